"""Tokenizer and chat template, offline: from a checkpoint directory or from a GGUF's metadata."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from jaxllm.model_executor.model_loader.default_model import cache_dir
from jaxllm.model_executor.model_loader.errors import ModelLoadError
from jaxllm.model_executor.model_loader.gguf_file import read_gguf


def _gguf_cache_key(path: Path) -> str:
    stat = path.stat()
    ident = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """A checkpoint directory's tokenizer, or a .gguf file's: the tokenizer files beside it in
    a Hub snapshot when there are (a GGUF repo that ships the original tokenizer), else the one
    embedded in the GGUF.

    Converting a GGUF vocabulary takes many seconds, so the converted tokenizer is saved under
    the cache directory and reloaded from there next time.
    """
    path = Path(path).expanduser()
    # Only in a Hub snapshot (.../snapshots/<commit>/) are the files beside a .gguf its own
    # tokenizer; elsewhere they may be any model's.
    if path.is_file() and path.parent.parent.name == "snapshots" \
            and (path.parent / "tokenizer_config.json").is_file():
        path = path.parent
    if path.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"{path}: no usable tokenizer files ({e}); pass prompts as "
                f"{{'prompt_token_ids': [...]}} with skip_tokenizer_init=True"
            ) from e
    cached = cache_dir() / "tokenizers" / _gguf_cache_key(path)
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                              local_files_only=True, **_gguf_tokenizer_type(path))
    # Saved beside, then renamed: a concurrent or interrupted run never sees half a tokenizer.
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    tokenizer.save_pretrained(str(tmp))
    try:
        tmp.rename(cached)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def _gguf_tokenizer_type(path: Path) -> dict[str, str]:
    """AutoTokenizer's `tokenizer_type` for a GGUF whose architecture transformers reads no
    config of (llama.cpp's "gemma", Gemma 1), where it would otherwise pick the tokenizer class
    from that config; its GGUF vocabulary builder for the architecture is then reached by the
    class's name. Empty for every other file."""
    try:
        architecture = read_gguf(path).metadata.get("general.architecture")
    except (ModelLoadError, OSError):
        return {}  # AutoTokenizer names what is wrong with the file
    return {"tokenizer_type": "gemma"} if architecture == "gemma" else {}
