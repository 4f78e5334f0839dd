"""Scoring a prompt, as lm-eval's loglikelihood does: ``max_tokens: 0`` with ``echo`` and ``logprobs``
returns the prompt, its tokens' logprobs (the first null) and nothing generated; vLLM's
``prompt_logprobs`` extra gives them keyed by token id. Both equal transformers' log-softmax."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from conftest import MODEL

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def reference(llama_path, http):
    """(prompt ids, log-softmax of transformers' logits at every position), float32."""
    from transformers import AutoModelForCausalLM

    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    with torch.no_grad():
        return ids, torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def test_echo_with_max_tokens_zero_scores_the_prompt(client, reference):
    ids, logsoftmax = reference
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    (choice,) = out.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [logsoftmax[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) in (1, 2) for top in lp.top_logprobs[1:])  # the chosen token and the likeliest


def test_token_id_prompts_and_batches_score_each_prompt(client, reference):
    ids, logsoftmax = reference
    out = client.completions.create(model=MODEL, prompt=[ids, ids[:4]], max_tokens=0, echo=True, logprobs=0)
    first, short = out.choices
    assert first.logprobs.token_logprobs[1:] == pytest.approx(
        [logsoftmax[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4)
    assert short.logprobs.token_logprobs[1:] == pytest.approx(first.logprobs.token_logprobs[1:4], abs=1e-5)


def test_streamed_scoring_sends_the_prompt_once_and_ends_as_length(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0, "stream": True}
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": "Bearer test-key"}) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    choices = [c for e in events[:-1] for c in json.loads(e)["choices"]]
    assert "".join(c["text"] for c in choices) == PROMPT
    assert choices[-1]["finish_reason"] == "length"


def test_prompt_logprobs_extra_keyed_by_token_id(client, reference):
    ids, logsoftmax = reference
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    entries = out.model_dump()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        entry = entries[pos]
        assert entry[str(ids[pos])]["logprob"] == pytest.approx(logsoftmax[pos - 1, ids[pos]].item(), abs=1e-4)
        top = torch.topk(logsoftmax[pos - 1], 2).indices.tolist()
        assert {str(t) for t in top} <= set(entry)
        assert {entry[str(t)]["rank"] for t in top} == {1, 2}
    assert len(out.choices[0].text) > 0  # generation goes on as asked


def test_prompt_logprobs_extra_on_chat(client, http):
    messages = [{"role": "user", "content": "Say hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                         extra_body={"prompt_logprobs": 0})
    ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    entries = out.model_dump()["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    assert all(str(ids[i]) in entries[i] for i in range(1, len(ids)))


def test_max_tokens_zero_without_echo_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert caught.value.body["param"] == "max_tokens" and "echo" in caught.value.body["message"]
