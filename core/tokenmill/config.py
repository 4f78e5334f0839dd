"""User-facing engine configuration (pydantic, validated once at start-up)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

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


class EngineConfig(BaseModel):
    """Everything the engine needs to start; the CLI and ``LLM(...)`` fill it."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    model: str | None = Field(None, description="Hub id, local folder or .gguf file; None: the default model")
    tokenizer: str | None = None
    revision: str | None = None
    dtype: str = Field("auto", description="auto, float32, bfloat16 or float16")
    max_model_len: int | None = Field(None, ge=1)
    seed: int = 0

    block_size: int = Field(16, ge=1)
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = Field(None, description="KV cache bytes; default from the platform (CPU: its RAM budget, GPU: gpu_memory_utilization)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    num_kv_blocks: int | None = Field(None, ge=1, description="override the computed number of KV blocks")

    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    enable_chunked_prefill: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    request_timeout: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="seconds from arrival after which a request ends with finish_reason 'timeout'; None: never")

    enforce_eager: bool = Field(False, description="run every step eagerly, never through a step graph")
    max_graph_batch_size: int = Field(
        64, ge=0, description="decode batches of up to this many requests replay a step graph where the platform can capture one")

    attention_backend: str | None = None
    distributed_executor_backend: str = Field(
        "uni", description="executor that runs the workers, by its registered name (tokenmill_register_executors); "
                           "'uni': one worker in the engine's own process")
    quantization: str | None = Field(
        None, description="quantization method, by its registered name or checkpoint alias (tokenmill_register_quantization_methods); "
        "None: the one the checkpoint declares (config.json's quantization_config, or its single-file format), if any")
    structured_outputs_backend: str = Field(
        "xgrammar", description="structured-output backend, by its registered name (tokenmill_register_structured_output_backends)")
    strict_plugins: bool = False
    num_threads: int | None = Field(None, ge=1)

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _parse_size(cls, value: int | str | None) -> int | None:
        return None if value is None else parse_size(value)

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, value: str) -> str:
        value = value.removeprefix("torch.")
        aliases = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
        value = aliases.get(value, value)
        if value not in {"auto", "float32", "bfloat16", "float16"}:
            raise ValueError(f"unsupported dtype {value!r}: use auto, float32, bfloat16 or float16")
        return value
