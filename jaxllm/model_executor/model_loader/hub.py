"""Models by Hugging Face Hub id, as vLLM takes them: `Qwen/Qwen2.5-1.5B-Instruct` (a repo's
config, tokenizer and safetensors) or `Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M` (the one .gguf
file of a repo whose name holds that quantization type, with the repo's tokenizer files if it
has any). Files come through `huggingface_hub` into its cache (HF_HOME, HF_HUB_CACHE or
`download_dir`), with its progress bars; HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE apply as
they do for every Hugging Face library.

A download takes two passes over one snapshot: the small files first, which also leaves the
repo's file listing in the cache; then the weights the listing calls for, at the commit the
first pass resolved, so both passes read the same revision and a run without network picks
the same file from the cache."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from jaxllm.model_executor.model_loader.errors import ModelLoadError
from jaxllm.model_executor.model_loader.tiny_model import TINY_MODEL_NAME

# Everything but the weights: config, tokenizer, chat templates.
CONFIG_PATTERNS = ["config.json", "generation_config.json", "tokenizer*", "vocab*", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template*",
                   "additional_chat_templates/*", "model.safetensors.index.json"]
SAFETENSORS_PATTERNS = ["*.safetensors", "model.safetensors.index.json"]

_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
# `name` or `owner/name`, then an optional `:QUANT` naming one .gguf file of the repo.
_HUB_ID = re.compile(rf"(?P<repo>{_NAME}(?:/{_NAME})?)(?::(?P<quant>[A-Za-z0-9_.-]+))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def looks_local(model: str) -> bool:
    """Written as a path: a typo in it must say "no such file", not send it to the Hub."""
    return model.startswith(("/", "./", "../", "~")) or model.lower().endswith(".gguf")


def is_hub_id(model: str | None) -> bool:
    """Whether `model` names a Hub repo: not one of our own names, not an existing path, not
    written as a path, and shaped like a repo id (`owner/name` or `name`, optionally
    `:QUANT`)."""
    if model is None or model == TINY_MODEL_NAME or looks_local(model) \
            or Path(model).expanduser().exists():
        return False
    return _HUB_ID.fullmatch(model) is not None


def parse_model_id(model: str) -> tuple[str, str | None]:
    """`owner/name[:QUANT]` -> (repo id, quantization type or None)."""
    match = _HUB_ID.fullmatch(model)
    if match is None:
        raise ModelLoadError(f"{model!r} is not a Hugging Face Hub model id (owner/name, "
                             f"optionally :QUANT for a GGUF repo's file)")
    return match["repo"], match["quant"]


def pick_gguf(model: str, files: list[str], quant: str | None) -> str | None:
    """The .gguf file of `files` that `quant` names (case-insensitive, exactly one must match);
    without `quant`, the only .gguf of a repo with no safetensors; None: a safetensors repo."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    listing = ", ".join(ggufs)
    if quant is None:
        if any(f.endswith(".safetensors") for f in files):
            return None
        if len(ggufs) == 1:
            return ggufs[0]
        if ggufs:
            raise ModelLoadError(f"{model!r} holds several .gguf files ({listing}): name one by "
                                 f"its quantization type, e.g. {model}:Q4_K_M")
        raise ModelLoadError(f"{model!r} has neither *.safetensors nor .gguf weights; its "
                             f"files: {', '.join(sorted(files)) or 'none'}")
    if not ggufs:
        raise ModelLoadError(f"{model!r}: ':{quant}' picks a .gguf file, but the repo has none; "
                             f"its files: {', '.join(sorted(files)) or 'none'}")
    # The type as a whole word first: ":F16" is not "BF16", ":Q4_0" not "IQ4_0".
    word = re.compile(rf"(?<![a-z0-9]){re.escape(quant.lower())}(?![a-z0-9])")
    matches = [f for f in ggufs if word.search(f.lower())] \
        or [f for f in ggufs if quant.lower() in f.lower()]
    if len(matches) != 1:
        found = "none" if not matches else f"{len(matches)} ({', '.join(matches)})"
        raise ModelLoadError(f"{model!r}: exactly one .gguf file must contain {quant!r}, "
                             f"{found} do; the repo's .gguf files: {listing}")
    return matches[0]


