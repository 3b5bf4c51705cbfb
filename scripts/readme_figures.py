"""README's figures table, rebuilt from the benchmark JSON under ``docs/benchmarks/``.

Every figure in the table is read or computed here from a JSON file that a benchmark wrote; the
words around the figures are this script's. One row a function below (``ROWS``), each naming the
JSON it reads. The table sits in README.md between ``<!-- figures:begin -->`` and
``<!-- figures:end -->``::

    python scripts/readme_figures.py            # rewrite README's table from the JSON
    python scripts/readme_figures.py --check    # exit 1 and print a diff where README differs

Rounding, one way for every row: ratios, times, rates and sizes to 3 significant figures (whole
numbers from 100 up), percentages to one decimal. Each row's "measured on" cell gives the machine
(CPU and whether it has native bf16) from the JSON's machine header; a field the JSON does not hold
(a date, a model, an instruction set) is taken from that run's section of docs/benchmarks.md and
marked "(docs)".

Standard library and numpy only: no torch, no ray, nothing from the engine.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import sys
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BEGIN = "<!-- figures:begin -->"
END = "<!-- figures:end -->"
HEADER = ["| what | figure, and where we lose | measured on | command |", "|---|---|---|---|"]
GROUPS = ("all", "chat", "document")


# Formatting: the one rounding rule ---------------------------------------------------------------
def num(x: float) -> str:
    """``x`` to 3 significant figures; from 100 up, a whole number with thousands separated."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    r = float(f"{x:.3g}")  # decide the decimals on the rounded value (9.996 -> 10.0, not 10.00)
    if abs(r) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{2 - math.floor(math.log10(abs(r)))}f}"


def pct(frac: float) -> str:
    """A share (0..1) as a percentage to one decimal, without the sign."""
    return f"{100 * frac:.1f}"


def ratio(a: float, b: float) -> str:
    return num(a / b) + "x"


def span(values, fmt: Callable[[float], str] = num) -> str:
    """``lo-hi`` of ``values`` formatted with ``fmt`` (one figure where both ends print alike)."""
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def day(stamp: str) -> str:
    """'2026-12-06 04:40:39' or '20261204-051315' -> '2026-12-06'."""
    s = stamp.strip()
    return s[:10] if s[4] == "-" else f"{s[:4]}-{s[4:6]}-{s[6:8]}"


def days(stamps) -> str:
    ds = sorted({day(s) for s in stamps})
    return ds[0] if len(ds) == 1 else f"{ds[0]} to {ds[-1]}"


def docs(text: str) -> str:
    """A field the JSON does not hold, as docs/benchmarks.md gives it for this run."""
    return f"{text} (docs)"


def points(diff: float) -> str:
    """A difference of two percentages (given in points), to one decimal like the percentages."""
    return f"{diff:.1f}"


def machine(header: dict, detail: str = "") -> str:
    """The CPU and native bf16 from a JSON's machine header (``detail``: what docs/benchmarks.md adds)."""
    cpu = header.get("cpu", header.get("name"))
    bf16 = header.get("native_bf16", header.get("avx512_bf16"))
    if cpu is None or bf16 is None:
        raise KeyError(f"machine header without cpu / native bf16: {header}")
    return f"{cpu}{' ' + docs(detail) if detail else ''}, {'native bf16' if bf16 else 'no native bf16'}"


def measured_on(*fields: str) -> str:
    return "; ".join(fields)


DTYPES = {"bfloat16": "bf16", "float32": "fp32"}


def threads(n) -> str:
    return f"{n} thread{'s' if int(n) != 1 else ''}"


class Row:
    def __init__(self, what: str, figure: str, lose: str, on: str, command: str):
        self.cells = [what, f"{figure} **Where we lose**: {lose}", on, command]

    def line(self) -> str:
        for c in self.cells:
            if "|" in c.replace("\\|", "") or "\n" in c:
                raise ValueError(f"a cell may not hold '|' or a newline: {c!r}")
        return "| " + " | ".join(self.cells) + " |"


