"""The constraint on its output a request asks for, whichever way it asks: OpenAI's ``response_format``
(``json_object``, ``json_schema``), vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` and its
``structured_outputs`` object. One at most; each error names the field the client used."""

from __future__ import annotations

from apt_serve_ray.sampling.structured import StructuredOutput
from deployments.api_error import APIError

GUIDED_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"))
STRUCTURED_OUTPUTS_KEYS = frozenset({"json", "json_object", "regex", "choice"})


def requested(response_format, guided_json, guided_regex, guided_choice,
              structured_outputs: dict | None) -> tuple[str, dict] | None:
    """(the field it came in, ``StructuredOutput``'s keyword arguments), or None: free text."""
    given = []
    rf = response_format
    if rf is not None and rf.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        spec = (rf.model_extra or {}).get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise APIError("response_format: json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                           param="response_format")
        given.append(("response_format", {"json": spec.get("schema") or {"type": "object"}}))
    for (name, key), value in zip(GUIDED_FIELDS, (guided_json, guided_regex, guided_choice)):
        if value is not None:
            given.append((name, {key: value}))
    if structured_outputs is not None:
        unknown = sorted(set(structured_outputs) - STRUCTURED_OUTPUTS_KEYS)
        if unknown:
            raise APIError(f"structured_outputs: {unknown[0]!r} is not supported (supported: "
                           f"{sorted(STRUCTURED_OUTPUTS_KEYS)})", param="structured_outputs")
        given.append(("structured_outputs", dict(structured_outputs)))
    if not given:
        return None
    if len(given) > 1:
        raise APIError(f"{given[1][0]}: give one output constraint, not {given[0][0]} and {given[1][0]}",
                       param=given[1][0])
    return given[0]


def build(constraint: tuple[str, dict] | None) -> StructuredOutput | None:
    """``requested``'s answer as a ``StructuredOutput`` (its checks run now), errors naming the field."""
    if constraint is None:
        return None
    name, kwargs = constraint
    try:
        return StructuredOutput(**kwargs)
    except (TypeError, ValueError) as exc:
        raise APIError(f"{name}: {str(exc).removeprefix('structured_output: ')}", param=name) from None
