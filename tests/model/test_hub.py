"""Models by Hugging Face Hub id (jaxllm/model_executor/model_loader/hub.py), against a fake Hub
on 127.0.0.1 that serves what huggingface_hub's snapshot_download asks for: a repo's info at a
revision, its file tree at a commit, and each file (HEAD, GET). The oracle is the same files
loaded by local path."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from jaxllm import SamplingParams
from jaxllm.config import UsageContext, resolve_model
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.model_executor.model_loader.errors import ModelLoadError
from tests.gguf_models import write_tiny_gguf
from tests.utils import make_llm, save_tiny_checkpoint

MODEL_ID = "tiny-org/tiny-qwen2-hf"
GGUF_ID = "tiny-org/tiny-qwen2-GGUF"
# Files a checkpoint repo also holds that a model load never needs (big in real repos).
JUNK = {"pytorch_model.bin": b"\0" * (1 << 20), "original/consolidated.pth": b"\1" * 4096,
        "README.md": b"# tiny\n"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class FakeHub:
    """Repos of in-memory files behind the Hub's routes, each revision a commit; `requests`
    logs (method, path) of every request."""

    def __init__(self) -> None:
        self.commits: dict[str, dict[str, bytes]] = {}
        self.refs: dict[tuple[str, str], str] = {}  # (repo, branch or tag) -> commit
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 30  # a stuck client does not hold a server thread for ever

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
                hub.handle(self, body=False)

            def do_GET(self) -> None:  # noqa: N802
                hub.handle(self, body=True)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def add(self, repo: str, files: dict[str, bytes], revision: str = "main") -> str:
        digest = hashlib.sha1(repo.encode() + revision.encode())
        for name in sorted(files):
            digest.update(name.encode() + hashlib.sha1(files[name]).digest())
        commit = digest.hexdigest()
        self.commits[commit] = dict(files)
        self.refs[(repo, revision)] = commit
        self.refs[(repo, commit)] = commit
        return commit

    def fetched(self, repo: str, since: int = 0) -> list[str]:
        """The files of `repo` whose contents were sent (GET), from request `since` on."""
        prefix = f"/{repo}/resolve/"
        return [path[len(prefix):].split("/", 1)[1] for method, path in self.requests[since:]
                if method == "GET" and path.startswith(prefix)]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    def handle(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(req.path).path)
        self.requests.append((req.command, path))
        status, headers, data = self.route(path)
        req.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            req.send_header(key, value)
        req.end_headers()
        if body:
            req.wfile.write(data)

    def route(self, path: str) -> tuple[int, dict[str, str], bytes]:
        if path.startswith("/api/models/"):
            rest = path[len("/api/models/"):]
            for kind in ("/revision/", "/tree/"):
                if kind in rest:
                    repo, rev = rest.split(kind, 1)
                    commit = self.refs.get((repo, rev.split("/", 1)[0]))
                    if commit is None:
                        code = "RepoNotFound" if not any(r == repo for r, _ in self.refs) \
                            else "RevisionNotFound"
                        return 404, {"X-Error-Code": code}, b"{}"
                    files = self.commits[commit]
                    if kind == "/revision/":
                        info = {"id": repo, "sha": commit,
                                "siblings": [{"rfilename": f} for f in sorted(files)]}
                    else:
                        info = [{"type": "file", "path": f, "size": len(data),
                                 "oid": hashlib.sha1(data).hexdigest()}
                                for f, data in sorted(files.items())]
                    return 200, {"Content-Type": "application/json"}, json.dumps(info).encode()
            return 404, {}, b""
        if "/resolve/" in path:
            repo, rest = path[1:].split("/resolve/", 1)
            rev, name = rest.split("/", 1)
            commit = self.refs.get((repo, rev))
            if commit is None:
                return 404, {"X-Error-Code": "RevisionNotFound"}, b""
            data = self.commits[commit].get(name)
            if data is None:
                return 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit}, b""
            return 200, {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                         "Content-Type": "application/octet-stream"}, data
        return 404, {}, b""


def point_hub_at(mp: pytest.MonkeyPatch, url: str, offline: bool = False) -> None:
    """huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE once, at import: set its constants
    (and the variables, for child processes)."""
    from huggingface_hub import constants

    mp.setenv("HF_ENDPOINT", url)
    mp.setattr(constants, "ENDPOINT", url)
    mp.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
               url + "/{repo_id}/resolve/{revision}/{filename}")
    mp.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    mp.setattr(constants, "HF_HUB_OFFLINE", offline)


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def read_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_hf")
    save_tiny_checkpoint(path, tied=False, seed=3)
    return path


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, Path]:
    """Tiny GGUFs named by quantization type, as GGUF repos name their files."""
    folder = tmp_path_factory.mktemp("tiny_gguf")
    out = {}
    for seed, quant in enumerate(("q4_k_m", "q8_0")):
        out[quant] = folder / f"tiny-qwen2-{quant}.gguf"
        write_tiny_gguf(out[quant], seed=seed)
    return out


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path

    return tiny_qwen2_path()


@pytest.fixture(scope="module")
def hub(checkpoint, ggufs, tokenizer_dir, tmp_path_factory):
    """The fake Hub with the checkpoint repo (main, and a tag v1 of other weights) and a GGUF
    repo; huggingface_hub pointed at it, its cache in a temporary HF_HOME."""
    server = FakeHub()
    files = read_files(checkpoint)
    server.add(MODEL_ID, {**files, **JUNK})
    other = tmp_path_factory.mktemp("tiny_hf_v1")
    save_tiny_checkpoint(other, tied=False, seed=4)
    server.add(MODEL_ID, {**read_files(other), **JUNK}, revision="v1")
    server.add(GGUF_ID, {**{p.name: p.read_bytes() for p in ggufs.values()},
                         **{f: (tokenizer_dir / f).read_bytes() for f in TOKENIZER_FILES},
                         "README.md": b"# tiny GGUF\n"})
    home = tmp_path_factory.mktemp("hf_home")
    with pytest.MonkeyPatch.context() as mp:
        from huggingface_hub import constants

        mp.setenv("HF_HOME", str(home))
        mp.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
        point_hub_at(mp, server.url)
        try:
            yield server
        finally:
            server.stop()


def greedy_tokens(llm, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_hub_id_generates_as_the_local_checkpoint_and_fetches_once(hub, checkpoint, tmp_path):
    prompts = [[1, 2, 3, 4], [7, 300, 12, 9, 45, 2, 100]]
    start = len(hub.requests)
    local = make_llm(checkpoint)
    expected = greedy_tokens(local, prompts)
    local.shutdown()
    llm = make_llm(MODEL_ID, download_dir=str(tmp_path))
    try:
        assert greedy_tokens(llm, prompts) == expected
        config = llm.llm_engine.engine_config
        assert config.model == MODEL_ID  # named as given, loaded from the snapshot
        snapshot = Path(config.model_path)
        assert snapshot.is_relative_to(tmp_path)
        assert read_files(snapshot) == read_files(checkpoint)
    finally:
        llm.shutdown()
    # Config, tokenizer and weight files only; each once, though the frontend, the core and
    # the model loader all needed the path.
    assert sorted(hub.fetched(MODEL_ID, start)) == sorted(read_files(checkpoint))
    assert hub.requests[start:].count(("GET", f"/api/models/{MODEL_ID}/revision/main")) == 1


def test_the_core_is_handed_the_snapshot_not_the_id(hub, monkeypatch, tmp_path):
    from jaxllm.engine import frontend

    handed = []

    def capture(launch_config, engine_args, remote_engine_args):
        handed.append((engine_args, remote_engine_args))
        raise RuntimeError("captured")

    monkeypatch.setattr(frontend, "make_client", capture)
    with pytest.raises(RuntimeError, match="captured"):
        frontend.EngineFrontend(EngineArgs(model=MODEL_ID, download_dir=str(tmp_path),
                                           skip_tokenizer_init=True), UsageContext.LLM_CLASS)
    ((args, remote_args),) = handed
    snapshot = resolve_model(MODEL_ID, None, str(tmp_path))
    assert args.model == str(snapshot) and snapshot.is_dir()
    # Data-parallel cores on other hosts get the id: each host resolves it in its own cache.
    assert remote_args.model == MODEL_ID


def test_the_core_is_handed_the_draft_models_snapshot(hub, checkpoint, monkeypatch, tmp_path):
    from jaxllm.engine import frontend

    handed = []

    def capture(launch_config, engine_args, remote_engine_args):
        handed.append((engine_args, remote_engine_args))
        raise RuntimeError("captured")

    monkeypatch.setattr(frontend, "make_client", capture)
    spec = {"method": "draft_model", "model": MODEL_ID, "revision": "v1",
            "num_speculative_tokens": 2}
    with pytest.raises(RuntimeError, match="captured"):
        frontend.EngineFrontend(EngineArgs(model=str(checkpoint), download_dir=str(tmp_path),
                                           skip_tokenizer_init=True, speculative_config=spec),
                                UsageContext.LLM_CLASS)
    ((args, remote_args),) = handed
    snapshot = resolve_model(MODEL_ID, "v1", str(tmp_path))
    assert args.model == remote_args.model == str(checkpoint)  # a local target stays as given
    assert args.speculative_config == {**spec, "model": str(snapshot), "revision": None,
                                       "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    assert remote_args.speculative_config["model"] == MODEL_ID
    assert remote_args.speculative_config["revision"] == "v1"
    # A frontend that runs no core (every core on another host) leaves the draft as named.
    start = len(hub.requests)
    handed.clear()
    with pytest.raises(RuntimeError, match="captured"):
        frontend.EngineFrontend(EngineArgs(model=str(checkpoint), download_dir=str(tmp_path / "x"),
                                           skip_tokenizer_init=True, speculative_config=spec,
                                           data_parallel_size=2, data_parallel_size_local=0),
                                UsageContext.LLM_CLASS)
    ((args, _),) = handed
    assert args.speculative_config["model"] == MODEL_ID and len(hub.requests) == start


def test_a_draft_model_by_hub_id_at_a_revision(hub, checkpoint, tmp_path):
    """The draft fetched by Hub id at the tag v1 (other weights than the target's): the
    engine drafts with that snapshot and its greedy tokens are the target's alone."""
    from tests.engine.spec_decode_utils import SpecCounters

    prompts = [[1, 2, 3, 4], [7, 300, 12, 9, 45, 2, 100]]
    small = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32)
    plain = make_llm(checkpoint, **small)
    expected = greedy_tokens(plain, prompts)
    plain.shutdown()
    spec = {"method": "draft_model", "model": MODEL_ID, "revision": "v1",
            "num_speculative_tokens": 3}
    start = len(hub.requests)
    llm = make_llm(checkpoint, download_dir=str(tmp_path), speculative_config=spec, **small)
    try:
        counters = SpecCounters(llm)
        assert greedy_tokens(llm, prompts) == expected
        assert counters.delta()["num_spec_draft_tokens"] > 0  # drafts were verified
        config = llm.llm_engine.engine_config.speculative_config
        assert (config.model, config.revision) == (MODEL_ID, "v1")  # named as given
        draft = Path(config.draft_model_config.model_path)
        assert draft.is_relative_to(tmp_path)
        weights = "model.safetensors"
        assert read_files(draft)[weights] == hub.commits[hub.refs[(MODEL_ID, "v1")]][weights] \
            != read_files(checkpoint)[weights]
    finally:
        llm.shutdown()
    assert hub.requests[start:].count(("GET", f"/api/models/{MODEL_ID}/revision/v1")) == 1


