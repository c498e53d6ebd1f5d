"""DPLBClient: several data-parallel engine cores behind one frontend (vLLM's
DPLBAsyncMPClient idea: the client balances the load itself, without a coordinator process).

Each core is a process of its own on its own devices (`data_parallel_device_env`), with its own
scheduler, KV cache, structured-output manager and drafter: this host's are CoreProcesses
(mp_client.py), the others RemoteCores that joined over TCP from other hosts or Ray actors
(remote_core.py); the same model, so EngineCoreInfo comes from core 0. One client object
answers both the blocking and the `*_async` calls; the frontend (LLMEngine, AsyncLLM) is
unchanged but for the one error below.

Routing, per request (DPRouter.pick), over the live cores:
  siblings  an n > 1 request's sequences go where its first one went (the later ones reuse its
            prompt's KV blocks there; processor.child_request_ids names them `{i}_{parent}`)
  prefix    the hashes of its first full KV blocks: the longest one a recent request had names
            that request's core, taken unless that core's load exceeds the least-loaded one's
            by more than `load_margin` (its prefix cache then saves less than the wait costs)
  load      else the core with the fewest unfinished requests (then the fewest routed so far)
A core's load is counted here: one more at add, one less when the request's final output
arrives or it is aborted. Aborts go to the core that holds the request.

Faults: a core that dies fails the requests it held, and only those: get_output raises
EngineCoreDeadError (their ids) once for it, the frontend ends those requests with it, and new
requests go to the other cores. A core process of this host that died is started again in the
background (the same engine arguments, index and devices; `data_parallel_max_restarts` times at
most, a replacement that fails to start is not retried) and rejoins the routing once ready;
cores on other hosts, in Ray actors or spanning hosts stay dead. While no core lives, adds raise
EngineDeadError; once every core is dead and none is restarting, every call raises it as a
single dead core does. Utility calls go to every core: a list in engine-index order, None for
a dead core.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from jaxllm.config import LaunchConfig
from jaxllm.engine import (
    EngineCoreDeadError,
    EngineCoreInfo,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDeadError,
)
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.engine.core_client import EngineCoreClient, check_utility
from jaxllm.engine.mp_client import CoreConnection, CoreProcess
from jaxllm.engine.serial_utils import RequestType

# Full KV blocks of a prompt hashed for prefix routing: the head of a prompt (a system prompt, a
# shared document) is what requests share; hashing the whole prompt would cost every request.
PREFIX_ROUTING_BLOCKS = 8
# Block hashes and n > 1 parents remembered (the oldest forgotten first): recent requests are
# the ones whose KV blocks are likely still in their core's prefix cache.
RECENT_PREFIXES = 1 << 16
RECENT_PARENTS = 1 << 12

logger = logging.getLogger(__name__)


@dataclass
class EngineState:
    """One core as the client sees it (for /health, /metrics and tests)."""

    engine_index: int
    host: str  # the host name the core's process runs on
    pid: int
    alive: bool
    num_requests: int  # unfinished requests routed to it
    num_routed: int  # requests routed to it since start
    placement: str | None = None  # where its launcher put it (a Ray node id)
    restarts: int = 0  # times its process was started again after it died


class DPRouter:
    """Which core each request goes to, and each core's load as the client counts it (plain
    bookkeeping, no processes: the client tells it which cores live)."""

    def __init__(self, num_engines: int, block_size: int, load_margin: int) -> None:
        self.block_size = block_size
        self.load_margin = load_margin
        self.request_core: dict[str, int] = {}
        self.loads = [0] * num_engines
        self.routed = [0] * num_engines
        self._prefixes: OrderedDict[int, int] = OrderedDict()
        self._parents: OrderedDict[str, int] = OrderedDict()

    def prefix_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """Chained hashes of the first full KV blocks: the i-th covers blocks 0..i."""
        bs = self.block_size
        hashes, h = [], 0
        for b in range(min(len(token_ids) // bs, PREFIX_ROUTING_BLOCKS)):
            h = hash((h, tuple(token_ids[b * bs:(b + 1) * bs])))
            hashes.append(h)
        return hashes

    def pick(self, request_id: str, hashes: list[int], live: list[int]) -> int:
        """The core for a new request, among the `live` ones (not empty)."""
        least = min(live, key=lambda i: (self.loads[i], self.routed[i]))
        parent = _parent_of_sibling(request_id)
        if parent is not None:
            core = self._parents.get(parent)
            if core is not None and core in live:
                return core
        for h in reversed(hashes):  # the longest shared prefix first
            core = self._prefixes.get(h)
            if core is not None:
                if core in live and self.loads[core] - self.loads[least] <= self.load_margin:
                    return core
                break
        return least

    def add(self, request_id: str, core: int, hashes: list[int]) -> None:
        self.request_core[request_id] = core
        self.loads[core] += 1
        self.routed[core] += 1
        _remember(self._prefixes, hashes, core, RECENT_PREFIXES)
        head, sep, rest = request_id.partition("_")
        if sep and head == "0":
            _remember(self._parents, [rest], core, RECENT_PARENTS)

    def remove(self, request_id: str) -> int | None:
        """A request finished or was aborted: the core that held it (None: not known)."""
        core = self.request_core.pop(request_id, None)
        if core is not None:
            self.loads[core] -= 1
        return core

    def drop_engine(self, core: int) -> list[str]:
        """A core died: the requests it held, forgotten."""
        ids = [rid for rid, c in self.request_core.items() if c == core]
        for rid in ids:
            del self.request_core[rid]
        self.loads[core] = 0
        return ids

    def reset_engine(self, core: int) -> None:
        """A core rejoined with an empty KV cache: it holds no request, and no recent prefix or
        n > 1 parent is on it any more."""
        self.drop_engine(core)
        _forget(self._prefixes, core)
        _forget(self._parents, core)


class DPLBClient(EngineCoreClient):
    """The launch config's `data_parallel_size` core processes; `shutdown()`, or garbage
    collection of the client, ends them all (and any being restarted)."""

    def __init__(self, engine_args: EngineArgs, launch_config: LaunchConfig,
                 remote_engine_args: EngineArgs | None = None) -> None:
        self.cores, self.launchers = start_cores(engine_args, launch_config,
                                                 remote_engine_args)
        # Restarts: set at shutdown, it abandons a replacement's start; the finalizer waits for
        # the threads, then closes `self.cores` (the same list, replacements included).
        self._cancel = threading.Event()
        self._restart_threads: list[threading.Thread] = []
        self._lock = threading.RLock()  # the cores' lifecycle: callers' and cores' threads
        self._finalizer = weakref.finalize(self, close_cores, self.cores, self.launchers,
                                           self._cancel, self._restart_threads, self._lock)
        self._engine_args, self._launch_config = engine_args, launch_config
        self._max_restarts = engine_args.data_parallel_max_restarts
        self.restarts = [0] * len(self.cores)
        self._restarting: set[int] = set()
        self._not_restarted: set[int] = set()  # dead for good: said once
        self._leftover: list[EngineCoreDeadError] = []  # failed requests not yet raised
        # A quarter of a batch: the prefix's core still takes the request into its next steps.
        self.router = DPRouter(len(self.cores), engine_args.block_size,
                               load_margin=max(2, engine_args.max_num_seqs // 4))
        parallel = launch_config.parallel_config
        self._prefix_routing = parallel.data_parallel_routing == "prefix"
        self._reported: set[int] = set()  # dead cores whose requests were failed
        self._next = 0  # the core polled first: each in turn, so that none starves
        # Wake-ups from the cores' threads; the closure holds no reference to the client.
        self._event = threading.Event()
        self._async_slot: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._wake = _waker(self._event, self._async_slot)
        for i, core in enumerate(self.cores):
            self._watch(i, core)
            self._restart(i, core)  # it died before it was watched (a no-op for a live one)

    def _watch(self, i: int, core: CoreConnection) -> None:
        """Wake-ups from `core`'s threads: waiters look again, and its death starts a restart
        right away (an idle client polls nothing)."""
        core.wakeups[:] = [self._wake, _death_hook(weakref.ref(self), i, core)]

    # --- what the frontend and the server read ----------------------------------------------

    def get_engine_info(self) -> EngineCoreInfo:
        return self.cores[0].ready.info

    @property
    def core_pids(self) -> list[int]:
        return [core.ready.pid for core in self.cores]

    @property
    def num_live_engines(self) -> int:
        return sum(core.dead is None for core in self.cores)

    @property
    def num_restarting_engines(self) -> int:
        """Dead cores whose replacement is starting."""
        return len(self._restarting)

    def engine_states(self) -> list[EngineState]:
        r = self.router
        return [EngineState(i, core.host, core.ready.pid, core.dead is None, r.loads[i],
                            r.routed[i], self._placement(i), self.restarts[i])
                for i, core in enumerate(self.cores)]

    def _placement(self, engine_index: int) -> str | None:
        for launcher in self.launchers:
            where = launcher.placement(engine_index)
            if where is not None:
                return where
        return None

    def shutdown(self) -> None:
        self._finalizer()

    # --- routing ------------------------------------------------------------------------------

    def _add(self, request: EngineCoreRequest) -> None:
        rid = request.request_id
        hashes = self.router.prefix_hashes(request.prompt_token_ids) if self._prefix_routing \
            else []
        # The router and the cores' list change on a restart thread too (_rejoin).
        with self._lock:
            while True:
                live = [i for i, core in enumerate(self.cores) if core.dead is None]
                if not live:
                    raise self._dead_error()
                i = self.router.pick(rid, hashes, live)
                try:
                    self.cores[i].send(RequestType.ADD, request)
                    break
                except EngineDeadError:
                    continue  # it died just now: the next pick passes it over
            self.router.add(rid, i, hashes)

    def _abort(self, request_ids: list[str]) -> None:
        by_core: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                i = self.router.remove(rid)
                if i is not None:
                    by_core.setdefault(i, []).append(rid)
            for i, ids in by_core.items():
                self.cores[i].send(RequestType.ABORT, ids)  # nothing to do for a dead core

    # --- outputs ------------------------------------------------------------------------------

    def _poll(self) -> EngineCoreOutputs | None:
        """The next outputs of any core, or None; a dead core's requests fail once."""
        with self._lock:
            return self._poll_locked()

    def _poll_locked(self) -> EngineCoreOutputs | None:
        if self._leftover:
            raise self._leftover.pop(0)
        n = len(self.cores)
        for k in range(n):
            i = (self._next + k) % n
            if i in self._reported:
                continue
            core = self.cores[i]
            try:
                out = core.get_output_nowait()
            except EngineDeadError:
                err = self._core_died(i, core)
                if err is None or isinstance(err, EngineCoreDeadError) and not err.request_ids:
                    continue  # it held nothing (or was replaced meanwhile): nobody to tell
                raise err from None
            if out is not None:
                self._next = (i + 1) % n
                for o in out.outputs:
                    if o.finished:
                        self.router.remove(o.request_id)
                if out.scheduler_stats is not None:
                    out.scheduler_stats.engine_index = i
                return out
        if self._all_dead():
            raise self._dead_error()
        return None

    def _all_dead(self) -> bool:
        """Every core dead and none restarting: the client is dead for good."""
        return len(self._reported) == len(self.cores) and not self._restarting

    def _core_died(self, i: int, core: CoreConnection) -> EngineDeadError | None:
        """`core` (core i) died: its requests' error, once; None if it was replaced already."""
        with self._lock:
            if self.cores[i] is not core or i in self._reported:
                return None
            self._restart(i, core)
            self._reported.add(i)
            ids = self.router.drop_engine(i)
            if self._all_dead():
                return self._dead_error()
            return EngineCoreDeadError(f"data-parallel engine core {i} died: {core.dead}", i,
                                       ids)

    # --- restarts -----------------------------------------------------------------------------

    def _restart(self, i: int, core: CoreConnection) -> None:
        """Start core i's replacement in the background, if it may have one (once per death)."""
        with self._lock:
            if self.cores[i] is not core or core.dead is None or self._cancel.is_set() \
                    or i in self._restarting or i in self._not_restarted:
                return
            if not isinstance(core, CoreProcess) \
                    or self._launch_config.parallel_config.multihost:
                # Another host or Ray runs it, or its followers would have to start again too.
                self._not_restarted.add(i)
                return
            if self.restarts[i] >= self._max_restarts:
                self._not_restarted.add(i)
                logger.error("data-parallel engine core %d died (%s); not restarted: "
                             "data_parallel_max_restarts is %d", i, core.dead,
                             self._max_restarts)
                return
            self.restarts[i] += 1
            self._restarting.add(i)
            logger.warning("data-parallel engine core %d died (%s); restarting (%d of %d)", i,
                           core.dead, self.restarts[i], self._max_restarts)
            thread = threading.Thread(
                target=_restart_core, daemon=True, name=f"EngineCoreRestart-{i}",
                args=(weakref.ref(self), i, core, self._engine_args, self._launch_config,
                      self._cancel))
            self._restart_threads[:] = [t for t in self._restart_threads if t.is_alive()]
            self._restart_threads.append(thread)
            thread.start()

    def _rejoin(self, i: int, core: CoreProcess) -> None:
        """Core i's replacement is ready: it takes the dead one's place in the routing."""
        with self._lock:
            if self._cancel.is_set():  # shutting down: the finalizer closes the list's cores
                core.close()
                return
            old = self.cores[i]
            if i not in self._reported:  # it died unnoticed by any poll: its requests fail now
                self._reported.add(i)
                ids = self.router.drop_engine(i)
                if ids:
                    self._leftover.append(EngineCoreDeadError(
                        f"data-parallel engine core {i} died: {old.dead}", i, ids))
            self.router.reset_engine(i)
            self._watch(i, core)
            self.cores[i] = core
            self._reported.discard(i)
            self._restarting.discard(i)
        old.close()
        logger.info("engine core %d is back (pid %d)", i, core.ready.pid)
        self._wake()

    def _restart_failed(self, i: int, err: BaseException) -> None:
        with self._lock:
            self._restarting.discard(i)
            self._not_restarted.add(i)
        if not self._cancel.is_set():
            logger.error("data-parallel engine core %d failed to restart; it stays dead: %s", i,
                         err)
        self._wake()  # every core may be dead for good now

    def _dead_error(self) -> EngineDeadError:
        """Every core is dead: the last one's error, fresh each time (see dead_error)."""
        for core in reversed(self.cores):
            if core.dead is not None:
                return core.dead_error()
        return EngineDeadError("no engine core is alive")

    # --- utility calls ------------------------------------------------------------------------

    def _call_all(self, method: str, args: tuple) -> list[concurrent.futures.Future | None]:
        check_utility(method)
        futures: list[concurrent.futures.Future | None] = []
        for core in self.cores:
            try:
                futures.append(core.call_utility(method, args))
            except EngineDeadError:
                futures.append(None)
        return futures

    def _results(self, results: list[Any]) -> list[Any]:
        """Per core: its result, None for a dead one; raises the first other error, and
        EngineDeadError when no core answered."""
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, EngineDeadError):
                raise r
        out = [None if r is None or isinstance(r, BaseException) else r for r in results]
        if all(r is None or isinstance(r, BaseException) for r in results):
            raise self._dead_error()
        return out

    # --- the blocking API ---------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        self._add(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._abort(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        while True:
            self._event.clear()  # before looking: an output put after the look sets it
            out = self._poll()
            if out is not None:
                return out
            self._event.wait()

    def call_utility(self, method: str, *args: Any) -> list[Any]:
        results: list[Any] = []
        for fut in self._call_all(method, args):
            try:
                results.append(None if fut is None else fut.result())
            except EngineDeadError as e:
                results.append(e)
        return self._results(results)

    # --- the asyncio API ----------------------------------------------------------------------

    def _bind_loop(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self._async_slot and self._async_slot[0][0] is loop:
            return self._async_slot[0][1]
        event = asyncio.Event()
        self._async_slot[:] = [(loop, event)]
        return event

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._add(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self._abort(request_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        event = self._bind_loop()
        while True:
            event.clear()
            out = self._poll()
            if out is not None:
                return out
            await event.wait()

    async def call_utility_async(self, method: str, *args: Any) -> list[Any]:
        self._bind_loop()
        futures = self._call_all(method, args)
        results = await asyncio.gather(
            *(asyncio.wrap_future(f) for f in futures if f is not None), return_exceptions=True)
        it = iter(results)
        return self._results([None if f is None else next(it) for f in futures])


def _parent_of_sibling(request_id: str) -> str | None:
    """The parent id of an n > 1 request's later sequence (`{i}_{parent}`, i > 0)."""
    head, sep, rest = request_id.partition("_")
    return rest if sep and head.isdigit() and head != "0" else None


def _remember(table: OrderedDict, keys: list, value: int, bound: int) -> None:
    for key in keys:
        table[key] = value
        table.move_to_end(key)
    while len(table) > bound:
        table.popitem(last=False)


def _forget(table: OrderedDict, value: int) -> None:
    for key in [k for k, v in table.items() if v == value]:
        del table[key]


def _death_hook(client_ref: weakref.ref[DPLBClient], i: int, core: CoreConnection
                ) -> Callable[[], None]:
    """Called on each of `core`'s wake-ups; holds the client weakly (its finalizer must run)."""
    def on_wakeup() -> None:
        if core.dead is None:
            return
        client = client_ref()
        if client is not None:
            client._restart(i, core)

    return on_wakeup


def _restart_core(client_ref: weakref.ref[DPLBClient], i: int, old: CoreProcess,
                  engine_args: EngineArgs, launch_config: LaunchConfig,
                  cancel: threading.Event) -> None:
    """A restart thread's body: start core i again, then hand it to the client (or close it:
    the client was shut down or collected meanwhile)."""
    # A core found dead may still run (its output could not be read): it holds the devices
    # the replacement is about to take.
    old.kill()
    try:
        core = CoreProcess(engine_args, launch_config, i, cancel)
    except Exception as e:
        client = client_ref()
        if client is not None:
            client._restart_failed(i, e)
        return
    client = client_ref()
    if client is None:
        core.close()
        return
    try:
        client._rejoin(i, core)
    except Exception as e:
        core.close()
        client._restart_failed(i, e)


def _waker(event: threading.Event,
           async_slot: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]
           ) -> Callable[[], None]:
    def wake() -> None:  # from a core's output or monitor thread
        event.set()
        for loop, async_event in list(async_slot):
            try:
                loop.call_soon_threadsafe(async_event.set)
            except RuntimeError:  # the loop was closed
                pass

    return wake


def start_cores(engine_args: EngineArgs, launch_config: LaunchConfig,
                remote_engine_args: EngineArgs | None = None
                ) -> tuple[list[CoreConnection], list[Launcher]]:
    """Start every core at once (each loads and compiles in its own process): this host's as
    child processes, the others as they join over TCP (headless hosts; Ray actors, which are
    launched here); in rank order, with the launchers to close after them. If one fails (or the
    start is interrupted), the others are abandoned and closed, and its error raised.
    `remote_engine_args`: what the joining cores run (the model as the user named it)."""
    parallel = launch_config.parallel_config
    n = parallel.data_parallel_size
    if parallel.data_parallel_start_rank != 0:
        raise ValueError("data_parallel_start_rank is the first rank of a --headless host; the "
                         "frontend's host runs ranks from 0")
    local = range(parallel.data_parallel_size_local)
    remote = list(range(len(local), n))
    cancel = threading.Event()
    launchers: list[Launcher] = []
    pool = concurrent.futures.ThreadPoolExecutor(len(local) + 1,
                                                 thread_name_prefix="EngineCoreStart")
    futures: list[concurrent.futures.Future[Any]] = [
        pool.submit(CoreProcess, engine_args, launch_config, i, cancel) for i in local]
    if remote:
        from jaxllm.engine.remote_core import start_remote_cores

        futures.append(pool.submit(start_remote_cores, remote_engine_args or engine_args,
                                   launch_config, remote, cancel,
                                   lambda: [launcher.check() for launcher in launchers]))
    # Those that failed on their own: none is abandoned before `wait` returns.
    failed: list[int] = [-1]
    try:
        if parallel.data_parallel_backend == "ray":
            from jaxllm.engine.ray_launcher import RayLauncher

            launchers.append(RayLauncher(launch_config, remote))
        done, _ = concurrent.futures.wait(futures,
                                          return_when=concurrent.futures.FIRST_EXCEPTION)
        failed = [i for i, f in enumerate(futures) if f in done and f.exception() is not None]
    finally:
        if failed:
            cancel.set()
        pool.shutdown(wait=True)  # every start has ended (an abandoned one within a poll)
        if failed:
            for f in futures:
                if f.exception() is None:
                    result = f.result()
                    for core in result if isinstance(result, list) else [result]:
                        core.close()
            for launcher in launchers:
                launcher.close()
    if failed:
        err = futures[failed[0]].exception()
        if failed[0] >= len(local):  # the joining cores: the error names which
            raise RuntimeError(str(err)) from err
        raise RuntimeError(f"data-parallel engine core {failed[0]} failed to start: "
                           f"{err}") from err
    cores: list[CoreConnection] = []
    for f in futures:
        result = f.result()
        cores.extend(result if isinstance(result, list) else [result])
    return cores, launchers


class Launcher(Protocol):
    """What started cores elsewhere (Ray's actors), closed once its cores are."""

    def close(self) -> None: ...

    def check(self) -> None:
        """Raise if a core it started ended (while the cores start)."""
        ...

    def placement(self, engine_index: int) -> str | None:
        """Where the core runs (a Ray node), if the launcher knows."""
        ...


def close_cores(cores: list[CoreConnection], launchers: list[Launcher],
                cancel: threading.Event | None = None,
                restart_threads: Sequence[threading.Thread] = (),
                lock: threading.RLock | None = None) -> None:
    """Abandon the restarts under way (`cancel`) and wait for their threads, which close a
    replacement or leave it in `cores`; then ask every core to exit first, so that they wind
    down together, close each, then what launched them. `lock`: the one a restart starts
    under, so that none starts after `cancel` unseen."""
    if cancel is not None:
        if lock is None:
            cancel.set()
        else:
            with lock:
                cancel.set()
    for thread in list(restart_threads):
        if thread is not threading.current_thread():
            thread.join()
    for core in cores:
        core.request_shutdown()
    for core in cores:
        core.close()
    for launcher in launchers:
        launcher.close()
