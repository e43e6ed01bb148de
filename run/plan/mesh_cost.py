"""The mesh's cost model: for a model on N devices of a machine, every factorisation
D x S x C x X (replicas x stages x seq devices x tensor devices) with its memory per
device (exact: `sharding.footprint`), and predicted prefill and decode times (a roofline
model). Replicas share nothing in a step: one decodes its ceil(batch / D) rows as a
mesh of S x C x X would, so a token's time is one replica's and the throughput D of
theirs.

Per device and per stage tick, a stage's work is its L_pad / S layer slots of 1/X of
every matmul (model.split), read or computed at the device's rooflines, plus the
`tensor` all-reduces of the hidden state (two per slot and the embedding's, ring
all-reduces: 2 (X - 1) / X of the payload each, and a latency each), plus the K/V
the step attends (1/(C X) of it). Between stages the hidden state crosses a link
once per tick. A decode step of one request visits every stage in turn:

    token_s = S * (stage_s + link_s)                     (single stream)
    steps/s = G / (max(G, S) * (stage_s + link_s))       (G groups in flight, G >= S: full)

The seed's worked exercise (S = 4, 5 ms a stage, 0.2 ms a transfer) gives 20.8 ms a
token single-stream and 1 / 5.2 ms = 192 steps a second with the pipeline full (200
if the transfer overlapped the compute, which these programs do not: the shift follows
the stage's layers in the same tick).

Links: `tensor` and `seq` stay inside a host where the factorisation allows (tensor
innermost, then seq: sharding.mesh), and use the host's fast links; a stage boundary
that crosses hosts uses the slower network.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.split import TensorSplit
from qwen3_spmd.run.flops import attention_flops, dense_flops
from qwen3_spmd.run.plan.machines import TARGETS, Machine
from qwen3_spmd.run.traffic import all_reduces_per_tick, all_to_all_per_layer
from qwen3_spmd.sharding.footprint import bytes_per_device
from qwen3_spmd.sharding.mesh import MeshShape


@dataclasses.dataclass(frozen=True)
class Load:
    """What is served: `batch` requests of `prompt_len` prompt tokens, each with a cache of
    `max_seq_len` slots, in `dtype`."""

    batch: int = 8
    prompt_len: int = 2048
    max_seq_len: int = 4096
    dtype: str = "bfloat16"


def factorisations(cfg: Qwen3Config, devices: int, hosts: int, experts: str | None = None):
    """Every D x S x C x X of `devices` the model splits over: X inside a host (X divides
    the devices of one), S at most the layers, the replicas whole hosts or whole shares
    of one (D a multiple or a divisor of the hosts)."""
    per_host = devices // hosts
    for D in range(1, devices + 1):
        if devices % D or (D % hosts and hosts % D):
            continue
        replica = devices // D
        for X in range(1, min(per_host, replica) + 1):
            if per_host % X or replica % X or not TensorSplit.of(X, D, experts).fits(cfg, X):
                continue
            for S in range(1, min(cfg.L, replica // X) + 1):
                if (replica // X) % S == 0:
                    yield MeshShape(S, replica // (S * X), X, D)


def pipeline_decode(stage_s: float, link_s: float, stages: int, groups: int) -> tuple:
    """(a token's seconds single-stream, decode steps per second with `groups` groups in
    flight) for stages of `stage_s` a tick and links of `link_s` between them."""
    tick = stage_s + link_s
    return stages * tick, groups / (max(groups, stages) * tick)


def _seconds(nbytes: float, rate: float, latency: float = 0.0) -> float:
    return nbytes / rate + latency


def predict(
    cfg: Qwen3Config,
    shape: MeshShape,
    machine: Machine,
    load: Load,
    hosts: int = 1,
    experts: str | None = None,
) -> dict:
    """One mesh's figures: bytes per device, prefill seconds, decode seconds per step at
    batch 1 and at `load.batch`, the cache tokens the free memory holds (90% of the
    device's, less the weights), and the parts of a step. experts: Qwen3-MoE's split
    (model.split; None: its default on this mesh)."""
    S, C, X, D = shape.stage, shape.seq, shape.tensor, shape.data
    itemsize = jnp.dtype(load.dtype).itemsize
    dtype = jnp.dtype(load.dtype)
    split = TensorSplit.of(X, D, experts)
    memory = bytes_per_device(
        cfg, S, C, dtype, load.batch, load.max_seq_len, X, split.experts, data=D
    )
    batch = -(-load.batch // D)  # one replica's rows
    slots = math.ceil(cfg.L / S)
    # Links: devices are laid out tensor, then seq, then stage; a group of n consecutive
    # devices stays in a host when n divides the devices of one.
    per_host = shape.devices // hosts
    inside = X * C <= per_host
    seq_rate = machine.host_link_bytes_per_s if inside else machine.network_bytes_per_s
    stage_crosses = S > 1 and X * C * S > per_host
    stage_rate, stage_latency = (
        (machine.network_bytes_per_s, machine.network_latency_s)
        if stage_crosses
        else (machine.host_link_bytes_per_s, machine.host_latency_s)
    )
    reduces = all_reduces_per_tick(cfg, S)
    reduce_factor = 2 * (X - 1) / X

    def all_reduce_s(rows: float) -> float:
        if X == 1:
            return 0.0
        payload = rows * cfg.D * itemsize * reduce_factor
        return reduces * _seconds(payload, machine.host_link_bytes_per_s, machine.host_latency_s)

    # Qwen3-MoE's "a2a" split: a stage's sparse layers each send two all-to-alls over
    # data x tensor (run.traffic.all_to_all_per_layer), across hosts once replicas are.
    exchanges = split.exchanges and cfg.has_sparse
    sparse_slots = -(-sum(cfg.sparse_layers) // S)
    a2a_rate, a2a_latency = (
        (machine.network_bytes_per_s, machine.network_latency_s)
        if shape.devices > per_host and D > 1
        else (machine.host_link_bytes_per_s, machine.host_latency_s)
    )

    def all_to_all_s(rows: float) -> float:
        if not exchanges:
            return 0.0
        sent, _ = all_to_all_per_layer(cfg, split, math.ceil(rows), itemsize)
        return sparse_slots * _seconds(sent, a2a_rate, 2 * a2a_latency)

    # A device holds the embedding (and lm_head) whole on every stage; a step reads its
    # stage's layer slots, and the last stage lm_head once per token.
    tables = (1 if cfg.tie_word_embeddings else 2) * cfg.V * cfg.D * itemsize / X
    layer_weights = memory["weights"] - tables
    head_s = _seconds(cfg.V * cfg.D * itemsize / X, machine.hbm_bytes_per_s)

    def decode_stage_s(rows: int, context: float) -> dict:
        kv = 2 * slots * rows * context * cfg.K * cfg.H * itemsize / (C * X)
        read = _seconds(layer_weights + kv, machine.hbm_bytes_per_s)
        seq_merge = (
            0.0
            if C == 1
            else 2
            * slots
            * _seconds(rows * cfg.N * cfg.H * 4 / X, seq_rate, machine.host_latency_s)
        )
        return {
            "read_s": read,
            "all_reduce_s": all_reduce_s(rows),
            "seq_s": seq_merge,
            "all_to_all_s": all_to_all_s(rows),
        }

    link_s = 0.0 if S == 1 else _seconds(cfg.D * itemsize, stage_rate, stage_latency)
    one = decode_stage_s(1, load.prompt_len)
    token_s = pipeline_decode(sum(one.values()), link_s, S, 1)[0] + head_s
    G = max(1, min(batch, S))
    rows = -(-batch // G)
    many = decode_stage_s(rows, load.prompt_len)
    steps_per_s = pipeline_decode(sum(many.values()) + head_s / S, link_s, S, G)[1]
    # Prefill of one prompt: each stage's share of the flops at the matmul roofline,
    # its all-reduces, and the hidden state across each stage boundary.
    T = load.prompt_len
    flops = dense_flops(cfg, T) / S + attention_flops(cfg, T) * slots
    prefill_s = S * (
        flops / (C * X) / machine.flops_per_s
        + all_reduce_s(T / C)
        + all_to_all_s(T / C)
        + (0.0 if S == 1 else _seconds(T / C * cfg.D * itemsize, stage_rate, stage_latency))
    )
    kv_per_token = 2 * slots * math.ceil(TensorSplit(X).kv_heads(cfg) / X) * cfg.H * itemsize
    free = machine.memory * 0.9 - memory["weights"]
    cache_tokens = int(free / kv_per_token * C) if free > 0 else 0
    parts = {"weights read": one["read_s"], "all-reduces": one["all_reduce_s"]}
    parts.update({"seq merges": one["seq_s"], "stage links": link_s, "lm_head": head_s / S})
    if exchanges:
        parts["all-to-alls"] = one["all_to_all_s"]
    return {
        "mesh": str(shape),
        "stage": S,
        "seq": C,
        "tensor": X,
        "data": D,
        "weight_bytes_per_device": memory["weights"],
        "kv_bytes_per_device": memory["kv"],
        "fits": memory["total"] <= machine.memory * 0.9,
        "prefill_s": prefill_s,
        "decode_token_s": token_s,
        "decode_steps_per_s": steps_per_s,
        "decode_tokens_per_s": D * steps_per_s * rows,
        # KV slots the free memory holds, all requests together, every replica's
        "cache_tokens": D * cache_tokens,
        "step_parts_s": parts,
    }


def rank(rows: list[dict], target: str) -> list[dict]:
    """The meshes that fit, best first for `target` (then the rest, which do not fit)."""
    key, larger = TARGETS[target]
    fit = sorted((r for r in rows if r["fits"]), key=lambda r: r[key], reverse=larger)
    return fit + [r for r in rows if not r["fits"]]


def why(row: dict) -> str:
    """What a step of this mesh spends its time on, in a few words."""
    parts = row["step_parts_s"]
    total = sum(parts.values()) or 1.0
    top = sorted(parts.items(), key=lambda kv: -kv[1])[:2]
    return ", ".join(f"{name} {100 * s / total:.0f}%" for name, s in top if s > 0)