def test_revision_is_passed_to_the_hub(hub, checkpoint, tmp_path):
    main = resolve_model(MODEL_ID, None, str(tmp_path))
    tagged = resolve_model(MODEL_ID, "v1", str(tmp_path))
    assert ("GET", f"/api/models/{MODEL_ID}/revision/v1") in hub.requests
    assert read_files(main) == read_files(checkpoint)
    weights = "model.safetensors"
    assert read_files(tagged)[weights] == hub.commits[hub.refs[(MODEL_ID, "v1")]][weights] \
        != read_files(checkpoint)[weights]
    with pytest.raises(ModelLoadError, match=r"no revision 'v9'"):
        resolve_model(MODEL_ID, "v9", str(tmp_path))


def test_gguf_quant_picks_one_file_and_the_repo_tokenizer(hub, ggufs, tokenizer_dir, tmp_path):
    from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer

    start = len(hub.requests)
    path = resolve_model(f"{GGUF_ID}:Q8_0", None, str(tmp_path))
    assert path.name == ggufs["q8_0"].name
    assert path.read_bytes() == ggufs["q8_0"].read_bytes()
    assert sorted(hub.fetched(GGUF_ID, start)) == sorted([ggufs["q8_0"].name, *TOKENIZER_FILES])
    # Lower case names the same file; the other quantization is fetched only when asked for.
    assert resolve_model(f"{GGUF_ID}:q4_K_m", None, str(tmp_path)).read_bytes() \
        == ggufs["q4_k_m"].read_bytes()
    text = "def quicksort(xs):\n    return sorted(xs)  # 例"
    assert load_tokenizer(path).encode(text) == load_tokenizer(tokenizer_dir).encode(text)


