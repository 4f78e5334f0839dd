"""The ``ngram`` speculative-decoding method (prompt lookup): no model, drafts are the tokens
that followed the last occurrence of the context's final n tokens.

Importing this module imports neither numpy nor torch: the hook names the proposer by qualname.
"""

from tokenmill.plugin_api import SpecDecodeSpec, hookimpl

TOKENMILL_PLUGIN_API = 1


@hookimpl
def tokenmill_register_spec_decode_methods() -> list[SpecDecodeSpec]:
    return [SpecDecodeSpec("ngram", "tokenmill_spec_ngram.proposer:NgramProposer")]
