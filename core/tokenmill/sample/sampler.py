"""The sampler: from one step's logits to one token (and optional logprobs) per row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.sample.bias import apply_logit_bias, apply_min_tokens
from tokenmill.sample.logprobs import (
    LogprobsTensors,
    compute_logprobs,
    compute_prompt_logprobs,
    gather_logprobs,
)
from tokenmill.sample.metadata import GREEDY_EPS, SamplingMetadata, pad_token_ids
from tokenmill.sample.ops import greedy_sample, random_sample
from tokenmill.sample.penalties import apply_penalties

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "compute_prompt_logprobs"]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler(torch.nn.Module):
    """Samples one token per row of ``logits`` ``[B, V]``.

    Order: raw logprobs; logit bias, min-tokens, penalties (seen by greedy
    and random rows alike); then greedy argmax, or temperature, min-p,
    top-k, top-p and the random draw; finally the logprobs gather.
    """

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if metadata.argmax_only:  # what the general path below comes to, without its checks
            return SamplerOutput(sampled_token_ids=greedy_sample(logits.float()), logprobs=None)
        # vLLM's default "raw_logprobs": what the model said, before any
        # sampling parameter, so logprobs do not depend on e.g. temperature.
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = compute_logprobs(logits)

        # The caller's tensor is left as it was. Logit bias and min-tokens edit in
        # place, so they get our own copy; the plain path's first edit (temperature)
        # writes a new tensor anyway, which saves a [B, V] copy per step.
        logits = logits.float()
        if metadata.min_tokens or any(metadata.logit_bias):
            logits = logits.clone()
        logits = self.apply_logits_processors(logits, metadata)
        sampled = self.sample(logits, metadata)

        logprobs = None
        if raw_logprobs is not None and metadata.max_num_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Edits that change which token is best, so greedy rows see them too."""
        logits = apply_logit_bias(logits, metadata.logit_bias)
        if metadata.min_tokens:
            logits = apply_min_tokens(logits, metadata.min_tokens, metadata.output_token_ids)
        if not metadata.no_penalties:
            output_ids = pad_token_ids(metadata.output_token_ids, logits.shape[-1], logits.device)
            logits = apply_penalties(
                logits,
                metadata.prompt_token_ids,
                output_ids,
                metadata.presence_penalties,
                metadata.frequency_penalties,
                metadata.repetition_penalties,
            )
        return logits

    @staticmethod
    def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """One token per row: argmax for greedy rows, a random draw for the others."""
        greedy = None
        if not metadata.all_random:
            # Taken before temperature and truncation, which the random path
            # applies in place and which cannot change a row's argmax anyway.
            greedy = greedy_sample(logits)
            if metadata.all_greedy:
                return greedy

        sampled = random_sample(
            logits,
            metadata.temperature,
            metadata.min_p,
            metadata.top_k,
            metadata.top_p,
            metadata.generators,
        )
        if greedy is None:
            return sampled
        return torch.where(metadata.temperature < GREEDY_EPS, greedy, sampled)
