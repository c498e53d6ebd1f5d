"""The code-editing workload of benchmarks/spec_decode.py: chat prompts that each show a small
Python function and ask for it back in full with one change, the case prompt-lookup (n-gram)
speculation is for (most of the answer is copied from the prompt).

    PYTHONPATH=. .venv/bin/python benchmarks/code_edit_workload.py            # rewrite the file
    PYTHONPATH=. .venv/bin/python benchmarks/code_edit_workload.py --check    # compare only

The functions are synthesised from templates (loops, dict and list handling, string formatting,
classes with two or three methods) with random identifiers and constants, 10-40 lines each. The
output, benchmarks/data/code_edit_prompts.json, is checked in: the same seed and count give the
same bytes (only `random.Random(seed)` draws, no hash ordering, no clock).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PATH = Path(__file__).resolve().parent / "data" / "code_edit_prompts.json"
DEFAULT_NUM_PROMPTS = 32
DEFAULT_SEED = 0
MIN_LINES, MAX_LINES = 10, 40

SYSTEM_PROMPT = ("You are a careful Python programmer. When asked to edit code, reply with the "
                 "complete edited code in one ```python block and nothing else.")

NOUNS = ["order", "user", "item", "record", "price", "score", "event", "line", "token", "node",
         "task", "payment", "invoice", "sensor", "reading", "message", "account", "product",
         "ticket", "batch", "sample", "entry", "packet", "job", "city", "route", "file", "word",
         "grade", "student", "vendor", "shipment", "metric", "session", "request", "rating"]
QUALIFIERS = ["total", "valid", "active", "pending", "raw", "clean", "last", "first", "best",
              "daily", "current", "recent", "known", "unique", "filtered", "grouped", "parsed",
              "sorted", "selected", "merged", "visible", "cached", "final", "main"]
VERBS = ["summarize", "collect", "count", "group", "filter", "merge", "format", "rank", "score",
         "normalize", "index", "split", "scan", "tally", "compute", "build", "render", "select"]
FIELDS = ["name", "kind", "status", "owner", "region", "label", "category", "source", "level"]
NUMERIC_FIELDS = ["amount", "weight", "size", "duration", "cost", "value", "count", "distance"]


@dataclass
class Snippet:
    """One synthesised function (or class) and what may be changed in it."""

    code: str
    name: str  # the function or class shown
    func: str  # a function whose parameters a change may touch (a method for a class)
    params: list[str]  # func's parameters, self excluded
    locals: list[str]  # variables safe to rename (assigned in the body, not attributes)
    constants: list[str] = field(default_factory=list)  # literals that occur exactly once
    is_class: bool = False


def _plural(noun: str) -> str:
    if noun.endswith(("s", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


class Names:
    """Distinct identifiers drawn from the word lists."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def _fresh(self, make) -> str:
        for _ in range(1000):
            name = make()
            if name not in self.used:
                self.used.add(name)
                return name
        raise RuntimeError("ran out of identifiers")

    def var(self) -> str:
        return self._fresh(lambda: f"{self.rng.choice(QUALIFIERS)}_{self.rng.choice(NOUNS)}")

    def plural(self) -> str:
        return self._fresh(lambda: _plural(self.rng.choice(NOUNS)))

    def func(self) -> str:
        return self._fresh(lambda: f"{self.rng.choice(VERBS)}_{_plural(self.rng.choice(NOUNS))}")

    def cls(self) -> str:
        return self._fresh(lambda: "".join(w.capitalize() for w in
                                           (self.rng.choice(NOUNS), self.rng.choice(
                                               ["Registry", "Tracker", "Buffer", "Ledger",
                                                "Counter", "Queue", "Report", "Index"]))))

    def pick(self, words: list[str]) -> str:
        return self._fresh(lambda: self.rng.choice(words))


class Constants:
    """Distinct integer literals, so that "change the constant X" names one place."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[int] = set()

    def __call__(self, lo: int, hi: int) -> str:
        for _ in range(1000):
            value = self.rng.randint(lo, hi)
            if value not in self.used and value not in (0, 1):
                self.used.add(value)
                return str(value)
        raise RuntimeError(f"no fresh constant in [{lo}, {hi}]")


def _indent(lines: list[str], depth: int) -> list[str]:
    return [("    " * depth + x) if x else x for x in lines]


def _type_guard(rng: random.Random, param: str) -> list[str]:
    """Half the time, a check of the collection argument's type first."""
    if rng.random() < 0.5:
        return []
    return [f"if not isinstance({param}, (list, tuple)):",
            f"    raise TypeError(f\"{param} must be a list or tuple, got "
            f"{{type({param}).__name__}}\")"]


