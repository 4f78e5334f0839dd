"""``GET /v1/models``: the names this server answers to, all one checkpoint."""

from __future__ import annotations

from fastapi import APIRouter

from tokenmill.lora import LoRARequest
from tokenmill_cli.server.errors import ERROR_RESPONSES, model_not_found
from tokenmill_cli.server.responses import ModelCard, ModelList
from tokenmill_cli.server.state import State

router = APIRouter(tags=["models"])


@router.get("/v1/models", responses={401: ERROR_RESPONSES[401]})
async def list_models(state: State) -> ModelList:
    root, max_len = state.settings.model_root, state.engine.max_model_len
    base = [ModelCard(id=name, root=root, max_model_len=max_len) for name in state.settings.served_model_names]
    return ModelList(data=base + [_adapter_card(state, lora) for lora in state.engine.list_loras()])


def _adapter_card(state: State, lora: LoRARequest) -> ModelCard:
    return ModelCard(id=lora.lora_name, root=lora.lora_path, max_model_len=state.engine.max_model_len,
                     parent=lora.base_model_name or state.settings.default_model_name)


@router.get("/v1/models/{model_id:path}", responses=ERROR_RESPONSES)
async def retrieve_model(model_id: str, state: State) -> ModelCard:
    """One served name (names may hold slashes, as hub ids do)."""
    lora = state.lora_request(model_id)
    if lora is not None:
        return _adapter_card(state, lora)
    if model_id not in state.settings.served_model_names:
        raise model_not_found(model_id)
    return ModelCard(id=model_id, root=state.settings.model_root, max_model_len=state.engine.max_model_len)
