"""Where a server's CPU time goes while it serves (issue 44, item 1): every process on this machine,
grouped by its role (our engine process, the engine replica, the router, the proxy, Serve's and
Ray's own processes, the benchmark client; vLLM's API server and engine core), sampled from
``/proc/<pid>/stat`` while something else drives the load, and which cores each role ran on.

    python benchmarks/serve_cpu.py --seconds 120 --json /tmp/serve_cpu.json &
    python benchmarks/mixed_traffic.py serve --servers ours ...   # or any load

Prints, per role, CPU seconds over the window and the share of one core, and the busiest cores;
``--json`` keeps it (with the machine header). Linux only.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from apt_serve_ray.bench.report import stamp, write_json

# (role, substring of the command line), first match wins.
ROLES = (
    ("engine process", "apt_serve_ray.engine.process"),
    ("engine replica", "ServeReplica:default:EngineReplica"),
    ("router", "ServeReplica:default:Router"),
    ("controller (ours)", "ServeReplica:default:Controller"),
    ("proxy", "ProxyActor"),
    ("serve controller", "ServeController"),
    ("vllm engine core", "VLLM::EngineCore"),
    ("vllm api server", "vllm-cli"),
    ("client", "benchmarks/"),
    ("ray gcs / raylet", "gcs_server"),
    ("ray gcs / raylet", "raylet"),
    ("ray dashboard / agents", "dashboard"),
    ("ray dashboard / agents", "Agent"),
    ("ray dashboard / agents", "log_monitor"),
    ("ray dashboard / agents", "monitor.py"),
    ("serve run", "serve run"),
)
TICK = os.sysconf("SC_CLK_TCK")


def snapshot() -> dict[int, tuple[str, float, int]]:
    """pid -> (role, CPU seconds so far, the core it last ran on)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        cpu_s = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
        text = f"{comm} {cmd}"
        role = next((r for r, key in ROLES if key in text), "other")
        out[int(pid)] = (role, cpu_s, int(fields[36]))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0, help="the window sampled")
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    first = last = snapshot()
    cores: dict[str, dict[int, int]] = {}
    start = time.monotonic()
    while time.monotonic() - start < args.seconds:
        time.sleep(args.interval)
        now = snapshot()
        for pid, (role, cpu_s, core) in now.items():
            if cpu_s - last.get(pid, (role, cpu_s))[1] > 0.05 * args.interval:  # busy in this interval
                cores.setdefault(role, {}).setdefault(core, 0)
                cores[role][core] += 1
        last = now
    wall = time.monotonic() - start
    used: dict[str, float] = {}
    for pid, (role, cpu_s, _) in last.items():
        used[role] = used.get(role, 0.0) + cpu_s - first.get(pid, (role, 0.0))[1]
    total = sum(used.values())
    rows = sorted(used.items(), key=lambda kv: -kv[1])
    print(f"{'role':24s} {'CPU s':>7s} {'cores':>6s}  busy on (samples per core)   window {wall:.0f} s, {os.cpu_count()} cores")
    for role, cpu_s in rows:
        if cpu_s < 0.01 * wall:
            continue
        print(f"{role:24s} {cpu_s:7.1f} {cpu_s / wall:6.2f}  {dict(sorted(cores.get(role, {}).items()))}")
    print(f"{'all':24s} {total:7.1f} {total / wall:6.2f}")
    if args.json:  # what served is not known here: the load's own JSON says it
        write_json(args.json, {"cpu_s": dict(rows), "cores": cores},
                   stamp(threads=None, dtype=None, model=None, simulated=False, seconds=wall))


if __name__ == "__main__":
    main()
