"""/v1/completions through the openai client: batches, n, logprobs, echo, stop strings, seeds, streaming."""

from __future__ import annotations

import math

import pytest
from conftest import MODEL

PROMPT = "The quick brown fox"
GREEDY = dict(model=MODEL, temperature=0, max_tokens=24, extra_body={"ignore_eos": True})


def _streamed(client, **kwargs):
    """(text per choice index, finish reason per index, usage) from a streamed completion."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                assert choice.index not in finish, "a choice finished twice"
                finish[choice.index] = choice.finish_reason
    return texts, finish, usage


def test_completion_basic(client):
    out = client.completions.create(prompt=PROMPT, **GREEDY)
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    (choice,) = out.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert out.usage.completion_tokens == 24
    assert out.usage.total_tokens == out.usage.prompt_tokens + 24


def test_prompt_forms_give_the_same_text(client, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(prompt=PROMPT, **GREEDY).choices[0].text
    by_ids = client.completions.create(prompt=ids, **GREEDY).choices[0].text
    batch = client.completions.create(prompt=[PROMPT, "Paged attention"], **GREEDY)
    id_batch = client.completions.create(prompt=[ids, ids], **GREEDY)
    assert by_ids == by_text
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == by_text
    assert [c.text for c in id_batch.choices] == [by_text, by_text]


def test_stream_deltas_sum_to_the_greedy_result(client):
    whole = client.completions.create(prompt=PROMPT, **GREEDY)
    texts, finish, usage = _streamed(client, prompt=PROMPT, stream_options={"include_usage": True}, **GREEDY)
    assert texts == {0: whole.choices[0].text} and finish == {0: "length"}
    assert usage.completion_tokens == 24 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_without_usage_sends_none(client):
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, **GREEDY))
    assert chunks and all(c.usage is None and len(c.choices) == 1 for c in chunks)


def test_n_and_batches_number_choices_prompt_major(client):
    out = client.completions.create(model=MODEL, prompt=[PROMPT, "Paged"], n=2, max_tokens=8, seed=7,
                                    temperature=1.0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert 4 <= out.usage.completion_tokens <= 32
    texts, finish, _ = _streamed(client, model=MODEL, prompt=[PROMPT, "Paged"], n=2, max_tokens=8, seed=7,
                                 temperature=1.0)
    assert texts == {c.index: c.text for c in out.choices}  # per-request seeds make the stream reproduce it
    assert sorted(finish) == [0, 1, 2, 3]


def test_seed_reproducibility(client):
    sample = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    first = client.completions.create(seed=1234, **sample).choices[0].text
    again = client.completions.create(seed=1234, **sample).choices[0].text
    others = {client.completions.create(seed=s, **sample).choices[0].text for s in (1, 2, 3)}
    assert first == again
    assert len(others | {first}) > 1  # a random 384-token model does not repeat 16 sampled tokens


def test_logprobs(client):
    out = client.completions.create(prompt=PROMPT, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 24
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 4  # the top 3 and the chosen token, keyed by text (byte tokens may collide)
        assert chosen <= 0 and math.isclose(chosen, max(top.values()), abs_tol=1e-5)  # greedy picks the best
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo(client):
    out = client.completions.create(prompt=PROMPT, echo=True, **{**GREEDY, "max_tokens": 4})
    plain = client.completions.create(prompt=PROMPT, **{**GREEDY, "max_tokens": 4})
    assert out.choices[0].text == PROMPT + plain.choices[0].text
    with_lp = client.completions.create(prompt=PROMPT, echo=True, logprobs=1, **{**GREEDY, "max_tokens": 4})
    lp = with_lp.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert len(lp.tokens) == with_lp.usage.prompt_tokens + 4
    assert "".join(lp.tokens[: with_lp.usage.prompt_tokens]) == PROMPT
    texts, _, _ = _streamed(client, prompt=PROMPT, echo=True, **{**GREEDY, "max_tokens": 4})
    assert texts == {0: out.choices[0].text}


def _stop_string(text: str) -> str:
    """Two characters from the middle of a greedy text (cut at their first occurrence)."""
    middle = len(text) // 2
    return text[middle: middle + 2]


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(client, include):
    full = client.completions.create(prompt=PROMPT, **GREEDY).choices[0].text
    stop = _stop_string(full)
    assert len(stop) == 2, f"greedy text too short to cut: {full!r}"
    expected = full[: full.index(stop) + (len(stop) if include else 0)]
    extra = {"ignore_eos": True, "include_stop_str_in_output": include}
    out = client.completions.create(prompt=PROMPT, stop=[stop, "never appears ~~~"],
                                    **{**GREEDY, "extra_body": extra})
    (choice,) = out.choices
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    assert choice.model_extra["stop_reason"] == stop
    texts, finish, _ = _streamed(client, prompt=PROMPT, stop=[stop], **{**GREEDY, "extra_body": extra})
    assert texts == {0: expected} and finish == {0: "stop"}  # held-back text never overshoots the stop


def test_vllm_sampling_extras_are_accepted(client):
    extras = {"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.2, "min_tokens": 3, "ignore_eos": True,
              "skip_special_tokens": False}
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, seed=3, top_p=0.9,
                                    presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"5": -100},
                                    user="someone", extra_body=extras)
    assert out.usage.completion_tokens == 6
