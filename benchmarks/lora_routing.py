"""LoRA adapters across replicas (issue 43): the seed's mixed traffic (chats and documents, two service levels,
bursty arrivals) with each request naming one of ``--adapters`` adapters, on ``--num-replicas`` engine replicas
of ``--max-loras`` slots each, with and without adapter-aware routing, through Serve over HTTP.

    python benchmarks/lora_routing.py --rates 0.3 0.5 --seeds 0 1 --dtype bfloat16 \\
        --json docs/benchmarks/lora_routing.json

Arms (one server start each, their order turned at every seed):

* ``affinity``: the app as it ships (``adapter_affinity: true``): a request goes to a replica holding its
  adapter, else to one with a slot to spare;
* ``no-affinity``: ``adapter_affinity: false``: replicas are chosen by fit, load and prefix alone, and each
  loads what its requests name (a request whose adapter finds every slot held waits for one);
* ``base``: the same server as ``affinity``, its requests naming the base model: what the adapters cost.

The model is a random OPT-125m checkpoint; the adapters are random rank-``--rank`` PEFT adapters on q and v
(PEFT's default), one per name, written to a temporary folder. Every (seed, rate) run gets token ids of its
own and each request an adapter drawn uniformly at random (the same draw for every arm). The trace's flags
are ``benchmarks/mixed_traffic.py``'s (any flag this script does not know goes there). Reported: attainment
per class, goodput and effective throughput, as mixed_traffic.py reports them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mixed_traffic as mixed  # noqa: E402

from apt_serve_ray.bench import servers  # noqa: E402
from apt_serve_ray.bench.adapters import write_random_adapter  # noqa: E402
from apt_serve_ray.bench.engine_args import engine_kwargs, random_checkpoint  # noqa: E402
from apt_serve_ray.bench.http_client import ClientOptions, replay  # noqa: E402
from apt_serve_ray.bench.misses import analyze  # noqa: E402
from apt_serve_ray.bench.report import stamp, write_json  # noqa: E402
from apt_serve_ray.bench.workloads import fresh_ids, with_rate  # noqa: E402

ARMS = ("affinity", "no-affinity", "base")
MODEL = "opt-125m"


def server(arm: str, args, adapters: dict[str, str]) -> servers.ServerSpec:
    engine = {**engine_kwargs(args), **servers.SHIPPED, "num_replicas": args.num_replicas, "num_cpus_per_replica": 1,
              "lora_modules": [f"{n}={p}" for n, p in adapters.items()], "max_loras": args.max_loras,
              "max_lora_rank": args.rank, "adapter_affinity": arm != "no-affinity"}
    return servers.ours(engine, model=random_checkpoint(MODEL, args.cache_dir), served_model_name=MODEL, name=arm)


def with_adapters(trace, names: list[str], seed: int, rate: float):
    """Each request an adapter drawn uniformly (seeded by the run, the same for every arm)."""
    rng = np.random.default_rng([seed, int(rate * 1000), 43])
    picks = rng.integers(0, len(names), len(trace))
    return [dataclasses.replace(r, model=names[i]) for r, i in zip(trace, picks)]


def run(args) -> dict:
    results = {arm: [] for arm in args.arms}
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(random_checkpoint(MODEL, args.cache_dir))
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {}
        for j in range(args.adapters):
            folder = os.path.join(tmp, f"lora{j}")
            write_random_adapter(folder, hf_config, args.rank, seed=j, modules=("q_proj", "v_proj"))
            adapters[f"lora{j}"] = folder
        for k, seed in enumerate(args.seeds):
            order = args.arms[k % len(args.arms):] + args.arms[:k % len(args.arms)]
            for arm in order:
                spec = server(arm, args, adapters)
                log = Path(args.log_dir) / f"lora_routing_{arm}.log"
                print(f"== {arm} seed {seed}: starting (log {log})", flush=True)
                with servers.running(spec, log):
                    client = ClientOptions(timeout=args.timeout, disable_tqdm=True, request_fields=spec.told)
                    url = f"{spec.base_url}/v1/completions"
                    warm = [dataclasses.replace(r, arrival_s=0.0, output_len=4, model=None)
                            for r in mixed.base_trace(args, 999_983)[:2]]
                    asyncio.run(replay(warm, url, MODEL, client, {}))
                    base = mixed.base_trace(args, seed)
                    classes = {r.request_id: r.service_class for r in base}
                    for rate in args.rates:
                        trace = fresh_ids(with_rate(base, rate, cv=args.cv, seed=seed), mixed.VOCAB, seed, rate)
                        trace = with_adapters(trace, list(adapters), seed, rate)
                        if arm == "base":
                            trace = [dataclasses.replace(r, model=None) for r in trace]
                        timelines, duration = asyncio.run(replay(trace, url, MODEL, client, {}))
                        a = analyze(timelines, classes, duration)
                        a.update(rate=rate, seed=seed, errors=sorted({t.error[:120] for t in timelines if t.error}))
                        results[arm].append(a)
                        print(mixed.row(arm, a), flush=True)
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--num-replicas", type=int, default=2)
    p.add_argument("--max-loras", type=int, default=2, help="adapter slots per replica")
    p.add_argument("--rank", type=int, default=16)
    own, rest = p.parse_known_args(argv)
    args = mixed.parse_args(["serve", *rest])
    for k, v in vars(own).items():
        setattr(args, k, v)
    header = stamp(threads=args.num_threads, dtype=args.dtype, model=f"{MODEL} (random weights), {args.adapters} "
                   f"random rank-{args.rank} q/v adapters", simulated=False, num_replicas=args.num_replicas,
                   max_loras=args.max_loras)
    results = run(args)
    eff = mixed.effective(results)
    print("\neffective throughput (req/s) at 90% / 60% attainment: all | chat | documents")
    for name, e in eff.items():
        print(f"  {name:12s} " + " | ".join(f"{e[g]['90']:.3f} / {e[g]['60']:.3f}" for g in mixed.GROUPS))
    if args.json:
        write_json(args.json, {"results": results, "effective_throughput": eff, "config": vars(args)}, header)
        print(f"written: {args.json}")


if __name__ == "__main__":
    main()
