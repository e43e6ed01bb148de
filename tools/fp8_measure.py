"""Times the products of a decode step's few rows on FP8 weights, formulation by
formulation, over a stack of layers of a preset's dense widths (q, k, v, o, gate, up,
down), on this machine's default backend:

    python tools/fp8_measure.py --model 0.6B --rows 1,8,32

Formulations: `bfloat16` (the plain weights, the floor to beat), `dequantize` (the
weight dequantized in the product's operand: `model.fp8.dequantize`, the engine's),
`blocked` (each block of 128 inputs its own product on the float8 values, the scales on
its outputs: slower than `dequantize` on an H100, so not in the model), `w8a8` (the same
blocks with the activations quantized to float8 too, row by row, as transformers' and
vLLM's GPU kernels do: a product of two float8 operands). Prints, per (rows,
formulation), the median milliseconds of a pass through the layers, the weight bytes a
pass reads at the least and what that makes per second, and the largest error of a
layer's output against float32 on the dequantized weights (relative to its largest
value).
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from qwen3_spmd.model import fp8
from qwen3_spmd.model.config import PRESETS
from qwen3_spmd.run.bench.measure import timed

BLOCKS = fp8.FP8Blocks(128, 128)
# Each projection as a matrix [O, I] and whether D is its input (the scales' layout).
NAMES = ("q", "k", "v", "o", "gate", "up", "down")
AS = {n: "gate_fd" for n in ("q", "k", "v", "gate", "up")} | {"o": "down_df", "down": "down_df"}


def _shapes(cfg) -> dict[str, tuple[int, int]]:
    NH, KH = cfg.N * cfg.head_dim, cfg.K * cfg.head_dim
    D, F = cfg.D, cfg.intermediate_size
    return {
        "q": (NH, D),
        "k": (KH, D),
        "v": (KH, D),
        "o": (D, NH),
        "gate": (F, D),
        "up": (F, D),
        "down": (D, F),
    }


def _weights(cfg, layers: int):
    """{name: (float8 [L, O, I], scales as our layout holds them [L, ...])}."""
    rng = np.random.default_rng(0)
    out = {}
    for n, (O, I) in _shapes(cfg).items():
        w8s, scales = [], []
        for _ in range(layers):
            w = rng.standard_normal((O, I), dtype=np.float32) * 0.02
            w8, scale_inv = fp8.quantize_blocks(w, BLOCKS)
            w8s.append(w8)
            scales.append(fp8.expand_scales(scale_inv, (O, I), AS[n], BLOCKS))
        out[n] = (jnp.asarray(np.stack(w8s)), jnp.asarray(np.stack(scales)))
    return out


def _block_scales(scale, name: str, O: int):
    """Weight `name`'s scales as our layout holds them -> [O, I/b1]: one per output row
    and block of b1 inputs ([O, I/b1] already where D is the input; [ceil(O/b0), I], one
    a column, where D is the output)."""
    if fp8.D_AXIS[name][1] == "in":
        return scale
    return jnp.repeat(scale[:, :: BLOCKS.cols], BLOCKS.rows, 0)[:O]


def _blocked(h, w, scale, name):
    """h [R, I] times w float8 [O, I] -> [R, O] float32, each block of b1 inputs its own
    product on the float8 values converted to h's dtype (exact: e4m3 fits bfloat16) and
    the block's scales applied to that product's [R, O] outputs, so no dequantized weight
    is written. The scales as our layout holds them: [O, I/b1] (D the input) or
    [ceil(O/b0), I] one a column (D the output, constant on each block of b1 columns)."""
    (R, I), O, b1 = h.shape, w.shape[0], BLOCKS.cols
    J = I // b1
    s = _block_scales(scale, name, O)
    parts = jnp.einsum(
        "RJK,OJK->JRO",
        h.reshape(R, J, b1),
        w.reshape(O, J, b1).astype(h.dtype),
        preferred_element_type=jnp.float32,
    )
    return jnp.einsum("JRO,OJ->RO", parts, s)


def _w8a8(h, w, scale, name):
    """h [R, I] bfloat16 quantized to float8 per (row, block of 128), times w float8 [O, I]
    in one product of float8 operands per block -> [R, O] float32."""
    (R, I), O, b1 = h.shape, w.shape[0], BLOCKS.cols
    J = I // b1
    h3 = h.reshape(R, J, b1).astype(jnp.float32)
    hs = jnp.max(jnp.abs(h3), axis=-1) / fp8.FP8_MAX
    hs = jnp.where(hs > 0, hs, 1.0)
    h8 = (h3 / hs[..., None]).astype(fp8.FP8)
    s = _block_scales(scale, name, O)
    parts = jax.lax.dot_general(
        h8, w.reshape(O, J, b1), (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.float32
    )  # [J, R, O]
    return jnp.einsum("JRO,RJ,OJ->RO", parts, hs, s)


def product(how: str, h, w, scale, name):
    """h [R, I] bfloat16 times weight [O, I] -> [R, O] float32, by formulation `how`."""
    if how == "bfloat16":  # w: the dequantized weight, bfloat16
        return jnp.einsum("RI,OI->RO", h, w, preferred_element_type=jnp.float32)
    if how == "dequantize":
        wd = fp8.dequantize(w, scale, name, BLOCKS, h.dtype)
        return jnp.einsum("RI,OI->RO", h, wd, preferred_element_type=jnp.float32)
    if how == "blocked":
        return _blocked(h, w, scale, name)
    if how == "w8a8":
        return _w8a8(h, w, scale, name)
    if how == "float32":
        wd = fp8.dequantize(w, scale, name, BLOCKS, jnp.float32)
        return jnp.einsum("RI,OI->RO", h.astype(jnp.float32), wd, precision="highest")
    raise ValueError(how)


def layer(how: str, x, ws):
    """One layer's seven products on x [R, D] bfloat16 -> (the next x [R, D] bfloat16,
    the products' sum y [R, D] float32, which the error is taken on)."""

    def p(n, h):
        w, s = ws[n]
        return product(how, h.astype(jnp.bfloat16), w, s, AS[n])

    D = x.shape[1]
    q, k, v = p("q", x), p("k", x), p("v", x)
    mlp = p("down", jax.nn.silu(p("gate", x)) * p("up", x))
    y = p("o", q) + mlp + k[:, :D] + v[:, :D]
    return (x.astype(jnp.float32) + 1e-3 * y).astype(jnp.bfloat16), y