def loop_template(rng: random.Random, names: Names, const: Constants) -> Snippet:
    fn, items, item, acc, count = (names.func(), names.plural(), names.var(), names.var(),
                                   names.var())
    limit, low = names.var(), const(2, 30)
    cap = const(50, 500)
    body = [*_type_guard(rng, items), f"{acc} = 0", f"{count} = 0", f"for {item} in {items}:",
            f"    if {item} < {low}:", "        continue"]
    if rng.random() < 0.5:
        body += [f"    if {item} > {cap}:", f"        {item} = {cap}"]
    body += [f"    {acc} += {item}", f"    {count} += 1", f"    if {count} >= {limit}:",
             "        break"]
    locs = [acc, count, item]
    if rng.random() < 0.5:
        spread = names.var()
        body = [f"{spread} = []", *body[:-4], f"    {spread}.append({item})", *body[-4:],
                f"if {spread}:", f"    print(min({spread}), max({spread}))"]
        locs.append(spread)
    body += [f"if {count} == 0:", "    return 0.0", f"return {acc} / {count}"]
    default = const(5, 40)
    code = "\n".join([f"def {fn}({items}, {limit}={default}):", *_indent(body, 1)])
    return Snippet(code, fn, fn, [items, limit], locs, [low, cap, default])


def dict_template(rng: random.Random, names: Names, const: Constants) -> Snippet:
    fn, records, record, groups, key = (names.func(), names.plural(), names.var(), names.var(),
                                        names.var())
    by, amount = names.pick(FIELDS), names.pick(NUMERIC_FIELDS)
    minimum = const(2, 20)
    body = [*_type_guard(rng, records), f"{groups} = {{}}", f"for {record} in {records}:",
            f"    {key} = {record}.get(\"{by}\", \"unknown\")",
            f"    if {record}.get(\"{amount}\", 0) < {minimum}:", "        continue",
            f"    {groups}.setdefault({key}, []).append({record})"]
    result, members = names.var(), names.var()
    body += [f"{result} = {{}}", f"for {key}, {members} in sorted({groups}.items()):",
             f"    {result}[{key}] = {{", f"        \"count\": len({members}),",
             f"        \"{amount}\": sum(r[\"{amount}\"] for r in {members}),"]
    if rng.random() < 0.6:
        body += [f"        \"largest\": max(r[\"{amount}\"] for r in {members}),"]
    body += ["    }"]
    if rng.random() < 0.5:
        top = const(3, 12)
        body += [f"if len({result}) > {top}:",
                 f"    {result} = dict(sorted({result}.items(), key=lambda kv: -kv[1][\"count\"])"
                 f"[:{top}])"]
        consts = [minimum, top]
    else:
        consts = [minimum]
    body += [f"return {result}"]
    code = "\n".join([f"def {fn}({records}):", *_indent(body, 1)])
    return Snippet(code, fn, fn, [records], [groups, record, result, members], consts)


def list_template(rng: random.Random, names: Names, const: Constants) -> Snippet:
    fn, values, cleaned, value, step, size = (names.func(), names.plural(), names.var(),
                                              names.var(), names.var(), names.var())
    window = const(2, 9)
    scale = const(10, 100)
    body = [f"if {size} < 1:", f"    raise ValueError(f\"{size} must be >= 1, got {{{size}}}\")",
            *_type_guard(rng, values),
            f"{cleaned} = [{value} for {value} in {values} if {value} is not None]",
            f"if len({cleaned}) < {size}:", f"    return list({cleaned})",
            f"{step} = []", f"for i in range(len({cleaned}) - {size} + 1):",
            f"    chunk = {cleaned}[i:i + {size}]",
            f"    {step}.append(sum(chunk) / {size})"]
    locs = [cleaned, step]
    if rng.random() < 0.5:
        peak = names.var()
        body += [f"{peak} = max({step})", f"if {peak} > {scale}:",
                 f"    {step} = [x * {scale} / {peak} for x in {step}]"]
        locs.append(peak)
    if rng.random() < 0.5:
        body += [f"{step}.sort(reverse=True)"]
    body += [f"return [round(x, 2) for x in {step}]"]
    code = "\n".join([f"def {fn}({values}, {size}={window}):", *_indent(body, 1)])
    return Snippet(code, fn, fn, [values, size], locs, [window, scale])


