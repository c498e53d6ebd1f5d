"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from jaxllm.model_executor.layers import cpu_ffi


@pytest.fixture(params=list(cpu_ffi.ISA_FLAGS))
def cpu_isa(request: pytest.FixtureRequest) -> str:
    """Each build of our C++ CPU kernels: native and, on x86, the AVX2 build (an AVX-512
    machine runs AVX2 code too), whose register tiles differ; every x86 machine tests both."""
    isa = request.param
    if not cpu_ffi.runs_here(isa):
        pytest.skip(f"this CPU cannot run the {isa} build")
    return isa
