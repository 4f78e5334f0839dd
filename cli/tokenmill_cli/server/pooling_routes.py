"""The pooling routes: ``/v1/score`` and ``/v1/rerank`` (also at ``/score``, ``/rerank``,
``/v2/rerank``, as vLLM serves them), ``/classify`` and ``/pooling``.

A cross-encoder scores each (query, document) pair as one input; an embedding model
scores by the cosine similarity of the two embeddings. Rerank is score with the
documents sorted, most relevant first (Jina's and Cohere's request and response).
``/pooling`` returns what the pooler gave for each input, untouched (vLLM's raw pooling
output): no normalisation, no softmax, so a client can apply its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from tokenmill.engine.input_processor import PromptType
from tokenmill.entrypoints.scoring import (
    check_classifier,
    cross_encoder_score,
    pair_max_length,
    pair_prompt,
    score_pairs,
)
from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import RequestOutput
from tokenmill.pooling import finish_embedding
from tokenmill.pooling_outputs import ClassificationOutput, cosine_similarity
from tokenmill_cli.server.completions import engine_prompts
from tokenmill_cli.server.embeddings import _encode as encode_vector
from tokenmill_cli.server.errors import ERROR_RESPONSES
from tokenmill_cli.server.lifecycle import check_admitting
from tokenmill_cli.server.pooling_protocol import (
    ClassifyData,
    ClassifyRequest,
    ClassifyResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from tokenmill_cli.server.responses import Usage
from tokenmill_cli.server.state import ServerState, State
from tokenmill_cli.server.streaming import until_disconnected

router = APIRouter(tags=["pooling"])  # served for every model that pools
classify_router = APIRouter(tags=["pooling"])  # only for a classifier: the schema lists what the model can do
_ADMITTING = [Depends(check_admitting)]


@router.post("/v1/score", response_model=ScoreResponse, responses=ERROR_RESPONSES, dependencies=_ADMITTING)
@router.post("/score", response_model=ScoreResponse, responses=ERROR_RESPONSES, dependencies=_ADMITTING,
             include_in_schema=False)
async def create_score(body: ScoreRequest, request: Request, state: State) -> Response:
    return await until_disconnected(request, _score_route(body, state))


@router.post("/v1/rerank", response_model=RerankResponse, responses=ERROR_RESPONSES, dependencies=_ADMITTING)
@router.post("/rerank", response_model=RerankResponse, responses=ERROR_RESPONSES, dependencies=_ADMITTING,
             include_in_schema=False)
@router.post("/v2/rerank", response_model=RerankResponse, responses=ERROR_RESPONSES, dependencies=_ADMITTING,
             include_in_schema=False)
async def create_rerank(body: RerankRequest, request: Request, state: State) -> Response:
    return await until_disconnected(request, _rerank_route(body, state))


@classify_router.post("/classify", response_model=ClassifyResponse, responses=ERROR_RESPONSES, dependencies=_ADMITTING)
async def create_classify(body: ClassifyRequest, request: Request, state: State) -> Response:
    return await until_disconnected(request, _classify_route(body, state))


@router.post("/pooling", response_model=PoolingResponse, responses=ERROR_RESPONSES, dependencies=_ADMITTING)
async def create_pooling(body: PoolingRequest, request: Request, state: State) -> Response:
    return await until_disconnected(request, _pooling_route(body, state))


async def _score_route(body: ScoreRequest, state: ServerState) -> Response:
    model = state.model_name(body.model)
    scores, tokens = await score(state, score_pairs(body.text_1, body.text_2), body.truncate_prompt_tokens)
    data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
    return JSONResponse(ScoreResponse(model=model, data=data,
                                      usage=Usage(prompt_tokens=tokens, total_tokens=tokens)).model_dump())


async def _rerank_route(body: RerankRequest, state: ServerState) -> Response:
    model = state.model_name(body.model)
    scores, tokens = await score(state, [(body.query, d) for d in body.documents], body.truncate_prompt_tokens)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=body.documents[i]) if body.return_documents else None)
               for i in order]
    return JSONResponse(RerankResponse(model=model, results=results,
                                       usage=RerankUsage(total_tokens=tokens)).model_dump())


async def _classify_route(body: ClassifyRequest, state: ServerState) -> Response:
    model = state.model_name(body.model)
    info = state.engine.model_info
    check_classifier(info, True, "classify")
    texts = [body.input] if isinstance(body.input, str) else body.input
    outputs = await _pool_all(state, texts, body.truncate_prompt_tokens)
    data = []
    for i, output in enumerate(outputs):
        classes = ClassificationOutput.from_logits(_vector(output))
        best = max(range(classes.num_classes), key=classes.probs.__getitem__)
        label = info.class_labels[best] if best < len(info.class_labels) else f"LABEL_{best}"
        data.append(ClassifyData(index=i, label=label, probs=classes.probs, num_classes=classes.num_classes))
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return JSONResponse(ClassifyResponse(model=model, data=data,
                                         usage=Usage(prompt_tokens=tokens, total_tokens=tokens)).model_dump())


async def _pooling_route(body: PoolingRequest, state: ServerState) -> Response:
    model = state.model_name(body.model)
    prompts = engine_prompts(body.input, param="input")
    if "" in prompts:
        raise InvalidRequestError("input must not be an empty string", param="input")
    outputs = await _pool_all(state, prompts, body.truncate_prompt_tokens)
    data = [PoolingData(index=i, data=encode_vector(_vector(o), body.encoding_format)) for i, o in enumerate(outputs)]
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return JSONResponse(PoolingResponse(model=model, data=data,
                                        usage=Usage(prompt_tokens=tokens, total_tokens=tokens)).model_dump())


async def score(state: ServerState, pairs: list[tuple[str, str]], truncate: int | None) -> tuple[list[float], int]:
    """Each pair's score and the tokens read: a cross-encoder's logit, or the embeddings' cosine."""
    info = state.engine.model_info
    if info.classifies:
        max_length = pair_max_length(info, truncate)
        prompts = [pair_prompt(state.tokenizer, a, b, max_length) for a, b in pairs]
        outputs = await _pool_all(state, prompts, None)
        return [cross_encoder_score(_vector(o)) for o in outputs], sum(len(o.prompt_token_ids) for o in outputs)
    check_classifier(info, False, "score")
    outputs = await _pool_all(state, [text for pair in pairs for text in pair], truncate)
    vectors = [finish_embedding(_vector(o), info.pooler) for o in outputs]
    scores = [cosine_similarity(vectors[2 * i], vectors[2 * i + 1]) for i in range(len(pairs))]
    return scores, sum(len(o.prompt_token_ids) for o in outputs)


async def _pool_all(state: ServerState, prompts: Sequence[PromptType],
                    truncate: int | None) -> list[RequestOutput]:
    try:
        return list(await asyncio.gather(*[state.engine.pool(p, truncate_prompt_tokens=truncate) for p in prompts]))
    except InvalidRequestError as exc:  # the engine calls it the prompt; here it is the input
        raise InvalidRequestError(str(exc), param="input" if exc.param == "prompt" else exc.param) from exc


def _vector(output: RequestOutput) -> list[float]:
    assert output.embedding is not None  # pool() raises for a request that ended without one
    return output.embedding
