"""The engine's LoRA adapters (issue 43): a request takes its adapter's slot when it is added, or waits outside
the scheduler until one frees; adapters registered, loaded and unloaded between steps. ``LLMEngine`` mixes it in
(it holds ``runner``, ``requests``, ``scheduler``, ``clock`` and ``_lora_waiting``, a deque)."""

from __future__ import annotations

import collections

from apt_serve_ray.engine.outputs import RequestOutput
from apt_serve_ray.request import Request, RequestStatus

# A request waiting this long for a LoRA adapter slot lets no later adapter request start before it.
LORA_FAIR_WAIT_S = 1.0


class LoRASlots:
    def _check_lora(self, name) -> None:
        if name is None:
            return
        lora = getattr(self.runner, "lora", None)
        if lora is None or name not in lora.known:
            raise ValueError(f"model: no LoRA adapter named {name!r} is loaded"
                             + ("" if lora is not None else " (LoRA is off: max_loras is 0)"))

    def _take_lora_slot(self, request: Request) -> bool:
        """Give ``request`` its adapter's slot, loading the adapter into one if it is registered but not
        loaded (a free slot, else the least recently used one no request holds); False when requests hold
        every slot: the request waits outside the scheduler (``_lora_waiting``) until one ends. A
        ``ValueError`` naming ``model`` if the adapter was unloaded meanwhile."""
        if request.lora_name is None or request.lora is not None:
            return True
        self._check_lora(request.lora_name)
        request.lora = self.runner.lora.load(request.lora_name, self._busy_lora_slots)
        return request.lora is not None

    def _lora_queue_closed(self) -> bool:
        """Whether the first request waiting for an adapter slot has waited ``LORA_FAIR_WAIT_S``: then
        adapter requests queue behind it, so that the slots drain (else requests of the adapters in
        slots, arriving without end, would keep every slot held and it would never start)."""
        return bool(self._lora_waiting) and self.clock() - self._lora_waiting[0].arrival_time > LORA_FAIR_WAIT_S

    def _start_lora_waiting(self) -> list[RequestOutput]:
        """Requests that waited for an adapter slot go to the scheduler once their adapter has one (in
        arrival order; past ``LORA_FAIR_WAIT_S``, none overtakes the first); those whose adapter was
        unloaded meanwhile end with an explicit error."""
        if not self._lora_waiting:
            return []
        failed, still = [], collections.deque()
        closed = self._lora_queue_closed()
        while self._lora_waiting:
            request = self._lora_waiting.popleft()
            if request.request_id not in self.requests:  # aborted while it waited
                continue
            try:
                started = (not closed or not still) and self._take_lora_slot(request)
            except ValueError as exc:
                request.error = f"{exc} (it was unloaded before this request started)"
                failed.append(self._finish(request, RequestStatus.FINISHED_ERROR))
                continue
            if started:
                self.scheduler.add_request(request)
            else:
                still.append(request)
        self._lora_waiting = still
        return failed

    def _busy_lora_slots(self) -> set[int]:
        requests = getattr(self, "requests", {})  # none yet while __init__ loads lora_modules
        return {r.lora.slot for r in requests.values() if r.lora is not None}

    def _lora_manager(self):
        lora = getattr(self.runner, "lora", None)
        if lora is None:
            raise ValueError("max_loras: LoRA is off (0 adapter slots); start the engine with max_loras > 0")
        return lora

    def add_lora(self, name: str, path: str) -> None:
        """Register the PEFT adapter in the folder ``path`` as ``name`` (requests then name it as their
        ``model``) and load it into a slot if one is free or held by no request (else it is loaded on
        its first request); a ``ValueError`` naming the field when it cannot be served."""
        lora = self._lora_manager()
        lora.register(name, path)
        lora.load(name, self._busy_lora_slots)

    def remove_lora(self, name: str) -> None:
        """Unload ``name``: new requests can no longer name it; those running with it finish with it,
        and its slot is freed when the last one ends."""
        ref = self._lora_manager().unregister(name)
        if ref is not None and ref.slot not in self._busy_lora_slots():
            self.runner.lora.release(ref)

    def list_loras(self) -> dict[str, str]:
        """The adapters registered (requests may name them): {name: path}."""
        lora = getattr(self.runner, "lora", None)
        return lora.paths if lora is not None else {}

    def loaded_loras(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(the adapters in a slot now, those of them requests in the engine hold)."""
        lora = getattr(self.runner, "lora", None)
        if lora is None:
            return (), ()
        busy = self._busy_lora_slots()
        return tuple(lora.refs), tuple(n for n, ref in lora.refs.items() if ref.slot in busy)


