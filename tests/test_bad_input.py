"""Bad input: a clear, typed error naming the problem, and the engine goes on."""

from __future__ import annotations

import json
import shutil

import pytest

from tokenmill import (
    LLM,
    InvalidRequestError,
    ModelNotFoundError,
    SamplingParams,
    UnsupportedModelError,
)


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(str(llama_path), max_model_len=64, kv_cache_memory="8MiB")


def _ok(llm: LLM) -> None:
    out = llm.generate({"prompt_token_ids": [4, 5, 6]}, SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("prompt", ["", {"prompt_token_ids": []}, {"prompt": ""}])
def test_empty_prompt(llm, prompt):
    with pytest.raises(InvalidRequestError, match="empty") as error:
        llm.generate(prompt)
    assert error.value.param == "prompt"
    _ok(llm)


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(InvalidRequestError, match=r"64 tokens.*max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 64})
    _ok(llm)


def test_token_ids_outside_the_vocabulary(llm):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [5, 10**6]})


def test_a_bad_prompt_in_a_batch_runs_none_and_leaks_nothing(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([{"prompt_token_ids": [5, 6]}, ""])
    assert not llm.engine.has_unfinished_requests()
    stats = llm.engine.core.make_stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    _ok(llm)


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"max_tokens": -1}, "max_tokens"),  # 0 is a prompt-only request (scoring)
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"n": 0}, "n"),
    ({"min_p": 2.0}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"seed": 2**70}, "seed"),
])
def test_invalid_sampling_parameters_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidRequestError, match=param) as error:
        SamplingParams(**kwargs)
    assert error.value.param == param


def test_unknown_architecture(llama_path, tmp_path):
    shutil.copytree(llama_path, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"NoSuchModelForCausalLM.*LlamaForCausalLM") as error:
        LLM(str(tmp_path), max_model_len=64)
    for installed in ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"):
        assert installed in str(error.value)
    assert "docs/plugins.md" in str(error.value)


@pytest.mark.parametrize("model", ["/no/such/folder", "./missing-model", "weights.gguf"])
def test_model_path_that_does_not_exist(model):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        LLM(model)


def test_unknown_hub_id_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache"):
        LLM("no-such-org/no-such-model")


def test_invalid_engine_option():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="dtype"):
        LLM("/whatever", dtype="float7")
