"""What every handler needs: the engine and the server settings, stored on the app."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request

from tokenmill_cli.server.errors import model_not_found
from tokenmill_cli.server.response_store import ResponseStore
from tokenmill_cli.server.settings import ServerSettings

if TYPE_CHECKING:
    from tokenmill.entrypoints.async_llm import AsyncLLM
    from tokenmill.lora import LoRARequest
    from tokenmill_cli.server.lifecycle import Lifecycle
    from tokenmill_cli.server.metrics import ServerMetrics


@dataclass
class ServerState:
    engine: AsyncLLM
    settings: ServerSettings
    lifecycle: Lifecycle
    metrics: ServerMetrics
    client_disconnects: int = 0  # requests whose client left before the answer was complete
    response_store: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses' stored responses

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        """The token ids every route takes: those the model has logits for and the tokenizer can decode."""
        return min(self.engine.model_info.vocab_size, len(self.engine.tokenizer))

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; a name this server does not serve (nor a LoRA adapter's) is a 404."""
        if requested is None:
            return self.settings.default_model_name
        if requested not in self.settings.served_model_names and self.lora_request(requested) is None:
            raise model_not_found(requested)
        return requested


    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names, if it names one."""
        if model is None or model in self.settings.served_model_names:
            return None
        return next((lora for lora in self.engine.list_loras() if lora.lora_name == model), None)


def get_state(request: Request) -> ServerState:
    return request.app.state.server


State = Annotated[ServerState, Depends(get_state)]


def note_disconnect(request: Request) -> None:
    get_state(request).client_disconnects += 1
