"""Dependencies point one way, into jaxllm/: the scheduler is plain Python, the kernels know
nothing of the engine. Checked on the source (every import statement, top level or inside a
function) and at run time (what an import really pulls into sys.modules)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = {"jaxllm", "pallas_kernels", "scheduler", "tests", "benchmarks"}


def imported_roots(path: Path) -> dict[str, int]:
    """Top-level package of every absolute import in a file -> first line it appears on."""
    roots: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            roots.setdefault(name.split(".")[0], node.lineno)
    return roots


def violations(package: str, allowed) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for root, line in imported_roots(path).items():
            if not allowed(root):
                found.append(f"{path.relative_to(ROOT)}:{line} imports {root}")
    return found


def test_scheduler_imports_only_the_standard_library():
    allowed = set(sys.stdlib_module_names) | {"scheduler"}
    assert violations("scheduler", allowed.__contains__) == []


def test_kernels_import_nothing_of_ours():
    assert violations("pallas_kernels", lambda r: r == "pallas_kernels" or r not in OURS) == []


def test_engine_imports_no_tests_or_benchmark_scripts():
    assert violations("jaxllm", lambda r: r not in {"tests", "benchmarks"}) == []


def test_the_checker_sees_imports_inside_functions(tmp_path):
    (tmp_path / "mod.py").write_text("import os\n\ndef f():\n    from jax import numpy\n")
    assert imported_roots(tmp_path / "mod.py") == {"os": 1, "jax": 4}


def test_importing_the_scheduler_loads_no_jax_or_numpy():
    modules = sorted(p.stem for p in (ROOT / "scheduler").glob("*.py") if p.stem != "__init__")
    code = "import sys\n" + "".join(f"import scheduler.{m}\n" for m in modules) + (
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'numpy', 'jaxllm'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
