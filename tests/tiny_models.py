"""Tiny random-weight checkpoints built with transformers, for golden tests.

No hub is reachable, so tests make their own: a byte-level BPE tokenizer
trained on a few sentences, and small Llama / Mistral / Qwen2 / Qwen3
models saved with ``save_pretrained`` (safetensors), exactly as a real
checkpoint folder looks.
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


COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)

ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied-llama3rope": ("LlamaConfig", "LlamaForCausalLM", {
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    }),
    "llama-yarn": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 64},
    }),
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    }),
    "llama-dynamic-rope": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    }),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16, "head_dim": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "llama-one-kv-head": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 1}),
}


def build_model(folder: Path, arch: str, seed: int = 0) -> Path:
    """Save a tiny random model of ``arch`` (and the shared tokenizer) into ``folder``."""
    import torch
    import transformers

    config_name, model_name, extra = ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**COMMON, **extra})
    model = getattr(transformers, model_name)(config).to(torch.float32)
    with torch.no_grad():  # random init gives near-uniform logits; widen them so argmax is robust
        model.lm_head.weight.normal_(0, 0.5) if not config.tie_word_embeddings else None
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer(folder)
    return folder


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
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
                return_dict_in_generate=True, pad_token_id=COMMON["pad_token_id"],
            )
            tokens = out.sequences[0, len(prompt):].tolist()
            logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens, strict=True)]
            results.append((tokens, logprobs))
    return results