class Bench:
    """The JSON files under one ``docs/benchmarks`` folder, read once each; ``used`` lists those read."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.used: list[str] = []
        self._cache: dict[str, object] = {}

    def __call__(self, rel: str):
        if rel not in self._cache:
            self._cache[rel] = json.loads((self.root / rel).read_text())
            self.used.append(rel)
        return self._cache[rel]


def jpath(*rels: str) -> str:
    return ", ".join(f"`docs/benchmarks/{r}`" for r in rels)


# mixed_traffic.py serve JSON (runs -> "serve:NAME" -> results per rate and seed) -----------------
def at(run: dict, rate: float) -> list[dict]:
    return sorted((a for a in run["results"] if a["rate"] == rate), key=lambda a: a["seed"])


def rates_of(run: dict) -> list[float]:
    return sorted({a["rate"] for a in run["results"]})


def mean_att(run: dict, rate: float, group: str) -> float:
    return float(np.mean([a[group]["attainment"] for a in at(run, rate)]))


def triple(run: dict, rate: float) -> str:
    """Mean attainment over seeds, all / chats / documents."""
    return " / ".join(pct(mean_att(run, rate, g)) for g in GROUPS) + "%"


def goodput_ratio(run: dict, base: dict, rate: float) -> float:
    """Mean over seeds of goodput over the arrival window against ``base`` on the same seed
    (what ``mixed_traffic.py report`` prints)."""
    ref = {a["seed"]: a["all"]["goodput_arrivals"] for a in at(base, rate)}
    return float(np.mean([a["all"]["goodput_arrivals"] / ref[a["seed"]] for a in at(run, rate)]))


def doc_deficits(ours: dict, peer: dict) -> list[tuple[float, float, int]]:
    """(points under, rate, seed) for every rate and seed where our documents' attainment is below the peer's."""
    out = []
    for rate in rates_of(ours):
        peer_by_seed = {a["seed"]: a["document"]["attainment"] for a in at(peer, rate)}
        for a in at(ours, rate):
            gap = 100 * (peer_by_seed[a["seed"]] - a["document"]["attainment"])
            if gap > 0:
                out.append((gap, rate, a["seed"]))
    return out


def burst_what(cfg: dict, peers: str) -> str:
    return (f"**bursts** (issue 44's variant of the seed's traffic: CV {cfg['cv']:g}, "
            f"{100 * (1 - cfg['chat_share']):.0f}% documents, chats TTFT {cfg['chat_ttft_ms'] / 1000:g} s / gap "
            f"{cfg['chat_tbt_ms'] / 1000:g} s, documents {cfg['doc_ttft_ms'] / 1000:g} s / {cfg['doc_tbt_ms'] / 1000:g} s, "
            f"{cfg['num_pages'] * 16:,} KV tokens each, {cfg['num_requests']} requests a rate, fresh token ids), "
            f"through HTTP against vLLM CPU 0.32 {peers}")


# The rows ----------------------------------------------------------------------------------------
def bursts_bf16(b: Bench) -> Row:
    # ours at f80ff03 (the reservation kept to the first token, the fewest written off); vLLM's two runs are
    # the second pass's on the same ids, copied beside it from burst/serve_vllm_bf16.json (not side by side)
    rel = "burst/serve_cv4_s40_f80ff03.json"
    runs = b(rel)["runs"]
    ours, vllm, prio = runs["serve:ours"], runs["serve:vllm"], runs["serve:vllm-priority"]
    cfg, rates = ours["config"], rates_of(ours)
    seeds = sorted({a["seed"] for a in ours["results"]})
    eff = ratio(ours["effective_throughput"]["all"]["90"], vllm["effective_throughput"]["all"]["90"])
    figure = (f"{len(seeds)} seeds, all / chats / documents: "
              + "; ".join(f"**{triple(ours, r)}** vs vLLM {triple(vllm, r)} at {r:g} req/s" for r in rates)
              + "; goodput " + " / ".join(ratio(goodput_ratio(ours, vllm, r), 1) for r in rates)
              + f" vLLM's; effective throughput at 90% {eff}.")
    deficits = doc_deficits(ours, vllm)
    doc_means = ", ".join(f"{pct(mean_att(ours, r, 'document'))} vs {pct(mean_att(vllm, r, 'document'))}%" for r in rates)
    behind = [r for r in rates if mean_att(ours, r, "chat") < mean_att(prio, r, "chat")]
    chat_gaps = lambda run, r: sum(a["chat"]["gap_misses"] for a in at(run, r))  # noqa: E731
    chats_n = lambda run, r: sum(a["chat"]["num"] for a in at(run, r))  # noqa: E731
    if deficits:
        worst = max(deficits)
        worst_rates = " and ".join(f"{r:g}" for g, r, seed in deficits if seed == worst[2])
        docs_part = (f"documents only level with vLLM's ({doc_means}), up to {points(worst[0])} points under on the "
                     f"worst seed (seed {worst[2]}, at {worst_rates} req/s)")
    else:
        docs_part = f"documents the closest class ({doc_means}), at or above vLLM's on every seed, level on the worst"
    lose = (docs_part + "; against vLLM with `--scheduling-policy priority` overall "
            + ", ".join(f"{pct(mean_att(ours, r, 'all'))} vs {pct(mean_att(prio, r, 'all'))}%" for r in rates)
            + "".join(f", chats behind at {r:g} req/s ({pct(mean_att(ours, r, 'chat'))} vs "
                      f"{pct(mean_att(prio, r, 'chat'))}%: {chat_gaps(ours, r)} of our {chats_n(ours, r)} chats broke "
                      f"their gap, {chat_gaps(prio, r)} of vLLM's)" for r in behind)
            + f"; goodput only {ratio(goodput_ratio(ours, vllm, rates[0]), 1)} vLLM's at {rates[0]:g} req/s; "
              "the tier off not run against vLLM")
    on = measured_on(machine(ours["machine"]), DTYPES[cfg["dtype"]], threads(cfg.get("threads", cfg.get("num_threads")))
                     + " each", docs("random-weight OPT-125m"), days(r["started"] for r in runs.values()))
    return Row(burst_what(cfg, "with its defaults and with priority scheduling"), figure, lose, on,
               f"`benchmarks/mixed_traffic.py serve` (issue 44; {jpath(rel)}; vLLM's runs not side by side)")


def bursts_fp32(b: Bench) -> Row:
    rel = "burst/serve_fp32_tier_onoff.json"
    runs = b(rel)["runs"]
    ours, off, vllm = runs["serve:ours"], runs["serve:ours-notier"], runs["serve:vllm"]
    cfg, rates = ours["config"], rates_of(ours)
    seeds = sorted({a["seed"] for a in ours["results"]})
    figure = (f"{len(seeds)} seeds, all / chats / documents: "
              + "; ".join(f"**{triple(ours, r)}** (the tier off {triple(off, r)}) vs vLLM {triple(vllm, r)} at {r:g} req/s"
                          for r in rates)
              + "; goodput " + " / ".join(ratio(goodput_ratio(ours, vllm, r), 1) for r in rates)
              + " vLLM's (the tier off " + " / ".join(ratio(goodput_ratio(off, vllm, r), 1) for r in rates) + ").")
    deficits = doc_deficits(ours, vllm)
    chat_gaps = lambda run, r: sum(a["chat"]["gap_misses"] for a in at(run, r))  # noqa: E731
    chats_n = lambda run, r: sum(a["chat"]["num"] for a in at(run, r))  # noqa: E731
    lose = (("documents under vLLM's on seed "
             + ", ".join(f"{seed} at {r:g} req/s ({points(g)} points)" for g, r, seed in sorted(deficits, key=lambda d: d[2]))
             if deficits else "documents at or above vLLM's on every seed")
            + "; " + "; ".join(f"the tier on {points(100 * (mean_att(off, r, 'all') - mean_att(ours, r, 'all')))} points "
                               f"under the tier off at {r:g} req/s (chats' gaps broken through Serve: {chat_gaps(ours, r)} "
                               f"of {chats_n(ours, r)} chats against {chat_gaps(off, r)}; vLLM {chat_gaps(vllm, r)})"
                               for r in rates))
    on = measured_on(machine(ours["machine"]), DTYPES[cfg["dtype"]], threads(cfg.get("threads", cfg.get("num_threads"))) + " each",
                     docs("random-weight OPT-125m"), days(r["started"] for r in runs.values()))
    return Row(burst_what(cfg, "with its defaults, in float32, ours with the tier below memory on and off"), figure, lose,
               on, f"`benchmarks/mixed_traffic.py serve --dtype float32 --servers ours ours-notier vllm` (issue 44; {jpath(rel)})")


def decision_cost(b: Bench) -> Row:
    # as shipped (the fewest written off, the reservation kept to the first token) / the rules before them
    rels = ("burst/scheduler_overhead_fewest.json", "burst/scheduler_overhead_inturn.json")
    on_, off = (b(r) for r in rels)
    r_on, r_off = on_["results"][0], off["results"][0]
    assert r_on["num_candidates"] == r_off["num_candidates"]
    cfg = on_["config"]
    aim_ms = 1.0  # docs/benchmarks.md, issue 44: "Aim 1 ms"
    what = (f"one whole `apt` decision (the real scheduler, pool and policy on the simulator, {cfg['max_num_seqs']} "
            f"sequences / {cfg['max_num_batched_tokens']:,} tokens a step)")
    figure = (f"{r_on['num_candidates']:,} candidates, median: **{num(r_on['full_decision_ms'])} ms** as shipped (the "
              f"fewest written off, the reservation kept to its request's first token), {num(r_off['full_decision_ms'])} "
              f"ms with the rules before them (one run each, one after the other; P90 {num(r_on['full_decision_p90_ms'])} "
              f"/ {num(r_off['full_decision_p90_ms'])} ms).")
    met = r_on["full_decision_ms"] <= aim_ms
    lose = (f"the aim of {aim_ms:g} ms (docs) {'met' if met else 'not met, by ' + points(100 * (r_on['full_decision_ms'] / aim_ms - 1)) + '%'}"
            f"; the rules cost {ratio(r_on['full_decision_ms'], r_off['full_decision_ms'])} the decision before them "
            "(a second pair: 1.004 vs 1.013 ms, docs)")
    on = measured_on(machine(on_["machine"]), "simulated engine (no model, no dtype)", docs("2026-12-06"))
    return Row(what, figure, lose, on, f"`benchmarks/scheduler_overhead.py --policy-options` (issue 44; {jpath(*rels)})")


def against(ours: dict, peer: dict) -> list[str]:
    """TTFT, TPOT (one stream) and saturated output of one probe against another's."""
    return [ratio(ours["single"]["median_ttft_ms"], peer["single"]["median_ttft_ms"]),
            ratio(ours["single"]["median_tpot_ms"], peer["single"]["median_tpot_ms"]),
            ratio(ours["saturated"]["output_throughput"], peer["saturated"]["output_throughput"])]


