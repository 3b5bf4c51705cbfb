"""Starting and stopping the servers a benchmark measures, one way each.

* ``ours``: ``serve run`` of the app (``deployments.app:build_app`` with ``key=value`` arguments, or a
  config file such as ``serve_config.yaml``) in a process group of its own;
* ``vllm``: vLLM's CPU build from ``$PEER`` (``shared/tools/vllm-peer/README.md``), told the same
  model, dtype, threads, cache bytes (its blocks of 32 tokens holding our pages' tokens), step budget
  and batch limit as ours;
* ``local_serve``: a Ray instance and Serve in this process, for benchmarks that deploy the app
  themselves (``serve.run(build_app(...))``) and reach it by handle as well as over HTTP.

``start_server`` waits until the server answers; ``stop_server`` sends SIGINT (``serve run`` shuts
Serve and Ray down on it; vLLM stops), waits, then kills what is left of the process group, by its id.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from apt_serve_ray.bench.engine_args import app_args

REPO = Path(__file__).resolve().parents[2]
OURS_PORT = 8000  # serve run's
VLLM_PORT = 8100


@dataclass(frozen=True)
class ServerSpec:
    name: str
    cmd: list[str]
    env: dict
    port: int
    told: tuple[str, ...] = ()  # what of a request's service level this server is told (ClientOptions)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def server_env(**extra: str) -> dict:
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false",
                PYTHONPATH=pythonpath, **extra)


def serve_binary() -> str:
    beside = Path(sys.executable).parent / "serve"
    return str(beside) if beside.exists() else (shutil.which("serve") or "serve")


def ours(engine: dict | None = None, *, model: str | None = None, served_model_name: str | None = None,
         extra: list[str] | tuple = (), config: str | None = None, name: str = "ours",
         told: tuple[str, ...] = ("priority", "slos")) -> ServerSpec:
    """``serve run`` of our app: ``config`` (a Serve config file, its arguments as written) or
    ``deployments.app:build_app`` with ``engine`` (EngineConfig / app fields) as ``key=value``."""
    if config is not None:
        cmd = [serve_binary(), "run", config]
    else:
        head = {"model": model, "served_model_name": served_model_name}
        cmd = [serve_binary(), "run", "deployments.app:build_app",
               *app_args({k: v for k, v in head.items() if v is not None}), *app_args(engine or {})]
    return ServerSpec(name, cmd + list(extra), server_env(), OURS_PORT, told)


# serve_config.yaml's scheduling, watermarks, kinds and tier: ``ours`` as the app ships it; the other
# names change one thing each.
SHIPPED = dict(policy="apt", cache_kinds=("hidden", "kv-int8"), light_watermark=0.7, heavy_watermark=0.9,
               max_hidden_ratio=0.7, swap_space=4)
OURS_VARIANTS = {
    "ours": {},
    "ours-kv": dict(cache_kinds=(), light_watermark=1.0, heavy_watermark=1.0),  # KV pages only, watermarks off
    "ours-notier": dict(swap_space=0),  # no tier below memory: preempted requests are recomputed
    "ours-nopc": dict(enable_prefix_caching=False),
    # apt's admission as before issue 44: no promise, no reservation, nobody written off
    "ours-open": dict(policy_options={"admission_share": None, "reserve_after": None, "write_off_late": False}),
    # the margin on a step's prediction from the P99 of its measured error, not the envelope (issue 44, item 4)
    "ours-p99": dict(policy_options={"step_margin_quantile": 0.99}),
    # priority preemption of any lower-priority victim, as before the victims' promises were kept
    "ours-evictany": dict(policy_options={"evict_within_promise": False}),
    # requests predicted late written off in turn, each that does not fit, not the fewest (the longest first)
    "ours-inturn": dict(policy_options={"write_off_fewest": False}),
    # as before issue 44's fifth pass: written off in turn, the reservation passed on at admission
    "ours-prev": dict(policy_options={"write_off_fewest": False, "keep_reservation": False}),
    # the node's Ray processes under SCHED_BATCH (cpu_affinity.yield_to_engines; off as shipped)
    "ours-yield": dict(yield_to_engines=True),
    # ... and as shipped, said explicitly (the name the tenth pass's burst A/B ran under, when yield was on)
    "ours-noyield": dict(yield_to_engines=False),
}
# vLLM with its defaults (FCFS, prefix caching on), with priorities (told each request's), without
# prefix caching (a lab baseline: users run vLLM with it on).
VLLM_VARIANTS = {"vllm": ((), ()), "vllm-priority": (("--scheduling-policy", "priority"), ("priority",)),
                 "vllm-nopc": (("--no-enable-prefix-caching",), ())}


def named(name: str, engine: dict, *, model: str, served_model_name: str, ours_args=(), vllm_args=(),
          vllm_port: int = VLLM_PORT, kv_cache_gib: float = 1) -> ServerSpec:
    """One of ``OURS_VARIANTS`` or ``VLLM_VARIANTS`` with ``engine``'s settings."""
    if name in OURS_VARIANTS:
        return ours({**engine, **SHIPPED, **OURS_VARIANTS[name]}, model=model, served_model_name=served_model_name,
                    extra=list(ours_args), name=name)
    if name in VLLM_VARIANTS:
        flags, told = VLLM_VARIANTS[name]
        return vllm(engine, model=model, served_model_name=served_model_name, extra=[*flags, *vllm_args],
                    port=vllm_port, name=name, told=told, kv_cache_gib=kv_cache_gib)
    raise SystemExit(f"--servers: unknown {name!r}; valid: {' '.join([*OURS_VARIANTS, *VLLM_VARIANTS])}")


