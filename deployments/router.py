"""Router: the HTTP ingress (OpenAI-compatible API) and the Python handle API, over the engine replicas.

One request's way through it:

1. prepare it (``preparation.py``: validation, its service class from the body's ``service_class`` or
   the ``x-service-class`` header, tokenising, context checks, the ``EngineRequest`` and its admission
   ticket), so that every bad input is a 4xx before any engine sees it;
2. while the controller has closed admission (heavy watermark): with ``heavy_watermark_action``
   "hold" (the default) wait in the admission line, for at most the request's TTFT target, then 503 +
   ``Retry-After``; with "refuse", 503 + ``Retry-After`` at once;
3. wait for an in-flight slot in the score-ordered admission queue (429 when that line is full; the
   controller narrows the slots to ``admission_limit`` of them while it forecasts a peak over heavy);
   steps 2 and 3 are ``admission_gate.py``'s, whose rule the fleet simulator shares;
4. stream ``StreamItem``s from an engine replica (``FitAwareRequestRouter`` picks it) and assemble them
   into OpenAI responses or server-sent events ending with ``data: [DONE]`` (``responses.py``).

The first item is awaited before the HTTP status is sent, so an engine that refuses the request still
gives a 4xx. A client that disconnects cancels this request; Serve cancels the engine call with it,
which aborts the request in the engine and frees its pages.

The controller's state and the arrivals reported to it travel over ``ControllerLink``
(``controller_link.py``). Observability: the router times TTFT as the client sees it (request received -> first token handed
on) and subtracts the engine's own TTFT (sent with the first item) to get the time spent in the Serve
path; it counts the requests it refuses or loses (the engine counts those it finishes); with tracing
on it opens a "router.request" span per request and sends its context along, so the engine's span
joins the same trace. ``GET /v1/debug/memory_timeline`` draws a replica's cache-memory timeline.
"""

import asyncio
import contextlib
import dataclasses
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.propagate import inject
from ray import serve
from ray.serve import context as serve_context
from ray.exceptions import RayError
from starlette.exceptions import HTTPException as StarletteHTTPException

from apt_serve_ray.models.loader import generation_defaults, load_tokenizer, resolve_model
from apt_serve_ray.observability.metrics import NO_SERVICE_CLASS
from apt_serve_ray.observability.tracing import configure_tracing, finished_spans
from deployments import openai_protocol as oai
from deployments import auth, responses
from deployments.admission import AdmissionQueue
from deployments.admission_gate import AdmissionGate
from deployments.affinity import keep_off_engine_cpus
from deployments.metrics import RouterMetrics, make_backend, snapshot
from deployments.lora_registry import AdapterRegistry, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from deployments.request_body import read_body
from deployments.router_options import RouterOptions
from deployments.prefix_affinity import fits_beside_cached_prefix, process_index
from deployments.preparation import ModelLimits, Prepared, RequestPreparer
from deployments.service_classes import HEADER, ServiceClasses
from deployments.streaming import coalesced
from deployments.controller_link import ControllerLink
from deployments.wire import EngineRequest, InvalidRequest, StreamItem

SESSION_HEADER = "x-session-id"  # a conversation's id: its requests stick to one replica (else the body's user)

logger = logging.getLogger("ray.serve")


api = FastAPI(title="apt-serve-ray", docs_url=None, redoc_url=None)
api.add_middleware(auth.ApiKeyMiddleware)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    error = oai.APIError(str(exc.detail), status=exc.status_code, type="invalid_request_error")
    return JSONResponse(error.body(), status_code=exc.status_code)