def format_template(rng: random.Random, names: Names, const: Constants) -> Snippet:
    fn, rows, title, lines, row, width = (names.func(), names.plural(), names.var(), names.var(),
                                          names.var(), names.var())
    label, amount = names.pick(FIELDS), names.pick(NUMERIC_FIELDS)
    pad = const(8, 30)
    body = [f"if not {rows}:", f"    return f\"{{{title}}}: no {rows}\"",
            f"{rows} = sorted({rows}, key=lambda r: str(r[\"{label}\"]))",
            f"{lines} = [{title}.upper(), \"=\" * len({title})]",
            f"{width} = max((len(str(r[\"{label}\"])) for r in {rows}), default={pad})",
            f"for {row} in {rows}:", f"    name = str({row}[\"{label}\"]).ljust({width})",
            f"    {lines}.append(f\"{{name}} | {{{row}['{amount}']:>{pad}.2f}}\")"]
    if rng.random() < 0.6:
        total = names.var()
        body += [f"{total} = sum(r[\"{amount}\"] for r in {rows})",
                 f"{lines}.append(\"-\" * ({width} + {pad} + 3))",
                 f"{lines}.append(f\"{{'total'.ljust({width})}} | {{{total}:>{pad}.2f}}\")"]
        locs = [lines, width, row, total]
    else:
        locs = [lines, width, row]
    if rng.random() < 0.5:
        body += [f"{lines}.append(f\"{{len({rows})}} {rows}\")"]
    body += [f"return \"\\n\".join({lines})"]
    code = "\n".join([f"def {fn}({rows}, {title}=\"{rng.choice(NOUNS)} report\"):",
                      *_indent(body, 1)])
    return Snippet(code, fn, fn, [rows, title], locs, [pad])


def class_template(rng: random.Random, names: Names, const: Constants) -> Snippet:
    cls, store, limit, key, amount = (names.cls(), names.var(), names.var(), names.var(),
                                      names.var())
    cap = const(10, 200)
    add = f"add_{rng.choice(NOUNS)}"
    lines = [f"class {cls}:", f"    def __init__(self, {limit}={cap}):",
             f"        self.{limit} = {limit}", f"        self.{store} = {{}}", "",
             f"    def {add}(self, {key}, {amount}=1):",
             f"        if len(self.{store}) >= self.{limit} and {key} not in self.{store}:",
             f"            raise ValueError(f\"{cls} is full: {{{key}!r}}\")",
             f"        self.{store}[{key}] = self.{store}.get({key}, 0) + {amount}",
             f"        return self.{store}[{key}]"]
    consts = [cap]
    locs = []
    if rng.random() < 0.7:
        top, ranked = const(3, 15), names.var()
        lines += ["", f"    def top(self, n={top}):",
                  f"        {ranked} = sorted(self.{store}.items(), key=lambda kv: kv[1],"
                  " reverse=True)", f"        return [k for k, _ in {ranked}[:n]]"]
        consts.append(top)
        locs.append(ranked)
    if rng.random() < 0.6:
        share = names.var()
        lines += ["", "    def shares(self):", f"        {share} = sum(self.{store}.values())",
                  f"        if {share} == 0:", "            return {}",
                  f"        return {{k: v / {share} for k, v in self.{store}.items()}}"]
        locs.append(share)
    code = "\n".join(lines)
    return Snippet(code, cls, add, [key, amount], locs, consts, is_class=True)


