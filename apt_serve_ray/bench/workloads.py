"""Seeded, reproducible request traces for serving benchmarks.

Length distributions
--------------------
Synthetic stand-ins shaped like the datasets of the Apt-Serve paper (arXiv 2504.07494): long-tailed
chat lengths (ShareGPT), long prompts truncated at the model length with short summaries
(LongBench), short code prompts and completions (HumanEval). The parameters are set by hand to
resemble the datasets' published summary figures; they are *not* fitted to, sampled from, or
derived from any record of the datasets. ``log-normal m, s`` means ``round(exp(N(ln m, s^2)))``.

=========  ===========================================  ===========================================
name       prompt tokens                                output tokens
=========  ===========================================  ===========================================
sharegpt   log-normal m=200, s=1.0 (mean ~330)          log-normal m=180, s=0.9 (mean ~270)
longbench  log-normal m=1400, s=0.25 (5-95%: 930-2110)  log-normal m=90, s=0.35 (5-95%: 51-160)
humaneval  log-normal m=140, s=0.25 (5-95%: 93-211)     log-normal m=100, s=0.3 (5-95%: 61-164)
random     uniform [1024, 1024] (vLLM's defaults)       uniform [128, 128]
=========  ===========================================  ===========================================

``random`` mirrors ``vllm bench serve --dataset-name random``: see :func:`make_random_trace`.

Fitting the model: ``output = clip(output, 1, max_model_len - 1)``, then
``prompt = clip(prompt, 1, max_model_len - output)``. The prompt is the side that is truncated, as a
server truncates a context; outputs are kept because benchmarks fix them (ignore EOS). With
``max_model_len=2048`` about 9% of longbench prompts sit at the cap, as LongBench's documents are
truncated to the model length in the paper.

Arrivals
--------
Gaps are Gamma(shape ``k = 1/cv^2``, scale ``1/(rate*k)``): mean ``1/rate``, coefficient of variation
``cv`` (``cv=1`` is Poisson; larger is burstier). The first request arrives at 0 and request ``i`` after
the first ``i`` gaps, as ``vllm bench serve`` sends its first request at once. ``rate=inf``: all at 0.

Peaks: ``rate_shapes.py`` (on/off and diurnal rates over the same requests).

Randomness
----------
``SeedSequence(seed)`` spawns independent streams for lengths, gaps, token ids and service classes. So the lengths
do not depend on the rate, ``with_rate(make_trace(w, n, r1, cv, s), r2, cv, s) ==
make_trace(w, n, r2, cv, s)``, and the gaps of a rate sweep are the same draws rescaled.
Token ids (when ``vocab_size`` is given) are uniform in ``[10, vocab_size - 10)``, away from the low
ids where tokenizers keep special tokens, so a token-id prompt has exactly ``prompt_len`` tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_STREAM_LENGTHS, _STREAM_GAPS, _STREAM_TOKENS, _STREAM_CLASSES = range(4)
# The structured-output requests' schema (sampling_cost.py, also --grammars): nested, bounded, enums.
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "colours", "address"],
    "additionalProperties": False,
}
_MIN_TOKEN_ID_MARGIN = 10


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival_s: float  # offset from the start of the trace
    prompt_len: int
    output_len: int
    prompt_token_ids: list[int] | None = None
    ttft_slo_ms: float | None = None
    tbt_slo_ms: float | None = None
    priority: int = 0
    service_class: str | None = None  # the name of its ServiceClass, if assign_classes gave it one
    model: str | None = None  # the model it names (a LoRA adapter), else the replay's

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"{self.request_id}: prompt_len and output_len must be >= 1")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(f"{self.request_id}: prompt_token_ids has {len(self.prompt_token_ids)} "
                             f"ids, prompt_len is {self.prompt_len}")


@dataclass(frozen=True)
class LogNormal:
    median: float
    sigma: float

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.rint(rng.lognormal(math.log(self.median), self.sigma, n)).astype(np.int64)


@dataclass(frozen=True)
class Uniform:
    low: int
    high: int  # inclusive

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, n, dtype=np.int64)


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    prompt: LogNormal | Uniform
    output: LogNormal | Uniform


def random_spec(input_len: int = 1024, output_len: int = 128, range_ratio: float = 0.0) -> WorkloadSpec:
    """vLLM's random dataset: lengths uniform in [floor(len*(1-r)), ceil(len*(1+r))]."""
    if input_len < 1:
        raise ValueError(f"input_len must be >= 1, got {input_len}")
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")

    def uniform(length: int) -> Uniform:
        return Uniform(max(1, math.floor(length * (1 - range_ratio))), math.ceil(length * (1 + range_ratio)))

    return WorkloadSpec("random", uniform(input_len), uniform(output_len))


