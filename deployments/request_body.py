"""Reading an HTTP request body under a size limit, so a hostile client cannot make the router hold
an arbitrarily large body in memory: 413 (an OpenAI error body) when ``Content-Length`` says it is
over the limit, and also when a body without one (chunked) grows past it while it is read.
"""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from deployments import openai_protocol as oai

# 8 MiB: a context of 128k tokens as a JSON list of ids is about 1 MiB, so this leaves room for any
# real prompt or conversation (vLLM has no limit of its own; its uvicorn accepts any size).
MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024


def _too_large(limit: int) -> oai.APIError:
    return oai.APIError(f"body: the request body is larger than this server's limit of {limit} bytes",
                        status=413, code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise oai.APIError("Content-Length: not a number of bytes")
        if int(declared) > limit:
            raise _too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise oai.APIError("body: the client went away before sending the whole body") from None
    return b"".join(chunks)
