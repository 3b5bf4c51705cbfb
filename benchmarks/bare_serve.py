"""The smallest Ray Serve HTTP app: one deployment that answers ``/v1/models`` and nothing else.

``peer_sweep.py --start engine --beside bare-serve`` keeps it running, idle, beside the in-process
engine's probe: what Ray Serve itself (GCS, raylet, dashboard, Serve's controller, the HTTP proxy, one
replica) costs an engine that computes on every core, before any deployment of ours exists.

    serve run benchmarks.bare_serve:app     # from the repository root
"""

from ray import serve


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Models:
    async def __call__(self, request) -> dict:
        return {"object": "list", "data": [{"id": "bare-serve", "object": "model", "owned_by": "bare-serve"}]}


app = Models.bind()
