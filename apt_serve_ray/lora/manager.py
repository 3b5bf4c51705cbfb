"""LoRA adapters served side by side over one base model, several in one step (issue 43, item 3).

``LoRAManager`` holds ``max_loras`` slots per targetable layer (``targets.py``): A [slots, rank blocks,
in] and Bt [slots, rank blocks, out], allocated once at start (their bytes come out of the memory
budget like the weights'). Adapters are registered (read into memory; more than there are slots, as
vLLM's ``lora_modules`` beyond ``max_loras``) and copied into a slot when a request names one: a free slot,
else the least recently used one no request holds (``load``); unloading empties a slot once no request
uses it. Each targeted layer is wrapped in a ``LoRALinear``; a step's rows tell it their slots
(``set_batch``, from the model runner), and it adds every row's own update in one pair of matrix
products over the slots in use, masked per row (base-model rows get none):

    y = base(x) + ((x A_[:m]^T) * mask) Bt_[:m]       (m: the highest slot in use + 1)

On a CPU a decode step is bound by the bytes it reads, and this reads each adapter in the step once,
whatever rows use it; the products' extra columns (rows times other adapters' ranks) are the price of
not gathering per row (vLLM's punica kernels gather per row on GPUs).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch

from apt_serve_ray.lora.peft import load_adapter
from apt_serve_ray.lora.targets import Targets, lora_targets


@dataclass(frozen=True)
class LoRARef:
    """An adapter as a request holds it: its name, its slot, and a key unique to this load of it
    (the prefix cache's hash chain starts from it, so no other adapter, nor a reload of this one
    with other weights, shares its cached pages)."""

    name: str
    slot: int
    key: str


class LoRABatch:
    """One step's rows' slots: ``m`` slots in use from 0, and ``mask`` [rows, m] (None: every row uses
    slot 0)."""

    __slots__ = ("m", "mask")

    def __init__(self, m: int, mask: torch.Tensor | None) -> None:
        self.m, self.mask = m, mask


class LoRALinear:
    """A linear layer (plain, packed or quantized) with the step's adapters' updates added."""

    __slots__ = ("base", "a", "bt", "manager", "used")

    def __init__(self, base, a: torch.Tensor, bt: torch.Tensor, manager: LoRAManager) -> None:
        self.base, self.a, self.bt, self.manager = base, a, bt, manager
        self.used = False  # whether any adapter loaded targets this layer (else: the base layer's cost only)

    def __getattr__(self, name):  # kept_rows, nbytes, weight...: the base layer's
        if name in LoRALinear.__slots__:  # not set yet (a copy being made): no base to ask
            raise AttributeError(name)
        return getattr(self.base, name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.manager.batch
        if batch is None or not self.used:
            return y
        m = batch.m
        xa = x @ self.a[:m].flatten(0, 1).T  # [rows, m * blocks]
        if batch.mask is not None:
            xa = (xa.view(x.shape[0], m, -1) * batch.mask[:, :, None]).flatten(1)
        return y.addmm_(xa, self.bt[:m].flatten(0, 1))


class LoRAManager:
    def __init__(self, model, hf_config, *, max_loras: int, max_rank: int, device, dtype) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras / max_lora_rank: must be >= 1, got {max_loras} / {max_rank}")
        self.targets: Targets = lora_targets(hf_config)
        self.max_loras, self.max_rank, self.dtype = max_loras, max_rank, dtype
        self.slots: list[str | None] = [None] * max_loras  # adapter name per slot
        self.refs: dict[str, LoRARef] = {}  # the registered adapters in a slot
        # Every adapter registered: {name: (folder, key, weights in memory)}; more than there are slots.
        self.known: dict[str, tuple[str, str, object]] = {}
        self.last_used: dict[str, int] = {}  # name -> when a request last named it (a counter)
        self._clock = 0
        self.num_slot_loads = 0  # adapters copied into a slot since the start
        self.batch: LoRABatch | None = None
        self._loads = 0
        self._lock = threading.Lock()
        self.buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.layers: dict[tuple[int, int], LoRALinear] = {}
        self.targeted: dict[str, set[tuple[int, int]]] = {}  # adapter name -> the (layer, group)s it has
        for i, layer in enumerate(model.layers):
            for g, group in enumerate(self.targets.groups):
                rows = len(group.parts) * max_rank
                a = torch.zeros(max_loras, rows, group.in_features, device=device, dtype=dtype)
                bt = torch.zeros(max_loras, rows, group.out_features, device=device, dtype=dtype)
                self.buffers[i, g] = (a, bt)
                self.layers[i, g] = LoRALinear(getattr(layer, group.attr), a, bt, self)
                setattr(layer, group.attr, self.layers[i, g])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + bt.nbytes for a, bt in self.buffers.values())

    @property
    def paths(self) -> dict[str, str]:
        """Every adapter registered (requests may name it): {name: its folder}."""
        return {name: path for name, (path, _, _) in self.known.items()}

    def names(self) -> list[str]:
        return list(self.known)

    def loaded(self) -> list[str]:
        """The registered adapters in a slot now."""
        return list(self.refs)

    def ref(self, name: str) -> LoRARef | None:
        """``name``'s slot if it is loaded, else None."""
        return self.refs.get(name)

    def register(self, name: str, path: str) -> None:
        """Read the PEFT adapter in ``path`` as ``name`` (kept in memory, loaded into a slot when a
        request needs it); a ``ValueError`` naming the field for a name taken or an adapter this model
        cannot take."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"lora_name: must be a non-empty string, got {name!r}")
        with self._lock:
            if name in self.known:
                raise ValueError(f"lora_name: an adapter named {name!r} is already loaded")
        adapter = load_adapter(path, self.targets, max_rank=self.max_rank, dtype=self.dtype)
        with self._lock:
            if name in self.known:
                raise ValueError(f"lora_name: an adapter named {name!r} is already loaded")
            self._loads += 1
            self.known[name] = (path, f"{name}#{self._loads}", adapter)

    def load(self, name: str, busy_slots: Callable[[], set[int]]) -> LoRARef | None:
        """``name``'s slot, loading it into a free one, else into the least recently used one no request
        holds (``busy_slots()``: the slots requests hold, asked only when no slot is free), which stays
        registered; None when every slot is busy. The adapter keeps the key it was registered with, so its cached prefixes outlive a reload."""
        with self._lock:
            ref = self.refs.get(name)
            if ref is None:
                if name not in self.known:
                    raise ValueError(f"model: no LoRA adapter named {name!r} is loaded")
                slot = self._free_slot(busy_slots)
                if slot is None:
                    return None
                _, key, adapter = self.known[name]
                for layer, (a, bt) in self.buffers.items():
                    weights = adapter.weights.get(layer)
                    if weights is None:
                        a[slot].zero_()
                        bt[slot].zero_()
                    else:
                        a[slot].copy_(weights[0])
                        bt[slot].copy_(weights[1])
                ref = LoRARef(name, slot, key)
                self.slots[slot], self.refs[name] = name, ref
                self.targeted[key] = set(adapter.weights)
                self.num_slot_loads += 1
                self._mark_used()
            self._clock += 1
            self.last_used[name] = self._clock
            return ref

    def _free_slot(self, busy_slots: Callable[[], set[int]]) -> int | None:
        if None in self.slots:
            return self.slots.index(None)
        busy = busy_slots()
        idle = [(self.last_used.get(name, 0), slot) for slot, name in enumerate(self.slots)
                if slot not in busy and self.refs.get(name) is not None and self.refs[name].slot == slot]
        if not idle:
            return None
        _, slot = min(idle)
        self._empty(slot)
        return slot

    def _empty(self, slot: int) -> None:
        name = self.slots[slot]
        ref = self.refs.get(name)
        if ref is not None and ref.slot == slot:
            del self.refs[name]
            self.targeted.pop(ref.key, None)
        self.slots[slot] = None
        for a, bt in self.buffers.values():
            a[slot].zero_()
            bt[slot].zero_()
        self._mark_used()

    def _mark_used(self) -> None:
        """Layers no adapter held targets skip the update (PEFT's default, q and v only, leaves the
        MLP and the output projection alone)."""
        used = set().union(*self.targeted.values()) if self.targeted else set()
        for key, layer in self.layers.items():
            layer.used = key in used

    def unregister(self, name: str) -> LoRARef | None:
        """Forget ``name``: new requests can no longer name it. Its slot (returned, if it had one) is
        freed by ``release`` once the requests that hold it have ended (the engine tracks them)."""
        with self._lock:
            if name not in self.known:
                raise ValueError(f"lora_name: no adapter named {name!r} is loaded")
            del self.known[name]
            self.last_used.pop(name, None)
            return self.refs.pop(name, None)

    def release(self, ref: LoRARef) -> None:
        """Free ``ref``'s slot (no request holds it any more, and it was unregistered), zeroing it: a
        freed slot inside the range a step multiplies over must add nothing (0 * NaN would)."""
        with self._lock:
            if self.slots[ref.slot] == ref.name and self.refs.get(ref.name) != ref:
                self.slots[ref.slot] = None
                for a, bt in self.buffers.values():
                    a[ref.slot].zero_()
                    bt[ref.slot].zero_()
                self.targeted.pop(ref.key, None)
                self._mark_used()

    def set_batch(self, row_slots: list[int], device) -> None:
        """The step's rows' slots (-1: the base model), before the forward pass; ``clear`` after."""
        used = max(row_slots, default=-1)
        if used < 0:
            self.batch = None
            return
        m = used + 1
        if m == 1 and min(row_slots) == 0:
            self.batch = LoRABatch(1, None)
            return
        slots = torch.tensor(row_slots, device=device)
        mask = (slots[:, None] == torch.arange(m, device=device)[None, :]).to(self.dtype)
        self.batch = LoRABatch(m, mask)

    def clear(self) -> None:
        self.batch = None
