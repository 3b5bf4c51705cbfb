"""Router: the HTTP ingress (OpenAI-compatible API) and the Python handle API, over the engine replicas.

One request's way through it:

1. validate (strict pydantic models, ``SamplingParams``), tokenise (prompt or chat template), and
   check the context length, so that every bad input is a 4xx before any engine sees it;
2. refuse with 503 + ``Retry-After`` while the controller has closed admission (heavy watermark);
3. wait for an in-flight slot in the score-ordered admission queue (429 when that line is full);
4. stream from an engine replica (``FitAwareRequestRouter`` picks it) and translate the items into
   OpenAI responses or server-sent events ending with ``data: [DONE]``.

The first item is awaited before the HTTP status is sent, so an engine that refuses the request still
gives a 4xx. A client that disconnects cancels this request; Serve cancels the engine call with it,
which aborts the request in the engine and frees its pages.

Observability: the router times TTFT as the client sees it (request received -> first token handed
on) and subtracts the engine's own TTFT (sent with the first item) to get the time spent in the Serve
path; it counts the requests it refuses or loses (the engine counts those it finishes); with tracing
on it opens a "router.request" span per request and sends its context along, so the engine's span
joins the same trace. ``GET /v1/debug/memory_timeline`` draws a replica's cache-memory timeline.
"""


import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.propagate import inject
from ray import serve
from ray.exceptions import RayError
from starlette.exceptions import HTTPException as StarletteHTTPException

from apt_serve_ray import SamplingParams
from apt_serve_ray.llm import apply_chat_template
from apt_serve_ray.model_loader import load_tokenizer, resolve_model
from apt_serve_ray.observability.tracing import configure_tracing, finished_spans
from deployments import openai_protocol as oai
from deployments.affinity import keep_off_engine_cpus
from deployments.admission import AdmissionQueue, QueueFull, ScoreWeights, Ticket
from deployments.metrics import RouterMetrics, make_backend, snapshot
from deployments.request_router import request_pages
from deployments.streaming import coalesced, merge_items

logger = logging.getLogger("ray.serve")

api = FastAPI(title="apt-serve-ray", docs_url=None, redoc_url=None)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    error = oai.APIError(str(exc.detail), status=exc.status_code, type="invalid_request_error")
    return JSONResponse(error.body(), status_code=exc.status_code)


@dataclass
class Prepared:
    """A validated request, ready for admission."""

    body: oai.CompletionRequest | oai.ChatCompletionRequest
    chat: bool
    request_id: str
    created: int
    engine_request: dict
    ticket: Ticket
    received: float = field(default_factory=time.monotonic)  # when validation began (monotonic)


async def _next(items) -> dict:
    try:
        return await anext(items)
    except StopAsyncIteration:
        raise oai.APIError("the engine stream ended without a final token", status=500, type="server_error") from None


