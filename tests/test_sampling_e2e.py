"""Sampling and stopping through the whole engine."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams

PROMPT = {"prompt_token_ids": [12, 40, 7, 99, 3, 250]}


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(str(llama_path), max_model_len=128, kv_cache_memory="16MiB")


def _tokens(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def test_seeded_sampling_reproduces_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = _tokens(llm.generate(PROMPT, params))
    crowd = [{"prompt_token_ids": [i + 3, 8, 9]} for i in range(5)]
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    together = llm.generate([*crowd, PROMPT], [unseeded] * 5 + [params])
    assert _tokens(together[-1:]) == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=4321, ignore_eos=True)
    assert _tokens(llm.generate(PROMPT, other_seed)) != alone


def test_n_samples_differ_when_sampling(llm):
    out = llm.generate(PROMPT, SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True))
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2, 3]
    samples = [tuple(c.token_ids) for c in out[0].outputs]
    assert len(set(samples)) == 4


def test_n_greedy_samples_agree_and_seeded_n_reproduces(llm):
    greedy = llm.generate(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True))
    assert greedy[0].outputs[0].token_ids == greedy[0].outputs[1].token_ids
    seeded = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True)
    assert _tokens(llm.generate(PROMPT, seeded)) == _tokens(llm.generate(PROMPT, seeded))


def test_max_tokens_and_finish_reason_length(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_max_model_len_caps_generation(llm):
    prompt = {"prompt_token_ids": [7] * 120}
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


def test_stop_token_ids(llm):
    free = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                              stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_eos_stops_unless_ignored_and_min_tokens_holds_it_back(llm):
    free = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    eos = free.token_ids[2]
    llm.engine.input_processor.eos_token_id = eos  # pretend this token is the model's EOS
    try:
        stopped = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
        assert stopped.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
        held = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, min_tokens=6))[0].outputs[0]
        assert len(held.token_ids) >= 6 and eos not in held.token_ids[:6]
    finally:
        llm.engine.input_processor.eos_token_id = 1


def test_stop_strings_cut_the_text(llm):
    free = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    cut = text[: text.index(stop)]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))
    assert out[0].outputs[0].text == cut
    assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].stop_reason == stop
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop,
                                               include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == cut + stop


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_detokenized_text_equals_a_full_decode(llm, seed):
    """Incremental text is the full decode's continuation of the prompt, except an
    incomplete UTF-8 sequence at the very end, which is held back rather than shown as U+FFFD."""
    prompt = "The quick brown fox"
    out = llm.generate(prompt, SamplingParams(temperature=0.9, seed=seed, max_tokens=20, ignore_eos=True))[0]
    tokenizer = llm.get_tokenizer()
    whole = tokenizer.decode(out.prompt_token_ids + out.outputs[0].token_ids, skip_special_tokens=True)
    continuation = whole[len(tokenizer.decode(out.prompt_token_ids)):]
    text = out.outputs[0].text
    assert continuation.startswith(text)
    assert set(continuation[len(text):]) <= {"\ufffd"}


def test_logprobs_and_prompt_logprobs_match_transformers(llm, llama_path):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate(PROMPT, params)[0]
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    ids = PROMPT["prompt_token_ids"] + out.outputs[0].token_ids
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    prompt_len = len(PROMPT["prompt_token_ids"])
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == prompt_len
    for pos in range(1, prompt_len):
        entry = out.prompt_logprobs[pos]
        token = ids[pos]
        assert entry[token].logprob == pytest.approx(reference[pos - 1, token].item(), abs=1e-4)
        assert entry[token].rank == int((reference[pos - 1] > reference[pos - 1, token]).sum()) + 1
    for step, entry in enumerate(out.outputs[0].logprobs):
        row = reference[prompt_len - 1 + step]
        top = torch.topk(row, 3)
        for rank, (value, token) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
            assert entry[token].logprob == pytest.approx(value, abs=1e-4)
            assert entry[token].rank == rank
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(reference[prompt_len - 1 + i, t].item() for i, t in enumerate(out.outputs[0].token_ids)), abs=1e-3)


def test_max_tokens_zero_scores_the_prompt_and_samples_nothing(llm, llama_path):
    """A prompt-only request (max_tokens 0) is prefilled for its logprobs, and no token is drawn:
    the same prompt logprobs as transformers', no output token, finish_reason "length"."""
    from transformers import AutoModelForCausalLM

    ids = PROMPT["prompt_token_ids"]
    scored, batched = llm.generate([PROMPT, {"prompt_token_ids": [5, 6, 7]}],
                                   [SamplingParams(max_tokens=0, prompt_logprobs=1, n=2),
                                    SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
    assert [(c.token_ids, c.text, c.finish_reason) for c in scored.outputs] == [([], "", "length")] * 2
    assert len(batched.outputs[0].token_ids) == 3  # a generating neighbour in the same steps is unaffected
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        assert scored.prompt_logprobs[pos][ids[pos]].logprob == pytest.approx(reference[pos - 1, ids[pos]].item(),
                                                                              abs=1e-4)
    (plain,) = llm.generate(PROMPT, SamplingParams(max_tokens=0))
    assert plain.outputs[0].token_ids == [] and plain.outputs[0].finish_reason == "length"


def test_penalties_change_greedy_output(llm):
    base = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = _tokens(llm.generate(PROMPT, base))[0]
    penalised = _tokens(llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                            repetition_penalty=5.0, frequency_penalty=2.0)))[0]
    assert penalised != plain
    assert len(set(penalised)) >= len(set(plain))


def test_repetition_penalty_equals_transformers_over_many_steps(llm, llama_path):
    """The penalty sees every token generated so far, at every step of a batch whose
    requests stop one after another (the runner reuses a batch's sampling metadata while
    its requests stay the same: the token lists in it must be the live ones)."""
    from transformers import AutoModelForCausalLM

    prompts = [{"prompt_token_ids": [*PROMPT["prompt_token_ids"][: 6 - i], 5 + i]} for i in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=12 + 4 * i, ignore_eos=True, repetition_penalty=1.8)
              for i in range(3)]
    outputs = _tokens(llm.generate(prompts, params))
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    for prompt, param, tokens in zip(prompts, params, outputs, strict=True):
        ids = torch.tensor([prompt["prompt_token_ids"]])
        reference = model.generate(ids, do_sample=False, repetition_penalty=1.8, max_new_tokens=param.max_tokens,
                                   min_new_tokens=param.max_tokens, pad_token_id=0)
        assert tokens == reference[0, ids.shape[1]:].tolist()


def test_embeddings_equal_transformers_hidden_states(llm, llama_path):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(llama_path, dtype=torch.float32)
    prompt = [5, 9, 100, 7, 23, 11, 8]
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    last = llm.embed({"prompt_token_ids": prompt})[0].embedding
    mean = llm.embed({"prompt_token_ids": prompt}, pooling="mean")[0].embedding
    assert torch.allclose(torch.tensor(last), hidden[-1], atol=1e-4)
    assert torch.allclose(torch.tensor(mean), hidden.mean(0), atol=1e-4)
