"""What an installed (non-editable) jaxllm carries: every C++ source and header our CPU kernels
compile on first use is matched by pyproject.toml's package data, and a wheel built from this
tree holds them."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def kernel_sources() -> set[str]:
    package = ROOT / "jaxllm"
    return {p.relative_to(package).as_posix() for p in package.rglob("*")
            if p.suffix in (".cc", ".h")}


def test_package_data_matches_every_kernel_source():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["jaxllm"]
    matched = {p.relative_to(ROOT / "jaxllm").as_posix() for pattern in patterns
               for p in (ROOT / "jaxllm").glob(pattern)}
    assert kernel_sources() and kernel_sources() <= matched, kernel_sources() - matched


def test_a_wheel_holds_the_kernel_sources(tmp_path):
    pytest.importorskip("setuptools", reason="building a wheel needs setuptools (in the first "
                                             "lane's venv)")
    # From a copy of the tracked files: a build/ left in the checkout would be reused.
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-z", "pyproject.toml", "README.md", "jaxllm",
                            "pallas_kernels", "scheduler"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes((ROOT / name).read_bytes())
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(tmp_path), str(src)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("jaxllm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"jaxllm/{s}" for s in kernel_sources()} <= names
