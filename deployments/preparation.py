"""Request preparation: an OpenAI request body -> a validated, tokenised ``EngineRequest`` and its
admission ticket, or an ``APIError`` (a 4xx naming the field) before any engine sees it.

The checks, in order: the body's shape and types (strict pydantic models), the model's name, the
service class (``service_classes.py``: the body's ``service_class`` or the ``x-service-class`` header,
else the default class; its SLOs and priority fill the scheduling hints the request leaves out), the
prompt or chat template (tokenised here), the context (prompt + ``max_tokens`` within the model's
context, capped to what one replica's pages hold), then ``SamplingParams``' ranges. Sampling fields the
request leaves out take the model's generation-config defaults (``model_loader.generation_defaults``),
then ``SamplingParams``' own.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from apt_serve_ray import SamplingParams
from apt_serve_ray.engine.llm import apply_chat_template
from deployments import openai_protocol as oai
from deployments.admission import Ticket
from deployments.request_router import request_pages
from deployments.service_classes import ServiceClasses
from deployments.tools import render as render_tools, template_knows_tools
from deployments.wire import EngineRequest, LoadReport


@dataclass(frozen=True)
class ModelLimits:
    """What a request may use: the model's context, capped to what one replica's pages can hold with
    a KV cache (a request larger than the whole pool could never finish)."""

    max_model_len: int
    tokens_per_page: int  # of a KV page

    @classmethod
    def from_load(cls, load: LoadReport) -> ModelLimits:
        return cls(min(load.max_model_len, load.num_pages * load.tokens_per_kv_page), load.tokens_per_kv_page)


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready for admission."""

    body: oai.CompletionRequest | oai.ChatCompletionRequest
    chat: bool
    request_id: str
    request: EngineRequest
    ticket: Ticket
    created: int = field(default_factory=lambda: int(time.time()))  # the response's ``created``
    received: float = field(default_factory=time.monotonic)  # when validation began (monotonic)
    token_text: Callable[[int], str] | None = None  # one token's text (logprobs)
    # n > 1, or several prompts: this is choice ``index``; the others follow it, each a request of its
    # own to the engines (``request_id``-``index``), with the prompt's index (usage counts it once).
    index: int = 0
    prompt_index: int = 0
    siblings: tuple["Prepared", ...] = ()

    @property
    def choices(self) -> list["Prepared"]:
        return [self, *self.siblings]


class RequestPreparer:
    def __init__(self, served_model_name: str, tokenizer, *, sampling_defaults: dict,
                 default_ttft_slo_ms: float, output_horizon_tokens: int,
                 service_classes: ServiceClasses | None = None, adapters=()) -> None:
        """``sampling_defaults``: ``SamplingParams`` keyword arguments for fields a request leaves out;
        ``default_ttft_slo_ms``: the admission deadline of a request whose class sets no TTFT target."""
        self.served_model_name = served_model_name
        # LoRA adapters a request's ``model`` may name: {name: path to load it from where a replica does not
        # hold it (those loaded at run time), or None (registered by every replica at start)}
        self.adapters = dict(adapters) if isinstance(adapters, dict) else dict.fromkeys(adapters)
        self.tokenizer = tokenizer
        self.sampling_defaults = dict(sampling_defaults)
        self.default_ttft_slo_s = default_ttft_slo_ms / 1000.0
        self.horizon = output_horizon_tokens
        self.service_classes = service_classes or ServiceClasses()

    def prepare(self, raw: bytes | dict, chat: bool, limits: ModelLimits, received: float,
                service_class_header: str | None = None, session_header: str | None = None) -> Prepared:
        body = oai.parse_request(oai.ChatCompletionRequest if chat else oai.CompletionRequest, raw)
        if body.model != self.served_model_name and body.model not in self.adapters:
            also = f" and the LoRA adapters {', '.join(f'`{a}`' for a in self.adapters)}" if self.adapters else ""
            raise oai.APIError(f"model: the model `{body.model}` does not exist; this server serves "
                               f"`{self.served_model_name}`{also}", status=404, param="model", code="model_not_found")
        lora_name = None if body.model == self.served_model_name else body.model
        lora_path = self.adapters.get(lora_name) if lora_name is not None else None
        service_class = self.service_classes.choose(body.service_class, service_class_header)
        try:
            prompts = self.tokenize_all(body, chat)
        except ValueError as exc:
            raise oai.from_value_error(exc) from None
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        scheduling = self.service_classes.scheduling(service_class, body.scheduling_kwargs())
        choices = []
        for j, prompt_ids in enumerate(prompts):
            room = self.check_context(body, chat, len(prompt_ids), limits.max_model_len)
            # Chat defaults to the rest of the context, completions to 16 tokens (as OpenAI does).
            sampling = body.sampling_kwargs(default_max_tokens=room if chat else min(16, room),
                                            defaults=self.sampling_defaults)
            for i in range(body.n):
                if i and sampling.get("seed") is not None:
                    sampling = {**sampling, "seed": sampling["seed"] + 1}  # seeded choices differ
                try:
                    params = SamplingParams(**sampling)
                except ValueError as exc:
                    raise oai.from_value_error(exc) from None
                index = j * body.n + i
                rid = request_id if len(prompts) * body.n == 1 else f"{request_id}-{index}"
                request = EngineRequest(prompt_ids, params, rid, service_class=service_class,
                                        session_id=session_header or body.user, cache_salt=body.cache_salt,
                                        lora_name=lora_name, lora_path=lora_path, **scheduling)
                ttft_s = request.ttft_slo_ms / 1000.0 if request.ttft_slo_ms else self.default_ttft_slo_s
                ticket = Ticket(request_pages(request, limits.tokens_per_page, self.horizon), ttft_s,
                                request.priority or 0)
                choices.append(Prepared(body, chat, request_id, request, ticket, received=received,
                                        token_text=self.token_text, index=index, prompt_index=j))
        if len(choices) == 1:
            return choices[0]
        return dataclasses.replace(choices[0], siblings=tuple(choices[1:]))

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs show it (special tokens included)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def tokenize_all(self, body, chat: bool) -> list[list[int]]:
        if chat:
            messages, tools = render_tools(body, template_knows_tools(self.tokenizer))
            return [apply_chat_template(self.tokenizer, messages, body.add_generation_prompt,
                                        body.chat_template_kwargs, tools)]
        return [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in body.prompts()]

    @staticmethod
    def check_context(body, chat: bool, num_prompt: int, max_len: int) -> int:
        """The tokens left to generate in, or an APIError when the request cannot fit the context."""
        if num_prompt >= max_len:
            raise oai.APIError(f"{'messages' if chat else 'prompt'}: {num_prompt} tokens leave no room to "
                               f"generate within the model's context of {max_len} tokens",
                               param="messages" if chat else "prompt", code="context_length_exceeded")
        if body.max_tokens is not None and num_prompt + body.max_tokens > max_len:
            raise oai.APIError(f"max_tokens: {num_prompt} prompt tokens + max_tokens {body.max_tokens} exceed the "
                               f"model's context of {max_len} tokens", param="max_tokens",
                               code="context_length_exceeded")
        return max_len - num_prompt
