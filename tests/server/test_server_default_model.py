"""``tokenmill serve`` with no model serves SmolLM2-135M-Instruct, and it knows its capitals."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_server(start_server):
    return start_server([])  # no model argument, no served name: everything defaulted


def test_default_model_answers_paris(default_server):
    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    (card,) = client.models.list().data
    assert "SmolLM2-135M-Instruct" in card.id
    answer = client.chat.completions.create(
        model=card.id, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32, temperature=0)
    assert "Paris" in answer.choices[0].message.content
    streamed = client.chat.completions.create(
        model=card.id, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == answer.choices[0].message.content
