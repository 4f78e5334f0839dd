"""What the sampler needs to know about the rows of one step, as tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# The same threshold as ``SamplingParams.is_greedy``: one source of truth, so
# a request the scheduler thinks greedy is also sampled greedily here.
from tokenmill.sampling_params import _GREEDY_EPS as GREEDY_EPS
from tokenmill.sampling_params import SamplingParams

__all__ = ["GREEDY_EPS", "SamplingMetadata", "pad_token_ids"]


def pad_token_ids(
    rows: Sequence[Sequence[int]], pad_id: int, device: torch.device | str
) -> torch.Tensor:
    """A ``[len(rows), max_len]`` int64 tensor of ``rows``, right-padded with ``pad_id``.

    Padding with ``vocab_size`` lets the penalties count tokens with one
    scatter into ``vocab_size + 1`` bins and drop the last bin.
    """
    width = max((len(row) for row in rows), default=0)
    padded = [list(row) + [pad_id] * (width - len(row)) for row in rows]
    # Built on the host and moved once: one copy instead of one per row.
    return torch.tensor(padded, dtype=torch.int64).reshape(len(rows), width).to(device)


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs for the ``B`` rows being sampled.

    Optional tensors are ``None`` when no row needs them, so the sampler can
    skip a whole pass instead of running it with neutral values.
    """

    temperature: torch.Tensor  # [B] float32; < GREEDY_EPS means greedy
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [B] float32
    top_k: torch.Tensor | None  # [B] int64, 0 = off
    min_p: torch.Tensor | None  # [B] float32
    # row -> generator of a seeded request; it must live on the logits' device.
    generators: dict[int, torch.Generator]
    # None: no row wants logprobs; 0: only the sampled token's logprob.
    max_num_logprobs: int | None
    no_penalties: bool
    presence_penalties: torch.Tensor  # [B] float32
    frequency_penalties: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    # [B, max_prompt_len] int64 padded with vocab_size; None when no row uses
    # a repetition penalty (the only penalty that looks at the prompt).
    prompt_token_ids: torch.Tensor | None
    output_token_ids: list[list[int]]  # tokens generated so far, per row
    # row -> (min_tokens, stop ids incl. EOS): while the row has generated
    # fewer than min_tokens tokens, those ids are masked to -inf.
    min_tokens: dict[int, tuple[int, set[int]]]
    logit_bias: list[dict[int, float] | None]
    # Every row greedy, and nothing edits the logits or asks for logprobs: a row's token is its
    # argmax (the sampler's shortcut; set from the fields above, once per metadata, which
    # consecutive decode steps of the same requests share).
    argmax_only: bool = field(init=False)

    def __post_init__(self) -> None:
        self.argmax_only = (self.all_greedy and self.max_num_logprobs is None and self.no_penalties
                            and not self.min_tokens and not any(self.logit_bias))

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        generators: dict[int, torch.Generator],
        eos_token_ids: Sequence[int | None],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Build the metadata for one row per entry of ``params``."""
        num_rows = len(params)
        if not (len(output_token_ids) == len(prompt_token_ids) == len(eos_token_ids) == num_rows):
            raise ValueError("params, output_token_ids, prompt_token_ids and eos_token_ids must align")

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        greedy = [p.is_greedy for p in params]
        random_params = [p for p, g in zip(params, greedy, strict=True) if not g]
        # top-k/top-p/min-p only change random rows (greedy takes the argmax
        # anyway), so they are switched on only when a random row uses them.
        use_top_p = any(p.top_p < 1.0 for p in random_params)
        use_top_k = any(0 < p.top_k < vocab_size for p in random_params)
        use_min_p = any(p.min_p > 0.0 for p in random_params)

        use_repetition = any(p.repetition_penalty != 1.0 for p in params)
        no_penalties = not use_repetition and not any(
            p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params
        )

        requested = [p.logprobs for p in params if p.logprobs is not None]

        min_tokens: dict[int, tuple[int, set[int]]] = {}
        for row, (p, eos) in enumerate(zip(params, eos_token_ids, strict=True)):
            if p.min_tokens <= 0:
                continue
            stop_ids = set(p.stop_token_ids or [])
            # With ignore_eos the EOS does not stop the request, so it need
            # not be held back either.
            if eos is not None and not p.ignore_eos:
                stop_ids.add(eos)
            if stop_ids:
                min_tokens[row] = (p.min_tokens, stop_ids)

        return cls(
            temperature=floats([p.temperature for p in params]),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_p=floats([p.top_p for p in params]) if use_top_p else None,
            top_k=(
                torch.tensor(
                    # k >= vocab_size keeps everything: the same as off.
                    [p.top_k if p.top_k < vocab_size else 0 for p in params],
                    dtype=torch.int64,
                    device=device,
                )
                if use_top_k
                else None
            ),
            min_p=floats([p.min_p for p in params]) if use_min_p else None,
            generators=dict(generators),
            max_num_logprobs=max(requested) if requested else None,
            no_penalties=no_penalties,
            presence_penalties=floats([p.presence_penalty for p in params]),
            frequency_penalties=floats([p.frequency_penalty for p in params]),
            repetition_penalties=floats([p.repetition_penalty for p in params]),
            prompt_token_ids=(
                pad_token_ids(prompt_token_ids, vocab_size, device) if use_repetition else None
            ),
            output_token_ids=output_token_ids,
            min_tokens=min_tokens,
            logit_bias=[p.logit_bias or None for p in params],
        )
