"""LoRA on the vocabulary layers (the token embedding, PEFT's ``lora_embedding_A/B``, and the
lm_head) against transformers + peft on the same weights (float32): two adapters on both and
the base model in one mixed batch, with chunked prefill and prompt logprobs (the lm_head then
runs on prompt spans as well as on the sampled rows)."""

from __future__ import annotations

import random

import pytest
import torch
from lora_models import build_adapter, peft_greedy

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.layers import ModelBuildContext, ParallelLMHead, load_weight
from tokenmill.lora.adapter import LoRAModuleWeights
from tokenmill.lora.layers import LoRABatch
from tokenmill.lora.vocab_layers import wrap_lm_head

MAX_NEW = 8
ADAPTERS = {
    "vocab-r4": {"r": 4, "lora_alpha": 8, "target_modules": ["embed_tokens", "lm_head", "q_proj"]},
    "vocab-rs8": {"r": 8, "lora_alpha": 4, "use_rslora": True, "target_modules": ["lm_head", "embed_tokens",
                                                                                   "down_proj"]},
}
PLAN = ["vocab-r4", "vocab-rs8", None, "vocab-rs8", "vocab-r4", None]


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in (6, 13, 21, 30, 37, 9)]


@pytest.fixture(scope="module")
def adapters(llama_path, tmp_path_factory) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(build_adapter(llama_path, tmp_path_factory.mktemp(name), seed=5 + i,
                                                             **args)))
            for i, (name, args) in enumerate(ADAPTERS.items())}


def _peft_prompt_logprobs(base, adapter: str | None, prompt: list[int]) -> list[float]:
    """Each prompt token's logprob after the ones before it (from the second token on)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()


def test_embedding_and_lm_head_adapters_in_one_mixed_batch_match_peft(llama_path, adapters):
    prompts = _prompts()
    folders = [adapters[name].lora_path if name else None for name in PLAN]
    expected = [peft_greedy(llama_path, folder, [prompt], MAX_NEW)[0] for prompt, folder in zip(prompts, folders,
                                                                                                 strict=True)]
    base = peft_greedy(llama_path, None, prompts, MAX_NEW)
    assert [tokens != b[0] for (tokens, _), b in zip(expected, base, strict=True)] == [n is not None for n in PLAN]

    llm = LLM(str(llama_path), dtype="float32", max_model_len=128, kv_cache_memory="16MiB", enable_lora=True,
              max_loras=2, max_lora_rank=8, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                           lora_request=[adapters[n] if n else None for n in PLAN])
    for i, (out, (tokens, logprobs)) in enumerate(zip(outputs, expected, strict=True)):
        completion = out.outputs[0]
        assert completion.token_ids == tokens, f"prompt {i} ({PLAN[i]}): greedy tokens differ from peft"
        ours = [next(iter(step.values())).logprob for step in completion.logprobs]
        assert ours == pytest.approx(logprobs, abs=1e-3), f"prompt {i} ({PLAN[i]})"
    for i in (0, 3):  # prompt logprobs run the lm_head on prompt spans, chunk by chunk
        ours = [step[token].logprob for step, token in zip(outputs[i].prompt_logprobs[1:], prompts[i][1:],
                                                           strict=True)]
        assert ours == pytest.approx(_peft_prompt_logprobs(llama_path, folders[i], prompts[i]), abs=1e-3)


def test_a_tensor_parallel_lm_head_adds_each_rank_its_slice_of_the_adapter():
    """Vocabulary 10 over 3 ranks (4 rows each, the last padded): a rank's own logits slice gets the
    columns of the whole head's delta it holds; the gathered (whole) logits get all of them."""
    torch.manual_seed(0)
    hidden, vocab, rank, slots = 6, 10, 2, 2
    weight, x = torch.randn(vocab, hidden), torch.randn(5, hidden)
    adapter = LoRAModuleWeights(torch.randn(rank, hidden), torch.randn(vocab, rank))
    mask = torch.tensor([[0, 1], [1, 0], [0, 0], [0, 1], [0, 1]], dtype=torch.float32)
    expected = x @ weight.T + (x @ adapter.lora_a.T) @ adapter.lora_b.T * mask[:, 1:]
    for r in range(3):
        ctx = ModelBuildContext(hf_config=None, rank=r, world_size=3, params_dtype=torch.float32)
        head = ParallelLMHead(hidden, vocab, ctx=ctx)
        load_weight(head.weight, weight)
        lora = wrap_lm_head(head, slots, rank, LoRABatch())
        lora.set_slot(1, [adapter])
        local = head.quant_method.apply(head, x)  # this rank's slice, as the gather leaves it on a rank but 0
        ours = lora.head_delta_into(x, local.clone(), mask, None)
        columns = slice(4 * r, min(4 * r + 4, vocab))
        torch.testing.assert_close(ours[:, : columns.stop - columns.start], expected[:, columns])
        whole = lora.head_delta_into(x, x @ weight.T, mask, None)  # rank 0's gathered logits
        torch.testing.assert_close(whole, expected)