WORKLOADS: dict[str, WorkloadSpec] = {
    "sharegpt": WorkloadSpec("sharegpt", LogNormal(200, 1.0), LogNormal(180, 0.9)),
    "longbench": WorkloadSpec("longbench", LogNormal(1400, 0.25), LogNormal(90, 0.35)),
    "humaneval": WorkloadSpec("humaneval", LogNormal(140, 0.25), LogNormal(100, 0.3)),
    "random": random_spec(),
}


@dataclass(frozen=True)
class ServiceClass:
    """A named class of traffic: its share of a mixed trace, its SLOs and its priority (lower first)."""

    name: str
    share: float
    ttft_slo_ms: float
    tbt_slo_ms: float
    priority: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.share <= 1.0:
            raise ValueError(f"{self.name}: share must be in (0, 1], got {self.share!r}")
        if not (self.ttft_slo_ms > 0 and self.tbt_slo_ms > 0):
            raise ValueError(f"{self.name}: ttft_slo_ms and tbt_slo_ms must be > 0")


def assign_classes(trace: list[TraceRequest], classes: list[ServiceClass], seed: int = 0) -> list[TraceRequest]:
    """The same requests, each given one class's SLOs, priority and name; lengths and arrivals unchanged.

    Counts are exact (largest remainder of ``share * len(trace)``, so a 30/70 mix of 150 requests is
    45/105, not a binomial draw) and spread over the trace by a seeded shuffle; shares must sum to 1.
    """
    names = [c.name for c in classes]
    if not classes or len(set(names)) != len(names):
        raise ValueError(f"classes: need at least one, with distinct names, got {names}")
    shares = np.array([c.share for c in classes])
    if not math.isclose(shares.sum(), 1.0, abs_tol=1e-6):
        raise ValueError(f"classes: shares must sum to 1, got {shares.sum():g}")
    exact = shares * len(trace)
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(-(exact - counts), kind="stable")[: len(trace) - counts.sum()]] += 1
    labels = np.repeat(np.arange(len(classes)), counts)
    labels = _stream(seed, _STREAM_CLASSES).permutation(labels)
    return [dataclasses.replace(r, ttft_slo_ms=c.ttft_slo_ms, tbt_slo_ms=c.tbt_slo_ms, priority=c.priority,
                                service_class=c.name)
            for r, c in zip(trace, (classes[i] for i in labels))]


