"""The mixture-of-experts layer every MoE model uses: router logits in, hidden states out.

``FusedMoE`` holds all experts' weights stacked, as transformers 5 does:
``gate_up_proj`` ``[E, 2*I, H]`` (each expert's gate rows, then its up rows) and
``down_proj`` ``[E, H, I]``. Checkpoints store them per expert
(``experts.3.w1.weight`` / ``experts.3.gate_proj.weight``, ...) or already stacked
(``experts.gate_up_proj``); :meth:`FusedMoE.load_checkpoint_tensor` takes either,
through the parameters' expert-aware weight loader (:class:`ExpertShardLoader`), and
:meth:`FusedMoE.missing_checkpoint_tensors` names any expert tensor that never came.

Routing (:mod:`tokenmill.layers.moe_routing`) picks each token's experts; the layer's
method (a quant-method slot, as for the linear layers: the quantization config's
``get_moe_method``, float by default) runs the experts through the platform's
``fused_moe`` layer op. Under tensor parallelism every expert is split by its
intermediate dimension (each rank holds ``I / world_size`` gate, up and down columns
of every expert), and the ranks' partial outputs are summed by an all-reduce. With expert
parallelism (``ModelBuildContext.expert_parallel``) each rank instead holds whole experts
(:class:`~tokenmill.layers.expert_parallel.ExpertPlacement`), runs the token-expert pairs of
those, and the same all-reduce combines them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Literal, Protocol, cast

import torch
from torch import nn

from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.expert_parallel import ExpertPlacement
from tokenmill.layers.expert_replicas import ReplicatedExperts
from tokenmill.layers.moe_routing import MoERouting, select_experts
from tokenmill.layers.ops import layer_ops

Projection = Literal["gate", "up", "down"]
# How checkpoints name each expert's projections.
EXPERT_NAMES: dict[str, Projection] = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate",
                                       "up_proj": "up", "down_proj": "down"}
# ``3.w1.weight``; a quantized checkpoint's other leaves (``3.w1.qweight``) load into the
# method's ``{stack}_{leaf}`` parameter (``gate_up_proj_qweight``)
_PER_EXPERT = re.compile(r"^(\d+)\.(\w+)\.(\w+)$")
# a whole checkpoint name: the layer's prefix, then the per-expert part
_PREFIXED_PER_EXPERT = re.compile(r"^(.+)\.(\d+\.\w+\.\w+)$")


class FusedMoEMethod(Protocol):
    """How a MoE layer's expert weights are stored and run. ``create_weights`` registers
    them on ``layer`` (:meth:`FusedMoE.add_parameter`); an optional
    ``process_weights_after_loading(layer)`` is called once all are loaded."""

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,
                       intermediate_size_per_rank: int, params_dtype: torch.dtype) -> None: ...

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor: ...


class UnquantizedFusedMoEMethod:
    """Plain stacked weights, run by the platform's ``fused_moe`` op."""

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,
                       intermediate_size_per_rank: int, params_dtype: torch.dtype) -> None:
        inter = intermediate_size_per_rank
        layer.add_parameter("gate_up_proj", torch.empty(num_experts, 2 * inter, hidden_size, dtype=params_dtype),
                            layout="gate_up")
        layer.add_parameter("down_proj", torch.empty(num_experts, hidden_size, inter, dtype=params_dtype),
                            layout="down")
        layer.register_buffer("prepared_experts", None, persistent=False)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Once, after loading: the platform's prepared (packed) copy of the experts, where it has
        an optional ``prepare_moe_experts`` op (the CPU platform's kernel packs them into the panels
        it streams), for a layer that holds its experts whole (not under expert parallelism). Its
        ``routed_fused_moe`` op reads it (softmax top-k routing in the same call), and so does its
        optional ``prepared_fused_moe`` op for any other routing (DeepSeek's grouped, biased or
        scaled top-k, chosen by ``select_experts``)."""
        w13, w2 = cast(torch.Tensor, layer.gate_up_proj), cast(torch.Tensor, layer.down_proj)
        prepare = getattr(layer_ops(w13.device), "prepare_moe_experts", None)
        if prepare is not None and not layer.placement.is_partial:
            setattr(layer, "prepared_experts", prepare(w13, w2))  # noqa: B010 (a buffer)

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        ops = layer_ops(x.device)
        w13, w2 = cast(torch.Tensor, layer.gate_up_proj), cast(torch.Tensor, layer.down_proj)
        prepared = getattr(layer, "prepared_experts", None)
        run_prepared = getattr(ops, "prepared_fused_moe", None)
        if prepared is not None and run_prepared is not None:
            out = run_prepared(x, w13, w2, topk_weights, topk_ids, prepared)
            if out is not None:  # (None: the op declined these tensors)
                return cast(torch.Tensor, out)
        return ops.fused_moe(x, w13, w2, topk_weights, topk_ids)


@dataclasses.dataclass(frozen=True)
class ExpertShardLoader:
    """The expert parameters' weight loader: ``loader(param, tensor, shard_id, expert_id=e)``.

    A stacked parameter's ``expert_layout`` says which it is: ``"gate_up"`` takes an
    expert's gate (``shard_id`` 0) or up (1) tensor ``[I, H]`` into rows
    ``[shard * I_rank, (shard + 1) * I_rank)`` of expert ``e``; ``"down"`` an expert's
    ``[H, I]``. Without ``expert_id`` the tensor is the whole stack (an already-fused
    checkpoint). Under tensor parallelism this rank's slice of the intermediate
    dimension is cut out first. Under expert parallelism the stack holds this rank's experts only:
    ``expert_id`` indexes that stack (global id ``expert_offset + expert_id``, as names and errors
    give it), and a whole stack's ``local_experts`` experts from ``expert_offset`` are cut out.
    Under expert-parallel load balancing the stack is the rank's slots: ``slot_experts`` gives
    the global id of each (an expert may fill several), and a whole stack's rows are picked by it.
    ``loaded`` records what came (by stack index), for the completeness check.
    """

    prefix: str
    intermediate_size: int  # this rank's
    rank: int = 0
    world_size: int = 1
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # as the checkpoint names them
    expert_offset: int = 0  # the global id of the stack's first expert
    local_experts: int | None = None  # experts in the stack, when fewer than the checkpoint's (None: all)
    slot_experts: tuple[int, ...] | None = None  # the global id at each stack index, when not a run (EPLB)
    loaded: set[tuple[int | None, str]] = dataclasses.field(default_factory=set, compare=False, repr=False)

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None,
                 expert_id: int | None = None) -> None:
        layout: str = param.expert_layout  # type: ignore[attr-defined]  # set by FusedMoE.add_parameter
        name = self.tensor_name(layout, shard_id, expert_id)
        part = loaded if expert_id is not None else self._own_experts(loaded)
        if layout == "gate_up":
            target, source = self._gate_up(param, part, shard_id, expert_id, name)
        else:
            target = param.data if expert_id is None else param.data[expert_id]
            source = self._rank_part(part, part.dim() - 1, part.shape[-1] if part.dim() else 0)
        if target.shape != source.shape:
            expert = "" if expert_id is None else f"expert {self.global_id(expert_id)} of "
            raise ValueError(f"{name}: checkpoint tensor of shape {tuple(loaded.shape)} does not fit {expert}"
                             f"{self.prefix}.{'gate_up_proj' if layout == 'gate_up' else 'down_proj'} "
                             f"(expects {tuple(target.shape)} on this rank)")
        target.copy_(source)
        self.loaded.add((expert_id, layout if shard_id is None else f"{layout}.{shard_id}"))

    def _gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None, expert_id: int | None,
                 name: str) -> tuple[torch.Tensor, torch.Tensor]:
        inter = self.intermediate_size
        if expert_id is None:  # the whole stack [E, 2*I_total, H]: this rank's gate rows, then its up rows
            if shard_id is not None or loaded.dim() != 3 or loaded.shape[1] % 2:
                raise ValueError(f"{name}: a stacked gate/up tensor is [experts, 2*intermediate, hidden], "
                                 f"not {tuple(loaded.shape)}")
            gate, up = loaded.chunk(2, dim=1)
            source = torch.cat([self._rank_part(gate, 1, gate.shape[1]), self._rank_part(up, 1, up.shape[1])], dim=1)
            return param.data, source
        if shard_id not in (0, 1):
            raise ValueError(f"{name}: the gate/up stack has shards 0 (gate) and 1 (up), not {shard_id}")
        target = param.data[expert_id].narrow(0, shard_id * inter, inter)
        return target, self._rank_part(loaded, 0, loaded.shape[0] if loaded.dim() else 0)

    def _own_experts(self, stack: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a whole checkpoint stack (a stack that is too short fails the shape check)."""
        if self.slot_experts is not None and stack.dim() and stack.shape[0] > max(self.slot_experts):
            return stack[torch.tensor(self.slot_experts, device=stack.device)]
        if self.local_experts is None or stack.dim() == 0 or stack.shape[0] < self.expert_offset + self.local_experts:
            return stack
        return stack.narrow(0, self.expert_offset, self.local_experts)

    def _rank_part(self, loaded: torch.Tensor, dim: int, total: int) -> torch.Tensor:
        if self.world_size == 1 or total % self.world_size:
            return loaded  # (a size that does not split fails the shape check)
        size = total // self.world_size
        return loaded.narrow(dim, self.rank * size, size)

    def global_id(self, expert_id: int) -> int:
        """The checkpoint's id of the expert at index ``expert_id`` of the stack."""
        return self.slot_experts[expert_id] if self.slot_experts is not None else self.expert_offset + expert_id

    def tensor_name(self, layout: str, shard_id: int | None, expert_id: int | None) -> str:
        """The checkpoint tensor a load is for, as the errors name it."""
        if expert_id is None:
            return f"{self.prefix}.{'gate_up_proj' if layout == 'gate_up' else 'down_proj'}"
        expert_id = self.global_id(expert_id)
        if layout == "down":
            return f"{self.prefix}.{expert_id}.{self.expert_names[2]}.weight"
        if shard_id in (0, 1):
            return f"{self.prefix}.{expert_id}.{self.expert_names[shard_id or 0]}.weight"
        return f"{self.prefix}.{expert_id} (shard {shard_id})"


