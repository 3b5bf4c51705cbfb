"""Runs one scheduled step on the model: builds the flat token batch and attention metadata from the
``SchedulerOutput``, performs compressed->KV upgrades, runs the forward pass, samples. No policy here."""

from __future__ import annotations

import logging
import math

import torch

from apt_serve_ray.cache.cache_manager import ConversionPlan, SwapPlan
from apt_serve_ray.cache.layout import CacheLayout
from apt_serve_ray.cache.storage import CacheStorage, token_rows
from apt_serve_ray.config import QUANTIZATIONS, EngineConfig
from apt_serve_ray.worker.cpu_info import has_native_bf16 as cpu_has_native_bf16
from apt_serve_ray.models.checkpoint_quant import checked_quantization, dequantize_state
from apt_serve_ray.models.loader import ModelSource, load_config, load_state_dict
from apt_serve_ray.models import DecoderModel, model_class
from apt_serve_ray.models.base import tensor_bytes
from apt_serve_ray.models.llama import sliding_window
from apt_serve_ray.attention import AttentionMetadata, DecodeGroup, PrefillChunk, SlotWrite, make_backend
from apt_serve_ray.attention.metadata import ContextSegment, SegmentedDecode
from apt_serve_ray.attention.backend import read_kv
from apt_serve_ray.request import CacheKind, Request
from apt_serve_ray.sampling.sampler import SampledToken, Sampler
from apt_serve_ray.scheduler.output import ScheduledChunk, SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULT_CPU_CACHE_BYTES = 512 * 1024 * 1024
CONVERT_CHUNK = 512  # tokens an in-place kind change converts at a time (``_convert``)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on GPUs that compute in it (Ampere and later) and on CPUs with native bf16;
    float16 on older GPUs, float32 on other CPUs."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


