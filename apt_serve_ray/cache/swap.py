"""A tier below memory: slots for the pages of preempted requests, which come back instead of being
recomputed (vLLM's ``swap_space``).

A slot holds one page over all layers (``layout.bytes_per_page``), as raw bytes, so every cache
kind (KV, hidden, the int8 kinds with their scales) round-trips byte for byte::

    slots  [num_slots][num_layers][page_bytes] uint8      slot s, layer l  <-  storage.bytes[l][page]

The backing is pinned host memory when the cache lives on a GPU; on the CPU, anonymous memory
reserved lazily (a large tier costs nothing until slots are written; a thread of the lowest priority
faults slots in ahead of their first use, since a first write can cost 200x a later one where a
hypervisor backs memory lazily, see "The warmer" below), or, where ``swap_dir`` is given,
a sparse memory-mapped file there, unlinked as soon as it is mapped; either way nothing is left
behind, whatever way the process ends. An unbacked tier (``device=None``) keeps only the bookkeeping: the
simulator prices transfers without moving bytes.

Its slots are given out by the allocator the page pool also stands on (``slots.py``): it says "no"
(``None``) when full, records owners, and ``check_integrity()`` holds free + used == total. Whether
to swap is the scheduler's call.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from apt_serve_ray.cache.layout import CacheLayout
from apt_serve_ray.cache.slots import SlotAllocator

logger = logging.getLogger("apt_serve_ray")

GIB = 1 << 30
_STAGE_PAGES = 64  # pages per staged copy: bounds the temporary buffer of one transfer
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, leaving what they hold as it is
WARM_AHEAD_BYTES = 64 << 20  # how far past the slots ever used the warmer keeps the tier faulted in
WARM_START_BYTES = 16 << 20  # faulted in at once, before the tier is used (the rest by the warmer)
_WARM_CHUNK_BYTES = 4 << 20  # populated per call (the warmer checks its stop flag between calls)


@dataclass(frozen=True)
class TransferCost:
    """Seconds to move one page (all layers) to the tier and back (``measure_bandwidth``)."""

    out_s_per_page: float
    in_s_per_page: float
    bytes_per_page: int = 0

    def seconds(self, num_pages: int) -> float:
        """A round trip of ``num_pages`` pages: out now, in when the request resumes."""
        return num_pages * (self.out_s_per_page + self.in_s_per_page)

    def gb_per_s(self) -> tuple[float, float]:
        """(out, in) in GB/s (1e9 bytes), for logs and reports."""
        return tuple(self.bytes_per_page / s / 1e9 if s > 0 else float("inf")
                     for s in (self.out_s_per_page, self.in_s_per_page))


def _madvise():
    """libc's ``madvise`` through ctypes (which lets go of the GIL while it runs), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return fn


def _populate(madvise, data: torch.Tensor, first: int, num: int, slot_bytes: int) -> bool:
    """Fault slots ``first .. first + num - 1`` of ``data`` in (MADV_POPULATE_WRITE: what they hold is
    left as it is). False where it cannot be done here (no such call, or a kernel before 5.14)."""
    if madvise is None:
        return False
    start = data.data_ptr() + first * slot_bytes
    aligned = start - start % mmap.PAGESIZE
    if madvise(aligned, start + num * slot_bytes - aligned, _MADV_POPULATE_WRITE) != 0:
        logger.debug("cannot fault the tier in: madvise: %s", os.strerror(ctypes.get_errno()))
        return False
    return True