def engine_speed(b: Bench) -> Row:
    rel125, rel350, rel350_1, rel11 = ("engine_speed/probe_avx2_fifth.json", "engine_speed/probe_avx2_opt350m.json",
                                       "engine_speed/probe_avx2_opt350m_1t.json", "engine_speed/probe_avx2_tinyllama.json")
    rel11b = "engine_speed/probe_avx2_tinyllama_policy.json"
    relp = "engine_speed/probe_avx2_panels.json"  # the panel linears' A/B, both runs on one day
    p = b(relp)["servers"]
    # At the current code, an AVX2 CPU; 350M at one thread re-run with a 900-s client timeout (300 s cut half of
    # the saturated requests of both servers).
    own = {"125M": b(rel125)["servers"], "350M": {**b(rel350)["servers"], **b(rel350_1)["servers"]},
           "1.1B": b(rel11)["servers"]}
    names = {"125M": "OPT-125m shape", "350M": "OPT-350m shape", "1.1B": "TinyLlama-1.1B shape (GQA)"}

    def entry(server: str, shape: str, t: int) -> dict:
        return own[shape][f"{ {'apt-serve': 'ours'}.get(server, server)}-fp32-{t}t"]

    def probe(server: str, shape: str, t: int) -> dict:
        return entry(server, shape, t)["probe"]

    def three(shape: str, t: int, server: str = "apt-serve") -> list[str]:
        return against(probe(server, shape, t), probe("vllm", shape, t))

    def gain(server: str, shape: str) -> str:
        one, two = (probe(server, shape, t)["saturated"]["output_throughput"] for t in (1, 2))
        return f"{100 * (two / one - 1):+.0f}%"

    a, m, c = three("125M", 1), three("350M", 1), three("1.1B", 1)
    e1, e2 = three("125M", 1, "engine"), three("125M", 2, "engine")
    figure = (f"one thread: {names['125M']} TTFT / TPOT **{a[0]} / {a[1]}** vLLM's, saturated **{a[2]}**; "
              f"{names['350M']} **{m[0]} / {m[1]}**, saturated {m[2]}; {names['1.1B']} TTFT / TPOT "
              f"**{c[0]} / {c[1]}**, saturated {c[2]}. Two threads, 125M: TPOT **{three('125M', 2)[1]}**; "
              f"the engine alone (the probe in-process) {e2[0]} / {e2[1]} / **{e2[2]}** (one thread {e1[0]} / {e1[1]} / "
              f"{e1[2]}).")
    a2, m2, c2 = three("125M", 2), three("350M", 2), three("1.1B", 2)
    e11 = three("1.1B", 2, "engine")
    w2 = b(rel11b)["servers"]  # a second window at 1.1B, two threads: the same probe, an hour later
    o2, en2 = (against(w2[label]["probe"], w2["vllm-fp32-2t"]["probe"]) for label in ("ours-fp32-2t", "engine-apt-fp32-2t"))
    off = p["ours-nopanels-fp32-2t"]["probe"]["single"]["median_tpot_ms"]
    on_ = p["ours-fp32-2t"]["probe"]["single"]["median_tpot_ms"]
    lose = (f"two threads through Serve on the two cores: 125M TTFT {a2[0]}, saturated {a2[2]}; 350M "
            f"{m2[0]} / {m2[1]} / {m2[2]}; 1.1B {c2[0]} / {c2[1]} / {c2[2]}, the engine alone {e11[0]} / {e11[1]} / "
            f"{e11[2]} (a second window: {o2[0]} / {o2[1]} / {o2[2]}, the engine alone {en2[0]} / {en2[1]} / {en2[2]}). At 125M the second thread adds "
            f"{gain('vllm', '125M')} to vLLM's saturated output and {gain('apt-serve', '125M')} to ours (docs: the "
            f"Serve app's processes share the engine's two cores; in process the engine's second thread adds "
            f"{gain('engine', '125M')}; the panel linears took 125M's TPOT through Serve from {num(off)} to {num(on_)} "
            "ms the day they landed, `ours-nopanels`)")
    used = [entry(server, shape, t) for server in ("apt-serve", "vllm") for shape in names for t in (1, 2)] \
        + [w2["ours-fp32-2t"], w2["vllm-fp32-2t"]]
    on = measured_on(machine(used[0]) + ", " + docs("AVX2"), "real engines", docs("random weights"),
                     DTYPES["float32"] + " (the labels)", "1 and 2 threads (the labels)", days(v["date"] for v in used))
    return Row("engine speed through HTTP against vLLM CPU 0.32 (its defaults), same checkpoint, cache tokens, budget "
               "and compute threads: TTFT and TPOT of one stream, output tok/s with everything sent at once",
               figure, lose, on, "`peer_sweep.py --start ours` (and `vllm`, `engine`) `--probe-only --dtype float32 "
               "--threads 1` (and 2) `--shape opt-125m` (and `opt-350m`; at one thread `--timeout 900`; `tinyllama-1.1b` "
               "with `--probe-single 4 --probe-saturated 16 --probe-input-len 256 --probe-output-len 64 --timeout 900`) "
               f"(issue 41) ({jpath(rel125, rel350, rel350_1, rel11, rel11b, relp)}, labels `*-fp32-*t`)")


def engine_speed_bf16(b: Bench) -> Row:
    rel, brel = "engine_speed/probe_pass2.json", "engine_speed/bind_threads_probe.json"
    d, bd = b(rel), b(brel)
    s = {label: v["probe"] for label, v in d["servers"].items()}
    bound = [v["probe"] for k, v in bd["servers"].items() if k.startswith("ours-bf16-2t-bound")]
    peer = [s[f"vllm-bf16-2t-{r}"] for r in "abc"]

    def mean(ps: list[dict], part: str, key: str) -> float:
        return sum(p[part][key] for p in ps) / len(ps)

    def trio(ps: list[dict]) -> tuple[float, float, float]:
        return (mean(ps, "single", "median_ttft_ms"), mean(ps, "single", "median_tpot_ms"),
                mean(ps, "saturated", "output_throughput"))

    ours2, vllm2, eng2 = trio(bound), trio(peer), trio([s["engine-bfloat16-2t"]])
    ours1, vllm1 = trio([s["ours-bf16-1t"]]), trio([s["vllm-bf16-1t"]])
    figure = (f"the engine alone (the same probe in-process, two threads): TTFT **{ratio(eng2[0], vllm2[0])}**, "
              f"TPOT **{ratio(eng2[1], vllm2[1])}**, saturated **{ratio(eng2[2], vllm2[2])}** vLLM's whole server "
              f"({num(eng2[0])} ms, {num(eng2[1])} ms, {num(eng2[2])} tok/s); one thread through Serve: TTFT "
              f"{ratio(ours1[0], vllm1[0])}, TPOT {ratio(ours1[1], vllm1[1])}, saturated **{ratio(ours1[2], vllm1[2])}**.")
    lose = (f"two threads through Serve (compute threads bound, mean of two runs, against vLLM's three): TTFT "
            f"{ratio(ours2[0], vllm2[0])} ({num(ours2[0])} vs {num(vllm2[0])} ms), TPOT {ratio(ours2[1], vllm2[1])}, "
            f"saturated {ratio(ours2[2], vllm2[2])} ({num(ours2[2])} vs {num(vllm2[2])} tok/s): the Serve app's "
            "processes share the two cores with the engine (docs: 0.4 of a core at saturation, Ray's actors wake "
            "every 10 ms)")
    used = [*d["servers"].values(), *bd["servers"].values()]
    on = measured_on(machine(d["machine"]), "real engines", docs("random weights"), DTYPES["bfloat16"],
                     "1 and 2 threads (the labels)", days(v["date"] for v in used))
    return Row("engine speed in bf16 against vLLM CPU 0.32 with its defaults (prefix caching on), OPT-125m shape, "
               "6,048 KV tokens and a 512-token budget each: TTFT and TPOT of one stream (384 -> 128 tokens), "
               "output tok/s with 64 sent at once", figure, lose, on,
               f"`benchmarks/peer_sweep.py --start ours --probe-only --dtype bfloat16 --threads 2` (and `--start vllm`, `--start engine`) "
               f"(issue 41; {jpath(rel, brel)}, labels `vllm-bf16-2t-{{a,b,c}}`, `engine-bfloat16-2t`, "
               "`*-bf16-1t`, `ours-bf16-2t-bound-*`)")


