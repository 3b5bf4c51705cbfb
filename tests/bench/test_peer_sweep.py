"""peer_sweep.py's arguments: --beside (an idle server beside the in-process engine's probe)."""

import asyncio

import pytest

from tests.bench.scripts import load_script


def load(name: str):
    return load_script(f"benchmarks/{name}.py")


@pytest.fixture(scope="module")
def peer_sweep():
    return load("peer_sweep")


@pytest.mark.parametrize("argv", [["--label", "x", "--beside", "app"],
                                  ["--label", "x", "--start", "ours", "--beside", "bare-serve"],
                                  ["--label", "x", "--start", "engine", "--beside", "nothing", "--probe-only"]])
def test_beside_is_refused_without_the_in_process_engine(peer_sweep, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        peer_sweep.main(argv)
    assert exc.value.code == 2 and "--beside" in capsys.readouterr().err


def _args(peer_sweep, beside, tmp_path):
    return peer_sweep.parse_args(["--label", "x", "--start", "engine", "--probe-only", "--beside", beside,
                                  "--cache-dir", str(tmp_path)])


def test_beside_starts_bare_serve_or_our_app_on_ours_port(peer_sweep, tmp_path, monkeypatch):
    monkeypatch.setattr(peer_sweep, "random_checkpoint", lambda shape, cache_dir: str(tmp_path / shape))
    bare = peer_sweep.beside_spec(_args(peer_sweep, "bare-serve", tmp_path))
    assert bare.cmd[-2:] == ["run", "benchmarks.bare_serve:app"] and bare.port == 8000
    args = _args(peer_sweep, "app", tmp_path)
    app = peer_sweep.beside_spec(args)
    ours = peer_sweep.start_spec(type(args)(**{**vars(args), "start": "ours"}))
    assert app.cmd == ours.cmd and "deployments.app:build_app" in app.cmd


def test_the_bare_app_answers_models():
    bare = load("bare_serve")
    body = asyncio.run(bare.Models.func_or_class()(None))
    assert body["object"] == "list" and body["data"][0]["id"] == "bare-serve"
