"""``tokenmill router --prefill URL --decode URL``: the command that runs the router app."""

from __future__ import annotations

from typing import Annotated

import typer
import uvicorn

from tokenmill_cli.router.app import RouterSettings, build_router_app


def router(
    prefill: Annotated[list[str], typer.Option(
        help="A prefill server's URL (`tokenmill serve` with a kv_producer connector); repeat the option, or "
             "separate URLs with commas, for several")],
    decode: Annotated[list[str], typer.Option(
        help="A decode server's URL (`tokenmill serve` with a kv_consumer connector); repeat the option, or "
             "separate URLs with commas, for several")],
    host: Annotated[str, typer.Option(help="Address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on")] = 8000,
    prefill_timeout: Annotated[float, typer.Option(
        help="Seconds a prefill may take; after that (or when it fails) the decode server computes the prompt",
        min=0.001)] = 30.0,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error")] = "info",
) -> None:
    """Send each request to the least-loaded prefill server (one token, to compute the prompt's KV),
    then to the least-loaded decode server (which loads that KV), and answer with the decode side."""
    settings = RouterSettings(_urls(prefill), _urls(decode), prefill_timeout)
    uvicorn.run(build_router_app(settings), host=host, port=port, log_level=log_level)


def _urls(values: list[str]) -> list[str]:
    return [url.strip() for value in values for url in value.split(",") if url.strip()]
