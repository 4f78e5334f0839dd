"""Sampling: turn one step's logits into tokens, honouring each request's SamplingParams."""

from tokenmill.sample.bias import apply_logit_bias, apply_min_tokens
from tokenmill.sample.grammar import apply_grammar_bitmask, apply_token_bitmask, bitmask_penalty
from tokenmill.sample.logprobs import (
    LogprobsLists,
    LogprobsTensors,
    compute_logprobs,
    compute_prompt_logprobs,
    gather_logprobs,
)
from tokenmill.sample.metadata import GREEDY_EPS, SamplingMetadata, pad_token_ids
from tokenmill.sample.ops import (
    apply_min_p,
    apply_temperature,
    apply_top_k_top_p,
    inverse_cdf_sample,
    random_sample,
)
from tokenmill.sample.penalties import apply_penalties, token_counts
from tokenmill.sample.sampler import Sampler, SamplerOutput

__all__ = [
    "GREEDY_EPS",
    "LogprobsLists",
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_grammar_bitmask",
    "apply_logit_bias",
    "apply_min_p",
    "apply_min_tokens",
    "apply_penalties",
    "apply_temperature",
    "apply_token_bitmask",
    "apply_top_k_top_p",
    "bitmask_penalty",
    "compute_logprobs",
    "compute_prompt_logprobs",
    "inverse_cdf_sample",
    "gather_logprobs",
    "pad_token_ids",
    "random_sample",
    "token_counts",
]