def on_the_xeon(header: dict, used: list[dict]) -> str:
    """The "measured on" cell of the rows run on the AVX512-BF16 Xeon without AMX, both dtypes, one and two threads."""
    return measured_on(machine(header, "(no AMX, 2.3 GHz)"), "real engines", docs("random weights"),
                       "bf16 and fp32 (the labels)", "1 and 2 threads (the labels)", days(v["date"] for v in used))


def panels_xeon(b: Bench) -> Row:
    """Panel linears on AVX-512 (bf16 and float32) on the Xeon: the step A/B and the probes against vLLM (ninth pass)."""
    rb, rf = "engine_speed/panel_linear_bf16_xeon_opt350m.json", "engine_speed/panel_linear_fp32_xeon_opt350m.json"
    r125, r350 = "engine_speed/probe_xeon_panels.json", "engine_speed/probe_xeon_opt350m_panels.json"
    p125, p350 = b(r125)["servers"], b(r350)["servers"]

    def step(rel: str, what: str, t: int) -> str:
        r = next(r for r in b(rel)["rows"] if r["what"] == what and r["threads"] == t)
        return f"{ratio(r['panels_quiet_ms'], r['onednn_quiet_ms'])} / {ratio(r['panels_noisy_ms'], r['onednn_noisy_ms'])}"

    def layers(rel: str) -> str:
        return span([r["panels_quiet_ms"] / r["onednn_quiet_ms"] for r in b(rel)["rows"]
                     if r["what"] == "layer linears"]) + "x"

    def vs(runs: dict, cell: str) -> list[str]:
        return against(runs[f"ours-{cell}"]["probe"], runs[f"vllm-{cell}"]["probe"])

    def cells(runs: dict, names: list[str]) -> str:
        return "; ".join(f"{c.replace('-', ' ')} **{' / '.join(vs(runs, c))}**" for c in names)

    c125 = [c for c in ("bf16-1t", "bf16-2t", "bf16-2t-b", "fp32-1t", "fp32-2t")
            if f"ours-{c}" in p125 and f"vllm-{c}" in p125]  # "-b": a second window
    second = ""
    if "ours-fp32-2t-b" in p125:  # a second window at fp32, two threads: without panels, with them, vLLM
        nop = against(p125["ours-nopanels-fp32-2t-b"]["probe"], p125["vllm-fp32-2t-b"]["probe"])
        second = (f" (fp32 2t in a second window {' / '.join(vs(p125, 'fp32-2t-b'))}, the same app without panels "
                  f"{' / '.join(nop)})")
    figure = (f"a decode step of one request (OPT-350m shape), panels over oneDNN's time, quiet / beside noise: bf16 one "
              f"thread {step(rb, 'decode x1 @ 400', 1)}, two {step(rb, 'decode x1 @ 400', 2)}; fp32 one "
              f"{step(rf, 'decode x1 @ 400', 1)}, two {step(rf, 'decode x1 @ 400', 2)} (the linears alone at 1-64 rows: "
              f"bf16 {layers(rb)}, fp32 {layers(rf)}; bf16's panels take every step and oneDNN's copy is dropped, a "
              f"512-token prefill step {step(rb, 'prefill 512 @ 0', 1)} at one thread, {step(rb, 'prefill 512 @ 0', 2)} "
              f"at two). Through Serve against vLLM, TTFT / TPOT / saturated: OPT-350m shape "
              f"{cells(p350, ['bf16-1t', 'bf16-2t'])}; OPT-125m shape {cells(p125, c125)}{second}.")
    lose = [f"{c.replace('-', ' ')} {['TTFT', 'TPOT', 'saturated'][i]} {v}" for runs, cs in ((p350, ['bf16-1t', 'bf16-2t']), (p125, c125))
            for c in cs for i, v in enumerate(vs(runs, c)) if (float(v[:-1]) > 1.0) != (i == 2) and float(v[:-1]) != 1.0]
    lose_text = ("; ".join(lose) + " (one window each but the two marked b; at two threads one stream's latency "
                 "moves 10-30% between windows here, where the Serve app's processes share the engine's two cores, "
                 "docs)") if lose else "nowhere in these cells"
    used = [*p125.values(), *p350.values()]
    on = on_the_xeon(b(r125)["machine"], used)
    return Row("panel linears on AVX-512 (64 output channels a panel, bf16 widened in registers) on a CPU with "
               "AVX512-BF16 and no AMX, and engine speed with them against vLLM CPU 0.32 with its defaults, same "
               "pages, budget and threads", figure, lose_text, on,
               "`benchmarks/panel_linear.py --shape opt-350m --dtype bfloat16` (and `float32`); `peer_sweep.py --start "
               "ours` (and `vllm`) `--probe-only --dtype bfloat16` (and `float32`) `--threads 1` (and 2) (OPT-350m: "
               f"`--shape opt-350m --probe-single 4 --probe-saturated 16 --timeout 900`) (issue 41; {jpath(rb, rf, r125, r350)})")


