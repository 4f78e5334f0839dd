"""LoRA adapters over HTTP: ``--lora-modules``, and the run-time load and unload routes.

Each adapter is a model id of its own (``/v1/models`` lists it with ``parent`` = the base); a
request names it in ``model``. ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(vLLM's) exist only with ``--allow-runtime-lora`` (or ``TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING``),
behind the API key as every route. A load reads the adapter on a thread while the engine keeps
serving; an unload lets the requests using the adapter finish with it.
"""

from __future__ import annotations

import itertools
import json

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenmill.lora import LoRARequest
from tokenmill_cli.server.errors import ERROR_RESPONSES, APIError
from tokenmill_cli.server.state import State

router = APIRouter(tags=["lora"])
_ids = itertools.count(1)


def parse_lora_module(text: str) -> LoRARequest:
    """``name=path``, or the JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``.
    A malformed item is a ``ValueError`` quoting it and saying what is wrong."""
    if text.lstrip().startswith("{"):
        spec = _json_form(text)
        return LoRARequest(spec.name, next(_ids), spec.path, spec.base_model_name)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        missing = "an = between name and path" if not sep else "a name before the =" if not name else "a path after the ="
        raise ValueError(f"--lora-modules {text!r} lacks {missing}: each adapter is name=path or a JSON object "
                         f"{_JSON_FORM}")
    return LoRARequest(name, next(_ids), path)


_JSON_FORM = '{"name": ..., "path": ..., "base_model_name": ...}'


def _json_form(text: str) -> LoRAModuleSpec:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--lora-modules {text!r} is not valid JSON ({exc.msg} at character {exc.pos})") from exc
    try:
        return LoRAModuleSpec.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, error['loc'])) or 'the object'}: {error['msg']}"
                             for error in exc.errors())
        raise ValueError(f"--lora-modules {text!r}: {problems} (the JSON form is {_JSON_FORM})") from exc


class LoRAModuleSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    base_model_name: str | None = None


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, description="the model id requests will name it by")
    lora_path: str = Field(min_length=1, description="a local PEFT folder or a Hub id")


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)


class LoRAAdapterStatus(BaseModel):
    lora_name: str
    status: str = Field(description="loaded, already_loaded or unloaded")


def _check_allowed(state: State) -> None:
    if not state.settings.allow_runtime_lora:
        raise APIError(404, "run-time LoRA updates are off: start the server with --allow-runtime-lora "
                            "(or TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING=1)", code="not_found")


@router.post("/v1/load_lora_adapter", responses=ERROR_RESPONSES)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, state: State) -> LoRAAdapterStatus:
    """Load an adapter while the engine goes on serving (400 naming the problem for a bad one)."""
    _check_allowed(state)
    if body.lora_name in state.settings.served_model_names:
        raise APIError(400, f"{body.lora_name!r} is the base model's name", param="lora_name")
    added = await state.engine.add_lora(LoRARequest(body.lora_name, next(_ids), body.lora_path))
    return LoRAAdapterStatus(lora_name=body.lora_name, status="loaded" if added else "already_loaded")


@router.post("/v1/unload_lora_adapter", responses=ERROR_RESPONSES)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, state: State) -> LoRAAdapterStatus:
    """Forget an adapter (404 if it is not loaded); requests that use it finish with it."""
    _check_allowed(state)
    if state.lora_request(body.lora_name) is None:
        raise APIError(404, f"LoRA adapter {body.lora_name!r} is not loaded", param="lora_name",
                       code="model_not_found")
    await state.engine.remove_lora(body.lora_name)
    return LoRAAdapterStatus(lora_name=body.lora_name, status="unloaded")
