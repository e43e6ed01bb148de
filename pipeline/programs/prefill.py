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

import dataclasses
import functools
from collections.abc import Callable
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
    Run,
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


@dataclasses.dataclass(frozen=True, order=True)
class PrefillShape:
    """A prefill program, its key (`pipeline.runtime.registry.Program`): B prompts
    (rows, padding included) padded to P_pad tokens; with_context: later chunks of a
    long prompt, attending to its cached earlier ones; prompt_logprobs: scoring every
    prompt token. Those are not among `ShapeRules.declared()`: few requests ask
    (evaluation harnesses), and a server would compile every prefill twice for them;
    the first to meet one compiles it. cp: how attention splits along `seq` ("ring" or
    "ulysses"); block: the prefix cache's layout (`layout.lay_out`), None without one;
    pooled: the program gives each prompt's last hidden state after the final norm
    [B, D] instead of its logits (a pooling runner's: embeddings and scores,
    `model.pooling`) (the runner's choices: defaults in the planner's shapes)."""

    B: int
    P_pad: int
    with_context: bool = False
    prompt_logprobs: bool = False
    cp: str = "ring"
    block: int | None = None
    pooled: bool = False

    def name(self) -> tuple:
        """Its static choices, readably (B and P_pad show in its arrays' shapes)."""
        name = ("prefill",) if self.cp == "ring" else ("prefill", self.cp)
        name += ("context",) if self.with_context else ()
        name += ("blocks", self.block) if self.block is not None else ()
        name += ("pooled",) if self.pooled else ()
        return name + (("prompt_logprobs",) if self.prompt_logprobs else ())

    def build(self, engine) -> Callable:
        """The program on `engine` (`pipeline.runtime.engine.Engine`: its model, mesh,
        microbatches, dtype and poison), not yet jitted."""
        e = engine
        return build_prefill(e.cfg, e.graphdef, e.state_specs, e.mesh, self, e.M, e.dtype, e.poison)

    def compile(self, engine, settings, announce: bool = True) -> None:
        """Compiles, unless compiled, this prefill as a scheduler's rounds run it
        (`settings`, a `pipeline.runtime.shapes.RoundSettings`: their cp strategy and
        layout) and its helpers (`Engine.compile_prefill`)."""
        program = dataclasses.replace(self, cp=settings.cp(self), block=settings.block)
        engine.compile_prefill(program, settings.pages, announce)


class PrefillInputs(NamedTuple):
    tokens: jax.Array  # [B, P_pad] int32, P('data', 'seq'): zigzag device order
    positions: jax.Array  # [B, P_pad] int32, P('data', 'seq'): their positions, -1 = padding
    last_pos: jax.Array  # [B] int32, P('data'): each request's last prompt position
    offset: jax.Array  # [] int32, P(): the first local cache slot the tokens' K/V go to
    #                    (0, or after the earlier chunks of a chunked prompt)
    # [B, P_pad] int32, P('data', 'seq'), zigzag order as tokens: each token's next prompt
    # token, -1 where none; only in a program with prompt_logprobs (else None).
    targets: jax.Array | None = None

    @classmethod
    def specs(cls, targets: bool = False) -> PrefillInputs:
        return cls(
            SPECS.tokens_bt,
            SPECS.tokens_bt,
            SPECS.rows,
            SPECS.replicated,
            SPECS.tokens_bt if targets else None,
        )


class PrefillCarry(NamedTuple):
    """The tick loop's state on one device."""

    h: jax.Array  # [B/M, P_pad/C, D]: the hidden state received from the previous stage
    cache: StageCache  # this stage's cache slice
    logits: jax.Array  # [B, V'/X] float32: the last prompt token's logits (last stage;
    #                    this device's block of the vocabulary, model.split); pooled:
    #                    [B, D] float32, its hidden state after the final norm
    prompt: PromptLogprobs | None = None  # [B, P_pad/C, ...] with prompt_logprobs: this
    #                    device's tokens' (last stage)


