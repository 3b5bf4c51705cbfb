"""Traffic that repeats itself (issue 27): multi-turn conversations sharing system prompts, documents
asked several questions. Ours with and without prefix caching against vLLM's CPU build with and
without it, one server at a time, the same sessions at each rate.

    PEER=/path/to/vllm-peer python benchmarks/prefix_reuse.py serve \\
        --servers ours vllm ours-nopc vllm-nopc --rates 0.15 0.3 0.6 --dtype float32 \\
        --json docs/benchmarks/prefix/serve_fp32.json
    python benchmarks/prefix_reuse.py report --json docs/benchmarks/prefix/serve_fp32.json

The sessions (``bench/conversations.py``): ``--sessions`` of them a rate, Gamma arrivals (``--cv``) at
``--rates`` sessions a second; 75% conversations (3-8 turns, history re-sent every turn with the
replies' own token ids, think time exponential with mean ``--think-s``; users in ``--groups`` groups
sharing a 200-1,000-token system prompt; chat: TTFT 2 s, P99 gap 0.5 s, priority 0), 25% questions
about one of ``--documents`` documents of 800-1,400 tokens (TTFT 8 s, P99 gap 1 s, priority 10). Every
range and target is a flag of ``bench/conversations.py``'s spec; vary ``--seed`` rather than tune.

Servers: ``ours`` is ``serve run`` of the app as ``benchmarks/mixed_traffic.py`` starts it
(serve_config.yaml's scheduling, watermarks, kinds and tier, prefix caching on as shipped), told
each request's SLOs and priority; ``ours-nopc`` the same with ``enable_prefix_caching=false``;
``vllm`` vLLM CPU with its defaults (prefix caching on, FCFS) and ``--enable-prompt-tokens-details``
(to report cached tokens; changes nothing else); ``vllm-priority`` the same with
``--scheduling-policy priority``, told each request's priority (lower first, as ours); ``vllm-nopc``
with ``--no-enable-prefix-caching`` (a lab baseline: users run vLLM with it on). The same random-weight OPT-125m checkpoint, bytes of
cache (``--num-pages`` pages of 16 tokens; vLLM the same bytes in blocks of 32), 512-token step
budget, one compute thread each.

Measured at the client: TTFT and the P99 of each request's gaps between streamed chunks; SLO
attainment per class; goodput (requests meeting their SLOs a second); TTFT p50/p90 per class; the
prefix cache hit rate as the servers report it (``usage.prompt_tokens_details.cached_tokens`` over
prompt tokens); effective throughput (the highest rate at 90% attainment, interpolated).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from apt_serve_ray.bench.conversations import (ConversationSpec, Session, make_sessions, relabel,  # noqa: E402
                                             shared_token_share)
from apt_serve_ray.bench.slo_metrics import RequestTimeline, effective_throughput, p99_gap_ms, passes_slo, ttft_ms  # noqa: E402
from apt_serve_ray.bench.workloads import Uniform  # noqa: E402
from apt_serve_ray.worker.cpu_info import cpu_name, has_native_bf16  # noqa: E402

_REPO = Path(__file__).resolve().parents[1]


# The client ---------------------------------------------------------------------------------------
async def send(http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, s: Session,
               told: tuple[str, ...], t0: float, timeout: float) -> tuple[RequestTimeline, list[int], int | None]:
    """One streamed request; its timeline, the token ids it generated and the cached tokens reported."""
    body = {"model": "opt-125m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    if "priority" in told and s.service.priority:
        body["priority"] = s.service.priority
    if "slos" in told:
        body.update(ttft_slo_ms=s.service.ttft_slo_ms, tbt_slo_ms=s.service.tbt_slo_ms)
    t = RequestTimeline(s.session_id, time.perf_counter() - t0, None, [], None, len(prompt), 0,
                        ttft_slo_ms=s.service.ttft_slo_ms, tbt_slo_ms=s.service.tbt_slo_ms)
    ids: list[int] = []
    cached = None
    try:
        async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                t.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return t, ids, cached
            pending = b""
            async for chunk in resp.content.iter_any():
                now = time.perf_counter() - t0
                *events, pending = (pending + chunk).replace(b"\r\n", b"\n").split(b"\n\n")
                for event in events:
                    data = b"\n".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
                    if not data:
                        continue
                    if data == b"[DONE]":
                        t.finish_s = t.token_times_s[-1] if t.token_times_s else now
                        continue
                    payload = json.loads(data)
                    if "error" in payload:
                        t.error = str(payload["error"])
                        return t, ids, cached
                    new = [tok for c in payload.get("choices") or [] for tok in (c.get("token_ids") or [])]
                    if new:
                        ids.extend(new)
                        t.first_token_s = now if t.first_token_s is None else t.first_token_s
                        t.token_times_s.append(now)
                    usage = payload.get("usage") or {}
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        cached = details["cached_tokens"]
            if t.finish_s is None:
                t.error = "stream closed before [DONE]"
    except asyncio.TimeoutError:
        t.error = f"timeout after {timeout} s"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        t.error = f"{type(exc).__name__}: {exc}"
    t.num_output_tokens = len(ids)
    return t, ids, cached


async def run_sessions(sessions: list[Session], url: str, told: tuple[str, ...], timeout: float):
    """Every session on its timing, each turn after the previous reply and a think time. Returns one
    record per request: (session, turn, timeline, cached tokens), and the duration."""
    records = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        t0 = time.perf_counter()

        async def one(s: Session) -> None:
            await asyncio.sleep(max(0.0, s.start_s - (time.perf_counter() - t0)))
            history = list(s.prefix)
            for turn, (message, out) in enumerate(zip(s.messages, s.output_lens)):
                prompt = history + message
                t, ids, cached = await send(http, url, prompt, out, s, told, t0, timeout)
                records.append((s, turn, t, cached))
                if t.error is not None:
                    return  # the conversation ends here, as a user's would
                history = prompt + ids
                if turn < len(s.think_s):
                    await asyncio.sleep(s.think_s[turn])

        await asyncio.gather(*(one(s) for s in sessions))
        duration = time.perf_counter() - t0
    return records, duration


def analyze(records, duration_s: float) -> dict:
    def group(rows) -> dict:
        timelines = [t for _, _, t, _ in rows]
        ok = [passes_slo(t) for t in timelines]
        ttfts = [ttft_ms(t) for t in timelines if ttft_ms(t) is not None]
        prompt = sum(t.num_prompt_tokens for t in timelines)
        cached = [c for _, _, _, c in rows if c is not None]
        return {
            "num": len(rows), "met": int(sum(ok)), "attainment": float(np.mean(ok)) if ok else 0.0,
            "goodput": sum(ok) / duration_s, "errors": sum(t.error is not None for t in timelines),
            "ttft_p50_ms": float(np.percentile(ttfts, 50)) if ttfts else None,
            "ttft_p90_ms": float(np.percentile(ttfts, 90)) if ttfts else None,
            "ttft_misses": sum(1 for t in timelines if t.error is None and (ttft_ms(t) or 1e18) >= t.ttft_slo_ms),
            "gap_misses": sum(1 for t in timelines if t.is_finished and p99_gap_ms(t) >= t.tbt_slo_ms),
            "prompt_tokens": prompt,
            "cached_tokens": int(sum(cached)) if cached else None,
            "hit_rate": (sum(cached) / prompt) if cached and prompt else None,
        }

    out = {"duration_s": duration_s, "all": group(records)}
    for name in ("chat", "document"):
        rows = [r for r in records if r[0].service.name == name]
        if rows:
            out[name] = group(rows)
    later = [r for r in records if r[1] > 0]
    if later:
        out["later_turns"] = group(later)
    out["requests"] = [{"session": s.session_id, "turn": turn, "class": s.service.name,
                        "prompt": t.num_prompt_tokens, "cached": c, "ttft_ms": ttft_ms(t),
                        "p99_gap_ms": p99_gap_ms(t) if t.is_finished else None, "met": passes_slo(t),
                        "error": t.error} for s, turn, t, c in records]
    return out


# Servers -----------------------------------------------------------------------------------------
def server(name: str, args, ckpt: str, port: int):
    import mixed_traffic as mt

    if name in ("ours", "ours-nopc"):
        ns = argparse.Namespace(**{**vars(args), "ours_args": list(args.ours_args) + (
            ["enable_prefix_caching=false"] if name == "ours-nopc" else [])})
        return mt.server_command("ours", ns, ckpt, port)
    if name in ("vllm", "vllm-nopc", "vllm-priority"):
        extra = ["--enable-prompt-tokens-details"] + (["--no-enable-prefix-caching"] if name == "vllm-nopc" else [])
        ns = argparse.Namespace(**{**vars(args), "vllm_args": list(args.vllm_args) + extra})
        return mt.server_command("vllm-priority" if name == "vllm-priority" else "vllm", ns, ckpt, port)
    raise SystemExit(f"--servers: unknown {name!r}; valid: ours ours-nopc vllm vllm-nopc vllm-priority")


def spec_of(args) -> ConversationSpec:
    return ConversationSpec(num_sessions=args.sessions, chat_share=args.chat_share, num_groups=args.groups,
                            system_len=Uniform(*args.system_len), turns=Uniform(*args.turns), think_s=args.think_s,
                            num_documents=args.documents, max_model_len=args.max_model_len)


def run_serve(args, save=None) -> dict:
    """Every server in turn; ``save(data)`` after each run, so that what was measured survives a
    server that fails to start later."""
    import mixed_traffic as mt

    from apt_serve_ray.models.checkpoints import make_random_checkpoint

    ckpt = make_random_checkpoint(args.cache_dir / "opt-125m-bf16", "opt-125m", dtype="bfloat16")
    spec = spec_of(args)
    results, failed = {}, {}
    for name in args.servers:
        port = 8000 if name.startswith("ours") else args.vllm_port
        cmd, env, told = server(name, args, ckpt, port)
        log = Path(args.log_dir) / f"prefix_{name}.log"
        print(f"== {name}: starting ({' '.join(cmd[:3])} ...; log {log})", flush=True)
        try:
            proc = mt.start_server(cmd, env, port, log)
        except (RuntimeError, OSError, SystemExit) as exc:
            print(f"== {name}: did not start ({exc}); the other servers go on", flush=True)
            failed[name] = str(exc)
            continue
        results[name] = []
        url = f"http://127.0.0.1:{port}/v1/completions"
        try:
            warm = make_sessions(ConversationSpec(num_sessions=2, turns=Uniform(1, 1)), 100.0, seed=999_983)
            asyncio.run(run_sessions(warm, url, told, args.timeout))  # its own seed: nothing of the trace cached
            for seed in args.seeds:
                for rate in args.rates:
                    sessions = make_sessions(spec, rate, args.cv, seed)
                    if not args.same_tokens:  # no help from what the server cached at the rate before
                        sessions = relabel(sessions, seed * 1_000_003 + round(rate * 1000), spec.vocab_size)
                    records, duration = asyncio.run(run_sessions(sessions, url, told, args.timeout))
                    a = analyze(records, duration)
                    a.update(rate=rate, seed=seed, ideal_hit_rate=shared_token_share(sessions))
                    results[name].append(a)
                    print(row(name, a), flush=True)
                    if save is not None:
                        save({"results": results, "failed": failed})
                    if len(args.rates) > 1 or len(args.seeds) > 1:
                        time.sleep(args.idle_s)  # idle between rates: every conversation of the last has ended
        finally:
            mt.stop_server(proc)
    return {"results": results, "failed": failed}


# Simulated (a lab study: the real scheduler, pool and prefix cache on a cost model's clock) ----------
def run_sim(args) -> dict:
    """Every ``--variants`` entry (``name`` or ``name:key=value,...``, EngineConfig fields over the
    shipped scheduling: apt, hidden + kv-int8 under engine watermarks, a tier) on the same sessions,
    replayed on ``SimulatedEngine`` (its replies are one token id repeated: the history re-sent is
    still the conversation's own). No model, no HTTP, no controller: for comparing cache rules side by
    side in seconds, not for comparing with vLLM."""
    from apt_serve_ray.bench.simulator import OUTPUT_TOKEN_ID, CostModel, SimulatedEngine
    from apt_serve_ray.bench.slo_metrics import RequestTimeline as Timeline
    from apt_serve_ray.config import EngineConfig
    from apt_serve_ray.scheduler.costs import StepCosts

    spec = dataclasses.replace(spec_of(args), vocab_size=32_000)
    cost = CostModel(base_s=args.sim_cost[0], per_token_s=args.sim_cost[1], per_context_s=args.sim_cost[2],
                     prefill_pair_s=args.sim_cost[3], hidden_context_s=args.sim_cost[4])
    results = {}
    for variant in args.variants:
        name, _, options = variant.partition(":")
        overrides = {k: _value(v) for k, v in (kv.split("=", 1) for kv in options.split(",") if kv)}
        config = EngineConfig(**{**dict(policy="apt", cache_kinds=["hidden", "kv-int8"], cache_ratio=0.0,
                                        max_num_batched_tokens=args.max_num_batched_tokens,
                                        max_num_seqs=args.max_num_seqs, swap_space=4.0, enable_watermarks=True,
                                        max_hidden_ratio=0.7), **overrides})
        results[name] = []
        for seed in args.seeds:
            for rate in args.rates:
                sessions = make_sessions(spec, rate, args.cv, seed)
                sim = SimulatedEngine(config, num_pages=args.num_pages, cost=cost, max_model_len=args.max_model_len)
                if hasattr(sim.scheduler.policy, "set_costs"):  # as the engine calibrates them: rho, step times
                    sim.scheduler.policy.set_costs(StepCosts(rho=args.sim_rho, step_time=cost))
                records = _replay(sim, sessions, Timeline, OUTPUT_TOKEN_ID)
                a = analyze(records, sim.now)
                a.update(rate=rate, seed=seed, ideal_hit_rate=shared_token_share(sessions))
                results[name].append(a)
                print(row(name, a), flush=True)
    return {"results": results, "cost_model": dataclasses.asdict(cost)}


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _replay(sim, sessions: list[Session], Timeline, reply_token: int) -> list:
    """The sessions on the simulated clock: each turn arrives at its time (the first at the session's
    start, the next a think time after the previous reply), with the history re-sent."""
    pending = sorted(((s.start_s, s.session_id, s, 0, list(s.prefix)) for s in sessions), key=lambda e: e[:2])
    live, records = {}, []
    while pending or live:
        if not live and pending and pending[0][0] > sim.now:
            sim.now = pending[0][0]
        while pending and pending[0][0] <= sim.now:
            _, _, s, turn, history = pending.pop(0)
            prompt = history + s.messages[turn]
            r = sim.add(0, s.output_lens[turn], prompt_token_ids=prompt, ttft_slo_ms=s.service.ttft_slo_ms,
                        tbt_slo_ms=s.service.tbt_slo_ms, priority=s.service.priority)
            live[r.request_id] = (s, turn, prompt, r)
        sim.step()
        for rid in [rid for rid, (*_, r) in live.items() if r.is_finished]:
            s, turn, prompt, r = live.pop(rid)
            t = Timeline(rid, r.arrival_time, r.first_token_time, list(r.token_times), r.finish_time,
                         len(prompt), len(r.output_token_ids), ttft_slo_ms=s.service.ttft_slo_ms,
                         tbt_slo_ms=s.service.tbt_slo_ms)
            records.append((s, turn, t, r.num_cached_tokens or 0))
            if turn + 1 < s.num_turns:
                at = sim.now + s.think_s[turn]
                pending.append((at, s.session_id, s, turn + 1, prompt + [reply_token] * len(r.output_token_ids)))
                pending.sort(key=lambda e: e[:2])
    return records


# Report ------------------------------------------------------------------------------------------
def _fmt(x, pattern="{:.0f}"):
    return "-" if x is None else pattern.format(x)


def row(name: str, a: dict) -> str:
    al, ch, dc = a["all"], a.get("chat", {}), a.get("document", {})
    return (f"{name:10s} seed {a['seed']} rate {a['rate']:5.2f}  attainment {al['attainment']:6.1%} / "
            f"{ch.get('attainment', 0):6.1%} / {dc.get('attainment', 0):6.1%}  goodput {al['goodput']:.3f}  "
            f"TTFT p50/p90 chat {_fmt(ch.get('ttft_p50_ms'))}/{_fmt(ch.get('ttft_p90_ms'))} ms "
            f"doc {_fmt(dc.get('ttft_p50_ms'))}/{_fmt(dc.get('ttft_p90_ms'))} ms  "
            f"hit {_fmt(al.get('hit_rate'), '{:.1%}')} (ideal {a['ideal_hit_rate']:.1%})  "
            f"misses TTFT {al['ttft_misses']} gap {al['gap_misses']} errors {al['errors']}")


def effective(results: dict) -> dict:
    out = {}
    for name, runs in results.items():
        for seed in sorted({a["seed"] for a in runs}):
            pts = [(a["rate"], a["all"]["attainment"]) for a in runs if a["seed"] == seed]
            out.setdefault(name, {})[seed] = {f"{int(t * 100)}%": effective_throughput(pts, t) for t in (0.9, 0.6)}
    return out


def report(path: Path) -> str:
    data = json.loads(path.read_text())
    lines = [f"# {path.name}: {data.get('machine', {}).get('cpu', '?')}, dtype {data.get('args', {}).get('dtype')}"]
    for name, runs in data["results"].items():
        for a in runs:
            lines.append(row(name, a))
    lines.append("effective throughput (sessions/s at 90% / 60% attainment): " + json.dumps(effective(data["results"])))
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("serve", "sim", "report"))
    p.add_argument("--servers", nargs="+", default=["ours", "vllm", "ours-nopc", "vllm-nopc"])
    p.add_argument("--rates", nargs="+", type=float, default=[0.15, 0.3, 0.6], help="sessions a second")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--sessions", type=int, default=30)
    p.add_argument("--chat-share", type=float, default=0.75)
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--documents", type=int, default=3)
    p.add_argument("--system-len", nargs=2, type=int, default=[200, 1000])
    p.add_argument("--turns", nargs=2, type=int, default=[3, 8])
    p.add_argument("--think-s", type=float, default=5.0)
    p.add_argument("--cv", type=float, default=1.0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--num-pages", type=int, default=378, help="pages of 16 tokens (vLLM: the same bytes)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--ours-args", nargs="*", default=[])
    p.add_argument("--vllm-args", nargs="*", default=[])
    p.add_argument("--vllm-port", type=int, default=8100)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--idle-s", type=float, default=5.0)
    p.add_argument("--same-tokens", action="store_true",
                   help="serve: every rate sends the same token ids (one seed, one set of sessions re-timed), so "
                        "a rate finds what the rate before it left in the server's cache; by default each rate's "
                        "sessions are relabelled into tokens of their own (bench.conversations.relabel)")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "apt-serve-ray")
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--variants", nargs="+", default=["value", "lru:prefix_cache_retention=lru"],
                   help="sim: name[:EngineConfig field=value,...] each")
    # The step-time model the engine calibrated at start-up for random OPT-125m in fp32 on one thread
    # of the Intel Xeon (AMX) of 2026-12-04 (``StepCosts.step_time``; hidden: per token of hidden context).
    p.add_argument("--sim-cost", nargs=5, type=float, default=[0.031, 0.00104, 9.4e-6, 5.5e-7, 2.1e-6],
                   metavar=("BASE_S", "PER_TOKEN_S", "PER_CONTEXT_S", "PREFILL_PAIR_S", "HIDDEN_CONTEXT_S"),
                   help="sim: the step-time cost model")
    p.add_argument("--sim-rho", type=float, default=3.4e-5, help="sim: seconds a step per hidden page (calibrated as above)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.mode == "report":
        if args.json is None:
            raise SystemExit("report: --json PATH")
        print(report(args.json))
        return
    import mixed_traffic as mt

    meta = dict(machine={"cpu": cpu_name(), "native_bf16": has_native_bf16(), "python": platform.python_version()},
                git=mt.git_state(), command=" ".join(sys.argv),
                args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})

    def save(data: dict) -> None:
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({**data, **meta}, indent=1))

    data = run_sim(args) if args.mode == "sim" else run_serve(args, save)
    print("effective throughput (sessions/s at 90% / 60%):", json.dumps(effective(data["results"])))
    save(data)
    if args.json is not None:
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
