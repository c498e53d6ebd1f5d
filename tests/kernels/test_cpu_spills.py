"""The C++ CPU kernels' hot loops keep their values in registers on every instruction set: each
kernel compiled to assembly per target (this machine, AVX2, AVX-512, aarch64 where the cross
compiler is installed) has no stack traffic in its innermost FMA loops
(jaxllm/model_executor/layers/cpu_spills.py). Also that the check sees a spill."""

from __future__ import annotations

import pytest

from jaxllm.model_executor.layers import cpu_spills


@pytest.mark.parametrize("target", list(cpu_spills.TARGETS))
@pytest.mark.parametrize("kernel", list(cpu_spills.KERNELS))
def test_hot_loops_do_not_spill(kernel, target):
    t = cpu_spills.TARGETS[target]
    if not cpu_spills.available(t):
        pytest.skip(f"no compiler for {target} here ({t.compiler}, {t.arch})")
    report = cpu_spills.check(kernel, target)
    assert report.hot_loops, "no FMA loop found: the assembly was not read as expected"
    spilling = [loop for loop in report.hot_loops if loop.stack_ops]
    assert not spilling, spilling


_ASM = """\
\t.type\tf, @function
f:
\tmovq\t%rsp, %rbp
.L2:
\tvmovups\t(%rdi), %ymm0
.L3:
\tvfmadd231ps\t(%rsi), %ymm0, %ymm1
\tvmovaps\t%ymm1, -64(%rbp)
\taddq\t$32, %rsi
\tcmpq\t%rsi, %rdx
\tjne\t.L3
\tvmovaps\t%ymm1, 32(%rsp)
\tjmp\t.L2
\t.size\tf, .-f
"""


def test_the_check_sees_a_spill_in_the_innermost_loop():
    """Loop .L3 (inside .L2) is the hot loop: its store to the frame counts, the outer loop's
    store to the stack does not."""
    hot, vector, on_stack = cpu_spills.analyse(_ASM, "x86")
    assert [(loop.function, loop.lines, loop.stack_ops) for loop in hot] == [("f", 5, 1)]
    assert (vector, on_stack) == (4, 2)
