"""Wake-ups a second per process and per thread, from /proc: what preempts an engine's compute threads.

    python benchmarks/wakeups.py --seconds 10 --json docs/benchmarks/engine_speed/wakeups_idle_app.json

Every thread's context switches (``voluntary_ctxt_switches`` + ``nonvoluntary_ctxt_switches`` in
``/proc/PID/task/TID/status``) are read twice, ``--seconds`` apart. A voluntary switch is a thread going
to sleep, so each one is a wake-up to come (a timer, a poll, a message); a non-voluntary one is the thread
preempted. CPU time (``utime + stime``) comes from the same two reads. Processes are named by what Ray
calls them (``ray::ServeReplica:apt-serve:Router``, ``raylet``, ``gcs_server``) or their command line,
threads by their ``comm``; the table groups them by process, and the JSON keeps every thread.

Run it beside a server at rest (what it costs when nobody asks) or under load (one stream, saturated),
and compare the same run's processes with each other; absolute counts move with the machine. With
``--start`` it starts each server itself, one after the other (``peer_sweep.py``'s servers and flags:
``bare-serve`` is ``benchmarks/bare_serve.py``), takes the census at rest, then, with ``--saturate N``,
again while N streams of 384 -> 128 tokens run at once (the probe's saturated phase), and stops it:

    python benchmarks/wakeups.py --start bare-serve ours vllm --saturate 64 \
        --server-flags "--dtype bfloat16 --threads 2 --num-pages 378 --max-model-len 1024" \
        --json docs/benchmarks/engine_speed/wakeups_xeon.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_name(pid: int) -> str | None:
    """Ray's own name for its workers (``ray::...`` in argv[0]), else the command line's first words."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    words = [a.decode(errors="replace") for a in argv if a]
    if not words:
        return None  # a kernel thread
    if words[0].startswith("ray::"):
        return words[0].split(" ")[0]
    tail = [Path(words[0]).name] + [w if len(w) < 60 else Path(w).name for w in words[1:4]]
    return " ".join(tail)


