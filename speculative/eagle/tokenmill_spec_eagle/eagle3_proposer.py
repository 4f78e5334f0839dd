"""EAGLE-3 drafting: :class:`~tokenmill_spec_eagle.proposer.EagleProposer`'s bookkeeping (head
KV per request, catch-up over the target's new positions, ``k`` draft steps) with the EAGLE-3
head (:mod:`tokenmill_spec_eagle.eagle3_head`): the target hands three of its layers' hidden
states (``target_layer_ids``, which the runner asks the target model to record), ``fc`` folds
them into one as they arrive, and drafts come from the head's own lm_head over its draft
vocabulary, mapped to target tokens by ``d2t``.

The layers are the head config's ``eagle_config.eagle_aux_hidden_state_layer_ids`` where it
names them, else ``(2, L // 2, L - 3)`` of the target's ``L`` layers (the layers the published
heads were trained on); layer ``i`` is the residual stream entering the target's layer ``i``.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.plugin_api import ProposerContext, SpeculativeConfig
from tokenmill_spec_eagle.checkpoint import (
    EAGLE3_LAYOUT,
    check_shapes,
    load_head,
    read_head,
    trained_for_another_target,
)
from tokenmill_spec_eagle.eagle3_head import Eagle3Head
from tokenmill_spec_eagle.proposer import EagleProposer


class Eagle3Proposer(EagleProposer):
    def _load_head(self, config: SpeculativeConfig, context: ProposerContext) -> torch.nn.Module:
        """The EAGLE-3 head of ``config.model``, checked against the target, on the CPU; sets
        ``target_layer_ids``."""
        path = str(config.model)
        head_config, weights = read_head(path, EAGLE3_LAYOUT)
        target_hidden = int(self.embed.weight.shape[-1])
        own_embedding = "embed_tokens.weight" in weights
        trained_for = int(getattr(head_config, "target_hidden_size", None) or head_config.hidden_size)
        if trained_for != target_hidden or (not own_embedding and head_config.hidden_size != target_hidden):
            raise trained_for_another_target(path, EAGLE3_LAYOUT, head_config.hidden_size, target_hidden)
        self.target_layer_ids = _target_layer_ids(head_config, self.target)
        draft_vocab = int(getattr(head_config, "draft_vocab_size", None) or head_config.vocab_size)
        if "d2t" not in weights:
            if draft_vocab != self.vocab_size:
                raise ValueError(f"the EAGLE-3 head {path} has a draft vocabulary of {draft_vocab} tokens and no "
                                 f"'d2t' tensor mapping them to the target's {self.vocab_size}")
            weights["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)  # the target's vocabulary itself
        hidden, fc_input = head_config.hidden_size, len(self.target_layer_ids) * target_hidden
        check_shapes(path, EAGLE3_LAYOUT, weights,
                     {"fc.weight": (hidden, fc_input), "lm_head.weight": (draft_vocab, hidden), "d2t": (draft_vocab,)})
        _check_mapping(path, weights["d2t"], self.vocab_size)
        weights["d2t"] = weights["d2t"].long()
        return load_head(lambda: Eagle3Head(head_config, fc_input, draft_vocab, context.max_model_len + self.k,
                                            own_embedding), weights, path, EAGLE3_LAYOUT)

    def _head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """``fc`` over the target's three layers' states (``[n, 3 * H]`` -> ``[n, H]``)."""
        with torch.inference_mode():
            return self.head.fc(hidden.to(self.dtype))  # type: ignore[no-any-return]

    def _draft_tokens(self, hidden: torch.Tensor) -> list[int]:
        return [int(t) for t in self.head.draft_tokens(hidden).tolist()]

    def _draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits over its draft vocabulary, placed at their target tokens (``d2t``);
        the target tokens outside it are impossible drafts (-inf)."""
        draft = self.head.lm_head(self.head.norm(hidden)).float()
        d2t = self.head.d2t
        logits = torch.full((len(hidden), self.vocab_size), float("-inf"), device=draft.device)
        logits[:, torch.arange(len(d2t), device=d2t.device) + d2t] = draft
        return logits

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        own = self.head.embed_tokens
        return own(token_ids) if own is not None else self.embed(token_ids)  # type: ignore[no-any-return]


def _target_layer_ids(head_config: Any, target: Any) -> tuple[int, ...]:
    named = (getattr(head_config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    if named:
        return tuple(int(i) for i in named)
    num_layers = int(target.config.num_hidden_layers)
    return (2, num_layers // 2, num_layers - 3)


def _check_mapping(path: str, d2t: torch.Tensor, vocab_size: int) -> None:
    targets = torch.arange(len(d2t)) + d2t.long()
    if len(targets) and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise ValueError(f"the EAGLE-3 head {path} maps draft tokens outside the target's vocabulary of "
                         f"{vocab_size} (d2t)")
