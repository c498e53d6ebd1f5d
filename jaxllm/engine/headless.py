"""`jaxllm serve --headless`: this host's data-parallel engine cores for a frontend on another
host, no server of its own (vLLM's `--headless`).

Each core is a child process (`python -m jaxllm.engine.core_proc --handshake-address ...`) that
joins the frontend over TCP (remote_core.py) and takes its engine settings from it; this process
only starts them, waits, and stops them: they exit when it does (the death pipe, as for a
frontend's own cores), when the frontend tells them to, or when it goes silent. The exit code is
the first failed core's, 0 when every core ended cleanly.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from jaxllm.config import LaunchConfig, ParallelConfig
from jaxllm.engine.mp_client import has_fileno, with_jaxllm_path
from jaxllm.engine.remote_core import tcp_address

logger = logging.getLogger(__name__)

_POLL_S = 0.2


def core_command(handshake_address: str, engine_index: int, local_index: int, num_local: int,
                 model: str | None, death_fd: int | None,
                 multihost: ParallelConfig | None = None) -> list[str]:
    """The command line of one core that joins the frontend at `handshake_address`
    (`multihost`: the jax.distributed job it leads)."""
    cmd = [sys.executable, "-m", "jaxllm.engine.core_proc",
           "--handshake-address", handshake_address, "--engine-index", str(engine_index),
           "--local-index", str(local_index), "--num-local", str(num_local)]
    if model is not None:
        cmd += ["--model", model]
    if multihost is not None and multihost.coordinator_address is not None:
        cmd += ["--coordinator-address", multihost.coordinator_address,
                "--num-processes", str(multihost.num_processes)]
    if death_fd is not None:
        cmd += ["--death-fd", str(death_fd)]
    return cmd


def run_headless(launch_config: LaunchConfig, model: str | None) -> int:
    """Run ranks [data_parallel_start_rank, + data_parallel_size_local) until they all exit.
    `model`: the one this host was started with, if any (the frontend refuses another)."""
    parallel = launch_config.parallel_config
    if parallel.data_parallel_backend != "mp":
        raise ValueError("--headless starts this host's engine cores itself: with "
                         "data_parallel_backend 'ray', Ray places them")
    num_local, start = parallel.data_parallel_size_local, parallel.data_parallel_start_rank
    if num_local < 1:
        raise ValueError("--headless with data_parallel_size_local 0 has no engine core to run")
    if parallel.multihost and parallel.process_id != 0:
        raise ValueError("--headless runs process 0 of a core that spans hosts; its other "
                         "processes run `python -m jaxllm.entrypoints.multihost_follower`")
    address = tcp_address(parallel.data_parallel_address, parallel.data_parallel_rpc_port)
    logger.info("starting data-parallel engine cores %s of %d for the frontend at %s",
                list(range(start, start + num_local)), parallel.data_parallel_size, address)
    procs: list[subprocess.Popen] = []
    death_r, death_w = os.pipe()
    # SIGTERM ends this process as Ctrl-C does: the cores then stop with it.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for i in range(num_local):
            procs.append(subprocess.Popen(
                core_command(address, start + i, i, num_local, model, death_r, parallel),
                pass_fds=(death_r,), env=with_jaxllm_path(dict(os.environ)),
                stdin=subprocess.DEVNULL,
                stdout=sys.stderr.fileno() if has_fileno(sys.stderr) else None))
        os.close(death_r)
        death_r = -1
        return _wait_all(procs, start)
    except KeyboardInterrupt:
        logger.info("stopping this host's engine cores")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        if death_r >= 0:
            os.close(death_r)
        os.close(death_w)  # the cores see EOF and exit
        _reap(procs)


def _wait_all(procs: list[subprocess.Popen], start: int) -> int:
    rc = 0
    left = dict(enumerate(procs))
    while left:
        for i, proc in list(left.items()):
            code = proc.poll()
            if code is None:
                continue
            del left[i]
            if code != 0:
                logger.error("data-parallel engine core %d (pid %d) exited with code %d",
                             start + i, proc.pid, code)
                rc = rc or code
            else:
                logger.info("data-parallel engine core %d (pid %d) ended", start + i, proc.pid)
        time.sleep(_POLL_S)
    return rc


def _reap(procs: list[subprocess.Popen]) -> None:
    """The cores exit on their own once the death pipe closes; those that do not in time are
    killed."""
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _raise_interrupt(*_: object) -> None:
    raise KeyboardInterrupt
