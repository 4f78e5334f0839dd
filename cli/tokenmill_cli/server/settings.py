"""What the server knows besides the engine: names, the key, the chat template."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from tokenmill_cli.server.response_store import DEFAULT_MAX_STORED_RESPONSES


class ServerSettings(BaseModel):
    model_config = ConfigDict(frozen=True, protected_namespaces=())

    served_model_names: list[str] = Field(min_length=1, description="names a request's `model` may use; the first "
                                                                    "is the one responses report")
    model_root: str = Field(description="the checkpoint the names stand for (shown in /v1/models)")
    api_key: str | None = Field(None, description="when set, every route but /health, /ready and /metrics (and the "
                                                  "API docs, see api_docs_need_key) needs `Bearer <key>`")
    api_docs_need_key: bool = Field(False, description="guard /openapi.json, /docs and /redoc with the key too "
                                                       "(open by default, as vLLM's)")
    chat_template: str | None = Field(None, description="overrides the tokenizer's chat template")
    enable_tokenizer_info_endpoint: bool = Field(False, description="serve GET /tokenizer_info (vLLM's)")
    tool_call_parser: str | None = Field(None, description="the registered tool-call parser that reads replies "
                                                           "into tool_calls (tokenmill plugins lists them)")
    enable_auto_tool_choice: bool = Field(False, description='let tool_choice "auto" parse free replies for calls')
    reasoning_parser: str | None = Field(None, description="the registered reasoning parser that splits a reply's "
                                                           "reasoning section into reasoning_content")
    allow_runtime_lora: bool = Field(False, description="serve POST /v1/load_lora_adapter and "
                                                        "/v1/unload_lora_adapter")
    # operations: see docs/operations.md
    enable_metrics: bool = Field(True, description="serve Prometheus metrics at /metrics")
    log_stats: bool = Field(True, description="log a one-line engine summary every log_stats_interval seconds")
    log_stats_interval: float = Field(5.0, gt=0)
    health_stall_timeout: float = Field(30.0, gt=0, description="/health is 503 when the engine loop has not "
                                                                "gone round for this long (a hung step)")
    shutdown_timeout: float = Field(30.0, ge=0, description="on SIGTERM, how long running requests may finish "
                                                            "before they are aborted")
    retry_after_s: int = Field(1, ge=0, description="the Retry-After of a 429 (admission control)")
    max_stored_responses: int = Field(DEFAULT_MAX_STORED_RESPONSES, ge=0,
                                      description="finished /v1/responses kept in memory for GET and "
                                                  "previous_response_id, least recently used out; 0: none")

    @property
    def default_model_name(self) -> str:
        return self.served_model_names[0]


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template`` takes a file or the template text itself, as vLLM's does."""
    if value is None:
        return None
    path = Path(value).expanduser()
    looks_like_path = "{" not in value and len(value) < 4096
    if looks_like_path and path.is_file():
        return path.read_text(encoding="utf-8")
    if looks_like_path and path.suffix in {".jinja", ".j2", ".txt"}:
        raise FileNotFoundError(f"chat template file not found: {value}")
    return value
