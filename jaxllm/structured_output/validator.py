"""Client-supplied constraints validated where a crash or a runaway costs only that request.

llguidance converts and validates a schema, regex or grammar recursively in native code: a
deeply nested one overflows the stack and kills the process (SIGSEGV), and a large one can take
seconds. The server therefore never runs that work itself: `GrammarValidator` hands each
constraint to a small worker process (`python -m jaxllm.structured_output.validator`, which
imports llguidance and the constraint's own modules, no JAX) with a memory limit (RLIMIT_AS),
waits for it up to a time limit, and kills and replaces a worker that crashed or ran out of
time. The answer is the
grammar text the engine core compiles, or the reason it is refused.

The worker validates on a thread with a fixed stack (`VALIDATION_STACK_BYTES`), so what it
accepts does not depend on the environment's `ulimit -s`; the engine core compiles on threads
with a much larger stack (`COMPILE_STACK_BYTES`), so whatever passed here compiles there.

Wire: each message is a 4-byte little-endian length and that many bytes of JSON; the request is
a StructuredOutputsParams' fields, the answer `{"grammar": text}` or `{"error": message}`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from typing import Any

# The worker's validation thread: the default thread stack of Linux (8 MiB; docs/server.md says
# how deep a grammar or schema that allows).
VALIDATION_STACK_BYTES = 8 << 20
# The engine core's compilation threads: 8 x the validator's, a margin for compilation's own
# recursion.
COMPILE_STACK_BYTES = 64 << 20
# Validation answers kept (by a hash of the constraint), refusals included: a request repeated
# with the same schema does not go to a worker again, nor a grammar that crashed one. A timeout
# is not kept: under load a valid constraint may take longer once.
CACHE_SIZE = 512


class GrammarRefused(ValueError):
    """The constraint is invalid, or its validation crashed or ran out of time or memory."""


def constraint_key(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, ensure_ascii=False)
                          .encode("utf-8", "surrogatepass")).hexdigest()


def _write_message(fd: int, obj: Any) -> None:
    data = json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
    view = memoryview(len(data).to_bytes(4, "little") + data)
    while view:
        view = view[os.write(fd, view):]


class _Worker:
    """One worker process, one constraint at a time."""

    def __init__(self, memory_bytes: int) -> None:
        # Our own package on the path, whatever the server's working directory.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxllm.structured_output.validator", str(memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)

    def call(self, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
        """The worker's answer; TimeoutError, or EOFError when the worker died."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            _write_message(self.proc.stdin.fileno(), spec)
        except BrokenPipeError:
            raise EOFError from None
        fd = self.proc.stdout.fileno()
        loop_deadline = time.monotonic() + timeout
        buf = bytearray()
        need = 4
        while len(buf) < need:
            left = loop_deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, max(need - len(buf), 1 << 16))
            if not chunk:
                raise EOFError
            buf += chunk
            if need == 4 and len(buf) >= 4:
                need = 4 + int.from_bytes(buf[:4], "little")
        return json.loads(bytes(buf[4:need]).decode("utf-8", "surrogatepass"))

    def kill(self) -> int | None:
        """End the worker; its exit status (negative: the signal that ended it)."""
        self.proc.kill()
        code = self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
        return code


class GrammarValidator:
    """Validates constraints in up to `num_workers` worker processes at once, each answer
    within `timeout_s` and each worker within `memory_mib` of address space. Workers start on
    first use and are replaced after a crash or a timeout."""

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0,
                 memory_mib: int = 1024) -> None:
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.memory_bytes = memory_mib << 20
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self._slots: asyncio.Semaphore | None = None
        self._cache: OrderedDict[str, tuple[bool, str]] = OrderedDict()
        self.num_crashed = 0  # workers lost to a crash or a timeout since start

    async def validate(self, spec: dict[str, Any]) -> str:
        """The llguidance grammar of a StructuredOutputsParams' fields `spec`; GrammarRefused
        saying why it is invalid, crashed its validator or ran out of time."""
        key = constraint_key(spec)
        hit = self._cache.get(key)
        if hit is None:
            if self._slots is None:
                self._slots = asyncio.Semaphore(self.num_workers)
            async with self._slots:
                hit, keep = await asyncio.to_thread(self._validate_in_worker, spec)
            if keep:
                self._cache[key] = hit
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        ok, text = hit
        if not ok:
            raise GrammarRefused(text)
        return text

    def idle_worker_pids(self) -> list[int]:
        """Process ids of the workers waiting for a constraint (to inspect their limits)."""
        with self._lock:
            return [w.proc.pid for w in self._idle]

    def _validate_in_worker(self, spec: dict[str, Any]) -> tuple[tuple[bool, str], bool]:
        """((valid, grammar or why not), whether the answer may be kept)."""
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None or worker.proc.poll() is not None:
            worker = _Worker(self.memory_bytes)
        try:
            answer = worker.call(spec, self.timeout_s)
        except TimeoutError:
            worker.kill()
            with self._lock:
                self.num_crashed += 1
            return (False, f"its validation did not finish in {self.timeout_s:g} s "
                           f"(--structured-output-timeout)"), False
        except EOFError:
            code = worker.kill()
            with self._lock:
                self.num_crashed += 1
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            return (False, f"its validation crashed ({how}): it is too deeply nested or too "
                           f"large (the validator has {self.memory_bytes >> 20} MiB, "
                           f"--structured-output-memory-mib)"), True
        with self._lock:
            closed = self._closed
            if not closed:
                self._idle.append(worker)
        if closed:  # closed while this one worked: nobody would kill it later
            worker.kill()
        if "grammar" in answer:
            return (True, answer["grammar"]), True
        return (False, answer.get("error", "its validation failed")), True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._idle = self._idle, []
        for w in workers:
            w.kill()