def serve_floor_xeon(b: Bench) -> Row:
    """Two threads on two cores: the engine beside an idle bare Ray Serve app, ours through Serve, vLLM (eighth pass)."""
    rel, relw = "engine_speed/serve_floor_xeon.json", "engine_speed/wakeups_xeon.json"
    rel350 = "engine_speed/probe_xeon_opt350m.json"  # one thread, two alternated pairs
    p, w, p350 = b(rel)["servers"], b(relw)["runs"], b(rel350)["servers"]

    def vs(ours: str, peer: str) -> str:
        return " / ".join(against(p[ours]["probe"], p[peer]["probe"]))

    def vs350(part: int) -> str:
        return span([float(against(p350[f"ours-bf16-1t{r}"]["probe"], p350[f"vllm-bf16-1t{r}"]["probe"])[part][:-1])
                     for r in ("", "-b")]) + "x"

    def cpu(run: str) -> str:
        return f"{100 * w[run]['total_cpu_share']:.0f}%"

    rounds = [("bf16-2t-a", "bf16"), ("bf16-2t-b", "bf16"), ("fp32-2t-a", "fp32")]
    floor = "; ".join(f"{d} {vs(f'engine-bare-{r}', f'vllm-{r}')}" for r, d in rounds)
    figure = (f"one thread through Serve, bf16, one window: TTFT / TPOT / saturated **{vs('ours-bf16-1t-a', 'vllm-bf16-1t-a')}** "
              f"vLLM's (OPT-350m shape, two pairs: TTFT {vs350(0)}, saturated {vs350(2)}); two threads, the engine alone {'; '.join(vs(f'engine-{r}', f'vllm-{r}') for r, _ in rounds)} "
              "(bf16 twice, fp32).")
    lose = (f"two threads through Serve: {'; '.join(vs(f'ours-{r}', f'vllm-{r}') for r, _ in rounds)}. The same engine "
            f"beside an idle bare Ray Serve app (one trivial deployment; nothing sent to it): {floor}: any Ray Serve "
            f"app on the engine's two cores loses saturated output to vLLM here; ours adds to that floor. At rest, a "
            f"share of one core: bare Ray Serve {cpu('bare-serve-idle')}, ours {cpu('ours-idle')}, vLLM {cpu('vllm-idle')}. "
            f"OPT-350m at one thread: TPOT {vs350(1)} (a decode step's bf16 GEMVs read the weights slower than vLLM's; "
            "docs; before the bf16 panels, which the row above re-measures)")
    used = [*p.values(), *p350.values()]
    on = on_the_xeon(b(rel)["machine"], used)
    return Row("what Ray Serve itself costs an engine that computes on both of two cores, against vLLM CPU 0.32 with its "
               "defaults, OPT-125m shape, same pages, budget and threads: TTFT and TPOT of one stream, output tok/s with "
               "64 sent at once", figure, lose, on,
               "`peer_sweep.py --start engine --beside bare-serve` (and `--start engine`, `ours`, `vllm`) `--probe-only "
               "--dtype bfloat16` (and `float32`) `--threads 2` (and 1; `--shape opt-350m --probe-single 4 "
               "--probe-saturated 16 --timeout 900`); `benchmarks/wakeups.py --start bare-serve ours vllm --saturate 64` "
               f"(issue 41; {jpath(rel, rel350, relw)})")


def engine_speed_xeon(b: Bench) -> Row:
    """An Intel Xeon with AVX512-BF16 and no AMX: both dtypes, and bf16's many-row GEMMs in float32 (seventh pass)."""
    rb, rf = "engine_speed/probe_bf16_xeon.json", "engine_speed/probe_fp32_xeon.json"
    rws = ["engine_speed/wide_linear_xeon.json", "engine_speed/wide_linear_xeon_2.json",
           "engine_speed/wide_linear_xeon_3.json"]  # three runs of the step A/B
    pb, pf = b(rb)["servers"], b(rf)["servers"]

    def vs(ours: str, peer: str, runs: dict) -> str:
        return " / ".join(against(runs[ours]["probe"], runs[peer]["probe"]))

    def steps(t: int) -> str:
        return span([r["ratio"] for rw in rws for r in b(rw)["rows"] if r["threads"] == t and r["chunk"] != "128 @ 0"])

    figure = (f"bf16, two threads, one window: the engine alone TTFT / TPOT / saturated **{vs('engine-bf16-2t-wide', 'vllm-bf16-2t-b', pb)}** "
              f"vLLM's whole server (with bf16 GEMMs {vs('engine-bf16-2t-nowide', 'vllm-bf16-2t-b', pb)}: a prefill step's "
              f"many-row GEMMs in float32 take it {steps(1)}x the time at one thread, {steps(2)}x at two, three runs); fp32 one thread through Serve "
              f"**{vs('ours-fp32-1t', 'vllm-fp32-1t', pf)}**; bf16 one thread through Serve {vs('ours-bf16-1t-wide', 'vllm-bf16-1t', pb)} "
              "(vLLM's run an hour earlier).")
    lose = (f"two threads through Serve: bf16 {vs('ours-bf16-2t-wide', 'vllm-bf16-2t-b', pb)} (before the float32 GEMMs, "
            f"another window: {vs('ours-bf16-2t', 'vllm-bf16-2t', pb)}), fp32 {vs('ours-fp32-2t', 'vllm-fp32-2t', pf)}, the engine "
            f"alone level ({vs('engine-fp32-2t', 'vllm-fp32-2t', pf)} in fp32): the Serve app's wake-ups on the two cores "
            "(docs: ~3,700 a second; timer slack for them tried, within the noise); bf16 here computes no faster than "
            "fp32 (no AMX; docs)")
    used = [*pb.values(), *pf.values()]
    on = on_the_xeon(b(rb)["machine"], used)
    return Row("engine speed on a CPU with AVX512-BF16 and no AMX against vLLM CPU 0.32 with its defaults, OPT-125m "
               "shape, same pages, budget and threads: TTFT and TPOT of one stream, output tok/s with 64 sent at once",
               figure, lose, on,
               "`peer_sweep.py --start engine` (and `ours`, `vllm`) `--probe-only --dtype bfloat16` (and `float32`) "
               "`--threads 2` (and 1) (`-nowide`: `APT_SERVE_WIDE_LINEAR=0`); `benchmarks/wide_linear.py` "
               f"(issue 41; {jpath(rb, rf, *rws)})")


def prefix_reuse(b: Bench) -> Row:
    rel = "prefix/serve_fp32_epyc.json"
    d = b(rel)
    R = d["results"]
    ours, vllm, prio = R["ours"], R["vllm"], R.get("vllm-priority", [])
    rates = [a["rate"] for a in ours]
    by = lambda runs, r: next(a for a in runs if a["rate"] == r)  # noqa: E731
    att = lambda runs: " / ".join(pct(by(runs, r)["all"]["attainment"]) for r in rates) + "%"  # noqa: E731
    gp = " / ".join(ratio(by(ours, r)["all"]["goodput"], by(vllm, r)["all"]["goodput"]) for r in rates)
    p = prio[0] if prio else None
    prio_part = ""
    if p is not None:
        prio_part = (f" (vLLM with `--scheduling-policy priority`, run at {p['rate']:g} only: {pct(p['all']['attainment'])}%, "
                     f"ours {ratio(by(ours, p['rate'])['all']['goodput'], p['all']['goodput'])} its goodput)")
    r0 = rates[0]
    hit = lambda runs: span([a["all"]["hit_rate"] for a in runs], lambda x: f"{100 * x:.0f}")  # noqa: E731
    figure = (f"attainment **{att(ours)}** vs vLLM's {att(vllm)} at {' / '.join(f'{r:g}' for r in rates)} sessions/s, "
              f"goodput **{gp}**{prio_part}; chats' TTFT p50 {num(by(ours, r0)['chat']['ttft_p50_ms'] / 1000)} vs "
              f"{num(by(vllm, r0)['chat']['ttft_p50_ms'] / 1000)} s at {r0:g}; hit rate {hit(ours)}% vs "
              f"{hit(vllm + prio)}% (idle histories kept in the tier where vLLM evicts them).")
    r1 = rates[1]
    best = max(a["all"]["attainment"] for runs in R.values() for a in runs)
    lose = (f"documents' TTFT (p90 {num(by(ours, r0)['document']['ttft_p90_ms'] / 1000)} vs "
            f"{num(by(vllm, r0)['document']['ttft_p90_ms'] / 1000)} s at {r0:g}; under overload `apt` serves chats "
            f"first and documents wait, p50 {num(by(ours, r1)['document']['ttft_p50_ms'] / 1000)} vs "
            f"{num(by(vllm, r1)['document']['ttft_p50_ms'] / 1000)} s at {r1:g})"
            + ("; neither server reaches 90% on this CPU (best "
               f"{pct(best)}%), so no effective throughput at 90%" if best < 0.9 else ""))
    on = measured_on(machine(d["machine"]) + ", " + docs("AVX2"), "real engines", docs("random-weight OPT-125m"),
                     DTYPES[d["args"]["dtype"]], threads(d["args"]["threads"]) + " each", docs("2026-12-04"),
                     "stale since issue 44 changed `apt`'s admission and prefix lookups (2026-12-06), not re-run")
    return Row("**traffic that repeats itself**: multi-turn conversations (history re-sent each turn) sharing system "
               "prompts, beside documents asked several questions; chats TTFT 2 s / P99 gap 0.5 s, documents 8 s / 1 s; "
               f"{d['args']['num_pages'] * 16:,} KV tokens each, through HTTP against vLLM CPU 0.32 with its defaults "
               "(prefix caching on)", figure, lose, on, f"`benchmarks/prefix_reuse.py` (issue 27; {jpath(rel)})")


