"""Which runner serves a model: ``generate`` (sample tokens) or ``pooling`` (embed, score, classify).

vLLM's names: ``LLM(model, runner="pooling")`` (or the older ``task="embed"``); left
to ``auto`` the architecture's :class:`~tokenmill.plugins.specs.ModelSpec` decides:
an encoder (``is_generative=False``) pools, everything else generates. A decoder left
to ``auto`` also answers embedding requests when its spec allows pooling; one served
with ``runner="generate"`` by name answers them 400, naming its runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.errors import UnsupportedModelError
from tokenmill.model_loader.checkpoint import Checkpoint
from tokenmill.model_loader.loader import registered_model_spec
from tokenmill.plugins.manager import PluginManager
from tokenmill.plugins.specs import ModelSpec
from tokenmill.pooling import PoolerConfig, read_pooler_config


@dataclass(frozen=True)
class RunnerChoice:
    name: str  # "generate" or "pooling"
    is_encoder: bool  # bidirectional attention, no KV cache, prompts never chunked
    pooler: PoolerConfig | None  # None: the model cannot pool
    classifies: bool
    class_labels: tuple[str, ...] = ()

    def model_info_fields(self, max_model_len: int, max_num_batched_tokens: int) -> dict[str, Any]:
        """What :class:`~tokenmill.engine.model_info.ModelInfo` says of the runner. An encoder
        uses every position (nothing is generated after the prompt) but must fit one step."""
        max_prompt = min(max_model_len, max_num_batched_tokens) if self.is_encoder else max_model_len - 1
        return {"runner": self.name, "pooler": self.pooler, "is_encoder": self.is_encoder,
                "classifies": self.classifies, "max_prompt_tokens": max_prompt, "class_labels": self.class_labels}


def choose_runner(config: EngineConfig, checkpoint: Checkpoint, plugins: PluginManager) -> RunnerChoice:
    spec = registered_model_spec(checkpoint, plugins) or ModelSpec("")
    name = config.runner if config.runner != "auto" else "generate" if spec.is_generative else "pooling"
    architecture = checkpoint.architectures[0] if checkpoint.architectures else "(unknown)"
    if name == "generate" and not spec.is_generative:
        raise UnsupportedModelError(f"{architecture} is an encoder: it runs only with runner='pooling'")
    if name == "pooling" and not spec.supports_pooling:
        raise UnsupportedModelError(f"{architecture} does not support pooling: it runs only with runner='generate'")
    # A decoder pools too unless the user asked for the generate runner by name.
    pools = spec.supports_pooling and config.runner != "generate"
    pooler = read_pooler_config(checkpoint.path, checkpoint.hf_config, spec.default_pooling) if pools else None
    classifies = "classify" in spec.capabilities
    return RunnerChoice(name, not spec.is_generative, pooler, classifies,
                        _class_labels(checkpoint.hf_config) if classifies else ())


def _class_labels(hf_config: Any) -> tuple[str, ...]:
    id2label = getattr(hf_config, "id2label", None) or {}
    count = int(getattr(hf_config, "num_labels", len(id2label)))
    return tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(count))
