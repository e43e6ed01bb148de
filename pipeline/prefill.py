"""Prefill: GPipe over microbatches along `stage`, ring or Ulysses attention along `seq`.

One `shard_map` over the whole ('stage', 'seq') mesh. The batch is cut into M
microbatches of B / M requests; at tick t (M + S - 1 ticks) stage s runs microbatch
t - s (see pipeline.schedule):

    stage 0 embeds its tokens; any other stage takes the hidden state that stage s - 1
    sent at the previous tick; it runs its own layers (attention is ring or Ulysses
    attention over the `seq` devices, as `cp` says), writes its layers' K/V for the
    microbatch into its cache slots 0 .. P/C - 1, and sends its [B/M, P/C, D] share of the hidden state to stage s + 1.
    The last stage picks each request's last prompt token (wherever along `seq` it
    lies) and applies the final norm and lm_head to it alone.

Every device sends only its own 1/C of the hidden state between stages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from model.config import Qwen3Config
from pipeline.stage import StageCache, from_device, put_rows, rows, run_stage, shift, vary, when
from ring import (device_positions, fused_attention_available, heads_major, prompt_attention,
                  ring_attention, ulysses_attention, zigzag)
from sharding.specs import SPECS


CP_STRATEGIES = ("ring", "ulysses")


def build_prefill(cfg: Qwen3Config, graphdef: nnx.GraphDef, state_specs, mesh: Mesh,
                  microbatches: int, dtype, poison: bool = False, cp: str = "ring"):
    """The prefill program (not yet jitted).

    Returns f(state, real, tokens, positions, last_pos, cache_k, cache_v) ->
    (logits [B, V] float32, cache_k, cache_v), where
      state: model state, each layer leaf a tuple of per-slot [S, ...] sharded P('stage')
        (sharding.place.place_params);
      real: [L_pad] bool, False for identity slots;
      tokens, positions: [B, P] int32 in zigzag device order (position -1 = padding);
      last_pos: [B] int32, each request's last prompt position;
      cache_k, cache_v: [L_pad, B, K, S_cap, H] in `dtype`, the activations' dtype.
    With poison=True the hidden states of bubble slots are NaN, so a schedule that
    reads one shows NaN in the logits. cp: how attention splits along `seq`, "ring" or
    "ulysses" (ring.ulysses; C must divide N). Either writes each device's own tokens'
    K/V to its cache slots, so the cache is the same.
    """
    if cp not in CP_STRATEGIES:
        raise ValueError(f"cp {cp!r} is not one of {CP_STRATEGIES}")
    M = microbatches
    gated = mesh.shape["seq"] == 1  # no collectives inside the layers
    # One stage has no bubbles: no cond is needed around its layers.
    always_active = mesh.shape["stage"] == 1
    scale = cfg.head_dim**-0.5
    # Without a ring a device holds its prompts whole, in position order (zigzag with
    # C = 1 is the identity), and a GPU can run cuDNN's fused causal attention on them.
    fused = mesh.shape["seq"] == 1 and fused_attention_available(dtype, cfg.head_dim)
    # Ulysses holds whole prompts too (of its heads), in zigzag order: put in position
    # order, they run the same fused kernel.
    fused_ulysses = cp == "ulysses" and fused_attention_available(dtype, cfg.head_dim)

    def local(state, real, tokens, positions, last_pos, cache_k, cache_v):
        model = nnx.merge(graphdef, state)
        S, s = jax.lax.axis_size("stage"), jax.lax.axis_index("stage")
        B, T = tokens.shape
        Bm = B // M
        dtype = cache_k.dtype
        h0 = vary(jnp.full((Bm, T, cfg.D), jnp.nan if poison else 0.0, dtype))
        out0 = vary(jnp.zeros((B, cfg.V), jnp.float32))

        def tick(t, carry):
            h_in, cache, out = carry
            m = t - s
            active = (m >= 0) & (m < M)
            row0 = jnp.clip(m, 0, M - 1) * Bm
            tok, pos, last = rows(tokens, row0, Bm), rows(positions, row0, Bm), rows(last_pos, row0, Bm)
            x_in = vary(jnp.where(s == 0, model.embed(tok), h_in))

            # On a bubble every position reads as padding: the ring then skips every block.
            ring_pos = jnp.where(active, pos, -1)

            def attend_at(layer):
                def write(a, new):  # new [Bm, T, K, H]
                    new, at = heads_major(new), (layer, row0, 0, 0, 0)
                    old = jax.lax.dynamic_slice(a, at, (1, *new.shape))
                    return jax.lax.dynamic_update_slice(a, jnp.where(active, new[None].astype(dtype), old), at)

                def attend(q, k, v, c: StageCache):
                    c = StageCache(write(c.k, k), write(c.v, v))
                    if fused:
                        return prompt_attention(q, k, v, scale=scale), c
                    if cp == "ulysses":
                        C = mesh.shape["seq"]
                        order = device_positions(zigzag(T * C, C)) if fused_ulysses else None
                        o = ulysses_attention(q, k, v, ring_pos, ring_pos, axis_name="seq",
                                              scale=scale, fused_order=order)
                    else:
                        o, _ = ring_attention(q, k, v, ring_pos, ring_pos, axis_name="seq",
                                              scale=scale)
                    return o, c

                return attend

            def compute(x, c, gate):
                x, c = run_stage(model, cfg, real, x, pos, c, attend_at, gated, gate)
                return vary(x), c

            x, cache = when(active, compute, x_in, cache, gated, always_active)
            if poison:
                x = jnp.where(active, x, jnp.nan)
            # The last prompt token lies on one `seq` device; summing the selection over
            # the axis (zeros elsewhere) gives it to all of them.
            picked = jnp.where((pos == last[:, None])[..., None], x, jnp.zeros_like(x)).sum(axis=1)
            h_last = jax.lax.psum(picked, "seq")
            on_last = active & (s == S - 1)
            logits = jax.lax.cond(on_last, lambda h: vary(model.logits(h[:, None])[:, 0]),
                                  lambda h: vary(jnp.zeros((Bm, cfg.V), jnp.float32)), h_last)
            out = jnp.where(on_last, put_rows(out, logits, row0), out)
            return shift(x, cyclic=False), cache, out

        _, cache, out = jax.lax.fori_loop(0, M + S - 1, tick,
                                          (h0, StageCache(cache_k, cache_v), out0))
        return from_device(out, S - 1, 0), cache.k, cache.v

    return jax.shard_map(
        local, mesh=mesh,
        in_specs=(state_specs, SPECS.layers, SPECS.tokens_bt, SPECS.tokens_bt, SPECS.replicated,
                  SPECS.cache_lbksh, SPECS.cache_lbksh),
        out_specs=(P(), SPECS.cache_lbksh, SPECS.cache_lbksh))
