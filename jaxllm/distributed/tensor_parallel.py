"""Tensor parallelism (Megatron-style) on a one-axis JAX device mesh, axis "tp".

The step is one SPMD program: the model runs under `jax.shard_map` on each device's slice
(`TPLayout.local`: its query heads, KV heads, MLP columns and vocabulary rows) with explicit
collectives, two all-reduces per layer plus one for the embedding:
  - qkv_proj and gate_up_proj are column-parallel: each device's rows of the fused weight are its
    own q, k, v heads and its own gate and up rows (laid out here, once, at load), so the split
    after the GEMM is local, as in vLLM's QKVParallelLinear / MergedColumnParallelLinear;
  - o_proj and down_proj are row-parallel: a `psum` of the partial outputs each;
  - the embedding and the LM head are vocabulary-parallel: a lookup masked to the device's rows
    then a `psum`; each device's logits are its vocabulary slice, whose top-K and log-sum-exp
    are merged across devices (`merged_top_k`: an all-gather of [R, K] candidates, never of
    full logits rows);
  - a mixture-of-experts block (layers/fused_moe.py) splits each expert's intermediate
    dimension as the dense MLP's (stacked gate_up column-parallel, down row-parallel), its
    shared expert likewise; its router and shared-expert gate are replicated; one all-reduce
    sums the routed and shared outputs;
  - norms and RoPE tables are replicated, but for norms over a whole q or k projection
    (OLMo 2's `q_proj_norm`, `k_proj_norm`), split as the projection's heads are, whose mean
    of squares is then averaged over the devices (layers/layernorm.py `ShardedRMSNorm`).
The paged KV array is sharded on its kv-head axis. When N exceeds the KV heads, each KV head is
replicated on the N / num_kv_heads devices whose query heads read it (the array then has N
heads, one per device), so attention stays local.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.model_executor.config import ModelConfig
from jaxllm.sample.topk import top_k_logits

TP_AXIS = "tp"
# [layers, K/V, kv_heads, blocks, block_size, head_dim]: sharded on its kv heads.
KV_SPEC = P(None, None, TP_AXIS)
# Full logits rows [R, vocab]: each device holds its vocabulary slice.
LOGITS_SPEC = P(None, TP_AXIS)


@dataclass(frozen=True)
class TPLayout:
    """How one model splits over `size` devices; `local` is one device's view of the model."""

    size: int
    config: ModelConfig
    local: ModelConfig
    kv_replicas: int  # devices holding each KV head (1 when size <= num_key_value_heads)

    @property
    def num_kv_heads_total(self) -> int:
        """KV heads of the sharded KV array (with replicas)."""
        return self.local.num_key_value_heads * self.size


