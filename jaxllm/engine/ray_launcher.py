"""RayLauncher: data-parallel engine cores as Ray actors (`data_parallel_backend="ray"`, vLLM's
Ray data parallelism).

One actor per rank, each asking Ray for what its core's devices need, so that Ray places it on a
node that has them. The actor joins the frontend over TCP like a `--headless` host's core
(remote_core.py: the handshake, then requests, outputs and heartbeats both ways) by running
`core_proc.run_joined_core` until the core stops: on the frontend's SHUTDOWN, or once its
heartbeats stop. The frontend watches the cores by those heartbeats; Ray's view of an actor
(where it runs, that it died) is for placement and for the log.

Ray: the cluster this process is connected to (`ray.init` called already), else the one
`ray.init()` finds (RAY_ADDRESS, or a cluster `ray start` began on this host), else a local one
it starts; one started here for the engine ends with the engine's last launcher. Every node
must import the same jaxllm: installed there, or this checkout at the same path (the actors get
it on their PYTHONPATH, as the frontend's own core processes do).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxllm.config import LaunchConfig, gpu_platform_installed
from jaxllm.engine.mp_client import SHUTDOWN_TIMEOUT_S
from jaxllm.engine.remote_core import tcp_address
from jaxllm.engine.serial_utils import (
    ENGINE_READY_TIMEOUT_ENV,
    HEARTBEAT_TIMEOUT_ENV,
    engine_ready_timeout_s,
)

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.types import ObjectRef

logger = logging.getLogger(__name__)

RAY_MISSING = "data_parallel_backend 'ray' needs Ray: pip install 'jaxllm[ray]'"
# Settings both ends of a joined core read from their environment: the actors get the
# frontend's (a Ray worker's environment is its node's, not the frontend's).
_SHARED_ENV = (HEARTBEAT_TIMEOUT_ENV, ENGINE_READY_TIMEOUT_ENV)
_LOOPBACK = ("127.", "::1", "localhost")
_WATCH_S = 0.5

# The connection to Ray this module opened (ray.init), and how many launchers use it: the last
# one to close disconnects (and so stops a local cluster that ray.init started). A new
# connection (after someone else's ray.shutdown) is a new generation.
_ray_lock = threading.Lock()
_ray_generation = 0
_ray_users = 0


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(RAY_MISSING) from e
    return ray


class EngineCoreActor:
    """One data-parallel engine core in a Ray worker process (`ray.remote` applied by the
    launcher, so that importing this module needs no Ray)."""

    def ready(self) -> tuple[str, str, int]:
        """The Ray node id, host name and pid of this actor, once it can run a core: jaxllm
        imports here, and JAX has no backend yet (the core's device environment is set before
        JAX starts one)."""
        import socket

        import ray

        import jaxllm.engine.core_proc  # noqa: F401  (an import error fails the start here)

        if "jax" in sys.modules:
            from jax._src import xla_bridge

            if xla_bridge.backends_are_initialized():
                raise RuntimeError("JAX started a backend in this Ray worker before the engine "
                                   "core could set its devices")
        return ray.get_runtime_context().get_node_id(), socket.gethostname(), os.getpid()

    def run(self, handshake_address: str, engine_index: int) -> None:
        """Join the frontend and serve until the core stops (the frontend's SHUTDOWN, or its
        heartbeats stop)."""
        from jaxllm.engine.core_proc import log_to_stderr, run_joined_core
        from jaxllm.structured_output.validator import COMPILE_STACK_BYTES

        log_to_stderr(f"EngineCore rank={engine_index} pid={os.getpid()}")
        # As in a core process: grammar compilations recurse as deep as the grammar nests.
        threading.stack_size(COMPILE_STACK_BYTES)
        try:
            run_joined_core(handshake_address, engine_index, 0, 1, None)
        except BaseException:
            # As a core process does: a core whose loop died must not linger (its socket
            # threads, its devices); the frontend sees the silence, the launcher the exit.
            logging.getLogger(__name__).exception("engine core %d died", engine_index)
            sys.stderr.flush()
            os._exit(1)


class RayLauncher:
    """The actors of `ranks`, started at once; they join the frontend at its handshake address
    (bound by the frontend, in another thread). Raises, having killed what it started, when the
    cluster lacks the resources, or an actor is not running within the ready timeout."""

    def __init__(self, launch_config: LaunchConfig, ranks: list[int]) -> None:
        ray = _import_ray()
        self._ray = ray
        self._closed = False
        self._generation = 0  # of the connection this module opened, if this uses it
        self._actors: dict[int, ActorHandle] = {}
        self._runs: dict[int, ObjectRef] = {}
        self._where: dict[int, tuple[str, str, int]] = {}
        self._watcher: threading.Thread | None = None
        self._failure: str | None = None  # an actor's core that ended, while not closed
        parallel = launch_config.parallel_config
        self.address = tcp_address(parallel.data_parallel_address,
                                   parallel.data_parallel_rpc_port)
        self._connect()
        try:
            self.resources = core_resources(
                cores_use_gpus(ray.cluster_resources().get("GPU", 0.0)),
                parallel.tensor_parallel_size)
            check_capacity(available_per_node(), self.resources, len(ranks))
            check_reachable(parallel.data_parallel_address, ray)
            self._start(ranks)
        except BaseException:
            self.close()
            raise

    # --- Ray -----------------------------------------------------------------------------------

    def _connect(self) -> None:
        global _ray_generation, _ray_users
        ray = self._ray
        with _ray_lock:
            if not ray.is_initialized():
                # Ray's SIGTERM handler would replace the frontend's own.
                main = threading.current_thread() is threading.main_thread()
                previous = signal.getsignal(signal.SIGTERM) if main else None
                try:
                    ray.init(ignore_reinit_error=True, include_dashboard=False,
                             logging_level=logging.WARNING)
                except Exception as e:
                    raise RuntimeError(f"data_parallel_backend 'ray' could not connect to a Ray "
                                       f"cluster or start one: {e}") from e
                finally:
                    if previous is not None:
                        signal.signal(signal.SIGTERM, previous)
                logger.info("connected to Ray at %s", ray.get_runtime_context().gcs_address)
                _ray_generation += 1
                _ray_users = 0
                self._generation = _ray_generation
            elif _ray_users > 0:  # the connection this module opened: one more user
                self._generation = _ray_generation
            if self._generation:
                _ray_users += 1

    def _disconnect(self) -> None:
        global _ray_users
        with _ray_lock:
            if not self._generation or self._generation != _ray_generation:
                return
            self._generation = 0
            _ray_users -= 1
            if _ray_users == 0 and self._ray.is_initialized():
                self._ray.shutdown()

    def _start(self, ranks: list[int]) -> None:
        ray = self._ray
        env = actor_env()
        options: dict[str, Any] = dict(num_cpus=self.resources["CPU"],
                                       num_gpus=self.resources.get("GPU", 0),
                                       runtime_env={"env_vars": env}, max_restarts=0)
        if "GPU" not in self.resources:
            # On CPU a core's XLA runs on every CPU of its node: two on one node slow each
            # other, so Ray spreads them over the nodes where it can.
            options["scheduling_strategy"] = "SPREAD"
        actor_class = ray.remote(EngineCoreActor)
        ready: dict[int, ObjectRef] = {}
        for rank in ranks:
            actor = actor_class.options(**options).remote()
            self._actors[rank] = actor
            ready[rank] = actor.ready.remote()
            # Queued behind `ready` on the actor: the core starts as soon as the actor runs.
            self._runs[rank] = actor.run.remote(self.address, rank)
        logger.info("started %d Ray actors for data-parallel engine cores %s (each %s), to "
                    "join at %s", len(ranks), ranks, self.resources, self.address)
        timeout = engine_ready_timeout_s()
        deadline = time.monotonic() + timeout
        pending = {ref: rank for rank, ref in ready.items()}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1,
                               timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise RuntimeError(
                    f"the Ray actors of data-parallel engine cores {sorted(pending.values())} "
                    f"were not running within {timeout:.0f} s ({ENGINE_READY_TIMEOUT_ENV}): the "
                    f"Ray cluster did not place them (each needs {self.resources}; available "
                    f"now: {describe_nodes(available_per_node())}) or their workers could "
                    f"not start (see Ray's logs)")
            rank = pending.pop(done[0])
            try:
                self._where[rank] = ray.get(done[0])
            except Exception as e:
                raise RuntimeError(f"the Ray actor of data-parallel engine core {rank} failed "
                                   f"to start: {e}") from e
        for rank, (node, host, pid) in sorted(self._where.items()):
            logger.info("data-parallel engine core %d: Ray node %s (host %s, pid %d)", rank,
                        node, host, pid)
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name="RayEngineCoreWatch")
        self._watcher.start()

    def _watch(self) -> None:
        """Log each actor whose core ended other than by close(), and keep the first for
        check() (once started, the frontend learns it from the heartbeats)."""
        ray = self._ray
        pending = {ref: rank for rank, ref in self._runs.items()}
        while pending and not self._closed:
            try:
                done, _ = ray.wait(list(pending), num_returns=1, timeout=_WATCH_S)
            except Exception:  # Ray disconnected
                return
            for ref in done:
                rank = pending.pop(ref)
                try:
                    ray.get(ref)
                    error = "it stopped"
                except Exception as e:
                    error = str(e)
                if not self._closed:
                    logger.error("the Ray actor of data-parallel engine core %d ended: %s",
                                 rank, error)
                    self._failure = self._failure or (
                        f"the Ray actor of data-parallel engine core {rank} ended: {error}")

    # --- the Launcher protocol -----------------------------------------------------------------

    def check(self) -> None:
        """Raise if an actor's core ended (a core that fails before it joins the frontend
        then fails the start at once, not at the ready timeout)."""
        if self._failure is not None:
            raise RuntimeError(self._failure)

    def placement(self, engine_index: int) -> str | None:
        """The Ray node id of the core's actor."""
        where = self._where.get(engine_index)
        return None if where is None else where[0]

    def close(self) -> None:
        """Kill the actors (their cores were asked to stop already, or never joined) and wait,
        for a bounded time, for Ray to report them gone. Idempotent."""
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        if ray.is_initialized():
            for actor in self._actors.values():
                try:
                    ray.kill(actor, no_restart=True)
                except Exception as e:
                    logger.warning("could not kill a Ray engine-core actor: %s", e)
            runs = list(self._runs.values())
            if runs:
                try:
                    ray.wait(runs, num_returns=len(runs), timeout=SHUTDOWN_TIMEOUT_S)
                except Exception:
                    pass
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=2 * _WATCH_S)
        self._actors.clear()
        self._disconnect()


