"""The OpenAI wire format: request models, error bodies, and the response and chunk objects.

Requests are validated strictly (a string is not a number, a float is not an integer) so that every
bad input becomes a 4xx with ``{"error": {"message", "type", "param", "code"}}`` naming the field.
Unknown fields are ignored, as vLLM does; known but unsupported ones are refused by name.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(ValueError):
    """An error the client caused (or an overload it should retry), with its HTTP status."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(max(1, round(self.retry_after_s)))}


def from_value_error(exc: ValueError) -> APIError:
    """Our library raises ``ValueError("field: what is wrong")``; keep the field as ``param``."""
    if isinstance(exc, APIError):
        return exc
    message = str(exc)
    field, sep, _ = message.partition(":")
    param = field.strip() if sep and field and " " not in field.strip() else None
    return APIError(message, param=param)


def from_validation_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    # Pydantic puts the union member that failed ("str", "list[int]") into the location; the
    # client's field is the path of our field names and list indexes.
    parts = [str(p) for p in first["loc"] if isinstance(p, int) or p in _FIELD_NAMES]
    param = ".".join(parts) if parts else None
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return APIError(f"{param or 'body'}: {first['msg']}{more}", param=param)


# Every integer field within int64: a larger one would overflow the engine's and numpy's arrays.
Int64 = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share: sampling, streaming, and our extensions."""

    model_config = ConfigDict(strict=True, extra="ignore")

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
    user: str | None = None
    # Extensions: scheduling hints for the SLO-aware scheduler (lower priority value = served earlier).
    # ``service_class`` names one of the app's classes (``service_classes.py``); the other three, when
    # given, override that class's values.
    service_class: str | None = None
    priority: Int64 | None = None
    ttft_slo_ms: float | None = None
    tbt_slo_ms: float | None = None

    def check_supported(self) -> None:
        unsupported = {
            "presence_penalty": self.presence_penalty != 0.0, "frequency_penalty": self.frequency_penalty != 0.0,
            "logit_bias": bool(self.logit_bias),
        }
        for name, is_set in unsupported.items():
            if is_set:
                raise APIError(f"{name}: not supported by this server", param=name)
        if self.n != 1:
            raise APIError(f"n: only n=1 is supported, got {self.n}", param="n")
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
                  "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos}
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(self, name)
            if value is None and defaults:
                value = defaults.get(name)
            if value is not None:
                kwargs[name] = value
        return kwargs

    def scheduling_kwargs(self) -> dict:
        """The request's own scheduling hints (not its class's)."""
        return {k: v for k in ("priority", "ttft_slo_ms", "tbt_slo_ms") if (v := getattr(self, k)) is not None}


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[Int64], list[str], list[list[Int64]]]
    echo: bool = False
    logprobs: Int64 | None = None
    best_of: Int64 | None = None
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError("prompt: only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise APIError("prompt: must not be empty", param="prompt")
        return prompt

    def check_supported(self) -> None:
        super().check_supported()
        for name, is_set in (("echo", self.echo), ("logprobs", self.logprobs is not None),
                             ("best_of", self.best_of not in (None, 1)), ("suffix", self.suffix is not None)):
            if is_set:
                raise APIError(f"{name}: not supported by this server", param=name)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    tools: list | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise APIError("logprobs: not supported by this server", param="logprobs")
        if self.tools:
            raise APIError("tools: tool calling is not supported by this server", param="tools")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError("max_completion_tokens: give max_tokens or max_completion_tokens, not both",
                           param="max_completion_tokens")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens

    def conversation(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


_FIELD_NAMES = frozenset().union(*(m.model_fields for m in (
    CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions)))


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


# Responses -----------------------------------------------------------------------------------------
def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` (prompt tokens served from the
    prefix cache, as OpenAI and vLLM report them) where the engine said."""
    out = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
           "total_tokens": num_prompt_tokens + num_completion_tokens}
    if num_cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return out


def finish_reason(engine_reason: str | None) -> str | None:
    """Engine reasons are stop/length/abort/error; OpenAI clients know stop and length."""
    return {"abort": "abort", "error": "error"}.get(engine_reason, engine_reason)


def completion(request_id: str, model: str, text: str, reason: str | None, usage_: dict, *,
               chat: bool, created: int | None = None, token_ids: dict | None = None) -> dict:
    """``token_ids``: {"prompt_token_ids", "token_ids"} for the choice (``return_token_ids``)."""
    created = created or int(time.time())
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": reason, **(token_ids or {})}
        return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": [choice], "usage": usage_}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, **(token_ids or {})}
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": usage_}


def chunk(request_id: str, model: str, created: int, *, chat: bool, text: str | None = None,
          reason: str | None = None, role: bool = False, usage_: dict | None = None,
          include_usage: bool = False, token_ids: dict | None = None) -> dict:
    """One streamed event. ``text=None`` with ``usage_`` set is the usage-only final chunk.
    ``token_ids``: fields for the choice (``return_token_ids``)."""
    if chat:
        obj = "chat.completion.chunk"
        if usage_ is not None and text is None:
            choices = []
        else:
            delta = {"role": "assistant", "content": text or ""} if role else (
                {"content": text} if text else {})
            choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]
    else:
        obj = "text_completion"
        choices = [] if (usage_ is not None and text is None) else [
            {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}]
    if token_ids and choices:
        choices[0].update(token_ids)
    out = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
    if include_usage:
        out["usage"] = usage_
    return out


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


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
