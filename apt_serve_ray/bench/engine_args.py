"""The engine's settings as benchmark flags, declared once: ``add_engine_args`` puts them on a parser
with ``EngineConfig``'s defaults, ``engine_kwargs`` turns the parsed flags into ``EngineConfig``
keyword arguments, and ``app_args`` into ``serve run`` ``key=value`` arguments for the app.

A benchmark that needs another default passes it as ``Default(value, why)``: the reason is printed
in ``--help`` beside it, so a figure's settings can be told from the engine's own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from apt_serve_ray.config import _DTYPES, COMPRESSED_KIND_NAMES, EngineConfig

CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "apt-serve-ray"


@dataclass(frozen=True)
class Default:
    """A benchmark's own default for an engine flag, and why it differs from ``EngineConfig``'s."""

    value: object
    why: str
    choices: tuple | None = None  # narrower than the engine's, e.g. dtypes a peer server also takes

    def __post_init__(self) -> None:
        if not self.why.strip():
            raise ValueError("Default: say why the benchmark differs from EngineConfig")


class _Kinds(argparse.Action):
    """Cache kinds space- or comma-separated (``hidden kv-int8`` or ``hidden,kv-int8``), as one list."""

    def __call__(self, parser, namespace, values, option_string=None):
        kinds = [k for v in values for k in v.split(",") if k]
        bad = [k for k in kinds if k not in COMPRESSED_KIND_NAMES]
        if bad:
            parser.error(f"{option_string}: unknown cache kinds {bad}; valid: {list(COMPRESSED_KIND_NAMES)}")
        setattr(namespace, self.dest, kinds)


# EngineConfig field -> (flags, argparse keywords); the first flag is the one the docs quote.
FLAGS: dict[str, tuple[tuple[str, ...], dict]] = {
    "dtype": (("--dtype",), dict(choices=_DTYPES, help="the engine's dtype")),
    "num_threads": (("--threads", "--num-threads"), dict(type=int, help="torch compute threads")),
    "num_pages": (("--num-pages",), dict(type=int, help="cache pages of block_size (16) tokens")),
    "max_model_len": (("--max-model-len",), dict(type=int, help="longest prompt + output")),
    "max_num_batched_tokens": (("--max-num-batched-tokens",), dict(type=int, help="tokens a step")),
    "max_num_seqs": (("--max-num-seqs",), dict(type=int, help="requests a step")),
    "swap_space": (("--swap-space",), dict(type=float, help="GiB of the tier below memory (0: recompute)")),
    "cache_ratio": (("--cache-ratio",), dict(type=float, help="ceiling of the pool's share in compressed kinds")),
    "cache_kinds": (("--cache-kinds",), dict(action=_Kinds, nargs="+", help="compressed kinds offered "
                                             "(space- or comma-separated)")),
    "policy": (("--policy",), dict(help="scheduling policy")),
}
COMMON = ("dtype", "num_threads", "num_pages", "max_model_len", "max_num_batched_tokens", "max_num_seqs")

# The settings every comparison with the vLLM peer shares (the peer's own flags follow from them:
# ``servers.vllm_command``), and the serving benchmarks that compare policies on the same budget.
ONE_THREAD = Default(1, "one compute thread: the machine's cores are shared, one thread is steadier")
PEER_MATCHED = dict(
    num_pages=Default(378, "6,048 KV tokens: the bytes of the vLLM peer's 189 blocks of 32 "
                           "(shared/tools/vllm-peer), so that memory binds"),
    max_num_batched_tokens=Default(512, "the vLLM peer comparison's step budget"),
    num_threads=ONE_THREAD,
    max_model_len=Default(2048, "the random checkpoints' context"),
)
PEER_DTYPE = Default("float32", "the vLLM peer is given the same dtype; fp32 on a CPU without native bf16",
                     choices=("float32", "bfloat16"))


def engine_default(name: str):
    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == name)


def add_engine_args(parser: argparse.ArgumentParser, *names: str, **defaults: Default) -> argparse.ArgumentParser:
    """Add the engine flags ``names`` (default: ``COMMON``) to ``parser``; ``defaults`` overrides
    ``EngineConfig``'s default of a field, each with its reason."""
    names = names or COMMON
    unknown = (set(names) | set(defaults)) - set(FLAGS)
    if unknown:
        raise ValueError(f"add_engine_args: no flag for {sorted(unknown)}; known: {sorted(FLAGS)}")
    group = parser.add_argument_group("engine (EngineConfig)")
    for name in names:
        flags, kwargs = FLAGS[name]
        kwargs = dict(kwargs)
        given = defaults.get(name)
        if given is not None and not isinstance(given, Default):
            raise TypeError(f"add_engine_args: {name}: pass Default(value, why), not a bare {given!r}")
        if given is None:
            value = engine_default(name)
            kwargs["help"] += f" (default: EngineConfig's, {value})"
        else:
            value = given.value
            kwargs["help"] += f" (default {value}: {given.why})"
            if given.choices is not None:
                kwargs["choices"] = given.choices
        if name == "cache_kinds" and value is not None:
            value = list(value)
        group.add_argument(*flags, dest=name, default=value, **kwargs)
    return parser


def engine_kwargs(args: argparse.Namespace, **changes) -> dict:
    """``EngineConfig`` keyword arguments from the engine flags in ``args`` (those ``add_engine_args``
    added), updated with ``changes``; a flag left at None is left to the engine."""
    out = {}
    for name in FLAGS:
        value = getattr(args, name, None)
        if value is None:
            continue
        if name == "cache_kinds":
            value = tuple(value)
        out[name] = value
    out.update(changes)
    return out


def app_args(kwargs: dict) -> list[str]:
    """``key=value`` arguments of ``serve run deployments.app:build_app`` for app/engine settings
    (lists and dicts as JSON, booleans lower-case, as the app's argument parser reads them)."""
    def text(value) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, (list, tuple)):
            return "[" + ",".join(map(str, value)) + "]"
        if isinstance(value, dict) or value is None:
            return json.dumps(value)
        return str(value)

    return [f"{k}={text(v)}" for k, v in kwargs.items()]


def add_cache_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="where random checkpoints are kept")


def random_checkpoint(shape: str = "opt-125m", cache_dir: Path | None = None, dtype: str = "bfloat16") -> str:
    """The random-weight checkpoint of ``shape`` the benchmarks share (built once under ``cache_dir``)."""
    from apt_serve_ray.models.checkpoints import make_random_checkpoint

    return make_random_checkpoint(Path(cache_dir or CACHE_DIR) / f"{shape}-{'bf16' if dtype == 'bfloat16' else dtype}",
                                  shape, dtype=dtype)
