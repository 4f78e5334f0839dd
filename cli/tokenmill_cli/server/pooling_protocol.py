"""Request and response bodies of the pooling routes: ``/v1/score``, ``/v1/rerank`` (Jina and
Cohere's shape), ``/classify`` and ``/pooling``, with vLLM's field names."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, WithJsonSchema, field_validator

from tokenmill.errors import InvalidRequestError
from tokenmill_cli.server.protocol import Prompt, _Request
from tokenmill_cli.server.responses import Usage, new_id, now

_Text = Annotated[str, Field(min_length=1)]
_Texts = Annotated[list[_Text], Field(min_length=1)]

# -1 (as many as the model takes) or a positive count; more than the model takes is as many as it takes
TruncatePromptTokens = Annotated[int | None, WithJsonSchema({
    "anyOf": [{"type": "integer", "minimum": 1}, {"const": -1}, {"type": "null"}],
    "description": "keep at most this many tokens of each input (-1: the model's maximum); a text is truncated "
                   "by the tokenizer, which keeps its special tokens"})]


def check_truncate(value: int | None) -> int | None:
    if value is not None and value != -1 and value < 1:
        raise InvalidRequestError("truncate_prompt_tokens is -1 or a positive number", param="truncate_prompt_tokens")
    return value


class _PoolingRequest(_Request):
    truncate_prompt_tokens: TruncatePromptTokens = None

    _check_truncate = field_validator("truncate_prompt_tokens")(classmethod(lambda cls, v: check_truncate(v)))


class ScoreRequest(_PoolingRequest):
    text_1: _Text | _Texts = Field(description="a query, or texts paired one to one with text_2")
    text_2: _Text | _Texts = Field(description="the texts to score against text_1")


class RerankRequest(_PoolingRequest):
    query: _Text
    documents: _Texts = Field(description="the texts to rank by their relevance to the query")
    top_n: Annotated[int, Field(ge=1)] | None = Field(None, description="return only the best top_n (default: all)")
    return_documents: bool = Field(True, description="echo each document's text in its result")


class ClassifyRequest(_PoolingRequest):
    input: _Text | _Texts = Field(description="a text or texts to classify")


class PoolingRequest(_PoolingRequest):
    input: Prompt = Field(description="text, texts, token ids or lists of token ids")
    encoding_format: Literal["float", "base64"] = "float"


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[ScoreData]
    usage: Usage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int = Field(description="the document's position in the request")
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("rerank"))
    model: str
    usage: RerankUsage
    results: list[RerankResult] = Field(description="most relevant first")


class ClassifyData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassifyResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("classify"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[ClassifyData]
    usage: Usage


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str = Field(description="the pooler's output for the input, as floats or base64 of "
                                    "little-endian float32: an embedding model's pooled state before any "
                                    "normalisation, a classifier's logits before softmax")


class PoolingResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("pool"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[PoolingData]
    usage: Usage