def tp_layout(config: ModelConfig, size: int) -> TPLayout:
    """The per-device split of `config` over `size` devices; a split that cannot be made is a
    ValueError naming the numbers (checked at start-up, before any weight moves)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    checks = (("num_attention_heads", nh), ("intermediate_size", config.intermediate_size),
              ("vocab_size", config.vocab_size))
    for name, value in checks:
        if value % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's {name} "
                             f"{value}")
    if size <= nkv:
        if nkv % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's "
                             f"num_key_value_heads {nkv} (nor is it a multiple of it)")
        kv_local, replicas = nkv // size, 1
    else:
        if size % nkv:
            raise ValueError(f"tensor_parallel_size {size} exceeds the model's "
                             f"num_key_value_heads {nkv} and is not a multiple of it, so the "
                             f"KV heads cannot be replicated evenly")
        kv_local, replicas = 1, size // nkv
    moe = config.moe
    if moe is not None:
        for name, value in (("moe_intermediate_size", moe.intermediate_size),
                            ("shared_expert_intermediate_size",
                             moe.shared_expert_intermediate_size)):
            if value % size:
                raise ValueError(f"tensor_parallel_size {size} does not divide the model's "
                                 f"{name} {value}")
        moe = dataclasses.replace(
            moe, intermediate_size=moe.intermediate_size // size,
            shared_expert_intermediate_size=moe.shared_expert_intermediate_size // size)
    local = dataclasses.replace(
        config, num_attention_heads=nh // size, num_key_value_heads=kv_local,
        intermediate_size=config.intermediate_size // size, vocab_size=config.vocab_size // size,
        moe=moe)
    return TPLayout(size, config, local, replicas)


def make_mesh(size: int, devices: list | None = None) -> Mesh:
    """A one-axis mesh over the first `size` devices (all processes' devices, multi-host)."""
    devices = jax.devices() if devices is None else devices
    if len(devices) < size:
        raise ValueError(f"tensor_parallel_size {size} needs {size} devices, "
                         f"{len(devices)} are visible ({devices[0].platform})")
    return Mesh(np.array(devices[:size]), (TP_AXIS,))


def _leaf_spec(path: tuple[str, ...]) -> P:
    name = path[-1]
    parent = path[-2] if len(path) > 1 else ""
    if parent == "experts":  # stacked MoE experts [E, rows, cols]: each expert's inter split
        return P(None, TP_AXIS, None) if name == "gate_up_proj" else P(None, None, TP_AXIS)
    if name in ("embed_tokens", "lm_head") or parent in ("qkv_proj", "gate_up_proj"):
        return P(TP_AXIS) if name == "bias" else P(TP_AXIS, None)
    if parent in ("o_proj", "down_proj"):
        return P() if name == "bias" else P(None, TP_AXIS)  # the bias: added after the sum
    if parent in ("q_proj_norm", "k_proj_norm"):
        return P(TP_AXIS)
    return P()  # other norms: replicated


def param_specs(params: dict) -> dict:
    """PartitionSpecs of a param tree (same structure)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: _leaf_spec(tuple(k.key for k in path)), params)


def _per_shard_qkv(x: np.ndarray, layout: TPLayout) -> np.ndarray:
    """[q; k; v] rows (heads * head_dim each, any trailing dims) -> per device [q_d; k_d; v_d],
    KV heads repeated for the devices that share them."""
    cfg, n = layout.config, layout.size
    hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    q, k, v = np.split(x, [nh * hd, (nh + nkv) * hd])
    q = q.reshape(n, nh // n * hd, *x.shape[1:])
    k, v = (_per_shard_kv(a, layout) for a in (k, v))
    return np.concatenate([q, k, v], axis=1).reshape(-1, *x.shape[1:])


def _per_shard_kv(x: np.ndarray, layout: TPLayout) -> np.ndarray:
    """KV-head rows (heads * head_dim, any trailing dims) -> [devices, rows per device, ...],
    KV heads repeated for the devices that share them."""
    hd, nkv = layout.config.head_dim, layout.config.num_key_value_heads
    x = x.reshape(nkv, hd, *x.shape[1:])
    # Device d's KV heads: d * kv_local ... (no replicas) or head d // replicas.
    heads = np.arange(layout.num_kv_heads_total) // layout.kv_replicas
    return x[heads].reshape(layout.size, -1, *x.shape[2:])


def _per_shard_gate_up(x: np.ndarray, n: int) -> np.ndarray:
    """[gate; up] rows -> per device [gate_d; up_d]."""
    gate, up = (a.reshape(n, -1, *x.shape[1:]) for a in np.split(x, 2))
    return np.concatenate([gate, up], axis=1).reshape(x.shape)


def shard_params(params: dict, layout: TPLayout, mesh: Mesh) -> dict:
    """The loaded (unsharded) param tree laid out per shard and placed on the mesh. Consumes
    `params`: each leaf is replaced in place as it is placed, so the host never holds two
    copies of the model (the 0.5B model is 2 GB in float32)."""
    def place(tree: dict, names: tuple[str, ...]) -> None:
        for key, x in tree.items():
            path = names + (key,)
            if isinstance(x, dict):
                place(x, path)
                continue
            if key in ("weight", "bias") and names[-1:] == ("qkv_proj",):
                x = _per_shard_qkv(np.asarray(x), layout)
            elif key == "weight" and names[-1:] == ("k_proj_norm",):
                x = _per_shard_kv(np.asarray(x), layout).reshape(-1)
            elif key == "weight" and names[-1:] == ("gate_up_proj",):
                x = _per_shard_gate_up(np.asarray(x), layout.size)
            elif key == "gate_up_proj" and names[-1:] == ("experts",):
                x = np.stack([_per_shard_gate_up(w, layout.size) for w in np.asarray(x)])
            tree[key] = None  # drop the unsharded leaf before its copy is made
            tree[key] = jax.device_put(x, NamedSharding(mesh, _leaf_spec(path)))
            del x

    place(params, ())
    return params


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of (possibly sharded) arrays; shared leaves once."""
    seen = {}
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if hasattr(x, "sharding") else x.shape
        seen[id(x)] = int(np.prod(shape)) * x.dtype.itemsize
    return sum(seen.values())


# --- inside shard_map ---------------------------------------------------------------------------


def all_reduce(x: jax.Array, axis: str | None) -> jax.Array:
    """Sum over the mesh axis (row-parallel outputs); identity without tensor parallelism."""
    return x if axis is None else jax.lax.psum(x, axis)


def vocab_parallel_embed(embed: jax.Array, input_ids: jax.Array, axis: str) -> jax.Array:
    """Rows of a vocabulary-sharded embedding: each device looks up the ids in its slice (zero
    elsewhere), one all-reduce sums them."""
    rows = embed.shape[0]
    local = input_ids - jax.lax.axis_index(axis) * rows
    mine = (local >= 0) & (local < rows)
    h = jnp.take(embed, jnp.where(mine, local, 0), axis=0)
    return jax.lax.psum(jnp.where(mine[:, None], h, jnp.zeros_like(h)), axis)


def merged_top_k(local_logits: jax.Array, k: int, axis: str
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`top_k_logits` of logits whose vocabulary is split over `axis`: each device's top-K and
    log-sum-exp, all-gathered ([N, R, K], small) and merged; the same on every device."""
    rows = local_logits.shape[1]
    values, ids, lse = top_k_logits(local_logits, min(k, rows))
    ids = ids + jax.lax.axis_index(axis) * rows
    values = jax.lax.all_gather(values, axis, axis=1, tiled=True)  # [R, N * k_local]
    ids = jax.lax.all_gather(ids, axis, axis=1, tiled=True)
    lse = jax.nn.logsumexp(jax.lax.all_gather(lse, axis), axis=0)
    top, pos = jax.lax.top_k(values, k)
    neg, ids = jax.lax.sort((-top, jnp.take_along_axis(ids, pos, axis=1)), dimension=1,
                            num_keys=2)
    return -neg, ids, lse


def sharded_target_stats(local_logits: jax.Array, targets: jax.Array, axis: str
                         ) -> tuple[jax.Array, jax.Array]:
    """(logit of each row's target token, 1 + tokens with a larger logit) over a vocabulary
    split on `axis`."""
    rows = local_logits.shape[1]
    local = targets - jax.lax.axis_index(axis) * rows
    mine = (local >= 0) & (local < rows)
    val = jnp.take_along_axis(local_logits, jnp.where(mine, local, 0)[:, None], axis=1)[:, 0]
    target = jax.lax.psum(jnp.where(mine, val, 0.0), axis)
    rank = 1 + jax.lax.psum(jnp.sum(local_logits > target[:, None], axis=1, dtype=jnp.int32),
                            axis)
    return target, rank


def spmd(fn, mesh: Mesh, params: dict, out_specs, extra_in_specs: tuple = ()):
    """`fn(params, *replicated args, *extra)` as one SPMD program over `mesh`: params split by
    `param_specs`, the other inputs replicated unless `extra_in_specs` says otherwise (those
    come last). check_vma is off: the Pallas kernels' pallas_call carries no
    varying-manual-axes types."""
    def call(params, *args):
        n = len(args) - len(extra_in_specs)
        in_specs = (param_specs(params),) + (P(),) * n + tuple(extra_in_specs)
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)(params, *args)
    return call
