"""benchmarks/gguf_latency.py's settings per instruction set: `NAME@avx2` runs in a child process
on the kernels' AVX2 build (on an AVX-512 machine too), and a bad name or a missing llama.cpp
build is refused before anything loads. The tiny GGUF model; no timing assertions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gguf_latency import main
from jaxllm.model_executor.layers import cpu_ffi
from tests.gguf_models import write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]


def test_avx2_setting_runs_the_avx2_build_in_a_child(tmp_path):
    if not cpu_ffi.runs_here("avx2"):
        pytest.skip("this CPU cannot run the AVX2 build")
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    # A process of its own: the child is spawned from the script, as a user runs it.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("JAXLLM_CPU_ISA", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gguf_latency.py"), "gguf@avx2",
         "--model", str(model), "--no-tokenizer", "--rounds", "1", "--input-len", "8",
         "--output-len", "4"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gguf@avx2: start-up" in proc.stdout
    assert "CPU kernels avx2 build" in proc.stdout
    assert "gguf@avx2: median TTFT" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["gguf@sse2"], "'gguf@sse2': expected one of"),
    (["gguf", "llama.cpp@avx2"], "llama.cpp@avx2 needs --llama-cpp-avx2"),
])
def test_bad_settings_are_refused_before_loading(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
