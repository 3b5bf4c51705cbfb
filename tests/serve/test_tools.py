"""Tool calling's text side: tools into the prompt (the template's own way, or Hermes' where it has
none), calls out of the output (``<tool_call>`` blocks under "auto", JSON under a required call)."""

from __future__ import annotations

import json

import pytest

from deployments import openai_protocol as oai
from deployments import tools

TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def _chat(**kw):
    return oai.parse_request(oai.ChatCompletionRequest, {"model": "m", "messages": kw.pop("messages", [
        {"role": "user", "content": "1 + 2?"}]), "tools": [TOOL], **kw})


def test_auto_reads_tool_call_blocks_and_keeps_the_rest_as_content():
    body = _chat(tool_choice="auto")
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = tools.parse(text, body)
    assert content == "Let me add." and len(calls) == 1
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'} and calls[0]["type"] == "function"
    assert tools.parse("Just text, no call.", body) == ("Just text, no call.", [])
    assert tools.parse("<tool_call>{not json}</tool_call>", body) == ("<tool_call>{not json}</tool_call>", [])


def test_a_required_call_is_json_under_a_grammar_of_the_tools():
    body = _chat(tool_choice="required")
    spec = body.structured_output()
    assert spec.json["type"] == "array" and spec.json["items"]["anyOf"][0]["properties"]["name"] == {"const": "add"}
    content, calls = tools.parse('[{"name": "add", "arguments": {"a": 1, "b": 2}}]', body)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    named = _chat(tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False)
    assert named.structured_output().json["properties"]["name"] == {"const": "add"}
    assert _chat(tool_choice="none").structured_output() is None and not _chat(tool_choice="none").calls_tools


@pytest.mark.parametrize("raw, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
])
def test_bad_tool_requests_name_the_field(raw, param):
    with pytest.raises(oai.APIError) as info:
        oai.parse_request(oai.ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                      "tools": [TOOL], **raw})
    assert info.value.param == param, info.value.message


def test_a_template_without_tools_gets_them_in_hermes_form_with_the_history():
    body = _chat(messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 2?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                              "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}])
    messages, given = tools.render(body, knows_tools=False)
    assert given is None and messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert '"name": "add"' in messages[0]["content"] and "<tools>" in messages[0]["content"]
    assert messages[2] == {"role": "assistant",
                           "content": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    messages, given = tools.render(body, knows_tools=True)  # the template's own way: as they came
    assert given[0]["function"]["name"] == "add" and messages[3]["tool_call_id"] == "call_1"
    assert messages[2]["content"] is None and messages[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
