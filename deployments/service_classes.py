"""Service classes: named sets of SLO targets and a priority, defined once in the app's config and
chosen per request (``service_class`` in the body, or the ``x-service-class`` header).

A request's scheduling hints are, field by field, the first that is set of::

    the request's own priority / ttft_slo_ms / tbt_slo_ms  >  its class's  >  the engine's default_*

The class's name travels with the request to the engine, which tags its per-request metrics with it
(``apt_serve_ray/observability/metrics.py``). A request that names no class gets
``default_service_class``, by default the class ``default``: it sets nothing, so such a request keeps
the engine's configured ``default_*`` targets and priority, exactly as before classes existed (and is
labelled "default" in the metrics). ``default`` is always defined (an empty class) unless the config
defines it otherwise. Latency-sensitive traffic asks for ``interactive`` and goes first; ``batch``
goes last.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Optional

from pydantic import BaseModel, ConfigDict, PositiveFloat

from deployments.openai_protocol import APIError

HEADER = "x-service-class"
# A class name becomes a Prometheus label value and a header value: keep it plain.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class ServiceClass(BaseModel):
    """One class's targets; a field left out takes the engine's default (``default_ttft_slo_ms``,
    ``default_tbt_slo_ms``, ``default_priority``). Lower ``priority`` is served first."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    ttft_slo_ms: Optional[PositiveFloat] = None
    tbt_slo_ms: Optional[PositiveFloat] = None
    priority: Optional[int] = None


DEFAULT_SERVICE_CLASS = "default"
SERVICE_CLASSES: dict[str, ServiceClass] = {
    DEFAULT_SERVICE_CLASS: ServiceClass(),  # the engine's defaults
    "interactive": ServiceClass(ttft_slo_ms=1_000, tbt_slo_ms=100, priority=0),
    "batch": ServiceClass(ttft_slo_ms=30_000, tbt_slo_ms=1_000, priority=10),
}


@dataclass(frozen=True)
class ServiceClasses:
    """The classes a router knows and the one a request gets when it names none (checked here once)."""

    classes: Mapping[str, ServiceClass] = field(default_factory=lambda: dict(SERVICE_CLASSES))
    default: str = DEFAULT_SERVICE_CLASS

    def __post_init__(self) -> None:
        if DEFAULT_SERVICE_CLASS not in self.classes:  # always there: the engine's defaults
            object.__setattr__(self, "classes", {DEFAULT_SERVICE_CLASS: ServiceClass(), **self.classes})
        for name in self.classes:
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise ValueError(f"service_classes: class name {name!r} must be 1-64 letters, digits, '_', '.' "
                                 "or '-' (it becomes a metric label)")
        if self.default not in self.classes:
            raise ValueError(f"default_service_class: {self.default!r} is not a defined class; "
                             f"defined: {self.names}")

    @property
    def names(self) -> list[str]:
        return sorted(self.classes)

    def choose(self, field_value: str | None, header_value: str | None) -> str:
        """The class a request asked for (by the body's field or the header; the two must agree),
        else the default. An unknown name is a 400 naming where it came from and the valid names."""
        if field_value is not None and header_value is not None and field_value != header_value:
            raise APIError(f"service_class: {field_value!r} differs from the {HEADER} header's {header_value!r}; "
                           "name the class once", param="service_class", code="invalid_service_class")
        name, param = (field_value, "service_class") if field_value is not None else (header_value, HEADER)
        if name is None:
            return self.default
        if name not in self.classes:
            raise APIError(f"{param}: unknown service class {name!r}; valid: {self.names}", param=param,
                           code="invalid_service_class")
        return name

    def scheduling(self, name: str, overrides: dict) -> dict:
        """``priority`` / ``ttft_slo_ms`` / ``tbt_slo_ms`` for a request of class ``name``: the class's
        values with the request's own (``overrides``) on top; a field neither sets is left out."""
        values = self.classes[name].model_dump(exclude_none=True)
        return {**values, **{k: v for k, v in overrides.items() if v is not None}}