class _NoMatchFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No files matched")


@contextmanager
def _quiet_no_match() -> Iterator[None]:
    """huggingface_hub warns when a pattern list matches nothing: the first pass over a GGUF
    repo without config files does so by design."""
    logger = logging.getLogger("huggingface_hub._snapshot_download")
    quiet = _NoMatchFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _repo_files(repo_id: str, commit: str | None, cache_dir: str | None, folder: Path) -> list[str]:
    """The repo's files at `commit`, from the listing the first pass cached; a cache written
    without one: the files on disk."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return [f.path for f in get_cached_repo_tree(repo_id, revision=commit,
                                                      cache_dir=cache_dir)]
    except CachedRepoTreeNotFoundError:
        return [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]


def _safetensors_files(folder: Path) -> list[str]:
    """The safetensors a checkpoint loads: those its index names where it has one (repos that
    also ship a consolidated copy, as Mistral's do, would otherwise fetch the model twice),
    else every one."""
    index = folder / "model.safetensors.index.json"
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted({name for name in weight_map.values() if isinstance(name, str)})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return SAFETENSORS_PATTERNS  # no usable index: the loader says what is wrong
    return ["model.safetensors.index.json", *shards]


def download_model(model: str, revision: str | None = None,
                   download_dir: str | None = None) -> Path:
    """The local snapshot of Hub id `model` at `revision` (None: the default branch) under
    `download_dir` (None: huggingface_hub's cache): its directory, or its .gguf file. Fetches
    what the cache lacks; from the cache alone when the Hub cannot be reached or HF_HUB_OFFLINE
    is set. Failures are a ModelLoadError naming the id and revision."""
    import httpx2
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id, quant = parse_model_id(model)
    where = f"{model!r} (revision {revision or 'main'})"
    try:
        with _quiet_no_match():
            folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                            allow_patterns=CONFIG_PATTERNS))
        # The snapshot directory is named by its commit; a revision that is not a commit would
        # be looked up again (and could move between the passes).
        commit = folder.name if _COMMIT.fullmatch(folder.name) else revision
        files = _repo_files(repo_id, commit, download_dir, folder)
        gguf = pick_gguf(model, files, quant)
        weights = _safetensors_files(folder) if gguf is None else [gguf]
        folder = Path(snapshot_download(repo_id, revision=commit, cache_dir=download_dir,
                                        allow_patterns=weights))
    except GatedRepoError as e:
        raise ModelLoadError(f"{where} is a gated repo on the Hugging Face Hub: accept its terms "
                             f"on the model page and log in (`hf auth login` or HF_TOKEN)") from e
    except RepositoryNotFoundError as e:
        raise ModelLoadError(f"{where} is neither a local path nor a model repo on the Hugging "
                             f"Face Hub (a private repo needs `hf auth login` or HF_TOKEN)") from e
    except RevisionNotFoundError as e:
        raise ModelLoadError(f"{where}: the Hugging Face Hub repo {repo_id!r} has no revision "
                             f"{revision!r}") from e
    except LocalEntryNotFoundError as e:
        # Raised when the Hub could not be reached (or HF_HUB_OFFLINE is set) and the cache
        # does not hold the files.
        offline = " (HF_HUB_OFFLINE is set)" if _offline() else ""
        raise ModelLoadError(f"{where} is neither a local path nor reachable on the Hugging "
                             f"Face Hub{offline}, and the cache "
                             f"({download_dir or _default_cache()}) does not hold it: "
                             f"{_first_line(e)}") from e
    except (HfHubHTTPError, httpx2.HTTPError, OSError) as e:
        raise ModelLoadError(f"{where}: could not fetch it from the Hugging Face Hub: "
                             f"{_first_line(e)}") from e
    return folder if gguf is None else folder / gguf


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _default_cache() -> str:
    from huggingface_hub import constants

    return os.fspath(constants.HF_HUB_CACHE)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