def _warm_tier(ref, event: threading.Event) -> None:
    """The warming thread of a ``SwapSpace`` (see its ``_warm_target``): it holds the tier only through
    a weak reference between calls, so a tier dropped without ``close`` still goes, and the thread
    with it."""
    try:  # this thread only (Linux): the lowest priority, on any core (the engine's is pinned)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):
        pass
    madvise = _madvise()
    while True:
        tier = ref()
        if tier is None or tier._warm_stop or tier._data is None:
            return
        target = tier._warm_target()
        if tier.warm_slots >= target:
            if tier.warm_slots >= tier.num_slots:
                return
            del tier
            event.wait(1.0)
            event.clear()
            continue
        size = tier.layout.bytes_per_page
        n = min(max(1, _WARM_CHUNK_BYTES // size), target - tier.warm_slots)
        if not _populate(madvise, tier._data, tier.warm_slots, n, size):
            tier.warm_slots = tier.num_slots
            return
        tier.warm_slots += n
        del tier


def num_slots_for(swap_space_gib: float, layout: CacheLayout) -> int:
    """Slots of ``swap_space_gib`` GiB: whole pages of ``layout.bytes_per_page`` bytes."""
    return int(swap_space_gib * GIB // layout.bytes_per_page)


def make_swap_space(swap_space_gib: float, swap_dir: str | None, layout: CacheLayout, runner) -> SwapSpace | None:
    """The engine's tier (None at 0 GiB) beside ``runner``'s cache tensors (``runner.storage``), on
    their device, its transfer cost measured. A runner without cache tensors (the simulator) gets the
    bookkeeping alone, priced with its own ``transfer_cost``."""
    if not swap_space_gib:
        return None
    num_slots = num_slots_for(swap_space_gib, layout)
    if num_slots < 1:
        raise ValueError(f"swap_space: {swap_space_gib} GiB holds no page of {layout.bytes_per_page} bytes")
    storage = getattr(runner, "storage", None)
    if storage is None:
        swap = SwapSpace(layout, num_slots)
        swap.transfer = getattr(runner, "transfer_cost", None)
        return swap
    device = storage.layers[0].device
    if device.type != "cuda":
        # The backing is reserved lazily: a write past what is there would kill the process (OOM for
        # anonymous memory, SIGBUS on a file's mapping). Hold no more slots than half the memory
        # available now, or 90% of the file's free disk space.
        if swap_dir is None:
            where, share, free = "host memory", 0.5, _available_memory()
        else:
            where, share = swap_dir, 0.9
            free = shutil.disk_usage(where).free if os.path.isdir(where) else None  # else SwapSpace names it
        if free is not None and num_slots * layout.bytes_per_page > share * free:
            fitting = int(share * free // layout.bytes_per_page)
            logger.warning("swap_space: %.2f GiB asked, %.2f GiB free in %s: the tier holds %d pages",
                           swap_space_gib, free / GIB, where, fitting)
            if fitting < 1:
                return None
            num_slots = fitting
    swap = SwapSpace(layout, num_slots, device=device, swap_dir=swap_dir)
    swap.measure_bandwidth(storage)
    return swap


def _available_memory() -> int | None:
    """Bytes of memory available for new allocations (``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class SwapSpace:
    def __init__(self, layout: CacheLayout, num_slots: int, *, device: torch.device | str | None = None,
                 swap_dir: str | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"swap_space: holds no page of {layout.bytes_per_page} bytes (num_slots {num_slots})")
        self.layout = layout
        self.num_slots = num_slots
        self.device = torch.device(device) if device is not None else None
        self.transfer: TransferCost | None = None  # measured (``measure_bandwidth``) or given (simulator)
        # Last freed, first reused (a stack: the low slots first at start): the slots in use stay the
        # few the tier's working set needs, already written once. Cycling first-in-first-out through a
        # 4 GiB file made every swap-out write cold blocks (page faults, block allocation): a 90-page
        # swap-out of an fp32 OPT-125m request took ~0.3 s, 10x its measured (warm) cost.
        self._slots = SlotAllocator(num_slots, lifo=True, what="swap slot")
        self._data: torch.Tensor | None = None
        self._mmap: np.memmap | None = None
        # Slots 0 .. warm_slots - 1 are faulted in. Only anonymous memory starts cold (see ``_warm_target``);
        # pinned memory, a file's mapping (its blocks are written either way) and bookkeeping are "warm".
        self.warm_slots = num_slots
        self._warm_wanted = threading.Event()
        self._warm_stop = False
        self._warm_thread: threading.Thread | None = None
        if self.device is not None:
            self._data = self._allocate(swap_dir)
            if isinstance(self._mmap, mmap.mmap):
                start = min(num_slots, max(1, WARM_START_BYTES // layout.bytes_per_page))
                if _populate(_madvise(), self._data, 0, start, layout.bytes_per_page):
                    self.warm_slots = start
                    self._warm_thread = threading.Thread(target=_warm_tier, args=(weakref.ref(self), self._warm_wanted),
                                                         name="apt-tier-warmer", daemon=True)
                    self._warm_thread.start()
                else:  # no way to warm it here: slots fault in as they are written, as before
                    self.warm_slots = num_slots

    def _allocate(self, swap_dir: str | None) -> torch.Tensor:
        shape = (self.num_slots, self.layout.num_layers, self.layout.page_bytes)
        if self.device.type == "cuda":
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        if swap_dir is None:
            # Anonymous memory, reserved lazily (MAP_NORESERVE): a large tier costs nothing until slots
            # are written, and it goes with the process. A file-backed mapping on the temp dir's disk
            # wrote its dirty pages back and faulted them again: a demoted page took 2.2 ms to copy out
            # (OPT-125m bf16, 590 KB a page, ext4 on a virtual disk), against ~0.2 ms here.
            size = self.num_slots * self.layout.bytes_per_page
            self._mmap = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
            return torch.frombuffer(self._mmap, dtype=torch.uint8).view(shape)
        if not os.path.isdir(swap_dir):
            raise ValueError(f"swap_dir: {swap_dir!r} is not a directory")
        fd, path = tempfile.mkstemp(prefix="apt-serve-swap-", dir=swap_dir)
        try:
            os.ftruncate(fd, self.num_slots * self.layout.bytes_per_page)  # sparse: no block written yet
            self._mmap = np.memmap(path, dtype=np.uint8, mode="r+", shape=shape)
        finally:
            os.close(fd)
            os.unlink(path)  # the mapping keeps the file alive; its blocks go when it is unmapped
        return torch.from_numpy(self._mmap)

    @property
    def is_backed(self) -> bool:
        return self._data is not None

    # Slots --------------------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return self._slots.num_free

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - self._slots.num_free

    def can_allocate(self, num: int) -> bool:
        return num <= self._slots.num_free

    def allocate(self, num: int, owner: str) -> list[int] | None:
        slots = self._slots.allocate(num, owner)
        if self._warm_thread is not None and self.warm_slots < self._warm_target():
            self._warm_wanted.set()
        return slots

    @property
    def num_warm_free_slots(self) -> int:
        """Free slots already faulted in. Slots are handed out lowest first and the freed ones reused
        first (LIFO), so every slot ever used is warm and the never used are those from
        ``high_water`` up, warm below ``warm_slots``."""
        cold = self.num_slots - max(self.warm_slots, self._slots.high_water)
        return max(0, self._slots.num_free - cold)

    def next_slot_is_warm(self) -> bool:
        """Whether the next slot ``allocate`` gives is free and already faulted in (a demotion, which is
        optional, takes only such a slot: see ``_warm_target``)."""
        slot = self._slots.peek()
        return slot is not None and slot < self.warm_slots

    # The warmer ---------------------------------------------------------------------------------
    # Anonymous memory is faulted in on its first write, and under a hypervisor that backs guest memory
    # lazily the fault is dear: a 590 KB slot written for the first time took 4.65 ms here (Firecracker
    # VM), against 0.025 ms again. The tier filled slot after slot as prefix pages were demoted, so every
    # demotion and swap-out of a run wrote cold slots, and steps with one ran 2.2x their prediction
    # (issue 44: 0.60 s predicted 0.27 s; ten chats' gaps broken by one such step). So a thread of the
    # lowest priority (SCHED_IDLE: it runs only where the core would idle) faults slots in ahead of use,
    # WARM_AHEAD_BYTES past the highest slot ever used, with MADV_POPULATE_WRITE, which leaves their
    # bytes as they are and so races with nothing; and demotions take only warm slots.
    def _warm_target(self) -> int:
        ahead = max(1, WARM_AHEAD_BYTES // self.layout.bytes_per_page)
        return min(self.num_slots, self._slots.high_water + ahead)

    def free(self, slots: list[int], owner: str) -> None:
        self._slots.free(slots, owner)

    def owner(self, slot: int) -> str | None:
        return self._slots.owner(slot)

    def check_integrity(self) -> None:
        """free + used == total, no slot free twice, no free slot owned."""
        self._slots.check_integrity()

    # Bytes --------------------------------------------------------------------------------------
    # Page by page: a contiguous copy per page and layer runs at memcpy speed (~10 GB/s on a CPU), where
    # index_select / index_copy_ over uint8 rows ran ten times slower. On a GPU the gather stays on the
    # device and one transfer per batch crosses the bus.
    def copy_out(self, storage, pages: list[int], slots: list[int]) -> None:
        """Pages of ``storage`` (a ``CacheStorage``) -> slots, every layer, byte for byte."""
        data, src = self._backing(), storage.bytes
        if src[0].device.type == "cpu":
            for page, slot in zip(pages, slots):
                row = data[slot]
                for layer, page_bytes in enumerate(src):
                    row[layer].copy_(page_bytes[page])
            return
        for i in range(0, len(pages), _STAGE_PAGES):
            p = torch.tensor(pages[i : i + _STAGE_PAGES], device=src[0].device)
            staged = torch.stack([page_bytes.index_select(0, p) for page_bytes in src], dim=1).cpu()
            for j, slot in enumerate(slots[i : i + _STAGE_PAGES]):
                data[slot].copy_(staged[j])

    def copy_in(self, storage, slots: list[int], pages: list[int]) -> None:
        """Slots -> pages of ``storage``, every layer, byte for byte."""
        data, dst = self._backing(), storage.bytes
        if dst[0].device.type == "cpu":
            for slot, page in zip(slots, pages):
                row = data[slot]
                for layer, page_bytes in enumerate(dst):
                    page_bytes[page].copy_(row[layer])
            return
        for i in range(0, len(pages), _STAGE_PAGES):
            chunk = slots[i : i + _STAGE_PAGES]
            staged = torch.empty((len(chunk), *data.shape[1:]), dtype=torch.uint8, pin_memory=True)
            for j, slot in enumerate(chunk):
                staged[j].copy_(data[slot])
            staged = staged.to(dst[0].device, non_blocking=True)
            p = torch.tensor(pages[i : i + _STAGE_PAGES], device=dst[0].device)
            for layer, page_bytes in enumerate(dst):
                page_bytes.index_copy_(0, p, staged[:, layer])

    def gather(self, slots: list[int], device) -> torch.Tensor:
        """The bytes of ``slots`` as one ``[n, num_layers, page_bytes]`` tensor on ``device`` (for a copy
        that is converted on its way in, rather than copied byte for byte)."""
        data = self._backing()
        staged = torch.empty((len(slots), *data.shape[1:]), dtype=torch.uint8,
                             pin_memory=torch.device(device).type == "cuda")
        for j, slot in enumerate(slots):
            staged[j].copy_(data[slot])
        return staged.to(device, non_blocking=True)

    def _backing(self) -> torch.Tensor:
        if self._data is None:
            raise RuntimeError("this swap space has no backing memory (closed, or bookkeeping only)")
        return self._data

    def measure_bandwidth(self, storage, num_pages: int = 8, repeats: int = 3) -> TransferCost:
        """Time copying ``num_pages`` pages out and back in (the fastest of ``repeats``; interference only
        adds time), as calibration times rho; sets and returns ``transfer``. Uses free slots and the
        first pages of ``storage``, which it leaves byte for byte as they were: call it at start."""
        n = min(num_pages, self.num_free_slots, storage.num_pages)
        if n < 1:
            raise ValueError("num_pages: no free slot or page to time a transfer with")
        slots = self.allocate(n, "__bandwidth__")
        pages = list(range(n))
        sync = torch.cuda.synchronize if storage.bytes[0].device.type == "cuda" else (lambda: None)
        best_out = best_in = float("inf")
        try:
            for _ in range(repeats + 1):  # the first pass also touches the file's blocks: a warm-up
                sync()
                t0 = time.perf_counter()
                self.copy_out(storage, pages, slots)
                sync()
                t1 = time.perf_counter()
                self.copy_in(storage, slots, pages)
                sync()
                t2 = time.perf_counter()
                best_out, best_in = min(best_out, t1 - t0), min(best_in, t2 - t1)
        finally:
            self.free(slots, "__bandwidth__")
        self.transfer = TransferCost(best_out / n, best_in / n, self.layout.bytes_per_page)
        return self.transfer

    def describe(self) -> str:
        where = ("pinned host memory" if self.device is not None and self.device.type == "cuda"
                 else "a memory-mapped file" if isinstance(self._mmap, np.memmap)
                 else "anonymous host memory" if self._data is not None else "bookkeeping only")
        return f"{self.num_slots} slots of {self.layout.bytes_per_page} B ({self.num_slots * self.layout.bytes_per_page / GIB:.2f} GiB) in {where}"

    def close(self) -> None:
        """Drop the backing memory: once unreferenced it is unmapped, and the unlinked file's blocks go."""
        self._warm_stop = True
        self._warm_wanted.set()
        if self._warm_thread is not None:
            self._warm_thread.join(timeout=5)
            self._warm_thread = None
        self._data = None
        self._mmap = None
