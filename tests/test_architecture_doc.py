"""docs/architecture.md names the files a request's Python path runs through: measured here,
the files of ours whose functions run during one warm LLM.generate (in process, the default
settings), against the list between the document's request-files markers."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("jaxllm", "scheduler", "pallas_kernels")


def documented_files() -> set[str]:
    text = DOC.read_text()
    block = text.split("<!-- request-files -->")[1].split("<!-- /request-files -->")[0]
    return set(re.findall(r"[\w/]+\.py", block))


def test_the_documented_request_path_is_the_measured_one(tiny_models, kv_budget):
    from jaxllm import LLM, SamplingParams

    llm = LLM(str(tiny_models["untied"][0]), multiprocess_mode=False, show_progress=False,
              max_model_len=128, **kv_budget)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    llm.generate(prompts, params, use_tqdm=False)
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(ROOT) and path.relative_to(ROOT).parts[0] in PACKAGES:
                seen.add(path.relative_to(ROOT).as_posix())

    sys.setprofile(profile)
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        sys.setprofile(None)
    documented = documented_files()
    assert seen == documented, (f"run but not documented: {sorted(seen - documented)}; "
                                f"documented but not run: {sorted(documented - seen)}")
    assert f"through {len(documented)} files" in DOC.read_text()
