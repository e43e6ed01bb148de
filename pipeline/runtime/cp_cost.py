"""Which way to split prompt attention along `seq`: the bytes each device receives per
layer for ring and Ulysses attention, a small time model, and the `auto` choice.

Per layer, a prompt padded to P tokens on C `seq` devices, T = P/C tokens per device,
batch B, `itemsize` bytes per activation value:

  ring     C-1 steps, each receiving a K/V block and its positions:
           (C-1) * B * T * (2 * K * H * itemsize + 4)
  ulysses  all-to-all q, k, v there and o back (a device keeps 1/C of each), and the
           query and key positions gathered:
           (C-1)/C * B * T * (2*N + 2*K') * H * itemsize + (C-1) * B * T * 2 * 4
           with K' = `ring.head_split(N, K, C).kv_sent` (K, or more when C > K repeats
           KV heads).

Both compute the same causal block pairs: 2C+1 pairs of (T/2)^2 scores of N heads per
device (the ring: its own block's 3 and 2 of every other; Ulysses: (2C)(2C+1)/2 pairs of
N/C heads). The time model: the ring sends the next block while it computes the
current one, so each of its C-1 steps takes the longer of the two; Ulysses waits for its
all-to-alls. The layer's matmuls (the same for both) are added from the roofline. A link
bandwidth is one figure for both, or one per collective ({"ppermute": .., "all_to_all":
..}): XLA's CPU backend runs the two at very different speeds.
"""

from __future__ import annotations

import dataclasses

from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.pipeline.requests import RequestError
from qwen3_spmd.ring import head_split

CP_CHOICES = ("ring", "ulysses", "auto")

# Nominal link bandwidth (bytes/s, per collective) and matmul throughput (FLOP/s) by
# platform, used by `auto` when the caller has not measured its own (`bench` measures
# both). Emulated CPU devices copy through one memory, and XLA's CPU all-to-all runs far
# slower per byte than its collective-permute: the orders of magnitude bench finds.
NOMINAL = {
    "cpu": ({"ppermute": 1e9, "all_to_all": 3e7}, 1e11),
    "gpu": ({"ppermute": 3e11, "all_to_all": 3e11}, 5e14),
    "tpu": ({"ppermute": 1e11, "all_to_all": 1e11}, 2e14),
}


def check_cp(cfg: Qwen3Config, seq: int, cp: str) -> None:
    """A RequestError in words (param `cp`) unless `cp` can split this model's attention
    over C = seq devices (Ulysses needs C to divide the N query heads)."""
    if cp not in CP_CHOICES:
        raise RequestError(f"$cp {cp!r} is not one of {', '.join(CP_CHOICES)}", "cp")
    if cp == "ulysses" and "ulysses" not in feasible(cfg, seq):
        fits = ", ".join(str(d) for d in range(1, cfg.N + 1) if cfg.N % d == 0)
        raise RequestError(
            f"ulysses: {cfg.N} query heads cannot be shared equally by {seq} seq devices; "
            f"use $cp ring, or a seq size that divides {cfg.N} ({fits})",
            "cp",
        )


def feasible(cfg: Qwen3Config, seq: int) -> tuple[str, ...]:
    """The strategies that can run on C = seq devices."""
    return ("ring", "ulysses") if cfg.N % seq == 0 else ("ring",)


def bytes_per_layer(
    strategy: str, cfg: Qwen3Config, seq: int, batch: int, padded_len: int, itemsize: int
) -> int:
    """Bytes one device receives along `seq` in one layer of prompt attention."""
    C, T = seq, padded_len // seq
    if C == 1:
        return 0
    if strategy == "ring":
        return (C - 1) * batch * T * (2 * cfg.K * cfg.H * itemsize + 4)
    kv_sent = head_split(cfg.N, cfg.K, C).kv_sent
    heads = (C - 1) * batch * T * (2 * cfg.N + 2 * kv_sent) * cfg.H * itemsize // C
    return heads + (C - 1) * batch * T * 2 * 4


