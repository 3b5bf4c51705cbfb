"""A model-free engine: the real scheduler, page pool and policies driven by a step-time cost model on
a simulated clock. For scheduler tests and quick policy studies (not a substitute for real runs).

Step time = ``base_s + per_token_s * batched tokens + per_context_s * sum(context of decodes)
+ hidden_context_s * sum(context of hidden decodes)`` — the shape the calibrated cost model has.
"""

from __future__ import annotations

from dataclasses import dataclass

from apt_serve_ray.cache.cache_manager import CacheManager
from apt_serve_ray.cache.layout import CacheLayout
from apt_serve_ray.cache.page_pool import PagePool
from apt_serve_ray.config import EngineConfig
from apt_serve_ray.request import CacheKind, Request, RequestStatus
from apt_serve_ray.sampling_params import SamplingParams
from apt_serve_ray.scheduler.registry import make_policy
from apt_serve_ray.scheduler.scheduler import Scheduler
from apt_serve_ray.scheduler.watermarks import Watermarks


@dataclass(frozen=True)
class CostModel:
    base_s: float = 0.010
    per_token_s: float = 0.0002
    per_context_s: float = 0.000002
    hidden_context_s: float = 0.00002

    def predict(self, num_tokens: int, sum_context: int, sum_hidden_context: int = 0) -> float:
        """The same shape as ``calibration.StepTimeModel.predict`` (context: decodes and chunks alike)."""
        return (self.base_s + self.per_token_s * num_tokens + self.per_context_s * sum_context
                + self.hidden_context_s * sum_hidden_context)

    def step_time(self, chunks) -> float:
        t = self.base_s + self.per_token_s * sum(c.num_tokens for c in chunks)
        for c in chunks:
            ctx = c.request.num_computed_tokens + c.num_tokens
            t += self.per_context_s * ctx
            if c.request.kind is CacheKind.HIDDEN:
                t += self.hidden_context_s * ctx
        return t


# OPT-125m-like geometry (MHA: a hidden page holds 2x the tokens) and a grouped-query one.
MHA_LAYOUT = CacheLayout(num_layers=12, num_kv_heads=12, head_dim=64, hidden_size=768, block_size=16, dtype_bytes=2)
GQA_LAYOUT = CacheLayout(num_layers=30, num_kv_heads=3, head_dim=64, hidden_size=576, block_size=16, dtype_bytes=2)


class SimulatedEngine:
    def __init__(self, config: EngineConfig, layout: CacheLayout = MHA_LAYOUT, num_pages: int = 100,
                 cost: CostModel = CostModel(), policy=None, max_model_len: int = 2048) -> None:
        self.config = config
        self.cost = cost
        self.now = 0.0
        self.cache = CacheManager(PagePool(num_pages), layout)
        hidden_allowed = config.hidden_allowed(layout.hidden_saves_memory)
        self.scheduler = Scheduler(config, self.cache, None, hidden_allowed, max_model_len)
        self.hidden_allowed = hidden_allowed
        self.runner = None
        policy = policy or make_policy(config.policy, config)
        policy.bind(self)
        self.scheduler.policy = policy
        self.watermarks = (Watermarks(config.light_watermark, config.heavy_watermark, config.max_hidden_ratio,
                                      config.hidden_ratio_step, base=self.scheduler.cache_ratio)
                           if config.enable_watermarks else None)
        self.finished: list[Request] = []
        self.steps: list[dict] = []
        self._next_id = 0

    def add(self, prompt_len: int, output_len: int, *, ttft_slo_ms: float | None = None, tbt_slo_ms: float | None = None,
            priority: int = 0, request_id: str | None = None) -> Request:
        rid = request_id or f"r{self._next_id}"
        self._next_id += 1
        request = Request(rid, [7] * prompt_len, SamplingParams(max_tokens=output_len, ignore_eos=True),
                          arrival_time=self.now, max_total_tokens=10**9,
                          ttft_slo_ms=ttft_slo_ms or self.config.default_ttft_slo_ms,
                          tbt_slo_ms=tbt_slo_ms or self.config.default_tbt_slo_ms, priority=priority)
        self.scheduler.add_request(request)
        return request

    def step(self):
        if self.watermarks is not None:
            d = self.watermarks.observe(self.cache.pool.usage())
            self.scheduler.set_cache_ratio(d.cache_ratio)
            self.scheduler.pressure_admit = d.admit
        out = self.scheduler.schedule(self.now)
        self.cache.release_deferred()
        dt = self.cost.step_time(out.chunks) if out.chunks else 0.001
        self.now += dt
        for c in out.chunks:
            c.request.num_computed_tokens += c.num_tokens
        for c in out.chunks:
            r = c.request
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token(8, self.now)
                if r.num_output_tokens >= r.max_output_tokens:
                    self.scheduler.finish(r, RequestStatus.FINISHED_LENGTH)
                    r.finish_time = self.now
                    self.finished.append(r)
        self.steps.append({"t": self.now, "out": out, "usage": self.cache.pool.usage(),
                           "ratio": self.scheduler.cache_ratio, "admit": self.scheduler.pressure_admit})
        return out

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.num_unfinished:
                return
            self.step()
        raise RuntimeError(f"not idle after {max_steps} steps: {self.scheduler.num_unfinished} unfinished")
