"""``tokenmill serve --speculative-config``: streamed text with n-gram speculation is the text
without it, and the spec_decode counters on /metrics count what was drafted and accepted."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import API_KEY, MODEL
from test_server_metrics import scrape

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
GREEDY = dict(model=MODEL, temperature=0.0, max_tokens=24, extra_body={"ignore_eos": True})
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def spec_server(start_server, tiny_args):
    return start_server(tiny_args("--speculative-config", json.dumps(NGRAM)), env={"TOKENMILL_API_KEY": API_KEY})


def test_streaming_with_speculation_returns_the_text_without(spec_server, client):
    spec_client = openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    expected = client.completions.create(prompt=PROMPT, **GREEDY).choices[0].text
    streamed = "".join(chunk.choices[0].text for chunk in spec_client.completions.create(
        prompt=PROMPT, stream=True, **GREEDY) if chunk.choices)
    assert streamed == expected
    _, samples = scrape(spec_server)
    drafted = samples[("tokenmill:spec_decode_num_draft_tokens_total", ())]
    accepted = samples[("tokenmill:spec_decode_num_accepted_tokens_total", ())]
    assert drafted >= accepted > 0
