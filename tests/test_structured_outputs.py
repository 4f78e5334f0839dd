"""Structured outputs end to end: JSON schemas, regex, choice, JSON object and
EBNF grammars through ``LLM`` and streaming ``AsyncLLM``, on a tiny random model
and on the default SmolLM2 model.

A random model never wants to stop, so every constraint used on the tiny model
has a finite language (enums, bounded arrays, maxLength strings, bounded
numbers): the grammar itself must end the output, and a generous ``max_tokens``
leaves room for the whitespace a random model likes (runs are bounded too).
``json_object`` cannot force an end, so only the real model runs it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re

import jsonschema
import pytest

from tokenmill import LLM, AsyncLLM, InvalidRequestError, SamplingParams, StructuredOutputsParams

SCHEMAS: dict[str, dict] = {
    "nested_objects": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "bounded_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4},
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]},
                       "ok": {"type": "boolean"}},
        "required": ["color", "size", "ok"],
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60},
                       "count": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["celsius", "count"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 20}, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                       "tags": {"type": "array", "items": {"enum": ["new", "old"]}, "maxItems": 2}},
        "required": ["title"],
    },
}
REGEX = r"[a-z]{2,6}-[0-9]{2,3}"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [a-z]{1,8}'
GRAMMAR_RE = r"(hello|hi) [a-z]{1,8}!"
TINY_PROMPTS = ["The quick brown fox", "What is the capital of France?", "Numbers like 0 1 2", "Paged attention keeps"]


def _params(max_tokens: int = 200, **constraint) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**constraint))


def _check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)  # json.loads is strict: no raw control characters


def _finished_texts(outputs) -> list[str]:
    completions = [c for o in outputs for c in o.outputs]
    assert all(c.finish_reason == "stop" for c in completions), [(c.finish_reason, c.text) for c in completions]
    return [c.text for c in completions]


# -- the tiny random model --------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(llama_path):
    return LLM(str(llama_path), max_model_len=256, kv_cache_memory="16MiB")


@pytest.mark.parametrize("compact", [False, True], ids=["any_whitespace", "compact"])
def test_tiny_json_schemas_validate(tiny, compact):
    names = list(SCHEMAS)
    prompts = [TINY_PROMPTS[i % len(TINY_PROMPTS)] for i in range(len(names))]
    params = [_params(json=SCHEMAS[n], disable_any_whitespace=compact) for n in names]
    for name, text in zip(names, _finished_texts(tiny.generate(prompts, params)), strict=True):
        _check_json(text, SCHEMAS[name])


def test_tiny_regex_choice_grammar_and_sampled_n(tiny):
    outputs = tiny.generate(TINY_PROMPTS[:3], [_params(regex=REGEX), _params(choice=CHOICES), _params(grammar=GRAMMAR)])
    regex_text, choice_text, grammar_text = _finished_texts(outputs)
    assert re.fullmatch(REGEX, regex_text) and choice_text in CHOICES and re.fullmatch(GRAMMAR_RE, grammar_text)
    sampled = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=200,
                             structured_outputs=StructuredOutputsParams(json=SCHEMAS["enums"]))
    for text in _finished_texts(tiny.generate(TINY_PROMPTS[0], sampled)):
        _check_json(text, SCHEMAS["enums"])


def test_tiny_grammar_ends_the_output_even_with_ignore_eos(tiny):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    out = tiny.generate(TINY_PROMPTS[1], params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in CHOICES


def test_unconstrained_requests_are_unaffected_by_constrained_neighbours(tiny):
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in tiny.generate(TINY_PROMPTS, free)]
    mixed_params = [free, _params(json=SCHEMAS["enums"]), free, _params(regex=REGEX), free, free]
    mixed_prompts = [TINY_PROMPTS[0], TINY_PROMPTS[1], TINY_PROMPTS[1], TINY_PROMPTS[2], TINY_PROMPTS[2], TINY_PROMPTS[3]]
    mixed = tiny.generate(mixed_prompts, mixed_params)
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4, 5)] == alone
    _check_json(mixed[1].outputs[0].text, SCHEMAS["enums"])
    assert re.fullmatch(REGEX, mixed[3].outputs[0].text)


def test_preempted_constrained_requests_resume_their_grammar(llama_path):
    # 10 blocks of 16 tokens for 6 requests: some are preempted and recomputed mid-output; each
    # matcher must carry on from where its request was.
    llm = LLM(str(llama_path), max_model_len=128, num_kv_blocks=10, block_size=16)
    prompts = [TINY_PROMPTS[i % len(TINY_PROMPTS)] + " and" * (12 + i) for i in range(6)]
    params = [_params(max_tokens=100, json=SCHEMAS["optional_fields"], disable_any_whitespace=True)] * 6
    for text in _finished_texts(llm.generate(prompts, params)):
        _check_json(text, SCHEMAS["optional_fields"])
    assert llm.engine.scheduler_stats.num_preemptions > 0


@pytest.mark.parametrize(("constraint", "param"), [
    ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "structured_outputs.json"),
    ({"json": '{"type": '}, "structured_outputs.json"),
    ({"regex": "[a-z"}, "structured_outputs.regex"),
    ({"grammar": 'root ::= "a" | | "b"'}, "structured_outputs.grammar"),
    ({"grammar": 'start ::= "a"'}, "structured_outputs.grammar"),
])
def test_invalid_constraints_are_request_errors_naming_the_field(tiny, constraint, param):
    with pytest.raises(InvalidRequestError) as err:
        tiny.generate(TINY_PROMPTS[0], SamplingParams(structured_outputs=constraint))
    assert err.value.param == param
    assert not tiny.engine.has_unfinished_requests()
    assert tiny.generate(TINY_PROMPTS[0], _params(choice=CHOICES))[0].outputs[0].text in CHOICES


# -- streaming -------------------------------------------------------------------
async def _stream(engine: AsyncLLM, prompt, params: SamplingParams) -> list[str]:
    return [out.outputs[0].text async for out in engine.generate(prompt, params)]


def _check_stream(texts: list[str]) -> str:
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts)), texts
    return texts[-1]


def _stream_all(engine: AsyncLLM, prompts: list, params: list[SamplingParams]) -> list[str]:
    async def run():
        return await asyncio.gather(*[_stream(engine, p, sp) for p, sp in zip(prompts, params, strict=True)])

    return [_check_stream(texts) for texts in asyncio.run(run())]


def test_tiny_streaming_outputs_validate(llama_path):
    engine = AsyncLLM(str(llama_path), max_model_len=256, kv_cache_memory="16MiB")
    try:
        names = list(SCHEMAS)
        prompts = [TINY_PROMPTS[i % len(TINY_PROMPTS)] for i in range(len(names))] + TINY_PROMPTS[:2]
        params = [_params(json=SCHEMAS[n]) for n in names] + [_params(regex=REGEX), _params(choice=CHOICES)]
        finals = _stream_all(engine, prompts, params)
        for name, text in zip(names, finals, strict=False):
            _check_json(text, SCHEMAS[name])
        assert re.fullmatch(REGEX, finals[-2]) and finals[-1] in CHOICES

        async def bad():
            async for _ in engine.generate(TINY_PROMPTS[0], SamplingParams(structured_outputs={"regex": "(a"})):
                pass

        with pytest.raises(InvalidRequestError) as err:
            asyncio.run(bad())
        assert err.value.param == "structured_outputs.regex" and engine.is_running
    finally:
        engine.shutdown()


# -- the default model (SmolLM2-135M-Instruct) -----------------------------------------
def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def smollm():
    return LLM(max_model_len=1024, kv_cache_memory="512MiB")


@pytest.mark.slow
def test_smollm_every_kind_of_constraint(smollm):
    # One batch, so the real model's steps are shared: five schemas, regex, choice, json_object, grammar.
    names = list(SCHEMAS)
    conversations = [_chat(f"Give an example of {name.replace('_', ' ')}, as JSON.") for name in names] + [
        _chat("Make up a product code."), _chat("Is the sky blue?"),
        _chat('What is 2+2? Answer as a JSON object like {"answer": ...}.'), _chat("Greet someone.")]
    params = [_params(json=SCHEMAS[n]) for n in names] + [
        _params(regex=REGEX), _params(choice=CHOICES), _params(json_object=True), _params(grammar=GRAMMAR)]
    texts = _finished_texts(smollm.chat(conversations, params))
    for name, text in zip(names, texts, strict=False):
        _check_json(text, SCHEMAS[name])
    regex_text, choice_text, object_text, grammar_text = texts[len(names):]
    assert re.fullmatch(REGEX, regex_text) and choice_text in CHOICES and re.fullmatch(GRAMMAR_RE, grammar_text)
    assert isinstance(json.loads(object_text), dict)


@pytest.mark.slow
def test_smollm_streaming_outputs_validate(smollm):
    engine = AsyncLLM(max_model_len=1024, kv_cache_memory="512MiB")
    try:
        tokenizer = engine.tokenizer
        names = ["nested_objects", "bounded_numbers", "optional_fields"]
        prompts = [tokenizer.apply_chat_template(_chat(f"An example of {n.replace('_', ' ')}, as JSON."),
                                                 tokenize=False, add_generation_prompt=True) for n in names]
        finals = _stream_all(engine, [*prompts, prompts[0]],
                             [*(_params(json=SCHEMAS[n]) for n in names), _params(choice=CHOICES)])
        for name, text in zip(names, finals, strict=False):
            _check_json(text, SCHEMAS[name])
        assert finals[-1] in CHOICES
    finally:
        engine.shutdown()
