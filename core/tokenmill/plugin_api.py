"""The public surface for plugins: every name a plugin may import, in one place.

A shipped plugin imports from exactly three modules of tokenmill (the test
``tests/test_plugin_api.py`` enforces it):

* ``tokenmill`` — the user API (``LLM``, ``SamplingParams``, ``EngineConfig``,
  ``StructuredOutputsParams``, the errors), as listed in its ``__all__``;
* ``tokenmill.plugin_api`` — this module: the hook marker, the spec records, the
  platform capabilities, the attention, checkpoint, sampling-kernel, structured
  output, tool-parser, reasoning-parser and executor interfaces, as listed in ``__all__`` below;
* ``tokenmill.layers`` — the building blocks models, quantization methods and
  platforms meet at: anything its ``__all__`` lists is public.

Everything else under ``tokenmill`` is internal and may change in any release;
the names here change only with ``PLUGIN_API_VERSION``. The names that need
torch load on first use, so an entry-point module can import the hook marker and
the spec records from here without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tokenmill.errors import InvalidRequestError, PluginError, UnsupportedModelError
from tokenmill.hookspecs import PLUGIN_API_VERSION, ExperimentalHookWarning, hookimpl
from tokenmill.plugins.specs import (
    AttentionBackendSpec,
    KVConnectorSpec,
    ModelSpec,
    OptionSpec,
    PlatformSpec,
    QuantMethodSpec,
    SpecDecodeSpec,
    resolve_qualname,
)

if TYPE_CHECKING:
    from tokenmill.attention import (
        AttentionBackend,
        AttentionMetadata,
        AttentionRequirements,
        KVCache,
        KVCacheKind,
        KVCacheSpec,
        latent_attention,
        write_latent,
    )
    from tokenmill.config import EngineConfig, parse_size
    from tokenmill.executor import Executor, UniProcExecutor
    from tokenmill.kv_cache.fp8 import (
        dequantize_kv,
        gather_blocks,
        is_fp8,
        kv_cache_torch_dtype,
        quantize_kv,
        write_kv,
    )
    from tokenmill.kv_transfer import (
        KVConnectorContext,
        KVConnectorOutput,
        KVConnectorScheduler,
        KVConnectorWorker,
        KVTransferConfig,
        KVTransferParams,
        ScheduledKVRequest,
    )
    from tokenmill.model_loader.checkpoint import Checkpoint, WeightsIterator
    from tokenmill.multimodal.inputs import MultiModalItem, content_hash
    from tokenmill.native_extension import (
        attached_extensions,
        import_built_extension,
        load_native_extension,
        native_headers,
        native_include_dir,
        optional_native_extension,
        publish_parallel_backend,
    )
    from tokenmill.platform import (
        ActivationProfiling,
        CommunicationBackend,
        DeviceAndMemory,
        DeviceKVAllocator,
        DevicePerRank,
        DtypeDefaults,
        GroupCommunicator,
        KernelFeatures,
        KVCacheAllocator,
        KVCachePrefault,
        Platform,
        StepGraph,
        StepGraphCapture,
        StepGraphUnsupported,
        ThreadAffine,
    )
    from tokenmill.plugins.manager import PluginManager, get_plugin_manager
    from tokenmill.processes import process_alive
    from tokenmill.reasoning import (
        ReasoningDelta,
        ReasoningParser,
        ReasoningSplit,
        ReasoningStreamer,
        as_structural_format,
    )
    from tokenmill.request import Request
    from tokenmill.sample.draft_sampler import (
        DraftSampler,
        SampledDrafts,
        draft_sampling_params,
        sample_drafts,
        samples_drafts,
    )
    from tokenmill.sample.kernels import SamplingKernels, register_sampling_kernels
    from tokenmill.sample.metadata import SamplingMetadata
    from tokenmill.scheduler.output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
    from tokenmill.spec_decode.config import SpeculativeConfig
    from tokenmill.spec_decode.proposer import DraftRequest, Proposer, ProposerContext, TargetHiddenStates
    from tokenmill.structured_output.backend import GrammarMatcher, StructuredOutputBackend
    from tokenmill.tool_parsers import (
        ExtractedToolCalls,
        FunctionTool,
        ToolCall,
        ToolCallDelta,
        ToolCallPiece,
        ToolCallStreamer,
        ToolParser,
    )
    from tokenmill.worker.host_memory import lazy_zeros
    from tokenmill.worker.spec import WorkerSpec
    from tokenmill.worker.worker import Worker

# name -> the internal module it is defined in, imported on first use
_LAZY = {
    **dict.fromkeys(["AttentionBackend", "AttentionMetadata", "AttentionRequirements", "KVCache", "KVCacheKind",
                     "KVCacheSpec", "latent_attention", "write_latent"],
                    "tokenmill.attention"),
    **dict.fromkeys(["EngineConfig", "parse_size"], "tokenmill.config"),
    **dict.fromkeys(["Executor", "UniProcExecutor"], "tokenmill.executor"),
    "WorkerSpec": "tokenmill.worker.spec",
    "Worker": "tokenmill.worker.worker",
    **dict.fromkeys(["Checkpoint", "WeightsIterator"], "tokenmill.model_loader.checkpoint"),
    **dict.fromkeys(["DeviceKVAllocator", "DevicePerRank", "KVCacheAllocator", "KVCachePrefault", "Platform", "StepGraph",
                     "StepGraphCapture", "StepGraphUnsupported", "ThreadAffine", "ActivationProfiling", "CommunicationBackend",
                     "DeviceAndMemory", "DtypeDefaults", "KernelFeatures", "GroupCommunicator"], "tokenmill.platform"),
    **dict.fromkeys(["PluginManager", "get_plugin_manager"], "tokenmill.plugins.manager"),
    **dict.fromkeys(["SamplingKernels", "register_sampling_kernels"], "tokenmill.sample.kernels"),
    **dict.fromkeys(["GrammarMatcher", "StructuredOutputBackend"], "tokenmill.structured_output.backend"),
    **dict.fromkeys(["ExtractedToolCalls", "FunctionTool", "ToolCall", "ToolCallDelta", "ToolCallPiece",
                     "ToolCallStreamer", "ToolParser"], "tokenmill.tool_parsers"),
    **dict.fromkeys(["ReasoningDelta", "ReasoningParser", "ReasoningSplit", "ReasoningStreamer",
                     "as_structural_format"], "tokenmill.reasoning"),
    "lazy_zeros": "tokenmill.worker.host_memory",
    **dict.fromkeys(["import_built_extension", "load_native_extension", "native_include_dir", "native_headers",
                     "publish_parallel_backend", "attached_extensions",
                     "optional_native_extension"], "tokenmill.native_extension"),
    "process_alive": "tokenmill.processes",
    "SpeculativeConfig": "tokenmill.spec_decode.config",
    **dict.fromkeys(["DraftSampler", "SampledDrafts", "draft_sampling_params", "sample_drafts", "samples_drafts"],
                    "tokenmill.sample.draft_sampler"),
    "SamplingMetadata": "tokenmill.sample.metadata",
    **dict.fromkeys(["CachedRequestData", "ModelRunnerOutput", "NewRequestData", "SchedulerOutput"],
                    "tokenmill.scheduler.output"),
    **dict.fromkeys(["DraftRequest", "Proposer", "ProposerContext", "TargetHiddenStates"],
                    "tokenmill.spec_decode.proposer"),
    **dict.fromkeys(["KVConnectorContext", "KVConnectorOutput", "KVConnectorScheduler", "KVConnectorWorker",
                     "KVTransferConfig", "KVTransferParams", "ScheduledKVRequest"], "tokenmill.kv_transfer"),
    "Request": "tokenmill.request",
    **dict.fromkeys(["MultiModalItem", "content_hash"], "tokenmill.multimodal.inputs"),
    **dict.fromkeys(["dequantize_kv", "gather_blocks", "is_fp8", "kv_cache_torch_dtype", "quantize_kv", "write_kv"],
                    "tokenmill.kv_cache.fp8"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenmill.plugin_api' has no attribute {name!r}")


__all__ = [
    # hooks and spec records (tokenmill.hookspecs, tokenmill.plugins.specs)
    "PLUGIN_API_VERSION",
    "AttentionBackendSpec",
    "ExperimentalHookWarning",
    "KVConnectorSpec",
    "ModelSpec",
    "OptionSpec",
    "PlatformSpec",
    "QuantMethodSpec",
    "SpecDecodeSpec",
    "hookimpl",
    "resolve_qualname",
    # errors a plugin raises
    "InvalidRequestError",
    "PluginError",
    "UnsupportedModelError",
    # configuration
    "EngineConfig",
    "parse_size",
    # platforms and their optional capabilities
    "ActivationProfiling",
    "CommunicationBackend",
    "DeviceAndMemory",
    "DeviceKVAllocator",
    "DevicePerRank",
    "DtypeDefaults",
    "GroupCommunicator",
    "KernelFeatures",
    "KVCacheAllocator",
    "KVCachePrefault",
    "Platform",
    "StepGraph",
    "StepGraphCapture",
    "StepGraphUnsupported",
    "ThreadAffine",
    "SamplingKernels",
    "register_sampling_kernels",
    "lazy_zeros",
    "import_built_extension",
    "load_native_extension",
    "native_include_dir",
    "native_headers",
    "publish_parallel_backend",
    "attached_extensions",
    "optional_native_extension",
    "process_alive",
    # attention backends
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionRequirements",
    "KVCache",
    "KVCacheKind",
    "KVCacheSpec",
    "latent_attention",
    "write_latent",
    # checkpoints (single-file formats)
    "Checkpoint",
    "WeightsIterator",
    # executors and the workers they run
    "Executor",
    "UniProcExecutor",
    "Worker",
    "WorkerSpec",
    # the step diffs a worker is driven with (by an executor, or a draft model's proposer)
    "CachedRequestData",
    "ModelRunnerOutput",
    "NewRequestData",
    "SchedulerOutput",
    # multimodal inputs: a model plugin's own processor (ModelSpec.mm_processor) makes these items
    "MultiModalItem",
    "content_hash",
    # structured-output backends
    "GrammarMatcher",
    "StructuredOutputBackend",
    # tool-call parsers
    "ExtractedToolCalls",
    "FunctionTool",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallPiece",
    "ToolCallStreamer",
    "ToolParser",
    # reasoning parsers
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningSplit",
    "ReasoningStreamer",
    "as_structural_format",
    # speculative-decoding proposers
    "DraftRequest",
    "Proposer",
    "ProposerContext",
    "SpeculativeConfig",
    "TargetHiddenStates",
    # a proposer that samples its drafts: the request's params as a draft sees them, the draft's q
    "DraftSampler",
    "SampledDrafts",
    "SamplingMetadata",
    "draft_sampling_params",
    "sample_drafts",
    "samples_drafts",
    # KV connectors (disaggregated prefill/decode, KV offload): the two halves' contract, what they
    # are built with and report, and the request as the scheduler half sees it (read-only)
    "KVConnectorContext",
    "KVConnectorOutput",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "KVTransferConfig",
    "KVTransferParams",
    "Request",
    "ScheduledKVRequest",
    # the process's plugin registry (to look up what other plugins registered)
    "PluginManager",
    "get_plugin_manager",
    # an fp8 KV cache: the rounding reference a backend stores and reads its blocks with
    "dequantize_kv",
    "gather_blocks",
    "is_fp8",
    "kv_cache_torch_dtype",
    "quantize_kv",
    "write_kv",
]