@dataclasses.dataclass(frozen=True)
class PrefillRun(Run):
    """One device's prefill as its ticks read it (`stage.Run`), with the engine's
    microbatches, poison and fused kernels."""

    microbatches: int
    poison: bool
    # Without a ring a device holds its prompts whole, in position order (zigzag with
    # C = 1 is the identity), and a GPU can run cuDNN's fused causal attention on them.
    fused: bool
    # Ulysses holds whole prompts too (of its heads), in zigzag order: put in position
    # order, they run the same fused kernel.
    fused_ulysses: bool

    @property
    def Bm(self) -> int:
        """Rows a microbatch."""
        return self.B // self.microbatches

    @property
    def V_local(self) -> int:
        """This device's vocabulary rows (`model.split`)."""
        return self.model.split.vocab(self.cfg) // self.model.split.size

    @property
    def width(self) -> int:
        """What the last stage keeps of each row's last token: its logits over this
        device's vocabulary rows, or (pooled) its whole normed hidden state, D."""
        return self.cfg.D if self.shape.pooled else self.V_local


# One shard_map program; the functions below it, read top to bottom, are the prefill
# schedule of the module's docstring: a tick, a stage's layers, their attention, the
# last stage's logits.
def build_prefill(
    cfg: Qwen3Config,
    graphdef: nnx.GraphDef,
    state_specs,
    mesh: Mesh,
    shape: PrefillShape,
    microbatches: int,
    dtype,
    poison: bool = False,
):
    """The prefill program for `shape`'s choices (not yet jitted), in `microbatches`.

    Returns f(weights: Weights, cache: KVCache, inputs: PrefillInputs) ->
    (logits [B, V] float32, or pooled the last tokens' normed hidden states [B, D]
    float32, KVCache). It writes k and v (in `dtype`, the activations' dtype) at each row's
    local slots `inputs.offset` .. + P_pad/C - 1 of every device, through its pages
    (`cache.table`), so `cache` is donated and updated in place; `cache.pos` and
    `cache.table` pass through.
    With poison=True the hidden states of bubble slots are NaN, so a schedule that
    reads one shows NaN in the logits. cp: how attention splits along `seq`, "ring" or
    "ulysses" (ring.ulysses; C must divide N). Either writes each device's own tokens'
    K/V to its cache slots, so the cache is the same. with_context: the tokens are a
    later chunk of their prompts, written from local slot `inputs.offset` on, and
    attend also to the cached slots below it (`ring.context_attention`, merged by LSE
    with the chunk's own attention, ring or Ulysses). block: the prompts are laid out
    block by block (`ring.zigzag_blocks`; the position order fused Ulysses restores).
    """
    if shape.cp not in CP_STRATEGIES:
        raise ValueError(f"cp {shape.cp!r} is not one of {CP_STRATEGIES}")
    fusable = fused_attention_available(dtype, cfg.head_dim)
    # (not with context: the merge needs the log-sum-exp, which the kernel keeps)
    fused = mesh.shape["seq"] == 1 and not shape.with_context and fusable
    fused_ulysses = shape.cp == "ulysses" and fusable

    def local(weights: Weights, cache: KVCache, inputs: PrefillInputs):
        model = nnx.merge(graphdef, weights.state)
        device = (model, cfg, weights, inputs, cache.pos, cache.table, shape)
        run = PrefillRun(*device, microbatches, poison, fused, fused_ulysses)
        ticks = microbatches + jax.lax.axis_size("stage") - 1
        tick = functools.partial(prefill_tick, run)
        carry = jax.lax.fori_loop(0, ticks, tick, first_carry(run, cache))
        return prefill_outputs(run, carry, cache)

    scored = shape.prompt_logprobs
    in_specs = (Weights.specs(state_specs), CACHE_SPECS, PrefillInputs.specs(scored))
    out_specs = (SPECS.rows, CACHE_SPECS)
    if scored:  # each seq device keeps its own tokens'
        along = SPECS.tokens_bt
        out_specs += (PromptLogprobs(along, along, P(*along, None), P(*along, None)),)
    mapped = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)

    def prefill(weights: Weights, cache: KVCache, inputs: PrefillInputs):
        return mapped(weights, cache, inputs)

    return prefill