def socket_bytes(b: Bench) -> Row:
    rel = "engine/socket_bytes.json"
    d = b(rel)
    k = {r["kind"]: r for r in d["results"]}
    cum, dl = k["cumulative"], k["delta"]
    run = d["run"]
    figure = (f"outputs as deltas: {num(dl['bytes_per_step_mean'] / 1000)} KB a step vs "
              f"{num(cum['bytes_per_step_mean'] / 1000)} KB with whole outputs "
              f"(**{ratio(cum['bytes_per_step_mean'], dl['bytes_per_step_mean'])}** fewer bytes, "
              f"{ratio(cum['pickle_ms_per_step_mean'], dl['pickle_ms_per_step_mean'])} less pickling on the step loop).")
    lose = "not measured yet: what it changes in TPOT through the server"
    on = measured_on(machine(d["machine"]) + ", " + docs("AVX2"), "real engine",
                     f"{run['shape']}, " + docs("random weights"), "fp32 (the script's fixed dtype)", docs("2026-12-04"))
    return Row(f"what one engine step sends across the engine socket, {run['requests']} running requests of "
               f"{run['context']:,}-token contexts", figure, lose, on,
               f"`benchmarks/engine_socket_bytes.py` (issue 28; {jpath(rel)})")


NAMES = {"llama": "Llama", "opt": "OPT", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "phi3": "Phi-3",
         "gemma": "Gemma", "gemma2": "Gemma 2", "gemma3_text": "Gemma 3"}


def architectures(b: Bench) -> Row:
    rel = "architectures.json"
    d = b(rel)
    rows, args = d["rows"], d["args"]
    batches = sorted({r["batch"] for r in rows})
    same = ("qwen2", "qwen3", "mistral", "phi3", "gemma")
    masked = ("gemma2", "gemma3_text")
    over = lambda archs, bs=batches: [r["over_llama"] for r in rows if r["architecture"] in archs and r["batch"] in bs]  # noqa: E731
    figure = (f"{', '.join(NAMES[a] for a in same)} {span(over(same))}x Llama's step, OPT {span(over(('opt',)))}x.")
    top = batches[-1]
    lose = (f"{' / '.join(NAMES[a].split()[-1] if i else NAMES[a] for i, a in enumerate(masked))} "
            f"{span(over(masked, (top,)))}x Llama's at batch {top} (their capped and windowed layers take the masked "
            "reference path, not the C++ kernels)")
    on = measured_on(machine(d["machine"]["machine"], "with AMX"), "real engine", docs("random weights"),
                     DTYPES[args["dtype"]], threads(args["threads"]), docs("2026-12-04"))
    return Row(f"every architecture at OPT-125m's sizes (768 wide, 12 layers, multi-head), one whole decode step, batch "
               f"{' / '.join(map(str, batches))}, context {args['context']}", figure, lose, on,
               f"`benchmarks/architectures.py` (issue 29; {jpath(rel)})")


def sampler(b: Bench) -> Row:
    rel = "structured/sampling_cost.json"
    tp = {n: f"structured/tpot/{n}.json" for n in ("penalties", "plain2", "regex", "plain3")}
    d = b(rel)
    t = {n: b(p) for n, p in tp.items()}
    rows = d["rows"]
    extra = lambda s: [r["extra_us_per_row_token"] for r in rows if r["setting"] == s]  # noqa: E731
    plain_us = {r["batch"]: 1000 * r["step_ms"] / r["batch"] for r in rows if r["setting"] == "plain"}
    schema_over_plain = [r["extra_us_per_row_token"] / plain_us[r["batch"]] for r in rows if r["setting"] == "json_schema"]
    tpot = lambda a, base: ratio(t[a]["mean_tpot_ms"], t[base]["mean_tpot_ms"])  # noqa: E731
    figure = (f"all three penalties {span(extra('all penalties'))} us, a JSON-schema mask {span(extra('json_schema'))} us; "
              f"TPOT (mean) with penalties {tpot('penalties', 'plain2')} plain, with a regex constraint "
              f"{tpot('regex', 'plain3')} (each against the plain run beside it; the TPOT part stale since the engine "
              "streams deltas, ccc0641: not re-run).")
    lose = (f"the schema mask adds {span(schema_over_plain)}x plain sampling's own time a row-token (batch "
            f"{' / '.join(str(r['batch']) for r in rows if r['setting'] == 'json_schema')})")
    model = t["plain2"]["model_id"]
    on = measured_on(machine(d["machine"], "with AMX"), f"the sampler alone ({threads(d['run']['threads'])}), then "
                     f"the server on {model} (the shipped Q4_1 GGUF, dequantised at load, in bf16 with 2 threads: docs), "
                     f"{t['plain2']['max_concurrency']} concurrent", days(v["date"] for v in t.values()))
    return Row(f"the sampler's extra work a row-token, {d['run']['vocab']:,}-token vocabulary, batch "
               f"{' and '.join(str(x) for x in sorted(plain_us))}; TPOT through the server", figure, lose, on,
               f"`benchmarks/sampling_cost.py`, `benchmarks/online_client.py --extra-body` (issue 29; {jpath(rel)}, "
               "`docs/benchmarks/structured/tpot/`)")


