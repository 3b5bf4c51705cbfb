"""Loading a script of the repository (``benchmarks/``, ``scripts/``: files, not packages) as a module, for its tests."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script(relpath: str):
    """The module at ``ROOT / relpath``, executed afresh."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
