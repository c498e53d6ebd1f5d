"""Write docs/engine_args.md from the EngineArgs fields' help (tests/engine/test_config.py checks
that the committed file is up to date).

    PYTHONPATH=. python scripts/generate_engine_args_doc.py
"""

from pathlib import Path

from jaxllm.engine.arg_utils import engine_args_markdown

if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "docs" / "engine_args.md"
    out.write_text(engine_args_markdown())
    print(f"wrote {out}")
