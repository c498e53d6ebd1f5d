"""Several hosts, process 0's side: the commands its ModelRunner broadcasts to the followers
before each device call (multihost.py runs the followers' side). Apart from multihost.py so the
runner, which holds a `Leader`, does not import the module that drives runners.
"""

from __future__ import annotations

import numpy as np

# Header: [command, bucket index (STEP) or launch index (FETCH), row count (FETCH)]
HEADER = 3
STEP, PROMPT, STOP, FETCH = 1, 2, 3, 4
# Followers keep the logits of this many recent steps (async scheduling samples step N while
# N + 1 runs) for process 0's row fetches.
RECENT_STEPS = 4


def broadcast(x: np.ndarray) -> np.ndarray:
    """Process 0's `x` on every process (the others pass an array of the same shape)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(x))


class Leader:
    """Process 0's side: tells the followers what the runner is about to launch."""

    def __init__(self, shapes: list[tuple[int, int]]) -> None:
        self.shapes = shapes  # the runner's bucket shapes: a STEP names one by its index
        self.stopped = False

    def step(self, shape: tuple[int, int], packed: np.ndarray) -> None:
        """`packed`: the step's inputs as `DeviceInputs.pack` gives them."""
        broadcast(np.array([STEP, self.shapes.index(shape), 0], np.int32))
        broadcast(packed)

    def prompt(self, rows: np.ndarray, targets: np.ndarray) -> None:
        broadcast(np.array([PROMPT, 0, 0], np.int32))
        broadcast(np.concatenate([rows, targets]).astype(np.int32))

    def fetch(self, launch_index: int, rows: np.ndarray) -> None:
        broadcast(np.array([FETCH, launch_index, rows.shape[0]], np.int32))
        broadcast(rows)

    def stop(self) -> None:
        """Let the followers exit (once; also at process 0's exit)."""
        if not self.stopped:
            self.stopped = True
            broadcast(np.array([STOP, 0, 0], np.int32))
