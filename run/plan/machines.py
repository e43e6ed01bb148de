"""The devices the mesh's cost model knows (`run.plan.mesh_cost`) and what `plan` ranks
by: plain data, importable without JAX, so `qwen3-spmd plan --help` lists them at once."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Machine:
    """What one device and its links do: memory (bytes), HBM bandwidth (bytes/s), matmul
    throughput (FLOP/s) in the serving dtype, and per-direction link bandwidths (bytes/s)
    inside a host and across hosts, each with a per-collective latency (s)."""

    name: str
    memory: float
    hbm_bytes_per_s: float
    flops_per_s: float
    host_link_bytes_per_s: float
    network_bytes_per_s: float
    host_latency_s: float = 5e-6
    network_latency_s: float = 2e-5


# Vendor figures (dense bfloat16, no sparsity); links per direction: NVLink 4 at 450 GB/s
# and one 400 Gb/s NIC per GPU across hosts.
GPUS = {
    "h200": Machine("H200", 141e9, 4.8e12, 989e12, 450e9, 50e9),
    "h100": Machine("H100", 80e9, 3.35e12, 989e12, 450e9, 50e9),
    "a100": Machine("A100-80GB", 80e9, 2.0e12, 312e12, 300e9, 25e9),
}


# What `plan --target` ranks by: (a row's figure, whether larger is better).
TARGETS = {
    "latency": ("decode_token_s", False),
    "throughput": ("decode_tokens_per_s", True),
    "prompt": ("cache_tokens", True),
}
