"""User-facing engine configuration (pydantic, validated once at start-up)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tokenmill.eplb.config import EPLBConfig, check_eplb_options
from tokenmill.kv_transfer.config import KVTransferConfig
from tokenmill.multimodal.fetch import MediaFetchPolicy
from tokenmill.spec_decode.config import SpeculativeConfig

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
               "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


def parse_size(value: int | str) -> int:
    """``"4GiB"``, ``"512m"`` or a byte count -> bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a memory size: {value!r} (try '4GiB' or '512MiB')")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def cli(panel: str, *, metavar: str | None = None) -> dict[str, Any]:
    """A field's ``json_schema_extra``: the help panel its command-line option shows in and, for a
    field whose option takes text the field's validator reads (``--kv-cache-memory 2GiB``), the
    metavar that text is shown as. The CLI generates one option per field (``tokenmill_cli.engine_options``);
    a field without it shows in the "Engine" panel."""
    return {"cli_panel": panel, **({"cli_metavar": metavar} if metavar else {})}


_MODEL, _KV, _SCHED, _RUN, _PLUGINS = "Model", "KV cache", "Scheduler", "Execution", "Plugins"
_LORA = "LoRA"
_MM = "Multimodal"


class EngineConfig(BaseModel):
    """Everything the engine needs to start; the CLI and ``LLM(...)`` fill it.

    Each field is also a command-line option of ``tokenmill generate``, ``serve`` and
    ``bench throughput|latency`` (``max_num_seqs`` -> ``--max-num-seqs``): its type, default and
    ``description`` are the option's, and :func:`cli` names its help panel.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    model: str | None = Field(None, description="Hub id, local folder or .gguf file (default: SmolLM2-135M-Instruct)",
                              json_schema_extra=cli(_MODEL))
    tokenizer: str | None = Field(None, description="Tokenizer folder or hub id (default: the model's)",
                                  json_schema_extra=cli(_MODEL))
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of the model",
                                 json_schema_extra=cli(_MODEL))
    dtype: str = Field("auto", description="auto, float32, bfloat16 or float16", json_schema_extra=cli(_MODEL))
    max_model_len: int | None = Field(None, ge=1, description="Context length (default: the model's)",
                                      json_schema_extra=cli(_MODEL))
    runner: Literal["auto", "generate", "pooling"] = Field(
        "auto", description="generate (sample tokens) or pooling (embeddings, scores, classes); auto: from the "
                            "model's architecture", json_schema_extra=cli(_MODEL))
    task: Literal["auto", "generate", "embed", "classify", "score"] = Field(
        "auto", description="vLLM's older name for the runner: embed, classify and score run the pooling runner",
        json_schema_extra=cli(_MODEL))

    block_size: int = Field(16, ge=1, description="Tokens per KV block", json_schema_extra=cli(_KV))
    enable_prefix_caching: bool = Field(True, description="Reuse the KV blocks of shared prefixes",
                                        json_schema_extra=cli(_KV))
    kv_cache_memory: int | None = Field(
        None, description="KV cache size, e.g. 2GiB (default: from the platform; on the CPU its RAM budget, on a "
                          "GPU gpu_memory_utilization)", json_schema_extra=cli(_KV, metavar="SIZE"))
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="Fraction of GPU memory to use",
                                          json_schema_extra=cli(_KV))
    num_kv_blocks: int | None = Field(None, ge=1, description="Number of KV blocks, instead of the one computed "
                                                              "from the memory budget", json_schema_extra=cli(_KV))
    kv_cache_dtype: str = Field(
        "auto", description="dtype of the KV cache: auto (the model's), fp8 (= fp8_e4m3) or fp8_e5m2; float8 "
                            "halves the bytes per block against bfloat16, scaled by the checkpoint's per-layer "
                            "k_scale/v_scale where it has them, else 1.0", json_schema_extra=cli(_KV))

    max_num_batched_tokens: int = Field(2048, ge=1, description="Token budget of one step",
                                        json_schema_extra=cli(_SCHED))
    max_num_seqs: int = Field(64, ge=1, description="Most requests in one step", json_schema_extra=cli(_SCHED))
    enable_chunked_prefill: bool = Field(True, description="Split long prompts over several steps",
                                         json_schema_extra=cli(_SCHED))
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="fcfs, or priority (the request's `priority` field)", json_schema_extra=cli(_SCHED))
    request_timeout: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="Seconds from arrival after which a request ends with finish_reason 'timeout' (a request's "
                    "`timeout` field overrides it; default: never)", json_schema_extra=cli(_SCHED))

    seed: int = Field(0, description="Engine seed", json_schema_extra=cli(_RUN))
    enforce_eager: bool = Field(False, description="Run every step eagerly, never through a step graph",
                                json_schema_extra=cli(_RUN))
    max_graph_batch_size: int = Field(
        64, ge=0, description="Decode batches of up to this many requests replay a step graph where the platform "
                              "can capture one", json_schema_extra=cli(_RUN))
    attention_backend: str | None = Field(None, description="Force an attention backend by name",
                                          json_schema_extra=cli(_RUN))
    tensor_parallel_size: int = Field(1, ge=1, description="Ranks the model's layers are split over (tensor "
                                                           "parallelism), one worker process each",
                                      json_schema_extra=cli(_RUN))
    pipeline_parallel_size: int = Field(1, ge=1, description="Stages the model's decoder layers are split "
                                                             "into (pipeline parallelism), tensor_parallel_size "
                                                             "worker processes each", json_schema_extra=cli(_RUN))
    enable_expert_parallel: bool = Field(
        False, description="MoE layers place whole experts on the tensor-parallel ranks (expert i of E on one "
                           "rank, a contiguous share each) instead of splitting every expert; with one rank it "
                           "changes nothing", json_schema_extra=cli(_RUN))
    enable_eplb: bool = Field(
        False, description="Expert-parallel load balancing (needs enable_expert_parallel): copies of the most loaded "
                           "experts in eplb_config.num_redundant_experts extra slots, each token sent to the least "
                           "loaded copy, the placement recomputed from the measured load every "
                           "eplb_config.step_interval steps while serving", json_schema_extra=cli(_RUN))
    eplb_config: EPLBConfig = Field(
        default_factory=EPLBConfig, description="The load balancer's options, as JSON: {\"num_redundant_experts\": 2, "
                                                "\"window_size\": 1000, \"step_interval\": 3000}",
        json_schema_extra=cli(_RUN))
    distributed_executor_backend: str = Field(
        "uni", description="Executor that runs the model's workers, by its registered name (see `tokenmill plugins`; "
                          "default: uni, one worker in the engine's own process, or mp, one process per rank, "
                          "when tensor_parallel_size or pipeline_parallel_size > 1)", json_schema_extra=cli(_RUN))
    quantization: str | None = Field(
        None, description="Quantization method, by its registered name or checkpoint alias (see `tokenmill plugins`; "
                          "default: the one the checkpoint declares, in config.json's quantization_config or its "
                          "single-file format, if any)", json_schema_extra=cli(_MODEL))
    structured_outputs_backend: str = Field(
        "xgrammar", description="Structured-output backend, by its registered name (see `tokenmill plugins`)",
        json_schema_extra=cli(_RUN))
    num_threads: int | None = Field(None, ge=1, description="CPU threads of the engine (default: "
                                                            "TOKENMILL_NUM_THREADS, else the usable cores)",
                                    json_schema_extra=cli(_RUN))
    engine_process: bool = Field(
        False, description="Serving (AsyncLLM, tokenmill serve): step the engine in a process of its own, apart "
                           "from the API server's event loop and its GIL (the offline LLM steps in its caller)",
        json_schema_extra=cli(_RUN))

    speculative_config: SpeculativeConfig | None = Field(
        None, description="Speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4} "
                          "or {\"model\": DRAFT, \"num_speculative_tokens\": 3}; the method is a proposer by its "
                          "registered name (see `tokenmill plugins`; default: none)", json_schema_extra=cli(_RUN))
    kv_transfer_config: KVTransferConfig | None = Field(
        None, description="KV connector, as JSON: {\"kv_connector\": NAME, \"kv_role\": \"kv_producer\"|"
                          "\"kv_consumer\"|\"kv_both\", \"kv_connector_extra_config\": {...}}; the connector "
                          "by its registered name (see `tokenmill plugins`; default: none)", json_schema_extra=cli(_RUN))
    enable_lora: bool = Field(False, description="Serve LoRA adapters (a request names one; see docs/lora.md)",
                              json_schema_extra=cli(_LORA))
    max_loras: int = Field(4, ge=1, description="LoRA adapters one step can use: the device slots",
                           json_schema_extra=cli(_LORA))
    max_lora_rank: int = Field(16, ge=1, description="Largest LoRA rank an adapter may have",
                               json_schema_extra=cli(_LORA))
    max_cpu_loras: int | None = Field(None, ge=1, description="LoRA adapters kept loaded in host memory (LRU; "
                                                              "default: twice max_loras)",
                                      json_schema_extra=cli(_LORA))

    limit_mm_per_prompt: dict[str, int] = Field(
        default_factory=dict, description="Most multimodal items of each kind one prompt may carry, as JSON: "
                                          "{\"image\": 4} (a kind not named: no limit but the context)",
        json_schema_extra=cli(_MM))
    allowed_local_media_path: str | None = Field(
        None, description="A folder whose images chat requests may name as file:// URLs (default: none)",
        json_schema_extra=cli(_MM))
    media_fetch_timeout: float | None = Field(
        None, gt=0, description="Seconds an http(s) image or video URL may take to download (default: "
                                "$VLLM_IMAGE_FETCH_TIMEOUT or 5 for images, $VLLM_VIDEO_FETCH_TIMEOUT or 30 for videos)",
        json_schema_extra=cli(_MM))
    max_media_bytes: int = Field(
        64 << 20, ge=1, description="Largest body an http(s) image or video URL may have (e.g. 64MiB); the "
                                    "download stops there and the request is refused",
        json_schema_extra=cli(_MM, metavar="SIZE"))
    allowed_media_domains: list[str] = Field(
        default_factory=list, description="Hosts http(s) media URLs may name, comma-separated (default: any)",
        json_schema_extra=cli(_MM, metavar="DOMAINS"))
    mm_encoder_cache_size: int = Field(
        8192, ge=0, description="Encoder outputs (image embeddings) kept for reuse by later requests, in "
                                "embedding rows (tokens); 0: none kept", json_schema_extra=cli(_MM))
    max_num_encoder_input_tokens: int | None = Field(
        None, ge=1, description="Encoder input tokens (image placeholder rows) one step may encode; a prefill "
                                "chunk stops before an image that does not fit, and an image larger than it is "
                                "encoded alone in a step (default: max_num_batched_tokens)",
        json_schema_extra=cli(_MM))

    strict_plugins: bool = Field(False, description="Fail when a plugin cannot be loaded",
                                 json_schema_extra=cli(_PLUGINS))
    plugin_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options plugins add (tokenmill_add_options), keyed '<plugin>.<name>'; checked against them "
                    "when the engine starts. On the command line each is its own option, --<plugin>.<name>",
        json_schema_extra=cli(_PLUGINS))

    @model_validator(mode="before")
    @classmethod
    def _default_executor(cls, data: Any) -> Any:
        """Left unset, the executor is "uni" for one rank and "mp" (a process per rank) for more."""
        if isinstance(data, dict) and data.get("distributed_executor_backend") is None:
            data = {key: value for key, value in data.items() if key != "distributed_executor_backend"}
            ranks = int(data.get("tensor_parallel_size") or 1) * int(data.get("pipeline_parallel_size") or 1)
            if ranks > 1:
                data["distributed_executor_backend"] = "mp"
        return data

    @model_validator(mode="after")
    def _runner_from_task(self) -> EngineConfig:
        """``task`` picks the runner when ``runner`` is left to auto; the two must not disagree."""
        if self.task == "auto":
            return self
        wanted = "generate" if self.task == "generate" else "pooling"
        if self.runner not in ("auto", wanted):
            raise ValueError(f"task={self.task!r} needs runner={wanted!r}, not {self.runner!r}")
        if self.runner == "auto":
            object.__setattr__(self, "runner", wanted)  # validate_assignment would re-run this validator
        return self

    @property
    def world_size(self) -> int:
        """Worker ranks the model is split over: tensor-parallel ranks times pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @model_validator(mode="after")  # (its decorator was lost in a merge: the checks never ran)
    def _check_lora(self) -> EngineConfig:
        if self.enable_lora and self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} is below max_loras={self.max_loras}: every "
                             "adapter in a device slot is also kept in host memory")
        if self.enable_lora and self.pipeline_parallel_size > 1:  # rank 0 alone cannot check every layer's targets
            raise ValueError("LoRA under pipeline parallelism is not supported yet")
        return self

    @model_validator(mode="after")
    def _check_eplb(self) -> EngineConfig:
        check_eplb_options(self.enable_eplb, self.enable_expert_parallel, self.eplb_config)
        return self

    @model_validator(mode="after")
    def _check_kv_transfer(self) -> EngineConfig:
        # under tensor parallelism each rank moves its own KV heads (a connector may refuse it at start)
        if self.kv_transfer_config is not None and self.pipeline_parallel_size > 1:
            raise ValueError("a KV connector (kv_transfer_config) does not run under pipeline parallelism, for now")
        return self

    @property
    def lora_host_cache_size(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else 2 * self.max_loras

    @field_validator("plugin_options")
    @classmethod
    def _check_option_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        if malformed := [key for key in value if "" in key.rpartition(".")]:
            raise ValueError(f"plugin option keys look like '<plugin>.<name>', not {malformed}")
        return value

    @field_validator("max_media_bytes", mode="before")
    @classmethod
    def _parse_media_size(cls, value: int | str) -> int:
        return parse_size(value)

    @field_validator("allowed_media_domains", mode="before")
    @classmethod
    def _split_domains(cls, value: str | list[str]) -> list[str]:
        """The command line gives one text: "a.com,b.org" (or space-separated)."""
        if isinstance(value, str):
            return [d for d in value.replace(",", " ").split() if d]
        return value

    def media_fetch_policy(self) -> MediaFetchPolicy:
        """How chat requests' http(s) media URLs are fetched (``tokenmill.multimodal.fetch``)."""
        return MediaFetchPolicy(self.media_fetch_timeout, self.max_media_bytes, tuple(self.allowed_media_domains))

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _parse_size(cls, value: int | str | None) -> int | None:
        return None if value is None else parse_size(value)

    @field_validator("kv_cache_dtype")
    @classmethod
    def _check_kv_cache_dtype(cls, value: str) -> str:
        from tokenmill.kv_cache.fp8 import normalize_kv_cache_dtype

        return normalize_kv_cache_dtype(value)

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, value: str) -> str:
        value = value.removeprefix("torch.")
        aliases = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
        value = aliases.get(value, value)
        if value not in {"auto", "float32", "bfloat16", "float16"}:
            raise ValueError(f"unsupported dtype {value!r}: use auto, float32, bfloat16 or float16")
        return value