def first_carry(run: PrefillRun, cache: KVCache) -> PrefillCarry:
    """The loop's state before tick 0: nothing received (NaN with poison), the stage's
    cache slice, the last tokens' logits [B, V'/X] zero, the prompt's scores zero."""
    B, T = run.inputs.tokens.shape
    fill = jnp.nan if run.poison else 0.0
    scores = prompt_logprob_shapes(B, T) if run.shape.prompt_logprobs else None
    return PrefillCarry(
        vary(jnp.full((run.Bm, T, run.cfg.D), fill, cache.k.dtype)),
        StageCache(cache.k, cache.v),
        vary(jnp.zeros((B, run.width), jnp.float32)),
        jax.tree.map(lambda a: vary(jnp.zeros(a.shape, a.dtype)), scores),
    )


def prefill_outputs(run: PrefillRun, carry: PrefillCarry, cache: KVCache) -> tuple:
    """What the program returns: the last tokens' logits [B, V] from the last stage
    (the vocabulary gathered over `tensor`; pooled: their hidden states [B, D], whole on
    every device), the cache, and with prompt_logprobs the prompt's scores (each `seq`
    device its own tokens')."""
    stages = jax.lax.axis_size("stage")
    logits = carry.logits
    if not run.shape.pooled:
        logits = gather_vocab(logits, run.model.split, run.cfg.V)
    out = (from_device(logits, stages - 1, 0), cache._replace(k=carry.cache.k, v=carry.cache.v))
    if run.shape.prompt_logprobs:
        out += (jax.tree.map(from_last_stage, carry.prompt),)
    return out


def prefill_tick(run: PrefillRun, t, carry: PrefillCarry) -> PrefillCarry:
    """Tick t on this device: stage s runs microbatch m = t - s (if there is one) through
    its layers, x [Bm, P_pad/C, D] (stage 0 embeds its tokens; the others take what
    stage s - 1 sent); the last stage keeps the logits of each row's last prompt token
    (and the prompt's scores); hidden states move one stage on."""
    s, inputs, Bm = jax.lax.axis_index("stage"), run.inputs, run.Bm
    m = t - s
    active = (m >= 0) & (m < run.microbatches)
    row0 = jnp.clip(m, 0, run.microbatches - 1) * Bm
    tok, pos = rows(inputs.tokens, row0, Bm), rows(inputs.positions, row0, Bm)
    x_in = vary(jnp.where(s == 0, run.model.embed(tok), carry.h))
    x, kv = prefill_stage(run, x_in, carry.cache, active, row0, pos)
    if run.poison:
        x = jnp.where(active, x, jnp.nan)
    logits = last_token_logits(run, x, active, row0, pos, carry.logits)
    prompt = carry.prompt
    if run.shape.prompt_logprobs:
        prompt = score_prompt(run, x, active, row0, prompt)
    return PrefillCarry(shift(x, cyclic=False), kv, logits, prompt)


def prefill_stage(run: PrefillRun, x, kv: StageCache, active, row0, pos):
    """This stage's layers on microbatch rows row0 .., x [Bm, T, D] at positions pos
    [Bm, T] (-1: padding) -> (x, kv): each layer writes the tokens' K/V at local slots
    from `inputs.offset` and attends (`prefill_attention`). Where not `active` (a
    bubble) x and the cache stay as they were."""
    # On a bubble every position reads as padding: the ring then skips every block.
    ring_pos = jnp.where(active, pos, -1)

    def attend_at(layer):
        at_layer = functools.partial(prefill_attention, run, row0, ring_pos, layer=layer)
        table = rows(run.table, row0, run.Bm)
        return cache_attend(layer, table, run.inputs.offset, active, at_layer)

    def compute(x, kv, gate):
        x, kv = run_stage(
            run.model, run.cfg, run.weights.real, x, pos, kv, attend_at, run.gated, gate
        )
        return vary(x), kv

    return when(active, compute, x, kv, run.gated, run.always_active)


