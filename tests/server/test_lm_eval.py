"""lm-eval's ``local-completions`` model against a real ``tokenmill serve``: the loglikelihood of each
continuation in a tiny local task (tests/server/lm_eval_task) equals transformers' on the same float32
weights, with lm-eval tokenizing through the server (``remote``: /tokenizer_info, /tokenize) or
through the folder ``tokenmill tokenizer export`` writes. lm-eval scores with ``echo`` and
``max_tokens: 1``, summing the prompt logprobs after the context; everything runs offline."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from conftest import API_KEY, MODEL, tokenmill_command

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK_NAME = "tokenmill_tiny_continuations"


@pytest.fixture(scope="module")
def info_server(start_server, tiny_args):
    """The tiny Llama with /tokenizer_info on, behind the key (the same server test_tokenizer_export uses)."""
    return start_server(tiny_args("--enable-tokenizer-info-endpoint", "--api-key", API_KEY))


@pytest.fixture(scope="module")
def transformers_model(llama_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(llama_path)


def _task_config() -> dict:
    """The task YAML with its JSONL named absolutely (datasets resolves relative paths against the cwd)."""
    config = yaml.safe_load((TASK_DIR / "tiny_continuations.yaml").read_text())
    config["dataset_kwargs"] = {"data_files": {"train": str(TASK_DIR / "tiny_continuations.jsonl")}}
    return config


def _reference_loglikelihood(transformers_model, context: str, continuation: str) -> tuple[float, bool]:
    """log P(continuation | context) and whether every continuation token is the argmax, in transformers.

    The continuation's tokens are those of the whole text after the context's (how a causal scorer
    splits a pair, so a token spanning the boundary is not invented)."""
    model, tokenizer = transformers_model
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    start = len(tokenizer(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logsoftmax = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
    targets = torch.tensor(whole[start:])
    predicted = logsoftmax[start - 1 : len(whole) - 1]
    total = predicted.gather(1, targets[:, None]).sum().item()
    return total, bool((predicted.argmax(-1) == targets).all())


def _evaluate(server, tokenizer_args: dict) -> list[dict]:
    import lm_eval

    # auth_token is for the remote tokenizer's calls, header for the completions (lm-eval would send
    # OPENAI_API_KEY there); max_length is the server's context, tokenized_requests=False sends text.
    model_args = {"model": MODEL, "base_url": f"{server.url}/v1/completions", "tokenized_requests": False,
                  "auth_token": API_KEY, "header": {"Authorization": f"Bearer {API_KEY}"}, "max_retries": 1,
                  "max_length": 256, **tokenizer_args}
    results = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=[_task_config()],
                                      log_samples=True, bootstrap_iters=0)
    assert results is not None
    return results["samples"][TASK_NAME]


@pytest.fixture(scope="module")
def exported_tokenizer(llama_path, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("exported") / "tokenizer"
    done = subprocess.run([*tokenmill_command(), "tokenizer", "export", str(llama_path), str(folder)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return folder


@pytest.fixture(params=["remote", "exported"])
def tokenizer_args(request) -> dict:
    """lm-eval's tokenizer: the server's own (``remote``) or the exported folder loaded by transformers."""
    if request.param == "remote":
        return {"tokenizer_backend": "remote"}
    return {"tokenizer_backend": "huggingface", "tokenizer": str(request.getfixturevalue("exported_tokenizer"))}


def test_loglikelihoods_agree_with_transformers(info_server, transformers_model, tokenizer_args, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    samples = _evaluate(info_server, tokenizer_args)
    lines = (TASK_DIR / "tiny_continuations.jsonl").read_text().splitlines()
    assert len(samples) == len(lines)
    for sample in samples:
        ((context, continuation),) = sample["arguments"]  # the one request lm-eval built from this line
        assert (context, continuation) == (sample["doc"]["context"], sample["doc"]["continuation"])
        ((loglikelihood, is_greedy),) = sample["filtered_resps"]  # the one response, no filter
        expected, expected_greedy = _reference_loglikelihood(transformers_model, context, continuation)
        assert loglikelihood == pytest.approx(expected, abs=1e-4), sample["doc"]
        assert is_greedy == expected_greedy, sample["doc"]
