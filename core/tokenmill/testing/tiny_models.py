"""Tiny random-weight checkpoints built with transformers, and greedy runs on both engines.

No hub is reachable where the kit runs, so it makes its checkpoints itself: a
byte-level BPE tokenizer trained on a few sentences and a model of any
transformers config, saved with ``save_pretrained`` (safetensors) exactly as a real
checkpoint folder looks. The repository's own tests build theirs through the same
functions (tests/tiny_models.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the key value cache in fixed size blocks.",
    "Continuous batching schedules prefill and decode tokens together.",
    "A scheduler hands out a token budget to the running requests first.",
    "Prefix caching reuses blocks whose tokens and parents match.",
    "What is the capital of France? The capital of France is Paris.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 and 1000 appear too.",
] * 20

VOCAB_SIZE = 384
# The special tokens build_tokenizer trains first, so their ids are fixed.
BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID = 0, 1, 2
# The sizes of the repository's tiny models: 2 layers, 64 wide, 4 heads over 2 KV heads.
TINY_DIMENSIONS: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID,
    pad_token_id=PAD_TOKEN_ID,
)


def build_tokenizer(folder: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - 8, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    fast.save_pretrained(folder)
    return fast


def save_random_model(folder: Path, config: Any, model_class: str, seed: int = 0) -> Path:
    """Save a random-weight ``transformers.<model_class>(config)`` in float32 (and the
    shared tokenizer) into ``folder``. ``config`` should use :data:`VOCAB_SIZE` and the
    token ids above so the tokenizer fits it."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).to(torch.float32)
    head = getattr(model, "lm_head", None)
    with torch.no_grad():  # random init gives near-uniform logits; widen them so argmax is robust
        if head is not None and not getattr(config, "tie_word_embeddings", False):
            head.weight.normal_(0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer(folder)
    return folder


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int,
              pad_token_id: int = PAD_TOKEN_ID) -> list[tuple[list[int], list[float]]]:
    """Greedy generation with transformers ``generate``: token ids and chosen-token logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    results = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=pad_token_id,
            )
            tokens = out.sequences[0, len(prompt):].tolist()
            logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens, strict=True)]
            results.append((tokens, logprobs))
    return results


def tokenmill_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int,
                     **options: Any) -> list[list[int]]:
    """tokenmill's greedy completions of ``prompts`` (float32, EOS ignored, as ``hf_greedy``)."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(folder), **{"dtype": "float32", "max_model_len": 128, "kv_cache_memory": "16MiB", **options})
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True))
    return [list(out.outputs[0].token_ids) for out in outputs]
