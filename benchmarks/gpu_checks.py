"""The GPU check suite: stages of sub-checks, each with pass/fail and numbers.

    python benchmarks/gpu_checks.py STAGE [STAGE ...] [--dry-run] [--out DIR] [--time-box S]
    python benchmarks/gpu_checks.py lease [--dry-run] [--out DIR] [--deadline S] [--parts P,..]

Stages: probe, kernels, tiny, realshape, parity, bench, or `all` of them in that order
(docs/gpu.md says what each measures; the code is in benchmarks/gpu/). Several stages run one
after the other in this process, each under its own time box. Every stage writes DIR/STAGE.json
(DIR: --out, else $OUT, else ./gpu_checks_out) after each sub-check, so a command killed at its
time limit still leaves the numbers it had; a stage stops starting sub-checks once its time box
is spent and records them as skipped. The exit status is non-zero when any sub-check failed.

A real run refuses to run anywhere but on a GPU. `--dry-run` runs every stage on CPU through the
same code with tiny shapes, the Pallas interpret backend (the reference backend where interpret
mode would take minutes), the tiny random `tiny-qwen2` in place of the embedded model and small
time boxes: what CI runs.

`lease` is the plan for one command on a lent GPU (benchmarks/gpu/lease.py): probe, tiny, the
0.5B-shaped bench at batch 1 and 64, a profiler trace of decode steps with and without CUDA
graphs, then 1.5B- and 7B-shaped batch-1 latency while time remains, each part in its own
process under its own limit, all inside one deadline.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

# Run as a script, Python puts benchmarks/ on the path: this checkout's packages come first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu.bench import stage_bench  # noqa: E402
from benchmarks.gpu.engine_checks import stage_parity, stage_tiny  # noqa: E402
from benchmarks.gpu.harness import (  # noqa: E402
    DEFAULT_TIME_BOX_S,
    DRY_RUN_TIME_BOX_S,
    STAGES,
    StageRun,
    run_recorded,
    sizes_for,
)
from benchmarks.gpu.lease import (  # noqa: E402
    DEFAULT_DEADLINE_S,
    DRY_RUN_DEADLINE_S,
    PART_BY_NAME,
    run_lease,
)
from benchmarks.gpu.probe import stage_kernels, stage_probe  # noqa: E402
from benchmarks.gpu.realshape import stage_realshape  # noqa: E402

STAGE_FNS: dict[str, Callable[[StageRun], None]] = {
    "probe": stage_probe, "kernels": stage_kernels, "tiny": stage_tiny,
    "realshape": stage_realshape, "parity": stage_parity, "bench": stage_bench}


def run_stage(stage: str, out: Path, dry_run: bool, time_box_s: float | None) -> list[str]:
    """Run one stage, writing out/STAGE.json; returns the names of its failed sub-checks."""
    return run_recorded(stage, STAGE_FNS[stage], out, sizes_for(dry_run, time_box_s))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("stages", nargs="+", metavar="STAGE", choices=(*STAGES, "all", "lease"),
                        help=f"one or more of {', '.join(STAGES)}, or all; or lease alone")
    parser.add_argument("--dry-run", action="store_true",
                        help="on CPU: tiny shapes, the interpret backend, small time boxes")
    parser.add_argument("--out", default=None,
                        help="where STAGE.json goes (default: $OUT, else ./gpu_checks_out)")
    parser.add_argument("--time-box", type=float, default=None,
                        help=f"seconds per stage after which it starts no sub-check (default "
                             f"{DEFAULT_TIME_BOX_S:.0f}, {DRY_RUN_TIME_BOX_S:.0f} with --dry-run)")
    parser.add_argument("--deadline", type=float, default=None,
                        help=f"lease: seconds for the whole plan (default "
                             f"{DEFAULT_DEADLINE_S:.0f}, {DRY_RUN_DEADLINE_S:.0f} with --dry-run)")
    parser.add_argument("--parts", default=None,
                        help=f"lease: only these parts, comma-separated, in the plan's order "
                             f"({','.join(PART_BY_NAME)}); a part whose checkpoint another "
                             f"part writes writes it itself")
    ns = parser.parse_args(argv)
    if ns.time_box is not None and ns.time_box <= 0:
        parser.error(f"--time-box must be > 0, got {ns.time_box}")
    if ns.deadline is not None and ns.deadline <= 0:
        parser.error(f"--deadline must be > 0, got {ns.deadline}")
    if "lease" in ns.stages and (len(ns.stages) > 1 or ns.time_box is not None):
        parser.error("lease runs alone and sets its parts' limits itself (--deadline)")
    if "lease" not in ns.stages and (ns.deadline is not None or ns.parts is not None):
        parser.error("--deadline and --parts are the lease plan's")
    only = tuple(x for x in (ns.parts or "").split(",") if x)
    if set(only) - set(PART_BY_NAME):
        parser.error(f"unknown --parts {sorted(set(only) - set(PART_BY_NAME))}")
    stages = STAGES if "all" in ns.stages else tuple(dict.fromkeys(ns.stages))
    # Engine cores in their own process and the bench and kernel-test children share the GPU
    # with this process: none may take most of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    out = Path(ns.out or os.environ.get("OUT") or "gpu_checks_out")
    if "lease" in ns.stages:
        return run_lease(out, ns.dry_run, ns.deadline, only)
    failed = {stage: run_stage(stage, out, ns.dry_run, ns.time_box) for stage in stages}
    return 1 if any(failed.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
