"""How closely a quantized model's greedy generation follows a float reference.

Weight-and-activation methods (FP8, INT8 W8A8) round the activations too, so
transformers on the dequantised weights is not bit-for-bit what they compute: a
near-tie between two tokens may flip. Comparing free-running generations would
count every position after a flip as a miss; instead transformers scores the
quantized model's own completion (teacher forcing), and each position counts as a
match when transformers' argmax there is the token tokenmill chose.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.layers import VocabEmbedding


@dataclass(frozen=True)
class Agreement:
    positions: int
    matching: int
    max_logprob_error: float  # |ours - reference| of the chosen token, over all positions

    @property
    def fraction(self) -> float:
        return self.matching / self.positions


def agreement_with_transformers(reference: Path, prompts: list[list[int]], completions: list[list[int]],
                                logprobs: list[list[float]],
                                prepare: Callable[[torch.nn.Module], None] | None = None) -> Agreement:
    """Score ``completions`` (with our chosen-token ``logprobs``) under transformers on
    ``reference``; ``prepare(model)`` may hook the model first (to round its inputs)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    if prepare is not None:
        prepare(model)
    positions = matching = 0
    worst = 0.0
    with torch.no_grad():
        for prompt, completion, ours in zip(prompts, completions, logprobs, strict=True):
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1: -1].float()
            reference_logprobs = torch.log_softmax(logits, dim=-1)
            chosen = torch.tensor(completion)
            positions += len(completion)
            matching += int((reference_logprobs.argmax(dim=-1) == chosen).sum())
            theirs = reference_logprobs[torch.arange(len(completion)), chosen]
            worst = max(worst, float((theirs - torch.tensor(ours)).abs().max()))
    return Agreement(positions, matching, worst)


def greedy_with_logprobs(folder: Path, prompts: list[list[int]], max_new_tokens: int,
                         **options: object) -> tuple[list[list[int]], list[list[float]]]:
    """tokenmill's greedy completions of ``prompts`` from ``folder`` and their chosen-token logprobs."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(folder), dtype="float32", max_model_len=96, kv_cache_memory="16MiB", **options)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, logprobs=0))
    completions = [out.outputs[0] for out in outputs]
    return ([list(c.token_ids) for c in completions],
            [[next(iter(step.values())).logprob for step in c.logprobs] for c in completions])


def rewrite_checkpoint(source: Path, target: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of the single-file checkpoint ``source`` whose tensors ``edit`` changed in place."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target, dirs_exist_ok=True)
    tensors = load_file(str(source / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def weight_storage(llm: object) -> tuple[dict[str, torch.dtype], int]:
    """The loaded model's linear-layer weight dtypes by layer prefix, and the bytes of all its
    parameters (read from the in-process worker through ``collective_rpc``)."""

    def look(worker: object) -> tuple[dict[str, torch.dtype], int]:
        model = worker.runner.model  # type: ignore[attr-defined]
        dtypes = {module.prefix: module.weight.dtype for module in model.modules()
                  if hasattr(module, "quant_method") and not isinstance(module, VocabEmbedding)  # (its own method)
                  and isinstance(getattr(module, "weight", None), torch.Tensor)}
        return dtypes, sum(p.numel() * p.element_size() for p in model.parameters())

    return llm.engine.core.executor.collective_rpc(look)[0]  # type: ignore[attr-defined]
