"""Test-only policies shared by the cache tests."""

from __future__ import annotations

from apt_serve_ray.scheduler.policies.sarathi import SarathiPolicy


class UpgradeAt(SarathiPolicy):
    """Sarathi, but upgrades every running compressed request to KV once it has ``at`` output tokens."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def schedule(self, ctx):
        for r in list(ctx.running):
            if r.kind.is_compressed and r.num_output_tokens >= self.at:
                assert ctx.upgrade(r)
        super().schedule(ctx)