class FusedMoE(nn.Module):
    """``num_experts`` SiLU-gated expert MLPs of ``intermediate_size`` (the whole size; a
    rank holds ``intermediate_size / world_size`` of it), ``routing``'s top-k of them
    per token. ``forward(hidden [T, H], router_logits [T, E])`` -> ``[T, H]``, summed
    over the ranks. ``reduce_results=False`` leaves the all-reduce to the caller (which
    can then add a shared expert's partial output first and reduce once).

    ``expert_names``: the checkpoint's names of an expert's (gate, up, down) tensors,
    used by the errors that name a missing one.

    Built with ``ctx.expert_parallel`` over several ranks, the layer holds ``placement``'s
    whole experts (``num_local_experts`` of the ``num_experts``, global ids from
    ``placement.first``) at the full intermediate size; ``forward``'s contract is unchanged.
    ``num_experts``, routing and the ``expert_load`` counters stay global. With
    ``ctx.redundant_experts`` set too (expert-parallel load balancing), ``placement`` is a
    :class:`~tokenmill.layers.expert_replicas.ReplicatedExperts`: the stack's rows are slots, an
    expert may fill several (on this rank or others), and the balancer moves experts between
    slots while serving (:mod:`tokenmill.eplb`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, routing: MoERouting, *,
                 ctx: ModelBuildContext | None = None, quant_method: FusedMoEMethod | None = None,
                 expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 reduce_results: bool = True) -> None:
        super().__init__()
        ctx = ctx if ctx is not None else ModelBuildContext(hf_config=None)
        if routing.top_k > num_experts:
            raise ValueError(f"num_experts_per_tok {routing.top_k} exceeds the {num_experts} experts")
        expert_parallel = ctx.expert_parallel and ctx.world_size > 1
        self.placement: ExpertPlacement | ReplicatedExperts
        if expert_parallel and ctx.redundant_experts is not None:
            self.placement = ReplicatedExperts.for_rank(num_experts, ctx.redundant_experts, ctx.rank, ctx.world_size)
        else:
            self.placement = (ExpertPlacement.for_rank(num_experts, ctx.rank, ctx.world_size) if expert_parallel
                              else ExpertPlacement(num_experts))
        split = 1 if expert_parallel else ctx.world_size  # ranks each expert's intermediate dimension splits over
        if intermediate_size % split:
            raise ValueError(f"{ctx.prefix}: an expert intermediate size of {intermediate_size} does not split "
                             f"over {ctx.world_size} ranks")
        self.num_experts = num_experts
        self.num_local_experts = self.placement.count
        self.hidden_size = hidden_size
        self.intermediate_size_per_rank = intermediate_size // split
        self.routing = routing
        self.prefix = ctx.prefix
        self.expert_names = expert_names
        self.comm = ctx.comm
        self.reduce_results = reduce_results
        first = self.placement.first if isinstance(self.placement, ExpertPlacement) else 0
        self.loader = ExpertShardLoader(ctx.prefix, self.intermediate_size_per_rank, 0 if expert_parallel else ctx.rank,
                                        split, expert_names, expert_offset=first,
                                        local_experts=self.placement.count if expert_parallel else None,
                                        slot_experts=_slot_experts(self.placement))
        self.register_parameter("e_score_correction_bias", None)
        if routing.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                        requires_grad=False)
        # tokens routed to each expert since the model was built (or last reset): one bincount a step
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.quant_method: FusedMoEMethod = quant_method or ctx.moe_method(self) or UnquantizedFusedMoEMethod()
        self.quant_method.create_weights(self, self.num_local_experts, hidden_size, self.intermediate_size_per_rank,
                                         ctx.params_dtype)

    def add_parameter(self, name: str, data: torch.Tensor, *, layout: str | None = None) -> nn.Parameter:
        """Register ``data`` as parameter ``name`` (no grad), loaded by the expert loader
        when ``layout`` is ``"gate_up"`` or ``"down"`` (its stacked layout; a method's
        per-expert scales use the same layouts), else copied whole."""
        param = nn.Parameter(data, requires_grad=False)
        param.expert_layout = layout  # type: ignore[attr-defined]  # read by the loader
        if layout is not None:
            param.weight_loader = self.loader  # type: ignore[attr-defined]
        self.register_parameter(name, param)
        return param

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        routed = self._route_and_run_in_one_op(hidden, router_logits)
        if routed is not None:
            return self.comm.all_reduce(routed) if self.reduce_results else routed
        weights, ids = select_experts(router_logits, self.routing, self.e_score_correction_bias)
        load = cast(torch.Tensor, self.expert_load)
        load += torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        if self.placement.is_partial:
            out = self._apply_held_experts(hidden, weights, ids)
        else:
            out = self.quant_method.apply(self, hidden, weights, ids)
        return self.comm.all_reduce(out) if self.reduce_results else out

    def routes_in_one_op(self) -> bool:
        """Whether this layer's routing and experts can run as one op of the platform's
        (``_route_and_run_in_one_op``): plain softmax top-k routing of experts held whole."""
        routing = self.routing
        return not (self.placement.is_partial or routing.scoring != "softmax" or routing.num_groups > 1
                    or routing.correction_bias or routing.scaling_factor != 1.0)

    def _route_and_run_in_one_op(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor | None:
        """Plain softmax top-k routing of plain experts held whole, as one op of the platform's
        where it has one (an optional ``routed_fused_moe`` layer op: the CPU platform's kernel,
        which its step graphs record, so that MoE decode steps replay; it counts
        ``expert_load`` too); None otherwise, or where that op declines the tensors."""
        routing = self.routing
        if type(self.quant_method) is not UnquantizedFusedMoEMethod or not self.routes_in_one_op():
            return None
        routed_fused_moe = getattr(layer_ops(hidden.device), "routed_fused_moe", None)
        if routed_fused_moe is None:
            return None
        prepared = getattr(self, "prepared_experts", None)
        if prepared is not None:
            return cast("torch.Tensor | None", routed_fused_moe(hidden, router_logits, self.gate_up_proj,
                                                                self.down_proj, routing.top_k, routing.renormalize,
                                                                self.expert_load, prepared=prepared))
        return cast("torch.Tensor | None", routed_fused_moe(hidden, router_logits, self.gate_up_proj, self.down_proj,
                                                            routing.top_k, routing.renormalize, self.expert_load))

    def _apply_held_experts(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: the token-expert pairs whose expert this rank holds, run by the
        method as one-expert rows (so any method's kernel serves), weighted and added back to
        their tokens; zeros for the tokens none of whose experts are here."""
        tokens, slots, local_ids = self.placement.local_pairs(ids)
        out = torch.zeros_like(hidden)
        if tokens.numel():
            rows = self.quant_method.apply(self, hidden[tokens], weights[tokens, slots].unsqueeze(1),
                                           local_ids.unsqueeze(1))
            out.index_add_(0, tokens, rows.to(out.dtype))
        return out

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> str:
        """Load the checkpoint tensor ``{prefix}.{name}``: ``3.w1.weight`` (per expert), or
        ``gate_up_proj`` / ``down_proj`` / ``e_score_correction_bias`` (stacked); returns the
        parameter's name within the layer. Raises KeyError for a name it has no place for."""
        match = _PER_EXPERT.match(name)
        if match is not None and match.group(2) in EXPERT_NAMES:
            expert, projection = int(match.group(1)), EXPERT_NAMES[match.group(2)]
            if not 0 <= expert < self.num_experts:
                raise KeyError(f"checkpoint tensor '{self.prefix}.{name}': this layer has {self.num_experts} experts")
            param_name = "down_proj" if projection == "down" else "gate_up_proj"
            if match.group(3) != "weight":
                param_name = f"{param_name}_{match.group(3)}"
            shard = None if projection == "down" else (0 if projection == "gate" else 1)
            param = getattr(self, param_name, None)
            if not isinstance(param, nn.Parameter) or getattr(param, "weight_loader", None) is None:
                raise KeyError(f"checkpoint tensor '{self.prefix}.{name}' has no per-expert parameter in the "
                               f"MoE layer (its method is {type(self.quant_method).__name__})")
            for slot in self.placement.local_slots(expert):  # (none: another rank's expert, that rank's to load)
                param.weight_loader(param, tensor, shard,  # type: ignore[attr-defined]  # checked above
                                    expert_id=slot)
            return param_name
        params = dict(self.named_parameters(recurse=False))
        if name not in params:
            raise KeyError(f"checkpoint tensor '{self.prefix}.{name}' has no parameter in the MoE layer")
        param = params[name]
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensor)
        elif param.shape != tensor.shape:
            raise ValueError(f"{self.prefix}.{name}: checkpoint tensor of shape {tuple(tensor.shape)} for a "
                             f"parameter of shape {tuple(param.shape)}")
        else:
            param.data.copy_(tensor)
        return name

    def holds_checkpoint_tensor(self, name: str) -> bool:
        """Whether the checkpoint tensor ``{prefix}.{name}`` has a place on this rank: False only
        for a per-expert tensor of an expert another rank holds (expert parallelism)."""
        match = _PER_EXPERT.match(name)
        return match is None or match.group(2) not in EXPERT_NAMES or self.placement.holds(int(match.group(1)))

    def missing_checkpoint_tensors(self) -> list[str]:
        """The per-expert checkpoint tensors of this rank's experts not loaded yet (none once a
        stacked one came); a method with tensors of its own (a quantized checkpoint's) answers
        for them."""
        method_check = getattr(self.quant_method, "missing_checkpoint_tensors", None)
        if method_check is not None:
            return cast(list[str], method_check(self))
        done = self.loader.loaded
        missing = []
        gate, up, down = self.expert_names
        for layout, names in (("gate_up", {0: gate, 1: up}), ("down", {None: down})):
            if (None, layout) in done:
                continue
            for local in range(self.num_local_experts):
                for shard, checkpoint_name in names.items():
                    key = layout if shard is None else f"{layout}.{shard}"
                    if (local, key) not in done:
                        missing.append(f"{self.prefix}.{self.placement.expert_at(local)}.{checkpoint_name}.weight")
        return missing


