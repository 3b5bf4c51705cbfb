"""The traffic Apt-Serve is for (issue 26, SPEC section 7): short chats beside long documents, bursty
arrivals, two service levels, memory that binds. Attainment per class, goodput, and why each miss.

    # the engine in-process, policies side by side on one trace (per-step explanation of every miss)
    python benchmarks/mixed_traffic.py engine --policies apt apt-kv sarathi --rates 0.25 0.4 0.6 \\
        --dtype float32 --json docs/benchmarks/mixed/engine_fp32.json

    # through HTTP: our Serve app as serve_config.yaml ships it, and vLLM's CPU build with its defaults
    PEER=/path/to/vllm-peer python benchmarks/mixed_traffic.py serve --servers ours ours-kv vllm vllm-priority \\
        --rates 0.25 0.4 0.6 --dtype float32 --json docs/benchmarks/mixed/serve_fp32.json

The trace (``bench/mixed_trace.py``, defaults as in issue 26): ``--num-requests`` requests a rate,
Gamma arrivals of coefficient of variation ``--cv`` (3: bursty); ``--chat-share`` of them chats (prompt
64-256 tokens, 32-128 out; TTFT 2 s, P99 gap 0.5 s, priority 0), the rest documents (900-1,500
prompt tokens, 64-128 out; TTFT 12 s, P99 gap 1 s, priority 10). Every length range and target is a
flag: vary them (and ``--seed``, ``--cv``) rather than tune to one trace. Outputs are fixed per request
(ignore EOS); token ids random. One trace per seed, re-timed for each rate (``with_rate``) and given token
ids of its own at every rate and seed (``fresh_token_ids``): a server or engine that ran the rate before
finds nothing of it cached.

Memory that binds: 378 pages of 16 tokens (6,048 KV tokens) for ours, 189 blocks of 32 for vLLM
(the same bytes); 512 batched tokens a step; one compute thread each (``--threads``); the same
random-weight OPT-125m checkpoint. ``--dtype`` float32 or bfloat16 (say which; on a CPU without native
bf16, bf16 runs several times slower).

Engine mode (``engine``): one in-process engine per policy (``bench/driver.replay``, the engine's own
token times), policies interleaved per rate. ``apt``: the adaptive policy as the app ships it (hidden
and kv-int8 kinds under a ceiling the engine's own watermarks move, 0.7 / 0.9, up to 0.7; 4 GiB
tier); ``apt-open``: the same as it was before issue 44 (admits whatever memory allows, no
reservation for the oldest, no request written off before it is late); ``apt-keeplate``: apt without
writing off the waiting requests predicted late; ``apt-notier``: apt without its tier (``swap_space`` 0); ``apt-kv``: the same policy with KV pages only; ``sarathi`` (vLLM v1's chunked prefill, FCFS),
``fcfs``, ``priority``. Every step is recorded (``driver.step_record``): each miss is explained by
the steps in the gap it broke (prefill tokens, decode rows, compressions, swaps, upgrades, measured
vs predicted seconds) or, for a late first token, the steps it waited through. The step-time model's
prediction against the measured step is tabled by step kind.

Serve mode (``serve``): one server at a time on this machine, each started here and stopped after its
rates. ``ours``: ``serve run`` of the app with serve_config.yaml's scheduling, watermarks, kinds and
tier, told each request's SLOs and priority in the body; ``ours-notier``: the same without the tier
below memory; ``ours-open``: apt's admission as before issue 44; ``ours-kv``: the same with KV pages only (no
compressed kind, watermarks off); ``vllm``: vLLM CPU (``$PEER``, see shared/tools/vllm-peer) with its
defaults (FCFS, prefix caching on), the same requests without SLOs or priority; ``vllm-priority``: with
``--scheduling-policy priority`` and the priority in the body. Gaps are measured at the client between
streamed chunks, as a user sees them.

Outputs: a table per rate (attainment all / chat / documents, goodput, TTFT and gap misses per
class, the longest gap per request), effective throughput at 90% and 60% per server or policy,
``--json`` (every request's outcome and miss cause, the machine, the command) and plots in
``--out-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from apt_serve_ray.bench.slo_metrics import (  # noqa: E402
    RequestTimeline,
    effective_throughput,
    inter_token_gaps_ms,
    p99_gap_ms,
    passes_slo,
    summarize,
    ttft_ms,
)
from apt_serve_ray.bench.mixed_trace import TrafficClass, make_mixed_trace  # noqa: E402
from apt_serve_ray.bench.workloads import ServiceClass, Uniform, WorkloadSpec, fill_token_ids, fresh_token_ids, with_rate  # noqa: E402
from apt_serve_ray.worker.cpu_info import cpu_name, has_native_bf16  # noqa: E402

_DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "apt-serve-ray"
_REPO = Path(__file__).resolve().parents[1]
VOCAB = 49152  # the SmolLM2 tokenizer the random checkpoints carry


# The trace ---------------------------------------------------------------------------------------
def _range(text: str) -> Uniform:
    low, _, high = text.partition(":")
    return Uniform(int(low), int(high or low))


def traffic_classes(args) -> tuple[TrafficClass, TrafficClass]:
    chat = TrafficClass(ServiceClass("chat", args.chat_share, args.chat_ttft_ms, args.chat_tbt_ms, args.chat_priority),
                        WorkloadSpec("chat", _range(args.chat_prompt), _range(args.chat_output)))
    doc = TrafficClass(ServiceClass("document", round(1.0 - args.chat_share, 6), args.doc_ttft_ms, args.doc_tbt_ms,
                                    args.doc_priority),
                       WorkloadSpec("document", _range(args.doc_prompt), _range(args.doc_output)))
    return chat, doc


def base_trace(args, seed: int):
    trace = make_mixed_trace(traffic_classes(args), args.num_requests, 1.0, cv=args.cv, seed=seed,
                             max_model_len=args.max_model_len)
    return fill_token_ids(trace, VOCAB, seed)


# Outcomes ----------------------------------------------------------------------------------------
def classify(t: RequestTimeline) -> str:
    """Why a request failed: "ok", "ttft", "gap", "ttft+gap" or "unfinished"."""
    if not t.is_finished:
        return "unfinished"
    late = t.ttft_slo_ms is not None and (ttft_ms(t) or 0.0) >= t.ttft_slo_ms
    gap = t.tbt_slo_ms is not None and p99_gap_ms(t) >= t.tbt_slo_ms
    return {(False, False): "ok", (True, False): "ttft", (False, True): "gap"}.get((late, gap), "ttft+gap")


def _longest_gap(t: RequestTimeline) -> tuple[float, float, float]:
    """(gap ms, start, end) of the request's longest inter-token gap (0, 0, 0 without one)."""
    times = np.asarray(t.token_times_s, dtype=float)
    if times.size < 2:
        return 0.0, 0.0, 0.0
    i = int(np.argmax(np.diff(times)))
    return float((times[i + 1] - times[i]) * 1000.0), float(times[i]), float(times[i + 1])