class ModelRunner:
    swap = None  # the tier below memory (a ``SwapSpace``), set by the engine when it has one

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.dtype == "auto":
            logger.info("dtype auto: %s on %s%s", str(self.dtype).removeprefix("torch."), self.device.type,
                        "" if self.device.type != "cpu" else
                        f" ({'native' if cpu_has_native_bf16() else 'no native'} bf16 on this CPU)")
        self.hf_config = load_config(source)
        model_max = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(f"max_model_len: {config.max_model_len} exceeds the model's context {model_max}")
        cls = model_class(self.hf_config.model_type)
        window = None if cls.masks_sliding_window else sliding_window(self.hf_config)
        if window is not None and window < model_max:
            # Attention within the window is full attention for sequences that fit in it.
            if config.max_model_len is not None and config.max_model_len > window:
                raise ValueError(f"max_model_len: {config.max_model_len} exceeds the model's attention window "
                                 f"{window} (sliding-window attention is served up to the window)")
            if config.max_model_len is None:
                logger.warning("max_model_len capped from %d to %d tokens: the model's sliding attention window",
                               model_max, window)
            model_max = window
        self.max_model_len = config.max_model_len or model_max
        state = load_state_dict(source, self.dtype)
        quantization = checked_quantization(config, state, self.dtype, self.device)
        if quantization is None:
            state = dequantize_state(state, self.dtype)
        if quantization in QUANTIZATIONS and (self.dtype == torch.float32 or self.device.type != "cpu"):
            # torch's kernels for packed int8 / int4 weights: 9-17x the full-width time at one row in
            # float32, 80-170x at 32-512 rows (bf16: 0.55-0.6x at one row), models/quant.py; none on a GPU
            if config.dtype != "auto" and self.dtype == torch.float32:
                raise ValueError(f"quantization: {config.quantization} weights need bfloat16 (or float16) "
                                 "activations; dtype is float32: set dtype=bfloat16")
            if config.device != "auto" and self.device.type != "cpu":
                raise ValueError("quantization: quantized weights are served on CPU only (no GPU kernel yet)")
            # dtype / device auto chose float32 (a CPU without native bf16) or a GPU: a config that asks for
            # int4 by default (serve_config.yaml) still serves, at full width.
            logger.warning("quantization=%s is served with bfloat16 activations on CPU, and auto chose %s on %s: "
                           "the weights are served at full width", quantization,
                           str(self.dtype).removeprefix("torch."), self.device.type)
            quantization = None
        self.model: DecoderModel = cls(self.hf_config, state, self.device, self.dtype, self.max_model_len,
                                       quantization=quantization)
        del state
        self.weight_bytes = tensor_bytes(self.model)  # before LoRA wraps the layers (their slots: lora.nbytes)
        self.lora = None
        if config.lora_enabled:
            from apt_serve_ray.lora.manager import LoRAManager

            self.lora = LoRAManager(self.model, self.hf_config, max_loras=config.max_loras,
                                    max_rank=config.max_lora_rank, device=self.device, dtype=self.dtype)
        s = self.model.shape
        self.vocab_size = s.vocab_size
        self.layout = CacheLayout(
            num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
            hidden_size=s.hidden_size, block_size=config.block_size,
            dtype_bytes=torch.finfo(self.dtype).bits // 8,
        )
        self.num_pages = self._num_pages()
        self.storage = CacheStorage(self.layout, self.num_pages, self.device, self.dtype)
        self.sampler = Sampler(config.seed)
        self.attention = make_backend(config.attention_backend, self.device, config.cache_proj_optimize)
        logger.info("attention backend: %s", self.attention.describe())

    def _num_pages(self) -> int:
        if self.config.num_pages is not None:
            return self.config.num_pages
        budget = self.config.cache_budget_bytes
        if budget is None and self.config.memory_budget_bytes is not None:
            weights = self.weight_bytes + (self.lora.nbytes if self.lora is not None else 0)
            budget = self.config.memory_budget_bytes - weights
            if budget < self.layout.bytes_per_page:
                raise ValueError(f"memory_budget_bytes: {self.config.memory_budget_bytes} bytes leave no page "
                                 f"({self.layout.bytes_per_page} bytes) beside the weights' {weights} bytes")
            logger.info("memory budget: %.1f MiB of weights, %.1f MiB for the cache", weights / 2**20, budget / 2**20)
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * 0.8)
            else:
                budget = _DEFAULT_CPU_CACHE_BYTES
        num = budget // self.layout.bytes_per_page
        if num < 1:
            raise ValueError(
                f"cache_budget_bytes: {budget} bytes is smaller than one page ({self.layout.bytes_per_page} bytes)"
            )
        return num

    def forget(self, request_id: str) -> None:
        """The request has left the engine: drop its sampling state (its seeded generator)."""
        self.sampler.forget(request_id)

    # One step -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[tuple[Request, SampledToken]]:
        # Swap-outs first: pages they free may have been given to other requests of this step. Then
        # swap-ins (their slots are released only after the step), then upgrades, then the forward pass.
        if out.swap_out:
            self.swap.copy_out(self.storage, [p for plan in out.swap_out for p in plan.pages],
                               [s for plan in out.swap_out for s in plan.slots])
        if out.swap_in:
            copies = [plan for plan in out.swap_in if not plan.is_conversion]
            if copies:
                self.swap.copy_in(self.storage, [s for plan in copies for s in plan.slots],
                                  [p for plan in copies for p in plan.pages])
            for plan in out.swap_in:
                if plan.is_conversion:
                    self._convert_in(plan)
        for plan in out.conversions:
            self._convert(plan)
        if not out.chunks:
            return []
        input_ids, positions, meta, sample_rows, sample_requests = self._prepare(out.chunks)
        try:
            hidden = self.model.forward(input_ids, positions, meta)
        finally:
            if self.lora is not None:
                self.lora.clear()
        if not sample_rows:
            return []
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        return list(zip(sample_requests, self.sampler.sample(logits, sample_requests)))

    @torch.inference_mode()
    def logits_for_all_rows(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Forward ``chunks`` and return the logits of every row (scoring and tests)."""
        input_ids, positions, meta, _, _ = self._prepare(chunks)
        try:
            hidden = self.model.forward(input_ids, positions, meta)
        finally:
            if self.lora is not None:
                self.lora.clear()
        return self.model.compute_logits(hidden).float()

    def _prepare(self, chunks: list[ScheduledChunk]):
        """The flat token batch of ``chunks`` and its attention metadata. Plain Python lists per row
        (decode steps are many short rows), one tensor per field at the end."""
        ids: list[int] = []
        positions: list[int] = []
        writes = {kind: ([], []) for kind in CacheKind}  # (rows, slots)
        decodes = {kind: [] for kind in CacheKind}  # (row, context length, pages)
        segmented: dict[tuple, list] = {}  # (prefix kind, kind) -> decode rows over two K/V segments
        prefills: list[PrefillChunk] = []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        lora_slots: list[int] | None = [] if self.lora is not None else None
        row = 0
        for chunk in chunks:
            r, n = chunk.request, chunk.num_tokens
            if lora_slots is not None:
                lora_slots.extend([r.lora.slot if r.lora is not None else -1] * n)
            start, end = r.num_computed_tokens, r.num_computed_tokens + n
            ids.extend(r.all_token_ids[start:end])
            positions.extend(range(start, end))
            tpp = self.layout.tokens_per_page(r.kind)
            page_ids = r.page_ids
            rows, slots = writes[r.kind]
            rows.extend(range(row, row + n))
            if r.num_prefix_pages:  # a shared prefix in another kind: the rest starts after its pages
                head, first = r.num_prefix_pages, r.num_prefix_tokens
                slots.extend(page_ids[head + (p - first) // tpp] * tpp + (p - first) % tpp for p in range(start, end))
                if n == 1 and not (r.kind.stores_hidden or r.prefix_kind.stores_hidden):
                    own = page_ids[head: head + (end - first + tpp - 1) // tpp]
                    segmented.setdefault((r.prefix_kind, r.kind), []).append((row, first, page_ids[:head], end - first, own))
                else:
                    prefills.append(self._segmented_chunk(r, row, n, start, end))
            elif n == 1:
                slots.append(page_ids[start // tpp] * tpp + start % tpp)
                decodes[r.kind].append((row, end, page_ids[: (end + tpp - 1) // tpp]))
            else:
                slots.extend(page_ids[p // tpp] * tpp + p % tpp for p in range(start, end))
                c = PrefillChunk(row, n, start, r.kind)
                if not r.kind.stores_hidden:
                    c.block_table = self._to(torch.tensor(page_ids[: (end + tpp - 1) // tpp], dtype=torch.int32))
                if start > 0 or r.kind.is_int8:  # int8 chunks attend over their stored (dequantised) K/V
                    ctx = torch.arange(end)
                    c.pages, c.offsets = self._to(torch.tensor(page_ids)[ctx // tpp]), self._to(ctx % tpp)
                prefills.append(c)
            if chunk.completes:
                sample_rows.append(row + n - 1)
                sample_requests.append(r)
            row += n
        meta = AttentionMetadata(storage=self.storage, num_tokens=row, backend=self.attention, prefills=prefills)
        if lora_slots is not None:
            self.lora.set_batch(lora_slots, self.device)
        for (prefix_kind, kind), entries in segmented.items():
            prefix = self._decode_group([(e[0], e[1], e[2]) for e in entries], prefix_kind)
            own = self._decode_group([(e[0], e[3], e[4]) for e in entries], kind)
            meta.decode_segmented.append(SegmentedDecode(prefix.rows, prefix_kind, kind, prefix, own,
                                                         self._to(torch.tensor([e[1] for e in entries]))))
        meta.writes = {kind: self._slot_write(*w, kind, row) for kind, w in writes.items() if w[0]}
        meta.decodes = {kind: self._decode_group(d, kind) for kind, d in decodes.items() if d}
        return self._to(torch.tensor(ids)), self._to(torch.tensor(positions)), meta, sample_rows, sample_requests

    def _segmented_chunk(self, r: Request, row: int, n: int, start: int, end: int) -> PrefillChunk:
        """The rows of a request that keeps a shared prefix in another kind (decode rows too): its
        context is read segment by segment, each in its kind, and attended as one."""
        segments = []
        for kind, pages, first, last in ((r.prefix_kind, r.page_ids[:r.num_prefix_pages], 0, r.num_prefix_tokens),
                                         (r.kind, r.page_ids[r.num_prefix_pages:], r.num_prefix_tokens, end)):
            ctx = torch.arange(last - first)
            tpp = self.layout.tokens_per_page(kind)
            segments.append(ContextSegment(kind, self._to(torch.tensor(pages)[ctx // tpp]), self._to(ctx % tpp),
                                           self._to(ctx + first)))
        return PrefillChunk(row, n, start, r.kind, segments=segments)

    def _to(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def _slot_write(self, rows: list[int], slots: list[int], kind: CacheKind, num_tokens: int) -> SlotWrite | None:
        if not rows:
            return None
        slots_t = torch.tensor(slots)
        tpp = self.layout.tokens_per_page(kind)
        return SlotWrite(self._to(torch.tensor(rows)), self._to(slots_t // tpp), self._to(slots_t % tpp),
                         self._to(slots_t), all_rows=len(rows) == num_tokens)  # rows are distinct

    def _decode_group(self, entries, kind: CacheKind) -> DecodeGroup | None:
        if not entries:
            return None
        max_pages = max(len(e[2]) for e in entries)
        table = [pages + [0] * (max_pages - len(pages)) for _, _, pages in entries]
        lens = [e[1] for e in entries]
        return DecodeGroup(
            rows=self._to(torch.tensor([e[0] for e in entries])),
            block_table=self._to(torch.tensor(table, dtype=torch.int32)),
            ctx_lens=self._to(torch.tensor(lens, dtype=torch.int32)),
            max_len=max(lens), tokens_per_page=self.layout.tokens_per_page(kind),
        )

    def _convert_in(self, plan: SwapPlan) -> None:
        """A copy in the tier comes back in another kind: its tokens, read from the slots' bytes,
        quantised into the new pages (kv -> kv-int8, hidden -> hidden-int8), layer by layer."""
        if plan.num_tokens == 0:
            return
        staged = self.swap.gather(plan.slots, self.device)  # [slots, layers, page_bytes]
        pos = torch.arange(plan.num_tokens)
        tpp = self.layout.tokens_per_page(plan.to_kind)
        dst_pages = self._to(torch.tensor(plan.pages)[pos // tpp])
        dst_offs = self._to(pos % tpp)
        for layer in range(self.layout.num_layers):
            tokens = token_rows(self.layout, staged[:, layer], plan.kind, self.dtype)[: plan.num_tokens]
            self.storage.write_int8(layer, plan.to_kind, dst_pages, dst_offs, tokens)

    def _convert(self, plan: ConversionPlan) -> None:
        """Fill a request's new pages from its old ones, layer by layer: to KV, K/V projected from stored
        x (hidden), dequantised (kv-int8), or both (hidden-int8); to an int8 kind, the same content
        (K/V, or x) quantised."""
        if plan.num_tokens == 0:
            return
        pos = torch.arange(plan.num_tokens)  # from the plan's first token (after a shared prefix it keeps)
        tpp, dst_tpp = self.layout.tokens_per_page(plan.from_kind), self.layout.tokens_per_page(plan.to_kind)
        src_pages = self._to(torch.tensor(plan.src_pages)[pos // tpp])
        src_offs = self._to(pos % tpp)
        dst_pages = self._to(torch.tensor(plan.dst_pages)[pos // dst_tpp])
        dst_offs = self._to(pos % dst_tpp)
        pos = self._to(pos + plan.start_token)  # positions: K is rotated where it sits
        # In pieces of CONVERT_CHUNK tokens: whole, a document's temporaries (9 MB and more a layer) were
        # fresh allocations, faulted in each time, and converting 1,500 tokens cost 2.7-3.6x per token what
        # 512 did (kv <-> kv-int8, bf16 OPT-125m), far above the price calibrated on 512.
        # Whole pages of both kinds per piece: an int8 page's scales may cover all of its tokens.
        pages = math.lcm(tpp, dst_tpp)
        step = -(-CONVERT_CHUNK // pages) * pages
        for lo in range(0, plan.num_tokens, step):
            part = slice(lo, lo + step)
            sp, so, dp, do = src_pages[part], src_offs[part], dst_pages[part], dst_offs[part]
            for layer in range(self.layout.num_layers):
                if not plan.is_upgrade:
                    src = self.storage.view(plan.from_kind)[layer][sp, so]
                    self.storage.write_int8(layer, plan.to_kind, dp, do, src)
                    continue
                k, v = read_kv(layer, self.storage, plan.from_kind, sp, so,
                               self.model.kv_projections[layer], pos[part], self.dtype)
                self.storage.kv[layer][dp, do] = torch.stack((k, v), dim=1)