def cores_use_gpus(cluster_gpus: float) -> bool:
    """Whether each core asks Ray for GPUs: as JAX_PLATFORMS says when it is set, else when
    this host would run JAX on a GPU or the cluster has GPUs (a head node without one, in
    front of GPU nodes, is a common set-up)."""
    if os.environ.get("JAX_PLATFORMS", "").strip():
        return gpu_platform_installed()
    return gpu_platform_installed() or cluster_gpus > 0


def core_resources(gpu: bool, tensor_parallel_size: int) -> dict[str, float]:
    """What one core's actor asks Ray for. On a GPU host its `tensor_parallel_size` GPUs (Ray
    then sets its CUDA_VISIBLE_DEVICES) and a CPU for its host work. On CPU one CPU, a token
    for placement rather than a share: the core's XLA host platform runs on every CPU of its
    node (as a --headless host's one core does), and asking for all of them would fail on a
    node where anything else holds one; spreading the cores over nodes (SPREAD) keeps them
    apart instead."""
    if gpu:
        return {"CPU": 1, "GPU": tensor_parallel_size}
    return {"CPU": 1}


def actor_env() -> dict[str, str]:
    """The actors' environment additions: this checkout on the PYTHONPATH unless jaxllm is an
    installed package (a node's own Python has it then), and the frontend's settings that both
    ends of a joined core read."""
    env = {k: os.environ[k] for k in _SHARED_ENV if k in os.environ}
    root = Path(__file__).resolve().parents[2]
    if root.name not in ("site-packages", "dist-packages"):
        env["PYTHONPATH"] = f"{root}{os.pathsep}${{PYTHONPATH}}"  # Ray expands ${...}
    return env


