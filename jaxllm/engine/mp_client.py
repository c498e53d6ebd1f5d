"""SyncMPClient and AsyncMPClient: the engine core in its own process (core_proc.py), over ZMQ
IPC sockets in a private temporary directory (vLLM's MPClient family).

This process binds two sockets, input (PUSH) and output (PULL), and starts the core with
`python -m jaxllm.engine.core_proc`, which connects to them. The core's first message is the
ready handshake (EngineCoreInfo: limits, dtype, platform); nothing here touches JAX's backends.

Threads on this side, all holding only the `CoreProcess` (never the client, so that garbage
collection of the client still runs its finalizer):

  output thread   output socket -> decode -> the outputs queue, utility futures
  monitor thread  waits on the child process; if it dies while not shutting down, every
                  waiting caller and every later call gets EngineDeadError (ZMQ itself never
                  reports a dead peer)

The async client uses the same thread rather than a zmq.asyncio socket: one code path, and the
client can be built before an event loop runs (AsyncLLM's constructor is synchronous). The
thread hands outputs to the loop with call_soon_threadsafe; sends are non-blocking
(unbounded PUSH queue) so the async methods call them directly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from jaxllm.config import LaunchConfig, data_parallel_device_env, platform_env
from jaxllm.engine import EngineCoreInfo, EngineCoreOutputs, EngineCoreRequest, EngineDeadError
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.engine.core_client import EngineCoreClient, check_utility
from jaxllm.engine.serial_utils import (
    OUTPUT_DECODERS,
    UTILITY_RESULT_TYPES,
    MsgpackDecoder,
    MsgpackEncoder,
    OutputType,
    ReadyMessage,
    RequestType,
    UtilityRequest,
)

logger = logging.getLogger(__name__)

# How long a clean shutdown waits for the core to exit before it is terminated, then killed.
SHUTDOWN_TIMEOUT_S = 5.0

_POLL_MS = 100
# How long a send waits for the core's connection (see CoreConnection._send_frames).
SEND_WAIT_S = 1.0


def child_env(launch_config: LaunchConfig, local_index: int = 0) -> dict[str, str]:
    """The child must import the same jaxllm as this process, installed or not, and find in
    its environment the XLA flags its backend must start with, and, one of several
    data-parallel cores, its own devices."""
    env = with_jaxllm_path(dict(os.environ))
    env.update(platform_env(launch_config, env))
    parallel = launch_config.parallel_config
    if parallel.data_parallel_size > 1:
        env.update(data_parallel_device_env(env, local_index, parallel.data_parallel_size_local,
                                            parallel.local_devices))
    return env


def with_jaxllm_path(env: dict[str, str]) -> dict[str, str]:
    """`env` with this jaxllm first on PYTHONPATH: a core process must import the same jaxllm
    as its parent, installed or not."""
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _compilation_cache_dir() -> str | None:
    """The XLA disk cache this process configured (LLM / AsyncLLM do), for the child to use;
    reading JAX's config starts no backend."""
    jax = sys.modules.get("jax")
    return None if jax is None else jax.config.jax_compilation_cache_dir