@pytest.mark.parametrize("model, match", [
    (GGUF_ID, r"several \.gguf files \(tiny-qwen2-q4_k_m\.gguf, tiny-qwen2-q8_0\.gguf\)"),
    (f"{GGUF_ID}:Q5_K", r"exactly one \.gguf file must contain 'Q5_K', none do; .*"
                        r"tiny-qwen2-q4_k_m\.gguf, tiny-qwen2-q8_0\.gguf"),
    (f"{GGUF_ID}:tiny", r"must contain 'tiny', 2 \("),
    (f"{MODEL_ID}:Q4_K_M", r"picks a \.gguf file, but the repo has none"),
    ("tiny-org/no-such-repo", r"'tiny-org/no-such-repo' \(revision main\) is neither a local "
                              r"path nor a model repo on the Hugging Face Hub"),
])
def test_hub_ids_that_name_no_single_model(hub, tmp_path, model, match):
    start = len(hub.requests)
    with pytest.raises(ModelLoadError, match=match):
        resolve_model(model, None, str(tmp_path))
    repo = model.split(":")[0]
    assert not [f for f in hub.fetched(repo, start) if f.endswith((".gguf", ".safetensors"))]


def test_offline_from_the_cache(hub, tmp_path):
    cache = str(tmp_path)
    online = resolve_model(MODEL_ID, None, cache), resolve_model(f"{GGUF_ID}:Q8_0", None, cache)
    with pytest.MonkeyPatch.context() as mp:
        point_hub_at(mp, closed_port_url(), offline=True)
        before = len(hub.requests)
        assert (resolve_model(MODEL_ID, None, cache),
                resolve_model(f"{GGUF_ID}:Q8_0", None, cache)) == online
        # Not cached: the other quantization, or the tag never fetched.
        with pytest.raises(ModelLoadError, match=r"HF_HUB_OFFLINE is set"):
            resolve_model(f"{GGUF_ID}:Q4_K_M", None, cache)
        with pytest.raises(ModelLoadError, match=r"\(revision v1\) is neither a local path "
                                                 r"nor reachable"):
            resolve_model(MODEL_ID, "v1", cache)
        # Unreachable without the variable: the cache as well.
        point_hub_at(mp, closed_port_url(), offline=False)
        assert resolve_model(MODEL_ID, None, cache) == online[0]
        assert len(hub.requests) == before


