"""``POST /v1/embeddings``: pooled hidden states of a decoder model (last token or mean)."""

from __future__ import annotations

import asyncio
import base64
import sys
from array import array

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from tokenmill.errors import InvalidRequestError
from tokenmill_cli.server.completions import engine_prompts
from tokenmill_cli.server.errors import ERROR_RESPONSES, APIError
from tokenmill_cli.server.lifecycle import check_admitting
from tokenmill_cli.server.protocol import EmbeddingRequest
from tokenmill_cli.server.responses import EmbeddingData, EmbeddingResponse, Usage
from tokenmill_cli.server.state import ServerState, State
from tokenmill_cli.server.streaming import until_disconnected

router = APIRouter(tags=["embeddings"])


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERROR_RESPONSES,
             dependencies=[Depends(check_admitting)])
async def create_embedding(body: EmbeddingRequest, request: Request, state: State) -> Response:
    return await until_disconnected(request, _serve(body, state))


async def _serve(body: EmbeddingRequest, state: ServerState) -> Response:
    model = state.model_name(body.model)
    if body.dimensions is not None:
        raise InvalidRequestError("dimensions is not supported: embeddings have the model's hidden size",
                                  param="dimensions")
    embed = getattr(state.engine, "embed", None)
    if embed is None:
        raise APIError(501, "this engine cannot compute embeddings yet", code="not_implemented")
    # Tokenized here so usage counts exactly what the engine pooled over.
    token_ids = [_token_ids(state, prompt) for prompt in engine_prompts(body.input, param="input")]
    try:
        vectors = await asyncio.gather(*[embed({"prompt_token_ids": ids}, pooling=body.pooling) for ids in token_ids])
    except InvalidRequestError as exc:  # the engine calls it the prompt; here it is the input
        raise InvalidRequestError(str(exc), param="input" if exc.param == "prompt" else exc.param) from exc
    data = [EmbeddingData(index=i, embedding=_encode(v, body.encoding_format)) for i, v in enumerate(vectors)]
    total = sum(len(ids) for ids in token_ids)
    response = EmbeddingResponse(data=data, model=model, usage=Usage(prompt_tokens=total, total_tokens=total))
    return JSONResponse(response.model_dump())


def _token_ids(state: ServerState, prompt: object) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("input must not be an empty string", param="input")
        return list(state.tokenizer.encode(prompt))
    assert isinstance(prompt, dict)
    return list(prompt["prompt_token_ids"])


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """base64 is little-endian float32, what the openai client decodes (and asks for by default)."""
    if encoding_format == "float":
        return vector
    packed = array("f", vector)  # C float: 4 bytes on every platform torch runs on
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")
