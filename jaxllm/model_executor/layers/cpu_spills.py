"""Stack traffic in the hot loops of our C++ CPU kernels, per instruction set, from the
compiler's assembly (no run needed): each kernel is compiled with `-S` and the build's own flags
for each target (this machine, AVX2, AVX-512, and aarch64 where a cross compiler is installed),
and every innermost loop that does FMAs (the kernels' inner loops) is searched for loads and
stores relative to the stack or frame pointer: register spills. A hot loop that spills fails.
Also counts, over the whole file, vector instructions and those that touch the stack. (A stack
address the compiler copied into another register is not seen: the kernels keep every index of
their register arrays a compile-time constant, so none is made.)

    python -m jaxllm.model_executor.layers.cpu_spills [--target NAME] [--kernel NAME] [--json]
        [--verbose]

Loops are read from each function's control flow: a jump back to a block at or above it closes a
loop (its body: the blocks that reach the jump without passing the loop's first block),
innermost when no other loop lies inside it.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from jaxllm.model_executor.layers import cpu_attention, cpu_ffi
from jaxllm.model_executor.layers.quantization import cpu_dequant_matmul

KERNELS = {"dequant_matmul": cpu_dequant_matmul.SOURCE, "attention": cpu_attention.SOURCE}


@dataclass(frozen=True)
class Target:
    name: str
    compiler: str  # a command name
    march: tuple[str, ...]
    arch: str  # "x86" or "aarch64": the assembly's syntax


_HOST = "x86" if platform.machine() in ("x86_64", "AMD64") else "aarch64"
TARGETS = {
    "native": Target("native", "g++", cpu_ffi.ISA_FLAGS["native"], _HOST),
    "avx2": Target("avx2", "g++", cpu_ffi.ISA_FLAGS["avx2"], "x86"),
    "avx512": Target("avx512", "g++", ("-march=skylake-avx512",), "x86"),
    "aarch64": Target("aarch64", "aarch64-linux-gnu-g++", ("-march=armv8-a",), "aarch64"),
}

_X86 = {
    "jump": re.compile(r"^\s+j[a-z]+\s+(\S+)"),
    "end": re.compile(r"^\s+(jmp|ret|ud2)\b"),  # no fall-through
    "fma": re.compile(r"^\s+vfn?m(add|sub)"),
    "vector": re.compile(r"^\s+v[a-z]"),
    # %rbp only where the function made it the frame pointer (else it is a general register).
    "stack": re.compile(r"\(%rsp\b"),
    "frame": re.compile(r"\(%rbp\b"),
    "frame_setup": re.compile(r"^\s+movq?\s+%rsp, %rbp"),
}
_AARCH64 = {
    "jump": re.compile(r"^\s+(?:b(?:\.?(?:eq|ne|cs|hs|cc|lo|mi|pl|vs|vc|hi|ls|ge|lt|gt|le))?"
                       r"|cbn?z\s+\w+,|tbn?z\s+\w+,\s*#\d+,)\s+(\S+)"),
    "end": re.compile(r"^\s+(b|br|ret)(\s|$)"),
    "fma": re.compile(r"^\s+f(mla|mls|madd|msub)\b"),
    "vector": re.compile(r"^\s+\w+\s+[vq]\d+"),
    "stack": re.compile(r"\[sp\b"),
    "frame": re.compile(r"\[x29\b"),
    "frame_setup": re.compile(r"^\s+(mov\s+x29, sp|add\s+x29, sp)"),
}


@dataclass
class LoopSpills:
    function: str
    lines: int  # instructions in the loop
    stack_ops: int


@dataclass
class Report:
    kernel: str
    target: str
    hot_loops: list[LoopSpills]
    vector_ops: int
    vector_stack_ops: int

    @property
    def hot_spills(self) -> int:
        return sum(loop.stack_ops for loop in self.hot_loops)


def _functions(asm: str) -> dict[str, list[str]]:
    """Function name -> its lines, from GCC's `.type f, @function`/`%function` ... `.size f`."""
    out: dict[str, list[str]] = {}
    name = None
    for line in asm.splitlines():
        m = re.match(r"^\s+\.type\s+([\w.$]+),\s*[@%]function", line)
        if m:
            name = m.group(1)
            out[name] = []
        elif name is not None:
            if re.match(rf"^\s+\.size\s+{re.escape(name)},", line):
                name = None
            else:
                out[name].append(line)
    return out


def _is_stack_op(line: str, syntax: dict[str, re.Pattern[str]], frame: bool) -> bool:
    return bool(syntax["stack"].search(line) or frame and syntax["frame"].search(line))


