"""The serving-bench harness: engine flags -> EngineConfig, the report stamp, fresh token ids per
run, and the server commands."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np
import pytest

from apt_serve_ray.bench import servers
from apt_serve_ray.bench.conversations import ConversationSpec, make_sessions, shared_token_share
from apt_serve_ray.bench.engine_args import (COMMON, PEER_MATCHED, Default, add_engine_args, app_args,
                                             engine_kwargs)
from apt_serve_ray.bench.report import RUN_FIELDS, STAMP_FIELDS, stamp, write_json
from apt_serve_ray.bench.workloads import Uniform, fill_token_ids, fresh_ids, make_trace
from apt_serve_ray.config import EngineConfig


# Engine flags ------------------------------------------------------------------------------------
def test_engine_flags_default_to_engine_config_and_map_back_to_it():
    p = add_engine_args(argparse.ArgumentParser())
    args = p.parse_args([])
    assert {name: getattr(args, name) for name in COMMON} == {
        name: getattr(EngineConfig(), name) for name in COMMON}
    # Flags left at None are left to the engine; the rest become EngineConfig fields as given.
    assert engine_kwargs(args) == {k: v for k, v in dataclasses.asdict(EngineConfig()).items()
                                   if k in COMMON and v is not None}
    args = p.parse_args(["--dtype", "float32", "--threads", "2", "--num-pages", "100", "--max-model-len", "512",
                         "--max-num-batched-tokens", "256", "--max-num-seqs", "8"])
    config = EngineConfig(**engine_kwargs(args, policy="sarathi"))
    assert (config.dtype, config.num_threads, config.num_pages, config.max_model_len) == ("float32", 2, 100, 512)
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.policy) == (256, 8, "sarathi")
    assert p.parse_args(["--num-threads", "3"]).num_threads == 3  # the older spelling still works


def test_a_benchmark_default_needs_a_reason_and_shows_it():
    p = add_engine_args(argparse.ArgumentParser(), "num_pages", "cache_kinds", "swap_space",
                        num_pages=PEER_MATCHED["num_pages"])
    assert p.parse_args([]).num_pages == 378 and p.parse_args([]).swap_space == EngineConfig.swap_space
    assert "vLLM peer" in p.format_help() and "EngineConfig's, 4.0" in p.format_help()
    assert not hasattr(p.parse_args([]), "dtype")  # only the flags asked for
    with pytest.raises(TypeError, match="Default"):
        add_engine_args(argparse.ArgumentParser(), num_pages=96)
    with pytest.raises(ValueError, match="why"):
        Default(96, " ")
    with pytest.raises(ValueError, match="no flag"):
        add_engine_args(argparse.ArgumentParser(), "no_such_field")
    # Kinds space- or comma-separated (both spellings are in use), checked, a tuple for the engine.
    args = p.parse_args(["--cache-kinds", "hidden,kv-int8", "hidden-int8"])
    assert engine_kwargs(args)["cache_kinds"] == ("hidden", "kv-int8", "hidden-int8")
    with pytest.raises(SystemExit):
        p.parse_args(["--cache-kinds", "kv-int4"])


def test_dtype_choices_can_be_narrowed():
    p = add_engine_args(argparse.ArgumentParser(), "dtype", dtype=Default("float32", "the peer's", ("float32",)))
    assert p.parse_args([]).dtype == "float32"
    with pytest.raises(SystemExit):
        p.parse_args(["--dtype", "auto"])


def test_app_args_are_what_serve_run_parses():
    assert app_args({"num_pages": 378, "cache_kinds": ("hidden", "kv-int8"), "enable_watermarks": False,
                     "policy_options": {"write_off_late": False}, "swap_space": 4.0}) == [
        "num_pages=378", "cache_kinds=[hidden,kv-int8]", "enable_watermarks=false",
        'policy_options={"write_off_late": false}', "swap_space=4.0"]


# The stamp ---------------------------------------------------------------------------------------
def test_every_json_carries_the_stamp(tmp_path):
    header = stamp(threads=1, dtype="float32", model="opt-125m", simulated=True, rates=[0.5])
    assert set(STAMP_FIELDS) <= set(header) and set(RUN_FIELDS) <= set(header["run"])
    assert header["run"]["rates"] == [0.5] and header["run"]["simulated"] is True
    m = header["machine"]
    assert m["cpu"] and isinstance(m["native_bf16"], bool) and isinstance(m["cpu_flags"], list)
    assert all(f.startswith(("avx", "amx", "fma", "f16c", "sse4", "vnni")) for f in m["cpu_flags"])
    assert header["git"] and len(header["date"]) == 19
    path = write_json(tmp_path / "sub" / "out.json",
                      {"x": np.float64(1.5), "n": np.int64(3), "inf": math.inf, "nan": float("nan")}, header)
    doc = json.loads(path.read_text())  # strict JSON: no Infinity / NaN
    assert doc["x"] == 1.5 and doc["n"] == 3 and doc["inf"] is None and doc["nan"] is None
    assert doc["run"]["model"] == "opt-125m"
    with pytest.raises(ValueError, match="stamp"):
        write_json(tmp_path / "bad.json", {}, {"git": "x"})
    with pytest.raises(TypeError):
        stamp(threads=1, dtype="float32", model="m")  # real or simulated must be said


# Fresh token ids ---------------------------------------------------------------------------------
def test_fresh_trace_ids_differ_across_rate_and_seed_and_keep_the_requests():
    base = fill_token_ids(make_trace("sharegpt", 20, 1.0, seed=0, max_model_len=1024), 49152, 0)
    a, b, c = (fresh_ids(base, 49152, seed, rate) for seed, rate in ((0, 0.5), (0, 1.0), (1, 0.5)))
    assert fresh_ids(base, 49152, 0, 0.5) == a  # deterministic
    for x, y in ((a, b), (a, c), (b, c), (a, base)):
        assert all(r.prompt_token_ids != s.prompt_token_ids for r, s in zip(x, y))
    for x in (a, b, c):
        assert [(r.request_id, r.prompt_len, r.output_len, r.arrival_s) for r in x] == \
            [(r.request_id, r.prompt_len, r.output_len, r.arrival_s) for r in base]
        assert all(len(r.prompt_token_ids) == r.prompt_len for r in x)
    # runs that share a seed and a rate (several traces on one server) are told apart by name
    assert fresh_ids(base, 49152, 0, 0.5, run="cv4")[0].prompt_token_ids != a[0].prompt_token_ids


def test_fresh_session_ids_differ_across_rate_and_seed_and_keep_what_is_shared():
    spec = ConversationSpec(num_sessions=12, num_groups=2, num_documents=2, turns=Uniform(2, 3))
    base = make_sessions(spec, 0.5, seed=0)
    runs = [fresh_ids(base, spec.vocab_size, seed, rate) for seed, rate in ((0, 0.5), (0, 1.0), (1, 0.5))]
    for x, y in ((runs[0], runs[1]), (runs[0], runs[2]), (runs[0], base)):
        assert all(s.prefix != t.prefix for s, t in zip(x, y))
    for run in runs:
        assert shared_token_share(run) == shared_token_share(base)
        for s, t in zip(run, base):
            assert [len(m) for m in s.messages] == [len(m) for m in t.messages] and s.start_s == t.start_s
        # sessions that shared a system prompt or a document still share it, and no others do
        for s, s0 in zip(run, base):
            for t, t0 in zip(run, base):
                assert (s.prefix == t.prefix) == (s0.prefix == t0.prefix)


# Servers -----------------------------------------------------------------------------------------
def test_our_server_and_the_peer_get_the_same_settings(monkeypatch):
    engine = {"dtype": "float32", "num_threads": 2, "num_pages": 378, "max_model_len": 2048,
              "max_num_batched_tokens": 512, "max_num_seqs": 64}
    ours = servers.ours({**engine, "policy": "apt"}, model="/ckpt", served_model_name="opt-125m", extra=["x=1"])
    assert ours.cmd[1:3] == ["run", "deployments.app:build_app"] and ours.port == servers.OURS_PORT
    assert {"model=/ckpt", "num_pages=378", "num_threads=2", "policy=apt", "x=1"} <= set(ours.cmd)
    assert str(servers.REPO) in ours.env["PYTHONPATH"].split(":")
    monkeypatch.setenv("PEER", "/peer")
    peer = servers.vllm(engine, model="/ckpt", served_model_name="opt-125m", extra=["--flag"])
    flags = dict(zip(peer.cmd[4::2], peer.cmd[5::2]))
    assert flags["--num-gpu-blocks-override"] == "189" and flags["--block-size"] == "32"  # the same bytes
    assert flags["--max-num-batched-tokens"] == "512" and flags["--dtype"] == "float32"
    assert peer.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and peer.cmd[-1] == "--flag"
    monkeypatch.delenv("PEER")
    with pytest.raises(SystemExit, match="PEER"):
        servers.vllm(engine, model="/ckpt", served_model_name="m")


def test_a_server_is_stopped_with_its_whole_process_group(tmp_path):
    import os
    import subprocess
    import sys
    import time

    # A "server" that answers /v1/models and leaves a child behind; stop_server ends both.
    port = servers.free_port()
    code = ("import http.server, subprocess, sys\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        self.send_response(200); self.end_headers(); self.wfile.write(b'{}')\n"
            "    def log_message(self, *a): pass\n"
            f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    spec = servers.ServerSpec("fake", [sys.executable, "-c", code], dict(os.environ), port)
    with servers.running(spec, tmp_path / "log.txt", timeout_s=30) as proc:
        assert servers.answers(port)
        group = proc.pid
        members = subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True).stdout.split()
        assert len(members) == 2
    assert proc.returncode is not None and not servers.answers(port)
    for _ in range(50):  # none left (the child, killed, is gone once reaped)
        if subprocess.run(["pgrep", "-g", str(group)], capture_output=True).returncode == 1:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"processes of group {group} outlived stop_server")


# Plots -------------------------------------------------------------------------------------------
def test_the_benchmarks_plots_render(tmp_path):
    from apt_serve_ray.bench import plots
    from apt_serve_ray.bench.rate_shapes import OnOff, make_shaped_trace
    from apt_serve_ray.bench.workloads import ServiceClass

    pts = {"apt": [(1.0, 0.95), (2.0, 0.5)], "fcfs": [(1.0, 0.9), (2.0, 0.2)]}
    shape = OnOff(1.0, 4.0, 10.0)
    trace = make_shaped_trace("humaneval", 30, shape, seed=0)
    requests = [{"arrival_s": r.arrival_s, "passed": i % 3 != 0} for i, r in enumerate(trace)]
    run = {"forecasts": [{"t": float(t), "rate": 2.0, "low": 1.0, "high": 3.0} for t in range(8)],
           "decisions": [{"t": 3.0, "replica": None, "actions": ["raise_hidden_target"]}],
           "requests": requests, "attainment": 0.66}
    classes = [ServiceClass("interactive", 0.3, 1000, 100, 0), ServiceClass("batch", 0.7, 30000, 1000, 10)]
    waits = {"apt": {"1.0": {"max_wait_time_s": 60.0, "classes": {c.name: {"max_pending_s": 2.0} for c in classes}}}}
    paths = [plots.plot_attainment(pts, tmp_path / "a.png"),
             plots.plot_attainment_panels({"all": pts, "chat": pts}, tmp_path / "p.png"),
             plots.plot_forecast(run, trace, shape, 5.0, tmp_path / "f.png"),
             plots.plot_phases({"runs": {"predictive": {"on/off": run}}}, shape, tmp_path / "ph.png"),
             plots.plot_longest_waits(waits, classes, tmp_path / "w.png")]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    edges, share, count = plots.attainment_by_phase(requests, shape)
    assert count.sum() == len(requests) and np.nanmax(share) <= 1.0 and len(edges) == len(share) + 1
