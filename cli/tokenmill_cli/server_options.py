"""The operations options of ``tokenmill serve`` (admission bounds, shutdown, health, logging and
metrics) and a few server ones (API docs, tokenizer info), as ``Annotated`` aliases; the engine's own (``--request-timeout``) are generated from
``EngineConfig`` by ``engine_options``."""

from __future__ import annotations

from typing import Annotated

import typer

_OPS = "Operations"

MaxQueuedRequests = Annotated[int | None, typer.Option(
    min=1, help="Most requests waiting for their first token; past it: 429 [default: no bound]",
    rich_help_panel=_OPS)]
MaxQueuedTokens = Annotated[int | None, typer.Option(
    min=1, help="Most prompt tokens waiting for their first token; past it: 429 [default: no bound]",
    rich_help_panel=_OPS)]
ShutdownTimeout = Annotated[float, typer.Option(
    min=0, help="On SIGTERM, seconds running requests may take to finish before they are aborted",
    rich_help_panel=_OPS)]
HealthStallTimeout = Annotated[float, typer.Option(
    min=0.001, help="/health turns 503 when the engine loop is stuck in one step this long", rich_help_panel=_OPS)]
DisableLogStats = Annotated[bool, typer.Option(
    "--disable-log-stats", help="No periodic engine summary line in the log", rich_help_panel=_OPS)]
LogStatsInterval = Annotated[float, typer.Option(
    min=0.001, help="Seconds between two summary lines", rich_help_panel=_OPS)]
DisableMetrics = Annotated[bool, typer.Option(
    "--disable-metrics", help="No Prometheus metrics (and no /metrics route)", rich_help_panel=_OPS)]
MaxStoredResponses = Annotated[int, typer.Option(
    min=0, help="Most finished /v1/responses kept in memory for GET /v1/responses/ID and previous_response_id "
                "(least recently used out); 0: none", rich_help_panel=_OPS)]

_SERVER = "Server"

ApiDocsNeedKey = Annotated[bool, typer.Option(
    "--api-docs-need-key", help="With --api-key, guard /openapi.json, /docs and /redoc too [default: open, as vLLM's]",
    rich_help_panel=_SERVER)]
EnableTokenizerInfoEndpoint = Annotated[bool, typer.Option(
    "--enable-tokenizer-info-endpoint", help="Serve GET /tokenizer_info (the tokenizer's config, special tokens "
                                             "and chat template, as vLLM's), e.g. for lm-eval's remote tokenizer",
    rich_help_panel=_SERVER)]
