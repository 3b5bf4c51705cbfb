"""Response assembly: a request's ``StreamItem``s -> one OpenAI response, its chunks, or server-sent events.

Each function takes the first item apart (the router awaits it before choosing the HTTP status) and
the iterator of the rest, and closes that iterator when it stops, so that a caller who goes away
cancels the engine call.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from deployments import openai_protocol as oai
from deployments.preparation import Prepared
from deployments.wire import StreamItem


async def next_item(items: AsyncIterator[StreamItem]) -> StreamItem:
    try:
        return await anext(items)
    except StopAsyncIteration:
        raise oai.APIError("the engine stream ended without a final token", status=500, type="server_error") from None


def _failure(item: StreamItem) -> oai.APIError:
    return oai.APIError(f"generation failed: {item.error}", status=500, type="server_error")


async def collect(prepared: Prepared, first: StreamItem, items: AsyncIterator[StreamItem]) -> dict:
    """The whole OpenAI response (completion or chat completion); APIError if generation failed."""
    texts, ids, item = [], [], first
    async with contextlib.aclosing(items):
        while True:
            texts.append(item.text)
            ids.extend(item.token_ids)
            if item.is_final:
                break
            item = await next_item(items)
    if item.is_failed:
        raise _failure(item)
    return oai.completion(prepared.request_id, prepared.body.model, "".join(texts),
                          oai.finish_reason(item.finish_reason),
                          oai.usage(first.num_prompt_tokens, item.num_output_tokens, item.num_cached_tokens),
                          chat=prepared.chat, created=prepared.created,
                          token_ids=_token_ids(prepared, ids, first=True))


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


async def chunks(prepared: Prepared, first: StreamItem, items: AsyncIterator[StreamItem]) -> AsyncIterator[dict]:
    """OpenAI chunk dicts for one request; an engine failure mid-stream is one ``{"error": ...}`` dict."""
    body, chat, rid, created = prepared.body, prepared.chat, prepared.request_id, prepared.created
    include_usage, num_output, item, sent_first = body.include_usage, 0, first, False
    async with contextlib.aclosing(items):
        if chat:
            yield oai.chunk(rid, body.model, created, chat=True, text="", role=True, include_usage=include_usage)
        try:
            while True:
                num_output += len(item.token_ids)
                if item.is_final and item.is_failed:
                    raise _failure(item)
                if item.text or item.is_final or (body.return_token_ids and item.token_ids):
                    yield oai.chunk(rid, body.model, created, chat=chat, text=item.text,
                                    reason=oai.finish_reason(item.finish_reason), include_usage=include_usage,
                                    token_ids=_token_ids(prepared, item.token_ids, first=not sent_first))
                    sent_first = True
                if item.is_final:
                    break
                item = await next_item(items)
        except oai.APIError as exc:
            yield exc.body()
            return
    if include_usage:
        yield oai.chunk(rid, body.model, created, chat=chat,
                        usage_=oai.usage(first.num_prompt_tokens, num_output, item.num_cached_tokens),
                        include_usage=True)


async def sse(prepared: Prepared, first: StreamItem, items: AsyncIterator[StreamItem]) -> AsyncIterator[str]:
    """Server-sent events of the chunks, ending with ``data: [DONE]``."""
    async for payload in chunks(prepared, first, items):
        yield oai.sse(payload)
    yield oai.sse("[DONE]")
