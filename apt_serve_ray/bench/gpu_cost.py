"""A GPU's step time from the model's shape and the device: a roofline with efficiency factors.

Devices and model shapes are data (``gpu_specs.json``: datasheet peaks, the efficiency factors and
the published figures they were set to meet). One step of ``SchedulerOutput`` chunks costs::

    linears    max(2 P T / (F e_c),  W / (B e_m))                P: linear parameters, T: tokens,
    lm head    max(2 d V R / (F e_c), d V b / (B e_m))           W = P b: weight bytes, R: rows sampled
    attention  max(4 d L pairs / (F e_c), cache bytes read / (B e_a))   pairs: query-key pairs
    recompute  4 d kv L H / (F e_c) + 2 d kv L b / (B e_m)       H: hidden-kind context (K/V projected
                                                                 again; its x bytes are in the cache read)
    host       step_overhead + per_seq_overhead x rows

each term as the slower of its compute and its memory traffic (F: peak FLOP/s, B: memory bytes/s,
e: the share of each the kernels reach), summed: the kernels of one step run one after another. A
decode row reads its whole context's cache in its kind (KV: 2 kv L b bytes a token; hidden: d L b,
and its K/V projected again; the int8 kinds: their bytes with scales, ``CacheLayout``); a prefill
chunk's attention is its query-key pairs. The recompute reads W_k and W_v once a step (a fused kernel
that streamed them per request, as the Triton one does per program, would read them once a row: a
bound the L2 cache decides, which ``gpu_check.sh`` measures). The int8 kinds are priced by their bytes
alone: dequantising in the kernel is taken as free beside the bytes it saves (so the policy is given
0 s a page for them). Swaps move pages over the host link (``pcie_bw``).

``GpuCostModel`` is what ``simulator.CostModelRunner`` takes as its cost (``step_time(chunks)`` and the
swap prices), and ``step_costs`` gives the adaptive policy what the engine would measure at start on
such a GPU: the step-time model fitted by the engine's own calibration (``calibration.step_time_model``,
timing the simulated runner), rho and each compressed kind's seconds per page as decode-time
differences, the in-place conversions per token.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from pathlib import Path

from apt_serve_ray.cache.kinds import CacheKind
from apt_serve_ray.cache.layout import CacheLayout

SPECS_PATH = Path(__file__).with_name("gpu_specs.json")
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # dense bf16 tensor FLOP/s
    mem_bw: float  # device memory bytes/s
    memory_bytes: int
    pcie_bw: float  # host link bytes/s (swaps to and from the tier below memory)
    compute_eff: float  # share of peak FLOP/s large GEMMs reach
    mem_eff: float  # share of bandwidth streaming weights reaches
    attn_mem_eff: float  # share of bandwidth paged attention reaches reading the cache
    step_overhead_s: float  # host time per step: scheduling, input preparation, sampling, launches
    per_seq_overhead_s: float  # the same per row of the step
    calibration: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_eff") and not 0 < value <= 1:
                raise ValueError(f"{self.name}: {f.name} must be in (0, 1], got {value!r}")
            if f.name in ("peak_flops", "mem_bw", "memory_bytes", "pcie_bw") and not value > 0:
                raise ValueError(f"{self.name}: {f.name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_size: int
    vocab_size: int
    gated_mlp: bool = False
    tied_embeddings: bool = True  # the lm head is the embedding matrix (OPT); False: a matrix of its own
    dtype_bytes: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def linear_params(self) -> int:
        """Parameters of every layer's linears (attention projections and MLP), the lm head apart."""
        d = self.hidden_size
        per_layer = d * (d + 2 * self.kv_dim) + d * d + (3 if self.gated_mlp else 2) * d * self.ffn_size
        return self.num_layers * per_layer

    @property
    def weight_bytes(self) -> int:
        """Every weight held on the device (linears, embeddings, and the lm head where it is not tied)."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return (self.linear_params + embeddings) * self.dtype_bytes

    def layout(self, block_size: int = BLOCK_SIZE) -> CacheLayout:
        return CacheLayout(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           hidden_size=self.hidden_size, block_size=block_size, dtype_bytes=self.dtype_bytes)


def _specs(path: Path = SPECS_PATH) -> dict:
    return json.loads(Path(path).read_text())


def device(name: str) -> Device:
    devices = _specs()["devices"]
    if name not in devices:
        raise ValueError(f"device: unknown GPU {name!r}; valid: {sorted(devices)}")
    return Device(name=name, **devices[name])


def model_shape(name: str) -> ModelShape:
    models = _specs()["models"]
    if name not in models:
        raise ValueError(f"model: unknown shape {name!r}; valid: {sorted(models)}")
    return ModelShape(name=name, **models[name])


def devices() -> list[str]:
    return sorted(_specs()["devices"])


def models() -> list[str]:
    return sorted(_specs()["models"])


def kv_pages(dev: Device, shape: ModelShape, utilization: float = 0.9, activation_bytes: int = 2 << 30,
             block_size: int = BLOCK_SIZE) -> int:
    """KV pages of ``block_size`` tokens in what is left of ``utilization`` of the device's memory once
    the weights and ``activation_bytes`` are in (vLLM's ``gpu_memory_utilization`` rule)."""
    free = dev.memory_bytes * utilization - shape.weight_bytes - activation_bytes
    pages = int(free // shape.layout(block_size).bytes_per_page)
    if pages < 1:
        raise ValueError(f"{shape.name} does not fit {dev.name} at utilization {utilization}")
    return pages


class GpuCostModel:
    """Seconds of one step of ``shape`` on ``dev``; the interface of ``simulator.CostModel`` the runner
    uses (``step_time``, the swap prices), plus ``decode_s`` / ``prefill_s`` for tables."""

    def __init__(self, dev: Device, shape: ModelShape, block_size: int = BLOCK_SIZE) -> None:
        self.dev, self.shape = dev, shape
        self.layout = shape.layout(block_size)
        page_s = self.layout.bytes_per_page / dev.pcie_bw
        self.swap_out_s_per_page = self.swap_in_s_per_page = page_s
        d, b = shape.hidden_size, shape.dtype_bytes
        # Cache bytes read per token of context, every layer, per kind (int8 kinds: codes and scales).
        self._read_bytes = {kind: self.layout.bytes_per_token(kind) for kind in CacheKind}
        self._recompute = {kind: kind.spec.cost == "rho" for kind in CacheKind}
        self._weights_s = shape.linear_params * b / (dev.mem_bw * dev.mem_eff)
        self._head_bytes_s = d * shape.vocab_size * b / (dev.mem_bw * dev.mem_eff)

    # The runner's interface -----------------------------------------------------------------------
    def step_time(self, chunks) -> float:
        return self.rows_time([(c.request.num_computed_tokens, c.num_tokens, c.request.kind, c.completes)
                               for c in chunks])

    def rows_time(self, rows) -> float:
        """Seconds of a step of ``(start, tokens, kind, samples)`` rows."""
        if not rows:
            return 0.0
        dev, s = self.dev, self.shape
        flops_s = dev.peak_flops * dev.compute_eff
        d, L, b = s.hidden_size, s.num_layers, s.dtype_bytes
        tokens = sampled = pairs = read = hidden = 0
        for start, n, kind, samples in rows:
            tokens += n
            sampled += bool(samples)
            context = start + n
            # A decode row attends its whole context; a chunk's queries the causal pairs.
            pairs += context if n == 1 else n * start + n * (n + 1) // 2
            read += context * self._read_bytes[kind]
            if self._recompute[kind]:
                hidden += start  # the context held as x: its K/V projected again this step
        linears = max(2 * s.linear_params * tokens / flops_s, self._weights_s)
        head = max(2 * d * s.vocab_size * sampled / flops_s, self._head_bytes_s) if sampled else 0.0
        attention = max(4 * d * L * pairs / flops_s, read / (dev.mem_bw * dev.attn_mem_eff))
        recompute = (4 * d * s.kv_dim * L * hidden / flops_s  # its x bytes are counted in ``read``
                     + (2 * d * s.kv_dim * L * b / (dev.mem_bw * dev.mem_eff) if hidden else 0.0))
        return attention + linears + head + recompute + dev.step_overhead_s + dev.per_seq_overhead_s * len(rows)

    # Tables ---------------------------------------------------------------------------------------
    def decode_s(self, batch: int, context: int, kind: CacheKind = CacheKind.KV) -> float:
        return self.rows_time([(context - 1, 1, kind, True)] * batch)

    def prefill_s(self, num_tokens: int, start: int = 0) -> float:
        return self.rows_time([(start, num_tokens, CacheKind.KV, True)])

    def seconds_per_page(self, kind: CacheKind, batch: int = 32, context: int = 1024) -> float:
        """What holding one KV page's worth of context in ``kind`` adds to a decode step (rho for the
        hidden kind): decode steps of ``batch`` rows of ``context`` in ``kind`` and in KV, their difference
        per page (the engine's calibration measures the same difference, ``calibrate_kind``)."""
        extra = self.decode_s(batch, context, kind) - self.decode_s(batch, context)
        return max(0.0, extra) / (batch * context / self.layout.block_size)

    def conversion_s_per_token(self, from_kind: CacheKind, to_kind: CacheKind) -> float:
        """An in-place kind change, per token: its bytes read in one kind and written in the other (from
        the hidden kinds, K/V projected as well)."""
        dev, s = self.dev, self.shape
        moved = self._read_bytes[from_kind] + self._read_bytes[to_kind]
        project = 4 * s.hidden_size * s.kv_dim * s.num_layers if self._recompute[from_kind] else 0
        return moved / (dev.mem_bw * dev.attn_mem_eff) + project / (dev.peak_flops * dev.compute_eff)


def step_costs(runner, cost: GpuCostModel, kinds=(CacheKind.HIDDEN,)):
    """The ``StepCosts`` the engine would measure at start on ``cost``'s GPU: the step-time model from
    ``calibration.step_time_model`` timing ``runner`` (a ``CostModelRunner`` on ``cost``) on its
    simulated clock, rho and the other kinds' seconds per page from the cost model's decode steps."""
    from apt_serve_ray.scheduler.costs import StepCosts
    from apt_serve_ray.worker.calibration import conversion_pairs, step_time_model

    kinds = tuple(CacheKind(k) for k in kinds)
    rho = cost.seconds_per_page(CacheKind.HIDDEN) if CacheKind.HIDDEN in kinds else 0.0
    model = step_time_model(runner, clock=runner.clock)
    model = dataclasses.replace(model, hidden_seconds_per_token=rho / cost.layout.block_size)
    kind_costs = {k: cost.seconds_per_page(k) for k in kinds if k.spec.cost == "measured"}
    conversions = {pair: cost.conversion_s_per_token(*pair) for pair in conversion_pairs(kinds)}
    return StepCosts(rho, model, kind_costs, conversion_costs=conversions)


def summary(cost: GpuCostModel) -> dict:
    """A few step times, for a JSON and a log line."""
    return {
        "device": cost.dev.name, "model": cost.shape.name,
        "weights_gb": round(cost.shape.weight_bytes / 1e9, 2),
        "decode_ms": {f"b{b}_ctx{c}": round(1000 * cost.decode_s(b, c), 3)
                      for b in (1, 16, 64, 256) for c in (512, 2048)},
        "prefill_ms": {str(n): round(1000 * cost.prefill_s(n), 3) for n in (128, 512, 2048)},
        "rho_ms_per_page": round(1000 * cost.seconds_per_page(CacheKind.HIDDEN), 5),
        "swap_ms_per_page": round(1000 * cost.swap_out_s_per_page, 4),
        "tokens_per_s_unloaded": round(1 / cost.decode_s(1, 512), 1),
        "calibration": cost.dev.calibration,
    }


def gpu_engine(config, cost: GpuCostModel, num_pages: int | None = None, max_model_len: int = 2048,
               apt_options: dict | None = None, costs=None):
    """A ``SimulatedEngine`` running ``config`` on ``cost``'s GPU: the KV pages its memory holds (or
    ``num_pages``), and for ``apt`` the costs the engine would measure there (``step_costs``, or
    ``costs`` computed once for many engines), for the kinds ``config`` offers."""
    from apt_serve_ray.bench.simulator import SimulatedEngine
    from apt_serve_ray.scheduler.policies.apt import AdaptiveScheduler

    pages = num_pages or kv_pages(cost.dev, cost.shape, block_size=cost.layout.block_size)
    sim = SimulatedEngine(config, layout=cost.layout, num_pages=pages, cost=cost, max_model_len=max_model_len,
                          vocab_size=cost.shape.vocab_size)
    if config.policy == "apt":
        policy = AdaptiveScheduler(**(apt_options or {}), config=sim.config)
        policy.set_costs(costs or step_costs(sim.runner, cost, kinds=config.cache_kinds))
        sim.llm_engine.set_policy(policy)
    return sim
