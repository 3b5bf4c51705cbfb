"""A model-free engine: the real ``LLMEngine`` (scheduler, page pool, policies, watermarks, stop
conditions, outputs) with its model runner replaced by a step-time cost model on a simulated clock.
For scheduler tests and quick policy studies (not a substitute for real runs). No model is loaded.

Step time = ``base_s + per_token_s * batched tokens + per_context_s * sum(context of every row)
+ hidden_context_s * sum(context of hidden rows) + prefill_pair_s * query-key pairs of prefill chunks``
— the shape the calibrated cost model has (``scheduler.costs.step_features``).
Swaps to and from the tier below memory (``swap_space``) move no bytes but take their transfer time
(``swap_out_s_per_page`` / ``swap_in_s_per_page``, per page over all layers) on the same clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from apt_serve_ray.cache.layout import CacheLayout
from apt_serve_ray.cache.swap import TransferCost
from apt_serve_ray.config import EngineConfig
from apt_serve_ray.engine.llm_engine import LLMEngine
from apt_serve_ray.request import Request
from apt_serve_ray.sampling.sampler import SampledToken
from apt_serve_ray.sampling.params import SamplingParams
from apt_serve_ray.scheduler.costs import step_features
from apt_serve_ray.scheduler.output import SchedulerOutput

IDLE_STEP_S = 0.001  # a step that computes nothing still lets the clock move (waiters must see time pass)
PROMPT_TOKEN_ID, OUTPUT_TOKEN_ID = 7, 8


@dataclass(frozen=True)
class CostModel:
    base_s: float = 0.010
    per_token_s: float = 0.0002
    per_context_s: float = 0.000002
    hidden_context_s: float = 0.00002
    # A page to the tier below memory and back: OPT-125m pages (576 KiB in bf16) took 0.04-0.1 ms each
    # way through a memory-mapped file on a 2-core EPYC (benchmarks/swap_cost.py); 16 tokens of recompute
    # cost 16 * per_token_s = 3.2 ms here.
    swap_out_s_per_page: float = 0.0001
    swap_in_s_per_page: float = 0.0001
    # Per query-key pair of a prefill chunk's attention (``costs.chunk_pairs``); 0: chunks cost the
    # same wherever they start (the model before issue 26).
    prefill_pair_s: float = 0.0

    def predict(self, num_tokens: int, sum_context: int, sum_hidden_context: int = 0,
                prefill_pairs: int = 0) -> float:
        """The same shape as ``calibration.StepTimeModel.predict`` (context: decodes and chunks alike)."""
        return (self.base_s + self.per_token_s * num_tokens + self.per_context_s * sum_context
                + self.hidden_context_s * sum_hidden_context + self.prefill_pair_s * prefill_pairs)

    def step_time(self, chunks) -> float:
        return self.predict(*step_features(chunks))


# Cost models measured on this project's 2-core CPU machines for the OPT-125m shape in bf16, one thread,
# and rho (seconds per 16-token page per step): before the engine's C++ attention kernels
# (serving_policies.py --simulate's default; rho from hidden_cache_cost.py, now decode_step.py --flop-model),
# and what the engine measured for ``apt`` at start with them (priority_classes.py's; policy_simulation.json).
CPU_OPT125M = CostModel(base_s=0.0195, per_token_s=0.00113, per_context_s=0.000015, hidden_context_s=0.000139)
CPU_OPT125M_RHO = 0.00222
CPU_OPT125M_KERNELS = CostModel(base_s=0.01055, per_token_s=0.000582, per_context_s=2.96e-06, hidden_context_s=3.32e-06)
CPU_OPT125M_KERNELS_RHO = 5.31e-05


def simulated_engine(config, *, cost: CostModel, rho: float, num_pages: int, max_model_len: int = 2048,
                     layout=None, apt_options: dict | None = None) -> "SimulatedEngine":
    """A ``SimulatedEngine`` running ``config.policy``; ``apt`` is given ``rho`` and the cost model as
    its step-time model (what the engine measures at start), and ``apt_options`` as its arguments."""
    from apt_serve_ray.scheduler.policies.apt import AdaptiveScheduler

    policy = None
    if config.policy == "apt":
        policy = AdaptiveScheduler(**(apt_options or {}), config=config, rho=rho, step_model=cost)
    return SimulatedEngine(config, layout=layout or MHA_LAYOUT, num_pages=num_pages, cost=cost, policy=policy,
                           max_model_len=max_model_len)


def calibrated_cost(path: str, dtype: str = "bfloat16") -> tuple[CostModel, float]:
    """The step-time model and rho the engine measures at start for ``apt`` on the checkpoint at
    ``path`` (one thread), as a ``CostModel`` and seconds per page: a simulator calibrated on this machine."""
    from apt_serve_ray import LLM

    llm = LLM(path, policy="apt", calibrate_rho=True, dtype=dtype, num_threads=1)
    costs = llm.llm_engine.scheduler.policy.costs
    st = costs.step_time
    return CostModel(base_s=st.a, per_token_s=st.b, per_context_s=st.c,
                     hidden_context_s=st.hidden_seconds_per_token), float(costs.rho or 0.0)


# OPT-125m-like geometry (MHA: a hidden page holds 2x the tokens) and a grouped-query one.
MHA_LAYOUT = CacheLayout(num_layers=12, num_kv_heads=12, head_dim=64, hidden_size=768, block_size=16, dtype_bytes=2)
GQA_LAYOUT = CacheLayout(num_layers=30, num_kv_heads=3, head_dim=64, hidden_size=576, block_size=16, dtype_bytes=2)


class SimulatedClock:
    """Simulated seconds: the runner advances them by step times, whoever waits by idle time."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)


