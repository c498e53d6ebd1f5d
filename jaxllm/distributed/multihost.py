"""Several hosts: the engine core as one multi-controller JAX program (`jax.distributed`).

Every process joins JAX's distributed runtime (`initialize`), so the "tp" mesh spans all their
devices. Process 0 runs the whole engine (scheduler, sampler, frontend); the others build an
EngineCore from the same EngineArgs (its scheduler stays idle) and follow process 0's device
calls with its ModelRunner (`follow`):
before each call process 0 broadcasts a fixed-size header (what to run, the bucket) and then
that bucket's inputs as one int32 vector (`jax.experimental.multihost_utils`), so every process
launches the same executable on the same inputs. Every header and input size is broadcast once
at start-up (`warm_up`), so the broadcasts compile nothing while serving.

A follower that dies: its peers' next collective fails and JAX's coordination service, whose
heartbeat timeout is set to HEARTBEAT_TIMEOUT_S here (JAX's default is 100 s), reports the task
missing; process 0's engine core then fails (an exception, or JAX ending the process), which a
frontend in another process sees as EngineDeadError.
"""

from __future__ import annotations

import atexit
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxllm.distributed.leader import (
    FETCH,
    HEADER,
    PROMPT,
    RECENT_STEPS,
    STEP,
    STOP,
    Leader,
    broadcast,
)
from jaxllm.worker.input_batch import DeviceInputs

if TYPE_CHECKING:
    from jaxllm.config import ParallelConfig
    from jaxllm.worker.model_runner import ModelRunner

HEARTBEAT_TIMEOUT_S = 5
def initialize(cfg: ParallelConfig) -> None:
    """Join the distributed runtime; must come before anything starts a JAX backend."""
    assert cfg.coordinator_address is not None  # start() joins for several hosts only
    # CPU devices of different processes reduce through gloo (GPUs use NCCL regardless).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(cfg.coordinator_address, num_processes=cfg.num_processes,
                               process_id=cfg.process_id,
                               heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)


def input_size(runner: ModelRunner, shape: tuple[int, int]) -> int:
    return DeviceInputs.packed_size(runner.input_shapes(shape))


def warm_up(runner: ModelRunner, prompt_rows: int) -> None:
    """Broadcast every size once (all processes, same order), so serving compiles nothing."""
    broadcast(np.zeros(HEADER, np.int32))
    shapes = runner.bucket_shapes()
    rows = {runner.step_sizes(shape)[1] for shape in shapes}
    for size in sorted({input_size(runner, s) for s in shapes} | {2 * prompt_rows} | rows):
        broadcast(np.zeros(size, np.int32))


def follow(runner: ModelRunner, prompt_rows: int) -> int:
    """A follower's loop: run what process 0 broadcasts until it says STOP; returns the number
    of steps run."""
    shapes = runner.bucket_shapes()
    steps = 0
    hidden: jax.Array | None = None
    recent: dict[int, jax.Array] = {}  # launch index -> that step's logits
    compiles: list[str] = []  # warm-up covers every call below: any compile here is reported

    def on_event(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if "backend_compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    while True:
        if compiles:
            print(f"follower: {len(compiles)} compile(s) while serving", flush=True)
            compiles.clear()
        command, index, count = broadcast(np.zeros(HEADER, np.int32)).tolist()
        if command == STOP:
            return steps
        if command == STEP:
            shape = shapes[index]
            flat = broadcast(np.zeros(input_size(runner, shape), np.int32))
            *_, logits, hidden = runner.launch(shape, flat)
            recent[runner.launches] = logits
            old = recent.pop(runner.launches - RECENT_STEPS, None)
            if old is not None:  # as process 0's release(): no fresh buffer every step
                runner.reuse_logits(old)
            steps += 1
        elif command == FETCH:
            runner.gather_rows(recent[index], broadcast(np.zeros(count, np.int32)))
        elif command == PROMPT:
            flat = broadcast(np.zeros(2 * prompt_rows, np.int32))
            if hidden is None:
                raise RuntimeError("follower: process 0 asked for prompt logprobs before a step")
            runner.launch_prompt(hidden, flat[:prompt_rows], flat[prompt_rows:])
        else:
            raise RuntimeError(f"follower: unknown command {command} from process 0")


# --- EngineCore hooks ---------------------------------------------------------------------------


def start(parallel_config: ParallelConfig) -> ParallelConfig | None:
    """Join the runtime when the config names a coordinator (EngineCore, before JAX starts a
    backend); returns the config then, None for one process."""
    if not parallel_config.multihost:
        return None
    initialize(parallel_config)
    return parallel_config


def agree(cfg: ParallelConfig | None, value: int) -> int:
    """Process 0's value on every process (the KV block count: each sizes its own device)."""
    if cfg is None:
        return value
    return int(broadcast(np.array([value], np.int64))[0])


def attach(cfg: ParallelConfig | None, runner: ModelRunner, prompt_rows: int) -> None:
    """After compile: warm the broadcasts; process 0's runner announces its launches."""
    if cfg is None:
        return
    warm_up(runner, prompt_rows)
    if cfg.process_id == 0:
        runner.leader = Leader(runner.bucket_shapes())
        atexit.register(runner.leader.stop)