def peer_dir() -> str:
    peer = os.environ.get("PEER")
    if not peer:
        raise SystemExit("set PEER to the folder with vLLM's venv and vllm-cli (shared/tools/vllm-peer)")
    return peer


def vllm(engine: dict, *, model: str, served_model_name: str, extra: list[str] | tuple = (),
         kv_cache_gib: float = 1, port: int = VLLM_PORT, name: str = "vllm",
         told: tuple[str, ...] = ()) -> ServerSpec:
    """vLLM CPU told ``engine``'s settings (dtype, num_threads, num_pages of 16 tokens as half as many
    blocks of 32, max_model_len, max_num_batched_tokens, max_num_seqs), its compute threads bound to the
    first cores. ``kv_cache_gib``: VLLM_CPU_KVCACHE_SPACE, enough to hold the blocks asked for."""
    peer, threads = peer_dir(), int(engine.get("num_threads") or 1)
    env = server_env(VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
                     VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}")
    cmd = [f"{peer}/venv/bin/python", f"{peer}/vllm-cli", "serve", model, "--served-model-name", served_model_name,
           "--max-model-len", str(engine["max_model_len"]), "--dtype", engine["dtype"], "--block-size", "32",
           "--num-gpu-blocks-override", str(engine["num_pages"] * 16 // 32),
           "--max-num-batched-tokens", str(engine["max_num_batched_tokens"]),
           "--max-num-seqs", str(engine["max_num_seqs"]), "--port", str(port), *extra]
    return ServerSpec(name, cmd, env, port, told)


def answers(port: int, path: str = "/v1/models") -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def start_server(spec: ServerSpec, log: Path | str, timeout_s: float = 400.0,
                 ready_path: str = "/v1/models") -> subprocess.Popen:
    """Start ``spec`` in a session (process group) of its own, output to ``log``; return once
    ``ready_path`` answers 200. SystemExit if the port is still taken, the server exits or is not
    up in ``timeout_s``."""
    for _ in range(60):  # a server stopped just before may still be shutting down
        if not answers(spec.port):
            break
        time.sleep(2)
    else:
        raise SystemExit(f"port {spec.port} still answers: stop that server first")
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(spec.cmd, env=spec.env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{spec.name}: server exited ({proc.returncode}); see {log}")
        if answers(spec.port, ready_path):
            return proc
        time.sleep(0.25)
    stop_server(proc)
    raise SystemExit(f"{spec.name}: server did not come up in {timeout_s:.0f} s; see {log}")


def stop_server(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGINT to the server, then SIGKILL to its whole process group (by the group's id: the server's)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def running(spec: ServerSpec, log: Path | str, **kwargs):
    """``with running(spec, log) as proc:`` the server is up inside, stopped after."""
    proc = start_server(spec, log, **kwargs)
    try:
        yield proc
    finally:
        stop_server(proc)


# In this process ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_serve(num_cpus: int | None = 2, address: str | None = None):
    """A Ray instance (``address``: an existing cluster instead) and Serve's HTTP proxy on a free
    loopback port, for ``serve.run`` in this process; yields the port. Ray's workers get the
    repository on their path (they import ``deployments``)."""
    import ray
    from ray import serve

    os.environ["PYTHONPATH"] = server_env()["PYTHONPATH"]
    ray.init(address=address or "local", num_cpus=None if address else num_cpus, include_dashboard=False,
             log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def process_tree_rss(root: int, include_root: bool = True) -> dict[str, float]:
    """RSS (MiB) of ``root`` (unless not ``include_root``) and every process below it, by command
    line (from /proc; Linux)."""
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    stack, out = [root] if include_root else list(children.get(root, [])), {}
    while stack:
        pid = stack.pop()
        stack += children.get(pid, [])
        try:
            name = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()[:70] or f"pid {pid}"
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            rss_kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
        except (OSError, StopIteration):
            continue
        out[name] = out.get(name, 0.0) + rss_kb / 1024
    return out
