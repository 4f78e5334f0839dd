"""Engine options shared by every command that starts an engine.

Each is an ``Annotated`` alias, so a command declares ``dtype: Dtype = "auto"``
and the help text stays in one place.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

_ENGINE = "Engine"

Model = Annotated[str | None, typer.Argument(help="Hub id, local folder or .gguf file [default: SmolLM2-135M-Instruct]")]
Dtype = Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16", rich_help_panel=_ENGINE)]
MaxModelLen = Annotated[int | None, typer.Option(help="Context length [default: the model's]", rich_help_panel=_ENGINE)]
MaxNumSeqs = Annotated[int, typer.Option(help="Most requests in one step", rich_help_panel=_ENGINE)]
MaxNumBatchedTokens = Annotated[int, typer.Option(help="Token budget of one step", rich_help_panel=_ENGINE)]
PrefixCaching = Annotated[bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching",
                                             help="Reuse the KV blocks of shared prefixes", rich_help_panel=_ENGINE)]
KVCacheMemory = Annotated[str | None, typer.Option(help="KV cache size on the CPU, e.g. 2GiB", rich_help_panel=_ENGINE)]
GPUMemoryUtilization = Annotated[float, typer.Option(help="Fraction of GPU memory to use", rich_help_panel=_ENGINE)]
BlockSize = Annotated[int, typer.Option(help="Tokens per KV block", rich_help_panel=_ENGINE)]
Seed = Annotated[int, typer.Option(help="Engine seed", rich_help_panel=_ENGINE)]
AttentionBackend = Annotated[str | None, typer.Option(help="Force an attention backend by name", rich_help_panel=_ENGINE)]
EnforceEager = Annotated[bool, typer.Option(
    "--enforce-eager", help="Run every step eagerly, never through a step graph", rich_help_panel=_ENGINE)]
MaxGraphBatchSize = Annotated[int | None, typer.Option(
    min=0, help="Decode batches of up to this many requests replay a captured step graph [default: 64]",
    rich_help_panel=_ENGINE)]
StrictPlugins = Annotated[bool, typer.Option(help="Fail when a plugin cannot be loaded", rich_help_panel=_ENGINE)]


def engine_kwargs(**options: Any) -> dict[str, Any]:
    """EngineConfig fields from CLI values; options left unset keep the config's defaults."""
    return {name: value for name, value in options.items() if value is not None}