def _blocks(lines: list[str], syntax: dict[str, re.Pattern[str]]
            ) -> tuple[list[list[str]], list[set[int]]]:
    """A function's basic blocks (their instructions) and each block's successors."""
    blocks: list[list[str]] = [[]]
    starts: dict[str, int] = {}
    ends_flow: list[bool] = []  # the block does not fall through
    for ln in lines:
        m = re.match(r"^(\.L\w+):", ln)
        if m:
            if blocks[-1]:
                ends_flow.append(False)
                blocks.append([])
            starts[m.group(1)] = len(blocks) - 1
            continue
        if not ln.startswith("\t") or ln.lstrip().startswith("."):
            continue  # directives
        blocks[-1].append(ln)
        if syntax["jump"].match(ln) or syntax["end"].match(ln):
            ends_flow.append(bool(syntax["end"].match(ln)))
            blocks.append([])
    ends_flow.append(True)
    succ: list[set[int]] = []
    for i, block in enumerate(blocks):
        nxt = set() if ends_flow[i] or i + 1 == len(blocks) else {i + 1}
        m = syntax["jump"].match(block[-1]) if block else None
        if m and m.group(1) in starts:
            nxt.add(starts[m.group(1)])
        succ.append(nxt)
    return blocks, succ


def _loops(succ: list[set[int]]) -> list[set[int]]:
    """Natural loops by header: a jump back to a block at or above it closes a loop, whose body
    is the header and every block that reaches the jump without passing the header."""
    pred: list[set[int]] = [set() for _ in succ]
    for i, targets in enumerate(succ):
        for t in targets:
            pred[t].add(i)
    by_header: dict[int, set[int]] = {}
    for latch, targets in enumerate(succ):
        for header in (t for t in targets if t <= latch):
            body = by_header.setdefault(header, {header})
            todo = [latch]
            while todo:
                b = todo.pop()
                if b not in body:
                    body.add(b)
                    todo.extend(pred[b])
    return list(by_header.values())


def analyse(asm: str, arch: str) -> tuple[list[LoopSpills], int, int]:
    """(hot loops with their stack traffic, vector instructions, vector instructions on the
    stack) of one assembly file. A hot loop is an innermost loop (no other loop inside it) that
    does FMAs."""
    syntax = _X86 if arch == "x86" else _AARCH64
    hot: list[LoopSpills] = []
    vector = vector_stack = 0
    for name, lines in _functions(asm).items():
        frame = any(syntax["frame_setup"].match(ln) for ln in lines)
        for ln in lines:
            if syntax["vector"].match(ln):
                vector += 1
                vector_stack += _is_stack_op(ln, syntax, frame)
        blocks, succ = _blocks(lines, syntax)
        loops = _loops(succ)
        for body in loops:
            if any(other < body for other in loops):
                continue  # not innermost
            code = [ln for b in sorted(body) for ln in blocks[b]]
            if any(syntax["fma"].match(ln) for ln in code):
                hot.append(LoopSpills(name, len(code),
                                      sum(_is_stack_op(ln, syntax, frame) for ln in code)))
    return hot, vector, vector_stack


def available(target: Target) -> bool:
    """Whether this machine compiles for `target`: its compiler is installed and, for x86
    targets, the host is x86 (the plain g++ compiles them)."""
    return shutil.which(target.compiler) is not None and (target.arch == _HOST or
                                                          target.name == "aarch64")


def assembly(source: Path, target: Target) -> str:
    """`source` compiled to assembly with the kernels' flags for `target`."""
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "kernel.s"
        cmd = [target.compiler, *cpu_ffi.flags_for(target.march), "-S", "-w", "-I",
               jax.ffi.include_dir(), "-I", str(cpu_ffi.HEADERS), str(source), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise cpu_ffi.KernelBuildError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
        return out.read_text()


def check(kernel: str, target: str) -> Report:
    t = TARGETS[target]
    hot, vector, vector_stack = analyse(assembly(KERNELS[kernel], t), t.arch)
    return Report(kernel, target, hot, vector, vector_stack)


def _demangle(name: str) -> str:
    if not shutil.which("c++filt"):
        return name
    return subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--target", action="append", choices=sorted(TARGETS),
                        help="default: every target whose compiler is installed")
    parser.add_argument("--kernel", action="append", choices=sorted(KERNELS))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="list the loops that spill")
    args = parser.parse_args(argv)
    targets = args.target or [n for n, t in TARGETS.items() if available(t)]
    failed = False
    reports = []
    for target in targets:
        if not available(TARGETS[target]):
            print(f"{target}: skipped, no {TARGETS[target].compiler}", file=sys.stderr)
            continue
        for kernel in args.kernel or KERNELS:
            r = check(kernel, target)
            reports.append(r)
            failed |= r.hot_spills > 0 or not r.hot_loops
            if not args.json:
                print(f"{kernel:15s} {target:8s} hot loops {len(r.hot_loops):4d}, stack ops in "
                      f"them {r.hot_spills:5d}; whole file: {r.vector_stack_ops} of "
                      f"{r.vector_ops} vector instructions on the stack")
                for loop in r.hot_loops if args.verbose else ():
                    if loop.stack_ops:
                        print(f"  {loop.stack_ops} of {loop.lines} in {_demangle(loop.function)}")
    if args.json:
        print(json.dumps([asdict(r) | {"hot_spills": r.hot_spills} for r in reports], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
