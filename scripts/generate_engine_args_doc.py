"""Write docs/engine_args.md from the EngineArgs fields' help (tests/engine/test_config.py checks
that the committed file is up to date): this checkout's, whichever jaxllm is installed.

    python scripts/generate_engine_args_doc.py
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxllm.engine.arg_utils import engine_args_markdown  # noqa: E402 - after the path

if __name__ == "__main__":
    out = ROOT / "docs" / "engine_args.md"
    out.write_text(engine_args_markdown())
    print(f"wrote {out}")
