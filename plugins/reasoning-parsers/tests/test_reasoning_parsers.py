"""The built-in reasoning parsers on replies as models write them: whole, streamed with every
possible cut (so each marker is split across deltas at every position), and the structured-output
constraint checked against what the parser reads from text it accepts."""

from __future__ import annotations

import itertools
import json

import pytest

from tokenmill import InvalidRequestError, StructuredOutputsParams
from tokenmill.reasoning import ReasoningSplit, load_reasoning_parser, reasoning_parser_names
from tokenmill_reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from tokenmill_reasoning_parsers.qwen3 import Qwen3ReasoningParser

R1 = DeepSeekR1ReasoningParser()
QWEN3 = Qwen3ReasoningParser()

# reply -> (reasoning, content) for each parser
REPLIES = {
    "opened in the prompt": ("Let me see. 2 + 2 = 4.</think>\n\nThe answer is 4.",
                             ("Let me see. 2 + 2 = 4.", "The answer is 4."), (None, "Let me see. 2 + 2 = 4.</think>\n\nThe answer is 4.")),
    "opened in the reply": ("<think>\nHmm, <b> is bold.\n</think>\n\n**4**",
                            ("\nHmm, <b> is bold.\n", "**4**"), ("\nHmm, <b> is bold.\n", "**4**")),
    "cut off while thinking": ("<think>still thinking </thi", ("still thinking </thi", None),
                               ("still thinking </thi", None)),
    "never thinks": ("Just the answer, <think> mentioned.", ("Just the answer, <think> mentioned.", None),
                     (None, "Just the answer, <think> mentioned.")),
    "empty reasoning": ("<think></think>Paris.", (None, "Paris."), (None, "Paris.")),
    "blanks before the tag": ("\n <think>a</think>b</think>c", ("a", "b</think>c"), ("a", "b</think>c")),
    "nothing after the section": ("plan</think>\n\n", ("plan", None), (None, "plan</think>\n\n")),
    "empty reply": ("", (None, None), (None, None)),
}


def streamed(parser, text: str, cuts: list[int]) -> tuple[str, str]:
    """Feed ``text`` cut at ``cuts``; assemble the two parts as a client does."""
    streamer = parser.streamer()
    reasoning = content = ""
    bounds = [0, *cuts, len(text)]
    for index, (start, end) in enumerate(itertools.pairwise(bounds)):
        delta = streamer.feed(text[start:end], final=index == len(bounds) - 2)
        reasoning += delta.reasoning
        content += delta.content
    return reasoning, content


@pytest.mark.parametrize("parser_index", [0, 1], ids=["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text,r1,qwen3", REPLIES.values(), ids=REPLIES.keys())
def test_whole_replies_split_as_the_model_family_means(parser_index, text, r1, qwen3):
    parser, expected = [(R1, r1), (QWEN3, qwen3)][parser_index]
    assert parser.extract_reasoning(text) == ReasoningSplit(*expected)


@pytest.mark.parametrize("parser", [R1, QWEN3], ids=["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", [value[0] for value in REPLIES.values()], ids=REPLIES.keys())
def test_streamed_replies_split_as_whole_ones_at_every_cut(parser, text):
    reasoning, content = parser.extract_reasoning(text)
    expected = (reasoning or "", content or "")
    for cut in range(len(text) + 1):  # one cut: each marker split at each position
        assert streamed(parser, text, [cut]) == expected, cut
    assert streamed(parser, text, list(range(1, len(text)))) == expected  # a character at a time
    for step in (2, 3, 5):
        assert streamed(parser, text, list(range(step, len(text), step))) == expected, step


def test_a_streamer_holds_back_only_a_possible_marker():
    streamer = R1.streamer()
    assert streamer.feed("Thinking </th") == ("Thinking ", "")
    assert streamer.feed("ey") == ("</they", "")  # not the marker after all: given out at once
    assert streamer.feed("</think>\n") == ("", "")
    assert streamer.feed("\nAnswer") == ("", "Answer")
    assert streamer.feed("", final=True) == ("", "")
    qwen = QWEN3.streamer()
    assert qwen.feed("<thi") == ("", "")  # could still open a section
    assert qwen.feed("s is content") == ("", "<this is content")


def test_both_parsers_are_registered_through_the_plugin_hook():
    assert {"deepseek_r1", "qwen3"} <= set(reasoning_parser_names())
    assert load_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    assert load_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(InvalidRequestError, match=r"unknown reasoning parser 'nope'; registered: .*deepseek_r1.*qwen3"):
        load_reasoning_parser("nope")


SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
          "additionalProperties": False}
CONSTRAINTS = {
    "json": (StructuredOutputsParams(json=SCHEMA), '{"city": "Rome"}', '{"city": "Oslo"}'),
    "json_object": (StructuredOutputsParams(json_object=True), '{"x": [1]}', "[1]"),
    "regex": (StructuredOutputsParams(regex="[0-9]{3}"), "123", "12a"),
    "choice": (StructuredOutputsParams(choice=["yes", "no"]), "no", "maybe"),
    "grammar": (StructuredOutputsParams(grammar='root ::= "a"+'), "aaa", "ab"),
    "structural_tag": (StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {
        "type": "const_string", "value": "ok"}}), "ok", "ko"),
}


def _accepts(params: StructuredOutputsParams, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string

    from tokenmill.structured_output.xgrammar_backend import to_grammar

    return _is_grammar_accept_string(to_grammar(params), text)


@pytest.mark.parametrize("kind", CONSTRAINTS, ids=CONSTRAINTS.keys())
def test_a_constraint_applies_after_the_reasoning_section_only(kind):
    params, good, bad = CONSTRAINTS[kind]
    r1, qwen3 = R1.constrain_content(params), QWEN3.constrain_content(params)
    free_thinking = "Maybe {not json} at all; 12a? <think>"
    for reply in (f"{free_thinking}</think>\n\n{good}", f"<think>{free_thinking}</think>{good}"):
        assert _accepts(r1, reply), reply
        assert R1.extract_reasoning(reply).content == good
    assert not _accepts(r1, f"{free_thinking}</think>{bad}")
    assert not _accepts(r1, good)  # DeepSeek-R1 always reasons first: the answer comes after </think>
    assert _accepts(qwen3, f"<think>{free_thinking}</think>\n{good}")
    assert _accepts(qwen3, good)  # Qwen3 may answer without a reasoning section
    assert not _accepts(qwen3, f"<think>{free_thinking}</think>{bad}") and not _accepts(qwen3, bad)
    json.dumps(r1.structural_tag)  # what the server sends on is plain JSON
