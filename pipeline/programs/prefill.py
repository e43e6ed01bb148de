"""Prefill: GPipe over microbatches along `stage`, ring or Ulysses attention along `seq`.

One `shard_map` over the whole ('stage', 'seq', 'tensor') mesh. The batch is cut into M
microbatches of B / M requests; at tick t (M + stages - 1 ticks) stage s runs
microbatch t - s (see pipeline.programs.schedule):

    stage 0 embeds its tokens; any other stage takes the hidden state that stage s - 1
    sent at the previous tick; it runs its own layers (attention is ring or Ulysses
    attention over the `seq` devices, as `cp` says), writes its layers' K/V for the microbatch into its cache slots
    0 .. P_pad/C - 1, and sends its [B/M, P_pad/C, D] share of the hidden state to
    stage s + 1. The last stage picks each request's last prompt token (wherever along
    `seq` it lies) and applies the final norm and lm_head to it alone. A program built
    with prompt_logprobs=True also applies them to every token of the microbatch, each
    `seq` device to its own, and keeps per token the log-probability of the next prompt
    token and the top ones (`sampling.split_logprobs`, a vocabulary-parallel
    log-softmax under `tensor`): one microbatch's [B/M, P_pad/C, V'/X] logits at a time,
    never the vocabulary on the host.

Every device sends only its own 1/C of the hidden state between stages.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from qwen3_spmd.model.cache import KVCache
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.pipeline.programs.sampling import (
    PromptLogprobs,
    gather_vocab,
    prompt_logprob_shapes,
    split_logprobs,
)
from qwen3_spmd.pipeline.programs.stage import (
    CACHE_SPECS,
    StageCache,
    Weights,
    cache_attend,
    from_device,
    from_last_stage,
    on_last_stage,
    put_rows,
    rows,
    run_stage,
    shift,
    vary,
    when,
)
from qwen3_spmd.ring import (
    context_attention,
    device_positions,
    fused_attention_available,
    prompt_attention,
    ring_attention,
    ulysses_attention,
    zigzag,
    zigzag_blocks,
)
from qwen3_spmd.ring.merge import merge
from qwen3_spmd.sharding.specs import SPECS

CP_STRATEGIES = ("ring", "ulysses")


class PrefillInputs(NamedTuple):
    tokens: jax.Array  # [B, P_pad] int32, P(None, 'seq'): zigzag device order
    positions: jax.Array  # [B, P_pad] int32, P(None, 'seq'): their positions, -1 = padding
    last_pos: jax.Array  # [B] int32, P(): each request's last prompt position
    offset: jax.Array  # [] int32, P(): the first local cache slot the tokens' K/V go to
    #                    (0, or after the earlier chunks of a chunked prompt)
    # [B, P_pad] int32, P(None, 'seq'), zigzag order as tokens: each token's next prompt
    # token, -1 where none; only in a program with prompt_logprobs (else None).
    targets: jax.Array | None = None

    @classmethod
    def specs(cls, targets: bool = False) -> PrefillInputs:
        return cls(
            SPECS.tokens_bt,
            SPECS.tokens_bt,
            SPECS.replicated,
            SPECS.replicated,
            SPECS.tokens_bt if targets else None,
        )


class PrefillCarry(NamedTuple):
    """The tick loop's state on one device."""

    h: jax.Array  # [B/M, P_pad/C, D]: the hidden state received from the previous stage
    cache: StageCache  # this stage's cache slice
    logits: jax.Array  # [B, V'/X] float32: the last prompt token's logits (last stage;
    #                    this device's block of the vocabulary, model.split)
    prompt: PromptLogprobs | None = None  # [B, P_pad/C, ...] with prompt_logprobs: this
    #                    device's tokens' (last stage)


