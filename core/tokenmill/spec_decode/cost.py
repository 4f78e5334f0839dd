"""What a draft token costs, and so the acceptance rate below which drafting loses time.

Decode reads every weight once per step. A step that verifies ``k`` drafts still reads them
once, but each verified position adds its own rows to every projection, the lm_head and
attention: about ``VERIFY_TOKEN_COST`` of a plain step per draft (measured on the 100M model
with n-gram drafts, docs/benchmarks.md). Drafting them costs the proposer's own work: nothing
worth counting for a lookup (n-gram), ``k`` steps of the draft model or head, each reading its
weights once. So a step with ``k`` drafts of which ``a`` are accepted on average gives
``1 + a`` tokens in the time of ``1 + k * (c_draft + VERIFY_TOKEN_COST)`` plain steps: it
gains exactly while the acceptance rate ``a / k`` exceeds ``c_draft + VERIFY_TOKEN_COST``,
the break-even rate the off-switch (``scheduler/draft_backoff.py``) uses unless
``min_acceptance_rate`` is given.

``c_draft`` is the ratio of weights read per token, draft over target: an estimate that leaves
out each forward's fixed overhead (which makes a very small draft dearer than its weights say).
"""

from __future__ import annotations

import logging
from typing import Any

from tokenmill.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)

VERIFY_TOKEN_COST = 0.1  # of a plain decode step, per verified draft token


def weights_read_per_token(config: Any) -> float:
    """The weights one decode step of a decoder reads: its layers' projections and its lm_head
    (a draft vocabulary where the head has its own, EAGLE-3); the embedding is one row."""
    hidden = int(config.hidden_size)
    heads = int(getattr(config, "num_attention_heads", None) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    intermediate = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim  # q, o; k, v
    mlp = 3 * hidden * intermediate  # gate, up, down
    vocab = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
    return int(config.num_hidden_layers) * (attention + mlp) + vocab * hidden


def draft_token_cost(draft_config: Any, target_config: Any) -> float:
    """One draft token's drafting, in plain target decode steps."""
    return weights_read_per_token(draft_config) / weights_read_per_token(target_config)


def break_even_acceptance_rate(speculative: SpeculativeConfig, target_config: Any) -> float:
    """The acceptance rate below which ``speculative``'s drafts cost more than they give."""
    drafting = 0.0
    if speculative.model is not None:
        try:
            drafting = draft_token_cost(_text_config(speculative.model), target_config)
        except (OSError, ValueError, AttributeError, TypeError) as exc:  # not a config this estimate reads
            logger.warning("the cost of drafting with %s is unknown (%s): the off-switch counts only the "
                           "verification's", speculative.model, exc)
    return min(1.0, drafting + VERIFY_TOKEN_COST)


def _text_config(path: str) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config
