"""A count of XLA backend compilations in this process, kept from the first import on: the
model runner reports it (`ModelRunner.get_compile_count`), so "nothing compiles while serving"
is checkable in the process that holds the runner, whichever engine mode put it there."""

from __future__ import annotations

import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_count = 0


def _on_event(event: str, duration_secs: float, **kwargs: str | int) -> None:
    global _count
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _count += 1


def compile_count() -> int:
    """Backend compilations in this process since this module was imported."""
    return _count


# Once per process (module import), never per runner: listeners cannot be removed.
jax.monitoring.register_event_duration_secs_listener(_on_event)
