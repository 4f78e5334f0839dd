"""LoRA on a quantized base: a GPTQ checkpoint, and online fp8 and int8 of a float one.

The base layer computes with its quantized weights (and, for int8, and fp8 where the CPU's
weight-only fp8 kernel does not run, activations rounded per token); the adapter adds ``x A^T B^T`` on the unrounded activations, in float32.
The reference computes the same thing independently: transformers on the base's dequantised
twin with peft's adapter on top, each base linear's input rounded per token as the method
rounds it (e4m3 with ``max|x| / 448``, int8 with ``max|x| / 127``) while peft's LoRA branch
gets the input as it is. It scores tokenmill's own completions (teacher forcing,
tests/quant_agreement.py) of one mixed batch of three adapters and the base: every position
is the reference's argmax, and chosen-token logprobs agree within 1e-3.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from fp8_models import build_fp8_pair
from gptq_models import GptqRecipe, build_gptq_pair
from lora_models import ADAPTERS, build_adapter
from quant_agreement import agreement_with_transformers
from w8a8_models import build_w8a8_pair

from tokenmill import LLM, LoRARequest, SamplingParams

MAX_NEW = 12
PLAN = ["attn-r4", "all-r8", "mlp-rs16", None, "mlp-rs16", None, "attn-r4", "all-r8"]
KINDS = ["gptq", "fp8", "int8"]
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in (4, 9, 13, 20, 27, 31, 40, 52)]


@pytest.fixture(scope="module")
def adapters(llama_path, tmp_path_factory) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(build_adapter(llama_path, tmp_path_factory.mktemp(name), seed=i, **args)))
            for i, (name, args) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module", params=KINDS)
def quantized_base(request, llama_path, tmp_path_factory) -> tuple[str, Path, dict[str, object], Path]:
    """(kind, the folder tokenmill loads, its options, the dequantised twin)."""
    kind = request.param
    quantized, twin = tmp_path_factory.mktemp(f"{kind}-q"), tmp_path_factory.mktemp(f"{kind}-twin")
    if kind == "gptq":
        build_gptq_pair(llama_path, quantized, twin, GptqRecipe(bits=4, group_size=32, sym=True))
        return kind, quantized, {}, twin
    # online quantization of the float checkpoint is what these builders write (their plugins' tests)
    (build_fp8_pair(llama_path, quantized, twin, "per-channel") if kind == "fp8"
     else build_w8a8_pair(llama_path, quantized, twin))
    return kind, llama_path, {"quantization": kind}, twin


def _generate(folder: Path, options: dict[str, object], loras: list[LoRARequest | None] | None):
    lora_options = dict(enable_lora=True, max_loras=4, max_lora_rank=16) if loras is not None else {}
    llm = LLM(str(folder), dtype="float32", max_model_len=96, kv_cache_memory="16MiB", **options, **lora_options)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, lora_request=loras)
    llm.engine.shutdown()
    completions = [out.outputs[0] for out in outputs]
    return ([list(c.token_ids) for c in completions],
            [[next(iter(step.values())).logprob for step in c.logprobs] for c in completions])


def _round_per_token(kind: str, x: torch.Tensor) -> torch.Tensor:
    """A base linear's input as the quantized method sees it (GPTQ, and fp8 on the CPU's
    weight-only kernel where it builds: untouched)."""
    if kind == "gptq" or (kind == "fp8" and _fp8_weight_only()):
        return x
    top = 448.0 if kind == "fp8" else 127.0
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / top
    if kind == "fp8":
        return (x / scale).clamp(-top, top).to(torch.float8_e4m3fn).float() * scale
    return torch.round(x / scale).clamp(-top, top) * scale


def _fp8_weight_only() -> bool:
    """Whether fp8 layers run the CPU's weight-only kernel (quantization/fp8's cpu_kernel.py),
    which multiplies the float activations as they are."""
    from tokenmill_quant_fp8.cpu_kernel import load_fp8_cpu_kernel

    return load_fp8_cpu_kernel() is not None


def _with_adapter(kind: str, adapter: str | None):
    """``prepare`` for the reference: peft's adapter injected, every base linear's input rounded."""
    def prepare(model: torch.nn.Module) -> None:
        from peft import PeftModel

        if adapter is not None:
            PeftModel.from_pretrained(model, adapter)  # replaces the targets inside ``model`` itself
        for name, module in model.named_modules():
            if name.rpartition(".")[2] in LINEAR:
                base = getattr(module, "base_layer", module)  # a LoRA layer rounds its base's input only
                base.register_forward_pre_hook(lambda _m, args: (_round_per_token(kind, args[0]),))

    return prepare


def test_adapters_on_a_quantized_base_match_the_dequantised_reference(quantized_base, adapters):
    kind, folder, options, twin = quantized_base
    tokens, logprobs = _generate(folder, options, [adapters[n] if n else None for n in PLAN])
    base_tokens, _ = _generate(folder, options, None)
    prompts = _prompts()
    for name in (*ADAPTERS, None):
        rows = [i for i, planned in enumerate(PLAN) if planned == name]
        agreement = agreement_with_transformers(twin, [prompts[i] for i in rows], [tokens[i] for i in rows],
                                                [logprobs[i] for i in rows],
                                                prepare=_with_adapter(kind, adapters[name].lora_path if name else None))
        assert agreement.fraction == 1.0, f"{kind} + {name}: {agreement}"
        assert agreement.max_logprob_error <= 1e-3, f"{kind} + {name}: {agreement}"
        for i in rows:  # the adapter is really applied (and the base rows are the base's)
            assert (tokens[i] != base_tokens[i]) == (name is not None), f"{kind}: prompt {i} ({name})"
