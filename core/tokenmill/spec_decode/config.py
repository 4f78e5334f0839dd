"""``speculative_config``: what proposes draft tokens, and how many per step (vLLM's names)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SpeculativeConfig(BaseModel):
    """One proposer and its options. ``method`` names a proposer registered through
    ``tokenmill_register_spec_decode_methods``; left out with a ``model`` given, it is
    ``"draft_model"``. Options the proposer reads beyond these are kept (``extra``) and
    handed to it untouched."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    method: str | None = Field(None, description="Proposer name (ngram, draft_model, ...)")
    model: str | None = Field(None, description="Draft model (or head) folder, for proposers that need one")
    num_speculative_tokens: int = Field(ge=1, description="Draft tokens proposed per request and step (k)")
    prompt_lookup_min: int = Field(1, ge=1, description="ngram: shortest suffix matched")
    prompt_lookup_max: int = Field(4, ge=1, description="ngram: longest suffix matched")
    min_acceptance_rate: float | None = Field(
        None, ge=0, le=1, description="A request whose last acceptance_window drafts were accepted less often than "
        "this is not drafted for during its next backoff_tokens tokens (0: never; default: the rate where drafting "
        "breaks even, estimated from the proposer's cost: spec_decode/cost.py)")
    acceptance_window: int = Field(32, ge=1, description="Draft tokens a request's acceptance is judged over")
    backoff_tokens: int = Field(32, ge=1, description="Tokens decoded without drafts after a low acceptance; "
                                "doubled after each further low judgement in a row, up to 16 times")
    disable_by_batch_size: int | None = Field(
        None, ge=1, description="No drafts while more requests than this run (a large batch is compute-bound: "
        "verifying drafts costs it nearly their full price; default: never)")

    @model_validator(mode="after")
    def _infer_method(self) -> SpeculativeConfig:
        if self.method is None:
            if self.model is None:
                raise ValueError("speculative_config needs a 'method' (e.g. 'ngram') or a draft 'model'")
            self.method = "draft_model"
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        return self

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @property
    def options(self) -> dict[str, Any]:
        """The proposer-specific options beyond the declared fields."""
        return dict(self.model_extra or {})
