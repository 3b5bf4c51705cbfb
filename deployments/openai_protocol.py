"""The OpenAI wire format: request models (the response and chunk objects: ``openai_objects.py``; the
error body: ``api_error.py``, re-exported here; the output-constraint fields: ``output_constraint.py``; the
LoRA endpoints' bodies: ``lora_registry.py``).

Requests are validated strictly (a string is not a number, a float is not an integer) so that every
bad input becomes a 4xx with ``{"error": {"message", "type", "param", "code"}}`` naming the field.
A field this server does not implement is refused by name, never ignored: a client that asks for
something gets it or a 400 saying it will not (the accepted fields: docs/serving.md).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from apt_serve_ray.sampling.structured import StructuredOutput
from deployments import output_constraint
from deployments.api_error import APIError, from_value_error  # noqa: F401 - the routes use oai.APIError


def from_validation_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    if first["type"] == "extra_forbidden":
        path = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or p in _FIELD_NAMES or p == first["loc"][-1])
        return APIError(f"{path}: unknown field; this server does not implement it (the fields it accepts: "
                        f"docs/serving.md)", param=path, code="unsupported_field")
    # Pydantic puts the union member that failed ("str", "list[int]") into the location; the
    # client's field is the path of our field names and list indexes.
    parts = [str(p) for p in first["loc"] if isinstance(p, int) or p in _FIELD_NAMES]
    param = ".".join(parts) if parts else None
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return APIError(f"{param or 'body'}: {first['msg']}{more}", param=param)


MAX_CHOICES = 128  # choices (n x prompts) one request may ask for

# Every integer field within int64: a larger one would overflow the engine's and numpy's arrays.
Int64 = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text", "json_object", "json_schema"]


class _SamplingFields(BaseModel):
    """Fields both endpoints share: sampling, streaming, and our extensions."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_tokens: Int64 = 0
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension
    # vLLM extension: the choice carries ``token_ids`` (generated; per chunk when streaming) and
    # ``prompt_token_ids`` (in the response, or the first chunk), e.g. to re-send a conversation as ids.
    return_token_ids: bool | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    # vLLM extensions with the meaning vLLM gives them (``SamplingParams``).
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI's stored completions: only "do not store" is something this server does.
    store: bool | None = None
    user: str | None = None
    # Structured output: OpenAI's ``response_format`` (json_object, json_schema), vLLM's ``guided_*``
    # fields and its ``structured_outputs`` object ({"json" | "regex" | "choice": ...}).
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict | None = None
    # Extensions: scheduling hints for the SLO-aware scheduler (lower priority value = served earlier).
    # ``service_class`` names one of the app's classes (``service_classes.py``); the other three, when
    # given, override that class's values.
    service_class: str | None = None
    priority: Int64 | None = None
    ttft_slo_ms: float | None = None
    tbt_slo_ms: float | None = None
    # vLLM's: only requests with the same salt share cached prefix pages (a tenant's isolation).
    cache_salt: str | None = None

    def check_supported(self) -> None:
        if self.store:
            raise APIError("store: this server does not store completions", param="store")
        self.structured_output()  # refuses a bad or ambiguous constraint now
        if not 1 <= self.n <= MAX_CHOICES:
            raise APIError(f"n: must be in [1, {MAX_CHOICES}], got {self.n}", param="n")
        if self.cache_salt is not None and not self.cache_salt:
            raise APIError("cache_salt: must be a non-empty string", param="cache_salt")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options: only allowed when stream is true", param="stream_options")
        for name in ("ttft_slo_ms", "tbt_slo_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise APIError(f"{name}: must be a positive number of milliseconds, got {value}", param=name)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_kwargs(self, default_max_tokens: int | None, defaults: dict | None = None) -> dict:
        """Keyword arguments for ``SamplingParams`` (which validates ranges and names the field).
        ``defaults``: the model's values for the sampling fields the request leaves out (its generation
        config); a field in neither keeps ``SamplingParams``' default."""
        kwargs = {"max_tokens": self.max_tokens if self.max_tokens is not None else default_max_tokens,
                  "min_tokens": self.min_tokens, "seed": self.seed, "stop": self.stop,
                  "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
                  "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                  "repetition_penalty": self.repetition_penalty, "min_p": self.min_p,
                  "logit_bias": self.logit_bias, "logprobs": self.num_logprobs,
                  "skip_special_tokens": self.skip_special_tokens,
                  "include_stop_str_in_output": self.include_stop_str_in_output,
                  "structured_output": self.structured_output()}
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(self, name)
            if value is None and defaults:
                value = defaults.get(name)
            if value is not None:
                kwargs[name] = value
        return kwargs

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs to return per token (None: no logprobs)."""
        return None

    def structured_output(self) -> StructuredOutput | None:
        """The constraint on the output the request asks for, whichever way it asks; None: free text."""
        return output_constraint.build(self._constraint())

    @property
    def constraint_field(self) -> str | None:
        """The field the request gave its output constraint in (the engine's grammar errors name it)."""
        constraint = self._constraint()
        return constraint[0] if constraint else None

    def _constraint(self) -> tuple[str, dict] | None:
        return output_constraint.requested(self.response_format, self.guided_json, self.guided_regex,
                                           self.guided_choice, self.structured_outputs)

    def scheduling_kwargs(self) -> dict:
        """The request's own scheduling hints (not its class's)."""
        return {k: v for k in ("priority", "ttft_slo_ms", "tbt_slo_ms") if (v := getattr(self, k)) is not None}


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[Int64], list[str], list[list[Int64]]]
    echo: bool = False
    logprobs: Int64 | None = None
    best_of: Int64 | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request (a string, ids, or a list of either: several prompts)."""
        prompt = self.prompt
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise APIError("prompt: must not be empty" if len(prompts) == 1 else f"prompt.{i}: must not be empty",
                               param="prompt")
        if len(prompts) * self.n > MAX_CHOICES:
            raise APIError(f"prompt: {len(prompts)} prompts x n={self.n} choices exceed {MAX_CHOICES} per request",
                           param="prompt")
        return prompts

    def check_supported(self) -> None:
        super().check_supported()
        for name, is_set in (("echo", self.echo), ("best_of", self.best_of not in (None, 1)),
                             ("suffix", self.suffix is not None)):
            if is_set:
                raise APIError(f"{name}: not supported by this server", param=name)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None  # a participant's name: accepted (OpenAI's), not shown to the model
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # the arguments always match ``parameters`` here (a grammar constrains them)


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    # vLLM extensions for the chat template.
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None

    def check_supported(self) -> None:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError("top_logprobs: needs logprobs true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= 20:
                raise APIError(f"top_logprobs: must be in [0, 20], got {self.top_logprobs}", param="top_logprobs")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise APIError("tools: function names must be unique", param="tools")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise APIError("tool_choice: needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise APIError(f"tool_choice: no tool is named {choice.function.name!r}", param="tool_choice")
        if self.calls_tools and self.tool_choice_forces and self._constraint() is not None:
            raise APIError("tool_choice: a required or named tool call constrains the output; give no "
                           "response_format or guided_* with it", param="tool_choice")
        super().check_supported()

        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError("max_completion_tokens: give max_tokens or max_completion_tokens, not both",
                           param="max_completion_tokens")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def calls_tools(self) -> bool:
        """The model may call tools: tools given, and ``tool_choice`` not "none"."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def tool_choice_forces(self) -> bool:
        """``tool_choice`` "required" or a named function: the output is a call, under a grammar."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def structured_output(self) -> StructuredOutput | None:
        if self.calls_tools and self.tool_choice_forces:
            from deployments.tools import forced_calls_constraint

            return forced_calls_constraint(self.tools, self.tool_choice, self.parallel_tool_calls is not False)
        return super().structured_output()

    def conversation(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


_FIELD_NAMES = frozenset().union(*(m.model_fields for m in (
    CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions, ResponseFormat, Tool,
    FunctionDefinition, ToolCall, FunctionCall, NamedToolChoice, NamedFunction)))


def parse_request(cls: type[_SamplingFields], raw: bytes | dict) -> _SamplingFields:
    """Bytes (HTTP) or a dict (Python handle) -> a checked request, or ``APIError``."""
    if isinstance(raw, (bytes, str)):
        try:
            raw = json.loads(raw)
        except RecursionError:
            raise APIError("body: JSON nested too deeply") from None
        except ValueError as exc:  # JSONDecodeError, invalid UTF-8, an integer of over 4,300 digits
            raise APIError(f"body: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise APIError("body: must be a JSON object")
    try:
        json.dumps(raw, ensure_ascii=False).encode()
    except UnicodeEncodeError:  # JSON's "\\ud800" escapes decode to lone surrogates, which are not text
        raise APIError("body: a string is not valid Unicode (a lone surrogate)") from None
    except (TypeError, ValueError):  # a handle caller's dict with values JSON does not have: the model says
        pass
    try:
        request = cls.model_validate(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    except RecursionError:  # a field that takes any JSON (logit_bias) nested thousands deep
        raise APIError("body: JSON nested too deeply") from None
    request.check_supported()
    return request


# OpenAPI ------------------------------------------------------------------------------------------
def openapi_body(cls: type[BaseModel]) -> dict:
    """The route's ``openapi_extra``: the request model as its JSON body. The routes read the raw body
    (to answer every bad one with an OpenAI error, not FastAPI's 422), so FastAPI cannot see the model;
    this puts it in ``/openapi.json`` for clients and for the schema-driven fuzz test."""
    schema = cls.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}