def stack(how: str):
    """A pass through the stacked layers, jitted: (x [R, D], weights) -> x."""
    body = lambda x, ws: (layer(how, x, ws)[0], None)  # noqa: E731
    return jax.jit(lambda x, weights: jax.lax.scan(body, x, weights)[0])


def _measure(how: str, x, ws, repeat: int):
    """(seconds of each timed pass through the layers, layer 0's y [R, D] float32)."""
    fn = stack(how)
    runs = timed(lambda: jax.block_until_ready(fn(x, ws)), repeat, 1)
    first = {n: (w[0], s[0]) for n, (w, s) in ws.items()}
    return runs, np.asarray(jax.jit(lambda x: layer(how, x, first)[1])(x))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="0.6B")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--layers", type=int, help="layers in the stack (default the preset's)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--how", default="bfloat16,dequantize,blocked,w8a8")
    args = ap.parse_args()
    cfg = PRESETS[args.model]
    L = args.layers or cfg.L
    weights = _weights(cfg, L)
    plain = {  # the bfloat16 floor: the same weights, dequantized once beforehand
        n: (fp8.dequantize(w, s, AS[n], BLOCKS, jnp.bfloat16), s) for n, (w, s) in weights.items()
    }
    print(f"{jax.devices()[0].device_kind}: {args.model} widths, {L} layers", flush=True)
    for R in map(int, args.rows.split(",")):
        x = jax.random.normal(jax.random.key(R), (R, cfg.D), jnp.bfloat16)
        _, ref = _measure("float32", x, weights, 0)
        for how in args.how.split(","):
            ws = plain if how == "bfloat16" else weights
            try:
                runs, got = _measure(how, x, ws, args.repeat)
            except Exception as err:  # noqa: BLE001 - a formulation the backend refuses
                print(f"rows {R:3d}  {how:10s} failed: {str(err).splitlines()[0][:160]}")
                continue
            ms = 1e3 * statistics.median(runs)
            nbytes = sum(w.nbytes + (0 if how == "bfloat16" else s.nbytes) for w, s in ws.values())
            err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
            print(
                f"rows {R:3d}  {how:10s} {ms:8.3f} ms  {nbytes / 1e6:7.1f} MB  "
                f"{nbytes / ms / 1e6:7.1f} GB/s  error {err:.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