class CostModelRunner:
    """The model runner's contract (see ``LLMEngine``) without a model: a step takes the cost
    model's time on the clock and samples ``OUTPUT_TOKEN_ID`` for every request whose chunk completes.
    Keeps the last ``SchedulerOutput`` it ran, for tests that look at the decision."""

    hf_config = None  # no EOS ids: requests end by length
    model = None
    vocab_size = 32_000
    device = torch.device("cpu")  # what calibration's step timing syncs (nothing): ``clock`` times it

    def __init__(self, layout: CacheLayout, num_pages: int, max_model_len: int, cost: CostModel,
                 clock: SimulatedClock) -> None:
        self.layout, self.num_pages, self.max_model_len = layout, num_pages, max_model_len
        self.cost, self.clock = cost, clock
        self.last_output: SchedulerOutput | None = None
        self.num_pages_swapped_out = self.num_pages_swapped_in = 0
        self.swap_s = 0.0  # simulated seconds spent on transfers

    @property
    def transfer_cost(self) -> TransferCost:
        """What the engine's swap space prices transfers with (a real runner measures it)."""
        return TransferCost(self.cost.swap_out_s_per_page, self.cost.swap_in_s_per_page, self.layout.bytes_per_page)

    def execute(self, out: SchedulerOutput) -> list[tuple[Request, SampledToken]]:
        self.last_output = out
        num_out = sum(len(plan.pages) for plan in out.swap_out)
        num_in = sum(len(plan.slots) for plan in out.swap_in)  # what crosses from the tier
        swap_s = num_out * self.cost.swap_out_s_per_page + num_in * self.cost.swap_in_s_per_page
        self.num_pages_swapped_out += num_out
        self.num_pages_swapped_in += num_in
        self.swap_s += swap_s
        self.clock.advance(swap_s + (self.cost.step_time(out.chunks) if out.chunks else IDLE_STEP_S))
        return [(c.request, SampledToken(OUTPUT_TOKEN_ID)) for c in out.chunks if c.completes]

    def forget(self, request_id: str) -> None:
        pass


class _Tokenizer:
    """No vocabulary: one character per token (so incremental detokenisation stays O(1) per token)."""

    eos_token_id = None

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "." * len(token_ids)


