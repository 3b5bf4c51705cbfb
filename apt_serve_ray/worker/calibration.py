"""Measured costs the scheduler prices decisions with: ``rho`` and a step-time model.

* ``calibrate_kind`` times what a request whose pages are of a compressed kind adds to every decode
  step: its decode attention over pages of that kind minus the same over KV pages, in every layer,
  through the engine's attention backend (hidden: the unfused path gathers x and projects K/V for
  the whole context, the fused CPU path scores the stored x against the absorbed query, or projects
  page by page under RoPE; kv-int8 / hidden-int8: the same reads with dequantisation). The
  difference is fitted as ``intercept + seconds_per_token * L`` over a range of context lengths L;
  ``seconds_per_page`` is the slope times the tokens of one KV page (``block_size``), the unit in
  which the scheduler counts a request's memory ``m_i`` (SPEC section 2). For the hidden kind it is
  ``rho`` (``calibrate_rho``).
* ``step_time_model`` times whole steps (prepare + forward + lm-head + sample) for a few decode
  batches and prefill chunks and fits ``step_s ~ a + b * num_tokens + c * sum_context``.
* ``measure_costs`` is what the engine calls when it installs a policy that prices with them: it
  measures the ``StepCosts`` the policy was not given, for the compressed kinds the engine offers,
  and the engine injects them. A kind whose measurement fails (its decode path is missing or
  broken) is marked unavailable with a warning, and the policy does not offer it: start-up goes on.

Timings take the fastest of a few repeats (interference only adds time) and, on a CPU with one
torch thread, this thread's CPU time rather than wall time, so a busy shared machine does not
inflate them. Both only read the model and write nothing the engine can see, except that ``step_time_model``
writes K/V into cache pages: give it a ``pool`` to borrow free pages from, or call it before any
request holds pages (engine start).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from apt_serve_ray.attention import DecodeGroup
from apt_serve_ray.request import CacheKind, Request
from apt_serve_ray.sampling.params import SamplingParams
from apt_serve_ray.scheduler.costs import StepCosts, chunk_pairs
from apt_serve_ray.scheduler.output import ScheduledChunk, SchedulerOutput

logger = logging.getLogger("apt_serve_ray")

DEFAULT_RHO_LENGTHS = (64, 128, 256, 512, 1024)
_OWNER = "__calibration__"


def measure_costs(runner, pool, known: StepCosts = StepCosts(), *, hidden_allowed: bool,
                  kinds: tuple[CacheKind, ...] | None = None) -> StepCosts:
    """``known`` with its unknown fields measured on ``runner``'s model, borrowing free pages of ``pool``.

    ``kinds``: the compressed kinds the engine offers (None: the hidden kind where ``hidden_allowed``);
    only those are timed, the others keep cost 0 (never used). rho is 0 where the hidden kind may not
    be used; its calibration also prices the hidden requests' recompute in the step-time model. A
    pool too small to time a few batches leaves the step-time model unknown (prefill chunks then keep
    the fixed token budget)."""
    if kinds is None:
        kinds = (CacheKind.HIDDEN,) if hidden_allowed else ()
    rho, step_time, rho_calibration = known.rho, known.step_time, None
    costs, unavailable = dict(known.kind_costs), set(known.unavailable)
    for kind in kinds:
        if known.known(kind) or kind in unavailable:
            continue
        try:
            calibration = calibrate_kind(runner, kind)
        except Exception as exc:  # noqa: BLE001 -- any failure of one kind's path must not stop the engine
            logger.warning("the %s cache kind could not be timed (%s: %s); the adaptive policy will not offer it",
                           kind.value, type(exc).__name__, exc)
            unavailable.add(kind)
            continue
        if kind.spec.cost == "rho":
            rho, rho_calibration = calibration.seconds_per_page, calibration
        else:
            costs[kind] = calibration.seconds_per_page
    if rho is None:
        rho = 0.0
    if step_time is None:
        try:
            step_time = step_time_model(runner, pool=pool, rho=rho_calibration)
        except ValueError as exc:
            logger.warning("no step-time model (%s); prefill chunks use the fixed token budget", exc)
    conversions = dict(known.conversion_costs)
    for pair in conversion_pairs([k for k in kinds if k not in unavailable]):
        if pair in conversions:
            continue
        try:
            conversions[pair] = conversion_seconds_per_token(runner, pool, *pair)
        except Exception as exc:  # noqa: BLE001 -- an unmeasured conversion is priced 0, as before
            logger.warning("converting %s -> %s could not be timed (%s: %s)", pair[0].value, pair[1].value,
                           type(exc).__name__, exc)
    return StepCosts(rho, step_time, costs, frozenset(unavailable), conversions)


def conversion_pairs(kinds) -> list[tuple[CacheKind, CacheKind]]:
    """The in-place kind changes the adaptive policy may plan with these compressed kinds offered:
    every kind upgraded to KV, and each int8 kind compressed from its full-precision base."""
    pairs = []
    for kind in kinds:
        pairs.append((kind, kind.upgrades_to))
        if kind.is_int8:
            pairs.append((kind.base, kind))
    return pairs


@torch.inference_mode()
def conversion_seconds_per_token(runner, pool, from_kind: CacheKind, to_kind: CacheKind, num_tokens: int = 512,
                                 repeats: int = 2) -> float:
    """Seconds per token of ``runner``'s in-place conversion (``ModelRunner._convert``) of ``num_tokens``
    tokens from ``from_kind`` pages to ``to_kind`` pages, on pages borrowed from ``pool``."""
    from apt_serve_ray.cache.conversions import ConversionPlan

    layout, device = runner.layout, runner.device
    num_tokens = min(num_tokens, runner.max_model_len)
    src_n, dst_n = layout.num_pages_for(num_tokens, from_kind), layout.num_pages_for(num_tokens, to_kind)
    pages = pool.allocate(src_n + dst_n, CacheKind.KV, _OWNER)
    if pages is None:
        raise ValueError("the pool has too few free pages")
    clock = _clock(device)
    try:
        plan = ConversionPlan(_OWNER, num_tokens, pages[:src_n], pages[src_n:], from_kind, to_kind)
        runner._convert(plan)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            _sync(device)
            t = clock()
            runner._convert(plan)
            _sync(device)
            best = min(best, clock() - t)
    finally:
        pool.free(pages, _OWNER)
    return best / num_tokens


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device: torch.device):
    """With one CPU thread every op runs on this thread, so its CPU time is the cost without the time
    other processes held the core (shared machines); otherwise wall time (CPU time would sum threads)."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _fit(columns: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares ``ys ~ columns @ coef`` (columns include the constant)."""
    a = torch.tensor(columns, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    return torch.linalg.lstsq(a, y, driver="gelsd").solution.squeeze(1).tolist()


def _r2(pred: list[float], ys: list[float]) -> float:
    mean = sum(ys) / len(ys)
    ss_tot = sum((y - mean) ** 2 for y in ys)
    ss_res = sum((y - p) ** 2 for y, p in zip(ys, pred))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0


# rho ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KindCalibration:
    """Per-decode-step cost of keeping one request's context in a compressed kind (hidden: rho)."""

    seconds_per_page: float  # extra decode time of one KV page worth of tokens of this kind, all layers
    seconds_per_token: float  # the fitted slope
    intercept_s: float  # fixed cost per request per step (launches, Python), not per page
    tokens_per_page: int  # the KV page size the per-page figure is for (block_size)
    points: tuple[tuple[int, float], ...]  # (context length, hidden minus KV seconds, fastest repeats)
    r2: float = 1.0
    repeats: int = 0
    wall_s: float = 0.0  # how long the calibration itself took
    kind: CacheKind = CacheKind.HIDDEN

    def recompute_seconds(self, num_tokens: int) -> float:
        """Predicted extra decode-step time of one hidden request with ``num_tokens`` of context."""
        return self.intercept_s + self.seconds_per_token * num_tokens


RhoCalibration = KindCalibration  # the hidden kind's, by its old name


def calibrate_rho(runner, lengths: tuple[int, ...] = DEFAULT_RHO_LENGTHS, repeats: int = 3) -> KindCalibration:
    """``calibrate_kind`` for the hidden kind: rho."""
    return calibrate_kind(runner, CacheKind.HIDDEN, lengths, repeats)


def _decode_fn(backend, model, kind: CacheKind):
    """The backend's decode of one layer over pages of ``kind`` as ``f(layer, q, group, storage)``
    (AttributeError where the backend has none: the kind cannot run)."""
    attend = getattr(backend, "decode_" + kind.spec.view)
    if kind.stores_hidden:
        return lambda layer, q, g, storage: attend(layer, q, g, storage, model.kv_projections[layer], model.scale)
    return lambda layer, q, g, storage: attend(layer, q, g, storage, model.scale)


@torch.inference_mode()
def calibrate_kind(runner, kind: CacheKind, lengths: tuple[int, ...] = DEFAULT_RHO_LENGTHS,
                   repeats: int = 3) -> KindCalibration:
    """Time one request's decode attention in all layers over pages of ``kind`` and over KV pages, for
    each context length in ``lengths``, and fit a line to the difference. Lengths beyond the
    model's context or the cache's capacity are dropped. Reads cache pages only."""
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    kind = CacheKind(kind)
    if not kind.is_compressed:
        raise ValueError(f"kind: {kind.value} is not a compressed kind")
    start = time.perf_counter()
    layout, storage, device = runner.layout, runner.storage, runner.device
    model, backend = runner.model, runner.attention
    tpp_kind = layout.tokens_per_page(kind)
    if tpp_kind <= 0:
        raise ValueError(f"kind: a page is too small for one {kind.value} token")
    limit = min(runner.max_model_len, runner.num_pages * min(layout.block_size, tpp_kind))
    usable = sorted({int(n) for n in lengths if 0 < int(n) <= limit})
    if len(usable) < 2:
        usable = sorted({max(1, limit // 4), max(2, limit // 2)})
    clock = _clock(device)
    shape = model.shape
    q = torch.randn(1, shape.num_heads, shape.head_dim, generator=torch.Generator().manual_seed(0))
    q = q.to(device=device, dtype=runner.dtype)

    def one_pass(n: int, k: CacheKind) -> float:
        # The decode path's shape: one request attending over pages 0.. of kind ``k``.
        tpp = layout.tokens_per_page(k)
        group = DecodeGroup(
            rows=torch.zeros(1, dtype=torch.long, device=device),
            block_table=torch.arange((n + tpp - 1) // tpp, dtype=torch.int32, device=device).unsqueeze(0),
            ctx_lens=torch.tensor([n], dtype=torch.int32, device=device), max_len=n, tokens_per_page=tpp,
        )
        attend = decode[k]
        _sync(device)
        t = clock()
        for layer in range(layout.num_layers):
            attend(layer, q, group, storage)
        _sync(device)
        return clock() - t

    kinds = (CacheKind.KV, kind)
    decode = {k: _decode_fn(backend, model, k) for k in kinds}
    for k in kinds:  # warm-up: allocator, kernels, caches (and a missing or broken path fails here)
        one_pass(usable[-1], k)
    # Round-robin over the lengths, then the fastest repeat of each: interference from other
    # processes only ever adds time, and a burst of it then does not tilt the fitted line.
    best = {(n, k): float("inf") for n in usable for k in kinds}
    for _ in range(repeats):
        for n in usable:
            for k in kinds:
                best[n, k] = min(best[n, k], one_pass(n, k))
    points = [(n, max(0.0, best[n, kind] - best[n, CacheKind.KV])) for n in usable]
    intercept, slope = _fit([[1.0, float(n)] for n, _ in points], [t for _, t in points])
    if slope <= 0:  # all noise (tiny models): no per-token cost can be resolved
        slope, intercept = 0.0, sum(t for _, t in points) / len(points)
    intercept = max(0.0, intercept)
    pred = [intercept + slope * n for n, _ in points]
    return KindCalibration(
        seconds_per_page=slope * layout.block_size, seconds_per_token=slope, intercept_s=intercept,
        tokens_per_page=layout.block_size, points=tuple(points), r2=_r2(pred, [t for _, t in points]),
        repeats=repeats, wall_s=time.perf_counter() - start, kind=kind,
    )


# Step time ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepTimeModel:
    """``step_s ~ a + b * num_tokens + c * sum_context + d * prefill_pairs`` (+ hidden recompute when
    rho is known).

    ``num_tokens``: tokens computed in the step; ``sum_context``: sum over the step's requests of
    their context after the step (computed + new tokens); ``prefill_pairs``: query-key pairs of its
    prefill chunks (``scheduler.costs.chunk_pairs``: what makes a chunk deep in a long prompt dearer
    than the same chunk at its start)."""

    a: float
    b: float
    c: float
    # (composition, num_tokens, sum_context, seconds, prefill_pairs)
    points: tuple[tuple, ...]
    r2: float = 1.0
    hidden_seconds_per_token: float = 0.0  # from the hidden kind's KindCalibration, per token of hidden context
    wall_s: float = 0.0
    d: float = 0.0

    def predict(self, num_tokens: int, sum_context: int, sum_hidden_context: int = 0, prefill_pairs: int = 0) -> float:
        return (self.a + self.b * num_tokens + self.c * sum_context + self.d * prefill_pairs
                + self.hidden_seconds_per_token * sum_hidden_context)


def _fake_request(i: int, context: int, num_new: int, vocab: int, page_ids: list[int], kind: CacheKind) -> Request:
    ids = [(7 * i + 13 * t) % vocab for t in range(context)]
    r = Request(f"{_OWNER}{i}", ids, SamplingParams(max_tokens=1, temperature=0.0), max_total_tokens=context + 1,
                ttft_slo_ms=1.0, tbt_slo_ms=1.0)
    r.num_computed_tokens = context - num_new
    r.kind = kind
    r.page_ids = page_ids
    return r


@torch.inference_mode()
def step_time_model(
    runner,
    *,
    decode_batch_sizes: tuple[int, ...] = (1, 8, 32),
    decode_contexts: tuple[int, ...] = (128, 512),
    prefill_chunk_sizes: tuple[int, ...] = (128, 512),
    prefill_offsets: tuple[tuple[int, int], ...] = ((128, 896), (384, 640), (512, 1024), (256, 1536)),
    mixed: tuple[tuple[int, int, int, int], ...] = (),
    repeats: int = 2,
    pool=None,
    rho: KindCalibration | None = None,
    clock=None,
) -> StepTimeModel:
    """Time ``runner.execute`` on KV decode batches (every size x context), single prefill chunks
    from position 0 and chunks deeper in a prompt (``prefill_offsets``: (chunk, start) pairs), and
    chunks beside decode rows (``mixed``: (chunk, start, rows, their context); none by default: the
    model fitted without them predicted held-out mixed steps at 1.01x, P90 1.07x,
    ``benchmarks/step_model_fit.py``), and fit the step-time model. Compositions that do not fit the model's context or the free pages
    are skipped. With ``pool``, pages are borrowed from it and returned; without,
    the cache must be idle (no request holds pages). ``clock``: a runner on a simulated clock
    (``bench.simulator.CostModelRunner``) is timed on it rather than on this process's."""
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    start = time.perf_counter()
    layout, device = runner.layout, runner.device
    clock = clock or _clock(device)
    vocab = runner.model.shape.vocab_size if runner.model is not None else runner.vocab_size
    free_pages = pool.num_free_pages if pool is not None else runner.num_pages
    compositions: list[tuple[str, list[tuple[int, int]]]] = []  # (name, [(context, new tokens)])
    for ctx in decode_contexts:
        for b in decode_batch_sizes:
            compositions.append((f"decode b={b} ctx={ctx}", [(ctx, 1)] * b))
    for n in prefill_chunk_sizes:
        compositions.append((f"prefill {n}", [(n, n)]))
    for n, offset in prefill_offsets:  # (not ``start``: that is the wall clock's start)
        compositions.append((f"prefill {n} @{offset}", [(offset + n, n)]))
    for n, offset, b, ctx in mixed:
        compositions.append((f"prefill {n} @{offset} + decode b={b} ctx={ctx}", [(offset + n, n)] + [(ctx, 1)] * b))

    def fits(reqs) -> bool:
        return (all(ctx < runner.max_model_len for ctx, _ in reqs)
                and sum(layout.num_pages_for(ctx, CacheKind.KV) for ctx, _ in reqs) <= free_pages)

    compositions = [c for c in compositions if fits(c[1])]
    if len(compositions) < 3:
        raise ValueError("step_time_model: fewer than 3 batch compositions fit the cache; give smaller sizes")
    borrowed = None
    if pool is not None:
        need = max(sum(layout.num_pages_for(ctx, CacheKind.KV) for ctx, _ in reqs) for _, reqs in compositions)
        borrowed = pool.allocate(need, CacheKind.KV, _OWNER)
        if borrowed is None:
            raise ValueError("step_time_model: the pool has too few free pages")
    page_ids = borrowed if borrowed is not None else list(range(runner.num_pages))
    points = []
    try:
        for name, reqs in compositions:
            requests, next_page = [], 0
            for i, (ctx, new) in enumerate(reqs):
                num = layout.num_pages_for(ctx, CacheKind.KV)
                requests.append(_fake_request(i, ctx, new, vocab, page_ids[next_page : next_page + num], CacheKind.KV))
                next_page += num
            out = SchedulerOutput([ScheduledChunk(r, new) for r, (_, new) in zip(requests, reqs)])
            runner.execute(out)  # warm-up for this shape
            times = []
            for _ in range(repeats):
                _sync(device)
                t = clock()
                runner.execute(out)
                _sync(device)
                times.append(clock() - t)
            pairs = sum(chunk_pairs(ctx - new, new) for ctx, new in reqs)
            points.append((name, sum(new for _, new in reqs), sum(ctx for ctx, _ in reqs), min(times), pairs))
    finally:
        if borrowed is not None:
            pool.free(borrowed, _OWNER)
    with_pairs = sum(1 for p in points if p[4]) >= 2 and any(p[4] and p[2] > p[1] for p in points)
    columns = [[1.0, float(n), float(ctx)] + ([float(pairs)] if with_pairs else []) for _, n, ctx, _, pairs in points]
    coef = _fit(columns, [p[3] for p in points])
    a, b, c, d = (coef + [0.0])[:4]
    if d < 0:  # noise on a model too small to resolve it: refit without the term
        (a, b, c), d = _fit([col[:3] for col in columns], [p[3] for p in points]), 0.0
    pred = [a + b * n + c * ctx + d * pairs for _, n, ctx, _, pairs in points]
    return StepTimeModel(
        a=a, b=b, c=c, d=d, points=tuple(points), r2=_r2(pred, [p[3] for p in points]),
        hidden_seconds_per_token=rho.seconds_per_token if rho is not None else 0.0,
        wall_s=time.perf_counter() - start,
    )
