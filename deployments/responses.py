"""Response assembly: each choice's ``StreamItem``s -> one OpenAI response, its chunks, or server-sent events.

A request is one choice or several (``n`` > 1, several prompts: one engine request each). Each function
takes ``opened``: per choice its ``Prepared``, its first item (the router awaits them before choosing the
HTTP status) and the iterator of the rest; it closes every iterator when it stops, so that a caller who
goes away cancels the engine calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from apt_serve_ray.engine.outputs import OVERLOADED
from deployments import openai_objects as objects
from deployments import openai_protocol as oai
from deployments.controller_link import RETRY_AFTER_S
from deployments import tools
from deployments.preparation import Prepared
from deployments.wire import StreamItem

Opened = list[tuple[Prepared, StreamItem, AsyncIterator[StreamItem]]]


async def next_item(items: AsyncIterator[StreamItem]) -> StreamItem:
    try:
        return await anext(items)
    except StopAsyncIteration:
        raise oai.APIError("the engine stream ended without a final token", status=500, type="server_error") from None


def failure(item: StreamItem) -> oai.APIError:
    """The APIError of a failed final item: 503 + ``Retry-After`` for a request the policy shed, 500 else."""
    if item.error and item.error.startswith(OVERLOADED):  # shed by the policy before it started
        return oai.APIError(item.error, status=503, type="server_overloaded", code="cannot_start_in_time",
                            retry_after_s=RETRY_AFTER_S)
    return oai.APIError(f"generation failed: {item.error}", status=500, type="server_error")


class _Usage:
    """Usage over the choices: each prompt's tokens (and those found cached) once, however many
    choices it has; every choice's output tokens."""

    def __init__(self) -> None:
        self.prompts: dict[int, tuple[int, int | None]] = {}
        self.num_output = 0

    def add(self, prepared: Prepared, first: StreamItem, num_output: int, num_cached: int | None) -> None:
        prompt, cached = self.prompts.get(prepared.prompt_index, (first.num_prompt_tokens or 0, None))
        if num_cached is not None:
            cached = max(cached or 0, num_cached)
        self.prompts[prepared.prompt_index] = (prompt, cached)
        self.num_output += num_output

    def body(self) -> dict:
        cached = [c for _, c in self.prompts.values() if c is not None]
        return objects.usage(sum(p for p, _ in self.prompts.values()), self.num_output, sum(cached) if cached else None)


async def collect(opened: Opened) -> dict:
    """The whole OpenAI response (completion or chat completion); APIError if generation failed."""
    try:
        results = await asyncio.gather(*(_collect_one(*choice) for choice in opened))
    finally:
        for _, _, items in opened:
            await items.aclose()
    prepared = opened[0][0]
    usage, choices = _Usage(), []
    for (choice, first, _), (text, reason, num_output, num_cached, extra) in zip(opened, results):
        usage.add(choice, first, num_output, num_cached)
        body = objects.completion(choice.request_id, choice.body.model, text, reason, {}, chat=choice.chat, **extra)
        choices.append({**body["choices"][0], "index": choice.index})
    response = objects.completion(prepared.request_id, prepared.body.model, "", None, usage.body(), chat=prepared.chat,
                              created=prepared.created)
    response["choices"] = choices
    return response


async def _collect_one(prepared: Prepared, first: StreamItem, items: AsyncIterator[StreamItem]):
    texts, ids, logprobs, item = [], [], [], first
    async with contextlib.aclosing(items):
        while True:
            texts.append(item.text)
            ids.extend(item.token_ids)
            logprobs.extend(item.logprobs or ())
            if item.is_final:
                break
            item = await next_item(items)
    if item.is_failed:
        raise failure(item)
    extra = {"token_ids": _token_ids(prepared, ids, first=True), "logprobs": _logprobs(prepared, ids, logprobs)}
    text, reason = "".join(texts), objects.finish_reason(item.finish_reason)
    if prepared.chat and prepared.body.calls_tools:
        text, extra["tool_calls"] = tools.parse(text, prepared.body)
        if extra["tool_calls"] and reason == "stop":
            reason = "tool_calls"
    return text, reason, item.num_output_tokens, item.num_cached_tokens, extra


