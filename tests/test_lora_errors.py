"""Bad adapters fail with a typed error naming the adapter and the problem, and the engine
keeps serving; requests naming an adapter that is not loaded fail likewise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from lora_models import build_adapter, build_adapter_for_other_base

from tokenmill import LLM, InvalidRequestError, LoRARequest, SamplingParams
from tokenmill.lora import LoRAAdapterError, LoRAAdapterNotFoundError

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}


@pytest.fixture(scope="module")
def good(llama_path, tmp_path_factory) -> LoRARequest:
    folder = build_adapter(llama_path, tmp_path_factory.mktemp("good"), r=4, lora_alpha=8,
                           target_modules=["q_proj", "down_proj"])
    return LoRARequest("good", 1, str(folder))


@pytest.fixture(scope="module")
def llm(llama_path) -> LLM:
    return LLM(str(llama_path), dtype="float32", max_model_len=64, kv_cache_memory="8MiB", enable_lora=True,
               max_loras=2, max_lora_rank=8)


def _bad_adapters(llama_path, good, tmp_path) -> dict[str, tuple[str, str]]:
    """name -> (lora_path, words the error must contain)."""
    corrupt = shutil.copytree(good.lora_path, tmp_path / "corrupt")
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])  # truncated mid-header
    return {
        "missing": (str(tmp_path / "no-such-adapter"), "no adapter folder"),
        "too-wide": (str(build_adapter(llama_path, tmp_path / "r16", r=16, target_modules=["q_proj"])),
                     "above max_lora_rank=8"),
        "norm-listed": (str(_rewritten(good, tmp_path / "norm-listed", target_modules=["q_proj", "input_layernorm"])),
                        "targets modules ['input_layernorm'], which tokenmill cannot apply LoRA to"),
        "norm-weights": (str(_rewritten(good, tmp_path / "norm-weights", target_modules=".*norm",
                                        rename=("self_attn.q_proj", "input_layernorm"))),
                         "targets modules ['model.layers.0.input_layernorm', 'model.layers.1.input_layernorm'], "
                         "which tokenmill cannot apply LoRA to"),
        "extra-vocab": (str(_with_extra_tokens(llama_path, tmp_path / "extra-vocab", 8)),
                        "an adapter that adds tokens (extra vocabulary) is not served"),
        "other-base": (str(build_adapter_for_other_base(tmp_path / "other", r=4, target_modules=["q_proj"])),
                       "trained for another base model"),
        "corrupt": (str(corrupt), "not a readable safetensors file"),
    }


def _rewritten(adapter: LoRARequest, folder: Path, rename: tuple[str, str] | None = None, **config: Any) -> Path:
    """A copy of ``adapter`` with ``config`` in its adapter_config.json and its weights' names renamed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter.lora_path, folder)
    file = folder / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
    if rename is not None:
        weights = folder / "adapter_model.safetensors"
        save_file({key.replace(*rename): tensor for key, tensor in load_file(weights).items()}, weights)
    return folder


def _with_extra_tokens(llama_path: Path, folder: Path, extra: int) -> Path:
    """An embedding adapter trained after the vocabulary grew by ``extra`` tokens (its table and A have more rows)."""
    import torch
    from safetensors.torch import load_file, save_file

    build_adapter(llama_path, folder, r=4, target_modules=["embed_tokens"])
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(weights)
    for key, tensor in tensors.items():
        grow = 0 if key.endswith("base_layer.weight") else 1 if key.endswith("lora_embedding_A") else None
        if grow is not None:
            shape = list(tensor.shape)
            shape[grow] = extra
            tensors[key] = torch.cat([tensor, torch.randn(shape)], dim=grow)
    save_file(tensors, weights)
    return folder


