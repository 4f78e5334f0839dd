"""A third-party quantization method (tests/plugins/tokenmill-example-int8) end to end:
found through its entry point by the checkpoint's ``quant_method``, loaded through its
own weight loaders, and generating what transformers generates on the dequantised
weights."""

from __future__ import annotations

import random
from importlib.metadata import entry_points

import pytest
from int8_models import build_int8_pair
from tiny_models import hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.errors import UnsupportedQuantizationError
from tokenmill.plugins.manager import ENTRY_POINT_GROUP

MAX_NEW = 12


def _prompts(count: int = 6) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in (5, 11, 17, 26, 33, 48)[:count]]


@pytest.fixture(scope="module", params=["untied", "tied"])
def int8_pair(request, model_factory, tmp_path_factory):
    """(int8 checkpoint, dequantised twin) of a tiny Llama: untied with its lm_head left
    float by ``ignored_layers``, or with tied embeddings (the lm_head is the table)."""
    assert any(ep.name == "example-int8" for ep in entry_points(group=ENTRY_POINT_GROUP)), \
        "plugin 'example-int8' is not installed: run scripts/install --dev"
    arch, ignored = ("llama", ("lm_head",)) if request.param == "untied" else ("llama-tied-llama3rope", ())
    quantized, dequantized = tmp_path_factory.mktemp("int8"), tmp_path_factory.mktemp("dequantized")
    build_int8_pair(model_factory(arch), quantized, dequantized, ignored)
    return quantized, dequantized


@pytest.mark.parametrize("backend", ["sdpa", "cpu-paged"])
def test_int8_checkpoint_generates_like_transformers_on_dequantised_weights(int8_pair, backend):
    quantized, dequantized = int8_pair
    expected = hf_greedy(dequantized, _prompts(), MAX_NEW)
    # The checkpoint has no float weight for any decoder projection: loading it at all
    # needs the plugin's qweight/scales parameters.
    llm = LLM(str(quantized), dtype="float32", max_model_len=96, kv_cache_memory="16MiB", attention_backend=backend)
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                           SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0))
    for i, (out, (tokens, logprobs)) in enumerate(zip(outputs, expected, strict=True)):
        completion = out.outputs[0]
        assert completion.token_ids == tokens, f"prompt {i}: greedy tokens differ from the dequantised reference"
        ours = [next(iter(step.values())).logprob for step in completion.logprobs]
        assert ours == pytest.approx(logprobs, abs=1e-3), f"prompt {i}: logprobs differ"


def test_int8_checkpoint_splits_over_two_ranks(int8_pair):
    """Column- and row-parallel int8 layers (qweight sliced by output rows or input columns,
    the scales by output rows or whole): two ranks give the dequantised reference's tokens."""
    quantized, dequantized = int8_pair
    expected = [tokens for tokens, _ in hf_greedy(dequantized, _prompts(), MAX_NEW)]
    llm = LLM(str(quantized), dtype="float32", max_model_len=96, kv_cache_memory="16MiB", tensor_parallel_size=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                           SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [list(out.outputs[0].token_ids) for out in outputs] == expected
    llm.engine.shutdown()


def test_int8_checkpoint_differs_from_its_float_original(model_factory, tmp_path_factory):
    """The quantization is real: the int8 model's logprobs are not the float model's."""
    quantized, dequantized = tmp_path_factory.mktemp("int8"), tmp_path_factory.mktemp("dequantized")
    build_int8_pair(model_factory("llama"), quantized, dequantized, ("lm_head",))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    prompt = [{"prompt_token_ids": _prompts(1)[0]}]
    logprobs = []
    for folder in (quantized, model_factory("llama")):
        out = LLM(str(folder), dtype="float32", max_model_len=64, kv_cache_memory="8MiB").generate(prompt, params)
        logprobs.append([next(iter(step.values())).logprob for step in out[0].outputs[0].logprobs])
    assert logprobs[0] != pytest.approx(logprobs[1], abs=1e-6)


def test_the_quantization_option_names_the_method_or_is_refused(int8_pair):
    quantized, _ = int8_pair
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt = [{"prompt_token_ids": _prompts(1)[0]}]
    named = LLM(str(quantized), dtype="float32", max_model_len=64, kv_cache_memory="8MiB", quantization="example-int8")
    declared = LLM(str(quantized), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")
    assert named.generate(prompt, params)[0].outputs[0].token_ids == declared.generate(prompt, params)[0].outputs[0].token_ids
    with pytest.raises(UnsupportedQuantizationError, match="does not match"):
        LLM(str(quantized), dtype="float32", max_model_len=64, kv_cache_memory="8MiB", quantization="gguf")
