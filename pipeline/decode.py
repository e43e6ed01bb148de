"""Decode: round-robin groups along `stage`, sharded-KV attention along `seq`.

One `shard_map` over the whole ('stage', 'seq') mesh runs a chunk of decode steps for
every request. The batch is cut into G groups of B / G requests. With period
P = max(G, S), at tick t stage s runs group (t - s) mod P, when that is below G (see
pipeline.schedule). Per tick, one cyclic `ppermute` along `stage` carries the hidden
state [B/G, 1, D] from stage s to s + 1 and, from the last stage back to stage 0, the
tokens it just sampled; stage 0 files those and embeds them when the group comes
round again, P >= S ticks later. With G >= S no stage is ever idle in steady state;
a batch smaller than S runs with bubbles.

Inside a layer the new token's hidden state is the same on every `seq` device. Decode
step j writes its K/V on `seq` device j mod C at local slot P/C + j // C (P = padded
prompt length), so every device's cache fills at the same rate; attention runs over
each device's own slots and the partial results merge with LSE (ring.decode_attention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from model.config import Qwen3Config
from pipeline.sampling import Sampling, sample
from pipeline.stage import StageCache, from_device, put_rows, rows, run_stage, shift, vary, when
from ring import decode_attention, heads_major
from sharding.specs import SPECS


def build_decode(cfg: Qwen3Config, graphdef: nnx.GraphDef, state_specs, mesh: Mesh,
                 groups: int, steps: int, sampling: Sampling, with_logits: bool = True):
    """The decode program for a chunk of `steps` steps (not yet jitted).

    Returns f(state, real, cache_k, cache_v, slot_pos, tokens, positions, request,
    first_step, run_steps, limit, prompt_slots, seed) -> (new_tokens [B, steps] int32,
    first_logits [steps, V] float32, cache_k, cache_v), where
      slot_pos: [B, S_cap] int32 positions held by the cache slots, -1 = empty (must
        already list the slots this chunk writes: future positions are masked anyway);
      tokens: [B] int32 the token each request feeds at step `first_step`;
      positions: [B] int32 its position;
      request: [B] int32 request index (for sampling keys);
      first_step: decode step index j of the chunk's first step;
      run_steps: how many of the `steps` to run (the last chunk may need fewer);
      limit: steps j >= limit write nothing (past the request's last token);
      prompt_slots: P / C, the local slots the prompt took;
      seed: sampling seed.
    first_logits are request row 0's logits at each step (for --logits-out and checks);
    with_logits=False leaves them out ([0, V]), sparing a [steps, V] buffer per chunk.
    """
    G = groups
    gated = mesh.shape["seq"] == 1  # no collectives inside the layers
    # One stage has no bubbles (P = G): no cond is needed around its layers.
    always_active = mesh.shape["stage"] == 1
    scale = cfg.head_dim**-0.5

    def local(state, real, cache_k, cache_v, slot_pos, tokens, positions, request,
              first_step, run_steps, limit, prompt_slots, seed):
        model = nnx.merge(graphdef, state)
        S, s = jax.lax.axis_size("stage"), jax.lax.axis_index("stage")
        C, c = jax.lax.axis_size("seq"), jax.lax.axis_index("seq")
        B = tokens.shape[0]
        Bg = B // G
        _, _, K, _, H = cache_k.shape
        dtype = cache_k.dtype
        period = max(G, S)
        busy = run_steps * period

        def slot_of(u):
            """Schedule slot u = t - s -> (runs a group?, first row, step in chunk)."""
            runs = (u >= 0) & (u < busy) & (u % period < G)
            u = jnp.clip(u, 0, busy - 1)
            return runs, jnp.minimum(u % period, G - 1) * Bg, u // period

        def tick(t, carry):
            h_recv, tok_recv, tok_buf, cache, out_tok, out_logits = carry
            # Stage 0 files the tokens the last stage sampled at tick t - 1.
            got, got_row0, _ = slot_of(t - S)
            tok_buf = jnp.where(got, put_rows(tok_buf, tok_recv, got_row0), tok_buf)

            active, row0, i = slot_of(t - s)
            j = first_step + i
            q_pos = (rows(positions, row0, Bg) + i)[:, None]  # [Bg, 1]
            x_in = vary(jnp.where(s == 0, model.embed(rows(tok_buf, row0, Bg)[:, None]), h_recv))
            slot = prompt_slots + j // C
            mine = active & (c == j % C) & (j < limit)
            group_slot_pos = rows(slot_pos, row0, Bg)

            def attend_at(layer):
                def write(a, new):  # new [Bg, 1, K, H]
                    new, at = heads_major(new), (layer, row0, 0, slot, 0)
                    old = jax.lax.dynamic_slice(a, at, (1, Bg, K, 1, H))
                    return jax.lax.dynamic_update_slice(a, jnp.where(mine, new[None].astype(dtype), old), at)

                def attend(q, k, v, cache: StageCache):
                    cache = StageCache(write(cache.k, k), write(cache.v, v))
                    # Slots past this step's hold nothing the group can see yet.
                    o, _ = decode_attention(q, cache.k, cache.v, q_pos, group_slot_pos,
                                            axis_name="seq", scale=scale, at=(layer, row0),
                                            filled=slot + 1)
                    return o, cache

                return attend

            def compute(x, cache, gate):
                x, cache = run_stage(model, cfg, real, x, q_pos, cache, attend_at, gated, gate)
                return vary(x), cache

            x, cache = when(active, compute, x_in, cache, gated, always_active)

            def head(x):
                logits = model.logits(x)[:, 0]  # [Bg, V]
                tok = sample(logits, rows(request, row0, Bg), j + 1, seed, sampling)
                return vary(logits), vary(tok)

            def idle(x):
                return vary(jnp.zeros((Bg, cfg.V), jnp.float32)), vary(jnp.zeros((Bg,), jnp.int32))

            on_last = active & (s == S - 1)
            logits, tok = jax.lax.cond(on_last, head, idle, x)
            out_tok = jnp.where(on_last, jax.lax.dynamic_update_slice(out_tok, tok[:, None], (row0, i)),
                                out_tok)
            if with_logits:
                out_logits = jnp.where(on_last & (row0 == 0),
                                       put_rows(out_logits, logits[:1], i), out_logits)
            h_next, tok_next = shift((x, tok), cyclic=True)
            return h_next, tok_next, tok_buf, cache, out_tok, out_logits

        carry = (vary(jnp.zeros((Bg, 1, cfg.D), dtype)), vary(jnp.zeros((Bg,), jnp.int32)),
                 vary(tokens), StageCache(cache_k, cache_v),
                 vary(jnp.zeros((B, steps), jnp.int32)), vary(jnp.zeros((steps if with_logits else 0, cfg.V), jnp.float32)))
        ticks = (run_steps - 1) * period + G + S - 1
        _, _, _, cache, out_tok, out_logits = jax.lax.fori_loop(0, ticks, tick, carry)
        return (from_device(out_tok, S - 1, 0), from_device(out_logits, S - 1, 0),
                cache.k, cache.v)

    rep = SPECS.replicated
    return jax.shard_map(
        local, mesh=mesh,
        in_specs=(state_specs, SPECS.layers, SPECS.cache_lbksh, SPECS.cache_lbksh, SPECS.slots_bs,
                  rep, rep, rep, rep, rep, rep, rep, rep),
        out_specs=(P(), P(), SPECS.cache_lbksh, SPECS.cache_lbksh))
