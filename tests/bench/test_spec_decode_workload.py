"""The checked-in code-editing workload of benchmarks/spec_decode.py: it is what the generator
makes from its seed, and every prompt shows valid Python and asks for a change that code allows."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.code_edit_workload import DEFAULT_PATH, build_prompts, render

ROOT = Path(__file__).resolve().parents[2]
CODE_BLOCK = re.compile(r"```python\n(.*?)\n```", re.S)


def test_committed_prompts_equal_a_fresh_generation():
    text = DEFAULT_PATH.read_text()
    assert text == render(build_prompts())
    assert text != render(build_prompts(seed=1))
    # Another process with another hash seed (set and dict order) writes the same bytes.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "12345"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "code_edit_workload.py"),
                           "--check"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "up to date" in proc.stdout


def _identifiers(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


def _defs(tree: ast.AST) -> dict[str, ast.FunctionDef | ast.ClassDef]:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def _check_change(change: str, code: str, tree: ast.Module) -> str:
    """Asserts the change names what the code has (and not what it lacks); returns its kind."""
    top = tree.body[0]
    assert isinstance(top, (ast.FunctionDef, ast.ClassDef)) and len(tree.body) == 1
    if m := re.fullmatch(r"rename the variable `(\w+)` to `(\w+)` everywhere it is used", change):
        old, new = m.groups()
        assert old in _identifiers(tree) and old not in _defs(tree)
        assert new not in code
        return "rename_variable"
    if m := re.fullmatch(r"rename the (function|class) `(\w+)` to `(\w+)`", change):
        what, old, new = m.groups()
        assert top.name == old and isinstance(top, ast.ClassDef) == (what == "class")
        assert new not in code
        return "rename_function"
    if m := re.fullmatch(r"add a parameter `(\w+)` with the default `(.+)` as the last parameter "
                         r"of `(\w+)`; leave the body unchanged", change):
        param, default, func = m.groups()
        fn = _defs(tree)[func]
        assert isinstance(fn, ast.FunctionDef)
        assert param not in [a.arg for a in fn.args.args]
        ast.literal_eval(default)
        return "add_parameter"
    if m := re.fullmatch(r"add a short docstring to `(\w+)` saying what it does", change):
        assert m.group(1) == top.name and ast.get_docstring(top) is None
        return "add_docstring"
    if m := re.fullmatch(r"change the constant `(\d+)` to `(\d+)`", change):
        old, new = int(m.group(1)), int(m.group(2))
        consts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
        assert consts.count(old) == 1 and old != new
        return "change_constant"
    if m := re.fullmatch(r"add type hints to the parameters and the return value of `(\w+)`",
                         change):
        fn = _defs(tree)[m.group(1)]
        assert isinstance(fn, ast.FunctionDef) and fn.returns is None
        assert all(a.annotation is None for a in fn.args.args)
        return "add_type_hints"
    raise AssertionError(f"unknown change: {change!r}")


def test_every_prompt_shows_valid_python_and_a_change_it_allows():
    records = json.loads(DEFAULT_PATH.read_text())
    assert isinstance(records, list) and len(records) == 32
    kinds, codes, nodes = set(), set(), set()
    for rec in records:
        assert set(rec) == {"messages", "change"}
        assert [m["role"] for m in rec["messages"]] == ["system", "user"]
        user = rec["messages"][1]["content"]
        (code,) = CODE_BLOCK.findall(user)
        tree = ast.parse(code)
        assert 10 <= len(code.splitlines()) <= 40, code
        assert f"Please {rec['change']}." in user
        kinds.add(_check_change(rec["change"], code, tree))
        codes.add(code)
        for node in ast.walk(tree):
            nodes.add(type(node).__name__)
    assert len(codes) == len(records)
    assert kinds == {"rename_variable", "rename_function", "add_parameter", "add_docstring",
                     "change_constant", "add_type_hints"}
    # The templates' constructs: loops, dict and list handling, formatting, classes.
    assert {"ClassDef", "FunctionDef", "For", "Dict", "ListComp", "JoinedStr"} <= nodes


def test_bad_count_is_refused():
    with pytest.raises(ValueError, match="num_prompts must be >= 1, got 0"):
        build_prompts(0)
