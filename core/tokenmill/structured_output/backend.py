"""The interface a structured-output backend implements (xgrammar is the default).

A backend is registered by name through
``tokenmill_register_structured_output_backends`` and chosen with
``EngineConfig.structured_outputs_backend``. The engine sees it through two
small objects: the backend itself (validate and compile, once per distinct
constraint) and one :class:`GrammarMatcher` per constrained request.

Token bitmasks are int32 and bit-packed: bit ``j`` of word ``i`` of a row is
token ``32 * i + j``; a set bit allows the token. That is xgrammar's layout,
and the sampler applies it without knowing which backend filled it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from tokenmill.structured_output.params import StructuredOutputsParams

CompiledGrammar = Any  # opaque: only the backend that made it looks inside


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance over ``token_ids``; on a token the grammar forbids, change nothing and return False."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative tokens)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (a CPU int32 tensor)."""

    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token accepted: the request is done."""


class StructuredOutputBackend(Protocol):
    """Built once per engine with the model's tokenizer; must be cheap to construct
    (heavy set-up belongs in the first ``compile``, which runs off the step loop)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None: ...

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise :class:`~tokenmill.errors.InvalidRequestError` (``param=params.param``) if the
        schema, regex or grammar is invalid or unsupported. Called in the submitting thread,
        so it must be fast and thread-safe."""

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile a validated constraint for this tokenizer. Runs in a worker thread."""

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return -(-vocab_size // 32)


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A ``[num_rows, bitmask_width]`` int32 bitmask with every token allowed."""
    return torch.full((num_rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)