def prefill_attention(run: PrefillRun, row0, pos, q, k, v, kv: StageCache, layer=None):
    """The microbatch's attention, q [Bm, T, N, H], k, v [Bm, T, K, H] at positions pos
    [Bm, T] (this device's share; -1: padding) -> o [Bm, T, N, H]: the ring's or
    Ulysses' over the prompt's `seq` shares (fused where it can), and with_context
    merged by LSE with the attention to the earlier chunks' cached slots (kv, the
    stage's cache, below `inputs.offset`)."""
    scale, T = run.cfg.head_dim**-0.5, run.inputs.tokens.shape[1]
    if run.shape.with_context:
        args = (q, k, v, pos, pos)
        o, lse = (
            ulysses_attention(*args, axis_name="seq", scale=scale, with_lse=True)
            if run.shape.cp == "ulysses"
            else ring_attention(*args, axis_name="seq", scale=scale)
        )
        o2, lse2 = context_attention(
            q,
            kv.k,
            kv.v,
            pos,
            rows(run.slot_pos, row0, run.Bm),
            table=rows(run.table, row0, run.Bm),
            axis_name="seq",
            scale=scale,
            at=(layer,),
            filled=run.inputs.offset,
        )
        return merge(o, lse, o2, lse2)[0]
    if run.fused:
        return prompt_attention(q, k, v, scale=scale)
    if run.shape.cp == "ulysses":
        C = jax.lax.axis_size("seq")
        block = run.shape.block
        part = zigzag(T * C, C) if block is None else zigzag_blocks(T * C, C, block)
        order = device_positions(part) if run.fused_ulysses else None
        return ulysses_attention(q, k, v, pos, pos, axis_name="seq", scale=scale, fused_order=order)
    return ring_attention(q, k, v, pos, pos, axis_name="seq", scale=scale)[0]


def last_token_logits(run: PrefillRun, x, active, row0, pos, buf):
    """`buf` [B, V'/X] with the microbatch's rows' logits (this device's vocabulary
    block; pooled: buf [B, D], their hidden states after the final norm) at each row's
    last prompt token written in, where this is the last stage on an active tick; x
    [Bm, T, D] at positions pos [Bm, T]."""
    last = rows(run.inputs.last_pos, row0, run.Bm)
    # The last prompt token lies on one `seq` device; summing the selection over the
    # axis (zeros elsewhere) gives it to all of them.
    picked = jnp.where((pos == last[:, None])[..., None], x, jnp.zeros_like(x)).sum(axis=1)
    h_last = jax.lax.psum(picked, "seq")
    if run.shape.pooled:
        last_stage = lambda h: run.model.norm(h).astype(jnp.float32)
    else:
        last_stage = lambda h: run.model.logits(h[:, None])[:, 0]
    on_last, logits = on_last_stage(
        active, last_stage, jax.ShapeDtypeStruct((run.Bm, run.width), jnp.float32), h_last
    )
    return jnp.where(on_last, put_rows(buf, logits, row0), buf)


def score_prompt(run: PrefillRun, x, active, row0, prompt: PromptLogprobs) -> PromptLogprobs:
    """`prompt` with the microbatch's scores written in on the last stage: each of this
    device's tokens' next-token log-probability and top ones (`sampling.split_logprobs`),
    from x [Bm, T, D]."""
    Bm, T = x.shape[:2]
    targets = rows(run.inputs.targets, row0, Bm)
    on_last, lp = on_last_stage(
        active,
        lambda x: split_logprobs(run.model.logits(x), targets, run.model.split),
        prompt_logprob_shapes(Bm, T),
        x,
    )
    return jax.tree.map(
        lambda buf, new: jnp.where(on_last, put_rows(buf, new, row0), buf), prompt, lp
    )
