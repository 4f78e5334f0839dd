"""The offline API, named and shaped as vLLM's so a vLLM script runs by
changing its import: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from tokenmill.config import EngineConfig
from tokenmill.engine.input_processor import PromptType
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.chat import Message, render_chat
from tokenmill.entrypoints.scoring import (
    check_classifier,
    cross_encoder_score,
    pair_max_length,
    pair_prompt,
    score_pairs,
)
from tokenmill.lora.request import LoRARequest
from tokenmill.metrics.stats import StatLogger
from tokenmill.multimodal.chat_media import media_placeholders, take_media
from tokenmill.outputs import RequestOutput
from tokenmill.pooling import finish_embedding
from tokenmill.pooling_outputs import (
    ClassificationOutput,
    EmbeddingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    cosine_similarity,
)
from tokenmill.sampling_params import SamplingParams


class LLM:
    """An engine in this process, for batches of prompts.

    Keyword arguments are :class:`~tokenmill.config.EngineConfig` fields
    (``dtype``, ``max_model_len``, ``enable_prefix_caching``,
    ``max_num_batched_tokens``, ``max_num_seqs``, ``seed``, ...).
    """

    def __init__(self, model: str | None = None, *, show_progress: bool = False,
                 stat_loggers: Sequence[StatLogger] | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(self.config, progress=show_progress, stat_loggers=list(stat_loggers or []))

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.
        ``lora_request``: one adapter for every prompt, or one (or None) per prompt; each is
        read and checked before any prompt runs (``LoRAAdapterError`` names a bad one).

        All prompts are validated before any runs, so a bad one raises
        ``InvalidRequestError`` without leaving the others half-done.
        """
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params_list = _per_prompt(sampling_params, len(prompt_list))
        loras = _per_prompt_lora(lora_request, len(prompt_list))
        for lora in dict.fromkeys(lora for lora in loras if lora is not None):
            self.engine.add_lora(lora)
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
                request_id = self.engine.next_request_id()
                prepared = self.engine.prepare_request(request_id, prompt, params, priority[i] if priority else 0,
                                                       lora_request=loras[i])
                self.engine.add_prepared(prepared, final_only=True)  # _run reads finished outputs only
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling: str = "auto", use_tqdm: bool = False,
              truncate_prompt_tokens: int | None = None,
              dimensions: int | None = None) -> list[PoolingRequestOutput[EmbeddingOutput]]:
        """Embed each prompt: the final hidden state of its last token (``last``), its first
        (``cls``), or the mean over its tokens; ``auto``: as the model's sentence-transformers
        files say (normalised where they say so), else the model family's default.
        ``dimensions`` truncates a Matryoshka model's embeddings."""
        info = self.engine.model_info
        check_classifier(info, False, "embed")
        pooled = self._pool(prompts, pooling, use_tqdm, truncate_prompt_tokens)
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids,
                                     EmbeddingOutput(finish_embedding(_pooled(o), info.pooler, dimensions)))
                for o in pooled]

    def classify(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = False,
                 truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput[ClassificationOutput]]:
        """Each prompt's class logits and probabilities, from a model with a classification head."""
        check_classifier(self.engine.model_info, True, "classify")
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids, ClassificationOutput.from_logits(_pooled(o)))
                for o in self._pool(prompts, "auto", use_tqdm, truncate_prompt_tokens)]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], use_tqdm: bool = False,
              truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput[ScoringOutput]]:
        """Relevance of each ``text_2`` to ``text_1`` (or of the zipped pairs): a cross-encoder's
        logit over the pair, or the cosine similarity of an embedding model's embeddings."""
        pairs = score_pairs(text_1, text_2)
        info = self.engine.model_info
        if not info.classifies:
            firsts = self.embed([a for a, _ in pairs], use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens)
            seconds = self.embed([b for _, b in pairs], use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens)
            return [PoolingRequestOutput(a.request_id, a.prompt_token_ids + b.prompt_token_ids,
                                         ScoringOutput(cosine_similarity(a.embedding, b.embedding)))
                    for a, b in zip(firsts, seconds, strict=True)]
        max_length = pair_max_length(info, truncate_prompt_tokens)
        prompts = [pair_prompt(self.engine.tokenizer, a, b, max_length) for a, b in pairs]
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(cross_encoder_score(_pooled(o))))
                for o in self._pool(prompts, "auto", use_tqdm, None)]

    def _pool(self, prompts: PromptType | Sequence[PromptType], pooling: str, use_tqdm: bool,
              truncate_prompt_tokens: int | None) -> list[RequestOutput]:
        """Run pooling requests; all are validated before any is queued."""
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        prepared = [self.engine.prepare_request(self.engine.next_request_id(), p, None, pooling=pooling,
                                                truncate_prompt_tokens=truncate_prompt_tokens)
                    for p in prompt_list]
        for request in prepared:
            self.engine.add_prepared(request)
        return self._run([p.request_id for p in prepared], use_tqdm)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation (or a list of them) and generate; ``tools``
        (OpenAI function tools) go to the template, which shows them to the model."""
        conversations = cast(list[Sequence[Message]],
                             [messages] if messages and isinstance(messages[0], dict) else list(messages))
        prompts = [self._chat_prompt(conv, chat_template, add_generation_prompt, continue_final_message, tools)
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _chat_prompt(self, conversation: Sequence[Message], chat_template: str | None, add_generation_prompt: bool,
                     continue_final_message: bool, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The prompt of one conversation: its token ids, or (with ``image_url`` content parts, for a
        multimodal model) its text with a placeholder where each image was, and the images."""
        conversation, media = take_media(conversation, media_placeholders(self.engine.input_processor.multimodal),
                                         self.config.allowed_local_media_path, self.config.media_fetch_policy())
        if not any(media.values()):
            return {"prompt_token_ids": self._chat_token_ids(conversation, chat_template, add_generation_prompt,
                                                             continue_final_message, tools)}
        text = render_chat(self.engine.tokenizer, conversation, chat_template, add_generation_prompt,
                           continue_final_message, tools)
        return {"prompt": text, "multi_modal_data": {k: v for k, v in media.items() if v}, "add_special_tokens": False}

    def _chat_token_ids(self, conversation: Sequence[Message], chat_template: str | None,
                        add_generation_prompt: bool, continue_final_message: bool,
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
        text = render_chat(self.engine.tokenizer, conversation, chat_template, add_generation_prompt,
                           continue_final_message, tools)
        # The template already holds the special tokens (BOS): do not add them again.
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [finished[i] for i in ids]


def _pooled(output: RequestOutput) -> list[float]:
    if output.embedding is None:
        raise RuntimeError(f"pooling request {output.request_id} ended without a result: {output.error}")
    return output.embedding


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)


def _per_prompt_lora(lora: LoRARequest | Sequence[LoRARequest | None] | None,
                     count: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * count
    if len(lora) != count:
        raise ValueError(f"got {len(lora)} LoRA requests for {count} prompts")
    return list(lora)


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="Generating", unit=" req")