# Serve pickles the class when it is decorated: module-level helpers it uses must be defined above.
@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Router:
    async def __init__(self, engine, controller, options: RouterOptions) -> None:
        keep_off_engine_cpus(options.engine_cpus)
        auth.install(auth.ApiKeys(options.api_keys))
        self.engine, self.controller, self.options = engine, controller, options
        self.served_model_name = options.name
        source = resolve_model(options.model)
        defaults = generation_defaults(source)
        if defaults:
            logger.info("router: sampling defaults from the model's generation config: %s", defaults)
        self.preparer = RequestPreparer(
            self.served_model_name, load_tokenizer(source, options.tokenizer), sampling_defaults=defaults,
            default_ttft_slo_ms=options.default_ttft_slo_ms, output_horizon_tokens=options.output_horizon_tokens,
            service_classes=ServiceClasses(options.service_classes, options.default_service_class),
            adapters=dict.fromkeys(options.lora_modules))
        self.adapters = AdapterRegistry(options.lora_modules, self.served_model_name)
        self.admission = AdmissionQueue(options.max_in_flight, options.max_queued_requests,
                                        options.admission_weights, options.urgency_slack_s, options.max_wait_s,
                                        options.fairness_penalty)
        self.created = int(time.time())
        self._limits: ModelLimits | None = None
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._metrics = make_backend({"model": self.served_model_name, "replica": self.replica_id},
                                     options.mirror_metrics)
        self.metrics = RouterMetrics(self._metrics)
        provider = configure_tracing(options.tracing_exporter, service_name="apt-serve-router")
        self.tracer = provider.get_tracer("deployments.router") if provider is not None else None
        self.link = ControllerLink(controller, self.replica_id, options.poll_interval_s,
                                   options.output_horizon_tokens)
        self.gate = AdmissionGate(self.admission, self.link, options.max_in_flight, options.heavy_watermark_action,
                                  options.poll_interval_s, on_rejected=lambda: self.metrics.outcome("rejected"))
        self._poller = asyncio.create_task(self.gate.poll(lambda state: self._sync_adapters(state.adapters)))

    # HTTP -----------------------------------------------------------------------------------------
    @api.post("/v1/completions", openapi_extra=oai.openapi_body(oai.CompletionRequest))
    async def http_completions(self, request: Request):
        return await self._http(request, chat=False)

    @api.post("/v1/chat/completions", openapi_extra=oai.openapi_body(oai.ChatCompletionRequest))
    async def http_chat(self, request: Request):
        return await self._http(request, chat=True)

    @api.get("/v1/models")
    async def http_models(self):
        limits = await self.model_limits()
        return {"object": "list", "data": [{
            "id": self.served_model_name, "object": "model", "created": self.created, "owned_by": "apt-serve-ray",
            "root": self.options.model, "max_model_len": limits.max_model_len}]
            + self.adapters.model_cards(self.created, limits.max_model_len)}

    def _sync_adapters(self, runtime: dict[str, str]) -> None:
        """The adapters loaded at run time, as the controller lists them (or as this router just changed them)."""
        self.adapters.runtime = dict(runtime)
        self.preparer.adapters = self.adapters.for_requests()

    @api.post("/v1/load_lora_adapter", openapi_extra=oai.openapi_body(LoadLoRAAdapterRequest))
    async def http_load_lora_adapter(self, request: Request):
        """vLLM's: ``{"lora_name", "lora_path"}``; every replica loads it on its first request for it."""
        return await self._lora_endpoint(request, LoadLoRAAdapterRequest, self._load_adapter)

    @api.post("/v1/unload_lora_adapter", openapi_extra=oai.openapi_body(UnloadLoRAAdapterRequest))
    async def http_unload_lora_adapter(self, request: Request):
        """vLLM's: ``{"lora_name"}``; adapters loaded at start (``lora_modules``) stay."""
        return await self._lora_endpoint(request, UnloadLoRAAdapterRequest, self._unload_adapter)

    async def _lora_endpoint(self, request: Request, cls, act):
        try:
            if not self.options.allow_runtime_lora_updating:
                raise oai.APIError("loading LoRA adapters at run time is off (allow_runtime_lora_updating)",
                                   status=404, code="not_found")
            return await act(oai.parse_request(cls, await read_body(request, self.options.max_request_body_bytes)))
        except oai.APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    async def _load_adapter(self, body: LoadLoRAAdapterRequest):
        self._sync_adapters(await self.adapters.load(body, self.controller))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def _unload_adapter(self, body: UnloadLoRAAdapterRequest):
        self._sync_adapters(await self.adapters.unload(body, self.controller))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @api.get("/health")
    async def http_health(self):
        try:
            await asyncio.wait_for(self.engine.check_health.remote(), timeout=10)
        except Exception as exc:  # noqa: BLE001 - any failure means "not ready"
            return JSONResponse({"status": "unhealthy", "reason": repr(exc)}, status_code=503)
        state = self.link.state
        return {"status": "ok", "admission_open": self.link.is_admission_open(), "admission_held": self.admission.held,
                "engine_replicas": len(self.link.known_replicas()),
                "requests_in_flight": self.admission.num_in_flight, "requests_waiting": self.admission.num_waiting,
                "admission_limit": state.admission_limit if state is not None else 1.0,
                "pressured_replicas": sorted(r for r, k in state.knobs.items() if k.is_pressured) if state else [],
                "forecast": state.forecast.to_dict() if state is not None and state.forecast is not None else None,
                "forecast_usage": state.forecast_usage if state is not None else None}

    @api.get("/v1/debug/memory_timeline")
    async def http_memory_timeline(self, replica: str | None = None, format: str = "png"):
        """A replica's cache-memory timeline (pages by kind, usage, hidden target, watermarks): a PNG,
        or the recorded series with ``format=json``. ``replica``: an id from ``/health``'s
        ``engine_replicas`` or ``x-replica-id`` (default: any replica)."""
        if format not in ("png", "json"):
            return JSONResponse(oai.APIError("format: must be 'png' or 'json'", param="format").body(), status_code=400)
        known = self.link.known_replicas()
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
            self.gate.refuse_if_saturated()
            body = await read_body(request, self.options.max_request_body_bytes)
            prepared = await self.prepare(body, chat, request.headers.get(HEADER), request.headers.get(SESSION_HEADER))
            opened = await self._open(prepared)
        except oai.APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())
        headers = {"x-request-id": prepared.request_id, "x-replica-id": str(opened[0][1].replica_id)}
        if prepared.body.stream:
            return StreamingResponse(responses.sse(opened), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        try:
            return JSONResponse(await responses.collect(opened), headers=headers)
        except oai.APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status, headers={**headers, **exc.headers()})

    async def _open(self, prepared: Prepared) -> list[tuple[Prepared, StreamItem, object]]:
        """Each choice's engine stream and first item (n > 1 and several prompts: one engine request
        per choice, all admitted at once); APIError, with every stream closed, if any is refused."""
        streams = [(choice, self._generate(choice)) for choice in prepared.choices]
        firsts = await asyncio.gather(*(anext(items) for _, items in streams), return_exceptions=True)
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is None:  # one that ended before its first token (shed: 503), before any status is sent
            failed = next((responses.failure(f) for f in firsts if f.is_failed), None)
        if failed is not None:
            for (_, items), first in zip(streams, firsts):
                if not isinstance(first, BaseException):
                    await items.aclose()
            if isinstance(failed, StopAsyncIteration):
                raise oai.APIError("the engine stream ended without a first item", status=500, type="server_error")
            raise failed
        return [(choice, first, items) for (choice, items), first in zip(streams, firsts)]

    # Python handle API ----------------------------------------------------------------------------
    async def completions(self, body: dict) -> dict:
        """``handle.completions.remote({...}).result()``: one OpenAI completion response. The body is the
        HTTP body (the service class too: ``"service_class": "interactive"``)."""
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
        return await responses.collect(await self._open(prepared))

    async def _handle_stream(self, body: dict, chat: bool):
        prepared = await self.prepare({**body, "stream": True}, chat)
        async for payload in responses.chunks(await self._open(prepared)):
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

    # Preparation ----------------------------------------------------------------------------------
    async def prepare(self, raw: bytes | dict, chat: bool, service_class_header: str | None = None,
                      session_header: str | None = None) -> Prepared:
        received = time.monotonic()
        try:
            return self.preparer.prepare(raw, chat, await self.model_limits(), received, service_class_header,
                                         session_header)
        except oai.APIError:
            self.metrics.outcome("invalid")
            raise

    async def model_limits(self) -> ModelLimits:
        if self._limits is None:
            self._limits = ModelLimits.from_load(await self.engine.load.remote())
        return self._limits

    # Admission and the engine call ----------------------------------------------------------------
    async def _generate(self, prepared: Prepared):
        """Engine items for one request, after admission, in a "router.request" span when tracing."""
        span, request = None, prepared.request
        self.link.count_arrival(request)
        if self.tracer is not None:
            span = self.tracer.start_span("router.request", attributes={
                "request.id": prepared.request_id, "request.service_class": request.service_class or NO_SERVICE_CLASS})
            carrier: dict[str, str] = {}
            inject(carrier, context=trace.set_span_in_context(span))
            request = dataclasses.replace(request, trace_context=carrier)
        outcome = "cancelled"  # the caller stopped before the end
        try:
            async with contextlib.aclosing(self._admitted_items(prepared, request, span)) as items:
                async for item in items:
                    outcome = item.finish_reason or outcome
                    yield item
        except oai.APIError as exc:
            outcome = {503: "rejected", 429: "rejected"}.get(exc.status, "invalid" if exc.status < 500 else "error")
            self.metrics.outcome(outcome)
            raise
        finally:
            if span is not None:
                span.set_attribute("request.outcome", outcome)
                span.end()

    def _engine_call(self, request: EngineRequest, index: int):
        """The engine replica's stream for ``request``. The second and later choices of one request
        (``n``, several prompts) go with Serve request ids of their own: a handle call inherits its
        caller's, and two streams of one id on one replica stall (measured: the second never started)."""
        var = getattr(serve_context, "_serve_request_context", None)  # Serve's own (private) context
        context = var.get() if var is not None else None
        if not index or context is None:
            return self.engine.options(stream=True).generate.remote(request)
        token = var.set(dataclasses.replace(
            context, request_id=f"{context.request_id}-{index}",
            _internal_request_id=f"{context._internal_request_id or context.request_id}-{index}"))
        try:
            return self.engine.options(stream=True).generate.remote(request)
        finally:
            var.reset(token)

    async def _admitted_items(self, prepared: Prepared, request: EngineRequest, span):
        """Engine items for one request, after admission. Raises APIError before the first item."""
        if self.gate.refuses_at_once():
            raise self.gate.closed()
        ticket = prepared.ticket
        if self.admission.is_held(ticket) and self.link.state is not None:
            ticket.passes_hold = fits_beside_cached_prefix(
                process_index(), self.link.state.replicas.values(), request.prompt, ticket.num_pages,
                request.prefix_salt)
        await self.gate.acquire(ticket)
        admitted = time.monotonic()
        if span is not None:
            span.add_event("admitted")
        started = finished = False
        stream = None
        try:
            stream = self._engine_call(request, prepared.index)
            async with contextlib.aclosing(coalesced(stream, StreamItem.merge)) as items:
                async for item in items:
                    if isinstance(item, InvalidRequest):
                        message, field = item.message, prepared.body.constraint_field
                        if field and message.startswith("structured_output:"):  # the client's name for it
                            message = field + message.removeprefix("structured_output")
                        raise oai.from_value_error(ValueError(message))
                    if not started:
                        now = time.monotonic()
                        self.metrics.first_token(now - prepared.received, item.engine_ttft_s, request.service_class)
                        self.admission.observe_ttft(now - admitted)
                        if span is not None:
                            span.add_event("first_token")
                    started, finished = True, item.is_final
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
