"""Turning what a caller sends into validated requests the core can run."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.errors import InvalidRequestError
from tokenmill.request import Request, RequestId
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from tokenmill.multimodal.inputs import MultiModalItem
    from tokenmill.multimodal.processor import MultiModalProcessor

# A text prompt, or vLLM's dict forms: {"prompt": str} / {"prompt_token_ids": [...]}; a text prompt
# of a multimodal model may add {"multi_modal_data": {"image": ...}, "mm_processor_kwargs": {...}}.
PromptType = str | Mapping[str, Any]
POOLING_TYPES = ("last", "mean", "cls")


@dataclass
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None
    mm_items: list[MultiModalItem] = field(default_factory=list)  # its images, where its tokens sit


class InputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int, eos_token_id: int | None,
                 extra_stop_token_ids: list[int],
                 validate_structured_outputs: Callable[[StructuredOutputsParams], None] | None = None) -> None:
        self.tokenizer = tokenizer
        # The structured-output backend's check: a bad schema, regex or grammar fails here, in the
        # submitting thread, as an InvalidRequestError, never inside the engine loop.
        self.validate_structured_outputs = validate_structured_outputs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.extra_stop_token_ids = extra_stop_token_ids
        # The longest prompt of a pooling request (an encoder may use every position); 0: as generating.
        self.max_pooling_prompt = 0
        # A multimodal model's processor (the model folder's own); None: prompts carry no images.
        self.multimodal: MultiModalProcessor | None = None
        # The most tokens one item may take where each is computed whole in one step (Gemma 3's
        # images: a step's token budget); 0: no bound.
        self.max_mm_item_tokens = 0

    def process_prompt(self, prompt: PromptType, pooling: bool = False,
                       truncate_prompt_tokens: int | None = None) -> ProcessedPrompt:
        """Tokenize and check ``prompt``. ``pooling``: for an embedding or score request, whose
        prompt may take the whole context. ``truncate_prompt_tokens``: keep at most that many
        tokens (-1, or more than the model takes: as many as it takes); a text is truncated by the tokenizer, which keeps its
        special tokens ([CLS] ... [SEP]), token ids by dropping the tail."""
        if truncate_prompt_tokens is not None:
            prompt = self._truncated(prompt, self._truncation_length(truncate_prompt_tokens, pooling))
        processed = self._process(prompt)
        if (self.multimodal is not None and not processed.mm_items
                and self.multimodal.image_token_id in processed.token_ids):
            raise InvalidRequestError("the prompt holds an image placeholder but no image was given "
                                      "(multi_modal_data)", param="prompt")
        if processed.mm_items and len(processed.token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt with its images takes {len(processed.token_ids)} tokens "
                f"({sum(i.length for i in processed.mm_items)} of them image tokens), which leaves no room to "
                f"generate within the model's context of {self.max_model_len} tokens (max_model_len)",
                param="multi_modal_data")
        self._check_item_sizes(processed.mm_items)
        self._validate(processed.token_ids, pooling)
        return processed

    def _check_item_sizes(self, items: list[MultiModalItem]) -> None:
        longest = max((item.length for item in items), default=0)
        if self.max_mm_item_tokens and longest > self.max_mm_item_tokens:
            raise InvalidRequestError(
                f"an image takes {longest} tokens, more than the {self.max_mm_item_tokens} one step computes "
                "(max_num_batched_tokens): this model attends within each image both ways, so an image is "
                "computed in one step", param="multi_modal_data")

    def _truncation_length(self, truncate_prompt_tokens: int, pooling: bool) -> int:
        limit = self.max_pooling_prompt if pooling and self.max_pooling_prompt else self.max_model_len - 1
        if truncate_prompt_tokens == -1:
            return limit
        if truncate_prompt_tokens < 1:
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or at least 1, got {truncate_prompt_tokens}",
                                      param="truncate_prompt_tokens")
        return min(truncate_prompt_tokens, limit)  # more than the model takes: as many as it takes

    def _truncated(self, prompt: PromptType, length: int) -> PromptType:
        text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, Mapping) else None
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            return {**prompt, "prompt_token_ids": list(prompt["prompt_token_ids"])[:length]}
        if isinstance(text, str) and text and self.tokenizer is not None:
            ids = self.tokenizer(text, truncation=True, max_length=length)["input_ids"]
            return {"prompt": text, "prompt_token_ids": list(ids)}
        return prompt

    def _process(self, prompt: PromptType) -> ProcessedPrompt:
        if prompt == "" or (isinstance(prompt, Mapping) and prompt.get("prompt") == ""):
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if isinstance(prompt, Mapping) and prompt.get("multi_modal_data"):
            return self._process_multimodal(prompt)
        if isinstance(prompt, str):
            processed = ProcessedPrompt(prompt, self._encode(prompt))
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            processed = ProcessedPrompt(prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]],
                                        prompt.get("cache_salt"))
        elif isinstance(prompt, Mapping) and isinstance(prompt.get("prompt"), str):
            processed = ProcessedPrompt(prompt["prompt"], self._encode(prompt["prompt"]), prompt.get("cache_salt"))
        else:
            raise InvalidRequestError(
                "a prompt is a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}", param="prompt")
        return processed

    def _process_multimodal(self, prompt: Mapping[str, Any]) -> ProcessedPrompt:
        if self.multimodal is None:
            raise InvalidRequestError("this model takes no images or other multimodal inputs (multi_modal_data)",
                                      param="multi_modal_data")
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise InvalidRequestError("a prompt with multi_modal_data is a text {'prompt': str, ...}, whose "
                                      "placeholders the model's processor expands", param="prompt")
        token_ids, items = self.multimodal.process(text, prompt["multi_modal_data"],
                                                   prompt.get("mm_processor_kwargs"),
                                                   add_special_tokens=bool(prompt.get("add_special_tokens", True)))
        return ProcessedPrompt(text, token_ids, prompt.get("cache_salt"), items)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send prompt_token_ids", param="prompt")
        return list(self.tokenizer.encode(text))

    def _validate(self, token_ids: list[int], pooling: bool = False) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if pooling and self.max_pooling_prompt:
            if len(token_ids) > self.max_pooling_prompt:
                raise InvalidRequestError(
                    f"the input has {len(token_ids)} tokens, more than this encoder's {self.max_pooling_prompt} "
                    "positions (set truncate_prompt_tokens to truncate it)", param="prompt")
        elif len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens, which leaves no room to generate within the model's "
                f"context of {self.max_model_len} tokens (max_model_len)", param="prompt")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1})",
                                      param="prompt")

    def make_pooling_request(self, request_id: str, prompt: ProcessedPrompt, pooling: str) -> Request:
        if pooling not in POOLING_TYPES:
            raise InvalidRequestError(f"pooling must be one of {POOLING_TYPES}, got {pooling!r}", param="pooling")
        return Request(request_id=RequestId(request_id), prompt_token_ids=prompt.token_ids,
                       sampling_params=SamplingParams(max_tokens=1), pooling=pooling, max_tokens=1,
                       cache_salt=prompt.cache_salt)

    def make_requests(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                      priority: int = 0, lora_name: str | None = None) -> list[Request]:
        """One request per sample; ``n > 1`` fans out into children ``{i}_{id}``."""
        if params.logit_bias and any(not 0 <= int(t) < self.vocab_size for t in params.logit_bias):
            raise InvalidRequestError("logit_bias names token ids outside the vocabulary", param="logit_bias")
        if params.structured_outputs is not None:
            if self.validate_structured_outputs is None:
                raise InvalidRequestError("this engine has no structured-output backend", param="structured_outputs")
            self.validate_structured_outputs(params.structured_outputs)
        room = self.max_model_len - len(prompt.token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        children = [params] if params.n == 1 else [params.for_child(i) for i in range(params.n)]
        ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        return [self._request(RequestId(rid), prompt, p, max_tokens, priority, lora_name)
                for rid, p in zip(ids, children, strict=True)]

    def _request(self, request_id: RequestId, prompt: ProcessedPrompt, params: SamplingParams, max_tokens: int,
                 priority: int, lora_name: str | None) -> Request:
        if self.extra_stop_token_ids and not params.ignore_eos:
            params = _with_stop_ids(params, self.extra_stop_token_ids)
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            priority=priority,
            lora_name=lora_name,
            cache_salt=prompt.cache_salt,
            max_tokens=max_tokens,
            mm_hashes=[(item.offset, item.length, item.content_hash) for item in prompt.mm_items],
            mm_inputs=list(prompt.mm_items),
        )


def _with_stop_ids(params: SamplingParams, extra: list[int]) -> SamplingParams:
    """The generation config's other EOS ids stop too (a copy: the caller's params stay as given)."""
    from dataclasses import replace

    merged = list(dict.fromkeys([*(params.stop_token_ids or []), *extra]))
    return replace(params, stop_token_ids=merged)
