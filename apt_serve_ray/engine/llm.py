"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))`` (vLLM's names)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from apt_serve_ray.config import EngineConfig
from apt_serve_ray.engine.llm_engine import LLMEngine
from apt_serve_ray.models.loader import DEFAULT_MODEL, generation_defaults, resolve_model
from apt_serve_ray.engine.outputs import RequestOutput
from apt_serve_ray.sampling.params import SamplingParams
from apt_serve_ray.scheduler.registry import make_policy
from apt_serve_ray.engine.stats import CacheStats

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def make_config(model: str = DEFAULT_MODEL, **kwargs) -> EngineConfig:
    unknown = sorted(set(kwargs) - _CONFIG_FIELDS)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown engine argument; valid arguments: {sorted(_CONFIG_FIELDS)}")
    return EngineConfig(model=model, **kwargs)


class LLM:
    """An engine in this process. Every keyword is an ``EngineConfig`` field."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs) -> None:
        self.llm_engine = LLMEngine(make_config(model, **kwargs))
        self._sampling_defaults = generation_defaults(resolve_model(self.llm_engine.config.model))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` / ``chat`` sample with when given no ``SamplingParams``: the model's
        generation-config defaults where it has them, else ``SamplingParams()``'s (as vLLM)."""
        return SamplingParams(**self._sampling_defaults)

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        lora_name: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of the prompts. ``lora_name``: the LoRA
        adapter of every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority: {len(priority)} given for {len(prompts)} prompts")
        if lora_name is None or isinstance(lora_name, str):
            loras = [lora_name] * len(prompts)
        else:
            loras = list(lora_name)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_name: {len(loras)} given for {len(prompts)} prompts")
        engine = self.llm_engine
        # Validate everything before adding anything, so a bad prompt leaves the engine untouched.
        requests = [
            engine.make_request(p, sp, priority=None if priority is None else priority[i], lora_name=loras[i])
            for i, (p, sp) in enumerate(zip(prompts, params))
        ]
        for request in requests:
            engine.add_request(request)
        finished: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[r.request_id] for r in requests]

    def chat(
        self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
        *, add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt=add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return apply_chat_template(self.llm_engine.tokenizer, messages, add_generation_prompt)

    # Hybrid cache and scheduler knobs
    def cache_stats(self) -> CacheStats:
        return self.llm_engine.cache_stats()

    @property
    def cache_ratio(self) -> float:
        """The ceiling of the share of pages in compressed kinds now in force (0 where the model is
        offered none). ``llm.adjust_cache_ratio(min(0.7, llm.cache_ratio + 0.1))`` raises it."""
        return self.llm_engine.scheduler.cache_ratio

    def adjust_cache_ratio(self, ratio: float) -> None:
        self.llm_engine.adjust_cache_ratio(ratio)

    def set_scheduler(self, policy, **options) -> None:
        """A policy object (e.g. ``AdaptiveScheduler(...)``) or a registered name."""
        if isinstance(policy, str):
            policy = make_policy(policy, self.llm_engine.config, **options)
        self.llm_engine.set_policy(policy)

    def set_monitor_callback(self, fn: Callable[[float], None] | None) -> None:
        """``fn(usage)`` is called every iteration with the share of pages in use."""
        self.llm_engine.monitor_callback = fn


class HybridCacheLLM(LLM):
    """The hybrid KV / hidden-state cache engine (the same engine; the name the design uses)."""


def apply_chat_template(tokenizer, messages, add_generation_prompt: bool = True,
                        template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` through the model's chat template; ``template_kwargs``: variables the
    template reads (e.g. Qwen3's ``enable_thinking``); ``tools``: for a template that renders them."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not (
                isinstance(m.get("content"), str) or (m.get("content") is None and m.get("tool_calls"))):
            raise ValueError(f"messages[{i}]: must have a string 'role' and a string 'content'")
    if tokenizer.chat_template is None:
        raise ValueError("messages: this model has no chat template; use a plain prompt")
    reserved = {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict", "tools"}
    clash = sorted(reserved & set(template_kwargs or {}))
    if clash:
        raise ValueError(f"chat_template_kwargs: {clash[0]!r} cannot be set there")
    if tools:
        template_kwargs = {**(template_kwargs or {}), "tools": tools}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        **(template_kwargs or {}))
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
