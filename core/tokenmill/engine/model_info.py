"""What the front end needs to know about the model the engine core serves.

One record, asked of the core once (``EngineCore.model_info()``), instead of reading
the core's checkpoint, config and executor attributes: a core in another process can
send it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.pooling import PoolerConfig


@dataclass(frozen=True)
class ModelInfo:
    path: str  # the local folder or file the model was loaded from
    architecture: str | None  # the first of config.json's "architectures"
    vocab_size: int  # the logits' width (the model's, which may exceed the tokenizer's)
    max_model_len: int  # the longest sequence (prompt + output) a request may reach
    eos_token_id: int | None  # the primary end-of-sequence id
    extra_stop_token_ids: tuple[int, ...]  # other ids the generation config says end a sequence
    dtype: str  # the weights' and activations' dtype: "float32", "bfloat16", "float16"
    device_type: str  # the platform's device: "cpu", "cuda", ...
    num_kv_blocks: int  # KV cache blocks of block_size tokens
    block_size: int
    runner: str = "generate"  # "generate" (samples tokens) or "pooling" (embeddings and scores only)
    pooler: PoolerConfig | None = None  # how embedding requests pool; None: the model cannot pool
    is_encoder: bool = False  # bidirectional: every prompt runs whole (at most max_prompt_tokens), nothing is generated
    classifies: bool = False  # its pooled output is class logits (a cross-encoder / classifier head)
    class_labels: tuple[str, ...] = ()  # a classifier's label names, by class index (config.json's id2label)
    max_prompt_tokens: int = 0  # the longest prompt a pooling request may have (0: max_model_len - 1)

    @property
    def stop_token_ids(self) -> list[int]:
        """Every id that ends a sequence, the primary EOS first."""
        return [t for t in (self.eos_token_id, *self.extra_stop_token_ids) if t is not None]