class CoreConnection:
    """This side of one engine core: the two sockets this process binds, the output thread,
    the outputs queue and the utility futures. How the core starts and how its death is
    noticed are the subclass's: a child process here (CoreProcess), or a core that joined over
    TCP (remote_core.RemoteCore). `engine_index`: which of several data-parallel cores."""

    def __init__(self, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.host = socket.gethostname()  # where the core runs
        self.closed = False
        self.closing = False
        self.dead: EngineDeadError | None = None
        self.outputs: queue.Queue[EngineCoreOutputs | BaseException] = queue.Queue()
        self.pending: dict[int, tuple[concurrent.futures.Future, str]] = {}
        self.wakeups: list[Callable[[], None]] = []  # async clients' event-loop notifiers
        self._call_ids = itertools.count()
        self._send_lock = threading.Lock()
        self._encoder = MsgpackEncoder()
        self.last_heard = time.monotonic()  # any message from the core
        self.ready: ReadyMessage  # set once the core is ready
        self.ctx = zmq.Context()

    def bind(self, input_address: str, output_address: str) -> tuple[str, str]:
        """Bind the input (PUSH) and output (PULL) sockets; the addresses bound (a TCP port 0
        becomes the one the system chose)."""
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)  # unbounded: a send never blocks
        self.input_socket.bind(input_address)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.bind(output_address)
        return (self.input_socket.getsockopt_string(zmq.LAST_ENDPOINT),
                self.output_socket.getsockopt_string(zmq.LAST_ENDPOINT))

    def wait_ready(self, alive: Callable[[], None]) -> ReadyMessage:
        """The handshake: the core's first message, once it loaded, sized KV and compiled.
        `alive` raises when the core can no longer answer (or the start must end)."""
        while True:
            if self.output_socket.poll(_POLL_MS):
                kind_frame, payload = self.output_socket.recv_multipart()
                self.last_heard = time.monotonic()
                kind = OutputType(kind_frame)
                if kind is OutputType.HEARTBEAT:
                    continue
                msg = OUTPUT_DECODERS[kind].decode(payload)
                if kind is OutputType.READY:
                    return msg
                if kind is OutputType.STARTUP_FAILED:
                    raise RuntimeError(f"the engine core failed to start:\n{msg}")
                raise RuntimeError(f"unexpected {kind.name} message before the handshake")
            alive()

    def wait_connected(self, alive: Callable[[], None]) -> None:
        """Until the core's connection to the input socket is up (it connects before READY,
        but a connection completes in the background): a send then finds it."""
        while not self.input_socket.poll(_POLL_MS, zmq.POLLOUT):
            alive()

    def start_output_thread(self) -> None:
        self.output_thread = threading.Thread(target=self._process_output_socket, daemon=True,
                                              name="EngineCoreClientOutputThread")
        self.output_thread.start()

    # --- this side's threads ------------------------------------------------------------------

    def _process_output_socket(self) -> None:
        sock = self.output_socket
        try:
            while not self.closing:
                if not sock.poll(_POLL_MS):
                    continue
                kind_frame, payload = sock.recv_multipart(copy=False)
                self.last_heard = time.monotonic()
                kind = OutputType(kind_frame.bytes)
                if kind is OutputType.HEARTBEAT:
                    continue
                msg = OUTPUT_DECODERS[kind].decode(payload.buffer)
                if kind is OutputType.OUTPUTS:
                    self.outputs.put(msg)
                    self._wake()
                elif kind is OutputType.UTILITY:
                    self._resolve_utility(msg)
        except Exception as e:
            if self.closing:
                return
            # Nobody would ever hear from the core again: fail every caller instead.
            logger.exception("engine core client output thread failed")
            self._fail(EngineDeadError(f"reading the engine core's outputs failed: "
                                       f"{type(e).__name__}: {e}"))

    def _resolve_utility(self, msg: Any) -> None:
        fut, method = self.pending.pop(msg.call_id, (None, ""))
        if fut is None or fut.done():
            return
        if msg.error is not None:
            fut.set_exception(RuntimeError(f"utility call {method!r} failed in the engine "
                                           f"core: {msg.error}"))
            return
        try:
            decoder = MsgpackDecoder(UTILITY_RESULT_TYPES.get(method, Any))
            fut.set_result(decoder.decode(msg.result))
        except Exception as e:
            fut.set_exception(e)

    def _fail(self, err: EngineDeadError) -> None:
        """Every waiting and every later caller gets `err`."""
        if self.dead is not None:
            return
        self.dead = err
        self.outputs.put(err)
        for fut, _ in list(self.pending.values()):
            if not fut.done():
                fut.set_exception(self.dead_error())
        self.pending.clear()
        self._wake()

    def _wake(self) -> None:
        for wake in list(self.wakeups):
            wake()

    # --- calls from the client ----------------------------------------------------------------

    def dead_error(self) -> EngineDeadError:
        """A fresh exception each time: one instance raised again and again would gather every
        caller's traceback (and keep their frames, and the engine, alive)."""
        assert self.dead is not None  # asked for once the core died
        return EngineDeadError(*self.dead.args)

    def send(self, kind: RequestType, payload: Any = None) -> None:
        if self.dead is not None:
            if kind is RequestType.ABORT:
                return  # nothing left to abort
            raise self.dead_error()
        data = b"" if payload is None else self._encoder.encode(payload)
        with self._send_lock:
            try:
                self._send_frames((kind.value, data))
            except EngineDeadError:
                if kind is not RequestType.ABORT:
                    raise

    def _send_frames(self, frames: tuple[bytes, bytes]) -> None:
        """Send without blocking for long: a PUSH socket whose core is not connected (its
        connection dropped: it died) would wait forever. One that gets no core within
        SEND_WAIT_S counts as dead (the monitor may not have seen it yet)."""
        sock = self.input_socket
        deadline = time.monotonic() + SEND_WAIT_S
        while self.dead is None:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if time.monotonic() > deadline:
                    self._fail(EngineDeadError(f"engine core {self.engine_index} cannot be "
                                               f"reached: its connection is gone"))
                    break
                sock.poll(_POLL_MS, zmq.POLLOUT)
        raise self.dead_error()

    def call_utility(self, method: str, args: tuple) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self.pending[call_id] = (fut, method)
        try:
            self.send(RequestType.UTILITY, UtilityRequest(call_id, method, list(args)))
        except BaseException:
            self.pending.pop(call_id, None)
            raise
        return fut

    def get_output_nowait(self) -> EngineCoreOutputs | None:
        try:
            item = self.outputs.get_nowait()
        except queue.Empty:
            return None
        return self._unwrap(item)

    def get_output(self) -> EngineCoreOutputs:
        return self._unwrap(self.outputs.get())

    def _unwrap(self, item: EngineCoreOutputs | BaseException) -> EngineCoreOutputs:
        if isinstance(item, BaseException):
            self.outputs.put(item)  # for the next waiter too
            raise self.dead_error()
        return item

    def _send_shutdown(self) -> None:
        with self._send_lock:
            self.input_socket.send_multipart((RequestType.SHUTDOWN.value, b""),
                                             flags=zmq.NOBLOCK)

    def request_shutdown(self) -> None:
        """Ask the core to exit without waiting (close() then waits): several cores wind down
        together."""
        if self.closing or self.dead is not None:
            return
        self.closing = True
        try:
            self._send_shutdown()
        except (zmq.ZMQError, AttributeError):  # no socket yet: close() ends it
            pass

    def close(self) -> None:
        raise NotImplementedError

    def _close_connection(self, linger_ms: int = 0) -> None:
        """This side's part of close(): the output thread, the callers, the sockets (what is
        queued on them is sent for up to `linger_ms`)."""
        thread = getattr(self, "output_thread", None)
        if thread is not None and thread is not threading.current_thread():
            # It looks at `closing` between polls; the sockets close once it stopped.
            thread.join(timeout=SHUTDOWN_TIMEOUT_S)
        self._fail(EngineDeadError("the engine core was shut down"))
        # ZMQ sockets are not thread-safe: under the send lock, no other thread (a heartbeat,
        # a caller that passed the dead check just before) is sending while they close; a send
        # after it finds them closed (ZMQError).
        with self._send_lock:
            self.ctx.destroy(linger=linger_ms)