def _token_ids(prepared: Prepared, ids, *, first: bool) -> dict | None:
    """The choice's ids where the request asked (``return_token_ids``): the generated ones, and the
    prompt's with the first."""
    if not prepared.body.return_token_ids:
        return None
    out = {"token_ids": list(ids)}
    prompt = prepared.request.prompt
    if first and not isinstance(prompt, str):
        out["prompt_token_ids"] = list(prompt)
    return out


def _logprobs(prepared: Prepared, ids, logprobs, offset: int = 0) -> dict | None:
    """The choice's ``logprobs`` object where the request asked for them."""
    num_top = prepared.body.num_logprobs
    if num_top is None:
        return None
    return objects.logprobs_object(ids, logprobs, num_top, prepared.token_text, chat=prepared.chat, offset=offset)


async def chunks(opened: Opened) -> AsyncIterator[dict]:
    """OpenAI chunk dicts for the request's choices, interleaved as they come (each names its
    ``index``), then the usage chunk where asked; an engine failure mid-stream is one
    ``{"error": ...}`` dict, and ends the stream."""
    prepared = opened[0][0]
    usage = _Usage()
    if len(opened) == 1:
        async for payload in _chunks_one(*opened[0], usage):
            yield payload
            if "error" in payload:
                return
    else:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice) -> None:
            try:
                async for payload in _chunks_one(*choice, usage):
                    await queue.put(payload)
            finally:
                await queue.put(None)

        tasks = [asyncio.ensure_future(pump(choice)) for choice in opened]
        try:
            running = len(tasks)
            while running:
                payload = await queue.get()
                if payload is None:
                    running -= 1
                    continue
                yield payload
                if "error" in payload:
                    return
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for _, _, items in opened:
                await items.aclose()
    if prepared.body.include_usage:
        yield objects.chunk(prepared.request_id, prepared.body.model, prepared.created, chat=prepared.chat,
                        usage_=usage.body(), include_usage=True)


async def _chunks_one(prepared: Prepared, first: StreamItem, items: AsyncIterator[StreamItem],
                      usage: _Usage) -> AsyncIterator[dict]:
    body, chat, rid, created = prepared.body, prepared.chat, prepared.request_id, prepared.created
    include_usage, num_output, item, sent_first = body.include_usage, 0, first, False
    text_offset = 0  # characters sent so far (completions' logprobs count offsets in the whole text)

    def indexed(payload: dict) -> dict:
        for choice in payload["choices"]:
            choice["index"] = prepared.index
        return payload

    # With tools the text may turn out to be calls: it is held back and sent, as content or calls,
    # in one chunk at the end.
    held = [] if chat and body.calls_tools else None
    async with contextlib.aclosing(items):
        if chat:
            yield indexed(objects.chunk(rid, body.model, created, chat=True, text="", role=True,
                                    include_usage=include_usage))
        try:
            while True:
                num_output += len(item.token_ids)
                if item.is_final and item.is_failed:
                    raise failure(item)
                if held is not None:
                    held.append(item.text)
                    if item.is_final:
                        text, calls = tools.parse("".join(held), body)
                        reason = objects.finish_reason(item.finish_reason)
                        yield indexed(objects.chunk(rid, body.model, created, chat=True, text=text,
                                                reason="tool_calls" if calls and reason == "stop" else reason,
                                                include_usage=include_usage, tool_calls=calls))
                        break
                    item = await next_item(items)
                    continue
                want_logprobs = body.num_logprobs is not None and item.token_ids
                if item.text or item.is_final or want_logprobs or (body.return_token_ids and item.token_ids):
                    logprobs = _logprobs(prepared, item.token_ids, item.logprobs or (), text_offset) \
                        if want_logprobs else None
                    yield indexed(objects.chunk(rid, body.model, created, chat=chat, text=item.text,
                                            reason=objects.finish_reason(item.finish_reason), include_usage=include_usage,
                                            token_ids=_token_ids(prepared, item.token_ids, first=not sent_first),
                                            logprobs=logprobs))
                    sent_first = True
                    text_offset += len(item.text)
                if item.is_final:
                    break
                item = await next_item(items)
        except oai.APIError as exc:
            yield exc.body()
            return
    usage.add(prepared, first, num_output, item.num_cached_tokens)


async def sse(opened: Opened) -> AsyncIterator[str]:
    """Server-sent events of the chunks, ending with ``data: [DONE]``."""
    async for payload in chunks(opened):
        yield objects.sse(payload)
    yield objects.sse("[DONE]")