def make_trace(workload: str, num_requests: int, rate: float, cv: float = 1.0, seed: int = 0,
               max_model_len: int = 2048, vocab_size: int | None = None,
               max_output_len: int | None = None) -> list[TraceRequest]:
    """A trace of ``num_requests`` requests of ``workload`` arriving at ``rate`` req/s; outputs capped
    at ``max_output_len`` after drawing (the other lengths stay those of the uncapped trace)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {workload!r}")
    trace = _make(WORKLOADS[workload], num_requests, rate, cv, seed, max_model_len, vocab_size)
    if max_output_len is not None:
        trace = [dataclasses.replace(r, output_len=min(r.output_len, max_output_len)) for r in trace]
    return trace


def make_random_trace(num_requests: int, rate: float, input_len: int = 1024, output_len: int = 128,
                      range_ratio: float = 0.0, cv: float = 1.0, seed: int = 0, max_model_len: int = 2048,
                      vocab_size: int | None = None) -> list[TraceRequest]:
    """Like ``vllm bench serve --dataset-name random`` (lengths fitted to the model as above)."""
    spec = random_spec(input_len, output_len, range_ratio)
    return _make(spec, num_requests, rate, cv, seed, max_model_len, vocab_size)


def with_rate(trace: list[TraceRequest], rate: float, cv: float = 1.0, seed: int = 0) -> list[TraceRequest]:
    """The same requests re-timed at ``rate`` (gaps drawn as in :func:`make_trace`)."""
    _check_arrivals(len(trace), rate, cv)
    arrivals = _arrival_times(len(trace), rate, cv, _stream(seed, _STREAM_GAPS))
    return [dataclasses.replace(r, arrival_s=float(t)) for r, t in zip(trace, arrivals)]


def fill_token_ids(trace: list[TraceRequest], vocab_size: int, seed: int = 0) -> list[TraceRequest]:
    """Give each request without ``prompt_token_ids`` seeded random ids of its exact prompt length."""
    if vocab_size <= 2 * _MIN_TOKEN_ID_MARGIN:
        raise ValueError(f"vocab_size must be > {2 * _MIN_TOKEN_ID_MARGIN}, got {vocab_size}")
    rng = _stream(seed, _STREAM_TOKENS)
    filled = []
    for r in trace:
        if r.prompt_token_ids is None:
            ids = rng.integers(_MIN_TOKEN_ID_MARGIN, vocab_size - _MIN_TOKEN_ID_MARGIN, r.prompt_len)
            r = dataclasses.replace(r, prompt_token_ids=ids.tolist())
        filled.append(r)
    return filled


def fresh_key(seed: int, rate: float, run: str = "") -> int:
    """The key of one run's token ids: ``seed`` and ``rate``, and ``run`` naming runs that share both
    (several traces at one rate on one server)."""
    key = int(seed) * 1_000_003 + int(round(float(rate) * 1000))
    return key + (zlib.crc32(run.encode()) * 1_000_000_007 if run else 0)


def fresh_token_ids(trace: list[TraceRequest], vocab_size: int, seed: int, rate: float,
                    run: str = "") -> list[TraceRequest]:
    """The same requests (lengths, timing, classes) with token ids of their own for this ``seed`` and
    ``rate``: a server that ran another rate or seed before finds none of these prompts in its prefix
    cache (or a tier below it)."""
    key = fresh_key(seed, rate, run)
    return fill_token_ids([dataclasses.replace(r, prompt_token_ids=None) for r in trace], vocab_size, key)


def fresh_ids(items: list, vocab_size: int, seed: int, rate: float, run: str = "") -> list:
    """The one way a serving benchmark gives each (seed, rate) run prompts of its own, so that nothing a
    server cached for an earlier run helps this one: trace requests get token ids drawn anew
    (``fresh_token_ids``); conversations (``bench.conversations.Session``) are relabelled through one
    permutation of the ids (``conversations.relabel``), which keeps what their prompts share (system
    prompts, documents, history) shared."""
    if items and not isinstance(items[0], TraceRequest):
        from apt_serve_ray.bench.conversations import relabel

        return relabel(items, fresh_key(seed, rate, run), vocab_size)
    return fresh_token_ids(items, vocab_size, seed, rate, run)


def save_trace(trace: list[TraceRequest], path: str | Path) -> None:
    """JSONL, one request per line; floats are written by repr, so a reload is exact."""
    with open(path, "w", encoding="utf-8") as f:
        for r in trace:
            f.write(json.dumps(dataclasses.asdict(r)) + "\n")


def load_trace(path: str | Path) -> list[TraceRequest]:
    trace = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                trace.append(TraceRequest(**json.loads(line)))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}:{line_no}: not a trace request: {e}") from e
    return trace


def _make(spec: WorkloadSpec, num_requests: int, rate: float, cv: float, seed: int, max_model_len: int,
          vocab_size: int | None) -> list[TraceRequest]:
    _check_arrivals(num_requests, rate, cv)
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    rng = _stream(seed, _STREAM_LENGTHS)
    prompt_lens = spec.prompt.sample(rng, num_requests)
    output_lens = np.clip(spec.output.sample(rng, num_requests), 1, max_model_len - 1)
    prompt_lens = np.clip(prompt_lens, 1, max_model_len - output_lens)
    arrivals = _arrival_times(num_requests, rate, cv, _stream(seed, _STREAM_GAPS))
    trace = [TraceRequest(f"{spec.name}-{i}", float(t), int(p), int(o))
             for i, (t, p, o) in enumerate(zip(arrivals, prompt_lens, output_lens))]
    return trace if vocab_size is None else fill_token_ids(trace, vocab_size, seed)


def _check_arrivals(num_requests: int, rate: float, cv: float) -> None:
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 req/s (inf: all at once), got {rate}")
    if not (cv > 0 and math.isfinite(cv)):
        raise ValueError(f"cv must be a finite number > 0, got {cv}")


def _arrival_times(n: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    if math.isinf(rate):
        return np.zeros(n)
    shape = 1.0 / cv**2
    gaps = rng.standard_gamma(shape, n - 1) / (rate * shape)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def _stream(seed: int, stream: int) -> np.random.Generator:
    # spawn(n)[i] does not depend on n, so adding a stream left the older ones' draws unchanged.
    return np.random.default_rng(np.random.SeedSequence(seed).spawn(stream + 1)[stream])
