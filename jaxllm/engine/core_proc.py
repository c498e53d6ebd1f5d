"""EngineCoreProc: the engine core in its own process (vLLM's EngineCoreProc).

Started by the multiprocess clients as `python -m jaxllm.engine.core_proc ...` (a subprocess, not
multiprocessing's spawn, which would re-import the user's `__main__`). Three threads:

  input thread   ZMQ PULL socket -> decode -> input queue
  busy loop      (main thread) take new requests / aborts / utility calls from the input queue,
                 step the core, put its outputs on the output queue; blocks on the input queue
                 when no request is unfinished
  output thread  output queue -> encode -> ZMQ PUSH socket

so socket I/O and (de)serialization never wait on the device step, and the step never waits on a
slow reader. The first message on the output socket is the ready handshake (or the start-up
error). The child exits when its parent dies: the parent holds the write end of a pipe whose read
end a watcher thread here blocks on; EOF means the parent is gone.

A data-parallel core on another host than its frontend's (`jaxllm serve --headless`) or in a Ray
actor starts with `--handshake-address` instead (`run_joined_core`): it joins the frontend over
TCP (remote_core.py), takes the engine's settings from it, and, with no parent process to
watch, sends heartbeats while its busy loop runs and exits once the frontend falls silent.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import queue
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from jaxllm.config import (
    CPU_AFFINITY_ENV,
    LaunchConfig,
    ParallelConfig,
    data_parallel_device_env,
    platform_env,
)
from jaxllm.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.engine.core_client import check_utility
from jaxllm.engine.gc_utils import freeze_gc_heap
from jaxllm.engine.serial_utils import (
    HEARTBEAT_INTERVAL_S,
    REQUEST_DECODERS,
    CoreHello,
    CoreWelcome,
    MsgpackEncoder,
    OutputType,
    ReadyMessage,
    RequestType,
    UtilityOutput,
    UtilityRequest,
    engine_ready_timeout_s,
)
from jaxllm.structured_output.validator import COMPILE_STACK_BYTES

logger = logging.getLogger("jaxllm.engine.core_proc")

_POLL_MS = 100


class EngineCoreProc:
    """Runs an EngineCore behind two sockets; `run_busy_loop` returns on a SHUTDOWN message."""

    heartbeat_timeout: float | None = None
    heartbeat = False

    def __init__(self, engine_args: EngineArgs, input_address: str, output_address: str,
                 launch_config: LaunchConfig | None = None,
                 heartbeat_timeout: float | None = None) -> None:
        """`heartbeat_timeout`: the core joined over TCP (the frontend is on another host, or
        this is a Ray actor): send heartbeats while the busy loop runs and has nothing else to
        send, and fail once the frontend is silent for this long."""
        self.heartbeat_timeout = heartbeat_timeout
        self.heartbeat = heartbeat_timeout is not None
        # (None, the exception): the input thread failed.
        self.input_queue: queue.Queue[tuple[RequestType | None, Any]] = queue.Queue()
        # None: no more outputs, the output thread closes its socket.
        self.output_queue: queue.Queue[tuple[OutputType, Any] | None] = queue.Queue()
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.IPV6, int(input_address.startswith("tcp://[")))
        self._encoder = MsgpackEncoder()
        # The output thread starts first, so that a start-up failure can still be reported.
        self.output_thread = threading.Thread(target=self.process_output_socket,
                                              args=(output_address,), daemon=True,
                                              name="EngineCoreOutputThread")
        self.output_thread.start()
        try:
            from jaxllm.engine.core import EngineCore

            self.engine_core = EngineCore(engine_args, launch_config)
        except BaseException:
            self.output_queue.put((OutputType.STARTUP_FAILED, traceback.format_exc()))
            self.output_queue.put(None)
            self.output_thread.join(timeout=5)
            raise
        # Loaded and compiled: a full collection of that heap would stall every running
        # request's next step.
        freeze_gc_heap()
        self._shutdown = False
        # Connecting before READY goes out: the frontend waits for this connection before it
        # sends.
        self.input_thread = threading.Thread(target=self.process_input_socket,
                                             args=(input_address,), daemon=True,
                                             name="EngineCoreInputThread")
        self.input_thread.start()
        self.output_queue.put((OutputType.READY, ReadyMessage(
            info=self.engine_core.get_engine_info(), pid=os.getpid())))

    # --- the busy loop (main thread) ----------------------------------------------------------

    def run_busy_loop(self) -> None:
        try:
            while not self._shutdown:
                self._process_input_queue()
                if self._shutdown:
                    break
                self._process_engine_step()
        except BaseException:
            # A dead loop must not look alive: without heartbeats the frontend counts this
            # core as dead even if the process lingers (a Ray actor's).
            self.heartbeat = False
            raise
        self.output_queue.put(None)
        self.output_thread.join(timeout=5)

    def _process_input_queue(self) -> None:
        # Idle: block (no spinning) until something arrives; busy: take what is there.
        while not self._shutdown and not self.engine_core.has_unfinished_requests():
            self._handle(*self.input_queue.get())
        while not self._shutdown:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle(*item)

    def _step_once(self) -> EngineCoreOutputs:
        """The one place the loop steps the core (an asynchronous step slots in here)."""
        return self.engine_core.step()

    def _process_engine_step(self) -> None:
        # An exception here is fatal: the process exits and the frontend's monitor reports
        # EngineDeadError to every caller (requests are validated before they get here).
        self.output_queue.put((OutputType.OUTPUTS, self._step_once()))

    def _handle(self, kind: RequestType | None, payload: Any) -> None:
        if kind is RequestType.ADD:
            self._add_request(payload)
        elif kind is RequestType.ABORT:
            self.engine_core.abort_requests(payload)
        elif kind is RequestType.UTILITY:
            self._call_utility(payload)
        elif kind is RequestType.SHUTDOWN:
            self._shutdown = True
        else:
            raise RuntimeError("the engine core's input thread failed") from payload

    def _add_request(self, req: EngineCoreRequest) -> None:
        try:
            self.engine_core.add_request(req)
        except ValueError as e:
            # What the core alone can see, after the Processor passed it: a LoRA adapter read
            # again (dropped from the host cache) whose directory is gone or changed.
            logger.warning("engine core refused request %r: %s", req.request_id, e)
            self.output_queue.put((OutputType.OUTPUTS, EngineCoreOutputs(outputs=[
                EngineCoreOutput(request_id=req.request_id, new_token_ids=[],
                                 finish_reason="error", stop_reason=str(e))])))
        except Exception:
            # The Processor validates every request, so this is a bug; the frontend still gets
            # an answer (the request ends as aborted) rather than waiting for it forever.
            logger.exception("engine core refused request %r", req.request_id)
            self.output_queue.put((OutputType.OUTPUTS, EngineCoreOutputs(outputs=[
                EngineCoreOutput(request_id=req.request_id, new_token_ids=[],
                                 finish_reason="abort")])))

    def _call_utility(self, call: UtilityRequest) -> None:
        try:
            check_utility(call.method)
            result = getattr(self.engine_core, call.method)(*call.args)
            out = UtilityOutput(call.call_id, msgspec.Raw(self._encoder.encode(result)))
        except Exception as e:
            out = UtilityOutput(call.call_id, error=f"{type(e).__name__}: {e}")
        self.output_queue.put((OutputType.UTILITY, out))

    # --- socket threads -----------------------------------------------------------------------

    def process_input_socket(self, address: str) -> None:
        """The input thread's loop: the frontend's messages from `address`, decoded, into
        input_queue (off the busy loop's thread, so decoding overlaps the steps)."""
        sock = self.ctx.socket(zmq.PULL)
        sock.connect(address)
        timeout, last_heard = self.heartbeat_timeout or 0.0, time.monotonic()
        try:
            while True:
                if self.heartbeat and not sock.poll(_POLL_MS):
                    if time.monotonic() - last_heard > timeout:
                        raise RuntimeError(f"the frontend sent nothing for {timeout:.0f} s: it "
                                           f"or its host is gone")
                    continue
                kind_frame, payload = sock.recv_multipart(copy=False)
                last_heard = time.monotonic()
                kind = RequestType(kind_frame.bytes)
                if kind is RequestType.HEARTBEAT:
                    continue
                if kind is RequestType.SHUTDOWN:
                    self.input_queue.put((kind, None))
                    break
                try:
                    request = REQUEST_DECODERS[kind].decode(payload.buffer)
                except msgspec.DecodeError as e:  # ValidationError included
                    self._refuse_undecodable(kind, payload.buffer, e)
                    continue
                self.input_queue.put((kind, request))
        except Exception as e:
            # A core that cannot hear its frontend must die (the frontend then reports
            # EngineDeadError) rather than idle forever.
            self.input_queue.put((None, e))
        sock.close(linger=0)

    def _refuse_undecodable(self, kind: RequestType, payload: memoryview,
                            error: Exception) -> None:
        """A message the decoder refused (the frontend validates requests, so a bug, or a
        value the two sides check differently) fails that request alone: an ADD whose id can
        still be read finishes with "error"; anything else is logged and dropped."""
        logger.error("engine core could not decode a %s message: %s", kind.name, error)
        if kind is not RequestType.ADD:
            return
        try:
            request_id = msgspec.msgpack.decode(payload)[0]  # an array-like struct
        except Exception:
            return
        if isinstance(request_id, str):
            self.output_queue.put((OutputType.OUTPUTS, EngineCoreOutputs(outputs=[
                EngineCoreOutput(request_id=request_id, new_token_ids=[],
                                 finish_reason="error",
                                 stop_reason=f"the engine core could not decode the request: "
                                             f"{error}")])))

    def process_output_socket(self, address: str) -> None:
        """The output thread's loop: output_queue's outputs, encoded, to the frontend at
        `address` (off the busy loop's thread, so encoding overlaps the steps)."""
        sock = self.ctx.socket(zmq.PUSH)
        sock.connect(address)
        while True:
            try:
                item = self.output_queue.get(timeout=HEARTBEAT_INTERVAL_S if self.heartbeat
                                             else None)
            except queue.Empty:
                if self.heartbeat:
                    sock.send_multipart((OutputType.HEARTBEAT.value, b""))
                continue
            if item is None:
                break
            kind, obj = item
            sock.send_multipart((kind.value, self._encoder.encode(obj)), copy=False)
        # Whatever is queued still goes out (the last outputs, a start-up error).
        sock.close(linger=5000)


def _watch_parent(death_fd: int, socket_dir: str | None) -> None:
    """Blocks until the parent's end of the death pipe closes (the parent exited or was
    killed), then ends this process at once: nobody is left to read its outputs. A parent
    killed outright could not remove the socket directory: done here."""
    try:
        while os.read(death_fd, 1):
            pass
    except OSError:
        pass
    logger.warning("parent process gone: engine core exiting")
    if socket_dir is not None:
        shutil.rmtree(socket_dir, ignore_errors=True)
    os._exit(1)


def _apply_cpu_affinity() -> None:
    """Keep to the CPUs the client gave this core (before JAX sizes its thread pools)."""
    cpus = os.environ.get(CPU_AFFINITY_ENV)
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def _ipc_dir(address: str) -> str | None:
    return os.path.dirname(address[len("ipc://"):]) if address.startswith("ipc://") else None


def join_frontend(handshake_address: str, engine_index: int, model: str | None
                  ) -> CoreWelcome:
    """Say who this core is at the frontend's handshake address and get its welcome: the
    addresses to connect to and the engine's settings. The frontend not answering in time, or
    refusing, ends the process with the reason."""
    ctx = zmq.Context()
    ctx.setsockopt(zmq.IPV6, int(handshake_address.startswith("tcp://[")))
    sock = ctx.socket(zmq.DEALER)
    sock.connect(handshake_address)
    timeout = engine_ready_timeout_s()
    try:
        sock.send(msgspec.msgpack.encode(CoreHello(engine_index, socket.gethostname(),
                                                   os.getpid(), model)))
        if not sock.poll(int(timeout * 1000)):
            raise SystemExit(f"engine core {engine_index}: no frontend answered at "
                             f"{handshake_address} within {timeout:.0f} s")
        welcome = msgspec.msgpack.decode(sock.recv(), type=CoreWelcome)
    finally:
        ctx.destroy(linger=0)
    if welcome.error is not None:
        raise SystemExit(f"engine core {engine_index}: the frontend at {handshake_address} "
                         f"refused it: {welcome.error}")
    return welcome


def run_joined_core(handshake_address: str, engine_index: int, local_index: int = 0,
                    num_local: int = 1, model: str | None = None,
                    multihost: ParallelConfig | None = None) -> None:
    """A data-parallel core on another host than its frontend's, or in a Ray actor: join the
    frontend, take this host's share of devices (local core `local_index` of `num_local`),
    start JAX and serve until told to stop or the frontend goes silent. `multihost`: the
    jax.distributed job this core leads (process 0; its followers run on other hosts), else
    one process. Runs in a process that has not started JAX yet."""
    welcome = join_frontend(handshake_address, engine_index, model)
    engine_args = msgspec.json.decode(welcome.engine_args_json, type=EngineArgs)
    launch_config = msgspec.json.decode(welcome.launch_config_json, type=LaunchConfig)
    # The frontend's own job (if its core spans hosts) is not this core's.
    own = multihost or ParallelConfig()
    parallel = dataclasses.replace(launch_config.parallel_config,
                                   coordinator_address=own.coordinator_address,
                                   num_processes=own.num_processes, process_id=own.process_id)
    launch_config = dataclasses.replace(launch_config, parallel_config=parallel)
    os.environ.update(platform_env(launch_config, os.environ))
    os.environ.update(data_parallel_device_env(dict(os.environ), local_index, num_local,
                                               parallel.local_devices))
    _apply_cpu_affinity()
    logger.info("engine core %d joined the frontend at %s", engine_index, handshake_address)
    proc = EngineCoreProc(engine_args, welcome.input_address, welcome.output_address,
                          launch_config, heartbeat_timeout=welcome.heartbeat_timeout_s)
    proc.run_busy_loop()


def log_to_stderr(name: str) -> None:
    """jaxllm's log lines, named `name`, to this process's stderr (its parent's or Ray's): our
    own logger only, JAX's INFO lines about absent backends are noise."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"({name}) %(levelname)s %(message)s"))
    jaxllm_logger = logging.getLogger("jaxllm")
    jaxllm_logger.addHandler(handler)
    jaxllm_logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="jaxllm engine core process (started by the "
                                "multiprocess engine-core clients, or by `jaxllm serve "
                                "--headless` to join a frontend on another host)")
    p.add_argument("--input-address")
    p.add_argument("--output-address")
    p.add_argument("--death-fd", type=int, default=None)
    p.add_argument("--engine-args", help="EngineArgs as JSON")
    p.add_argument("--launch-config", help="LaunchConfig as JSON, the frontend's decisions")
    p.add_argument("--compilation-cache-dir", default=None)
    joined = p.add_argument_group("a core that joins its frontend over TCP")
    joined.add_argument("--handshake-address", default=None,
                        help="the frontend's handshake socket (tcp://host:port)")
    joined.add_argument("--engine-index", type=int, default=0, help="this core's rank")
    joined.add_argument("--local-index", type=int, default=0,
                        help="which of this host's cores (its devices)")
    joined.add_argument("--num-local", type=int, default=1, help="this host's cores")
    joined.add_argument("--model", default=None,
                        help="the model this host was started with (checked against the "
                             "frontend's)")
    joined.add_argument("--coordinator-address", default=None,
                        help="the jax.distributed job this core leads (a core spanning hosts)")
    joined.add_argument("--num-processes", type=int, default=1)
    a = p.parse_args(argv)
    if a.handshake_address is None and None in (a.input_address, a.output_address,
                                                 a.engine_args, a.launch_config, a.death_fd):
        p.error("give --handshake-address, or every one of --input-address, --output-address, "
                "--engine-args, --launch-config and --death-fd")
    log_to_stderr(f"EngineCore pid={os.getpid()}")
    # Ctrl-C in a terminal reaches the whole process group: the user means the frontend (whose
    # generate() then aborts its requests), not the core; it ends with its parent.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Grammar compilations recurse as deep as the grammar nests: this process's threads get a
    # stack well beyond the one the server's validator accepted the grammar with.
    threading.stack_size(COMPILE_STACK_BYTES)
    if a.death_fd is not None:
        socket_dir = None if a.input_address is None else _ipc_dir(a.input_address)
        threading.Thread(target=_watch_parent, args=(a.death_fd, socket_dir), daemon=True,
                         name="ParentWatch").start()
    if a.handshake_address is not None:
        multihost = None if a.coordinator_address is None else ParallelConfig(
            coordinator_address=a.coordinator_address, num_processes=a.num_processes)
        _run(lambda: run_joined_core(a.handshake_address, a.engine_index, a.local_index,
                                     a.num_local, a.model, multihost), a.compilation_cache_dir)
        return
    engine_args = msgspec.json.decode(a.engine_args, type=EngineArgs)
    launch_config = msgspec.json.decode(a.launch_config, type=LaunchConfig)
    _apply_cpu_affinity()

    def run() -> None:
        EngineCoreProc(engine_args, a.input_address, a.output_address,
                       launch_config).run_busy_loop()

    _run(run, a.compilation_cache_dir)


def _run(run: Callable[[], None], compilation_cache_dir: str | None) -> None:
    """`run` the core; a failure is logged and ends the process with exit code 1."""
    import jax

    if compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    try:
        run()
    except SystemExit as e:
        if isinstance(e.code, str):
            logger.error("%s", e.code)
            sys.exit(1)
        raise
    except BaseException:
        logger.exception("engine core died")
        # Skip interpreter teardown: the socket threads may be blocked in ZMQ calls.
        sys.stderr.flush()
        os._exit(1)
    logger.info("engine core shut down")


if __name__ == "__main__":
    main()
