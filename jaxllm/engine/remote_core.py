"""Data-parallel engine cores that join the frontend over TCP: cores on other hosts (`jaxllm
serve --headless`) and Ray actors (vLLM's multi-node data parallelism).

The frontend binds a handshake socket (ROUTER) at `data_parallel_address`:`data_parallel_rpc_port`
and waits for the ranks no local process runs. Each such core connects (DEALER), says who it is
(CoreHello), and gets a CoreWelcome: the addresses of two sockets the frontend bound for it alone
on TCP, and the frontend's engine settings (every core runs the same engine), or the reason it is
refused (a rank nobody waits for, or taken; another model). It then connects to them and the
rest is as for a core on this host (mp_client.CoreConnection): the ready handshake, then
requests and outputs.

Neither side has the other's process to watch: the frontend sends a heartbeat every
HEARTBEAT_INTERVAL_S, the core one when it has sent nothing else for that long, and each counts
the other as dead after the frontend's heartbeat_timeout_s() of silence (the core gets it in its
welcome): the frontend fails the core's requests (as for a dead local core), the core exits.

The port and the core sockets take any peer: run them on a trusted network only.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from jaxllm.config import LaunchConfig
from jaxllm.engine import EngineDeadError
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.engine.mp_client import CoreConnection
from jaxllm.engine.serial_utils import (
    ENGINE_READY_TIMEOUT_ENV,
    HEARTBEAT_INTERVAL_S,
    CoreHello,
    CoreWelcome,
    RequestType,
    engine_ready_timeout_s,
    heartbeat_timeout_s,
)

logger = logging.getLogger(__name__)

_POLL_MS = 100
# How long a closing connection still tries to deliver the request to exit (a core that does
# not get it exits once the heartbeats stop).
SHUTDOWN_LINGER_MS = 1000


def tcp_address(host: str, port: int | str) -> str:
    host = host.strip("[]")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def endpoint_port(endpoint: str) -> str:
    """The port of a bound ZMQ endpoint (`tcp://127.0.0.1:40123`)."""
    return endpoint.rsplit(":", 1)[1]


class RemoteCore(CoreConnection):
    """A core that joined over TCP: its sockets, bound on `bind_host` at ports the system picks,
    and a monitor thread that sends heartbeats and watches for the core's."""

    def __init__(self, hello: CoreHello, bind_host: str, heartbeat_timeout: float) -> None:
        super().__init__(hello.engine_index)
        self.host = hello.host
        self.pid = hello.pid
        self.heartbeat_timeout = heartbeat_timeout
        try:
            self.ctx.setsockopt(zmq.IPV6, int(":" in bind_host))  # the sockets' default
            bound = self.bind(tcp_address(bind_host, "*"), tcp_address(bind_host, "*"))
        except BaseException:
            self.ctx.destroy(linger=0)
            raise
        # Told as the address the frontend was given: the bound one may be a wildcard's or a
        # name's resolution, not what the core's host reaches.
        self.input_address, self.output_address = (
            tcp_address(bind_host, endpoint_port(e)) for e in bound)

    def describe(self) -> str:
        return f"data-parallel engine core {self.engine_index} (host {self.host}, pid {self.pid})"

    def start(self, deadline: float, cancel: threading.Event) -> None:
        """Wait for the core's ready message (it loads and compiles meanwhile) and for its
        connection to the input socket, then watch it."""
        timeout = self.heartbeat_timeout

        def alive() -> None:
            silent = time.monotonic() - self.last_heard
            if silent > timeout:
                raise RuntimeError(f"{self.describe()} sent nothing for {silent:.0f} s while "
                                   f"starting: its process or host is gone (its log is there)")
            if cancel.is_set():
                raise RuntimeError("the engine core's start was abandoned")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.describe()} did not finish starting within "
                                   f"{engine_ready_timeout_s():.0f} s "
                                   f"({ENGINE_READY_TIMEOUT_ENV})")

        self.ready = self.wait_ready(alive)
        self.wait_connected(alive)
        self.start_output_thread()
        self.monitor_thread = threading.Thread(target=self._monitor, daemon=True,
                                               name="RemoteEngineCoreMonitor")
        self.monitor_thread.start()

    def _monitor(self) -> None:
        timeout = self.heartbeat_timeout
        while not self.closing and self.dead is None:
            time.sleep(HEARTBEAT_INTERVAL_S)
            silent = time.monotonic() - self.last_heard
            if silent > timeout and not self.closing:
                logger.error("%s sent nothing for %.0f s: counted as dead", self.describe(),
                             silent)
                self._fail(EngineDeadError(f"{self.describe()} sent nothing for {silent:.0f} "
                                           f"s: its process or host is gone"))
                return
            # Never waits: a send in progress (a heartbeat enough) or no connection (the
            # core's silence will tell) skips this one.
            if self._send_lock.acquire(blocking=False):
                try:
                    self.input_socket.send_multipart((RequestType.HEARTBEAT.value, b""),
                                                     flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                finally:
                    self._send_lock.release()

    def close(self) -> None:
        """Ask the core to exit (it also exits once our heartbeats stop), stop the threads and
        close the sockets, letting the request to exit go out. Idempotent."""
        if self.closed:
            return
        self.closed = True
        asked, self.closing = self.closing, True
        if not asked and self.dead is None:
            try:
                self._send_shutdown()
            except (zmq.ZMQError, AttributeError):
                pass
        self._close_connection(linger_ms=SHUTDOWN_LINGER_MS)


def start_remote_cores(engine_args: EngineArgs, launch_config: LaunchConfig, ranks: list[int],
                       cancel: threading.Event, check: Callable[[], object] = lambda: None
                       ) -> list[RemoteCore]:
    """Wait at the handshake address for the cores of `ranks` to join, welcome each, then wait
    for every one to be ready (they load and compile at once); in rank order. A core that
    fails, or the deadline (`ENGINE_READY_TIMEOUT_ENV`), or `cancel` ends the start: the cores
    that joined are closed and the error raised. `engine_args`: what every core runs, the model
    as the user named it (each host resolves a Hub id itself). `check` raises when what
    launched the cores knows one ended (a Ray actor)."""
    parallel = launch_config.parallel_config
    host = parallel.data_parallel_address
    address = tcp_address(host, parallel.data_parallel_rpc_port)
    welcome_args = msgspec.json.encode(engine_args).decode()
    welcome_launch = msgspec.json.encode(launch_config).decode()
    deadline = time.monotonic() + engine_ready_timeout_s()
    heartbeat_timeout = heartbeat_timeout_s()
    ctx = zmq.Context()
    ctx.setsockopt(zmq.IPV6, int(":" in host))
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.bind(address)
    except zmq.ZMQError as e:
        ctx.destroy(linger=0)
        raise RuntimeError(f"the frontend cannot listen for data-parallel engine cores at "
                           f"{address} (data_parallel_address, data_parallel_rpc_port): "
                           f"{e}") from None
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    if _is_loopback(bound) and not _is_loopback(address):
        logger.warning("data_parallel_address %s is a loopback address here (%s): engine cores "
                       "on other hosts cannot reach it; give this host's address in their "
                       "network", host, bound)
    logger.info("waiting for data-parallel engine cores %s to join at %s", ranks, address)
    waiting = set(ranks)
    joined: dict[int, CoreHello] = {}
    cores: dict[int, RemoteCore] = {}
    pool = concurrent.futures.ThreadPoolExecutor(max(len(ranks), 1),
                                                 thread_name_prefix="RemoteCoreStart")
    starts: dict[int, concurrent.futures.Future] = {}
    ok = False
    try:
        while waiting:
            if cancel.is_set():
                raise RuntimeError("the engine cores' start was abandoned")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"data-parallel engine core(s) {sorted(waiting)} did not join the frontend "
                    f"at {address} within {engine_ready_timeout_s():.0f} s "
                    f"({ENGINE_READY_TIMEOUT_ENV}); start them on their hosts with `jaxllm "
                    f"serve --headless --data-parallel-size {parallel.data_parallel_size} "
                    f"--data-parallel-size-local K --data-parallel-start-rank R "
                    f"--data-parallel-address {host} --data-parallel-rpc-port "
                    f"{parallel.data_parallel_rpc_port}`")
            _raise_failed(starts)
            check()
            if not sock.poll(_POLL_MS):
                continue
            frames = sock.recv_multipart()
            if len(frames) != 2:  # not a core's DEALER: nobody to answer
                logger.warning("ignored a message of %d frames at the data-parallel handshake "
                               "address", len(frames))
                continue
            ident, payload = frames
            welcome, core = _answer(payload, waiting, joined, engine_args, host,
                                    heartbeat_timeout)
            if core is not None:
                welcome = CoreWelcome(core.input_address, core.output_address, welcome_args,
                                      welcome_launch, heartbeat_timeout)
                joined[core.engine_index] = CoreHello(core.engine_index, core.host, core.pid)
                cores[core.engine_index] = core
                waiting.discard(core.engine_index)
                logger.info("%s joined", core.describe())
                starts[core.engine_index] = pool.submit(core.start, deadline, cancel)
            sock.send_multipart((ident, msgspec.msgpack.encode(welcome)))
        while True:  # every core loads and compiles; any may fail meanwhile
            _, loading = concurrent.futures.wait(
                starts.values(), timeout=_POLL_MS / 1000,
                return_when=concurrent.futures.FIRST_EXCEPTION)
            _raise_failed(starts)
            if not loading:
                break
            check()
        ok = True
        return [cores[r] for r in sorted(cores)]
    finally:
        if not ok:
            cancel.set()
        pool.shutdown(wait=True)
        if not ok:
            for core in cores.values():
                core.close()
        # Refusals still queued go out; the port is free again once every core joined.
        ctx.destroy(linger=1000)