def int8_accuracy(b: Bench) -> Row:
    rel = "int8_accuracy.json"
    d = b(rel)
    res = {r["model"]: r for r in d["results"]}
    tf = lambda m, kind: [v[kind]["teacher_forced_top1"] for v in res[m]["dtypes"].values() if kind in v]  # noqa: E731
    eq = lambda m, kind: [v[kind]["greedy_all_equal"] for v in res[m]["dtypes"].values() if kind in v]  # noqa: E731
    p = lambda x: pct(x)  # noqa: E731
    randoms = [m for m in res if m != "smollm2"]
    figure = (f"kv-int8 teacher-forced top-1 agreement with the KV cache: SmolLM2 {span(tf('smollm2', 'kv-int8'), p)}% "
              f"(bf16 KV against fp32 KV: {span(tf('smollm2', 'kv vs fp32 kv'), p)}%), random "
              + ", ".join(f"{m} {span(tf(m, 'kv-int8'), p)}%" for m in randoms)
              + f"; {num(res['smollm2']['capacity']['bfloat16']['kv-int8']['vs_kv'])}x the tokens per page in bf16.")
    lose = (f"hidden-int8 on SmolLM2 {span(tf('smollm2', 'hidden-int8'), p)}%; free-running greedy text diverges: "
            f"{span(eq('smollm2', 'kv-int8'), p)}% of prompts' {d['max_tokens']} greedy tokens all equal with kv-int8 on "
            f"SmolLM2 (bf16 KV against fp32 KV: {span(eq('smollm2', 'kv vs fp32 kv'), p)}%)")
    on = measured_on(machine(d["cpu"]), "SmolLM2-135M-Instruct (the shipped Q4_1 GGUF, dequantised: docs) and random "
                     + ", ".join(randoms), " and ".join(DTYPES[k] for k in res["smollm2"]["dtypes"]),
                     threads(d["cpu"]["threads"]), docs("2026-12-01"))
    return Row("int8 cache kinds' accuracy and capacity", figure, lose, on, f"`benchmarks/int8_accuracy.py` (issue 13; {jpath(rel)})")


def quantized_weights(b: Bench) -> Row:
    rel = "quantized_weights.json"
    d = b(rel)
    res = {r["model"]: r for r in d["results"]}
    dtype = "bfloat16"
    rows = lambda m: res[m]["dtypes"][dtype]  # noqa: E731
    step = lambda m, q, shape: rows(m)[q]["step_s"][shape] / rows(m)["full"]["step_s"][shape]  # noqa: E731
    sm = rows("smollm2")
    figure = (f"SmolLM2-135M in int4 (its shipped Q4_1 codes kept, our kernels): {num(sm['int4']['weight_bytes'] / 1e6)} MB of tensors "
              f"against {num(sm['full']['weight_bytes'] / 1e6)} MB, {sm['int4']['kv_tokens_in_saved_bytes']:,} KV tokens more "
              f"in the same memory; teacher-forced top-1 agreement with full width {pct(sm['int4']['teacher_forced_top1'])}% "
              f"(int8 {pct(sm['int8']['teacher_forced_top1'])}%); a decode step of one request "
              f"{ratio(sm['int4']['step_s']['decode x1'], sm['full']['step_s']['decode x1'])} full width's "
              f"(int8 {ratio(sm['int8']['step_s']['decode x1'], sm['full']['step_s']['decode x1'])}); GPTQ, AWQ and "
              f"compressed-tensors checkpoints served in their codes at int4's and int8's speed.")
    both = lambda q, shape: span([step(m, q, shape) for m in res])  # noqa: E731
    lose = (f"batches and prefill: decode of 32 requests {both('int8', 'decode x32')}x (int8) and "
            f"{both('int4', 'decode x32')}x (int4) full width's, a 512-token prefill "
            f"{both('int8', 'prefill 512')}x and {both('int4', 'prefill 512')}x; the aims (TPOT 0.6x in int8, 0.45x "
            "in 4-bit) are not met at these sizes; no kernel of ours in float32 or on a GPU (served at full width "
            "there); the default model is served in int4 all the same (its shipped codes)")
    on = measured_on(machine(d["machine"]), "SmolLM2-135M-Instruct and random " + ", ".join(m for m in res if m != "smollm2"),
                     DTYPES[dtype], threads(d["run"]["threads"]), day(d["date"]))
    return Row("weights kept quantized (int8, int4)", figure, lose, on,
               f"`benchmarks/quantized_weights.py --dtypes bfloat16` (issue 43; {jpath(rel)})")


def fleet(b: Bench) -> Row:
    """Issue 31: the paper's table on the GPU cost model, autoscaling ahead of peaks, the router at scale."""
    rels = ("fleet/gpu_policies_a100.json", "fleet/gpu_policies_a100_tbt25.json", "fleet/gpu_policies_a100_opt30b.json",
            "fleet/autoscale.json", "fleet/router.json", "fleet/scale.json", "fleet/autoscale_serve.json",
            "fleet/gpu_policies_h100.json")
    tight, loose, big_model, scaling, routing, scale, in_serve, h100 = (b(r) for r in rels)
    h = {w: h100["workloads"][w]["effective_throughput"] for w in ("sharegpt", "longbench")}
    ours, ray = in_serve["runs"]["forecast"], in_serve["runs"]["default"]
    work = ("sharegpt", "longbench", "humaneval")

    def ratios(d: dict, base: str) -> str:
        eff = {w: d["workloads"][w]["effective_throughput"] for w in work}
        return " / ".join(ratio(eff[w]["apt"]["90"], eff[w][base]["90"]) for w in work)

    slo = lambda d: d["workloads"]["sharegpt"]["slo"]  # noqa: E731
    gains = {name: [r for r in scaling[name]["forecast_minus_default_at_equal_hours"] if r["peak_points"] is not None]
             for name in ("onoff", "diurnal")}
    auto = "; ".join(f"{name} " + ", ".join(f"{r['peak_points']:+.1f}" for r in rows) + " points (its targets "
                     + ", ".join(f"{r['target']:g}" for r in rows) + ")" if rows else f"{name}: not bracketed"
                     for name, rows in gains.items())
    big = max((r for r in scale["rows"] if r["policy"] == "apt"), key=lambda r: r["replicas"])
    route = {(r["replicas"], r["queue_lengths"]): r for r in routing["rows"]}[(big["replicas"], "filled")]
    b30 = {w: big_model["workloads"][w]["effective_throughput"] for w in ("sharegpt", "longbench")}
    what = ("the design on a simulated GPU fleet: OPT-13B on an A100-80GB roofline (`bench/gpu_cost.py`, factors set "
            "to published figures), the real engine, request router, admission and controller on one simulated clock")
    figure = (f"effective throughput at 90%, TTFT {num(slo(tight)['ttft_scale'])}x / P99 gap {num(slo(tight)['tbt_scale'])}x "
              f"the unloaded latency (ShareGPT / LongBench / HumanEval): apt **{ratios(tight, 'fcfs')}** fcfs' (vLLM 0.5; "
              f"the paper: {num(tight['paper_ratios_at_90']['fcfs'])}x on average), {ratios(tight, 'sarathi')} sarathi's "
              f"(paper {num(tight['paper_ratios_at_90']['sarathi'])}x); forecast-driven autoscaling over Ray Serve's default "
              f"at equal replica-hours, attainment at the peaks: {auto}; the request router at {big['replicas']} replicas: "
              f"{num(route['mean_ms'])} ms CPU a request (P99 {num(route['p99_ms'])}); {big['replicas']} replicas at "
              f"{num(big['rate'])} req/s simulated ({num(big['sim_s'])} s in {num(big['wall_s'])} s): "
              f"{pct(big['attainment'])}% attainment. Where memory binds (OPT-30B, 692 KV pages): apt "
              f"{ratio(b30['sharegpt']['apt']['90'], b30['sharegpt']['fcfs']['90'])} / "
              f"{ratio(b30['sharegpt']['apt']['90'], b30['sharegpt']['sarathi']['90'])} fcfs' / sarathi's on ShareGPT, within "
              f"25% of the paper's; every kind (int8 included) {ratio(b30['sharegpt']['apt-all']['90'], b30['sharegpt']['apt']['90'])} apt's.")
    lose = (f"with a loose gap target (P99 gap {num(slo(loose)['tbt_scale'])}x) apt is {ratios(loose, 'fcfs')} fcfs' and "
            f"{ratios(loose, 'sarathi')} sarathi's: our steps always carry every decode, and vLLM 0.5's prefill-only steps "
            "reach short prompts' first tokens sooner; on OPT-13B the paper's ratios are not within 25% in either setting; "
            f"on a simulated H100 (one seed) apt is {ratio(h['sharegpt']['apt']['90'], h['sharegpt']['sarathi']['90'])} / "
            f"{ratio(h['longbench']['apt']['90'], h['longbench']['sarathi']['90'])} sarathi's (ShareGPT / LongBench): "
            "whole long prompts in a step break the gaps (apt's step-time model, calibrated on chunks of at most 512 "
            "tokens, predicts 69.6 ms for a 2,048-token prefill that takes 110 ms: docs); the hybrid "
            "cache is never chosen (hidden decode projects K/V again: "
            f"{num(tight['cost_model']['rho_ms_per_page'])} ms a page a step on OPT-13B); the router's time inside the "
            f"fleet (wall, admission and prompt hashing included, on a busy box) {num(big['router_ms_mean'])} ms; no GPU "
            "has checked the cost model; the same policy in the real app on this CPU (1-2 OPT-125m replicas, on/off "
            f"{num(in_serve['shape']['low'])} <-> {num(in_serve['shape']['high'])} req/s) starts the second replica "
            f"{num(ours['peaks'][1]['serving_before_s'])} s before the second peak (Ray's default: "
            f"{num(ray['peaks'][1]['serving_before_s'])} s) and meets {pct(ours['attainment'])}% against "
            f"{pct(ray['attainment'])}% with {num(ours['replica_seconds'] / 3600)} against "
            f"{num(ray['replica_seconds'] / 3600)} replica-hours, but two CPU replicas on two cores serve a peak badly "
            f"({pct(ours['peak_attainment'])}% at the peaks; measured before the panel linears sped up this CPU's "
            "fp32 decode, not re-run)")
    on = measured_on(machine(tight["machine"]), "simulated A100-80GB (cost model), bf16 weights", day(tight["date"]))
    return Row(what, figure, lose, on, "`benchmarks/gpu_policies.py` (`--tbt-scale 25`, `--model opt-30b`), "
               f"`benchmarks/fleet_sim.py autoscale` / `router` / `scale`, `benchmarks/autoscale_serve.py` (issue 31; {jpath(*rels)})")


