"""The checks ``LLMEngine.make_request`` runs before a request exists: each raises ``ValueError`` naming the
field ("prompt: ...", "ttft_slo_ms: ..."), and none touches engine state."""

from __future__ import annotations

from apt_serve_ray.sampling.params import SamplingParams


def prompt_ids(prompt, tokenizer, vocab_size: int, max_model_len: int) -> tuple[str | None, list[int]]:
    """(the prompt's text or None, its token ids): a string is tokenised, a list of ids checked."""
    if isinstance(prompt, str):
        text, ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        text, ids = None, list(prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt: token ids must be in [0, {vocab_size}), got {bad[:5]}")
    else:
        raise ValueError("prompt: must be a string or a list of token ids")
    if not ids:
        raise ValueError("prompt: must not be empty")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt: {len(ids)} tokens leave no room to generate within the model's context of "
            f"{max_model_len} tokens"
        )
    return text, ids


def check_params(params, vocab_size: int) -> None:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise ValueError(f"logit_bias: token ids must be in [0, {vocab_size}), got {max(params.logit_bias)}")


def check_hints(*, ttft_slo_ms, tbt_slo_ms, priority, service_class, cache_salt) -> None:
    """The scheduling hints and the prefix-cache salt a request may carry."""
    for name, value in (("ttft_slo_ms", ttft_slo_ms), ("tbt_slo_ms", tbt_slo_ms)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"{name}: must be a positive number of milliseconds, got {value!r}")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise ValueError(f"priority: must be an integer, got {priority!r}")
    if service_class is not None and not isinstance(service_class, str):
        raise ValueError(f"service_class: must be a string, got {service_class!r}")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError(f"cache_salt: must be a non-empty string, got {cache_salt!r}")
