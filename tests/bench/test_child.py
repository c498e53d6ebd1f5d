"""jaxllm.benchmarks.child: an object in a child process with its own environment; the parent's
environment is left as it was, and a failure there comes back as an error here."""

from __future__ import annotations

import os

import pytest

from jaxllm.benchmarks.child import Child, isa_env


class Probe:
    def __init__(self, tag: str):
        self.tag = tag

    def env(self, name: str) -> tuple[str, str | None]:
        return self.tag, os.environ.get(name)

    def fail(self) -> None:
        raise ValueError("raised in the child")


def test_child_sees_its_environment_and_the_parent_keeps_its_own(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_parent_flag")
    monkeypatch.delenv("JAXLLM_CPU_ISA", raising=False)
    env = isa_env("avx2")
    assert env["XLA_FLAGS"] == "--xla_parent_flag --xla_cpu_max_isa=AVX2"
    child = Child(Probe, "p", env=env)
    try:
        assert child.env("JAXLLM_CPU_ISA") == ("p", "avx2")
        assert child.env("XLA_FLAGS") == ("p", env["XLA_FLAGS"])
        with pytest.raises(RuntimeError, match="raised in the child"):
            child.fail()
        assert child.env("JAXLLM_CPU_ISA") == ("p", "avx2")  # still serving
    finally:
        child.close()
    assert "JAXLLM_CPU_ISA" not in os.environ
    assert os.environ["XLA_FLAGS"] == "--xla_parent_flag"


def test_a_failing_factory_and_an_unknown_isa_are_errors():
    with pytest.raises(RuntimeError, match="building"):
        Child(Probe, env={})  # Probe() lacks its argument
    with pytest.raises(ValueError, match="sse2"):
        isa_env("sse2")
