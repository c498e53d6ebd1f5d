"""A follower process of a multi-host engine (jaxllm/distributed/multihost.py):

    JAXLLM_PROCESS_ID=1 python -m jaxllm.entrypoints.multihost_follower [engine options]

with the same engine options as process 0 and its own JAXLLM_PROCESS_ID (or --process-id). It
builds the same EngineCore, then runs the device calls process 0 broadcasts until it stops."""

from __future__ import annotations

import argparse

from jaxllm.engine.arg_utils import EngineArgs


def main(argv: list[str] | None = None) -> int:
    from jaxllm.distributed.multihost import follow
    from jaxllm.engine.core import EngineCore
    from jaxllm.worker.model_runner import PROMPT_LOGPROB_ROWS

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(description=__doc__))
    args = EngineArgs.from_cli_args(parser.parse_args(argv))
    core = EngineCore(args)
    if core.distributed is None or core.distributed.process_id == 0:
        raise SystemExit("a follower needs a coordinator address and a process id > 0")
    steps = follow(core.runner, PROMPT_LOGPROB_ROWS)
    print(f"follower {core.distributed.process_id}: {steps} steps, stopped by process 0",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
