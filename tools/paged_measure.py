"""Times decode attention over a paged KV cache, kernel by kernel, at a preset's head
shapes on this machine's default backend:

    python tools/paged_measure.py --model 0.6B --batches 8,32 --context 2048

`gather` is the engine's (`ring.decode_attention` on one `seq` device: each row's
pages gathered through its block table, then the two products); `pallas` is jax's
Pallas GPU kernel (`jax.experimental.pallas.ops.gpu.paged_attention`, pages K-major
[K, pages, bs, H]: a layout the engine's pool [pages, K, bs, H] would have to take).
Prints, per (batch, kernel), the median milliseconds of one layer's attention, the
cache bytes it must read and what that makes per second, and its largest difference
from `gather`'s output.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from qwen3_spmd.model.config import PRESETS
from qwen3_spmd.ring import decode_attention
from qwen3_spmd.run.bench.measure import timed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="0.6B")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--context", type=int, default=2048, help="tokens in each row's cache")
    ap.add_argument("--page", type=int, default=16, help="tokens a page")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    cfg, dt, bs, T = PRESETS[args.model], jnp.dtype(args.dtype), args.page, args.context
    N, K, H = cfg.N, cfg.K, cfg.head_dim
    n = -(-T // bs)
    print(f"{jax.devices()[0].device_kind}: {args.model} heads, {T} tokens, pages of {bs}")
    for B in map(int, args.batches.split(",")):
        pages = B * n + 7
        key = jax.random.split(jax.random.key(B), 3)
        k_pool = jax.random.normal(key[0], (pages, K, bs, H), dt)
        v_pool = jax.random.normal(key[1], (pages, K, bs, H), dt)
        q = jax.random.normal(key[2], (B, 1, N, H), dt)
        table = jnp.asarray(
            np.random.default_rng(B).permutation(pages)[: B * n].reshape(B, n), jnp.int32
        )
        slot_pos = jnp.broadcast_to(
            jnp.where(jnp.arange(n * bs) < T, jnp.arange(n * bs), -1), (B, n * bs)
        )
        q_pos = jnp.full((B, 1), T, jnp.int32)
        lengths = jnp.full((B,), T, jnp.int32)
        nbytes = 2 * B * T * K * H * dt.itemsize

        def gather(q, k_pool, v_pool, table, slot_pos, q_pos):
            o, _ = decode_attention(
                q, k_pool, v_pool, q_pos, slot_pos, table=table, axis_name=None, scale=H**-0.5
            )
            return o[:, 0]

        kernels = {"gather": (jax.jit(gather), (q, k_pool, v_pool, table, slot_pos, q_pos))}
        try:
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

            def pallas(q, k_pages, v_pages, table, lengths):
                return paged_attention(q[:, 0] * H**-0.5, k_pages, v_pages, table, lengths)

            k_pages, v_pages = (jnp.swapaxes(x, 0, 1) for x in (k_pool, v_pool))
            kernels["pallas"] = (jax.jit(pallas), (q, k_pages, v_pages, table, lengths))
        except ImportError as err:
            print(f"pallas: {err}")
        want = None
        for name, (fn, fargs) in kernels.items():
            try:
                runs = timed(
                    lambda fn=fn, fargs=fargs: jax.block_until_ready(fn(*fargs)), args.repeat, 1
                )
                out = np.asarray(fn(*fargs), np.float32)
            except Exception as err:  # noqa: BLE001 - a kernel the backend refuses
                print(f"batch {B:3d}  {name:8s} failed: {str(err).splitlines()[0][:160]}")
                continue
            want = out if want is None else want
            ms = 1e3 * statistics.median(runs)
            print(
                f"batch {B:3d}  {name:8s} {ms:8.3f} ms  {nbytes / 1e6:7.1f} MB  "
                f"{nbytes / ms / 1e6:7.1f} GB/s  max diff {np.max(np.abs(out - want)):.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
