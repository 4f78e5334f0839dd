"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's extras): the server's own tokenizer."""

from __future__ import annotations

from fastapi import APIRouter

from tokenmill.errors import InvalidRequestError
from tokenmill_cli.server.chat import chat_prompt_ids
from tokenmill_cli.server.errors import ERROR_RESPONSES
from tokenmill_cli.server.protocol import DetokenizeRequest, TokenizeRequest
from tokenmill_cli.server.responses import DetokenizeResponse, TokenizeResponse
from tokenmill_cli.server.state import State

router = APIRouter(tags=["tokenizer"])


@router.post("/tokenize", responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, state: State) -> TokenizeResponse:
    """A prompt's token ids, or the ids of messages rendered as chat would render them."""
    state.model_name(body.model)
    if body.messages is not None:
        tokens = chat_prompt_ids(state, body.messages, body)
    else:
        assert body.prompt is not None
        tokens = list(state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    return TokenizeResponse(count=len(tokens), max_model_len=state.engine.max_model_len, tokens=tokens)


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, state: State) -> DetokenizeResponse:
    state.model_name(body.model)
    vocab = len(state.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})", param="tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))
