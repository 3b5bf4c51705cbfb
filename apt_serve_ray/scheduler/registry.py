"""Scheduling policies by name. Errors list the valid names."""

from __future__ import annotations

_POLICIES: dict[str, type] = {}


def register_policy(cls):
    _POLICIES[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    _load_builtin()
    return sorted(_POLICIES)


def make_policy(name: str, config, **options):
    _load_builtin()
    if name not in _POLICIES:
        raise ValueError(f"policy: unknown policy {name!r}; valid names: {sorted(_POLICIES)}")
    try:
        return _POLICIES[name](config=config, **options)
    except TypeError as exc:  # an unknown option
        raise ValueError(f"policy {name!r}: {exc}") from None


def _load_builtin() -> None:
    # Imported lazily: the policies import the scheduler, which imports the config, which asks here.
    from apt_serve_ray.scheduler.policies import apt, fcfs, priority, sarathi  # noqa: F401
