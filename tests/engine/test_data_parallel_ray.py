"""Data parallelism over Ray (`data_parallel_backend="ray"`): on a local two-node Ray cluster
(two raylets on this machine, one CPU each, started by a helper process), two engine cores as
Ray actors that join the frontend over TCP.

Against one core (in process, the same settings): the same greedy and seeded tokens per
request; the cores on two different Ray nodes, each serving some of the requests; shutdown
leaves no actor alive and no core process. Three cores on the two-CPU cluster fail the start
at once, naming what they need and what the cluster has; actors Ray cannot place fail it at
the ready timeout. One cluster and one data-parallel engine for the module (tiny-qwen2: a
start is seconds)."""

from __future__ import annotations

import logging
import re
import select
import signal
import subprocess
import sys
import time

import pytest
import ray
from ray._private.state import actors as ray_actors

from jaxllm import LLM
from jaxllm.engine import ray_launcher
from jaxllm.engine.dp_client import DPLBClient
from jaxllm.engine.serial_utils import ENGINE_READY_TIMEOUT_ENV
from tests.engine.dp_cases import (
    ENGINE,
    PROMPTS,
    alive,
    params,
    token_prompt,
    wait_until,
)
from tests.server.openai_server import free_port

# Just over Ray's smallest object store: the engine moves nothing through it.
OBJECT_STORE_BYTES = 80 << 20
ACTOR_CLASS = "EngineCoreActor"


def live_core_actors() -> list[dict]:
    return [a for a in ray_actors().values()
            if a["ActorClassName"].endswith(ACTOR_CLASS) and a["State"] != "DEAD"]


def test_without_ray_the_start_says_what_to_install(monkeypatch):
    # Before the module's cluster: no Ray thread of this process may import Ray meanwhile.
    assert not ray.is_initialized()
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails
    with pytest.raises(ImportError, match=re.escape("pip install 'jaxllm[ray]'")):
        LLM("tiny-qwen2", data_parallel_size=2, data_parallel_backend="ray",
            data_parallel_rpc_port=free_port(), **ENGINE)


# The cluster lives in a process of its own, which starts Ray's processes: forking them from
# this one, where JAX's threads run, could deadlock. It ends the cluster once its stdin closes.
CLUSTER_SCRIPT = """
import sys
from ray.cluster_utils import Cluster

node = dict(num_cpus=1, object_store_memory=int(sys.argv[1]))
cluster = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
try:
    cluster.add_node(**node)
    cluster.wait_for_nodes(timeout=60)
    print(cluster.address, flush=True)
    sys.stdin.read()
finally:
    cluster.shutdown()
"""


@pytest.fixture(scope="module")
def cluster():
    """A head and a second node, one CPU each, no dashboard; this process its driver."""
    sigterm = signal.getsignal(signal.SIGTERM)  # ray.init replaces it
    proc = subprocess.Popen([sys.executable, "-c", CLUSTER_SCRIPT, str(OBJECT_STORE_BYTES)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        address = proc.stdout.readline().strip() if ready else ""
        assert address, "the Ray cluster did not start"
        ray.init(address=address, logging_level=logging.WARNING)
        # Both nodes' CPUs are in the cluster's view before any engine asks for them.
        wait_until(lambda: ray.available_resources().get("CPU", 0) >= 2, timeout=60)
        yield address
    finally:
        ray.shutdown()
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        signal.signal(signal.SIGTERM, sigterm)


@pytest.fixture(scope="module")
def reference():
    """One core, in this process: the tokens every data-parallel run must give."""
    llm = LLM("tiny-qwen2", multiprocess_mode=False, **ENGINE)
    outs = llm.generate([token_prompt(p) for p in PROMPTS],
                        [params(i) for i in range(len(PROMPTS))], use_tqdm=False)
    yield [list(o.outputs[0].token_ids) for o in outs]
    llm.llm_engine.shutdown()


def test_more_cores_than_the_cluster_holds_fail_the_start_at_once(cluster):
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"3 engine cores need \{'CPU': 1\} each") as e:
        LLM("tiny-qwen2", data_parallel_size=3, data_parallel_backend="ray",
            data_parallel_rpc_port=free_port(), **ENGINE)
    assert "room for 2" in str(e.value) and str(e.value).count("CPU 1") == 2, str(e.value)
    assert time.monotonic() - t < 30
    assert live_core_actors() == []


def test_actors_ray_cannot_place_fail_the_start_at_the_ready_timeout(cluster, monkeypatch):
    """Past the capacity check (the cluster changed meanwhile): the ready wait ends it."""
    monkeypatch.setattr(ray_launcher, "core_resources", lambda gpu, tp: {"CPU": 2})
    monkeypatch.setattr(ray_launcher, "check_capacity", lambda nodes, need, n: None)
    monkeypatch.setenv(ENGINE_READY_TIMEOUT_ENV, "3")
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"engine cores \[0, 1\] were not running within 3 "
                                           r"s .*each needs \{'CPU': 2\}"):
        LLM("tiny-qwen2", data_parallel_size=2, data_parallel_backend="ray",
            data_parallel_rpc_port=free_port(), **ENGINE)
    assert time.monotonic() - t < 30
    wait_until(lambda: live_core_actors() == [])