class CoreProcess(CoreConnection):
    """A core in a child process of this one, over IPC sockets in a private temporary
    directory; closed exactly once. `cancel`: set by another thread, abandons the start (a
    sibling core failed to start)."""

    def __init__(self, engine_args: EngineArgs, launch_config: LaunchConfig,
                 engine_index: int = 0, cancel: threading.Event | None = None) -> None:
        super().__init__(engine_index)
        self.cancel = cancel
        self.proc: subprocess.Popen | None = None
        self.death_w: int | None = None
        self.tmpdir = tempfile.mkdtemp(prefix="jaxllm-core-")
        try:
            self._start(engine_args, launch_config)
        except BaseException:
            self.close()
            raise

    def _start(self, engine_args: EngineArgs, launch_config: LaunchConfig) -> None:
        input_address, output_address = self.bind(f"ipc://{self.tmpdir}/input",
                                                  f"ipc://{self.tmpdir}/output")
        death_r, self.death_w = os.pipe()
        cmd = [sys.executable, "-m", "jaxllm.engine.core_proc",
               "--input-address", input_address, "--output-address", output_address,
               "--death-fd", str(death_r),
               "--engine-args", msgspec.json.encode(engine_args).decode(),
               "--launch-config", msgspec.json.encode(launch_config).decode()]
        cache = _compilation_cache_dir()
        if cache:
            cmd += ["--compilation-cache-dir", cache]
        parallel = launch_config.parallel_config
        local_index = self.engine_index - parallel.data_parallel_start_rank
        try:
            # The child's stdout goes to our stderr: a CLI's stdout carries only its results.
            proc = self.proc = subprocess.Popen(
                cmd, pass_fds=(death_r,), env=child_env(launch_config, local_index),
                stdin=subprocess.DEVNULL,
                stdout=sys.stderr.fileno() if has_fileno(sys.stderr) else None)
        finally:
            os.close(death_r)
        self.ready = self.wait_ready(lambda: self._check_starting(proc))
        self.wait_connected(lambda: self._check_starting(proc))
        self.start_output_thread()
        self.monitor_thread = threading.Thread(target=self._monitor, args=(proc,), daemon=True,
                                               name="EngineCoreMonitor")
        self.monitor_thread.start()

    def _check_starting(self, proc: subprocess.Popen) -> None:
        rc = proc.poll()
        if rc is not None:
            raise RuntimeError(f"the engine core process exited with code {rc} during "
                               f"start-up (its log is above, on stderr)")
        if self.cancel is not None and self.cancel.is_set():
            raise RuntimeError("the engine core's start was abandoned")

    def _monitor(self, proc: subprocess.Popen) -> None:
        rc = proc.wait()
        if not self.closing:
            logger.error("engine core process %d died (exit code %s)", proc.pid, rc)
            self._fail(EngineDeadError(f"the engine core process ({proc.pid}) died with "
                                       f"exit code {rc}; see its log on stderr"))

    def request_shutdown(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        super().request_shutdown()

    def kill(self) -> None:
        """End the process now, if it still runs (a core found dead whose process lingers, so
        that a replacement gets its devices); close() still does the rest."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Ask the core to exit (terminate / kill it if it does not in time), stop the threads,
        close the sockets and remove their directory. Idempotent."""
        if self.closed:
            return
        self.closed = True
        asked, self.closing = self.closing, True
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                if not asked:
                    self._send_shutdown()
                proc.wait(SHUTDOWN_TIMEOUT_S)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                proc.terminate()
                try:
                    proc.wait(SHUTDOWN_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.death_w is not None:
            os.close(self.death_w)
            self.death_w = None
        self._close_connection()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True


class MPClient(EngineCoreClient):
    """Starts the core process; `shutdown()`, or garbage collection of the client, ends it."""

    def __init__(self, engine_args: EngineArgs, launch_config: LaunchConfig) -> None:
        self.resources = CoreProcess(engine_args, launch_config)
        self._finalizer = weakref.finalize(self, self.resources.close)
        self.ready: ReadyMessage = self.resources.ready

    @property
    def core_pid(self) -> int:
        return self.ready.pid

    def get_engine_info(self) -> EngineCoreInfo:
        return self.ready.info

    def shutdown(self) -> None:
        self._finalizer()


class SyncMPClient(MPClient):
    """Blocking calls; get_output() waits for the core's next step (the core steps on its own,
    whether or not anyone is waiting)."""

    def add_request(self, request: EngineCoreRequest) -> None:
        self.resources.send(RequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.resources.send(RequestType.ABORT, list(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        return self.resources.get_output()

    def call_utility(self, method: str, *args: Any) -> Any:
        check_utility(method)
        return self.resources.call_utility(method, args).result()


class AsyncMPClient(MPClient):
    """The `*_async` calls, for one asyncio event loop (bound on first use)."""

    def __init__(self, engine_args: EngineArgs, launch_config: LaunchConfig) -> None:
        super().__init__(engine_args, launch_config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def _bind_loop(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._event is not None:
            return self._event
        self._loop, event = loop, asyncio.Event()
        self._event = event

        def wake() -> None:  # from the output / monitor thread; holds no client ref
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop was closed
                pass

        self.resources.wakeups[:] = [wake]
        return event

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.resources.send(RequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            self.resources.send(RequestType.ABORT, list(request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        event = self._bind_loop()
        while True:
            out = self.resources.get_output_nowait()
            if out is not None:
                return out
            # Clear, then look again: an output put after the look sets the event after.
            event.clear()
            out = self.resources.get_output_nowait()
            if out is not None:
                return out
            await event.wait()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        check_utility(method)
        self._bind_loop()
        return await asyncio.wrap_future(self.resources.call_utility(method, args))
