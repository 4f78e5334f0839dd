"""What a worker is built from: a small, picklable record.

The engine resolves the model once (a Hub id becomes a local folder, ``max_model_len``
and ``dtype`` become concrete) and hands every worker the same spec, differing only in
its rank. A worker in another process rebuilds everything else from it: its plugin
manager (the same plugins, by name), its platform, its own checkpoint and weights.
Nothing in it holds a tokenizer, a tensor or a lambda, so it crosses a process boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tokenmill.config import EngineConfig
from tokenmill.errors import PluginError
from tokenmill.plugins.manager import CORE_PLUGIN_NAME, PluginManager


@dataclass(frozen=True)
class WorkerSpec:
    model_path: str  # the resolved local folder or file, never a Hub id
    config: EngineConfig
    dtype: str  # resolved: "float32", "bfloat16" or "float16"
    max_model_len: int  # resolved from the config and the checkpoint
    plugins: tuple[str, ...]  # the entry-point names the engine loaded
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def sampling_rank(self) -> int:
        """The one rank that samples: rank 0, or under pipeline parallelism the first rank of
        the last stage (which holds the lm_head; ranks are ``stage * tensor_parallel_size + tp_rank``)."""
        return (self.config.pipeline_parallel_size - 1) * self.config.tensor_parallel_size

    @property
    def samples(self) -> bool:
        """Only the sampling rank samples: the other ranks run the forward and return no tokens."""
        return self.rank == self.sampling_rank

    def for_rank(self, rank: int, local_rank: int | None = None) -> WorkerSpec:
        return replace(self, rank=rank, local_rank=rank if local_rank is None else local_rank)

    def load_plugins(self) -> PluginManager:
        """A plugin manager with the engine's plugins, for a worker in another process.

        A plugin the engine registered in code rather than through an entry point cannot
        be rebuilt here: that is an error naming it, not a worker silently missing a model.
        """
        manager = PluginManager(strict=self.config.strict_plugins, allow=frozenset(self.plugins))
        manager.load_entry_points()
        missing = sorted(set(self.plugins) - set(manager.infos))
        if missing:
            raise PluginError(f"worker rank {self.rank} could not load the engine's plugins {missing}: only "
                              "plugins found through the 'tokenmill.plugins' entry points reach a worker")
        return manager


def loaded_plugin_names(plugins: PluginManager) -> tuple[str, ...]:
    """The names a worker's :meth:`WorkerSpec.load_plugins` loads again (the core's defaults always load)."""
    return tuple(name for name in plugins.infos if name != CORE_PLUGIN_NAME)