# Serve pickles the class when it is decorated: module-level helpers it uses must be defined above.
@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Router:
    async def __init__(self, engine, controller, options: dict) -> None:
        keep_off_engine_cpus(options.get("engine_cpus"))
        self.engine, self.controller = engine, controller
        self.model = options["model"]
        self.served_model_name = options.get("served_model_name") or self.model
        self.tokenizer = load_tokenizer(resolve_model(self.model), options.get("tokenizer"))
        self.default_ttft_slo_s = options.get("default_ttft_slo_ms", 10_000.0) / 1000.0
        self.horizon = options.get("output_horizon_tokens", 256)
        self.admission = AdmissionQueue(
            options.get("max_in_flight", 256), options.get("max_queued_requests", 1024),
            ScoreWeights(**options.get("admission_weights", {})), options.get("urgency_slack_s", 1.0))
        self.poll_interval_s = options.get("poll_interval_s", 0.25)
        self.created = int(time.time())
        self.state: dict = {}
        self.state_time = 0.0
        self._info: dict | None = None
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._metrics = make_backend({"model": self.served_model_name, "replica": self.replica_id},
                                     options.get("mirror_metrics", False))
        self.metrics = RouterMetrics(self._metrics)
        provider = configure_tracing(options.get("tracing_exporter", "none"), service_name="apt-serve-router")
        self.tracer = provider.get_tracer("deployments.router") if provider is not None else None
        self._poller = asyncio.create_task(self._poll_controller())

    # HTTP -----------------------------------------------------------------------------------------
    @api.post("/v1/completions")
    async def http_completions(self, request: Request):
        return await self._http(request, chat=False)

    @api.post("/v1/chat/completions")
    async def http_chat(self, request: Request):
        return await self._http(request, chat=True)

    @api.get("/v1/models")
    async def http_models(self):
        info = await self._model_info()
        return {"object": "list", "data": [{
            "id": self.served_model_name, "object": "model", "created": self.created, "owned_by": "apt-serve-ray",
            "root": self.model, "max_model_len": info["max_model_len"]}]}

    @api.get("/health")
    async def http_health(self):
        try:
            await asyncio.wait_for(self.engine.check_health.remote(), timeout=10)
        except Exception as exc:  # noqa: BLE001 - any failure means "not ready"
            return JSONResponse({"status": "unhealthy", "reason": repr(exc)}, status_code=503)
        return {"status": "ok", "admission_open": self.is_admission_open(),
                "engine_replicas": len(self.state.get("replicas", {})),
                "requests_in_flight": self.admission.num_in_flight, "requests_waiting": self.admission.num_waiting}

    @api.get("/v1/debug/memory_timeline")
    async def http_memory_timeline(self, replica: str | None = None, format: str = "png"):
        """A replica's cache-memory timeline (pages by kind, usage, hidden target, watermarks): a PNG,
        or the recorded series with ``format=json``. ``replica``: an id from ``/health``'s
        ``engine_replicas`` or ``x-replica-id`` (default: any replica)."""
        if format not in ("png", "json"):
            return JSONResponse(oai.APIError("format: must be 'png' or 'json'", param="format").body(), status_code=400)
        known = sorted(self.state.get("replicas", {}))
        if replica is not None and replica not in known:
            error = oai.APIError(f"replica: unknown engine replica {replica!r}; known: {known}", status=404,
                                 param="replica")
            return JSONResponse(error.body(), status_code=404)
        call = self.engine.memory_timeline.remote(format, **({"replica_id": replica} if replica else {}))
        result = await asyncio.wait_for(call, timeout=30)
        if format == "json":
            return result
        return Response(result, media_type="image/png")

    async def _http(self, request: Request, chat: bool):
        try:
            prepared = await self.prepare(await request.body(), chat)
            items = self._generate(prepared)
            first = await anext(items)
        except oai.APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())
        headers = {"x-request-id": prepared.request_id, "x-replica-id": str(first.get("replica_id"))}
        if prepared.body.stream:
            return StreamingResponse(self._sse(prepared, first, items), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        try:
            return JSONResponse(await self._collect(prepared, first, items), headers=headers)
        except oai.APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status, headers={**headers, **exc.headers()})

    async def _sse(self, prepared: Prepared, first: dict, items):
        async for payload in self._chunks(prepared, first, items):
            yield oai.sse(payload)
        yield oai.sse("[DONE]")

    # Python handle API ----------------------------------------------------------------------------
    async def completions(self, body: dict) -> dict:
        """``handle.completions.remote({...}).result()``: one OpenAI completion response."""
        return await self._handle_call(body, chat=False)

    async def chat(self, body: dict) -> dict:
        return await self._handle_call(body, chat=True)

    async def completions_stream(self, body: dict):
        """``handle.options(stream=True).completions_stream.remote({...})``: OpenAI chunk dicts."""
        async for payload in self._handle_stream(body, chat=False):
            yield payload

    async def chat_stream(self, body: dict):
        async for payload in self._handle_stream(body, chat=True):
            yield payload

    async def _handle_call(self, body: dict, chat: bool) -> dict:
        prepared = await self.prepare({**body, "stream": False}, chat)
        items = self._generate(prepared)
        return await self._collect(prepared, await anext(items), items)

    async def _handle_stream(self, body: dict, chat: bool):
        prepared = await self.prepare({**body, "stream": True}, chat)
        items = self._generate(prepared)
        async for payload in self._chunks(prepared, await anext(items), items):
            if "error" in payload:
                raise oai.APIError(payload["error"]["message"], status=500, type=payload["error"]["type"])
            yield payload

    # Test hooks -----------------------------------------------------------------------------------
    def metrics_snapshot(self) -> dict:
        """The router's metric values kept in memory (``mirror_metrics``; {} otherwise)."""
        return snapshot(self._metrics)

    def finished_spans(self) -> list[dict]:
        """Spans of this process under the "memory" tracing exporter."""
        return finished_spans()

    # Validation -----------------------------------------------------------------------------------
    async def prepare(self, raw: bytes | dict, chat: bool) -> Prepared:
        received = time.monotonic()
        try:
            prepared = await self._validate(raw, chat)
        except oai.APIError:
            self.metrics.outcome("invalid")
            raise
        prepared.received = received
        return prepared

    async def _validate(self, raw: bytes | dict, chat: bool) -> Prepared:
        body = oai.parse_request(oai.ChatCompletionRequest if chat else oai.CompletionRequest, raw)
        if body.model != self.served_model_name:
            raise oai.APIError(f"model: the model `{body.model}` does not exist; this server serves "
                               f"`{self.served_model_name}`", status=404, param="model", code="model_not_found")
        info = await self._model_info()
        try:
            prompt_ids = self._tokenize(body, chat)
        except ValueError as exc:
            raise oai.from_value_error(exc) from None
        max_len, num_prompt = info["max_model_len"], len(prompt_ids)
        if num_prompt >= max_len:
            raise oai.APIError(f"{'messages' if chat else 'prompt'}: {num_prompt} tokens leave no room to "
                               f"generate within the model's context of {max_len} tokens",
                               param="messages" if chat else "prompt", code="context_length_exceeded")
        if body.max_tokens is not None and num_prompt + body.max_tokens > max_len:
            raise oai.APIError(f"max_tokens: {num_prompt} prompt tokens + max_tokens {body.max_tokens} exceed the "
                               f"model's context of {max_len} tokens", param="max_tokens",
                               code="context_length_exceeded")
        room = max_len - num_prompt  # chat defaults to the rest of the context, completions to 16 (OpenAI)
        sampling = body.sampling_kwargs(default_max_tokens=room if chat else min(16, room))
        try:
            SamplingParams(**sampling)
        except ValueError as exc:
            raise oai.from_value_error(exc) from None
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        engine_request = {"request_id": request_id, "prompt": prompt_ids, "sampling": sampling,
                          "scheduling": body.scheduling_kwargs(), "num_prompt_tokens": num_prompt,
                          "max_tokens": sampling["max_tokens"]}
        pages = request_pages(engine_request, info["tokens_per_page"], self.horizon)
        ttft_s = body.ttft_slo_ms / 1000.0 if body.ttft_slo_ms else self.default_ttft_slo_s
        ticket = Ticket(pages, ttft_s, body.priority or 0)
        return Prepared(body, chat, request_id, int(time.time()), engine_request, ticket)

    def _tokenize(self, body, chat: bool) -> list[int]:
        if chat:
            return apply_chat_template(self.tokenizer, body.conversation())
        prompt = body.single_prompt()
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    async def _model_info(self) -> dict:
        """The context a request may use: the model's, capped to what one replica's pages can hold
        with a KV cache (a request larger than the whole pool could never finish)."""
        if self._info is None:
            load = await self.engine.load.remote()
            tokens_per_page = load["tokens_per_page"]["kv"]
            self._info = {"max_model_len": min(load["max_model_len"], load["num_pages"] * tokens_per_page),
                          "tokens_per_page": tokens_per_page}
        return self._info

    # Admission and the engine call ----------------------------------------------------------------
    def is_admission_open(self) -> bool:
        """Closed only on the controller's word; a controller gone silent does not stop traffic."""
        fresh = time.monotonic() - self.state_time < max(5.0, 20 * self.poll_interval_s)
        return not fresh or self.state.get("admission_open", True)

    async def _poll_controller(self) -> None:
        while True:
            try:
                self.state = await asyncio.wait_for(self.controller.get_state.remote(), timeout=5)
                self.state_time = time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep serving on the last known state
                logger.warning("router: controller poll failed: %r", exc)
            await asyncio.sleep(self.poll_interval_s)

    async def _generate(self, prepared: Prepared):
        """Engine items for one request, after admission, in a "router.request" span when tracing."""
        span = None
        if self.tracer is not None:
            span = self.tracer.start_span("router.request", attributes={"request.id": prepared.request_id})
            carrier: dict[str, str] = {}
            inject(carrier, context=trace.set_span_in_context(span))
            prepared.engine_request["trace_context"] = carrier
        outcome = "cancelled"  # the caller stopped before the end
        try:
            async with contextlib.aclosing(self._admitted_items(prepared, span)) as items:
                async for item in items:
                    outcome = item.get("finish_reason", outcome)
                    yield item
        except oai.APIError as exc:
            outcome = {503: "rejected", 429: "rejected"}.get(exc.status, "invalid" if exc.status < 500 else "error")
            self.metrics.outcome(outcome)
            raise
        finally:
            if span is not None:
                span.set_attribute("request.outcome", outcome)
                span.end()

    async def _admitted_items(self, prepared: Prepared, span):
        """Engine items for one request, after admission. Raises APIError before the first item."""
        if not self.is_admission_open():
            raise oai.APIError("the server is at its memory limit and admits no new requests; retry later",
                               status=503, type="server_overloaded", code="admission_closed",
                               retry_after_s=self.state.get("retry_after_s", 2.0))
        try:
            await self.admission.acquire(prepared.ticket)
        except QueueFull as exc:
            raise oai.APIError(f"too many requests are waiting: {exc}; retry later", status=429,
                               type="rate_limit_exceeded", code="queue_full",
                               retry_after_s=self.state.get("retry_after_s", 2.0)) from None
        if span is not None:
            span.add_event("admitted")
        started = finished = False
        stream = None
        try:
            stream = self.engine.options(stream=True).generate.remote(prepared.engine_request)
            async with contextlib.aclosing(coalesced(stream, merge_items)) as items:
                async for item in items:
                    if "invalid" in item:
                        raise oai.from_value_error(ValueError(item["invalid"]))
                    if not started:
                        self.metrics.first_token(time.monotonic() - prepared.received, item.get("engine_ttft_s"))
                        if span is not None:
                            span.add_event("first_token")
                    started, finished = True, "finish_reason" in item
                    yield item
        except RayError as exc:
            logger.warning("router: request %s failed in the engine: %r", prepared.request_id, exc)
            raise oai.APIError(f"the engine replica serving this request failed ({type(exc).__name__}); "
                               "retry the request", status=500 if started else 503, type="server_error",
                               code="engine_failed", retry_after_s=1.0) from None
        finally:
            if stream is not None and not finished:
                stream.cancel()  # the caller stopped early: abort the request in the engine
            self.admission.release()

    async def _collect(self, prepared: Prepared, first: dict, items) -> dict:
        texts, item = [], first
        async with contextlib.aclosing(items):
            while True:
                texts.append(item["text"])
                if "finish_reason" in item:
                    break
                item = await _next(items)
        if item.get("error") or item["finish_reason"] == "error":
            raise oai.APIError(f"generation failed: {item.get('error')}", status=500, type="server_error")
        body = prepared.body
        return oai.completion(prepared.request_id, body.model, "".join(texts), oai.finish_reason(item["finish_reason"]),
                              oai.usage(first["num_prompt_tokens"], item["num_output_tokens"]), chat=prepared.chat,
                              created=prepared.created)

    async def _chunks(self, prepared: Prepared, first: dict, items):
        """OpenAI chunk dicts for one request; an engine failure mid-stream is one ``{"error": ...}`` dict."""
        body, chat, rid, created = prepared.body, prepared.chat, prepared.request_id, prepared.created
        include_usage, num_output, item = body.include_usage, 0, first
        async with contextlib.aclosing(items):
            if chat:
                yield oai.chunk(rid, body.model, created, chat=True, text="", role=True, include_usage=include_usage)
            try:
                while True:
                    num_output += len(item["token_ids"])
                    final = "finish_reason" in item
                    if final and (item.get("error") or item["finish_reason"] == "error"):
                        raise oai.APIError(f"generation failed: {item.get('error')}", status=500,
                                           type="server_error")
                    if item["text"] or final:
                        yield oai.chunk(rid, body.model, created, chat=chat, text=item["text"],
                                        reason=oai.finish_reason(item.get("finish_reason")),
                                        include_usage=include_usage)
                    if final:
                        break
                    item = await _next(items)
            except oai.APIError as exc:
                yield exc.body()
                return
        if include_usage:
            yield oai.chunk(rid, body.model, created, chat=chat,
                            usage_=oai.usage(first["num_prompt_tokens"], num_output), include_usage=True)

