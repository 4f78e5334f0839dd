"""``tokenmill tokenizer export MODEL DIR``: a model's tokenizer as a Hugging Face folder.

A GGUF file embeds its tokenizer and chat template; tools that want a tokenizer
folder or hub id (lm-eval's ``tokenizer=``, transformers' ``AutoTokenizer``)
cannot read it from there. This writes it out with ``save_pretrained``: the
tokenizer files, ``tokenizer_config.json`` with the special tokens, and the
chat template the engine renders with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

DEFAULT = "default"


def build_tokenizer_app() -> typer.Typer:
    app = typer.Typer(no_args_is_help=True, help="The tokenizer a model is served with.")
    app.command("export", help="Write MODEL's tokenizer (and chat template) to the folder DIR, for tools that "
                               "need a tokenizer folder, e.g. lm-eval with a GGUF model.")(export)
    return app


def export(
    model: Annotated[str, typer.Argument(help=f"Hub id, local folder or .gguf file; {DEFAULT!r}: the default model")],
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="Folder to write (created if missing)")],
) -> None:
    from tokenmill.errors import TokenmillError

    try:
        tokenizer = load_tokenizer(model)
    except (TokenmillError, OSError, ValueError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    written = export_tokenizer(tokenizer, directory)
    typer.echo(f"wrote {type(tokenizer).__name__} to {directory} ({', '.join(sorted(written))})")


def load_tokenizer(model: str) -> Any:
    """The tokenizer the engine would load for ``model``, read the engine's way (a GGUF through its plugin)."""
    import torch

    from tokenmill.errors import InvalidRequestError
    from tokenmill.model_loader.loader import default_model, load_checkpoint
    from tokenmill.platform import detect_platform
    from tokenmill.plugins.manager import get_plugin_manager

    plugins = get_plugin_manager()
    name = default_model(plugins) if model == DEFAULT else model
    checkpoint = load_checkpoint(name, plugins, detect_platform(plugins), torch.float32)
    if checkpoint.tokenizer is None:
        raise InvalidRequestError(f"{name} has no tokenizer", param="model")
    return checkpoint.tokenizer


def export_tokenizer(tokenizer: Any, directory: Path) -> list[str]:
    """``save_pretrained`` into ``directory``; the names of the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    return [Path(p).name for p in tokenizer.save_pretrained(str(directory))]
