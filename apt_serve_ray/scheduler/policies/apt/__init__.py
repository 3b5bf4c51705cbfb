"""The adaptive SLO-aware policy (Apt-Serve, SPEC section 2): ``policy.py`` says what it does and why.

One ``Decision`` per call (``decision.py``: the candidates' table, the prices, the plan and the step's
budget), and four stages over it, each a module of functions: ``price`` (the value model; requests that
cannot start in time written off, ``admission.predicted_late``), ``choose`` (the greedy, the
reservation, priority overtakes, admission as a promise), ``kinds`` (kind changes in place) and
``shape`` (the iteration: who runs, with how many prefill tokens, whom to preempt).
"""

from apt_serve_ray.scheduler.policies.apt.policy import AdaptiveScheduler

__all__ = ["AdaptiveScheduler"]
