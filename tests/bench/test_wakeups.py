"""benchmarks/wakeups.py: the census counts a thread's wake-ups and CPU, named by process and thread."""

import threading
import time
from pathlib import Path

from tests.bench.scripts import load_script


def load():
    return load_script("benchmarks/wakeups.py")


def test_census_counts_a_thread_that_wakes_every_2_ms():
    wakeups = load()
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            time.sleep(0.002)

    t = threading.Thread(target=ticker, name="ticker")
    t.start()
    try:
        time.sleep(0.05)  # born before the first read: a thread born in the window is not counted
        result = wakeups.census(1.0)
    finally:
        stop.set()
        t.join()
    mine = [r for r in result["threads"] if r["tid"] == t.native_id]
    assert len(mine) == 1 and mine[0]["thread"]  # its comm (Python 3.11 leaves it the process's)
    assert 100 < mine[0]["wakeups_per_s"] <= 600  # ~500 a second, fewer on a busy machine
    me = [p for p in result["processes"] if p["pid"] == __import__("os").getpid()]
    assert me and me[0]["wakeups_per_s"] >= mine[0]["wakeups_per_s"] and me[0]["threads"] >= 2
    assert result["total_wakeups_per_s"] >= me[0]["wakeups_per_s"]


def test_ray_workers_go_by_their_ray_name(tmp_path, monkeypatch):
    wakeups = load()
    proc = tmp_path / "proc" / "42"
    proc.mkdir(parents=True)
    (proc / "cmdline").write_bytes(b"ray::ServeReplica:apt-serve:Router\0\0")
    real = Path
    monkeypatch.setattr(wakeups, "Path", lambda p: real(str(p).replace("/proc", str(tmp_path / "proc"), 1)))
    assert wakeups.process_name(42) == "ray::ServeReplica:apt-serve:Router"
    (proc / "cmdline").write_bytes(b"/usr/bin/python3\0/long/path/to/some/script_that_runs.py\0--flag\0")
    assert wakeups.process_name(42) == "python3 /long/path/to/some/script_that_runs.py --flag"
    (proc / "cmdline").write_bytes(b"")
    assert wakeups.process_name(42) is None


def test_the_census_of_servers_is_checked(capsys):
    import pytest

    wakeups = load()
    for argv in (["--seconds", "0"], ["--saturate", "-1"], ["--start", "nginx"]):
        with pytest.raises(SystemExit) as exc:
            wakeups.main(argv)
        assert exc.value.code == 2
    assert "--seconds" in capsys.readouterr().err