def _raise_failed(starts: dict[int, concurrent.futures.Future]) -> None:
    for rank, fut in sorted(starts.items()):
        if fut.done() and fut.exception() is not None:
            raise RuntimeError(f"data-parallel engine core {rank} failed to start: "
                               f"{fut.exception()}") from fut.exception()


def _is_loopback(address: str) -> bool:
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host in ("::1", "localhost")


def _answer(payload: bytes, waiting: set[int], joined: dict[int, CoreHello],
            engine_args: EngineArgs, bind_host: str, heartbeat_timeout: float
            ) -> tuple[CoreWelcome, RemoteCore | None]:
    """A refusal, or the new core (its welcome is the caller's)."""
    try:
        hello = msgspec.msgpack.decode(payload, type=CoreHello)
    except msgspec.DecodeError as e:
        logger.warning("refused a data-parallel handshake that could not be read: %s", e)
        return CoreWelcome(error=f"the frontend could not read the handshake: {e}"), None
    taken = joined.get(hello.engine_index)
    if taken is not None:
        error = (f"engine core rank {hello.engine_index} joined already (host {taken.host}, "
                 f"pid {taken.pid}): check --data-parallel-start-rank")
    elif hello.engine_index not in waiting:
        error = (f"engine core rank {hello.engine_index} is not one the frontend waits for "
                 f"(it waits for {sorted(waiting)}): check --data-parallel-start-rank and "
                 f"--data-parallel-size-local")
    elif hello.model is not None and hello.model != engine_args.model:
        error = (f"this host was started with model {hello.model!r}, the frontend serves "
                 f"{engine_args.model!r}")
    else:
        return CoreWelcome(), RemoteCore(hello, bind_host, heartbeat_timeout)
    logger.warning("refused data-parallel engine core %d from %s (pid %d): %s",
                   hello.engine_index, hello.host, hello.pid, error)
    return CoreWelcome(error=error), None
