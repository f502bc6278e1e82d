"""What a wheel or sdist must carry beyond Python files: the C sources the CPU kernels compile at run time."""
from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

from nanoserve.kernels import cpu_kernels

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_ships_every_kernel_source():
    with open(ROOT / "pyproject.toml", "rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"].get("package-data", {})
    patterns = package_data.get("nanoserve.kernels", []) + package_data.get("*", [])
    kernel_dir = ROOT / "nanoserve" / "kernels"
    sources = sorted(p.name for p in kernel_dir.iterdir() if p.suffix in (".c", ".h"))
    # The sources the kernels build from at run time are all in the package dir, and all declared.
    assert {Path(s).name for s in cpu_kernels.SOURCES} <= set(sources)
    missing = [s for s in sources if not any(fnmatch.fnmatch(s, pat) for pat in patterns)]
    assert not missing, f"pyproject's [tool.setuptools.package-data] leaves out {missing}"
