"""Structured outputs: constrain generation to a JSON schema, a regex, a list of
choices or an EBNF grammar.

Only the parameters are imported here: the backends (xgrammar, ...) load on the
first constrained request, so ``import tokenmill`` stays cheap.
"""

from tokenmill.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
