"""The C++ CPU kernels built for aarch64 (NEON tiles) give the reference's values, and the same
bits as this machine's build: cpu_kernels_driver.cc (the kernels without XLA, fixed inputs,
float64 references, a hash of each case's result bits) cross-compiled with Debian's
g++-aarch64-linux-gnu and run under qemu-aarch64 (qemu-user), beside the same driver built for
this machine."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import jax
import pytest

from jaxllm.model_executor.layers import cpu_ffi

DRIVER = Path(__file__).with_name("cpu_kernels_driver.cc")
CROSS, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"

pytestmark = pytest.mark.skipif(
    not (shutil.which(CROSS) and shutil.which(QEMU)) or platform.machine() == "aarch64",
    reason=f"needs {CROSS} and {QEMU} on a non-aarch64 host (Debian: apt-get install "
           f"g++-aarch64-linux-gnu qemu-user)")


def _driver(cxx: str, march: str, out: Path, static: bool = False) -> Path:
    """The driver linked from its three parts (dequant matmul, attention, main)."""
    flags = [*cpu_ffi.flags_for((march,)), "-w", "-I", jax.ffi.include_dir(), "-I",
             str(cpu_ffi.HEADERS)]
    objects = []
    for part in ("KERNEL_DEQUANT", "KERNEL_ATTENTION", "DRIVER_MAIN"):
        obj = out.with_name(f"{out.name}-{part}.o")
        subprocess.run([cxx, *flags, f"-D{part}", "-c", str(DRIVER), "-o", str(obj)],
                       check=True, capture_output=True, timeout=600)
        objects.append(str(obj))
    subprocess.run([cxx, *(["-static"] if static else []), *objects, "-o", str(out),
                    "-lpthread"], check=True, capture_output=True, timeout=600)
    return out


def test_aarch64_build_matches_the_reference_and_this_machines_bits(tmp_path):
    host = subprocess.run([str(_driver("g++", "-march=native", tmp_path / "host"))],
                          capture_output=True, text=True, timeout=600)
    assert host.returncode == 0, host.stdout
    arm = subprocess.run([QEMU, str(_driver(CROSS, "-march=armv8-a", tmp_path / "arm",
                                            static=True))],
                         capture_output=True, text=True, timeout=600)
    assert arm.returncode == 0, arm.stdout  # every case within its reference's tolerance
    assert arm.stdout.splitlines() == host.stdout.splitlines()  # and the same bits
    assert len(arm.stdout.splitlines()) == 52 and arm.stdout.endswith("ok\n")