class SimulatedEngine:
    """``LLMEngine`` on a ``CostModelRunner`` and a ``SimulatedClock`` (``llm_engine``, as ``LLM``
    has it, so the bench driver and ``CacheTracker`` take either), plus what scenario tests need:
    requests added by length, ``step()`` returning the step's ``SchedulerOutput``, ``now`` to move
    time, ``finished`` requests and a record per step."""

    def __init__(self, config: EngineConfig, layout: CacheLayout = MHA_LAYOUT, num_pages: int = 100,
                 cost: CostModel = CostModel(), policy=None, max_model_len: int = 2048,
                 vocab_size: int | None = None) -> None:
        self.cost = cost
        self.clock = SimulatedClock()
        # The engine would cap the context at the pool's KV capacity anyway; capping here spares the warning.
        max_model_len = min(max_model_len, num_pages * layout.block_size)
        self.runner = CostModelRunner(layout, num_pages, max_model_len, cost, self.clock)
        if vocab_size is not None:
            self.runner.vocab_size = vocab_size
        # No model to calibrate on: a policy that needs rho or a step model is given them.
        self.llm_engine = LLMEngine(config.replace(calibrate_rho=False), runner=self.runner, tokenizer=_Tokenizer(),
                                    clock=self.clock)
        if policy is not None:
            self.llm_engine.set_policy(policy)
        self.finished: list[Request] = []
        self.steps: list[dict] = []  # {"t", "out", "usage", "ratio", "admit"} after each step
        self._requests: dict[str, Request] = {}
        self._next_id = 0

    @property
    def now(self) -> float:
        return self.clock.now

    @now.setter
    def now(self, t: float) -> None:
        self.clock.now = t

    @property
    def config(self) -> EngineConfig:
        return self.llm_engine.config

    @property
    def scheduler(self):
        return self.llm_engine.scheduler

    @property
    def cache(self):
        return self.llm_engine.cache

    @property
    def hidden_allowed(self) -> bool:
        return self.llm_engine.hidden_allowed

    def add(self, prompt_len: int, output_len: int, *, ttft_slo_ms: float | None = None, tbt_slo_ms: float | None = None,
            priority: int = 0, request_id: str | None = None, prompt_token_ids: list[int] | None = None) -> Request:
        """A request of ``prompt_len`` tokens that generates exactly ``output_len``, arriving now. Its
        prompt shares no page with another's (its first token is its own) unless ``prompt_token_ids``
        are given (then ``prompt_len`` is ignored): what the prefix cache finds is the caller's choice."""
        rid = request_id or f"r{self._next_id}"
        if prompt_token_ids is None:
            prompt_token_ids = [OUTPUT_TOKEN_ID + 1 + self._next_id % (self.runner.vocab_size - OUTPUT_TOKEN_ID - 1)] + [PROMPT_TOKEN_ID] * (prompt_len - 1)
        self._next_id += 1
        request = self.llm_engine.add_request(
            list(prompt_token_ids), SamplingParams(max_tokens=output_len, ignore_eos=True), rid,
            ttft_slo_ms=ttft_slo_ms, tbt_slo_ms=tbt_slo_ms, priority=priority)
        self._requests[rid] = request
        return request

    def step(self) -> SchedulerOutput:
        """One engine step; its decision (empty if nothing ran, and then the clock moves by ``IDLE_STEP_S``)."""
        self.runner.last_output = None
        outputs = self.llm_engine.step()
        out = self.runner.last_output
        if out is None:
            out = SchedulerOutput()
            self.clock.advance(IDLE_STEP_S)
        for output in outputs:
            if output.finished and output.request_id in self._requests:
                self.finished.append(self._requests.pop(output.request_id))
        sched = self.scheduler
        self.steps.append({"t": self.now, "out": out, "usage": self.cache.pool.usage(),
                           "ratio": sched.cache_ratio, "admit": sched.pressure_admit})
        return out

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.num_unfinished:
                return
            self.step()
        raise RuntimeError(f"not idle after {max_steps} steps: {self.scheduler.num_unfinished} unfinished")
