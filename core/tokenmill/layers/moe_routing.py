"""Which experts each token goes to, and with what weight, from the router's logits.

Two scoring rules cover the common MoE families:

- ``softmax``: softmax over all experts, then the top-k (Mixtral renormalises the
  k weights to sum to one; Qwen2/Qwen3-MoE only when ``norm_topk_prob``);
- ``sigmoid``: DeepSeek-V3's independent sigmoid scores, chosen after adding a
  per-expert correction bias (which steers load without changing the weights), the
  experts split into ``num_groups`` groups of which only the ``top_groups`` best (by
  the sum of their two best biased scores) may be picked; the weights are the
  unbiased scores, renormalised, times ``scaling_factor``.

Grouped selection also applies to softmax scoring (DeepSeek-V2's
``group_limited_greedy``: a group is ranked by its best expert).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

Scoring = Literal["softmax", "sigmoid"]


@dataclasses.dataclass(frozen=True)
class MoERouting:
    top_k: int
    scoring: Scoring = "softmax"
    renormalize: bool = False
    num_groups: int = 1
    top_groups: int = 1
    scaling_factor: float = 1.0
    correction_bias: bool = False  # the layer holds an ``e_score_correction_bias`` [E]

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"num_experts_per_tok must be at least 1, not {self.top_k}")
        if self.num_groups < 1 or not 1 <= self.top_groups <= self.num_groups:
            raise ValueError(f"topk_group {self.top_groups} must be between 1 and n_group {self.num_groups}")

    @classmethod
    def from_hf_config(cls, config: Any, *, renormalize_default: bool = False) -> MoERouting:
        """The routing a Hugging Face config describes. A value the layer cannot route by
        raises ValueError naming the config field."""
        scoring = getattr(config, "scoring_func", None) or "softmax"
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported MoE routing: scoring_func={scoring!r} (supported: 'softmax', 'sigmoid')")
        method = getattr(config, "topk_method", None) or "greedy"
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"unsupported MoE routing: topk_method={method!r} "
                             "(supported: 'greedy', 'group_limited_greedy', 'noaux_tc')")
        grouped = method != "greedy"
        norm = getattr(config, "norm_topk_prob", None)
        return cls(
            top_k=int(config.num_experts_per_tok),
            scoring="sigmoid" if scoring == "sigmoid" else "softmax",
            renormalize=renormalize_default if norm is None else bool(norm),
            num_groups=int(getattr(config, "n_group", None) or 1) if grouped else 1,
            top_groups=int(getattr(config, "topk_group", None) or 1) if grouped else 1,
            scaling_factor=float(getattr(config, "routed_scaling_factor", None) or 1.0),
            correction_bias=method == "noaux_tc",
        )


def select_experts(router_logits: torch.Tensor, routing: MoERouting,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``([T, k] float32 weights, [T, k] int64 expert ids)`` for router logits ``[T, E]``,
    computed in float32 as the reference implementations do."""
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if routing.scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if routing.num_groups > 1:
        choice = _keep_top_groups(choice, routing)
    if correction_bias is None and routing.num_groups == 1:
        weights, ids = torch.topk(scores, routing.top_k, dim=-1)
    else:
        ids = torch.topk(choice, routing.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if routing.scoring == "sigmoid" else 0.0))
    if routing.scaling_factor != 1.0:
        weights = weights * routing.scaling_factor
    return weights, ids


def _keep_top_groups(choice: torch.Tensor, routing: MoERouting) -> torch.Tensor:
    """``choice`` with the experts outside each token's ``top_groups`` best groups set to
    -inf, so that none of them is picked."""
    tokens, experts = choice.shape
    if experts % routing.num_groups:
        raise ValueError(f"n_group {routing.num_groups} does not divide the {experts} experts")
    grouped = choice.view(tokens, routing.num_groups, -1)
    if routing.scoring == "sigmoid":  # DeepSeek-V3: a group's two best experts
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
    else:  # DeepSeek-V2: a group's best expert
        group_scores = grouped.amax(dim=-1)
    top = torch.topk(group_scores, routing.top_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)