def explain(t: RequestTimeline, steps: list[dict], start_s: float) -> dict | None:
    """The steps behind a miss: for a broken gap, those that ended within the request's longest gap
    (the request waited through all but the last); for a late first token, those between its
    arrival and its first token. Their composition and measured vs predicted seconds."""
    why = classify(t)
    if why in ("ok",) or not steps:
        return None
    if "gap" in why:
        _, lo, hi = _longest_gap(t)
    else:
        lo = t.arrival_s
        hi = t.first_token_s if t.first_token_s is not None else lo + 1e9
    lo, hi = lo - start_s, hi - start_s
    inside = [s for s in steps if lo < s["end_s"] <= hi + 0.002]
    if not inside:
        return None
    longest = max(inside, key=lambda s: s["step_s"])
    return {
        "window_s": round(hi - lo, 4), "num_steps": len(inside),
        "prefill_tokens": sum(s["prefill_tokens"] for s in inside),
        "max_decodes": max(s["decodes"] for s in inside),
        "compressions": sum(s["compressions"] for s in inside), "upgrades": sum(s["upgrades"] for s in inside),
        "swap_outs": sum(s["swap_outs"] for s in inside), "swap_ins": sum(s["swap_ins"] for s in inside),
        "preemptions": sum(s["preemptions"] for s in inside),
        "longest_step": {k: longest[k] for k in ("step_s", "predicted_s", "decodes", "prefill_tokens",
                                                  "compressions", "upgrades", "swap_ins", "swap_outs")},
    }