# One shard_map program, read top to bottom as the prefill schedule of the module's
# docstring: its closures (the tick, the microbatch slicing) share the mesh sizes and
# specs set here.
def build_prefill(
    cfg: Qwen3Config,
    graphdef: nnx.GraphDef,
    state_specs,
    mesh: Mesh,
    microbatches: int,
    dtype,
    poison: bool = False,
    cp: str = "ring",
    with_context: bool = False,
    block: int | None = None,
    prompt_logprobs: bool = False,
):
    """The prefill program (not yet jitted).

    Returns f(weights: Weights, cache: KVCache, inputs: PrefillInputs) ->
    (logits [B, V] float32, KVCache). It writes k and v [L_pad, B, K, S_cap, H] (in
    `dtype`, the activations' dtype) at slots 0 .. P_pad/C - 1 of every device, so
    `cache` is donated and updated in place; `cache.pos` passes through.
    With poison=True the hidden states of bubble slots are NaN, so a schedule that
    reads one shows NaN in the logits. cp: how attention splits along `seq`, "ring" or
    "ulysses" (ring.ulysses; C must divide N). Either writes each device's own tokens'
    K/V to its cache slots, so the cache is the same. with_context: the tokens are a
    later chunk of their prompts, written from local slot `inputs.offset` on, and
    attend also to the cached slots below it (`ring.context_attention`, merged by LSE
    with the chunk's own attention, ring or Ulysses). block: the prompts are laid out
    block by block (`ring.zigzag_blocks`; the position order fused Ulysses restores).
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
    fused = (
        mesh.shape["seq"] == 1
        and not with_context  # the merge needs the log-sum-exp, which the kernel keeps
        and fused_attention_available(dtype, cfg.head_dim)
    )
    # Ulysses holds whole prompts too (of its heads), in zigzag order: put in position
    # order, they run the same fused kernel.
    fused_ulysses = cp == "ulysses" and fused_attention_available(dtype, cfg.head_dim)

    def local(weights: Weights, cache: KVCache, inputs: PrefillInputs):
        model = nnx.merge(graphdef, weights.state)
        stages, s = jax.lax.axis_size("stage"), jax.lax.axis_index("stage")
        B, T = inputs.tokens.shape
        Bm = B // M
        V_local = model.split.vocab(cfg) // model.split.size  # this device's vocabulary rows

        def tick(t, carry: PrefillCarry) -> PrefillCarry:
            m = t - s
            active = (m >= 0) & (m < M)
            row0 = jnp.clip(m, 0, M - 1) * Bm
            tok, pos = rows(inputs.tokens, row0, Bm), rows(inputs.positions, row0, Bm)
            last = rows(inputs.last_pos, row0, Bm)
            x_in = vary(jnp.where(s == 0, model.embed(tok), carry.h))

            # On a bubble every position reads as padding: the ring then skips every block.
            ring_pos = jnp.where(active, pos, -1)

            def context(layer, q, o, lse, kv):
                """(o, lse) over the chunk, merged with the earlier chunks' cache."""
                o2, lse2 = context_attention(
                    q,
                    kv.k,
                    kv.v,
                    ring_pos,
                    rows(cache.pos, row0, Bm),
                    axis_name="seq",
                    scale=scale,
                    at=(layer, row0),
                    filled=inputs.offset,
                )
                return merge(o, lse, o2, lse2)[0]

            def attention(q, k, v, kv, layer=None):
                if with_context:
                    args = (q, k, v, ring_pos, ring_pos)
                    o, lse = (
                        ulysses_attention(*args, axis_name="seq", scale=scale, with_lse=True)
                        if cp == "ulysses"
                        else ring_attention(*args, axis_name="seq", scale=scale)
                    )
                    return context(layer, q, o, lse, kv)
                if fused:
                    return prompt_attention(q, k, v, scale=scale)
                if cp == "ulysses":
                    C = mesh.shape["seq"]
                    part = zigzag(T * C, C) if block is None else zigzag_blocks(T * C, C, block)
                    order = device_positions(part) if fused_ulysses else None
                    return ulysses_attention(
                        q, k, v, ring_pos, ring_pos, axis_name="seq", scale=scale, fused_order=order
                    )
                return ring_attention(q, k, v, ring_pos, ring_pos, axis_name="seq", scale=scale)[0]

            def attend_at(layer):
                at_layer = functools.partial(attention, layer=layer)
                return cache_attend(layer, row0, inputs.offset, active, at_layer)

            def compute(x, kv, gate):
                x, kv = run_stage(model, cfg, weights.real, x, pos, kv, attend_at, gated, gate)
                return vary(x), kv

            x, kv = when(active, compute, x_in, carry.cache, gated, always_active)
            if poison:
                x = jnp.where(active, x, jnp.nan)
            # The last prompt token lies on one `seq` device; summing the selection over
            # the axis (zeros elsewhere) gives it to all of them.
            picked = jnp.where((pos == last[:, None])[..., None], x, jnp.zeros_like(x)).sum(axis=1)
            h_last = jax.lax.psum(picked, "seq")
            on_last, logits = on_last_stage(
                active,
                lambda h: model.logits(h[:, None])[:, 0],
                jax.ShapeDtypeStruct((Bm, V_local), jnp.float32),
                h_last,
            )
            logits = jnp.where(on_last, put_rows(carry.logits, logits, row0), carry.logits)
            prompt = carry.prompt
            if prompt_logprobs:
                targets = rows(inputs.targets, row0, Bm)
                on_last, lp = on_last_stage(
                    active,
                    lambda x: split_logprobs(model.logits(x), targets, model.split),
                    prompt_logprob_shapes(Bm, T),
                    x,
                )
                prompt = jax.tree.map(
                    lambda buf, new: jnp.where(on_last, put_rows(buf, new, row0), buf), prompt, lp
                )
            return PrefillCarry(shift(x, cyclic=False), kv, logits, prompt)

        carry = PrefillCarry(
            vary(jnp.full((Bm, T, cfg.D), jnp.nan if poison else 0.0, cache.k.dtype)),
            StageCache(cache.k, cache.v),
            vary(jnp.zeros((B, V_local), jnp.float32)),
            jax.tree.map(lambda a: vary(jnp.zeros(a.shape, a.dtype)), prompt_logprob_shapes(B, T))
            if prompt_logprobs
            else None,
        )
        carry = jax.lax.fori_loop(0, M + stages - 1, tick, carry)
        out = (
            from_device(gather_vocab(carry.logits, model.split, cfg.V), stages - 1, 0),
            KVCache(carry.cache.k, carry.cache.v, cache.pos),
        )
        if prompt_logprobs:  # each seq device keeps its own tokens'
            out += (jax.tree.map(from_last_stage, carry.prompt),)
        return out

    out_specs = (P(), CACHE_SPECS)
    if prompt_logprobs:
        along = SPECS.tokens_bt
        out_specs += (PromptLogprobs(along, along, P(*along, None), P(*along, None)),)
    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(Weights.specs(state_specs), CACHE_SPECS, PrefillInputs.specs(prompt_logprobs)),
        out_specs=out_specs,
    )

    def prefill(weights: Weights, cache: KVCache, inputs: PrefillInputs):
        return mapped(weights, cache, inputs)

    return prefill
