"""Reliability scenarios against the Ray Serve app, each bounded in time and request count, on loopback::

    python benchmarks/reliability.py overload                # 10x the sustainable rate for 60 s
    python benchmarks/reliability.py streams_cut             # 100 streams cut at random points
    python benchmarks/reliability.py kill_controller kill_router
    python benchmarks/reliability.py multinode               # its own Ray cluster of 3 nodes
    python benchmarks/reliability.py soak --duration 1800    # steady ~70% load: RSS, files, pages flat

Each scenario deploys its own app (opt-tiny with random weights unless ``--model``), prints a table and
writes ``docs/benchmarks/reliability/<scenario>.json``. The scenarios, the outcomes per request
(completed / cut / rejected / failed / dropped / lost / bad_rejection) and the promises:
``apt_serve_ray/bench/reliability.py``. The fast variants run in CI (tests/serve/test_serve_reliability.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from pathlib import Path

from apt_serve_ray.bench import reliability as rel
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.servers import REPO, local_serve

OUT_DIR = REPO / "docs" / "benchmarks" / "reliability"
SCENARIOS = ("overload", "streams_cut", "kill_controller", "kill_router", "multinode", "soak")


def default_model() -> str:
    from apt_serve_ray.models.checkpoints import make_random_checkpoint

    return make_random_checkpoint(Path(tempfile.gettempdir()) / "apt-reliability" / "opt-tiny", "opt-tiny")


def run_scenario(name: str, args, model: str, port: int | None) -> dict:
    from ray import serve

    if name == "multinode":
        return rel.multinode(model, duration_s=args.duration or 30.0)
    overrides = {"num_routers": 2} if name == "kill_router" else {}
    target = rel.deploy(f"rel-{name.replace('_', '-')}", model, port, **overrides)
    try:
        if name == "overload":
            return asyncio.run(rel.overload(target, duration_s=args.duration or 60.0, factor=args.factor))
        if name == "streams_cut":
            return asyncio.run(rel.streams_cut(target, num_streams=args.num_streams))
        if name in ("kill_controller", "kill_router"):
            target.max_tokens = 256
            deployment = "Controller" if name == "kill_controller" else "Router"
            return asyncio.run(rel.kill_during_load(target, deployment, duration_s=args.duration or 20.0))
        rate = 0.7 * asyncio.run(rel.sustainable_rate(target))
        return asyncio.run(rel.soak(target, rate, args.duration or 1800.0))
    finally:
        serve.delete(target.app)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="+", choices=SCENARIOS)
    parser.add_argument("--model", help="model to serve (default: opt-tiny with random weights)")
    parser.add_argument("--duration", type=float, help="seconds of load (default per scenario)")
    parser.add_argument("--factor", type=float, default=10.0, help="overload: x the sustainable rate")
    parser.add_argument("--num-streams", type=int, default=100, help="streams_cut: streams to cut")
    parser.add_argument("--address", help="an existing Ray cluster (default: a local one)")
    parser.add_argument("--num-cpus", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    model = args.model or default_model()
    single_node = [s for s in args.scenarios if s != "multinode"]
    # multinode builds a cluster of its own: after the others, with their Ray instance shut down.
    order = single_node + [s for s in args.scenarios if s == "multinode"]
    for group in (single_node, order[len(single_node):]):
        if not group:
            continue
        with local_serve(args.num_cpus, args.address) if group is single_node else contextlib.nullcontext() as port:
            for name in group:
                started = time.monotonic()
                result = {"scenario": name, **run_scenario(name, args, model, port)}
                result["wall_s"] = round(time.monotonic() - started, 1)
                print(f"\n== {name}")
                for key, value in result.items():
                    if key != "samples":
                        print(f"  {key:<24} {value}")
                header = stamp(threads=1, dtype="auto", model=model, simulated=False, scenario=name)
                write_json(args.out_dir / f"{name}.json", result, header)


if __name__ == "__main__":
    main()