@pytest.mark.parametrize("offline", [False, True])
def test_no_hub_and_no_cache_is_a_clear_error(hub, tmp_path, offline):
    with pytest.MonkeyPatch.context() as mp:
        point_hub_at(mp, closed_port_url(), offline=offline)
        with pytest.raises(ModelLoadError) as e:
            make_llm("Qwen/Qwen2.5-1.5B-Instruct", revision="abc", download_dir=str(tmp_path))
    message = str(e.value)
    assert message.startswith("'Qwen/Qwen2.5-1.5B-Instruct' (revision abc) is neither a local "
                              "path nor reachable on the Hugging Face Hub")
    assert str(tmp_path) in message and ("HF_HUB_OFFLINE" in message) == offline
    assert "Traceback" not in message and "\n" not in message


@pytest.mark.parametrize("model", ["./no/such/model", "/no/such/model", "~/no-such-model",
                                   "no-such-model.gguf"])
def test_a_path_that_does_not_exist_stays_a_path(hub, model, tmp_path):
    before = len(hub.requests)
    assert resolve_model(model, None, str(tmp_path)) == Path(model).expanduser()
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        make_llm(model)
    assert len(hub.requests) == before


def test_an_existing_directory_wins_over_a_hub_id(hub, checkpoint, tmp_path, monkeypatch):
    (tmp_path / "tiny-org").mkdir()
    shutil.copytree(checkpoint, tmp_path / MODEL_ID)
    monkeypatch.chdir(tmp_path)
    before = len(hub.requests)
    assert resolve_model(MODEL_ID) == Path(MODEL_ID)
    assert len(hub.requests) == before


