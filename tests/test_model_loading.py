"""Checkpoints from every source: sharded safetensors, the Hub cache offline, GGUF."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from tiny_models import build_tokenizer, hf_greedy

from tokenmill import LLM, SamplingParams

PROMPTS = [[5, 17, 33, 8, 91, 4], [120, 7, 7, 300, 41, 2, 99, 14, 250, 11, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


def test_sharded_safetensors(llama_path, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    build_tokenizer(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    llm = LLM(str(tmp_path), max_model_len=64, kv_cache_memory="8MiB")
    assert _tokens(llm) == [t for t, _ in hf_greedy(llama_path, PROMPTS, 8)]


def test_hub_id_from_the_local_cache_offline(llama_path, tmp_path):
    """A Hub id resolves through huggingface_hub's cache when HF_HUB_OFFLINE is set."""
    snapshot = tmp_path / "models--tiny-org--tiny-llama" / "snapshots" / "0123456789abcdef"
    shutil.copytree(llama_path, snapshot)
    (tmp_path / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (tmp_path / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("0123456789abcdef")
    code = (
        "from tokenmill import LLM, SamplingParams\n"
        "llm = LLM('tiny-org/tiny-llama', max_model_len=64, kv_cache_memory='8MiB')\n"
        f"out = llm.generate({{'prompt_token_ids': {PROMPTS[0]}}}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))\n"
        "print(out[0].outputs[0].token_ids)\n"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == str(hf_greedy(llama_path, PROMPTS[:1], 8)[0][0])


@pytest.fixture(scope="module")
def default_llm():
    return LLM(max_model_len=512, kv_cache_memory="256MiB")


@pytest.mark.slow
def test_default_model_answers_paris(default_llm):
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


@pytest.mark.slow
def test_default_gguf_model_matches_transformers_on_its_weights(default_llm):
    """The dequantised SmolLM2 in transformers, greedy, token for token."""
    import torch
    from transformers import LlamaForCausalLM

    from tokenmill_quant_gguf.weights import dequantized_weights

    checkpoint = default_llm.engine.core.checkpoint
    model = LlamaForCausalLM(checkpoint.hf_config).float()
    missing, unexpected = model.load_state_dict(dict(dequantized_weights(checkpoint.weights())), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    tokenizer = default_llm.get_tokenizer()
    prompt = tokenizer.encode("The capital of France is")
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    ours = default_llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12))
    assert ours[0].outputs[0].token_ids == expected.tolist()[: len(ours[0].outputs[0].token_ids)]