def test_bad_adapters_raise_a_typed_error_naming_them(llm, llama_path, good, tmp_path):
    for name, (path, problem) in _bad_adapters(llama_path, good, tmp_path).items():
        with pytest.raises(LoRAAdapterError) as caught:
            llm.generate(PROMPT, PARAMS, lora_request=LoRARequest(name, 9, path))
        assert caught.value.lora_name == name and f"LoRA adapter {name!r}" in str(caught.value)
        assert problem in caught.value.problem, caught.value.problem
        assert isinstance(caught.value, InvalidRequestError)  # the server's 400
    # the engine goes on serving, the good adapter and the base model alike
    with_adapter, base = llm.generate([PROMPT, PROMPT], PARAMS, lora_request=[good, None])
    assert len(with_adapter.outputs[0].token_ids) == len(base.outputs[0].token_ids) == 4
    assert with_adapter.outputs[0].token_ids != base.outputs[0].token_ids


def test_an_unknown_or_unloaded_adapter_is_not_found(llm, good):
    llm.generate(PROMPT, PARAMS, lora_request=good)
    llm.engine.remove_lora("good")
    prepared = llm.engine.prepare_request("x", PROMPT, PARAMS, lora_request=good)
    with pytest.raises(LoRAAdapterNotFoundError, match="'good'"):
        llm.engine.add_prepared(prepared)
    with pytest.raises(LoRAAdapterNotFoundError):
        llm.engine.remove_lora("good")
    assert llm.generate(PROMPT, PARAMS, lora_request=good)[0].outputs[0].token_ids  # registered again


def test_an_adapter_never_shares_kv_with_another_or_the_base(llm, good):
    """The adapter is part of the prefix-cache key: a prompt cached for the base is no hit for it."""
    prompt = {"prompt_token_ids": list(range(10, 50))}
    llm.generate(prompt, PARAMS)
    first = llm.generate(prompt, PARAMS, lora_request=good)[0]
    again = llm.generate(prompt, PARAMS, lora_request=good)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens > 0


def test_the_kv_follows_the_adapters_weights_not_its_name(llm, llama_path, good, tmp_path):
    """A name unloaded and registered again with other weights never meets the blocks its old
    weights left; the same weights under two names share theirs."""
    prompt = {"prompt_token_ids": list(range(60, 100))}
    other = LoRARequest("other", 2, str(build_adapter(llama_path, tmp_path / "other", seed=7, r=4, lora_alpha=8,
                                                      target_modules=["q_proj", "down_proj"])))
    with_good = llm.generate(prompt, PARAMS, lora_request=good)[0]
    with_other = llm.generate(prompt, PARAMS, lora_request=other)[0]
    assert with_other.outputs[0].token_ids != with_good.outputs[0].token_ids
    llm.engine.remove_lora("good")
    renamed = LoRARequest("good", 1, other.lora_path)
    again = llm.generate(prompt, PARAMS, lora_request=renamed)[0]
    assert again.outputs[0].token_ids == with_other.outputs[0].token_ids
    assert again.num_cached_tokens > 0  # the blocks "other" left
    llm.engine.remove_lora("good")  # the later tests register the original again


def test_lora_needs_enable_lora(llama_path, good):
    plain = LLM(str(llama_path), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        plain.generate(PROMPT, PARAMS, lora_request=good)


def test_lora_metrics(llama_path, good):
    """Adapters resident in slots and host memory, requests per resident adapter, load times."""
    from prometheus_client import CollectorRegistry

    from tokenmill.metrics.prometheus import PrometheusStatLogger

    registry = CollectorRegistry()
    llm = LLM(str(llama_path), dtype="float32", max_model_len=64, kv_cache_memory="8MiB", enable_lora=True,
              max_loras=2, max_lora_rank=8, stat_loggers=[PrometheusStatLogger("m", registry)])
    llm.generate([PROMPT] * 3, PARAMS, lora_request=[good, good, None])

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(f"tokenmill:{name}", {"model_name": "m", **labels})

    assert value("lora_adapters_in_slots") == 1 and value("lora_adapters_in_host") == 1
    assert value("lora_requests", lora_name="good") == 0  # resident, its requests finished
    assert value("lora_load_seconds_count") == 1
    assert value("num_requests_waiting_for_lora") == 0


def test_fewer_host_cache_entries_than_slots_is_refused(llama_path):
    with pytest.raises(ValueError, match="max_cpu_loras=1 is below max_loras=2"):
        LLM(str(llama_path), dtype="float32", max_model_len=128, enable_lora=True, max_loras=2, max_cpu_loras=1)