def test_serve_parses_revision_and_download_dir():
    from jaxllm.entrypoints.cli.main import build_parser

    args = build_parser().parse_args(["serve", f"{GGUF_ID}:Q4_K_M", "--revision", "v1",
                                      "--download-dir", "/models"])
    engine_args = EngineArgs.from_cli_args(args, model=args.model_tag)
    assert (engine_args.model, engine_args.revision, engine_args.download_dir) == \
        (f"{GGUF_ID}:Q4_K_M", "v1", "/models")


def test_a_quantization_type_is_matched_as_a_whole_word_first():
    from jaxllm.model_executor.model_loader.hub import pick_gguf

    files = ["m-BF16.gguf", "m-F16.gguf", "m-IQ4_0.gguf", "m-Q4_0.gguf", "m-Q4_K_M.gguf"]
    assert pick_gguf("o/m", files, "F16") == "m-F16.gguf"
    assert pick_gguf("o/m", files, "q4_0") == "m-Q4_0.gguf"
    assert pick_gguf("o/m", files, "Q4_K_M") == "m-Q4_K_M.gguf"
    # No whole-word match: a part of a name still picks it when only one file holds it.
    assert pick_gguf("o/m", files, "K_M") == "m-Q4_K_M.gguf"
    with pytest.raises(ModelLoadError, match="exactly one .gguf file must contain 'Q4'"):
        pick_gguf("o/m", files, "Q4")


def test_a_sharded_repo_fetches_the_shards_its_index_names(hub, checkpoint, tmp_path):
    """A repo with an index and a consolidated copy beside the shards (as Mistral's): only
    the index and its shards are fetched, and they load as the local checkpoint."""
    import json

    from safetensors import safe_open

    files = read_files(checkpoint)
    weights = files.pop("model.safetensors")
    with safe_open(checkpoint / "model.safetensors", framework="numpy") as st:
        names = list(st.keys())
    shard = "model-00001-of-00001.safetensors"
    index = {"metadata": {}, "weight_map": {name: shard for name in names}}
    repo = "tiny-org/tiny-sharded"
    hub.add(repo, {**files, shard: weights, "consolidated.safetensors": weights,
                   "model.safetensors.index.json": json.dumps(index).encode()})
    start = len(hub.requests)
    snapshot = resolve_model(repo, None, str(tmp_path))
    assert "consolidated.safetensors" not in hub.fetched(repo, start)
    assert (snapshot / shard).read_bytes() == weights
    assert not (snapshot / "consolidated.safetensors").exists()
