"""What a caller names an adapter by (vLLM's ``LoRARequest``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request: ``lora_name`` is how requests and the server's
    ``model`` field name it (and part of the prefix-cache key, so two adapters never share
    KV); ``lora_path`` a local PEFT folder (``adapter_config.json`` +
    ``adapter_model.safetensors``) or a Hub id; ``lora_int_id`` a caller's number for it,
    kept for vLLM compatibility. ``base_model_name``: the model id it is listed under in
    ``/v1/models`` (default: the served base)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a non-empty lora_name")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a lora_path")
