"""OpenAI's response objects: a whole completion (chat or text), a streamed chunk, the usage and
logprobs objects, and a server-sent event (``responses.py`` assembles them from the engine's items;
the request side and the error bodies: ``openai_protocol.py``)."""

from __future__ import annotations

import json
import time


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


def completion(request_id: str, model: str, text: str | None, reason: str | None, usage_: dict, *,
               chat: bool, created: int | None = None, token_ids: dict | None = None,
               logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
    """``token_ids``: {"prompt_token_ids", "token_ids"} for the choice (``return_token_ids``);
    ``logprobs``: the choice's (``logprobs_object``); ``tool_calls``: the assistant's calls (chat)."""
    created = created or int(time.time())
    if chat:
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason, **(token_ids or {})}
        return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": [choice], "usage": usage_}
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason, **(token_ids or {})}
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": usage_}


def chunk(request_id: str, model: str, created: int, *, chat: bool, text: str | None = None,
          reason: str | None = None, role: bool = False, usage_: dict | None = None,
          include_usage: bool = False, token_ids: dict | None = None, logprobs: dict | None = None,
          tool_calls: list[dict] | None = None) -> dict:
    """One streamed event. ``text=None`` with ``usage_`` set is the usage-only final chunk.
    ``token_ids``: fields for the choice (``return_token_ids``)."""
    if chat:
        obj = "chat.completion.chunk"
        if usage_ is not None and text is None:
            choices = []
        else:
            delta = {"role": "assistant", "content": text or ""} if role else (
                {"content": text} if text else {})
            if tool_calls:  # each call whole, in one delta (name and all its arguments)
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]
    else:
        obj = "text_completion"
        choices = [] if (usage_ is not None and text is None) else [
            {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}]
    if token_ids and choices:
        choices[0].update(token_ids)
    if logprobs is not None and choices:
        choices[0]["logprobs"] = logprobs
    out = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
    if include_usage:
        out["usage"] = usage_
    return out


def logprobs_object(token_ids, logprobs, num_top: int, token_text, *, chat: bool, offset: int = 0) -> dict:
    """A choice's ``logprobs`` for ``token_ids`` and their engine logprobs ({token id: logprob} per
    token, the sampled one's among them): chat's ``{"content": [{token, logprob, bytes,
    top_logprobs}]}`` or completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``
    (offsets from ``offset``, the characters of text before these tokens). ``token_text``: id -> text."""
    entries = []
    for token, top in zip(token_ids, logprobs):
        best = sorted(top.items(), key=lambda kv: -kv[1])[:num_top]
        entries.append((token_text(token), top.get(token, float("-inf")), [(token_text(t), lp) for t, lp in best]))
    if chat:
        return {"content": [
            {"token": text, "logprob": lp, "bytes": list(text.encode()),
             "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in best]}
            for text, lp, best in entries]}
    offsets = []
    for text, _, _ in entries:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": [text for text, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [dict(best) for _, _, best in entries], "text_offset": offsets}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"
