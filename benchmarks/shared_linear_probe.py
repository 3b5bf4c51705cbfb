"""Issue 41, sixth pass (an experiment, not kept): OPT-125m's four linears of one layer (qkv, out, fc1, fc2),
float32, two threads bound, through oneDNN's packed weight (split between the threads ahead of time) against
``apt_serve::shared_linear`` (the weight in oneDNN-packed column chunks of 64/128/256 that the threads take
from a counter, each run single-threaded), quiet and beside ``step_under_noise``'s 16 x 60 us every 6 ms.

    python benchmarks/shared_linear_probe.py --json docs/benchmarks/engine_speed/shared_linear_avx2.json
"""
import json, statistics, sys, time, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from step_under_noise import noise
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.kernels import cpu_attention
from apt_serve_ray.worker import cpu_affinity
cpu_attention.load()
torch.manual_seed(0)
threads = 2
rows = []
torch.set_num_threads(threads)
cpu_affinity.bind_compute_threads(threads, True, cpu_affinity.available_cpus()[:threads])
reorder = torch.ops.mkldnn._reorder_linear_weight
shapes = [(2304, 768), (768, 768), (3072, 768), (768, 3072)]
W = [torch.randn(n, k) * 0.02 for n, k in shapes]; B = [torch.randn(n) * 0.02 for n, _ in shapes]
full = [reorder(w) for w in W]
def chunks(width):
    out = []
    for w in W:
        ws = [min(width, w.shape[0] - c) for c in range(0, w.shape[0], width)]
        out.append(([reorder(w[c:c + width].contiguous()) for c in range(0, w.shape[0], width)], ws))
    return out
variants = {"onednn": None, "shared128": chunks(128), "shared256": chunks(256), "shared64": chunks(64)}
def layer(x, v):
    for i, (w, b) in enumerate(zip(W, B)):
        xi = x if w.shape[1] == x.shape[1] else torch.zeros(x.shape[0], w.shape[1])
        if v is None:
            torch.ops.mkldnn._linear_pointwise(xi, full[i], b, "none", [], "")
        else:
            cs, ws = v[i]
            torch.ops.apt_serve.shared_linear(xi, cs, b, ws, w.shape[0])
# correctness
with torch.inference_mode():
    x = torch.randn(100, 768)
    for name, v in variants.items():
        if v is None: continue
        cs, ws = v[0]
        y = torch.ops.apt_serve.shared_linear(x, cs, B[0], ws, 2304)
        ref = torch.nn.functional.linear(x, W[0], B[0])
        print(name, "max err", (y - ref).abs().max().item())
def med(fn, reps):
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3
cpus = set(cpu_affinity.available_cpus())
with torch.inference_mode():
    for m in (16, 64, 384, 512):
        x = torch.randn(m, 768)
        res = {k: ([], []) for k in variants}
        for r in range(3):
            for k, v in variants.items():
                res[k][0].append(med(lambda: [layer(x, v) for _ in range(4)], 15))
            procs = noise(16, 60, 6, cpus); time.sleep(0.5)
            try:
                for k, v in variants.items():
                    res[k][1].append(med(lambda: [layer(x, v) for _ in range(4)], 15))
            finally:
                for p in procs: p.kill(); p.wait()
        base_q = statistics.median(res["onednn"][0]); base_n = statistics.median(res["onednn"][1])
        for k, (q, n) in res.items():
            q, n = statistics.median(q), statistics.median(n)
            rows.append({"threads": threads, "rows": m, "variant": k, "quiet_ms": q, "noisy_ms": n,
                         "quiet_vs_onednn": q / base_q, "noisy_vs_onednn": n / base_n, "slowdown": n / q - 1})
            print(f"{threads}t M={m:4d} {k:10s} quiet {q:7.2f} ms ({q/base_q:.3f}x)  noise {n:7.2f} ms ({n/base_n:.3f}x)  slowdown +{100*(n/q-1):.0f}%", flush=True)
if "--json" in sys.argv:
    print("wrote", write_json(Path(sys.argv[sys.argv.index("--json") + 1]), {"rows": rows},
                              stamp(threads=[threads], dtype="float32", model="opt-125m layer linears", simulated=False)))
