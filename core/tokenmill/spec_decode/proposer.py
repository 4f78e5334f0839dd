"""The proposer protocol, and choosing one by name from the plugins' specs.

A proposer lives in the worker that samples (rank 0), next to the model runner. After each
step's sampling the runner hands it every request that sampled, with its tokens so far; it
returns up to ``k`` draft tokens per request. The scheduler schedules them with the next
step (``SchedulerOutput.scheduled_spec_decode_tokens``), where the target verifies them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill.plugins.specs import SpecDecodeSpec, resolve_qualname
from tokenmill.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    import numpy as np

    from tokenmill.plugins.manager import PluginManager


@dataclass
class DraftRequest:
    """One request to propose for: ``token_ids`` are its prompt and output so far (the token
    sampled this step last), a read-only view valid during the call. ``sampling_params``
    (its ``SamplingParams``) let a proposer draw drafts at the request's temperature."""

    req_id: str
    token_ids: np.ndarray
    num_drafts: int  # at most this many
    sampling_params: Any = None


@dataclass
class TargetHiddenStates:
    """The target's final hidden states (the lm_head's input) of one request's positions
    ``start .. start + len(hidden) - 1`` that a step computed and that hold: prompt tokens and
    the tokens the target accepted, never a rejected draft's. A view valid during the call.
    For a proposer that names ``target_layer_ids`` (EAGLE-3), ``hidden`` holds those layers'
    states instead, concatenated in its order: ``[n, len(target_layer_ids) * hidden_size]``."""

    req_id: str
    start: int
    hidden: Any  # torch.Tensor [n, hidden_size]


@dataclass
class ProposerContext:
    """What a proposer may need to build itself: the target's vocabulary and context length,
    where it runs, and the engine's plugins (a draft model is loaded through them)."""

    vocab_size: int
    max_model_len: int
    device: Any
    dtype: Any
    plugins: PluginManager | None = None
    platform: Any = None
    max_num_seqs: int = 64  # most requests one propose call gets
    block_size: int = 16
    engine_config: Any = None  # the target's EngineConfig (plugin options resolved), to derive a draft's from
    target_model: Any = None  # the target's model (its embedding and lm_head), for heads that share them


class Proposer(Protocol):
    """Built as ``cls(config, context)`` once per worker that samples.

    A proposer whose class sets ``uses_target_hidden_states = True`` (EAGLE) also has an
    ``observe(states: list[TargetHiddenStates])`` method, called after every step's
    sampling and before ``propose``, with the hidden states of every scheduled request
    (prefill chunks that do not sample included). One that also sets ``target_layer_ids``
    (a tuple of layer ids, an instance attribute set by the time it is built) gets the
    hidden states of those target layers instead of the final ones: the runner asks the
    target model for them (``AuxHiddenStatesCausalLM.set_aux_hidden_state_layers``; layer
    ``i`` is the residual stream entering decoder layer ``i``), and a target that cannot
    record them fails the start.

    A proposer that samples its drafts (rather than taking a point guess) also has a
    ``take_draft_probs() -> dict[str, torch.Tensor]`` method, called right after ``propose``:
    per request whose drafts were sampled, the distributions ``q`` ``[num_drafts, V]`` they
    were drawn from, row ``j`` the one of draft ``j``. The rejection sampler then accepts with
    ``min(1, p/q)``; a request left out is taken to have drafted with ``q`` one-hot on its draft
    (greedy drafts, n-gram lookup)."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Draft tokens per request, in order (an empty list: no guess)."""
        ...

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop any state kept for these finished or preempted requests."""
        ...


def spec_decode_methods(plugins: PluginManager) -> dict[str, SpecDecodeSpec]:
    """Every registered proposer by name; two plugins claiming one name is an error naming both."""
    named = plugins.collect_named("tokenmill_register_spec_decode_methods")
    return {name: spec for name, (_plugin, spec) in named.items()}


def check_speculative_config(config: SpeculativeConfig, plugins: PluginManager, vocab_size: int,
                             max_model_len: int, tensor_parallel_size: int) -> SpecDecodeSpec:
    """The chosen method's spec, or a clear error at start: an unknown method, a method that
    needs a draft model given none, a draft whose vocabulary differs from the target's or
    whose context is shorter than ``max_model_len`` (where the method checks it), or a layout it
    does not support yet."""
    methods = spec_decode_methods(plugins)
    spec = methods.get(str(config.method))
    if spec is None:
        known = ", ".join(sorted(methods)) or "none installed"
        raise ValueError(f"unknown speculative decoding method {config.method!r} (known: {known})")
    if tensor_parallel_size > 1:
        raise ValueError("speculative decoding does not run under tensor parallelism yet")
    if spec.needs_draft_model:
        if config.model is None:
            raise ValueError(f"speculative method {spec.name!r} needs a draft 'model'")
        _check_draft(config.model, vocab_size, max_model_len, spec.checks_draft_positions)
    return spec


def _check_draft(path: str, vocab_size: int, max_model_len: int, checks_positions: bool = True) -> None:
    from transformers import AutoConfig

    draft = AutoConfig.from_pretrained(path)
    draft_vocab = int(getattr(draft, "vocab_size", -1))
    if draft_vocab != vocab_size:
        raise ValueError(f"the draft model {path} has a vocabulary of {draft_vocab} tokens, the target "
                         f"{vocab_size}: a draft must share the target's tokenizer")
    positions = getattr(draft, "max_position_embeddings", None)
    if checks_positions and positions is not None and int(positions) < max_model_len:
        raise ValueError(f"the draft model {path} has {positions} positions, fewer than max_model_len="
                         f"{max_model_len}; lower max_model_len")


def build_proposer(config: SpeculativeConfig, plugins: PluginManager, context: ProposerContext) -> Proposer:
    spec = spec_decode_methods(plugins)[str(config.method)]
    cls = resolve_qualname(spec.proposer_qualname)
    return cls(config, context)  # type: ignore[no-any-return]
