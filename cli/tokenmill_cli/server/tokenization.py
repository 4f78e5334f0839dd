"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (vLLM's extras): the server's own
tokenizer. ``/tokenizer_info`` is served only with ``--enable-tokenizer-info-endpoint``, as in vLLM."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from tokenmill.errors import InvalidRequestError
from tokenmill_cli.server.chat import chat_prompt_ids_off_loop
from tokenmill_cli.server.errors import ERROR_RESPONSES
from tokenmill_cli.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest
from tokenmill_cli.server.responses import DetokenizeResponse, TokenizeResponse, TokenizerInfoResponse
from tokenmill_cli.server.state import State

router = APIRouter(tags=["tokenizer"])
info_router = APIRouter(tags=["tokenizer"])


@router.post("/tokenize", responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, state: State) -> TokenizeResponse:
    """A prompt's token ids, or the ids of messages rendered as chat would render them."""
    state.model_name(body.model)
    if isinstance(body, TokenizeChatRequest):
        tokens = await chat_prompt_ids_off_loop(state, body.messages, body)
    else:
        tokens = list(state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    return TokenizeResponse(count=len(tokens), max_model_len=state.engine.max_model_len, tokens=tokens)


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, state: State) -> DetokenizeResponse:
    state.model_name(body.model)
    vocab = state.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})", param="tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))


@info_router.get("/tokenizer_info", response_model=TokenizerInfoResponse, responses={401: ERROR_RESPONSES[401]})
async def tokenizer_info(state: State) -> dict[str, Any]:
    """What ``tokenizer_config.json`` would hold: the tokenizer's class and init arguments, its special
    tokens, and the chat template the server renders with (``--chat-template`` or the tokenizer's)."""
    return tokenizer_config(state.tokenizer, state.settings.chat_template)


def tokenizer_config(tokenizer: Any, chat_template: str | None = None) -> dict[str, Any]:
    config = {key: _json_safe(value) for key, value in getattr(tokenizer, "init_kwargs", {}).items()
              if key not in _NOT_CONFIG}
    config = {key: value for key, value in config.items() if value is not _UNSERIALIZABLE}
    config["tokenizer_class"] = type(tokenizer).__name__
    config.update({name: _json_safe(value) for name, value in tokenizer.special_tokens_map.items()})
    config["added_tokens_decoder"] = {str(i): _json_safe(token) for i, token in
                                      getattr(tokenizer, "added_tokens_decoder", {}).items()}
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template is not None:
        config["chat_template"] = template
    config["model_max_length"] = _json_safe(getattr(tokenizer, "model_max_length", None))
    return config


# init arguments that are objects or local paths, not configuration
_NOT_CONFIG = frozenset({"tokenizer_object", "tokenizer_file", "vocab_file", "merges_file", "gguf_file",
                         "name_or_path", "__slotnames__"})
_UNSERIALIZABLE = object()


def _json_safe(value: Any) -> Any:
    """Added tokens as their fields (as tokenizer_config.json writes them); anything else not JSON dropped."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    content = getattr(value, "content", None)
    if isinstance(content, str):  # tokenizers' AddedToken
        return {"content": content, **{f: getattr(value, f) for f in ("lstrip", "rstrip", "normalized",
                                                                        "single_word", "special")
                                       if hasattr(value, f)}}
    return _UNSERIALIZABLE
