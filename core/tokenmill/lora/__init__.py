"""LoRA adapters: many fine-tunes of one base model served in one batch.

``LoRARequest`` names an adapter (``llm.generate(..., lora_request=...)``); the engine reads
it on a thread (:mod:`tokenmill.lora.adapter`), keeps it in a host LRU cache and device
slots (:mod:`tokenmill.lora.manager`, :mod:`tokenmill.lora.slots`), and the wrapped layers
apply every slot's adapter in one batched pass (:mod:`tokenmill.lora.layers`; the token
embedding and the lm_head: :mod:`tokenmill.lora.vocab_layers`).
"""

from tokenmill.lora.errors import LoRAAdapterError, LoRAAdapterNotFoundError
from tokenmill.lora.request import LoRARequest

__all__ = ["LoRAAdapterError", "LoRAAdapterNotFoundError", "LoRARequest"]
