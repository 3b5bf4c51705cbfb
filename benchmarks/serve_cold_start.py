"""Cold start of ``serve run serve_config.yaml`` to the first chat answer, and the memory of the whole app.

    python benchmarks/serve_cold_start.py [--config serve_config.yaml] [--json out.json]

Starts the server (needs port 8000 free; ``bench/servers.py``), polls ``/health``, sends one chat
request, prints the RSS of every process of that Ray instance (they all descend from ``serve run``),
then stops the server by its process group (it takes its Ray instance with it).
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path

from apt_serve_ray.bench import servers
from apt_serve_ray.bench.report import stamp, write_json

QUESTION = "What is the capital of France? Answer in one sentence."


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="serve_config.yaml")
    p.add_argument("--model", default="smollm2-135m-instruct", help="the served model name the chat asks")
    p.add_argument("--log", type=Path, default=Path("/tmp/serve_cold_start.log"))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    spec = servers.ours(config=args.config)
    t0 = time.monotonic()
    with servers.running(spec, args.log, ready_path="/health") as proc:
        healthy_s = time.monotonic() - t0
        body = {"model": args.model, "max_tokens": 40, "temperature": 0,
                "messages": [{"role": "user", "content": QUESTION}]}
        request = urllib.request.Request(f"{spec.base_url}/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as resp:
            answer = json.loads(resp.read())
        first_answer_s = time.monotonic() - t0
        rss = servers.process_tree_rss(proc.pid)
    print(f"healthy after {healthy_s:.1f} s, first chat answer after {first_answer_s:.1f} s\n"
          f"{answer['choices'][0]['message']['content']!r}")
    print("RSS (MiB) of the Ray instance started by serve run:")
    for name, mib in sorted(rss.items(), key=lambda kv: -kv[1]):
        print(f"  {mib:8.1f}  {name}")
    print(f"  {sum(rss.values()):8.1f}  total")
    if args.json:
        header = stamp(threads=None, dtype=None, model=args.model, simulated=False, config=args.config)
        write_json(args.json, {"healthy_s": healthy_s, "first_answer_s": first_answer_s, "answer": answer,
                               "rss_mib": rss}, header)


if __name__ == "__main__":
    main()
