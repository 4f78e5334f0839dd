"""Spec records returned by registration hooks.

They hold lazy ``"module:Class"`` qualnames and static capabilities only, so an
entry-point module can build them without importing torch; the core imports the
class behind a spec only once it has chosen it (:func:`resolve_qualname`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def resolve_qualname(qualname: str) -> Any:
    """Import ``"package.module:Attr.attr"`` and return the object it names."""
    module_name, _, attr_path = qualname.partition(":")
    if not attr_path:
        raise ValueError(f"qualname {qualname!r} must look like 'module:Attr'")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class PlatformSpec:
    """A platform this machine has; the highest ``priority`` wins."""

    name: str
    qualname: str
    priority: int = 0
    device_type: str = "cpu"


@dataclass(frozen=True)
class AttentionBackendSpec:
    """An attention backend and what it can run."""

    name: str
    qualname: str
    device_types: tuple[str, ...] = ("cpu",)
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    head_sizes: tuple[int, ...] | None = None  # None: any head size
    supports_sliding_window: bool = True
    priority: int = 0
    # tanh soft-capping of the attention scores (Gemma 2): off unless a backend says it has it
    supports_logits_soft_cap: bool = False
    # Where it runs beyond the device type: the platform names (None: any platform with one of
    # ``device_types``; ROCm's device type is "cuda" too) and the NVIDIA compute capability range
    # (None: no bound; a bound excludes a device that reports none).
    platforms: tuple[str, ...] | None = None
    min_compute_capability: tuple[int, int] | None = None
    max_compute_capability: tuple[int, int] | None = None
    # KV-cache dtypes besides the model's own ("auto"), e.g. "fp8_e4m3"
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    # the KV-cache block size must be a multiple of this (FlashAttention 2's paged path: 256)
    block_size_multiple: int = 1

    def supports(self, device_type: str, dtype: str, head_size: int, sliding_window: bool,
                 logits_soft_cap: bool = False) -> bool:
        return (
            device_type in self.device_types
            and dtype in self.dtypes
            and (self.head_sizes is None or head_size in self.head_sizes)
            and (self.supports_sliding_window or not sliding_window)
            and (self.supports_logits_soft_cap or not logits_soft_cap)
        )


@dataclass(frozen=True)
class ModelSpec:
    """A model class for one architecture name of ``config.json``.

    ``is_generative``: the model samples tokens (the ``generate`` runner); False for an
    encoder (BERT), which the ``pooling`` runner prefills once, bidirectionally, and
    pools: its prompts are never chunked and it needs no KV cache. ``supports_pooling``:
    embedding requests are allowed (a decoder pools its last or mean hidden state).
    ``default_pooling``: "last", "mean" or "cls", used when neither the request nor the
    model folder's sentence-transformers files say. ``capabilities`` may hold
    ``"classify"``: the model's ``compute_pooled`` head turns the pooled state into class
    logits (a cross-encoder); ``"embed"``: its pooled state is an embedding.
    ``max_positions``: how many positions a sequence may use, from the HF config, for a model
    whose position table holds more rows than that (RoBERTa's first rows sit below its padding
    id: ``max_position_embeddings - pad_token_id - 1``); None: ``max_position_embeddings``.
    A plain function, so the entry-point module still imports no torch.
    ``mm_processor``: for a ``"multimodal"`` model, the ``"module:Class"`` of its own input
    processor (called ``(folder, hf_config, limits)``, with the interface of
    ``tokenmill.multimodal.processor.MultiModalProcessor``) where the model folder's
    ``AutoProcessor`` does not serve (Qwen2-VL's needs torchvision); None: that one.
    """

    qualname: str
    is_generative: bool = True
    supports_pooling: bool = True
    capabilities: frozenset[str] = field(default_factory=frozenset)
    default_pooling: str = "last"
    max_positions: Callable[[Any], int] | None = None
    mm_processor: str | None = None


@dataclass(frozen=True)
class QuantMethodSpec:
    """A quantization method or quantized checkpoint format.

    ``qualname`` names its :class:`tokenmill.layers.QuantizationConfig` subclass;
    ``checkpoint_aliases`` are the names a checkpoint's ``quantization_config``
    may use; ``file_suffixes`` are single-file formats (``.gguf``) whose
    ``loader_qualname`` turns the file into a config, tokenizer and weights.
    ``devices`` (platform device types, e.g. ``("cuda",)``) and ``dtypes`` (activation
    dtypes, e.g. ``("float16", "bfloat16")``) say where the method runs; empty: anywhere.
    A model is refused at load on a device its method does not list.
    """

    name: str
    qualname: str
    checkpoint_aliases: tuple[str, ...] = ()
    file_suffixes: tuple[str, ...] = ()
    loader_qualname: str | None = None
    devices: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()


@dataclass(frozen=True)
class SpecDecodeSpec:
    """A speculative-decoding proposer (``tokenmill_register_spec_decode_methods``): its
    name in ``speculative_config``, the ``"module:Class"`` of its :class:`Proposer`, and
    whether the config must name a draft model. ``checks_draft_positions``: whether that
    model's ``max_position_embeddings`` must cover ``max_model_len`` (a draft model's; an
    EAGLE head builds its rotary table for the engine's context, and the published heads
    declare fewer positions than their targets)."""

    name: str
    proposer_qualname: str
    needs_draft_model: bool = False
    checks_draft_positions: bool = True


@dataclass(frozen=True)
class KVConnectorSpec:
    """A KV connector (``tokenmill_register_kv_connectors``): its name in ``kv_transfer_config``,
    and the ``"module:Class"`` of its two halves: one runs next to the scheduler
    (:class:`KVConnectorScheduler`), one in each worker (:class:`KVConnectorWorker`).
    ``tensor_parallel``: its worker half moves its own rank's KV heads (``KVConnectorContext.rank``),
    so it may run with ``tensor_parallel_size > 1``; without it such an engine refuses to start."""

    name: str
    scheduler_qualname: str
    worker_qualname: str
    tensor_parallel: bool = False


@dataclass(frozen=True)
class OptionSpec:
    """A namespaced option a plugin adds to the CLI and ``LLM(...)`` (``tokenmill_add_options``).

    Its value lives in ``EngineConfig.plugin_options["<plugin>.<name>"]``, validated as ``type``
    (by pydantic: ``int``, ``float``, ``str``, ``bool``, or a dict/list/model type read as JSON on
    the command line); ``default`` is used when nobody sets it, ``help`` is the option's help text.
    """

    name: str
    type: type = str
    default: Any = None
    help: str = ""