def analyze(timelines: list[RequestTimeline], classes: dict[str, str], duration_s: float,
            steps: list[dict] | None = None, start_s: float = 0.0) -> dict:
    """Attainment, goodput and misses, over all requests and per class (``classes``: id -> class).
    ``goodput``: requests that passed per second of the run; ``goodput_arrivals``: per second of the
    arrival window (first to last arrival), the same for every server on one trace, so that a server
    that drains its backlog sooner does not look better for it."""
    arrivals = [t.arrival_s for t in timelines]
    window = max(arrivals) - min(arrivals) if len(arrivals) > 1 else duration_s
    out = {"all": _group(timelines, duration_s, window)}
    for name in sorted(set(classes.values())):
        out[name] = _group([t for t in timelines if classes[t.request_id] == name], duration_s, window)
    out["summary"] = summarize(timelines, duration_s)
    out["requests"] = [_request(t, classes[t.request_id], steps, start_s) for t in timelines]
    return out


def _group(timelines: list[RequestTimeline], duration_s: float, window_s: float) -> dict:
    causes = [classify(t) for t in timelines]
    longest = [_longest_gap(t)[0] for t in timelines if t.is_finished and len(t.token_times_s) > 1]
    return {
        "num": len(timelines), "attainment": sum(map(passes_slo, timelines)) / max(1, len(timelines)),
        "goodput": sum(map(passes_slo, timelines)) / duration_s,
        "goodput_arrivals": sum(map(passes_slo, timelines)) / max(window_s, 1e-9),
        "ttft_misses": sum("ttft" in c for c in causes), "gap_misses": sum("gap" in c for c in causes),
        "unfinished": causes.count("unfinished"),
        "median_longest_gap_ms": float(np.median(longest)) if longest else 0.0,
        "median_ttft_ms": float(np.median([ttft_ms(t) for t in timelines if t.first_token_s is not None] or [0.0])),
    }


def _request(t: RequestTimeline, cls: str, steps, start_s) -> dict:
    gaps = inter_token_gaps_ms(t)
    rec = {"id": t.request_id, "class": cls, "arrival_s": round(t.arrival_s - start_s, 4), "outcome": classify(t),
           "ttft_ms": None if t.first_token_s is None else round(ttft_ms(t), 1),
           "p99_gap_ms": round(p99_gap_ms(t), 1) if gaps else None,
           "max_gap_ms": round(max(gaps), 1) if gaps else None, "num_chunks": len(t.token_times_s),
           "num_output_tokens": t.num_output_tokens, "prompt_len": t.num_prompt_tokens,
           "preemptions": t.num_preemptions, "error": t.error}
    if steps:
        rec["why"] = explain(t, steps, start_s)
    return rec


def prediction_table(steps: list[dict]) -> dict:
    """Measured / predicted step seconds by kind of step (decode-only, prefill-only, mixed)."""
    rows = {}
    for kind, keep in (("decode", lambda s: s["prefill_tokens"] == 0),
                       ("prefill", lambda s: s["decodes"] == 0 and s["prefill_tokens"] > 0),
                       ("mixed", lambda s: s["decodes"] > 0 and s["prefill_tokens"] > 0)):
        sel = [s for s in steps if keep(s) and s["predicted_s"]]
        if not sel:
            continue
        ratio = np.array([s["step_s"] / s["predicted_s"] for s in sel])
        rows[kind] = {"num": len(sel), "median_ratio": float(np.median(ratio)),
                      "p10_ratio": float(np.percentile(ratio, 10)), "p90_ratio": float(np.percentile(ratio, 90)),
                      "median_s": float(np.median([s["step_s"] for s in sel]))}
    return rows