def test_capacity_is_counted_per_node():
    """An actor's GPUs are on one node: two nodes of one GPU hold no TP = 2 core."""
    one_gpu = {"a" * 56: {"CPU": 8.0, "GPU": 1.0}, "b" * 56: {"CPU": 8.0, "GPU": 1.0}}
    with pytest.raises(RuntimeError, match="room for 0: available node aaaaaaaaaaaa: CPU 8, "
                                           "GPU 1; node bbbbbbbbbbbb: CPU 8, GPU 1"):
        ray_launcher.check_capacity(one_gpu, ray_launcher.core_resources(True, 2), 1)
    ray_launcher.check_capacity(one_gpu, ray_launcher.core_resources(True, 1), 2)
    with pytest.raises(RuntimeError, match="room for 2"):
        ray_launcher.check_capacity(one_gpu, ray_launcher.core_resources(True, 1), 3)


def test_cores_ask_for_gpus_where_the_cluster_has_them(monkeypatch):
    """A frontend host without a GPU (a CPU head node) in front of GPU nodes: the cores ask for
    GPUs; JAX_PLATFORMS, when set, decides alone."""
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(ray_launcher, "gpu_platform_installed", lambda: False)
    assert ray_launcher.cores_use_gpus(8.0) and not ray_launcher.cores_use_gpus(0.0)
    monkeypatch.setattr(ray_launcher, "gpu_platform_installed", lambda: True)
    assert ray_launcher.cores_use_gpus(0.0)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setattr(ray_launcher, "gpu_platform_installed", lambda: False)
    assert not ray_launcher.cores_use_gpus(8.0)


@pytest.fixture(scope="module")
def ray_llm(cluster):
    llm = LLM("tiny-qwen2", data_parallel_size=2, data_parallel_backend="ray",
              data_parallel_rpc_port=free_port(), **ENGINE)
    yield llm
    llm.llm_engine.shutdown()


def test_two_nodes_same_tokens_as_one_core(ray_llm, reference):
    client = ray_llm.llm_engine.engine_core_client
    assert isinstance(client, DPLBClient)
    sps = [params(i) for i in range(len(PROMPTS))]
    # Twice over: the second batch's requests land on the cores as the load then says.
    for _ in range(2):
        outs = ray_llm.generate([token_prompt(p) for p in PROMPTS], sps, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == reference
    states = client.engine_states()
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    assert {s.placement for s in states} == nodes, (states, nodes)
    assert all(s.alive and s.num_routed > 0 and s.num_requests == 0 for s in states), states
    assert len(live_core_actors()) == 2


def test_shutdown_leaves_no_actor_or_core_process(ray_llm):
    client = ray_llm.llm_engine.engine_core_client
    pids = client.core_pids
    assert len(set(pids)) == 2 and all(alive(p) for p in pids)
    t = time.monotonic()
    ray_llm.llm_engine.shutdown()
    assert time.monotonic() - t < 30
    wait_until(lambda: live_core_actors() == [])
    wait_until(lambda: not any(alive(p) for p in pids))
