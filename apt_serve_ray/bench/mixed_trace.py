"""Mixed traffic: requests of several classes, each with its own lengths, SLOs and priority.

The traffic the Apt-Serve design is for (issue 26, SPEC section 7) is not one length distribution with
service levels laid on it (``workloads.assign_classes``) but classes that differ in both: short chats
with tight targets beside long documents with loose ones. ``MIXED`` is that seed traffic; a benchmark
varies it by building its own ``TrafficClass`` list.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from apt_serve_ray.bench.workloads import (
    _STREAM_GAPS,
    _STREAM_LENGTHS,
    ServiceClass,
    TraceRequest,
    Uniform,
    WorkloadSpec,
    _arrival_times,
    _check_arrivals,
    _stream,
    assign_classes,
    fill_token_ids,
)


@dataclass(frozen=True)
class TrafficClass:
    """A class of a mixed trace: its service level (share, SLOs, priority) and its own lengths."""

    service: ServiceClass
    lengths: WorkloadSpec


# The seed traffic of issue 26 / SPEC section 7: short chats beside long documents, two service levels.
CHAT = TrafficClass(ServiceClass("chat", 0.7, ttft_slo_ms=2000, tbt_slo_ms=500, priority=0),
                    WorkloadSpec("chat", Uniform(64, 256), Uniform(32, 128)))
DOCUMENT = TrafficClass(ServiceClass("document", 0.3, ttft_slo_ms=12000, tbt_slo_ms=1000, priority=10),
                        WorkloadSpec("document", Uniform(900, 1500), Uniform(64, 128)))
MIXED = (CHAT, DOCUMENT)


def make_mixed_trace(classes: tuple[TrafficClass, ...] | list[TrafficClass], num_requests: int, rate: float,
                     cv: float = 1.0, seed: int = 0, max_model_len: int = 2048,
                     vocab_size: int | None = None) -> list[TraceRequest]:
    """``num_requests`` requests of several classes, each with its class's lengths, SLOs and priority.

    Classes are laid on the trace as ``assign_classes`` does (exact counts, seeded shuffle); then each
    request draws its lengths from its own class's spec (one stream per class, so a class's lengths do
    not depend on the other classes' shares), fitted to the model as ``make_trace``. Arrivals and
    ``with_rate`` as for any trace; request ids are ``<class>-<i>``.
    """
    _check_arrivals(num_requests, rate, cv)
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    services = [c.service for c in classes]
    blank = [TraceRequest(str(i), 0.0, 1, 1) for i in range(num_requests)]
    labelled = assign_classes(blank, services, seed)
    streams = _stream(seed, _STREAM_LENGTHS).spawn(len(classes))
    prompt_lens = np.empty(num_requests, dtype=np.int64)
    output_lens = np.empty(num_requests, dtype=np.int64)
    for c, rng in zip(classes, streams):
        rows = [i for i, r in enumerate(labelled) if r.service_class == c.service.name]
        prompt_lens[rows] = c.lengths.prompt.sample(rng, len(rows))
        output_lens[rows] = c.lengths.output.sample(rng, len(rows))
    output_lens = np.clip(output_lens, 1, max_model_len - 1)
    prompt_lens = np.clip(prompt_lens, 1, max_model_len - output_lens)
    arrivals = _arrival_times(num_requests, rate, cv, _stream(seed, _STREAM_GAPS))
    trace = [dataclasses.replace(r, request_id=f"{r.service_class}-{i}", arrival_s=float(t), prompt_len=int(p),
                                 output_len=int(o))
             for i, (r, t, p, o) in enumerate(zip(labelled, arrivals, prompt_lens, output_lens))]
    return trace if vocab_size is None else fill_token_ids(trace, vocab_size, seed)