# Engine mode -------------------------------------------------------------------------------------
def engine_options(name: str, args) -> dict:
    """EngineConfig fields per policy name (see the module docstring)."""
    common = dict(num_pages=args.num_pages, max_model_len=args.max_model_len, dtype=args.dtype,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                  num_threads=args.threads)
    if name == "apt":
        return dict(common, policy="apt", cache_kinds=("hidden", "kv-int8"), enable_watermarks=True,
                    light_watermark=0.7, heavy_watermark=0.9, max_hidden_ratio=0.7, swap_space=4.0)
    if name == "apt-open":  # apt as it was before issue 44: admits whatever memory allows, no reservation
        return dict(engine_options("apt", args), policy_options={"admission_share": None, "reserve_after": None,
                                                                 "write_off_late": False})
    if name == "apt-keeplate":  # apt without writing off the waiting requests predicted late
        return dict(engine_options("apt", args), policy_options={"write_off_late": False})
    if name == "apt-notier":  # apt without the tier below memory: preempted requests are recomputed
        return dict(engine_options("apt", args), swap_space=0.0)
    if name == "apt-kv":
        return dict(common, policy="apt", cache_ratio=0.0, enable_hybrid_cache=False, swap_space=4.0)
    if name in ("sarathi", "fcfs", "priority"):
        return dict(common, policy=name, cache_ratio=0.0, enable_hybrid_cache=False, calibrate_rho=False,
                    swap_space=0.0)
    raise SystemExit(f"--policies: unknown {name!r}; valid: apt apt-open apt-keeplate apt-notier apt-kv sarathi fcfs priority")


def run_engine(args) -> dict:
    from apt_serve_ray import LLM
    from apt_serve_ray.bench.driver import replay
    from apt_serve_ray.models.checkpoints import make_random_checkpoint

    path = make_random_checkpoint(args.cache_dir / "opt-125m-bf16", "opt-125m", dtype="bfloat16")
    engines = {name: LLM(path, **engine_options(name, args)) for name in args.policies}
    results = {name: [] for name in args.policies}
    calib = {}
    for name, llm in engines.items():
        costs = getattr(llm.llm_engine.scheduler.policy, "costs", None)
        if costs is not None and costs.step_time is not None:
            st = costs.step_time
            calib[name] = {"a": st.a, "b": st.b, "c": st.c, "d": getattr(st, "d", 0.0), "r2": st.r2,
                           "points": [list(p) for p in st.points]}
    for seed in args.seeds:
        base = base_trace(args, seed)
        classes = {r.request_id: r.service_class for r in base}
        for k, rate in enumerate(args.rates):
            trace = fresh_token_ids(with_rate(base, rate, cv=args.cv, seed=seed), VOCAB, seed, rate)
            order = args.policies[k % len(args.policies):] + args.policies[: k % len(args.policies)]
            for name in order:
                res = replay(engines[name], trace, progress=not args.quiet, desc=f"{name} {rate}",
                             run_id=f"{name}-{seed}-{rate}", timeout_s=args.timeout)
                ids = {t.request_id: classes[t.request_id.split("/", 1)[1]] for t in res.timelines}
                a = analyze(res.timelines, ids, res.duration_s, res.steps, res.start_s)
                a.update(rate=rate, seed=seed, num_preemptions=res.num_preemptions, num_steps=len(res.steps),
                         prediction=prediction_table(res.steps), peak_pages=res.peak_pages,
                         preempt_causes=res.preempt_causes)
                if args.keep_steps:
                    a["steps"] = res.steps
                results[name].append(a)
                print(row(name, a), flush=True)
    return {"results": results, "calibration": calib}