class _TooDeep(Exception):
    pass


def schema_depth(schema: Any, limit: int) -> int:
    """The nesting depth of a JSON schema's JSON, each local `$ref` ("#/$defs/name", "#")
    counting as the depth of the schema it points to (a recursive reference as nothing more);
    at most `limit` + 1: counting stops there. What llguidance recurses through when it
    converts the schema."""
    memo: dict[str, int] = {}
    active = {"#"}

    def resolve(ref: str) -> Any:
        node = schema
        for part in ref[2:].split("/") if ref.startswith("#/") else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node if ref.startswith("#/") else None

    def height(node: Any, depth: int) -> int:
        # Recursion as deep as the count, which stops at the limit.
        if depth > limit:
            raise _TooDeep
        if isinstance(node, dict):
            h = 0
            ref = node.get("$ref")
            if isinstance(ref, str) and ref not in active:
                if ref not in memo:
                    target = resolve(ref)
                    active.add(ref)
                    memo[ref] = 0 if target is None else height(target, depth)
                    active.discard(ref)
                h = memo[ref]
                if depth + h > limit:
                    raise _TooDeep
            children: Any = node.values()
        elif isinstance(node, list):
            h, children = 0, node
        else:
            return 0
        for child in children:
            h = max(h, 1 + height(child, depth + 1))
        return h

    try:
        return height(schema, 0)
    except _TooDeep:
        return limit + 1


# --- the worker process -------------------------------------------------------------------------

class _ByteTokenizer:
    """One token per byte and an EOS: enough for llguidance to tell whether a grammar can
    start at all, without the model's vocabulary."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"</s>"]
    special_token_ids = [256]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


@functools.cache
def _byte_tokenizer() -> Any:
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()), slices=[])


def _matches_nothing(grammar: str) -> bool:
    """No text (not even the empty one) is a sentence of `grammar`: its first mask is a
    dead end (a regex such as `[^\\x00-\\x{10FFFF}]`). For grammars of text only: one that
    names special tokens has none here."""
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if not matcher.is_error():
        fill_next_token_bitmask(matcher, allocate_token_bitmask(1, 257), 0)
    return matcher.is_error()


def _validate(spec: dict[str, Any]) -> dict[str, Any]:
    from jaxllm.sampling_params import StructuredOutputsParams

    try:
        params = StructuredOutputsParams.from_dict(spec)
        grammar = params.llguidance_grammar()
        # Not a Lark/GBNF grammar: it may name the model's special tokens (`<tool_call>`),
        # which the byte vocabulary lacks.
        if params.kind != "grammar" and _matches_nothing(grammar):
            return {"error": f"SamplingParams.structured_outputs.{params.kind} matches no "
                             f"text at all"}
    except (ValueError, TypeError) as e:
        return {"error": str(e)}
    except MemoryError:
        return {"error": "its validation ran out of memory (--structured-output-memory-mib)"}
    except RecursionError:
        return {"error": "it is nested too deeply to validate"}
    except Exception as e:  # any other failure refuses this constraint, never the worker
        return {"error": f"its validation failed: {type(e).__name__}: {e}"[:500]}
    return {"grammar": grammar}


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _worker_main(memory_bytes: int) -> None:
    import resource

    import llguidance  # noqa: F401 - loaded before the memory limit applies
    import llguidance.numpy  # noqa: F401

    from jaxllm.sampling_params import StructuredOutputsParams  # noqa: F401

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    threading.stack_size(VALIDATION_STACK_BYTES)
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    while True:
        header = _read_exact(stdin, 4)
        if header is None:  # the server closed the pipe: it is gone
            return
        body = _read_exact(stdin, int.from_bytes(header, "little"))
        if body is None:
            return
        spec = json.loads(body.decode("utf-8", "surrogatepass"))
        answer: dict[str, Any] = {}

        def run(spec: dict[str, Any] = spec, answer: dict[str, Any] = answer) -> None:
            answer.update(_validate(spec))

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        _write_message(stdout, answer)


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]))