def hybrid_bytes_per_layer(
    cfg: Qwen3Config, ulysses: int, ring: int, batch: int, padded_len: int, itemsize: int
) -> dict:
    """What a hybrid (USP) would move, not built: Ulysses inside groups of `ulysses`
    consecutive `seq` devices, then a ring of `ring` such groups, C = ulysses * ring.
    Each device's group-level block holds ulysses*T tokens of its KV heads
    (`head_split(N, K, ulysses).kv_heads` of them), passed on ring-1 times.

    Returns {"ulysses", "ring", "total"} bytes one device receives per layer."""
    C = ulysses * ring
    T = padded_len // C
    inner = bytes_per_layer("ulysses", cfg, ulysses, batch, ulysses * T, itemsize)
    kv = head_split(cfg.N, cfg.K, ulysses).kv_heads
    outer = (ring - 1) * batch * ulysses * T * (2 * kv * cfg.H * itemsize + 4)
    return {"ulysses": inner, "ring": outer, "total": inner + outer}


def link_rate(link_bytes_per_s, strategy: str) -> float:
    """The bandwidth `strategy`'s collective runs at: ppermute for the ring, all_to_all
    for Ulysses (one figure serves both)."""
    if isinstance(link_bytes_per_s, dict):
        return link_bytes_per_s["ppermute" if strategy == "ring" else "all_to_all"]
    return link_bytes_per_s


@dataclasses.dataclass(frozen=True)
class Prefill:
    """One prefill as the model sees it: `batch` prompts padded to `padded_len` tokens,
    run in `microbatches` over `stages` stages and C = `seq` devices, `itemsize` bytes
    per activation value."""

    cfg: Qwen3Config
    seq: int
    stages: int
    microbatches: int
    batch: int
    padded_len: int
    itemsize: int


@dataclasses.dataclass(frozen=True)
class Rates:
    """What the machine is assumed to do: link bandwidth in bytes/s (one figure, or one
    per collective: `link_rate`) and matmul throughput in FLOP/s."""

    link_bytes_per_s: float | dict
    flops_per_s: float


def predict(strategy: str, prefill: Prefill, rates: Rates) -> dict:
    """The model's figures for one prefill: bytes per device (per layer and over the
    program, bubbles included: attention's collectives run on every tick) and seconds.

    Returns {"strategy", "bytes_per_layer", "bytes_per_device", "attention_s_per_layer",
    "predicted_s"}."""
    cfg, padded_len, flops_per_s = prefill.cfg, prefill.padded_len, rates.flops_per_s
    C, T, Bm = prefill.seq, padded_len // prefill.seq, prefill.batch // prefill.microbatches
    ticks, slots = prefill.microbatches + prefill.stages - 1, -(-cfg.L // prefill.stages)
    per_layer = bytes_per_layer(strategy, cfg, C, Bm, padded_len, prefill.itemsize)
    pair_s = 4.0 * Bm * (T / 2) ** 2 * cfg.N * cfg.H / flops_per_s
    comm_s = per_layer / link_rate(rates.link_bytes_per_s, strategy)
    if strategy == "ring":
        step_s = comm_s / max(C - 1, 1)  # one block's transfer, overlapped with 2 pairs
        attention_s = 3 * pair_s + (C - 1) * max(2 * pair_s, step_s)
    else:
        attention_s = (2 * C + 1) * pair_s + comm_s
    D, F, N, K, H = cfg.D, cfg.F, cfg.N, cfg.K, cfg.H
    matmul_s = 2.0 * (2 * D * N * H + 2 * D * K * H + 3 * D * F) * Bm * T / flops_per_s
    head_s = 2.0 * D * cfg.V * Bm / flops_per_s
    return {
        "strategy": strategy,
        "bytes_per_layer": per_layer,
        "bytes_per_device": per_layer * slots * ticks,
        "attention_s_per_layer": attention_s,
        "predicted_s": ticks * (slots * (matmul_s + attention_s) + head_s),
    }


def choose(cp: str, prefill: Prefill, rates: Rates) -> tuple[str, dict]:
    """(the strategy to run, {strategy: predict(...)} for each feasible one). `auto`
    takes the smaller predicted time (the ring on a tie, and always on one device)."""
    preds = {s: predict(s, prefill, rates) for s in feasible(prefill.cfg, prefill.seq)}
    if cp != "auto":
        check_cp(prefill.cfg, prefill.seq, cp)
        return cp, preds
    best = min(preds, key=lambda s: (preds[s]["predicted_s"], s != "ring"))
    return best, preds


def nominal(platform: str) -> tuple[dict, float]:
    """(link bytes/s, matmul FLOP/s) assumed for `platform` when none is measured."""
    return NOMINAL.get(platform, NOMINAL["cpu"])
