"""What the Ray Serve path adds to TTFT and inter-token gaps, against the same engine in-process.

    python benchmarks/serve_overhead.py --dtype auto --num-threads 1 --json docs/benchmarks/serve_overhead.json

The same requests (token-id prompts, greedy, fixed output length) go one after another through four
paths: an ``AsyncLLMEngine`` here, the Serve app over HTTP, the app's handle, and the engine replica's
handle (with the engine's own TTFT, to tell a slower engine from slower transport); gaps per streamed
chunk (chunks per token says how often tokens were merged). Also the RSS of every process of the Ray
instance. Results: docs/serving.md ("What the Serve path costs").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from apt_serve_ray.bench.engine_args import Default, add_engine_args, engine_kwargs
from apt_serve_ray.bench.http_client import feed_sse
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.servers import local_serve, process_tree_rss

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-requests", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    add_engine_args(p, "num_threads", "dtype", "num_pages",
                    num_threads=Default(2, "both cores of the box this was measured on, as serve_config.yaml"),
                    dtype=Default("float32", "the figures in docs/serving.md were taken in float32 first"),
                    num_pages=Default(512, "room for every request: this measures transport, not memory"))
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray instance")
    p.add_argument("--json", help="also write the results to this file")
    return p.parse_args()


def app_args(a: argparse.Namespace) -> dict:
    return {"model": a.model, "num_replicas": 1, "num_cpus_per_replica": 1, **engine_kwargs(a), "max_num_seqs": 16}


def prompts(a: argparse.Namespace, vocab: int, num_paths: int = 4) -> list[list[list[int]]]:
    # Distinct, deterministic prompts of exactly prompt_len tokens (ids clear of special tokens), one for
    # each path at each turn: a prompt sent through one path would be a prefix-cache hit in the next
    # (the Serve paths share one engine).
    def one(i: int) -> list[int]:
        return [100 + (i * 7919 + j * 104729) % (vocab - 200) for j in range(a.prompt_len)]

    return [[one(num_paths * i + k) for k in range(num_paths)] for i in range(a.num_requests + 2)]


class Timeline:
    def __init__(self) -> None:
        self.engine_ttft: list[float] = []
        self.ttft: list[float] = []
        self.gaps: list[float] = []
        self.num_chunks = 0
        self.num_tokens = 0

    def record(self, start: float, arrivals: list[float], num_tokens: int) -> None:
        self.ttft.append(arrivals[0] - start)
        self.gaps += [b - a for a, b in zip(arrivals, arrivals[1:])]
        self.num_chunks += len(arrivals)
        self.num_tokens += num_tokens

    def summary(self) -> dict:
        def stats(xs):
            xs = sorted(xs)
            return {"mean_ms": 1000 * statistics.fmean(xs), "median_ms": 1000 * statistics.median(xs),
                    "p99_ms": 1000 * xs[min(len(xs) - 1, int(0.99 * len(xs)))]}
        out = {"ttft": stats(self.ttft), "gap": stats(self.gaps),
               "chunks_per_token": self.num_chunks / max(1, self.num_tokens)}
        if self.engine_ttft:
            out["engine_ttft"] = stats(self.engine_ttft)
        return out


# The four paths, one request each -----------------------------------------------------------------
# Each returns (start, arrival times of chunks with tokens, number of tokens[, engine's own TTFT]).
class InProcess:
    def __init__(self, a, config) -> None:
        from apt_serve_ray import AsyncLLMEngine, SamplingParams

        self.engine = AsyncLLMEngine(config)
        self.engine.start()
        self.params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
        self.loop = asyncio.new_event_loop()

    def __call__(self, prompt):
        async def one():
            start, arrivals, n = time.perf_counter(), [], 0
            async for out in self.engine.generate(prompt, self.params):
                arrivals.append(time.perf_counter())
                n = out.num_output_tokens
            return start, arrivals, n
        return self.loop.run_until_complete(one())

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.close()


# 2. and 3. Ray Serve -----------------------------------------------------------------------------
def _time_chunks(chunks) -> tuple[float, list[float], int]:
    """(start, arrival time of every chunk with text, completion tokens from the usage chunk)."""
    start, arrivals, n = time.perf_counter(), [], 0
    for chunk in chunks:
        if chunk["choices"] and chunk["choices"][0]["text"]:
            arrivals.append(time.perf_counter())
        if chunk.get("usage"):
            n = chunk["usage"]["completion_tokens"]
    return start, arrivals, n


def _sse_chunks(client, body):
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        pending = b""
        for data in r.iter_bytes():
            events, pending = feed_sse(pending, data)
            for event in events:
                if event.error is not None:
                    raise RuntimeError(event.error)
                if not event.is_done:
                    yield {"choices": [{"text": event.text}] if event.text else [],
                           "usage": {"completion_tokens": event.completion_tokens}
                           if event.completion_tokens is not None else None}


def http_request(a, client, prompt):
    body = {"model": a.model, "prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    return _time_chunks(_sse_chunks(client, body))


def app_handle_request(a, handle, prompt):
    body = {"model": a.model, "prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    return _time_chunks(handle.options(stream=True).completions_stream.remote(body))


def engine_handle_request(a, handle, prompt):
    from apt_serve_ray import SamplingParams
    from deployments.wire import EngineRequest

    request = EngineRequest(list(prompt), SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True),
                            f"overhead-{time.time()}")
    start, arrivals, n, last = time.perf_counter(), [], 0, None
    for item in handle.options(stream=True).generate.remote(request):
        if item.token_ids:
            arrivals.append(time.perf_counter())
            n += len(item.token_ids)
        last = item
    return start, arrivals, n, last.engine_ttft_s


def main() -> None:
    a = parse_args()
    from deployments.app import AppArgs, build_app

    args = app_args(a)
    config = AppArgs.model_validate(args).engine_config()
    from apt_serve_ray.models.loader import load_tokenizer, resolve_model

    requests = prompts(a, len(load_tokenizer(resolve_model(a.model))))
    print(f"model {a.model}: {a.num_requests} requests of {a.prompt_len} prompt tokens -> {a.max_tokens} tokens, "
          "one at a time, each through every path in turn (so a busy moment hits all paths alike)", flush=True)
    in_process = InProcess(a, config)

    import httpx
    from ray import serve

    try:
        with local_serve(a.num_cpus) as port:
            serve.run(build_app(args), name="overhead", route_prefix="/")
            app_handle = serve.get_app_handle("overhead")
            engine = serve.get_deployment_handle("EngineReplica", "overhead")
            timelines = {name: Timeline() for name in ("in_process", "serve_http", "serve_handle", "engine_handle")}
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
                paths = {"in_process": in_process, "serve_http": lambda p: http_request(a, client, p),
                         "serve_handle": lambda p: app_handle_request(a, app_handle, p),
                         "engine_handle": lambda p: engine_handle_request(a, engine, p)}
                for i, turn in enumerate(requests):
                    for (name, path), prompt in zip(paths.items(), turn):
                        start, arrivals, n, *engine_ttft = path(prompt)
                        if i >= 2:  # the first two warm up
                            timelines[name].record(start, arrivals, n)
                            timelines[name].engine_ttft += engine_ttft
            results = {name: t.summary() for name, t in timelines.items()}
            memory = process_tree_rss(os.getpid(), include_root=False)  # the Ray instance this process started
    finally:
        in_process.close()

    base = results["in_process"]
    print(f"\n{'path':<14}{'TTFT mean':>11}{'median':>9}{'p99':>9}{'gap mean':>10}{'median':>9}{'p99':>9}"
          f"{'chunks/token':>14}")
    for name, r in results.items():
        print(f"{name:<14}{r['ttft']['mean_ms']:>9.1f}ms{r['ttft']['median_ms']:>7.1f}ms{r['ttft']['p99_ms']:>7.1f}ms"
              f"{r['gap']['mean_ms']:>8.2f}ms{r['gap']['median_ms']:>7.2f}ms{r['gap']['p99_ms']:>7.2f}ms"
              f"{r['chunks_per_token']:>14.2f}")
    for name in ("serve_http", "serve_handle", "engine_handle"):
        r = results[name]
        print(f"{name} adds: TTFT {r['ttft']['median_ms'] - base['ttft']['median_ms']:+.1f} ms (median), "
              f"gap {r['gap']['median_ms'] - base['gap']['median_ms']:+.2f} ms (median), "
              f"{r['gap']['p99_ms'] - base['gap']['p99_ms']:+.2f} ms (p99)")
    engine_ttft = results["engine_handle"]["engine_ttft"]["median_ms"]
    print(f"TTFT inside the engine replica (engine's own clock): {engine_ttft:.1f} ms median vs "
          f"{base['ttft']['median_ms']:.1f} ms in-process")
    print("\nRSS of the Ray instance (MiB), largest first:")
    for name, mib in sorted(memory.items(), key=lambda kv: -kv[1]):
        print(f"  {mib:8.1f}  {name}")
    app = sum(m for n, m in memory.items() if "ServeReplica" in n)
    print(f"  {app:8.1f}  = the app's replicas;  {sum(memory.values()):.1f} = the whole Ray instance")
    results["rss_mib"] = memory
    if a.json:
        header = stamp(threads=a.num_threads, dtype=a.dtype, model=a.model, simulated=False)
        write_json(a.json, results, header, indent=2)


if __name__ == "__main__":
    main()