def read_threads() -> dict[tuple[int, int], dict]:
    """{(pid, tid): {"switches", "involuntary", "cpu_s", "thread", "process"}} for every user thread."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        name = process_name(pid)
        if name is None:
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            base = f"/proc/{pid}/task/{tid}"
            try:
                status = Path(base + "/status").read_text()
                stat = Path(base + "/stat").read_text()
            except OSError:
                continue
            fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
            after_comm = stat.rsplit(")", 1)[1].split()
            out[(pid, int(tid))] = {
                "voluntary": int(fields.get("voluntary_ctxt_switches", 0)),
                "involuntary": int(fields.get("nonvoluntary_ctxt_switches", 0)),
                "cpu_s": (int(after_comm[11]) + int(after_comm[12])) / CLK_TCK,  # utime, stime
                "thread": fields.get("Name", "?").strip(), "process": name}
    return out


def census(seconds: float) -> dict:
    """Per thread and per process: wake-ups (voluntary switches) a second, preemptions a second, CPU share."""
    before = read_threads()
    t0 = time.monotonic()
    time.sleep(seconds)
    after = read_threads()
    span = time.monotonic() - t0
    threads = []
    for key, b in after.items():
        a = before.get(key)
        if a is None:
            continue  # born during the window: not counted
        threads.append({"pid": key[0], "tid": key[1], "process": b["process"], "thread": b["thread"],
                        "wakeups_per_s": (b["voluntary"] - a["voluntary"]) / span,
                        "preempted_per_s": (b["involuntary"] - a["involuntary"]) / span,
                        "cpu_share": (b["cpu_s"] - a["cpu_s"]) / span})
    processes = defaultdict(lambda: {"wakeups_per_s": 0.0, "preempted_per_s": 0.0, "cpu_share": 0.0, "threads": 0})
    for t in threads:
        p = processes[(t["pid"], t["process"])]
        for k in ("wakeups_per_s", "preempted_per_s", "cpu_share"):
            p[k] += t[k]
        p["threads"] += 1
    rows = [{"pid": pid, "process": name, **v} for (pid, name), v in processes.items()]
    rows.sort(key=lambda r: -r["wakeups_per_s"])
    threads.sort(key=lambda t: -t["wakeups_per_s"])
    threads = [t for t in threads if t["wakeups_per_s"] + t["preempted_per_s"] >= 5.0 or t["cpu_share"] >= 0.002]
    return {"seconds": span, "processes": rows, "threads": threads,  # threads: the ones that did something
            "total_wakeups_per_s": sum(r["wakeups_per_s"] for r in rows),
            "total_cpu_share": sum(r["cpu_share"] for r in rows)}


def print_census(result: dict, top_threads: int, min_rate: float) -> None:
    print(f"{'process':56s} {'pid':>7s} {'thr':>4s} {'wake/s':>8s} {'preempt/s':>9s} {'cpu':>6s}")
    for r in result["processes"]:
        if r["wakeups_per_s"] + r["preempted_per_s"] < min_rate:
            continue
        print(f"{r['process'][:56]:56s} {r['pid']:7d} {r['threads']:4d} {r['wakeups_per_s']:8.0f} "
              f"{r['preempted_per_s']:9.0f} {100 * r['cpu_share']:5.1f}%")
    print(f"{'all':56s} {'':7s} {'':4s} {result['total_wakeups_per_s']:8.0f} {'':9s} "
          f"{100 * result['total_cpu_share']:5.1f}%")
    if top_threads:
        print(f"\nbusiest threads (wake-ups a second)")
        for t in result["threads"][:top_threads]:
            print(f"  {t['wakeups_per_s']:7.0f}  {t['thread'][:24]:24s} {t['process'][:60]}")


def census_servers(names: list[str], server_flags: str, saturate: int, settle_s: float, seconds: float,
                   log_dir: Path) -> dict:
    """``{"<name>-idle": census, "<name>-saturated": census}`` for each server started in turn."""
    import asyncio
    import math
    import shlex
    import threading

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from apt_serve_ray.bench import servers, workloads
    from apt_serve_ray.bench.http_client import ClientOptions, first_model, replay, warm_up
    from benchmarks import peer_sweep

    runs = {}
    for name in names:
        if name == "bare-serve":
            spec = peer_sweep.bare_serve_spec()
        else:
            spec = peer_sweep.start_spec(peer_sweep.parse_args(
                ["--label", name, "--start", name, "--probe-only", *shlex.split(server_flags)]))
        with servers.running(spec, log_dir / f"wakeups_{name}.log"):
            time.sleep(settle_s)
            runs[f"{name}-idle"] = census(seconds)
            print(f"\n== {name}, at rest")
            print_census(runs[f"{name}-idle"], 0, 20.0)
            if saturate and name != "bare-serve":
                url = spec.base_url + "/v1/completions"
                model = asyncio.run(first_model(spec.base_url))
                asyncio.run(warm_up(url, model))
                trace = workloads.make_random_trace(saturate, math.inf, 384, 128, 0.1, seed=7, max_model_len=1024)
                trace = workloads.fresh_ids(trace, 49152, 7, 0.0, run=f"wakeups-{name}")
                load = threading.Thread(target=lambda: asyncio.run(
                    replay(trace, url, model, ClientOptions(timeout=900, max_concurrency=None), {})))
                load.start()
                time.sleep(settle_s)
                runs[f"{name}-saturated"] = census(seconds)
                print(f"\n== {name}, {saturate} streams at once")
                print_census(runs[f"{name}-saturated"], 0, 20.0)
                load.join()
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="the window between the two reads")
    ap.add_argument("--label", default="", help="what ran beside it (kept in the JSON)")
    ap.add_argument("--top-threads", type=int, default=20)
    ap.add_argument("--min-rate", type=float, default=5.0, help="leave out processes under this many switches a second")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--start", nargs="+", choices=("bare-serve", "ours", "vllm"), default=None,
                    help="start each server in turn and take its census (else: the machine as it is)")
    ap.add_argument("--server-flags", default="", help="--start: peer_sweep.py's flags for the servers, one string")
    ap.add_argument("--saturate", type=int, default=0, help="--start: also a census under this many streams at once")
    ap.add_argument("--settle", type=float, default=20.0, help="--start: seconds before each census")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp"), help="--start: the servers' logs")
    args = ap.parse_args(argv)
    if not args.seconds > 0:
        ap.error("--seconds must be > 0")
    if args.saturate < 0:
        ap.error("--saturate must be >= 0")
    if args.start:
        result = {"runs": census_servers(args.start, args.server_flags, args.saturate, args.settle, args.seconds,
                                         args.log_dir)}
    else:
        result = census(args.seconds)
        print_census(result, args.top_threads, args.min_rate)
    if args.json:  # imported after the census: the package's imports would be in its window
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from apt_serve_ray.bench.report import stamp, write_json

        write_json(args.json, {"label": args.label, **result},
                   stamp(threads=None, dtype=None, model=None, simulated=False, label=args.label))
        print(f"\nwritten {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
