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


# The folders are layers (docs/architecture.md): a module may import its own layer and those below it,
# never one above (within its own folder, anything). Imports inside functions count too (they still tie
# the layers together); those only for type checkers do not.
LAYERS = [
    {"engine", "bench", "observability"},
    {"worker"},
    {"scheduler"},
    {"models", "attention", "kernels", "sampling", "lora"},
    {"cache"},
    # shared by every layer: the settings, a request and what it carries (its cache kind, sampling
    # parameters, gap budget), the facts of this CPU
    {"config", "request", "cache.kinds", "sampling.params", "scheduler.gap_budget", "worker.cpu_info"},
]
# ``config.py`` validates every layer's settings against the names each layer defines (policies,
# attention backends, retentions, grammar backends, the default model): it may read any layer.
READS_EVERY_LAYER = {"config.py"}


def layer_of(module: str) -> int | None:
    """The layer of ``apt_serve_ray.<module...>``: the most specific entry of ``LAYERS`` that names it."""
    parts = module.split(".")[1:]
    for depth in (2, 1):
        name = ".".join(parts[:depth])
        for index, layer in enumerate(LAYERS):
            if name in layer:
                return index
    return None


def library_imports(path: Path) -> set[str]:
    names = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # drop ``if TYPE_CHECKING:`` blocks
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("apt_serve_ray."):
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith("apt_serve_ray."))
    return names


def test_every_library_module_belongs_to_a_layer():
    unplaced = [str(p.relative_to(LIBRARY)) for p in LIBRARY.rglob("*.py")
                if p.name != "__init__.py" or p.parent != LIBRARY]
    unplaced = [rel for rel in unplaced if layer_of("apt_serve_ray." + rel[:-3].replace("/", ".")) is None]
    assert not unplaced, f"modules outside every layer: {unplaced}"


def test_no_layer_imports_a_layer_above_it():
    upward = []
    for path in sorted(LIBRARY.rglob("*.py")):
        if path.parent == LIBRARY and path.name in {"__init__.py", *READS_EVERY_LAYER}:
            continue  # the package root re-exports the public names of every layer
        module = "apt_serve_ray." + str(path.relative_to(LIBRARY))[:-3].replace("/", ".")
        own = layer_of(module)
        for name in library_imports(path):
            target = layer_of(name)
            same_folder = name.split(".")[1] == module.split(".")[1]
            if target is not None and target < own and not same_folder:
                upward.append(f"{path.relative_to(LIBRARY)} -> {name}")
    assert not upward, f"imports from a higher layer: {upward}"


def test_layer_check_sees_an_upward_import():
    assert layer_of("apt_serve_ray.cache.page_pool") > layer_of("apt_serve_ray.scheduler.costs")
    assert layer_of("apt_serve_ray.worker.cpu_info") > layer_of("apt_serve_ray.kernels.cpu_attention")
    assert layer_of("apt_serve_ray.sampling.params") > layer_of("apt_serve_ray.sampling.sampler")
    assert layer_of("apt_serve_ray.worker.calibration") < layer_of("apt_serve_ray.scheduler.costs")
