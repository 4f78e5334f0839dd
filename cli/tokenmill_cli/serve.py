"""``tokenmill serve``: an OpenAI-compatible HTTP server over one model.

Its engine options (``engine``) are generated from ``EngineConfig`` (:mod:`tokenmill_cli.engine_options`)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated, Any

import typer

from tokenmill.config import EngineConfig
from tokenmill_cli.server_options import (
    ApiDocsNeedKey,
    DisableLogStats,
    DisableMetrics,
    EnableTokenizerInfoEndpoint,
    HealthStallTimeout,
    LogStatsInterval,
    MaxQueuedRequests,
    MaxQueuedTokens,
    MaxStoredResponses,
    ShutdownTimeout,
)

_SERVER = "Server"
_LORA = "LoRA"

logger = logging.getLogger(__name__)


def serve(
    engine: EngineConfig,
    host: Annotated[str, typer.Option(help="Address to bind; 0.0.0.0 for every interface",
                                      rich_help_panel=_SERVER)] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on", rich_help_panel=_SERVER)] = 8000,
    api_key: Annotated[str | None, typer.Option(envvar="TOKENMILL_API_KEY", show_envvar=True,
                                                help="Require `Authorization: Bearer KEY` (all routes but /health, /ready, /metrics)",
                                                rich_help_panel=_SERVER)] = None,
    served_model_name: Annotated[list[str] | None, typer.Option(
        help="Name(s) clients use as `model` (repeatable) [default: the model argument]",
        rich_help_panel=_SERVER)] = None,
    chat_template: Annotated[str | None, typer.Option(help="Chat template: a Jinja file or the template text",
                                                      rich_help_panel=_SERVER)] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error", rich_help_panel=_SERVER)] = "info",
    tool_call_parser: Annotated[str | None, typer.Option(
        help="Read replies into tool_calls with this registered parser (hermes, llama3_json, ...: see "
             "`tokenmill plugins`); needed for tool_choice other than none", rich_help_panel=_SERVER)] = None,
    enable_auto_tool_choice: Annotated[bool, typer.Option(
        "--enable-auto-tool-choice", help='Allow tool_choice "auto" (the model decides; its reply is parsed)',
        rich_help_panel=_SERVER)] = False,
    reasoning_parser: Annotated[str | None, typer.Option(
        help="Split a reasoning model's <think> section into reasoning_content with this registered parser "
             "(deepseek_r1, qwen3, ...: see `tokenmill plugins`)", rich_help_panel=_SERVER)] = None,
    max_queued_requests: MaxQueuedRequests = None,
    max_queued_tokens: MaxQueuedTokens = None,
    shutdown_timeout: ShutdownTimeout = 30.0,
    health_stall_timeout: HealthStallTimeout = 30.0,
    disable_log_stats: DisableLogStats = False,
    log_stats_interval: LogStatsInterval = 5.0,
    disable_metrics: DisableMetrics = False,
    max_stored_responses: MaxStoredResponses = 1000,
    api_docs_need_key: ApiDocsNeedKey = False,
    enable_tokenizer_info_endpoint: EnableTokenizerInfoEndpoint = False,
    lora_modules: Annotated[list[str] | None, typer.Option(
        help="LoRA adapters to serve (with --enable-lora), each name=path or a JSON object "
             '{"name": ..., "path": ..., "base_model_name": ...}, several after one flag or the flag repeated; '
             "a request names one in `model`",
        rich_help_panel=_LORA)] = None,
    allow_runtime_lora: Annotated[bool, typer.Option(
        "--allow-runtime-lora", envvar="TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING", show_envvar=True,
        help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key)",
        rich_help_panel=_LORA)] = False,
) -> None:
    from tokenmill import AsyncLLM, TokenmillError
    from tokenmill_cli.server.lora import parse_lora_module
    from tokenmill_cli.server.settings import load_chat_template

    _configure_logging(log_level)
    try:
        template = load_chat_template(chat_template)
        _check_tool_options(tool_call_parser, enable_auto_tool_choice)
        _check_reasoning_parser(reasoning_parser)
        adapters = [parse_lora_module(text) for text in lora_modules or []]
        if adapters and not engine.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        llm = AsyncLLM(max_queued_requests=max_queued_requests, max_queued_tokens=max_queued_tokens,
                       **engine.model_dump(exclude_unset=True))
        for adapter in adapters:
            asyncio.run(llm.add_lora(adapter))
    except (TokenmillError, ValueError, OSError) as exc:  # pydantic's ValidationError is a ValueError
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    operations: dict[str, Any] = {"shutdown_timeout": shutdown_timeout, "health_stall_timeout": health_stall_timeout,
                                  "log_stats": not disable_log_stats, "log_stats_interval": log_stats_interval,
                                  "enable_metrics": not disable_metrics, "max_stored_responses": max_stored_responses}
    # tool calling rides along with the other settings
    operations.update(tool_call_parser=tool_call_parser, enable_auto_tool_choice=enable_auto_tool_choice,
                      reasoning_parser=reasoning_parser)
    operations.update(api_docs_need_key=api_docs_need_key, enable_tokenizer_info_endpoint=enable_tokenizer_info_endpoint,
                      allow_runtime_lora=allow_runtime_lora)
    _run(llm, engine.model, host, port, api_key, served_model_name, template, log_level, operations)


def _check_tool_options(parser: str | None, enable_auto: bool) -> None:
    """Before the model loads: an unknown parser name fails now, listing the registered ones."""
    from tokenmill.errors import InvalidRequestError
    from tokenmill_cli.server.tool_calls import parser_class

    if enable_auto and parser is None:
        raise InvalidRequestError("--enable-auto-tool-choice needs --tool-call-parser", param="tool_call_parser")
    if parser is not None:
        parser_class(parser)


def _check_reasoning_parser(name: str | None) -> None:
    """Before the model loads: an unknown parser name fails now, listing the registered ones."""
    from tokenmill_cli.server.reasoning import reasoning_parser_class

    if name is not None:
        reasoning_parser_class(name)


def _run(engine: Any, model: str | None, host: str, port: int, api_key: str | None,
         served_model_name: list[str] | None, chat_template: str | None, log_level: str,
         operations: dict[str, Any]) -> None:
    import uvicorn

    from tokenmill_cli.server import ServerSettings, build_app
    from tokenmill_cli.server.graceful import GracefulServer

    checkpoint_path = Path(engine.model_info.path)
    settings = ServerSettings(
        served_model_names=served_model_name or [model or default_served_name(checkpoint_path)],
        model_root=str(checkpoint_path), api_key=api_key or None, chat_template=chat_template, **operations)
    app = build_app(engine, settings)
    logger.info("serving %s as %s on http://%s:%d/v1", checkpoint_path, ", ".join(settings.served_model_names),
                host, port)
    # uvicorn runs the app's lifespan, whose exit shuts the engine down; the drain comes before it.
    # After the drain only finished responses are left to flush: a short graceful timeout suffices.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                            access_log=log_level.lower() in {"debug", "info"}, timeout_graceful_shutdown=5)
    GracefulServer(config, app.state.server.lifecycle, engine, settings.shutdown_timeout).run()


def default_served_name(checkpoint_path: Path) -> str:
    """The default model's name: its file name without the extension, e.g. ``SmolLM2-135M-Instruct.Q4_1``."""
    return checkpoint_path.stem if checkpoint_path.is_file() else checkpoint_path.name


def _configure_logging(level: str) -> None:
    level_name = level.upper()
    if level_name not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
        raise typer.BadParameter(f"unknown log level {level!r}", param_hint="--log-level")
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level_name)
