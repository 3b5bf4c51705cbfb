"""Engine configuration, validated once at the boundary and never mutated afterwards."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from apt_serve_ray.cache.kinds import BY_COST, COMPRESSED, CacheKind
from apt_serve_ray.models.loader import DEFAULT_MODEL
from apt_serve_ray.scheduler.watermarks import HEAVY_WATERMARK, HIDDEN_RATIO_STEP, LIGHT_WATERMARK, MAX_HIDDEN_RATIO

_DTYPES = ("auto", "float32", "bfloat16", "float16")
COMPRESSED_KIND_NAMES = tuple(k.value for k in COMPRESSED)  # ("hidden", "kv-int8", "hidden-int8")
_DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")  # see apt_serve_ray.attention
QUANTIZATIONS = ("int8", "int4")  # weights quantized at load and kept so, see apt_serve_ray.models.quant
# Checkpoints that arrive quantized (read as they are, apt_serve_ray.models.checkpoint_quant); found from the
# checkpoint's config, so ``quantization`` may be left unset for them.
CHECKPOINT_QUANTIZATIONS = ("gptq", "awq", "compressed-tensors")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start.

    Cache size: ``num_pages`` wins over ``cache_budget_bytes``, which wins over ``memory_budget_bytes`` (the
    weights and the cache together: the cache gets what the weights, as held, leave); with none, the engine
    uses 512 MiB on CPU and 80% of the free accelerator memory after loading weights on CUDA.
    """

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    num_threads: int | None = None
    # Attention over the paged cache: "auto" picks the fast path for the device (C++ kernels on CPU,
    # Triton on CUDA); "torch" is the PyTorch reference. cache_proj_optimize: hidden-cache decode
    # through the backend's fused kernel (K/V never written); False = gather x, project, attend.
    attention_backend: str = "auto"
    cache_proj_optimize: bool = True
    # Weights kept quantized (vLLM's name): "int8" (per output channel) or "int4" (groups of 32, as GGUF's
    # Q4_1) weight-only, quantized at load and multiplied packed (models/quant.py; CPU, bf16 or fp16
    # activations). None: the checkpoint's weights at ``dtype``. Less memory and a faster single stream,
    # slower batches and prefill. A GPTQ / AWQ / compressed-tensors checkpoint is served in its own codes
    # whatever this says ("gptq" / "awq" / "compressed-tensors", or None; models/checkpoint_quant.py), widened
    # to full width where our kernels do not run (float32, GPU).
    quantization: str | None = None
    # LoRA adapters (PEFT folders on this machine; vLLM's names): ``lora_modules`` "name=path" each, read
    # at start; a request names one as its ``model``. ``max_loras``: adapters in slots at once, each a slot of
    # ``max_lora_rank``, all of which may share a step (None: as many as ``lora_modules``, 0 with none: LoRA
    # off); more lora_modules than slots load on demand, into the least recently used slot no request holds. With LoRA on, the hidden cache kinds are off: they project stored x to K/V with the base weights,
    # which would drop an adapter's k/v update.
    lora_modules: tuple[str, ...] = ()
    max_loras: int | None = None
    max_lora_rank: int = 16
    # CPUs the async engine's loop thread (and the OpenMP workers it starts) runs on; None: any.
    cpu_affinity: tuple[int, ...] | None = None
    # The engine process's compute threads bound one to a CPU each (of cpu_affinity, else of the CPUs it may
    # use, when there are at least as many; worker/cpu_affinity.compute_cpus). Through Serve on 2 cores, bf16,
    # two threads, six alternated pairs: saturated output 317 -> 337 tok/s (bound ahead in five), TTFT 136 -> 132 ms.
    bind_threads: bool = True
    # AsyncLLMEngine (the server's engine): run the step loop in a process of its own, off the server's
    # GIL; measured through Serve on 2 CPU cores: saturated output 188 -> 233 tok/s, TPOT 12.8 -> 10.7 ms.
    # False: on a thread of the caller's process. The offline ``LLM`` steps in the caller's thread either way.
    engine_process: bool = True
    # Cache.
    block_size: int = 16
    cache_budget_bytes: int | None = None
    # The weights and the cache together: the pages are what the model's tensors leave of it, so weights kept
    # quantized (``quantization``) leave more to the cache. ``num_pages`` and ``cache_budget_bytes`` win.
    memory_budget_bytes: int | None = None
    num_pages: int | None = None
    # The ceiling of the share of the pool's pages held in compressed kinds (hidden, kv-int8,
    # hidden-int8); 0: KV pages only, whatever the policy. Below it ``apt`` chooses kinds by value;
    # the other policies give new requests the cheapest compressed kind while the share is under it.
    cache_ratio: float = 0.0
    # The compressed kinds the engine may use (each only where it holds more tokens per page than KV
    # and no cheaper kind holds as many). The default is the exact hybrid cache; the int8 kinds
    # ("kv-int8", "hidden-int8") are lossy and opt-in, like vLLM's kv_cache_dtype.
    cache_kinds: tuple[str, ...] = ("hidden",)
    # A tier below memory for preempted requests' pages and evicted prefixes (GiB; vLLM's swap_space):
    # host memory (pinned on a GPU, anonymous and reserved lazily on CPU), or a sparse memory-mapped
    # file in ``swap_dir`` where one is given (CPU; at most half the memory available is taken otherwise).
    # 0: no tier, preempted requests are recomputed. Measured on CPU: a page out and back in ~0.1 ms
    # against 8-16 ms to recompute it; what lets ``apt`` evict unimportant requests for important ones.
    swap_space: float = 4.0
    swap_dir: str | None = None
    # The hybrid cache on/off. Off: KV pages only, whatever the policy (the "apt with the hybrid cache
    # off" baseline). On, it is used where a hidden page saves memory (MHA) or when force_hidden.
    enable_hybrid_cache: bool = True
    force_hidden: bool = False
    # Automatic prefix caching (on by default, as in vLLM v1): full pages are named by a hash chain
    # over their tokens and a request starts from the longest cached prefix of its tokens, in the kind
    # it is admitted in. Off: every request computes every token (the engine before prefix caching).
    enable_prefix_caching: bool = True
    # Which cached page nobody uses is evicted first (``cache/page_pool.py``): "value" (the default:
    # the one worth least by the requests that took it, their priority and the prefill it saves,
    # ageing) or "lru" (the least recently released, vLLM's rule).
    prefix_cache_retention: str = "value"
    # The grammar library that masks structured outputs (``apt_serve_ray.sampling.structured``).
    structured_output_backend: str = "llguidance"
    # Batching.
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    policy: str = "apt"
    policy_options: dict | None = None  # keyword arguments of the policy, e.g. AdaptiveScheduler's weights
    # Per-request defaults (SLOs in milliseconds; lower priority value = served earlier, as in vLLM).
    default_ttft_slo_ms: float = 10_000.0
    default_tbt_slo_ms: float = 1_000.0
    default_priority: int = 0
    # Memory watermarks (share of pages in use) steering the hidden target and admission.
    light_watermark: float = LIGHT_WATERMARK
    heavy_watermark: float = HEAVY_WATERMARK
    max_hidden_ratio: float = MAX_HIDDEN_RATIO
    hidden_ratio_step: float = HIDDEN_RATIO_STEP
    enable_watermarks: bool = False
    calibrate_rho: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model: must be a non-empty string, got {self.model!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: must be one of {_DTYPES}, got {self.dtype!r}")
        if self.device not in _DEVICES:
            raise ValueError(f"device: must be one of {_DEVICES}, got {self.device!r}")
        if self.cpu_affinity is not None:
            cpus = self.cpu_affinity
            if (not isinstance(cpus, (tuple, list)) or not cpus
                    or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cpus)):
                raise ValueError(f"cpu_affinity: must be a non-empty list of CPU numbers >= 0, got {cpus!r}")
            object.__setattr__(self, "cpu_affinity", tuple(cpus))
        if self.quantization is not None and self.quantization not in QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS:
            raise ValueError(f"quantization: must be one of {QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS} or None, "
                             f"got {self.quantization!r}")
        if self.quantization in QUANTIZATIONS and self.dtype == "float32":
            raise ValueError(f"quantization: {self.quantization} weights need bfloat16 (or float16) activations, "
                             "not float32: set dtype=bfloat16")
        if self.quantization in QUANTIZATIONS and self.device == "cuda":
            raise ValueError("quantization: quantized weights are served on CPU only (no GPU kernel yet)")
        self._check_lora()
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        _positive_int("block_size", self.block_size)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        for name in ("max_model_len", "num_threads", "num_pages", "cache_budget_bytes", "memory_budget_bytes"):
            value = getattr(self, name)
            if value is not None:
                _positive_int(name, value)
        for name in ("cache_ratio", "light_watermark", "heavy_watermark", "max_hidden_ratio", "hidden_ratio_step"):
            check_share(name, getattr(self, name))
        if self.hidden_ratio_step == 0:
            raise ValueError("hidden_ratio_step: must be above 0 (the hidden target would never move)")
        if self.light_watermark > self.heavy_watermark:
            raise ValueError(
                f"light_watermark: {self.light_watermark} must not exceed heavy_watermark {self.heavy_watermark}"
            )
        for name in ("default_ttft_slo_ms", "default_tbt_slo_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}: must be a positive number, got {value!r}")
        for name in ("enable_hybrid_cache", "force_hidden", "enable_watermarks", "enable_prefix_caching",
                     "calibrate_rho", "cache_proj_optimize", "engine_process", "bind_threads"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        from apt_serve_ray.cache.page_pool import RETENTIONS

        if self.prefix_cache_retention not in RETENTIONS:
            raise ValueError(f"prefix_cache_retention: must be one of {list(RETENTIONS)}, "
                             f"got {self.prefix_cache_retention!r}")
        from apt_serve_ray.sampling.structured import GRAMMAR_BACKENDS

        if self.structured_output_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"structured_output_backend: must be one of {list(GRAMMAR_BACKENDS)}, "
                             f"got {self.structured_output_backend!r}")
        kinds = self.cache_kinds
        if isinstance(kinds, str) or not isinstance(kinds, (tuple, list)) or \
                not all(isinstance(k, str) and k in COMPRESSED_KIND_NAMES for k in kinds):
            raise ValueError(f"cache_kinds: must be a list of {list(COMPRESSED_KIND_NAMES)}, got {kinds!r}")
        object.__setattr__(self, "cache_kinds", tuple(dict.fromkeys(kinds)))
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float)) or \
                not 0 <= self.swap_space < float("inf"):
            raise ValueError(f"swap_space: must be a number of GiB >= 0, got {self.swap_space!r}")
        if self.swap_dir is not None and (not isinstance(self.swap_dir, str) or not self.swap_dir):
            raise ValueError(f"swap_dir: must be a directory path, got {self.swap_dir!r}")
        if self.force_hidden and not self.enable_hybrid_cache:
            raise ValueError("force_hidden: cannot be true with enable_hybrid_cache false")
        from apt_serve_ray.scheduler.registry import policy_names

        if self.policy not in policy_names():
            raise ValueError(f"policy: unknown policy {self.policy!r}; valid names: {sorted(policy_names())}")
        if self.policy_options is not None and not isinstance(self.policy_options, dict):
            raise ValueError(f"policy_options: must be a dict of keyword arguments, got {self.policy_options!r}")

    def _check_lora(self) -> None:
        modules = self.lora_modules
        if isinstance(modules, str):
            modules = tuple(m for m in modules.split(",") if m)
        if not isinstance(modules, (tuple, list)) or not all(isinstance(m, str) for m in modules):
            raise ValueError(f"lora_modules: must be a list of 'name=path', got {self.lora_modules!r}")
        names = []
        for m in modules:
            name, sep, path = m.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora_modules: each must be 'name=path', got {m!r}")
            names.append(name.strip())
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules: adapter names must be unique, got {names}")
        object.__setattr__(self, "lora_modules", tuple(modules))
        if self.max_loras is None:
            object.__setattr__(self, "max_loras", len(modules))
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ValueError(f"max_loras: must be an integer >= 0, got {self.max_loras!r}")
        if modules and not self.max_loras:
            raise ValueError(f"max_loras: 0 turns LoRA off, but {len(modules)} lora_modules are given")
        _positive_int("max_lora_rank", self.max_lora_rank)
        if self.max_loras and self.force_hidden:
            raise ValueError("force_hidden: the hidden kinds are off with LoRA adapters (max_loras > 0)")

    @property
    def lora_enabled(self) -> bool:
        return bool(self.max_loras)

    def lora_module_paths(self) -> dict[str, str]:
        """``lora_modules`` as {name: path}."""
        return {n.strip(): p.strip() for n, _, p in (m.partition("=") for m in self.lora_modules)}

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def hidden_allowed(self, hidden_saves_memory: bool) -> bool:
        """Whether the engine may use hidden pages for a model whose layout has ``hidden_saves_memory``."""
        return self.enable_hybrid_cache and not self.lora_enabled and (hidden_saves_memory or self.force_hidden)

    def compressed_kinds(self, layout) -> tuple:
        """The compressed kinds offered for a model with ``layout`` (a ``CacheLayout``), cheapest per
        step first: each one allowed by ``cache_kinds`` and the hybrid-cache switches, holding more
        tokens per page than KV and than every cheaper kind offered (hidden-int8 on a grouped-query
        model holds fewer than kv-int8 and costs more: never offered)."""
        allowed = set(self.cache_kinds)
        hidden_ok = self.hidden_allowed(layout.hidden_saves_memory)
        offered, best = [], layout.block_size
        for kind in BY_COST:  # kv-int8, hidden, hidden-int8
            if kind.value not in allowed or (kind.stores_hidden and not hidden_ok):
                continue
            tpp = layout.tokens_per_page(kind)
            if tpp > best or (kind is CacheKind.HIDDEN and self.force_hidden):
                offered.append(kind)
                best = max(best, tpp)
        return tuple(offered)


def check_share(name: str, value: object) -> float:
    """A share in [0, 1] (``cache_ratio``, the watermarks), as a float; ValueError naming ``name`` if not.
    The one check of a cache ratio, at start (``EngineConfig``) and when it changes at run time."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}: must be a number in [0, 1], got {value!r}")
    return float(value)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
