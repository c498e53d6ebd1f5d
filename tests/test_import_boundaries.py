"""Dependencies point one way, into jaxllm/: the scheduler is plain Python, the kernels know
nothing of the engine, and no module of jaxllm/ reaches itself again through its imports.
Checked on the source (every import statement, top level, inside a function or under
TYPE_CHECKING) and at run time (what an import really pulls into sys.modules)."""

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


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of a package directory (a package is named
    by its __init__.py)."""
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports anywhere in its file. `from a
    import b` reaches a.b when that is a module, else a (a name its __init__ defines); importing
    a.b does not count as importing a, as a package's __init__ importing its own submodules
    would otherwise make every package a circle."""
    modules = module_names(package_dir)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [f"{base}.{alias.name}" for alias in node.names]
                targets = [t if t in modules else base for t in targets]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


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


def test_no_test_module_imports_another():
    """What tests share lives in helper modules (tests/utils.py and its siblings), never in a
    test module another one imports: each test module can change on its own."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} imports {name}"
                          for name in names if name.split(".")[-1].startswith("test_")]
    assert not offenders, offenders


def test_jaxllm_has_no_import_circles():
    graph = import_graph(ROOT / "jaxllm")
    assert "jaxllm.engine.core" in graph and graph["jaxllm.engine.core"]
    circles = import_circles(graph)
    assert circles == [], "\n".join(
        " <-> ".join(c) + "\n  " + "\n  ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c)
        for c in circles)


def test_the_circle_checker_finds_a_circle_through_type_checking_and_functions(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pkg.sub.b import B\nA = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\nB = 2\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg import A\n")  # the package's __init__, no circle
    graph = import_graph(pkg)
    assert graph["pkg.d"] == {"pkg"}
    assert import_circles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


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