def available_per_node() -> dict[str, dict[str, float]]:
    """Each live node's available resources (Ray's developer API, as vLLM reads them)."""
    from ray._private.state import available_resources_per_node

    return available_resources_per_node()


def describe_nodes(nodes: dict[str, dict[str, float]]) -> str:
    if not nodes:
        return "no live node"
    parts = []
    for node, res in sorted(nodes.items()):
        shown = ", ".join(f"{k} {v:g}" for k, v in sorted(res.items()) if k in ("CPU", "GPU"))
        parts.append(f"node {node[:12]}: {shown or 'no CPU or GPU'}")
    return "; ".join(parts)


def check_capacity(nodes: dict[str, dict[str, float]], need: dict[str, float], n: int) -> None:
    """Raise unless the nodes' available resources hold `n` actors of `need` (each on one
    node): an actor Ray cannot place would otherwise wait for the ready timeout."""
    fits = sum(min(math.floor(res.get(k, 0.0) / v + 1e-9) for k, v in need.items() if v > 0)
               for res in nodes.values())
    if fits < n:
        raise RuntimeError(f"data_parallel_backend 'ray': {n} engine cores need {need} each (on "
                           f"one node), and the Ray cluster has room for {fits}: available "
                           f"{describe_nodes(nodes)}")


def check_reachable(address: str, ray: Any) -> None:
    """A loopback data_parallel_address reaches the frontend from this host's Ray nodes only:
    with nodes on other hosts an actor placed there could never join (it would wait for the
    ready timeout)."""
    if not address.startswith(_LOOPBACK):
        return
    here = ray.util.get_node_ip_address()
    others = sorted({node["NodeManagerAddress"] for node in ray.nodes()
                     if node.get("Alive") and node["NodeManagerAddress"] != here
                     and not node["NodeManagerAddress"].startswith(_LOOPBACK)})
    if others:
        raise RuntimeError(f"data_parallel_address {address} is this host's loopback, which the "
                           f"Ray nodes on other hosts ({', '.join(others)}) cannot reach: set "
                           f"--data-parallel-address to this host's address in the cluster "
                           f"({here})")
