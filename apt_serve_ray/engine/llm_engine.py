"""The synchronous engine: add requests, ``step()`` (schedule, run, postprocess), collect outputs.

Single-threaded by design: the async engine and the Ray deployment drive it from one loop thread.
What it publishes about itself is typed in ``stats.py``.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from typing import Callable

import torch

from apt_serve_ray.cache.cache_manager import CacheManager
from apt_serve_ray.worker.calibration import measure_costs
from apt_serve_ray.cache.page_pool import PagePool
from apt_serve_ray.cache.swap import SwapSpace, make_swap_space
from apt_serve_ray.config import EngineConfig, check_share
from apt_serve_ray.engine import request_checks
from apt_serve_ray.engine.detokenizer import IncrementalDetokenizer
from apt_serve_ray.engine.lora_slots import LoRASlots
from apt_serve_ray.models.loader import load_tokenizer, resolve_model
from apt_serve_ray.worker.model_runner import ModelRunner
from apt_serve_ray.observability.observer import EngineObserver, RequestEvent, RequestLogger
from apt_serve_ray.engine.outputs import OVERLOADED, RequestOutput, output_of
from apt_serve_ray.request import CacheKind, Request, RequestStatus
from apt_serve_ray.sampling.params import SamplingParams
from apt_serve_ray.scheduler.output import ScheduledChunk
from apt_serve_ray.scheduler.registry import make_policy
from apt_serve_ray.scheduler.scheduler import Scheduler
from apt_serve_ray.scheduler.watermarks import Watermarks
from apt_serve_ray.engine.stats import CacheStats, StepStats, collect_cache_stats

logger = logging.getLogger("apt_serve_ray")


class LLMEngine(LoRASlots):
    """By default the engine loads ``config.model`` and runs on ``time.monotonic``. The simulator
    (``bench/simulator.py``) injects instead a ``runner`` that executes a ``SchedulerOutput`` without a
    model, a stand-in ``tokenizer`` and a simulated ``clock``, so the logic under test is this one.

    A runner has ``layout``, ``num_pages``, ``max_model_len``, ``vocab_size`` and ``hf_config`` (for
    its EOS ids; may be None), ``execute(out) -> [(request, SampledToken)]`` for the requests whose
    chunk completes, and ``forget(request_id)``; with ``swap_space``, ``execute`` also runs the
    output's swap plans (the engine hands a runner with cache tensors, ``storage``, its ``swap``; one
    without them prices transfers with its ``transfer_cost``). Every time the engine reads (arrival, schedule,
    tokens, finish, step durations) comes from ``clock()``.
    """

    def __init__(self, config: EngineConfig, *, runner=None, tokenizer=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        if runner is None:
            self.source = resolve_model(config.model)
            tokenizer = load_tokenizer(self.source, config.tokenizer)
            runner = ModelRunner(config, self.source)
        elif tokenizer is None:
            raise ValueError("tokenizer: an injected runner needs a tokenizer beside it")
        else:
            self.source = None
        self.tokenizer = tokenizer
        self.runner = runner
        for name, path in config.lora_module_paths().items():
            self.add_lora(name, path)  # the first max_loras take a slot; the others load on demand
        self.layout = self.runner.layout
        self.max_model_len = self.runner.max_model_len
        kv_capacity = self.runner.num_pages * config.block_size
        if kv_capacity < self.max_model_len:
            # A request longer than the whole pool could never run: it would be preempted forever.
            logger.warning("max_model_len capped from %d to %d tokens: the KV capacity of %d pages",
                           self.max_model_len, kv_capacity, self.runner.num_pages)
            self.max_model_len = kv_capacity
        self.vocab_size = self.runner.vocab_size
        self.swap = self._make_swap_space()
        self.cache = CacheManager(PagePool(self.runner.num_pages, config.prefix_cache_retention), self.layout, self.swap,
                                  enable_prefix_caching=config.enable_prefix_caching)
        self.hidden_allowed = config.hidden_allowed(self.layout.hidden_saves_memory)
        self.compressed_kinds = config.compressed_kinds(self.layout)
        logger.info(self.layout.describe(self.runner.num_pages, self.config.enable_hybrid_cache,
                                         self.config.force_hidden))
        lay = self.layout
        self._geometry = dict(  # the fixed part of cache_stats(), published every step
            hidden_supported=lay.hidden_saves_memory, hidden_ratio=lay.hidden_ratio,
            bytes_per_page=lay.bytes_per_page, kv_bytes_per_token=lay.bytes_per_token(CacheKind.KV),
            hidden_bytes_per_token=lay.bytes_per_token(CacheKind.HIDDEN),
            kv_tokens_per_page=lay.tokens_per_page(CacheKind.KV),
            hidden_tokens_per_page=lay.tokens_per_page(CacheKind.HIDDEN),
            tokens_per_page_by_kind={k.value: lay.tokens_per_page(k) for k in CacheKind},
            compressed_kinds=tuple(k.value for k in self.compressed_kinds),
        )
        self.scheduler = Scheduler(config, self.cache, None, self.hidden_allowed, self.max_model_len,
                                   self.compressed_kinds)
        self.set_policy(make_policy(config.policy, config, **(config.policy_options or {})))
        self.watermarks = (
            Watermarks(config.light_watermark, config.heavy_watermark, config.max_hidden_ratio,
                       config.hidden_ratio_step, base=self.scheduler.cache_ratio)
            if config.enable_watermarks else None
        )
        self.monitor_callback: Callable[[float], None] | None = None
        self.eos_token_ids = self._eos_ids()
        self.requests: dict[str, Request] = {}
        self._lora_waiting: collections.deque[Request] = collections.deque()  # for an adapter slot
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.last_step: StepStats | None = None
        self.num_steps = 0
        self._observers: list[EngineObserver] = [RequestLogger()]

    def add_observer(self, observer: EngineObserver) -> None:
        self._observers.append(observer)

    def remove_observer(self, observer: EngineObserver) -> None:
        if observer in self._observers:
            self._observers.remove(observer)

    def _emit(self, request: Request, event: RequestEvent, now: float, **attrs) -> None:
        for observer in self._observers:
            observer.on_request_event(request, event, now, attrs)

    # Set-up ---------------------------------------------------------------------------------------
    def _make_swap_space(self) -> SwapSpace | None:
        """The tier below memory (none at ``swap_space`` 0), its transfer cost measured now, as rho is."""
        swap = make_swap_space(self.config.swap_space, self.config.swap_dir, self.layout, self.runner)
        if swap is not None and swap.is_backed:
            cost = swap.transfer
            logger.info("swap space: %s; %.3f ms per page out (%.2f GB/s), %.3f ms in (%.2f GB/s)", swap.describe(),
                        cost.out_s_per_page * 1e3, cost.gb_per_s()[0], cost.in_s_per_page * 1e3, cost.gb_per_s()[1])
            self.runner.swap = swap
        return swap

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        eos = getattr(self.runner.hf_config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def set_policy(self, policy) -> None:
        """Install ``policy``. One that prices its choices (``policy.costs`` not None) gets the step costs
        it was not given measured here, on this engine's model and pages, and injected; the policy
        itself never sees the engine. ``calibrate_rho=False`` (the simulator) measures nothing."""
        costs = getattr(policy, "costs", None)
        if costs is not None and self.config.calibrate_rho:
            policy.set_costs(measure_costs(self.runner, self.cache.pool, costs, hidden_allowed=self.hidden_allowed,
                                           kinds=self.compressed_kinds))
        self.scheduler.policy = policy

    # Requests -------------------------------------------------------------------------------------
    def make_request(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None, request_id: str | None = None,
        *, arrival_time: float | None = None, ttft_slo_ms: float | None = None, tbt_slo_ms: float | None = None,
        priority: int | None = None, trace_context: dict[str, str] | None = None, service_class: str | None = None,
        cache_salt: str | None = None, lora_name: str | None = None,
    ) -> Request:
        """Validate and tokenise; raises ValueError naming the bad field. Does not touch engine state."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        request_checks.check_params(params, self.vocab_size)
        text, ids = request_checks.prompt_ids(prompt, self.tokenizer, self.vocab_size, self.max_model_len)
        if params.structured_output is not None:
            self.structured_outputs().compile(params.structured_output)  # a bad grammar: refused now
        request_checks.check_hints(ttft_slo_ms=ttft_slo_ms, tbt_slo_ms=tbt_slo_ms, priority=priority,
                                   service_class=service_class, cache_salt=cache_salt)
        self._check_lora(lora_name)
        request = Request(
            request_id or uuid.uuid4().hex, ids, params, prompt=text,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            max_total_tokens=self.max_model_len,
            ttft_slo_ms=ttft_slo_ms or self.config.default_ttft_slo_ms,
            tbt_slo_ms=tbt_slo_ms or self.config.default_tbt_slo_ms,
            priority=self.config.default_priority if priority is None else priority,
            trace_context=trace_context, service_class=service_class, cache_salt=cache_salt,
        )
        request.lora_name = lora_name
        return request

    def structured_outputs(self):
        """The engine's grammars and matchers (made when a request first asks for structured output:
        the grammar library loads then)."""
        so = self.runner.sampler.structured
        if so is None:
            from apt_serve_ray.sampling.structured import StructuredOutputs

            so = StructuredOutputs(self.tokenizer, self.vocab_size, self.config.structured_output_backend)
            self.runner.sampler.structured = so
        return so

    def add_request(self, prompt, sampling_params=None, request_id=None, **kwargs) -> Request:
        request = prompt if isinstance(prompt, Request) else self.make_request(prompt, sampling_params, request_id, **kwargs)
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        sp = request.sampling_params
        if sp.detokenize:  # else the caller detokenises (the async engine, off the step loop)
            self._detokenizers[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, sp.skip_special_tokens, sp.stop_strings, sp.include_stop_str_in_output
            )
        if sp.structured_output is not None:
            self.structured_outputs().add(request.request_id, sp.structured_output)
        if request.lora_name is not None and self._lora_queue_closed() or not self._take_lora_slot(request):
            self._lora_waiting.append(request)  # every adapter slot held by requests: it waits for one
        else:
            self.scheduler.add_request(request)
        self.requests[request.request_id] = request
        self._emit(request, RequestEvent.QUEUED, self.clock())
        predictor = getattr(self.scheduler.policy, "predictor", None)
        if predictor is not None:  # ``enable_prediction``: here, not an observer, so attach order is free
            predictor.observe_request(request.arrival_time, request.num_prompt_tokens, request.max_output_tokens)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        return self._finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._lora_waiting)

    # The step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = self.clock()
        usage = self.cache.pool.usage()
        if self.watermarks is not None:
            decision = self.watermarks.observe(usage)
            if decision.changed:
                logger.info("watermarks: %s", decision.reason)
                self.scheduler.set_cache_ratio(decision.cache_ratio)
                self.scheduler.pressure_admit = decision.admit
        if self.monitor_callback is not None:
            self.monitor_callback(usage)
        started = self._start_lora_waiting()
        sched_now = self.clock()
        out = self.scheduler.schedule(sched_now)
        self.last_step = None
        if len(self._observers) > 1 or out.preempted:
            self._emit_schedule_events(out, sched_now)
        shed = started + [self._shed(r) for r in out.shed]  # turned away by the policy: an explicit error
        if out.is_empty:
            return shed
        predicted = self.scheduler.predicted_seconds(out)
        t1 = self.clock()
        try:
            results = self.runner.execute(out)
        except Exception as exc:  # the step failed: every request in it ends with an explicit error
            logger.exception("step failed; failing %d requests", len(out.chunks))
            self.cache.release_deferred()
            for plan in out.swap_out:  # their slots may not hold their pages: recompute them
                if plan.request_id in self.requests:
                    self.cache.drop_swapped(self.requests[plan.request_id])
                else:  # demoted prefix pages
                    self.cache.forget_tier_slots(plan.slots)
            failed = shed
            for chunk in out.chunks:
                chunk.request.error = f"{type(exc).__name__}: {exc}"
                failed.append(self._finish(chunk.request, RequestStatus.FINISHED_ERROR))
            return failed
        self.cache.release_deferred()
        now = self.clock()
        name_pages = self.cache.name_computed_pages
        for chunk in out.chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens
            name_pages(chunk.request)
        outputs = shed + [o for o in (self._on_token(request, sampled, now) for request, sampled in results)
                          if o is not None]
        self.num_steps += 1
        decodes = sum(1 for c in out.chunks if c.num_tokens == 1 and c.request.num_output_tokens)
        upgrades = sum(p.is_upgrade for p in out.conversions)
        self.last_step = StepStats(
            schedule_s=out.schedule_time_s, execute_s=now - t1, total_s=self.clock() - t0,
            num_tokens=out.num_batched_tokens, num_seqs=len(out.chunks), num_upgrades=upgrades,
            preempt_causes=tuple(out.preempt_causes), cache=self.cache_stats(), num_swap_outs=sum(out.preempt_swapped),
            num_swap_ins=len(out.swap_in), num_decodes=decodes, num_prefill_tokens=out.num_batched_tokens - decodes,
            num_compressions=len(out.conversions) - upgrades, predicted_s=predicted)
        self.scheduler.observe_step(predicted, self.last_step.total_s)
        sampler = getattr(self.runner, "sampler", None)
        if sampler is not None and (sampler.mask_s_per_row or sampler.adjust_s_per_row):
            self.scheduler.observe_sampling(sampler.mask_s_per_row, sampler.adjust_s_per_row)
        for observer in self._observers:
            observer.on_step(self, self.last_step, now)
        return outputs

    def _emit_schedule_events(self, out, now: float) -> None:
        for chunk in out.chunks:
            if chunk.request.first_scheduled_time == now:
                self._emit(chunk.request, RequestEvent.SCHEDULED, now, num_tokens=chunk.num_tokens)
        for request, cause, swapped in zip(out.preempted, out.preempt_causes, out.preempt_swapped):
            self._emit(request, RequestEvent.PREEMPTED, now, cause=cause, swapped=swapped)
        for plan in out.conversions:
            if plan.request_id in self.requests:
                event = RequestEvent.UPGRADED if plan.is_upgrade else RequestEvent.COMPRESSED
                self._emit(self.requests[plan.request_id], event, now, num_tokens=plan.num_tokens,
                           kind=plan.to_kind.value)

    def _on_token(self, request: Request, sampled, now: float) -> RequestOutput | None:
        token = sampled.token_id
        request.append_output_token(token, now)
        if request.num_output_tokens == 1:
            self._emit(request, RequestEvent.FIRST_TOKEN, now)
        if sampled.logprob is not None:
            request.cumulative_logprob += sampled.logprob
            request.output_logprobs.append(sampled.top_logprobs)
        detok = self._detokenizers.get(request.request_id)
        stop_string = detok.add_token(token) if detok is not None else None
        sp = request.sampling_params
        status, reason = None, None
        may_stop = request.num_output_tokens >= sp.min_tokens
        if sampled.grammar_done:  # its structured output is complete: nothing more may follow
            status = RequestStatus.FINISHED_STOPPED
        elif may_stop and stop_string is not None:
            status, reason = RequestStatus.FINISHED_STOPPED, stop_string
        elif may_stop and not sp.ignore_eos and token in self.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif may_stop and token in sp.stop_token_ids:
            status, reason = RequestStatus.FINISHED_STOPPED, token
        elif request.num_output_tokens >= request.max_output_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            request.stop_reason = reason
            return self._finish(request, status)
        return self._output(request)

    def _shed(self, request: Request) -> RequestOutput:
        """End a request the policy turned away before it started (``SchedulerOutput.shed``)."""
        request.error = (f"{OVERLOADED}: the server cannot start this request within its TTFT target "
                         f"({request.ttft_slo_ms:.0f} ms) under the present load; retry later")
        return self._finish(request, RequestStatus.FINISHED_ERROR)

    def _finish(self, request: Request, status: RequestStatus) -> RequestOutput:
        self.scheduler.finish(request, status)
        request.finish_time = self.clock()
        self.runner.forget(request.request_id)
        self._emit(request, RequestEvent.FINISHED, request.finish_time, outcome=status.value)
        output = self._output(request)
        self.requests.pop(request.request_id, None)
        self._detokenizers.pop(request.request_id, None)
        ref = request.lora
        if ref is not None and self.runner.lora.ref(ref.name) != ref \
                and not any(r.lora == ref for r in self.requests.values()):
            self.runner.lora.release(ref)  # unloaded while it ran: the last of its requests frees the slot
        return output

    def _output(self, request: Request) -> RequestOutput | None:
        return output_of(request, self._detokenizers.get(request.request_id))

    def prompt_logits(self, token_ids: list[int], kind: CacheKind = CacheKind.KV,
                      lora_name: str | None = None) -> torch.Tensor:
        """Logits at every position of ``token_ids`` ([n, vocab], float32), computed through the paged
        cache of the given kind (with the LoRA adapter ``lora_name``); the pages are returned afterwards.
        Runs between steps only."""
        request = self.make_request(list(token_ids), SamplingParams(max_tokens=1), lora_name=lora_name)
        if not self._take_lora_slot(request):
            raise ValueError(f"max_loras: every adapter slot is held by requests; {lora_name!r} has none")
        kind = CacheKind(kind)
        if kind.stores_hidden and not self.hidden_allowed:
            raise ValueError(f"kind: the {kind.value} cache kind is disabled for this model")
        if kind.is_int8 and self.layout.tokens_per_page(kind) == 0:
            raise ValueError(f"kind: a page is too small for one {kind.value} token")
        if not self.cache.allocate(request, request.num_tokens, kind):
            raise ValueError(f"token_ids: {request.num_tokens} tokens do not fit in the free pages")
        try:
            return self.runner.logits_for_all_rows([ScheduledChunk(request, request.num_tokens)])
        finally:
            self.cache.free(request)

    # Knobs and stats ------------------------------------------------------------------------------
    def adjust_cache_ratio(self, ratio: float) -> None:
        self.scheduler.set_cache_ratio(check_share("cache_ratio", ratio))
        if self.watermarks is not None:
            self.watermarks.base = self.watermarks.ratio = self.scheduler.cache_ratio

    def check_integrity(self) -> None:
        """Both tiers, between steps: the page pool and the swap slots are consistent, every request's
        pages and slots are its own, and no page or slot is held by a request the engine has not."""
        self.cache.check_integrity(self.requests.values())
        for request in self.scheduler.running:
            if request.swap_slots:
                raise AssertionError(f"running request {request.request_id} still holds swap slots")
        for request in self.scheduler.waiting:
            if request.page_ids:
                raise AssertionError(f"waiting request {request.request_id} holds pages")

    def set_admission(self, open_: bool) -> None:
        self.scheduler.admission_open = bool(open_)

    def cache_stats(self) -> CacheStats:
        return collect_cache_stats(self.cache, self.scheduler, self.swap, num_lora_waiting=len(self._lora_waiting),
                                   hidden_allowed=self.hidden_allowed, loras=self.loaded_loras(), **self._geometry)
