"""Decode: round-robin groups along `stage`, sharded-KV attention along `seq`.

One `shard_map` over the whole ('stage', 'seq', 'tensor') mesh runs a chunk of decode steps for
every request. The batch is cut into `groups` groups of B / groups requests. At tick t
stage s runs group (t - s) mod period, when that is a group (`pipeline.programs.schedule`: the
period is max(groups, stages)). Per tick, one cyclic `ppermute` along `stage` carries
the hidden state [B/groups, 1, D] from stage s to s + 1 and, from the last stage back to
stage 0, the tokens it just sampled; stage 0 files those and embeds them when the group
comes round again, a period >= stages ticks later. With groups >= stages no stage is
ever idle in steady state; a batch smaller than the stage count runs with bubbles.

Inside a layer the new token's hidden state is the same on every `seq` device. Decode
step j writes its K/V where `ring.decode_slot` puts it (device j mod C, after the
prompt's slots), so every device's cache fills at the same rate; attention runs over
each device's own slots and the partial results merge with LSE (ring.decode_attention).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from qwen3_spmd.model.cache import KVCache
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.pipeline.programs.sampling import (
    TOP_LOGPROBS,
    Chosen,
    RowSampling,
    Sampling,
    TokenLogprobs,
    choose_tokens,
)
from qwen3_spmd.pipeline.programs.schedule import decode_period, decode_ticks
from qwen3_spmd.pipeline.programs.stage import (
    CACHE_SPECS,
    Run,
    StageCache,
    Weights,
    cache_attend,
    chunk_slot,
    from_device,
    on_last_stage,
    put_rows,
    rows,
    run_stage,
    seq_axis,
    shift,
    vary,
    when,
)
from qwen3_spmd.ring import decode_attention, decode_slot
from qwen3_spmd.sharding.specs import SPECS


@dataclasses.dataclass(frozen=True, order=True)
class DecodeShape:
    """A decode chunk's program, its key (`pipeline.runtime.registry.Program`): over the
    first `rows` rows, greedy only or sampled where a row asks to, with or without
    log-probabilities; constrained: with each row's allowed tokens (a structured
    output's grammar: a chunk of one step). groups, steps: the rows' decode groups and
    the chunk's steps (the engine's: None in the planner's shapes); with_logits: row 0's
    logits at each step. Constrained shapes are not among `ShapeRules.declared()` (a
    scheduler without a tokenizer never meets them): a server that has one compiles
    them last, in the background (`ShapeRules.constrained_decodes`), and a round that
    meets one before that compiles it."""

    rows: int
    sampled: bool
    logprobs: bool
    constrained: bool = False
    groups: int | None = None
    steps: int | None = None
    with_logits: bool = False

    def name(self) -> tuple:
        """Its static choices, readably (rows show in its arrays' shapes)."""
        name = ("decode", self.groups, self.steps, "sampled" if self.sampled else "greedy")
        name += (self.with_logits,) + (("logprobs",) if self.logprobs else ())
        return name + (("allowed",) if self.constrained else ())

    def build(self, engine) -> Callable:
        """The program on `engine` (`pipeline.runtime.engine.Engine`), not yet jitted."""
        return build_decode(engine.cfg, engine.graphdef, engine.state_specs, engine.mesh, self)

    def compile(self, engine, settings, announce: bool = True) -> None:
        """Compiles, unless compiled, this chunk as a scheduler's rounds run it
        (`settings`, a `pipeline.runtime.shapes.RoundSettings`: their groups), of the
        engine's steps, without logits (`Engine.compile_decode`)."""
        program = dataclasses.replace(self, groups=settings.groups, steps=engine.chunk)
        engine.compile_decode(program, settings.cache_rows, settings.pages, announce)


class DecodeInputs(NamedTuple):
    """What a decode chunk starts from, besides the weights and the cache. Every field but
    run_steps (replicated, P()) is one per row, split over `data` with the rows: each row
    is a request at its own step (continuous batching), and a new per-row field is one
    line here."""

    tokens: jax.Array  # [B] int32: the token each row feeds at its step `step`
    positions: jax.Array  # [B] int32: its position
    step: jax.Array  # [B] int32: the row's decode step index j at the chunk's first step
    limit: jax.Array  # [B] int32: steps j >= limit write nothing (0: an empty row)
    prompt_slots: jax.Array  # [B] int32: the local slots the row's prompt took (P_pad / C)
    sampling: RowSampling  # [B] each: the row's sampling parameters and key
    run_steps: jax.Array  # [] int32: steps of the chunk that run (the last chunk may need fewer)
    # [B, ceil(V/32)] int32: each row's allowed next tokens as packed bits
    # (`sampling.only_allowed`; all ones for a row under no constraint), for a chunk of
    # one step; None (no input at all, today's program) when no row is constrained.
    allowed: jax.Array | None = None

    @classmethod
    def empty(cls, rows: int) -> DecodeInputs:
        """A chunk's inputs over `rows` empty rows (no step writes), as host arrays: the
        shapes a decode program is lowered for ahead (`RowBook.decode_inputs` of an empty
        book gives the same)."""
        zeros = lambda: np.zeros(rows, np.int32)  # noqa: E731
        return cls(
            tokens=zeros(),
            positions=zeros(),
            step=zeros(),
            limit=zeros(),
            prompt_slots=zeros(),
            sampling=RowSampling.stack([(Sampling(), 0, 0)] * rows),
            run_steps=np.int32(0),
        )

    @classmethod
    def specs(cls, constrained: bool = False) -> DecodeInputs:
        fields = {name: SPECS.rows for name in cls._fields}
        return cls(
            **{
                **fields,
                "sampling": RowSampling(*[SPECS.rows] * len(RowSampling._fields)),
                "run_steps": SPECS.replicated,
                "allowed": SPECS.rows if constrained else None,
            }
        )


class DecodeOutputs(NamedTuple):
    tokens: jax.Array  # [B, steps] int32: each row's new tokens
    # [D steps, V] float32: each replica's row 0's logits at each step ([0, V] without);
    # the first `steps` are row 0's
    logits: jax.Array
    # Each new token's TokenLogprobs, fields [B, steps] and [B, steps, TOP_LOGPROBS]
    # (steps 0 without `logprobs`).
    logprobs: TokenLogprobs


class DecodeCarry(NamedTuple):
    """The tick loop's state on one device."""

    h: jax.Array  # [B/groups, 1, D]: the hidden state received from the previous stage
    tok_recv: jax.Array  # [B/groups] int32: tokens received from the last stage
    tok_buf: jax.Array  # [B] int32: the token each row feeds next (stage 0 files them)
    cache: StageCache  # this stage's cache slice
    out: DecodeOutputs  # filled by the last stage


# One shard_map program; the functions below it, read top to bottom, are the decode
# schedule of the module's docstring: a tick, a stage's layers, the sampling head.
def tick_through(run: Run, cache: KVCache, steps, tick, carry):
    """The decode schedule's ticks for `steps` steps a group (`schedule.decode_ticks`),
    each `tick(run, t, carry)` from `carry` (a carry with `out` and `cache`): (the last
    stage's `out`, the cache with the K/V the ticks wrote and `cache.pos` as given)."""
    stages = jax.lax.axis_size("stage")
    ticks = decode_ticks(run.shape.groups, stages, steps)
    carry = jax.lax.fori_loop(0, ticks, functools.partial(tick, run), carry)
    out = jax.tree.map(lambda x: from_device(x, stages - 1, 0), carry.out)
    return out, cache._replace(k=carry.cache.k, v=carry.cache.v)


def build_decode(cfg: Qwen3Config, graphdef: nnx.GraphDef, state_specs, mesh: Mesh, shape):
    """The decode program for a chunk of `shape.steps` steps in `shape.groups` groups
    (`DecodeShape`; not yet jitted).

    Returns f(weights: Weights, cache: KVCache, inputs: DecodeInputs) ->
    (DecodeOutputs, KVCache). `cache.pos` must already list the slots this chunk
    writes (positions ahead of a query are masked anyway); the program writes k and v
    only, so `cache` is donated and updated in place. sampled=False promises every row
    is greedy (no sort of the vocabulary compiled); sampled=True samples where a row
    asks to (a chunk whose rows are all greedy skips the sort, and the vocabulary's
    gather over `tensor`, at run time). with_logits=False leaves row 0's per-step
    logits out, sparing a [steps, V] buffer per chunk. logprobs=True also reports each
    new token's log-probability and the top TOP_LOGPROBS (`sampling.token_logprobs`).
    constrained=True: `inputs.allowed` masks each row's choice (a structured output's
    grammar); its bits are those of the row's next token, so such a chunk runs one step
    (`run_steps` 1: the host advances the grammar between tokens). The whole mask is
    on every device (a row's is V/8 bytes); under `tensor` each device reads its
    vocabulary block's bits.
    """

    def local(weights: Weights, cache: KVCache, inputs: DecodeInputs):
        run = Run(
            nnx.merge(graphdef, weights.state), cfg, weights, inputs, cache.pos, cache.table, shape
        )
        return tick_through(run, cache, inputs.run_steps, decode_tick, first_carry(run, cache))

    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(Weights.specs(state_specs), CACHE_SPECS, DecodeInputs.specs(shape.constrained)),
        out_specs=(DecodeOutputs(*[SPECS.rows] * 2, TokenLogprobs(*[SPECS.rows] * 3)), CACHE_SPECS),
    )

    def decode(weights: Weights, cache: KVCache, inputs: DecodeInputs):
        return mapped(weights, cache, inputs)

    return decode


