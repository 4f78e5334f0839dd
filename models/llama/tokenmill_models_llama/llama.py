"""The Llama decoder and the family members that differ from it in a flag.

Qwen2 adds a bias to the q/k/v projections; Qwen3 normalises each head of q
and k; Mistral is Llama with a sliding window, which the config carries; Phi-3
stores q/k/v and gate/up fused in its checkpoint and may use LongRoPE.
q/k/v and gate/up are each merged into one matmul; ``load_weights`` maps the
checkpoint's separate tensors into their shards. Under tensor parallelism (the build
context's ``world_size``) q/k/v and gate/up are column-parallel (heads and the MLP's
columns divided among the ranks; K/V heads replicated when fewer than the ranks),
o_proj and down_proj row-parallel, the embedding and the lm_head split by vocabulary. Under pipeline
parallelism (the context's ``pipeline`` stage) each stage builds its share of the decoder layers, the
first the embedding, the last the norm and lm_head; hidden state and residual travel between stages
together. Every module is built from the
model's build context, so each linear layer knows its checkpoint prefix
(``model.layers.3.self_attn.qkv_proj``) and takes its method from the quant config.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import (
    AuxHiddenStateRecorder,
    Linear,
    MergedLinear,
    ModelBuildContext,
    ParallelLMHead,
    RMSNorm,
    RotarySelfAttention,
    UnquantizedLinearMethod,
    VocabEmbedding,
    attention_head_size,
    get_rotary_embedding,
    layer_ops,
    left_out_prefixes,
    load_into_merged,
    make_layers,
    on_stage,
)
from tokenmill.plugin_api import AttentionMetadata

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class LlamaAttention(RotarySelfAttention):
    """Llama's attention: the shared rotary GQA block (q/k/v biases for Qwen2, q/k norms for Qwen3)."""


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, ctx: ModelBuildContext) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias,
                                         ctx=ctx.child("gate_up_proj"), parallel="column")
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias, ctx=ctx.child("down_proj"),
                                parallel="row")
        self.is_silu = config.hidden_act == "silu"
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.is_silu:  # the common case has a fused op
            return self.down_proj(layer_ops(gate_up.device).silu_and_mul(gate_up))
        gate, up = self.gate_up_proj.split(gate_up)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_index: int, ctx: ModelBuildContext, flags: dict[str, bool]) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_index, ctx.child("self_attn"), **flags)
        self.mlp = LlamaMLP(config, ctx.child("mlp"))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm residual block, with the residual stream carried separately so each
        add fuses with the norm that follows it: returns (MLP output, residual)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        hidden = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, ctx: ModelBuildContext, flags: dict[str, bool]) -> None:
        super().__init__()
        self.stage = stage = ctx.pipeline
        self.hidden_size = config.hidden_size
        self.dtype = ctx.params_dtype
        self.embed_tokens = on_stage(stage.is_first, lambda: VocabEmbedding(
            config.vocab_size, config.hidden_size, ctx=ctx.child("embed_tokens"), parallel=True))
        self.layers = make_layers(config.num_hidden_layers, stage,
                                  lambda i: LlamaDecoderLayer(config, i, ctx.child(f"layers.{i}"), flags))
        self.stage_layers = stage.layer_range(config.num_hidden_layers)
        self.norm = on_stage(stage.is_last, lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.aux_hidden_states = AuxHiddenStateRecorder(config.num_hidden_layers)  # for EAGLE-3

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``inputs_embeds``: the tokens' embeddings, made by a multimodal model that wraps
        this one (images in place of some tokens); None: embed ``input_ids``."""
        residual: torch.Tensor | None
        if self.stage.is_first:
            hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            hidden, residual = self.stage.receive(2, (input_ids.shape[0], self.hidden_size), self.dtype,
                                                  input_ids.device)
        for i in self.stage_layers:
            self.aux_hidden_states.before_layer(i, hidden, residual)
            hidden, residual = self.layers[i](positions, hidden, residual, metadata)
        self.aux_hidden_states.before_norm(hidden, residual)
        if not self.stage.is_last:
            assert residual is not None  # every stage holds a layer
            self.stage.send(hidden, residual)
            return hidden  # what the next stage continues from; this stage computes no logits
        if residual is None:  # a model without layers
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)


class LlamaForCausalLM(nn.Module):
    """Llama, and Mistral (same weights; the sliding window comes from the config).

    Built as ``LlamaForCausalLM(hf_config, ctx=ctx)``; ``ctx.prefix`` is "" for a
    whole model (the checkpoint's names start at ``model.`` and ``lm_head``).
    """

    qkv_bias: ClassVar[bool | None] = None  # None: the config's ``attention_bias``
    o_bias: ClassVar[bool | None] = None
    qk_norm: ClassVar[bool] = False
    supports_pipeline_parallel: ClassVar[bool] = True  # builds by stage (tokenmill.layers.pipeline)
    # merged layer -> the checkpoint modules of its output slices (for LoRA adapters, which name the latter)
    packed_modules: ClassVar[dict[str, list[str]]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                                      "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, config: Any, *, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.config = config
        attention_bias = bool(getattr(config, "attention_bias", False))
        flags = {
            "qkv_bias": attention_bias if self.qkv_bias is None else self.qkv_bias,
            "o_bias": attention_bias if self.o_bias is None else self.o_bias,
            "qk_norm": self.qk_norm,
        }
        self.model = LlamaModel(config, ctx.child("model"), flags)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # A tied lm_head multiplies by the embedding table itself (the same rows of it on
        # each rank), in the table's form: float, or the embedding method's. On a last pipeline
        # stage that is not also the first, the embedding is not there: the head loads its table (float).
        stage = ctx.pipeline
        shares_table = self.tie_word_embeddings and stage.is_first and stage.is_last
        self.lm_head_loads_embedding = self.tie_word_embeddings and stage.is_last and not stage.is_first
        tied_method = (self.model.embed_tokens.tied_head_method() if shares_table
                       else UnquantizedLinearMethod() if self.lm_head_loads_embedding else None)
        self.lm_head = on_stage(stage.is_last, lambda: ParallelLMHead(
            config.hidden_size, config.vocab_size, ctx=ctx.child("lm_head"), quant_method=tied_method))
        if shares_table:
            self.model.embed_tokens.tie(self.lm_head)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the scheduled tokens (from ``inputs_embeds`` where
        a multimodal model gives them)."""
        return self.model(input_ids, positions, metadata, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def set_aux_hidden_state_layers(self, layer_ids: Sequence[int]) -> None:
        """Record, in every forward, the residual stream entering each of these layers (0: the
        embeddings; ``num_hidden_layers``: the last layer's output before the norm), for EAGLE-3
        (``tokenmill.worker.model_interface.AuxHiddenStatesCausalLM``)."""
        stage = self.model.stage
        if layer_ids and not (stage.is_first and stage.is_last):
            raise ValueError("intermediate hidden states are not recorded under pipeline parallelism")
        self.model.aux_hidden_states.set_layers(layer_ids, type(self).__name__)

    def take_aux_hidden_states(self) -> torch.Tensor | None:
        """The last forward's recorded states ``[T, len(layer_ids) * hidden]``, once."""
        return self.model.aux_hidden_states.take()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names) through each parameter's weight
        loader, q/k/v and gate/up as shards of their merged layer; returns the
        parameters loaded."""
        params = dict(self.named_parameters())
        other_stages = left_out_prefixes(self)  # under pipeline parallelism: tensors another stage loads
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name.startswith("lm_head.")):
                continue
            if self.lm_head_loads_embedding and name == "model.embed_tokens.weight":
                name = "lm_head.weight"
            if name.startswith(other_stages):
                continue
            loaded.add(load_into_merged(params, name, tensor, model_name=type(self).__name__))
        return loaded


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: Llama's layers, with q/k/v and gate/up each fused into one checkpoint tensor
    (``qkv_proj``, ``gate_up_proj``), cut back into their shards on load (so that tensor
    parallelism splits each one). A LongRoPE ("su") config rotates each request's tokens
    by its short or long frequencies (:mod:`tokenmill.layers.longrope`)."""

    qkv_bias = False
    o_bias = False

    def __init__(self, config: Any, *, ctx: ModelBuildContext) -> None:
        partial = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise ValueError(f"Phi-3 with partial_rotary_factor={partial} is not supported (only 1.0)")
        super().__init__(config, ctx=ctx)
        # the layers' shared table: it says which of its rows each token rotates by
        self.rotary = get_rotary_embedding(ctx, attention_head_size(config), config.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, self.rotary.rope_positions(positions, metadata), metadata, inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors, fused ones as the separate projections Llama loads."""
        config = self.config
        head = attention_head_size(config)
        q_size = config.num_attention_heads * head
        kv_size = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head
        for name, tensor in weights:
            module_path, _, leaf = name.rpartition(".")
            owner, _, proj = module_path.rpartition(".")
            if proj == "qkv_proj":
                parts = zip(("q_proj", "k_proj", "v_proj"), tensor.split([q_size, kv_size, kv_size]), strict=True)
            elif proj == "gate_up_proj":
                parts = zip(("gate_proj", "up_proj"), tensor.chunk(2), strict=True)
            else:
                yield name, tensor
                continue
            for part_name, part in parts:
                yield f"{owner}.{part_name}.{leaf}", part
