"""``POST /v1/embeddings``: an encoder's embeddings, pooled as the model says (a sentence-transformers
folder's mean / CLS / last pooling and normalisation), or a decoder's pooled hidden states."""

from __future__ import annotations

import asyncio
import base64
import sys
from array import array
from typing import cast

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from tokenmill.entrypoints.scoring import check_classifier
from tokenmill.errors import InvalidRequestError
from tokenmill.pooling import check_matryoshka, finish_embedding
from tokenmill_cli.server.completions import engine_prompts
from tokenmill_cli.server.errors import ERROR_RESPONSES
from tokenmill_cli.server.lifecycle import check_admitting
from tokenmill_cli.server.pooling_protocol import check_truncate
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
    info = state.engine.model_info
    check_truncate(body.truncate_prompt_tokens)
    check_classifier(info, False, "embeddings")
    if body.dimensions is not None:  # before any work; the vector's own width is checked once known
        check_matryoshka(info.pooler)
    prompts = engine_prompts(body.input, param="input")
    for prompt in prompts:
        _check_not_empty(prompt)
    try:
        outputs = await asyncio.gather(*[state.engine.pool(p, body.pooling or "auto",
                                                           truncate_prompt_tokens=body.truncate_prompt_tokens)
                                         for p in prompts])
    except InvalidRequestError as exc:  # the engine calls it the prompt; here it is the input
        raise InvalidRequestError(str(exc), param="input" if exc.param == "prompt" else exc.param) from exc
    vectors = [finish_embedding(cast(list[float], o.embedding), info.pooler, body.dimensions) for o in outputs]
    data = [EmbeddingData(index=i, embedding=_encode(v, body.encoding_format)) for i, v in enumerate(vectors)]
    total = sum(len(o.prompt_token_ids) for o in outputs)  # what the engine pooled over, after truncation
    response = EmbeddingResponse(data=data, model=model, usage=Usage(prompt_tokens=total, total_tokens=total))
    return JSONResponse(response.model_dump())


def _check_not_empty(prompt: object) -> None:
    if prompt == "":
        raise InvalidRequestError("input must not be an empty string", param="input")


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """base64 is little-endian float32, what the openai client decodes (and asks for by default)."""
    if encoding_format == "float":
        return vector
    packed = array("f", vector)  # C float: 4 bytes on every platform torch runs on
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")