# Serve mode --------------------------------------------------------------------------------------
def server_command(name: str, args, ckpt: str, port: int) -> tuple[list[str], dict, tuple[str, ...]]:
    """(command, environment, request fields told) of one server."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false")
    if name == "ours-open":  # ours with apt's admission as before issue 44 (no promise, no reservation)
        cmd, env, told = server_command("ours", args, ckpt, port)
        return cmd + ['policy_options={"admission_share": null, "reserve_after": null, "write_off_late": false}'], env, told
    if name == "ours-notier":  # ours without the tier below memory (swap_space 0)
        cmd, env, told = server_command("ours", args, ckpt, port)
        return [a for a in cmd if a != "swap_space=4"] + ["swap_space=0"], env, told
    if name in ("ours", "ours-kv"):
        # serve_config.yaml's scheduling, watermarks, kinds and tier; the checkpoint and sizes of the run.
        kinds = "[hidden,kv-int8]" if name == "ours" else "[]"
        marks = ("light_watermark=0.7", "heavy_watermark=0.9") if name == "ours" else (
            "light_watermark=1.0", "heavy_watermark=1.0")
        cmd = [str(_REPO / ".venv/bin/serve"), "run", "deployments.app:build_app", f"model={ckpt}",
               "served_model_name=opt-125m", f"dtype={args.dtype}", f"num_threads={args.threads}",
               f"num_pages={args.num_pages}", f"max_model_len={args.max_model_len}",
               f"max_num_seqs={args.max_num_seqs}", f"max_num_batched_tokens={args.max_num_batched_tokens}",
               "policy=apt", f"cache_kinds={kinds}", *marks, "max_hidden_ratio=0.7", "swap_space=4",
               *args.ours_args]
        env["PYTHONPATH"] = str(_REPO)
        return cmd, env, ("priority", "slos")
    if name in ("vllm", "vllm-priority"):
        peer = os.environ.get("PEER")
        if not peer:
            raise SystemExit("serve: set PEER to the folder with vLLM's venv and vllm-cli (shared/tools/vllm-peer)")
        binds = "0" if args.threads == 1 else f"0-{args.threads - 1}"
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=binds)
        cmd = [f"{peer}/venv/bin/python", f"{peer}/vllm-cli", "serve", ckpt, "--served-model-name", "opt-125m",
               "--max-model-len", str(args.max_model_len), "--dtype", args.dtype, "--block-size", "32",
               "--num-gpu-blocks-override", str(args.num_pages * 16 // 32), "--max-num-batched-tokens",
               str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs), "--port", str(port)]
        if name == "vllm-priority":
            cmd += ["--scheduling-policy", "priority"]
        return cmd + args.vllm_args, env, (("priority",) if name == "vllm-priority" else ())
    raise SystemExit(f"--servers: unknown {name!r}; valid: ours ours-open ours-notier ours-kv vllm vllm-priority")


def _up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def start_server(cmd: list[str], env: dict, port: int, log: Path, timeout_s: float = 400.0) -> subprocess.Popen:
    for _ in range(60):  # a server stopped just before may still be shutting down
        if not _up(port):
            break
        time.sleep(2)
    else:
        raise SystemExit(f"port {port} still answers: stop that server first")
    proc = subprocess.Popen(cmd, env=env, cwd=_REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}); see {log}")
        if _up(port):
            return proc
        time.sleep(2)
    stop_server(proc)
    raise SystemExit(f"server did not come up in {timeout_s:.0f} s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT to the server (``serve run`` shuts Serve and Ray down on it), then its whole group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def server_steps(port: int, origin: float, duration_s: float) -> list[dict] | None:
    """Our server's steps during a run, from its memory timeline (one sample per step, at most one
    per 0.1 s: the long steps, which explain gaps, are all there), as engine-mode step records with
    ``end_s`` on the client's clock (both read CLOCK_MONOTONIC)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/debug/memory_timeline?format=json",
                                    timeout=60) as resp:
            series = json.loads(resp.read())["series"]
    except (OSError, ValueError, KeyError):
        return None
    keys = [k for k in ("step_s", "predicted_s", "decodes", "prefill_tokens", "seqs", "upgrades", "compressions",
                        "swap_outs", "swap_ins", "preemptions", "running", "waiting", "usage", "cache_ratio")
            if k in series]
    if "clock" not in series or "step_s" not in keys:
        return None
    steps = []
    for i, clock in enumerate(series["clock"]):
        end = clock - origin
        if 0.0 <= end <= duration_s + 1.0:
            steps.append({"end_s": round(end, 6), **{k: series[k][i] for k in keys}})
    return steps


