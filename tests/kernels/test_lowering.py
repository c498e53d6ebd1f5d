"""Every kernel lowers through Pallas -> Triton for CUDA at Qwen2 shapes (no GPU needed)."""

from __future__ import annotations

import pytest

from pallas_kernels.checks.check_lowering import KERNEL_MODULES, format_table, run_checks


@pytest.mark.parametrize("module", KERNEL_MODULES)
def test_kernel_lowers_for_cuda(module: str) -> None:
    results = run_checks([module])
    assert results, f"{module} produced no lowering cases"
    failed = [r for r in results if not r.ok]
    assert not failed, "\n" + format_table(failed)


def test_missing_module_is_reported_not_raised() -> None:
    (result,) = run_checks(["no_such_kernel"])
    assert not result.ok and result.error.startswith("missing")
