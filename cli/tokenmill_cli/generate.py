"""``tokenmill generate``: prompts in, text out, through a local engine.

Its engine options (``engine``) are generated from ``EngineConfig`` (:mod:`tokenmill_cli.engine_options`)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from tokenmill.config import EngineConfig

_SAMPLING = "Sampling"


def generate(
    engine: EngineConfig,
    prompts: Annotated[list[str], typer.Argument(help="Prompts; '-' reads one prompt per line from stdin")],
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="Apply the model's chat template to each prompt")] = True,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate", rich_help_panel=_SAMPLING)] = 64,
    temperature: Annotated[float, typer.Option(help="0 is greedy", rich_help_panel=_SAMPLING)] = 0.0,
    top_p: Annotated[float, typer.Option(rich_help_panel=_SAMPLING)] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 disables", rich_help_panel=_SAMPLING)] = 0,
    sample_seed: Annotated[int | None, typer.Option(help="Per-request seed", rich_help_panel=_SAMPLING)] = None,
) -> None:
    from tokenmill import LLM, SamplingParams, TokenmillError

    if prompts == ["-"]:
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=sample_seed)
        llm = LLM(show_progress=True, **engine.model_dump(exclude_unset=True))
        if chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=len(prompts) > 1)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    except TokenmillError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    for prompt, output in zip(prompts, outputs, strict=True):
        if len(prompts) > 1:
            typer.secho(f"> {prompt}", bold=True)
        typer.echo(output.outputs[0].text.strip())