def run_serve(args) -> dict:
    from online_client import replay as http_replay

    from apt_serve_ray.models.checkpoints import make_random_checkpoint

    ckpt = make_random_checkpoint(args.cache_dir / "opt-125m-bf16", "opt-125m", dtype="bfloat16")
    results = {}
    for name in args.servers:
        port = 8000 if name.startswith("ours") else args.vllm_port  # serve run listens on 8000
        cmd, env, told = server_command(name, args, ckpt, port)
        log = Path(args.log_dir) / f"mixed_{name}.log"
        print(f"== {name}: starting ({' '.join(cmd[:3])} ...; log {log})", flush=True)
        proc = start_server(cmd, env, port, log)
        results[name] = []
        try:
            client = argparse.Namespace(ignore_eos=True, timeout=args.timeout, max_concurrency=None,
                                        disable_tqdm=args.quiet, request_fields=told)
            url = f"http://127.0.0.1:{port}/v1/completions"
            # Warm-up prompts of their own seed: none of the trace's prompts may sit in a prefix cache.
            warm = [dataclasses.replace(r, arrival_s=0.0, output_len=4) for r in base_trace(args, 999_983)[:2]]
            asyncio.run(http_replay(warm, url, "opt-125m", client, {}))
            for seed in args.seeds:
                base = base_trace(args, seed)
                classes = {r.request_id: r.service_class for r in base}
                for rate in args.rates:
                    trace = fresh_token_ids(with_rate(base, rate, cv=args.cv, seed=seed), VOCAB, seed, rate)
                    origin = []
                    timelines, duration = asyncio.run(http_replay(trace, url, "opt-125m", client, {},
                                                                  on_start=origin.append))
                    steps = server_steps(port, origin[0], duration) if name.startswith("ours") else None
                    a = analyze(timelines, classes, duration, steps)
                    a.update(rate=rate, seed=seed)
                    if steps:
                        a["prediction"] = prediction_table(steps)
                        if args.keep_steps:
                            a["steps"] = steps
                    results[name].append(a)
                    print(row(name, a), flush=True)
        finally:
            stop_server(proc)
    return {"results": results}


# Report ------------------------------------------------------------------------------------------
def row(name: str, a: dict) -> str:
    al, ch, dc = a["all"], a.get("chat", {}), a.get("document", {})
    return (f"{name:14s} seed {a['seed']} rate {a['rate']:5.2f}  attainment {al['attainment']:6.1%} / "
            f"{ch.get('attainment', 0):6.1%} / {dc.get('attainment', 0):6.1%}  goodput {al['goodput']:.3f}  "
            f"TTFT misses {ch.get('ttft_misses', 0)}/{ch.get('num', 0)} {dc.get('ttft_misses', 0)}/{dc.get('num', 0)}  "
            f"gap misses {ch.get('gap_misses', 0)} {dc.get('gap_misses', 0)}  longest gap "
            f"{ch.get('median_longest_gap_ms', 0) / 1000:.2f} / {dc.get('median_longest_gap_ms', 0) / 1000:.2f} s")


def effective(results: dict) -> dict:
    """Effective throughput at 90% and 60% per name and class (attainment averaged over seeds)."""
    out = {}
    for name, runs in results.items():
        out[name] = {}
        for group in ("all", "chat", "document"):
            by_rate = {}
            for a in runs:
                by_rate.setdefault(a["rate"], []).append(a[group]["attainment"])
            points = [(r, float(np.mean(v))) for r, v in sorted(by_rate.items())]
            out[name][group] = {str(t): effective_throughput(points, t / 100) for t in (90, 60)}
    return out