def check_experts_loaded(model: nn.Module) -> None:
    """Raise ValueError naming the first expert tensor of ``model`` that was never loaded
    (a stacked parameter filled expert by expert has no single name to miss)."""
    for module in model.modules():
        if isinstance(module, FusedMoE):
            missing = module.missing_checkpoint_tensors()
            if missing:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise ValueError(f"the checkpoint lacks expert tensor {missing[0]}{more}")


def held_checkpoint_tensors(model: nn.Module) -> Callable[[str], bool] | None:
    """Under expert parallelism, which checkpoint tensors this rank's ``model`` loads: a test of
    a checkpoint name that is False for the per-expert tensors of other ranks' experts, so the
    loader need not read them. None when every MoE layer holds all its experts."""
    layers = {module.prefix: module for module in model.modules()
              if isinstance(module, FusedMoE) and module.placement.is_partial}
    if not layers:
        return None

    def holds(name: str) -> bool:
        match = _PREFIXED_PER_EXPERT.match(name)
        layer = layers.get(match.group(1)) if match is not None else None
        return layer is None or layer.holds_checkpoint_tensor(cast(re.Match[str], match).group(2))

    return holds


def expert_load_by_layer(model: nn.Module, reset: bool = False) -> dict[str, list[int]]:
    """Tokens routed to each expert, per MoE layer of ``model`` (by checkpoint prefix),
    since it was built or last reset (``reset=True`` zeroes the counters after reading).
    A worker answers it through the executor's ``collective_rpc``."""
    loads = {}
    for module in model.modules():
        if isinstance(module, FusedMoE):
            counter = cast(torch.Tensor, module.expert_load)
            loads[module.prefix] = counter.tolist()
            if reset:
                counter.zero_()
    return loads


def load_imbalance(load: list[int]) -> float:
    """Max over mean tokens per expert (1.0: perfectly balanced; 0.0 before any token)."""
    total = sum(load)
    return max(load) * len(load) / total if total else 0.0


def _slot_experts(placement: ExpertPlacement | ReplicatedExperts) -> tuple[int, ...] | None:
    """The global id at each index of the layer's stack, where that is not one contiguous run."""
    return tuple(placement.local_experts) if isinstance(placement, ReplicatedExperts) else None
