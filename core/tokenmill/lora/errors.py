"""The typed error a bad adapter raises: it names the adapter and what is wrong with it."""

from __future__ import annotations

from tokenmill.errors import InvalidRequestError


class LoRAAdapterError(InvalidRequestError):
    """An adapter that cannot be used: a missing path, a rank above ``max_lora_rank``, target
    modules the base model does not have, weights shaped for another base model, a corrupt
    weights file. The server answers it with a 400; the engine goes on serving."""

    def __init__(self, lora_name: str, problem: str) -> None:
        super().__init__(f"LoRA adapter {lora_name!r}: {problem}", param="model")
        self.lora_name = lora_name
        self.problem = problem


class LoRAAdapterNotFoundError(InvalidRequestError):
    """A request or an unload names an adapter this engine does not know (the server: 404)."""

    def __init__(self, lora_name: str) -> None:
        super().__init__(f"LoRA adapter {lora_name!r} is not loaded", param="model")
        self.lora_name = lora_name
