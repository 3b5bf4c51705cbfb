"""README's figures table against the benchmark JSON it is built from (scripts/readme_figures.py)."""

import json
import shutil
from pathlib import Path

import pytest

from tests.bench.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


rf = load_script("scripts/readme_figures.py")


def _copy_used_json(tmp_path: Path) -> tuple[Path, list[str]]:
    """A copy of only the JSON files the table reads (the folder holds many MB of others)."""
    bench = rf.Bench(ROOT / "docs" / "benchmarks")
    for row in rf.ROWS:
        row(bench)
    dst = tmp_path / "benchmarks"
    for rel in bench.used:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(bench.root / rel, dst / rel)
    return dst, bench.used


def test_readme_table_is_what_the_json_gives(capsys):
    assert rf.main(["--check"]) == 0, capsys.readouterr().out


def test_every_row_reads_json_and_names_it():
    bench = rf.Bench(ROOT / "docs" / "benchmarks")
    for row in rf.ROWS:
        fresh = rf.Bench(bench.root)
        line = row(fresh).line()
        assert fresh.used, row.__name__
        for rel in fresh.used:  # every JSON a row reads is named in its command cell (or its folder is)
            assert f"docs/benchmarks/{rel}`" in line or f"docs/benchmarks/{Path(rel).parent}/`" in line, (row.__name__, rel)
        assert "**Where we lose**" in line, row.__name__


def test_a_changed_number_in_the_json_fails_the_check(tmp_path, capsys):
    bench_dir, _ = _copy_used_json(tmp_path)
    readme = tmp_path / "README.md"
    shutil.copyfile(ROOT / "README.md", readme)
    # the copy as it is passes ...
    assert rf.main(["--check", "--readme", str(readme), "--bench-dir", str(bench_dir)]) == 0
    # ... and one goodput in the prefix-reuse run moved (0.098 -> 0.090 req/s at 0.3 sessions/s) does not
    path = bench_dir / "prefix" / "serve_fp32_epyc.json"
    doc = json.loads(path.read_text())
    run = next(a for a in doc["results"]["ours"] if a["rate"] == 0.3)
    run["all"]["goodput"] = 0.090
    path.write_text(json.dumps(doc))
    capsys.readouterr()
    assert rf.main(["--check", "--readme", str(readme), "--bench-dir", str(bench_dir)]) == 1
    out = capsys.readouterr().out
    removed = [l for l in out.splitlines() if l.startswith("-| ")]
    added = [l for l in out.splitlines() if l.startswith("+| ")]
    assert len(removed) == len(added) == 1 and "**traffic that repeats itself**" in removed[0]
    assert "**6.70x / 11.3x / 8.04x**" in removed[0] and "**6.70x / 10.3x / 8.04x**" in added[0]
    # writing brings README back in line with the JSON, and only the table changes
    before = readme.read_text()
    assert rf.main(["--readme", str(readme), "--bench-dir", str(bench_dir)]) == 0
    assert rf.main(["--check", "--readme", str(readme), "--bench-dir", str(bench_dir)]) == 0
    after = readme.read_text()
    assert after.split(rf.BEGIN)[0] == before.split(rf.BEGIN)[0]
    assert after.split(rf.END)[1] == before.split(rf.END)[1]


@pytest.mark.parametrize("rel, edit, gone", [
    ("burst/serve_cv4_s40_f80ff03.json", lambda d: d["runs"]["serve:ours"]["results"][0]["chat"].update(attainment=0.5),
     "**91.1 / 97.7 / 81.2%**"),
    # what the row shows now, read from the JSON (a re-run of the benchmark changes it, not this test)
    ("burst/scheduler_overhead_fewest.json", lambda d: d["results"][0].update(full_decision_ms=1.2),
     lambda d: f"**{rf.num(d['results'][0]['full_decision_ms'])} ms**"),
    ("architectures.json", lambda d: d["rows"][-1].update(over_llama=3.1), "2.57-2.87x"),
    ("engine_speed/probe_pass2.json",
     lambda d: d["servers"]["engine-bfloat16-2t"]["probe"]["saturated"].update(output_throughput=300.0), "436 tok/s"),
])
def test_other_rows_follow_their_json(tmp_path, rel, edit, gone):
    bench_dir, _ = _copy_used_json(tmp_path)
    doc = json.loads((bench_dir / rel).read_text())
    gone = gone(doc) if callable(gone) else gone
    edit(doc)
    (bench_dir / rel).write_text(json.dumps(doc))
    assert gone in rf.build(ROOT / "docs" / "benchmarks")
    assert gone not in rf.build(bench_dir)


def test_rounding_is_one_rule():
    assert [rf.num(x) for x in (11.27485, 0.8106, 2.5, 0.09, 9.996, 134999.77, 4510.5)] == [
        "11.3", "0.811", "2.50", "0.0900", "10.0", "135,000", "4,510"]
    assert rf.pct(0.5625) == "56.2" and rf.pct(0.35833) == "35.8"


def test_the_script_imports_neither_torch_nor_ray_nor_the_engine():
    src = (ROOT / "scripts" / "readme_figures.py").read_text()
    imports = {line.split()[1].split(".")[0] for line in src.splitlines() if line.startswith(("import ", "from "))}
    assert imports <= {"__future__", "argparse", "difflib", "json", "math", "sys", "pathlib", "typing", "numpy"}, imports