def parse_template(rng: random.Random, names: Names, const: Constants) -> Snippet:
    fn, text, result, errors, lineno, raw = (f"parse_{_plural(rng.choice(NOUNS))}", names.var(),
                                             names.var(), names.var(), names.var(), names.var())
    names.used.add(fn)
    sep, mark = rng.choice(["=", ":"]), rng.choice(["#", ";"])
    most = const(3, 25)
    body = [f"{result} = {{}}", f"{errors} = []",
            f"for {lineno}, {raw} in enumerate({text}.splitlines(), 1):",
            f"    line = {raw}.strip()", "    if not line or line.startswith(comment):",
            "        continue", "    if sep not in line:",
            f"        {errors}.append(f\"line {{{lineno}}}: missing {{sep!r}}\")",
            "        continue",
            "    key, _, value = line.partition(sep)", "    key = key.strip().lower()",
            "    value = value.strip()", "    if value.isdigit():", "        value = int(value)"]
    if rng.random() < 0.5:
        body += ["    elif value.replace(\".\", \"\", 1).isdigit():",
                 "        value = float(value)"]
    body += ["    elif value.lower() in (\"true\", \"false\"):",
             "        value = value.lower() == \"true\"",
             f"    if key in {result}:",
             f"        {errors}.append(f\"line {{{lineno}}}: duplicate key {{key!r}}\")",
             f"    {result}[key] = value",
             f"if len({errors}) > {most}:",
             f"    raise ValueError(\"; \".join({errors}[:{most}]))"]
    if rng.random() < 0.5:
        body += [f"for key in sorted({result}):", "    if key.startswith(\"_\"):",
                 f"        del {result}[key]"]
    body += [f"return {result}, {errors}"]
    code = "\n".join([f"def {fn}({text}, sep=\"{sep}\", comment=\"{mark}\"):",
                      *_indent(body, 1)])
    return Snippet(code, fn, fn, [text, "sep", "comment"], [result, errors, lineno, raw], [])


TEMPLATES = [loop_template, dict_template, list_template, format_template, class_template,
             parse_template]

CHANGES = ["rename_variable", "rename_function", "add_parameter", "add_docstring",
           "change_constant", "add_type_hints"]


def describe_change(rng: random.Random, s: Snippet, names: Names) -> str:
    """One edit the snippet allows, as the request's words."""
    kinds = [k for k in CHANGES
             if (k != "rename_variable" or s.locals) and (k != "change_constant" or s.constants)]
    kind = rng.choice(kinds)
    if kind == "rename_variable":
        old = rng.choice(sorted(s.locals))
        return f"rename the variable `{old}` to `{names.var()}` everywhere it is used"
    if kind == "rename_function":
        what = "class" if s.is_class else "function"
        new = names.cls() if s.is_class else names.func()
        return f"rename the {what} `{s.name}` to `{new}`"
    if kind == "add_parameter":
        new, default = rng.choice([("verbose", "False"), ("strict", "True"), ("limit", "None"),
                                   ("precision", "2"), ("encoding", '"utf-8"')])
        return (f"add a parameter `{new}` with the default `{default}` as the last parameter "
                f"of `{s.func}`; leave the body unchanged")
    if kind == "add_docstring":
        return f"add a short docstring to `{s.name}` saying what it does"
    if kind == "change_constant":
        old = rng.choice(s.constants)
        return f"change the constant `{old}` to `{int(old) * 2 + 1}`"
    return f"add type hints to the parameters and the return value of `{s.func}`"


def build_prompts(num_prompts: int = DEFAULT_NUM_PROMPTS,
                  seed: int = DEFAULT_SEED) -> list[dict]:
    """`num_prompts` records {"messages": [system, user], "change": "..."}, the same for the same
    arguments."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = random.Random(seed)
    records = []
    for i in range(num_prompts):
        names, const = Names(rng), Constants(rng)
        # Every template in turn, so a small count still covers them all.
        snippet = TEMPLATES[i % len(TEMPLATES)](rng, names, const)
        # Only a literal written once is unambiguous to change.
        snippet.constants = [c for c in snippet.constants
                             if len(re.findall(rf"\b{c}\b", snippet.code)) == 1]
        n_lines = snippet.code.count("\n") + 1
        if not MIN_LINES <= n_lines <= MAX_LINES:
            raise AssertionError(f"template {TEMPLATES[i % len(TEMPLATES)].__name__} made "
                                 f"{n_lines} lines, outside [{MIN_LINES}, {MAX_LINES}]")
        change = describe_change(rng, snippet, names)
        user = (f"Here is some Python code:\n\n```python\n{snippet.code}\n```\n\n"
                f"Please {change}. Give me the complete updated code.")
        records.append({"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                     {"role": "user", "content": user}],
                        "change": change})
    return records


def render(records: list[dict]) -> str:
    return json.dumps(records, indent=1, ensure_ascii=True) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS)
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--out", type=Path, default=DEFAULT_PATH)
    ap.add_argument("--check", action="store_true",
                    help="only compare --out with a fresh generation (exit 1 if they differ)")
    args = ap.parse_args()
    text = render(build_prompts(args.num_prompts, args.seed))
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print(f"{args.out}: {'up to date' if same else 'differs from a fresh generation'}")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"{args.num_prompts} prompts (seed {args.seed}) written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
