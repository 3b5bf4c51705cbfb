"""The engine library's dependencies match its layering: no module of ``apt_serve_ray`` imports Ray,
the web framework or the plotting and benchmark-client libraries when it is imported (pyproject:
those are the ``serve`` and ``bench`` extras; matplotlib may be imported inside the functions that
draw), so an engine-only install works."""

import ast
import subprocess
import sys
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[2] / "apt_serve_ray"
SERVE_AND_BENCH = {"ray", "fastapi", "starlette", "pydantic", "matplotlib", "aiohttp", "tqdm", "deployments"}
BENCH_ONLY = {"apt_serve_ray/bench/plots.py": {"matplotlib"}}  # benchmark plots: the bench extra


def module_level_imports(path: Path) -> set[str]:
    """Top-level package names imported when the module is imported (not inside functions)."""
    names: set[str] = set()

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, (ast.If, ast.Try, ast.With)):  # still runs at import time
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit(getattr(node, field, []))
            elif isinstance(node, ast.ExceptHandler):
                visit(node.body)
            elif isinstance(node, ast.ClassDef):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    return names


def test_no_library_module_imports_serve_or_bench_packages():
    bad = {}
    for path in sorted(LIBRARY.rglob("*.py")):
        rel = str(path.relative_to(LIBRARY.parent))
        found = (module_level_imports(path) & SERVE_AND_BENCH) - BENCH_ONLY.get(rel, set())
        if found:
            bad[rel] = sorted(found)
    assert not bad, f"the engine library imports serve/bench packages at import time: {bad}"


def test_module_level_imports_sees_imports_that_run_at_import_time():
    source = "import os\ntry:\n    import ray.util\nexcept ImportError:\n    pass\ndef f():\n    import tqdm\n"
    path = Path(__file__).with_name("_layering_probe.py")
    try:
        path.write_text(source)
        assert module_level_imports(path) == {"os", "ray"}
    finally:
        path.unlink()


def test_importing_the_whole_library_leaves_ray_and_the_web_framework_unloaded():
    probe = (
        "import importlib, pkgutil, sys\n"
        "import apt_serve_ray\n"
        "for info in pkgutil.walk_packages(apt_serve_ray.__path__, 'apt_serve_ray.'):\n"
        "    if info.name != 'apt_serve_ray.bench.plots':\n"
        "        importlib.import_module(info.name)\n"
        "print(sorted(m for m in ('ray', 'fastapi', 'starlette', 'deployments') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                            cwd=LIBRARY.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
