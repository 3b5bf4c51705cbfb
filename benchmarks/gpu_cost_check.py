"""The GPU cost model against what ``benchmarks/gpu_check.sh`` measured on a lent GPU, shape by shape.

    python benchmarks/gpu_cost_check.py OUT/gpu_check [--device a100-80gb]

Reads the check's ``decode_step_13b.json`` / ``decode_step_7b.json`` (whole decode steps of two layers of
OPT-13B / OPT-6.7B, per cache kind, batch and context) and ``probe.json`` (a whole OPT-1.3B shape: one
stream's TTFT and TPOT), predicts each with ``bench/gpu_cost.py`` for the device the check ran on
(``--device``, else from the GPU's name) and prints predicted, measured and their ratio; writes
``cost_model_check.json`` beside them. A ratio far from 1 says which efficiency factor of
``bench/gpu_specs.json`` to move (decode at batch 1: ``mem_eff``; large batches and long contexts:
``attn_mem_eff``; hidden pages: ``compute_eff``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from apt_serve_ray.bench import gpu_cost
from apt_serve_ray.cache.kinds import CacheKind

KINDS = {"kv": CacheKind.KV, "hidden": CacheKind.HIDDEN, "kv-int8": CacheKind.KV_INT8}
NAMES = {"A100": "a100-80gb", "H100": "h100-80gb", "L4": "l4"}


def device_of(name: str, given: str | None) -> str:
    if given:
        return given
    for key, device in NAMES.items():
        if key in name:
            return device
    return "a100-80gb"  # a dry run on the CPU, or a GPU with no entry: predictions for the A100


def kind_of(config: str) -> CacheKind:
    for key, kind in sorted(KINDS.items(), key=lambda kv: -len(kv[0])):  # "kv-int8" before "kv"
        if key in config:
            return kind
    raise ValueError(f"config: no cache kind in {config!r}; known: {sorted(KINDS)}")


def compare(dest: Path, given: str | None) -> dict:
    rows = []
    for name, shape in (("decode_step_13b", "opt-13b-2l"), ("decode_step_7b", "opt-6.7b-2l")):
        f = dest / f"{name}.json"
        if not f.exists():
            continue
        d = json.loads(f.read_text())
        cost = gpu_cost.GpuCostModel(gpu_cost.device(device_of(d.get("device", ""), given)), gpu_cost.model_shape(shape))
        for r in d["rows"]:
            if not r["config"].startswith("fast"):
                continue  # the PyTorch reference path is not what the engine runs on a GPU
            predicted = 1000 * cost.decode_s(r["batch"], r["context"], kind_of(r["config"]))
            rows.append({"check": name, "config": r["config"], "batch": r["batch"], "context": r["context"],
                         "device": cost.dev.name, "predicted_ms": predicted, "measured_ms": r["step_ms"]})
    f = dest / "probe.json"
    if f.exists():
        d = json.loads(f.read_text())
        cost = gpu_cost.GpuCostModel(gpu_cost.device(device_of(d.get("device", ""), given)), gpu_cost.model_shape("opt-1.3b"))
        for r in d["rows"]:
            rows.append({"check": "probe ttft", "config": r["backend"], "batch": 1, "context": 512,
                         "device": cost.dev.name, "predicted_ms": 1000 * cost.prefill_s(512), "measured_ms": r["ttft_ms"]})
            rows.append({"check": "probe tpot", "config": r["backend"], "batch": 1, "context": 576,
                         "device": cost.dev.name, "predicted_ms": 1000 * cost.decode_s(1, 576), "measured_ms": r["tpot_ms"]})
    for r in rows:
        r["measured_over_predicted"] = r["measured_ms"] / r["predicted_ms"] if r["predicted_ms"] else None
    return {"rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dest", type=Path, help="the gpu_check output folder (OUT/gpu_check)")
    ap.add_argument("--device", default=None, choices=gpu_cost.devices())
    args = ap.parse_args(argv)
    result = compare(args.dest, args.device)
    print("cost model vs measured (ms per step):")
    for r in result["rows"]:
        ratio = r["measured_over_predicted"]
        print(f"  {r['check']:16s} {r['config']:22s} B={r['batch']:<3d} ctx={r['context']:<5d} predicted "
              f"{r['predicted_ms']:8.2f}  measured {r['measured_ms']:8.2f}  x" + (f"{ratio:.2f}" if ratio else "-"))
    (args.dest / "cost_model_check.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
