"""A count of XLA backend compilations in this process, kept from the first import on: the
model runner reports it (`ModelRunner.get_compile_count`), so "nothing compiles while serving"
is checkable in the process that holds the runner, whichever engine mode put it there."""

from __future__ import annotations

import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_seconds: list[float] = []


def _on_event(event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _seconds.append(duration_secs)


def compile_count() -> int:
    """Backend compilations in this process since this module was imported."""
    return len(_seconds)


def compile_seconds() -> list[float]:
    """Each backend compilation's seconds, in order, since this module was imported."""
    with _lock:
        return list(_seconds)


# Once per process (module import), never per runner: listeners cannot be removed.
jax.monitoring.register_event_duration_secs_listener(_on_event)
