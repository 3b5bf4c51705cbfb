"""Autoscaling in the fleet simulator: a Ray Serve autoscaling policy run the way Ray's controller runs it,
fed the way Ray feeds it.

``RayAutoscaler`` is the fleet's ``autoscaler`` (called every ``FleetSettings.autoscale_interval_s``). It
runs ``deployments.autoscaling``'s policies, ours (``ForecastAutoscalingPolicy``) or Ray's default, inside
Ray's own wrapper (``ray_controller``: delays, scaling factors, bounds) on a real ``AutoscalingContext``
(``make_context``) whose numbers arrive as they do in a cluster: each replica samples its metrics every
``sample_s`` (Ray: ``look_back_period_s`` x 0.2, 6 s) and pushes them every ``push_s`` (``metrics_interval_s``,
10 s); the controller averages the requests in flight over ``look_back_period_s`` (30 s) and hands the
policy the counter samples of that window. A policy therefore sees the fleet 6-16 s late, in either
case.
"""

from __future__ import annotations

from collections import deque

from deployments.autoscaling import AutoscalingOptions, ForecastAutoscalingPolicy, make_context, ray_controller, \
    ray_default_policy


class RayAutoscaler:
    def __init__(self, options: AutoscalingOptions, max_num_seqs: int, sample_s: float = 6.0,
                 push_s: float = 10.0) -> None:
        self.options = options
        self.config = options.autoscaling_config(max_num_seqs)
        policy = (ForecastAutoscalingPolicy(**self.config.policy.policy_kwargs) if options.policy == "forecast"
                  else ray_default_policy)
        self.decide = ray_controller(policy)
        self.sample_s, self.push_s = sample_s, push_s
        self.look_back_s = self.config.look_back_period_s
        self.state: dict = {}
        self._samples: dict[str, deque] = {}  # replica -> (time, requests received so far), sampled
        self._ongoing: deque = deque()  # (time, requests in flight over the fleet), sampled
        self._next_sample = 0.0
        self._pushed = 0.0  # samples up to here have reached the controller
        self.decisions: list[tuple[float, int]] = []  # (time, target) at each call

    def __call__(self, fleet) -> int:
        now = fleet.clock.now
        serving = fleet.serving()
        if now >= self._next_sample:
            for r in serving:
                self._samples.setdefault(r.rid.unique_id, deque()).append((now, r.num_received))
            self._ongoing.append((now, sum(len(r.requests) for r in fleet.replicas.values())))
            self._next_sample = now + self.sample_s
        if now >= self._pushed + self.push_s:
            self._pushed = now
        window = self._pushed - self.look_back_s
        for samples in self._samples.values():
            while samples and samples[0][0] < window:
                samples.popleft()
        while self._ongoing and self._ongoing[0][0] < window:
            self._ongoing.popleft()
        names = [r.rid.unique_id for r in serving]
        seen = [v for t, v in self._ongoing if t <= self._pushed]
        received = {name: [(t, v) for t, v in self._samples.get(name, ()) if t <= self._pushed] for name in names}
        ctx = make_context(now=now, replicas=names, ongoing_requests=sum(seen) / len(seen) if seen else 0.0,
                           config=self.config, target_replicas=sum(1 for r in fleet.replicas.values() if not r.draining),
                           requests_received={k: v for k, v in received.items() if v}, policy_state=self.state)
        target, self.state = self.decide(ctx)
        self.decisions.append((now, target))
        return target