ROWS: list[Callable[[Bench], Row]] = [bursts_bf16, bursts_fp32, decision_cost, panels_xeon, serve_floor_xeon, engine_speed_xeon, engine_speed_bf16, engine_speed, prefix_reuse, socket_bytes,
                                     architectures, sampler, int8_accuracy, quantized_weights, fleet]

FOOTNOTES = [
    "Built by `scripts/readme_figures.py` from the JSON each row names (ratios, times and rates to 3 significant "
    "figures, percentages to one decimal; \"docs\" marks a field the JSON lacks, taken from that run's section of "
    "docs/benchmarks.md). Left out, no JSON behind them (docs/benchmarks.md has them): the decision's 9.6 ms before "
    "issue 44 and its first pair of runs (1.37 / 1.05 ms), the engine's 73.8 tok/s in process, the penalties' 715 us "
    "before `TokenCounts`, vLLM's bf16 step ~1.35x faster than ours (issue 41, superseded: our engine alone is now "
    "level with vLLM's whole server, the bf16 engine-speed row).",
    "Stale in two respects: the traffic-that-repeats-itself row ran with the tier below memory on a file-backed "
    "mapping, where demoting an evicted prefix page cost 2.2 ms; since 48ef6a3 it is anonymous memory (0.18 ms a page), faulted in ahead of use since c0de087. The "
    "float32 bursts row ran at c0de087, before 7f6ec87 changed `apt`'s reservation and write-off, and was not "
    "re-run (the bf16 row was, at f80ff03). Six seeds at CV 3 with 30% documents against vLLM, the tier on and off "
    "and the bf16 grid are in docs/benchmarks.md (\"Bursts: a chunk each in turn\", \"Bursts with the tier below "
    "memory on and off\", \"Bursts across the grid\"). Every row that runs the engine but the bf16 engine-speed "
    "row and the fp32 one (re-measured at issue 41's code: OPT-125m, OPT-350m, TinyLlama-1.1B) ran before c4665fc (prefill attention 0.51-0.70x the time a layer, a prefill step 0.76-0.93x) and ebb1db7 "
    "(compute threads bound to cores) and was not re-run; the engine-speed rows' probe repeated its eight "
    "single-stream prompts among the 64 saturated ones (prefix-cache hits for every server alike) until the commit "
    "after 61ca2f0. Every row measured on the default model through `serve_config.yaml` ran it at full width: since "
    "9fcf3cd the shipped config serves it in int4 (its shipped codes; through Serve TPOT 0.79x, TTFT 1.09x, saturated "
    "output 0.97x full width's, docs/benchmarks.md), and those rows were not re-run. Every bf16 row but the "
    "AVX512-BF16-without-AMX one ran before c077f90 (bf16 prefill GEMMs in float32 where a CPU runs that faster) on "
    "CPUs whose bf16 was the faster (Zen 5, AMX), where `measure_wide` keeps bf16 and nothing changes; not re-run "
    "there to confirm it. Every row measured on an AVX-512 CPU but the panel-linears one ran before 9e1c46d and "
    "ba9c7eb (64-channel panel linears: bf16 on AVX-512 without AMX, every step; float32, steps of at most 6 rows): "
    "on the AVX512-BF16-without-AMX Xeon the panel-linears row re-measures the engine-speed cells; the others "
    "(the Zen 5 rows among them) were not re-run.",
]


def build(bench_dir: Path = ROOT / "docs" / "benchmarks") -> str:
    """The table (with its footnote) that the JSON under ``bench_dir`` gives, between the markers."""
    b = Bench(bench_dir)
    lines = [BEGIN, *HEADER, *(row(b).line() for row in ROWS), "", *FOOTNOTES, END]
    return "\n".join(lines)


def split(readme: str) -> tuple[str, str, str]:
    i, j = readme.find(BEGIN), readme.find(END)
    if i < 0 or j < i:
        raise SystemExit(f"README has no {BEGIN} ... {END} block")
    return readme[:i], readme[i:j + len(END)], readme[j + len(END):]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 with a diff where README's table differs from the JSON's")
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    p.add_argument("--bench-dir", type=Path, default=ROOT / "docs" / "benchmarks", help="where the JSON is read")
    a = p.parse_args(argv)
    text = a.readme.read_text()
    head, current, tail = split(text)
    table = build(a.bench_dir)
    if a.check:
        if current == table:
            return 0
        for line in difflib.unified_diff(current.splitlines(), table.splitlines(), "README.md", "from the JSON",
                                         lineterm=""):
            print(line)
        print(f"\n{a.readme}: the figures table differs from the JSON; run python scripts/readme_figures.py")
        return 1
    if current != table:
        a.readme.write_text(head + table + tail)
        print(f"wrote {a.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
