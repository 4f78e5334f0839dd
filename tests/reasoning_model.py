"""A tiny Llama that *recites*: a reasoning model with a known reply, for testing how the server
splits ``<think>...</think>`` replies without a real reasoning model.

Random weights cannot be made to think, so this one is built to follow a script. Its attention and
MLP blocks write nothing (zero output projections), so the last hidden state is the current token's
embedding; its output head maps each script token's embedding onto the next script token. Greedy
decoding then continues any prompt that ends in a script token with the rest of the script, token by
token, through the real engine (and as transformers would run the same weights). The script is

    ":"  "<think>"  "\\n"  REASONING...  "</think>"  CONTENT...  "</s>"

so the DeepSeek-R1 style template, whose generation prompt ends in ``<think>\\n``, gets a reply that
starts inside its reasoning section, and the plain template (ending ``assistant:``) gets one that
opens ``<think>`` itself, as Qwen3 replies do.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from tiny_models import COMMON, build_tokenizer

START, END = "<think>", "</think>"
REASONING = "The tokens and blocks match"
CONTENT = "Paris is the capital of France"
# DeepSeek-R1's shape: the assistant turn opens the reasoning section in the prompt
R1_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
               "{% if add_generation_prompt %}<s>assistant:<think>\n{% endif %}")
PLAIN_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                  "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def script_ids(tokenizer) -> list[int]:
    """The script as token ids; each token occurs once, so every token has one successor."""
    ids = [*_ids(tokenizer, ":"), *_ids(tokenizer, START), *_ids(tokenizer, "\n"), *_ids(tokenizer, REASONING),
           *_ids(tokenizer, END), *_ids(tokenizer, CONTENT), tokenizer.eos_token_id]
    if len(set(ids)) != len(ids):
        raise ValueError(f"the script repeats a token, so its successor is ambiguous: {ids}")
    return ids


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def build_reasoning_model(folder: Path) -> Path:
    """Save the reciting Llama (float32) with a tokenizer that knows ``<think>`` and ``</think>``
    (added tokens, not special ones, as in DeepSeek-R1's and Qwen3's) and the R1 template."""
    import torch
    import transformers
    from tokenizers import AddedToken

    tokenizer = build_tokenizer(folder)
    tokenizer.add_tokens([AddedToken(START, special=False, normalized=False),
                          AddedToken(END, special=False, normalized=False)])
    tokenizer.chat_template = R1_TEMPLATE
    tokenizer.save_pretrained(folder)
    ids = script_ids(tokenizer)
    for template in (R1_TEMPLATE, PLAIN_TEMPLATE):  # each generation prompt ends on a script token
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template,
                                               tokenize=False, add_generation_prompt=True)
        if _ids(tokenizer, prompt)[-1] not in ids:
            raise ValueError(f"the prompt of {template!r} does not end on a script token")

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**COMMON)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:  # the blocks add nothing to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings = model.model.embed_tokens.weight
        embeddings.normal_(0, 1)
        head = model.lm_head.weight
        head.zero_()
        for token, successor in itertools.pairwise(ids):
            head[successor] = 10 * embeddings[token] / embeddings[token].norm()
    model.save_pretrained(folder, safe_serialization=True)
    return folder
