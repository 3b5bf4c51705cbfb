"""Tool calling for the chat endpoint: tools rendered into the prompt, calls read back from the output.

- **Rendering**: a chat template that knows tools (it reads ``tools``: Qwen2.5/3, Llama 3.1, Mistral...)
  gets them, the assistant's earlier ``tool_calls`` (arguments as objects) and the ``tool`` messages as
  they are. A template that does not (SmolLM2's) gets the Hermes convention in its system message:
  the tools' signatures in ``<tools></tools>``, calls as ``<tool_call>{"name": ..., "arguments": ...}
  </tool_call>``, results as ``<tool_response>`` user turns.
- **Parsing**, by ``tool_choice``: "auto" reads ``<tool_call>`` blocks out of the text (the rest is the
  message's content); "required" and a named function put the output under a grammar
  (``forced_calls_constraint``: a JSON array of calls, or one call of that function), so the calls are
  always well formed and their arguments match the function's parameters.
"""

from __future__ import annotations

import json
import re
import uuid

from apt_serve_ray.sampling.structured import StructuredOutput

HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def template_knows_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def render(body, knows_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """The conversation for the chat template, and the tools to give it (None: rendered into the
    system message here, or no tools)."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    messages = []
    for m in body.messages:
        if knows_tools:
            message = {"role": m.role, "content": m.text() if m.content is not None or not m.tool_calls else None}
            if m.tool_calls:
                message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        elif m.role == "tool":
            messages.append({"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"})
        elif m.tool_calls:
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c.function.name,
                                                            "arguments": _arguments(c.function.arguments)})
                              + "\n</tool_call>" for c in m.tool_calls)
            messages.append({"role": m.role, "content": (m.text() + "\n" if m.text() else "") + calls})
        else:
            messages.append({"role": m.role, "content": m.text()})
    if tools is None or knows_tools:
        return messages, tools
    system = HERMES_TOOLS.format(tools="\n".join(json.dumps(t) for t in tools))
    if messages and messages[0]["role"] in ("system", "developer"):
        messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + system}
    else:
        messages.insert(0, {"role": "system", "content": system})
    return messages, None


def _call_schema(tool) -> dict:
    f = tool.function
    return {"type": "object", "properties": {"name": {"const": f.name},
                                             "arguments": f.parameters or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_calls_constraint(tools, tool_choice, parallel: bool) -> StructuredOutput:
    """The grammar of the output when a call is required: one call of the named function, or an array
    of calls (one at most unless ``parallel``) of any of the tools."""
    if not isinstance(tool_choice, str):  # a named function
        tool = next(t for t in tools if t.function.name == tool_choice.function.name)
        return StructuredOutput(json=_call_schema(tool))
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": [_call_schema(t) for t in tools]}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutput(json=schema)


def _openai_call(call: dict) -> dict | None:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": arguments if isinstance(arguments, str)
                         else json.dumps(arguments)}}


def parse(text: str, body) -> tuple[str | None, list[dict]]:
    """The message's content and its OpenAI ``tool_calls`` from the generated text."""
    if body.tool_choice_forces:
        try:
            value = json.loads(text)
        except ValueError:  # cut short (max_tokens): what there is, as content
            return text, []
        calls = [_openai_call(c) for c in (value if isinstance(value, list) else [value])]
        return None, [c for c in calls if c is not None]
    calls, content = [], text
    for match in _TOOL_CALL.finditer(text):
        try:
            call = _openai_call(json.loads(match.group(1)))
        except ValueError:
            continue
        if call is not None:
            calls.append(call)
            content = content.replace(match.group(0), "", 1)
    if not calls:
        return text, []
    content = content.strip()
    return content or None, calls