def slot_of(run: Run, u):
    """Schedule slot u = t - s -> (runs a group?, its first row, its step in the chunk)
    (`stage.chunk_slot`)."""
    groups = run.shape.groups
    period = decode_period(groups, jax.lax.axis_size("stage"))
    return chunk_slot(u, run.inputs.run_steps * period, period, groups, run.B // groups)


def first_carry(run: Run, cache: KVCache) -> DecodeCarry:
    """The loop's state before tick 0: nothing received, each row's token to feed
    [B], the stage's cache slice, the outputs zero (tokens [B, steps], row 0's logits
    [steps, V] where asked, log-probabilities [B, steps, ...] where asked)."""
    B, Bg, shape = run.B, run.B // run.shape.groups, run.shape
    lp_steps = shape.steps if shape.logprobs else 0
    out = DecodeOutputs(
        vary(jnp.zeros((B, shape.steps), jnp.int32)),
        vary(jnp.zeros((shape.steps if shape.with_logits else 0, run.cfg.V), jnp.float32)),
        jax.tree.map(
            lambda x: vary(jnp.zeros((B, lp_steps, *x.shape[1:]), x.dtype)), _logprob_shapes(B)
        ),
    )
    return DecodeCarry(
        vary(jnp.zeros((Bg, 1, run.cfg.D), cache.k.dtype)),
        vary(jnp.zeros((Bg,), jnp.int32)),
        vary(run.inputs.tokens),
        StageCache(cache.k, cache.v),
        out,
    )


def decode_tick(run: Run, t, carry: DecodeCarry) -> DecodeCarry:
    """Tick t on this device: stage 0 files the tokens [Bg] the last stage chose at
    tick t - 1; stage s runs group (t - s) mod period at its step i of the chunk through
    its layers, x [Bg, 1, D]; the last stage chooses the group's next tokens and writes
    them to the outputs; hidden states and tokens move one stage on (the last stage's
    back to stage 0)."""
    s, stages = jax.lax.axis_index("stage"), jax.lax.axis_size("stage")
    Bg, inputs = run.B // run.shape.groups, run.inputs
    got, got_row0, _ = slot_of(run, t - stages)
    tok_buf = jnp.where(got, put_rows(carry.tok_buf, carry.tok_recv, got_row0), carry.tok_buf)

    active, row0, i = slot_of(run, t - s)
    j = rows(inputs.step, row0, Bg) + i  # [Bg]: each row at its own step
    q_pos = (rows(inputs.positions, row0, Bg) + i)[:, None]  # [Bg, 1]
    x_in = vary(jnp.where(s == 0, run.model.embed(rows(tok_buf, row0, Bg)[:, None]), carry.h))
    x, kv = decode_stage(run, x_in, carry.cache, active, row0, j, q_pos)

    shapes = Chosen(
        jax.ShapeDtypeStruct((Bg,), jnp.int32),
        _logprob_shapes(Bg) if run.shape.logprobs else None,
        jax.ShapeDtypeStruct((_keep(run), run.cfg.V), jnp.float32),
    )
    head = functools.partial(decode_head, run, row0, j)
    on_last, chosen = on_last_stage(active, head, shapes, x)
    out = write_step(run, carry.out, on_last, row0, i, chosen)
    h_next, tok_next = shift((x, chosen.tokens), cyclic=True)
    return DecodeCarry(h_next, tok_next, tok_buf, kv, out)


def decode_stage(run: Run, x, kv: StageCache, active, row0, j, q_pos):
    """This stage's layers on a group's new tokens, x [Bg, 1, D] at positions q_pos
    [Bg, 1], decode steps j [Bg] -> (x [Bg, 1, D], kv). Each row writes its K/V where
    `ring.decode_slot` puts step j (one `seq` device's slot; none past the row's limit)
    and attends over every `seq` device's own slots, merged with LSE. Where not
    `active` (a bubble) x and the cache stay as they were."""
    Bg = x.shape[0]
    C, c = jax.lax.axis_size("seq"), jax.lax.axis_index("seq")
    device, slot = decode_slot(j, rows(run.inputs.prompt_slots, row0, Bg), C)
    mine = active & (c == device) & (j < rows(run.inputs.limit, row0, Bg))
    group_slot_pos, group_table = rows(run.slot_pos, row0, Bg), rows(run.table, row0, Bg)
    scale = run.cfg.head_dim**-0.5

    def attend_at(layer):
        def attention(q, k, v, kv: StageCache):
            # Slots past this step's hold nothing the group can see yet.
            o, _ = decode_attention(
                q,
                kv.k,
                kv.v,
                q_pos,
                group_slot_pos,
                table=group_table,
                axis_name=seq_axis(),
                scale=scale,
                at=(layer,),
                filled=slot + 1,
            )
            return o

        return cache_attend(layer, group_table, slot, mine, attention)

    def compute(x, kv, gate):
        real = run.weights.real
        x, kv = run_stage(run.model, run.cfg, real, x, q_pos, kv, attend_at, run.gated, gate)
        return vary(x), kv

    return when(active, compute, x, kv, run.gated, run.always_active)


def decode_head(run: Run, row0, j, x) -> Chosen:
    """The last stage's sampling head for the group of rows row0 .., x [Bg, 1, D] ->
    Chosen: its tokens [Bg] for steps j + 1 [Bg] (each row's parameters, key, bans and
    allowed tokens), their log-probabilities where asked, and row 0's logits [1, V]
    where asked (`sampling.choose_tokens`)."""
    Bg, inputs, shape = x.shape[0], run.inputs, run.shape
    params = jax.tree.map(lambda a: rows(a, row0, Bg), inputs.sampling)
    allowed = rows(inputs.allowed, row0, Bg) if shape.constrained else None
    local = run.model.logits(x)[:, 0]  # [Bg, V'/X]: this device's vocabulary block
    split, V, keep = run.model.split, run.cfg.V, _keep(run)
    return choose_tokens(
        local, params, j + 1, split, V, shape.sampled, allowed, shape.logprobs, keep, lazy=True
    )


def write_step(run: Run, out: DecodeOutputs, on_last, row0, i, chosen: Chosen):
    """`out` with the group's choice at chunk step i written where `on_last` (the last
    stage, on a tick that runs a group): tokens and log-probabilities at [row0 .., i],
    row 0's logits at [i]."""

    def at_step(buf, new):  # row0's group of rows, chunk step i
        put = jax.lax.dynamic_update_slice(buf, new[:, None], (row0, i, 0)[: buf.ndim])
        return jnp.where(on_last, put, buf)

    out = out._replace(tokens=at_step(out.tokens, chosen.tokens))
    if run.shape.logprobs:
        out = out._replace(logprobs=jax.tree.map(at_step, out.logprobs, chosen.logprobs))
    if run.shape.with_logits:
        row0_steps = put_rows(out.logits, chosen.logits, i)
        out = out._replace(logits=jnp.where(on_last & (row0 == 0), row0_steps, out.logits))
    return out


def _keep(run: Run) -> int:
    """Rows whose whole logits the head returns: row 0's, where asked."""
    return 1 if run.shape.with_logits else 0


def _logprob_shapes(B: int) -> TokenLogprobs:
    return TokenLogprobs(
        jax.ShapeDtypeStruct((B,), jnp.float32),
        jax.ShapeDtypeStruct((B, TOP_LOGPROBS), jnp.float32),
        jax.ShapeDtypeStruct((B, TOP_LOGPROBS), jnp.int32),
    )
