"""The names the project's first sketches used (``apt_serve``) work as written there, and are
``apt_serve_ray``'s own objects."""

from __future__ import annotations


def test_the_apt_serve_names_are_apt_serve_rays(opt_tiny, tmp_path, monkeypatch):
    from apt_serve import HybridCacheLLM, SamplingParams
    from apt_serve.monitor import CacheTracker
    from apt_serve.predictor import TrafficPredictor

    import apt_serve_ray
    from apt_serve_ray.scheduler.predictor import TrafficPredictor as Ours

    assert HybridCacheLLM is apt_serve_ray.HybridCacheLLM and CacheTracker is apt_serve_ray.CacheTracker
    assert TrafficPredictor is Ours
    # The sketch's lines, with a local checkpoint for the model.
    llm = HybridCacheLLM(model=opt_tiny, num_pages=64)
    tracker = CacheTracker(llm)
    outputs = llm.generate(["The hybrid cache"], SamplingParams(max_tokens=8, temperature=0))
    assert len(outputs[0].outputs[0].token_ids) == 8 and tracker.samples
    monkeypatch.chdir(tmp_path)
    path = tracker.plot_memory_timeline()  # no argument: a file in the working directory
    assert (tmp_path / "memory_timeline.png").exists() and path.endswith("memory_timeline.png")
    predictor = TrafficPredictor(history_window=60)
    for t in range(30):
        predictor.observe(float(t), arrivals=2)
    assert predictor.num_observed > 0 and predictor.forecast(10.0).arrival_rate > 0
