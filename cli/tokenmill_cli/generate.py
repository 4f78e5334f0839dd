"""``tokenmill generate``: prompts in, text out, through a local engine."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from tokenmill_cli.engine_options import (
    AttentionBackend,
    BlockSize,
    Dtype,
    EnforceEager,
    KVCacheMemory,
    MaxGraphBatchSize,
    MaxModelLen,
    MaxNumBatchedTokens,
    MaxNumSeqs,
    PrefixCaching,
    Seed,
    StrictPlugins,
    engine_kwargs,
)

_SAMPLING = "Sampling"


def generate(
    prompts: Annotated[list[str], typer.Argument(help="Prompts; '-' reads one prompt per line from stdin")],
    model: Annotated[str | None, typer.Option("--model", "-m", help="Hub id, folder or .gguf file [default: SmolLM2-135M-Instruct]")] = None,
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="Apply the model's chat template to each prompt")] = True,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate", rich_help_panel=_SAMPLING)] = 64,
    temperature: Annotated[float, typer.Option(help="0 is greedy", rich_help_panel=_SAMPLING)] = 0.0,
    top_p: Annotated[float, typer.Option(rich_help_panel=_SAMPLING)] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 disables", rich_help_panel=_SAMPLING)] = 0,
    sample_seed: Annotated[int | None, typer.Option(help="Per-request seed", rich_help_panel=_SAMPLING)] = None,
    dtype: Dtype = "auto",
    max_model_len: MaxModelLen = None,
    max_num_seqs: MaxNumSeqs = 64,
    max_num_batched_tokens: MaxNumBatchedTokens = 2048,
    enable_prefix_caching: PrefixCaching = True,
    kv_cache_memory: KVCacheMemory = None,
    block_size: BlockSize = 16,
    seed: Seed = 0,
    attention_backend: AttentionBackend = None,
    strict_plugins: StrictPlugins = False,
    enforce_eager: EnforceEager = False,
    max_graph_batch_size: MaxGraphBatchSize = None,
) -> None:
    from tokenmill import LLM, SamplingParams, TokenmillError

    if prompts == ["-"]:
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=sample_seed)
        llm = LLM(show_progress=True, **engine_kwargs(
            model=model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            kv_cache_memory=kv_cache_memory, block_size=block_size, seed=seed,
            attention_backend=attention_backend, strict_plugins=strict_plugins,
            enforce_eager=enforce_eager, max_graph_batch_size=max_graph_batch_size))
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