def plot(results: dict, out_dir: Path, tag: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    for ax, group in zip(axes, ("all", "chat", "document")):
        for name, runs in results.items():
            by_rate = {}
            for a in runs:
                by_rate.setdefault(a["rate"], []).append(a[group]["attainment"])
            rates = sorted(by_rate)
            ax.plot(rates, [100 * np.mean(by_rate[r]) for r in rates], marker="o", label=name)
        ax.set_title(f"{group}: SLO attainment")
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("% of requests")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / f"attainment{tag}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]


def report(path: Path, baseline: str | None) -> str:
    """Markdown tables of every run in the JSON at ``path``: per rate, each server or policy's
    attainment (all / chat / documents), goodput (and its ratio to ``baseline``'s), misses by cause
    and class, and the median longest gap per class; then effective throughput; then how well the
    step-time model predicted ours (measured / predicted, by kind of step)."""
    doc = json.loads(path.read_text())
    runs = doc["runs"]
    names = list(runs)
    base = next((n for n in names if baseline and n.split(":", 1)[1] == baseline), None)
    rows = {}
    for name in names:
        for a in runs[name]["results"]:
            rows.setdefault((a["seed"], a["rate"]), {})[name] = a
    lines = ["| seed | rate | server | attainment all / chat / documents | goodput (req/s) | TTFT misses chat / doc "
             "| gap misses chat / doc | longest gap chat / doc (median, s) |", "|---|---|---|---|---|---|---|---|"]
    for (seed, rate), by in sorted(rows.items()):
        ref = by.get(base)
        for name in names:
            a = by.get(name)
            if a is None:
                continue
            al, ch, dc = a["all"], a["chat"], a["document"]
            ratio = (f" ({al['goodput'] / ref['all']['goodput']:.2f}x)" if ref is not None and name != base
                     and ref["all"]["goodput"] > 0 else "")
            lines.append(f"| {seed} | {rate:g} | {name.split(':', 1)[1]} | {al['attainment']:.1%} / {ch['attainment']:.1%} / "
                         f"{dc['attainment']:.1%} | {al['goodput']:.3f}{ratio} | {ch['ttft_misses']}/{ch['num']} / "
                         f"{dc['ttft_misses']}/{dc['num']} | {ch['gap_misses']} / {dc['gap_misses']} | "
                         f"{ch['median_longest_gap_ms'] / 1000:.2f} / {dc['median_longest_gap_ms'] / 1000:.2f} |")
    # Over seeds: each class's attainment, mean and range, and goodput over the arrival window against
    # the baseline's on the same seed (the ratio's mean and range).
    seeds = sorted({seed for seed, _ in rows})
    if len(seeds) > 1:
        lines += ["", f"Over seeds {', '.join(map(str, seeds))}: attainment mean (min-max), goodput over the arrival "
                  f"window as a ratio to {baseline or 'the baseline'} on the same seed, mean (min-max)", "",
                  "| rate | server | all | chat | documents | goodput ratio |", "|---|---|---|---|---|---|"]
        spread = lambda v: f"{np.mean(v):.1%} ({min(v):.0%}-{max(v):.0%})"  # noqa: E731
        for rate in sorted({r for _, r in rows}):
            for name in names:
                runs_at = [rows[(seed, rate)][name] for seed in seeds if name in rows.get((seed, rate), {})]
                if not runs_at:
                    continue
                cells = [spread([a[g]["attainment"] for a in runs_at]) for g in ("all", "chat", "document")]
                ratios = []
                for seed in seeds:
                    by = rows.get((seed, rate), {})
                    if name in by and base in by and name != base:
                        key = "goodput_arrivals" if "goodput_arrivals" in by[base]["all"] else "goodput"
                        ref = by[base]["all"][key]
                        if ref > 0:
                            ratios.append(by[name]["all"][key] / ref)
                ratio = f"{np.mean(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
                lines.append(f"| {rate:g} | {name.split(':', 1)[1]} | " + " | ".join(cells) + f" | {ratio} |")
    lines += ["", "| server | effective throughput at 90% / 60%: all | chat | documents (req/s) |", "|---|---|"]
    for name in names:
        e = runs[name]["effective_throughput"]
        lines.append(f"| {name.split(':', 1)[1]} | " + " \\| ".join(
            f"{e[g]['90']:.3f} / {e[g]['60']:.3f}" for g in ("all", "chat", "document")) + " |")
    pred = [(name, a["rate"], a["prediction"]) for name in names for a in runs[name]["results"] if a.get("prediction")]
    if pred:
        lines += ["", "| server | rate | decode steps: n, measured / predicted median, P90 | prefill | mixed |",
                  "|---|---|---|---|---|"]
        for name, rate, p in pred:
            cell = lambda k: (f"{p[k]['num']}, {p[k]['median_ratio']:.2f}, {p[k]['p90_ratio']:.2f}"  # noqa: E731
                              if k in p else "-")
            lines.append(f"| {name.split(':', 1)[1]} | {rate:g} | {cell('decode')} | {cell('prefill')} | {cell('mixed')} |")
    machines = {json.dumps(runs[n]["machine"], sort_keys=True) for n in names}
    lines += ["", "Machine(s): " + "; ".join(machines)]
    return "\n".join(lines)


def machine() -> dict:
    return {"cpu": cpu_name(), "native_bf16": has_native_bf16(), "num_cpus": os.cpu_count(),
            "python": platform.python_version()}


def git_state() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_REPO, capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_REPO,
                               capture_output=True, text=True).stdout
        return head.strip() + ("+dirty" if dirty.strip() else "")
    except OSError:
        return "unknown"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("engine", "serve", "report"),
                   help="report: print the tables of --json (with --baseline, goodput ratios against it)")
    p.add_argument("--baseline", default="vllm", help="report: the server goodput ratios are against")
    p.add_argument("--policies", nargs="+", default=["apt", "apt-kv", "sarathi"], help="engine mode")
    p.add_argument("--servers", nargs="+", default=["ours", "vllm"], help="serve mode")
    p.add_argument("--rates", nargs="+", type=float, default=[0.25, 0.4, 0.6])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--cv", type=float, default=3.0)
    p.add_argument("--chat-share", type=float, default=0.7)
    p.add_argument("--chat-prompt", default="64:256", help="LOW:HIGH tokens, uniform")
    p.add_argument("--chat-output", default="32:128")
    p.add_argument("--chat-ttft-ms", type=float, default=2000)
    p.add_argument("--chat-tbt-ms", type=float, default=500)
    p.add_argument("--chat-priority", type=int, default=0)
    p.add_argument("--doc-prompt", default="900:1500")
    p.add_argument("--doc-output", default="64:128")
    p.add_argument("--doc-ttft-ms", type=float, default=12000)
    p.add_argument("--doc-tbt-ms", type=float, default=1000)
    p.add_argument("--doc-priority", type=int, default=10)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--num-pages", type=int, default=378, help="16-token pages (vLLM: half as many 32-token blocks)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds after the last arrival (engine) / per request")
    p.add_argument("--vllm-port", type=int, default=8100, help="ours listens on 8000 (serve run's port)")
    p.add_argument("--ours-args", nargs="*", default=[], help="extra key=value arguments for `serve run`")
    p.add_argument("--vllm-args", nargs="*", default=[], help="extra vLLM server flags")
    p.add_argument("--cache-dir", type=Path, default=_DEFAULT_CACHE)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--json", type=Path, default=None, help="merged into if it exists (one key per name)")
    p.add_argument("--out-dir", type=Path, default=None, help="plots")
    p.add_argument("--tag", default="")
    p.add_argument("--keep-steps", action="store_true", help="every step record in the JSON (engine mode)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if not 0 < args.chat_share < 1:
        p.error("--chat-share: must be in (0, 1)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.mode == "report":
        if args.json is None or not args.json.exists():
            raise SystemExit("report: --json must name a results file")
        print(report(args.json, args.baseline))
        if args.out_dir:
            runs = json.loads(args.json.read_text())["runs"]
            args.out_dir.mkdir(parents=True, exist_ok=True)
            print("plots:", *plot({k.split(":", 1)[1]: v["results"] for k, v in runs.items()}, args.out_dir, args.tag))
        return
    started, code = time.strftime("%Y-%m-%d %H:%M:%S"), git_state()  # the code that runs: at the start
    out = run_engine(args) if args.mode == "engine" else run_serve(args)
    eff = effective(out["results"])
    print("\neffective throughput (req/s) at 90% / 60% attainment: all | chat | documents")
    for name, e in eff.items():
        print(f"  {name:14s} " + " | ".join(f"{e[g]['90']:.3f} / {e[g]['60']:.3f}" for g in ("all", "chat", "document")))
    if args.json:
        doc = json.loads(args.json.read_text()) if args.json.exists() else {}
        doc.setdefault("runs", {})
        for name, runs in out["results"].items():
            doc["runs"][f"{args.mode}:{name}"] = {
                "results": runs, "effective_throughput": eff[name], "started": started, "git": code,
                "machine": machine(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "calibration": out.get("calibration", {}).get(name),
            }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"written: {args.json}")
    if args.out_dir:  # every server or policy in the JSON (earlier runs too), else this run's
        results = ({k.split(":", 1)[1]: v["results"] for k, v in doc["runs"].items() if k.startswith(args.mode + ":")}
                   if args.json else out["results"])
        args.out_dir.mkdir(parents=True, exist_ok=True)
        print("plots:", *plot(results, args.out_dir, args.tag))


if __name__ == "__main__":
    main()
