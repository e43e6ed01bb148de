"""Speculation's rounds on the device: draft, verify, accept and carry back, with no host
between rounds (the drafter beside the last stage, issue 46).

One `shard_map` over the whole ('stage', 'seq', 'tensor') mesh, scheduled as a decode
chunk (`pipeline.programs.decode`) whose steps are verify passes (`pipeline.speculative.verify`) of T tokens a
row: at tick t stage s runs group (t - s) mod period in round (t - s) // period, period
max(groups, stages). A group's tokens for its pass, its newest token then its drafts,
travel with its hidden state from stage to stage, with each row's step and token count
beside them, so every stage writes the row's K/V where plain decoding would. The last
stage, where the model's choices are:

    accept   a_b = the longest run of drafts equal to the model's choices (greedy, or
             drawn with the row's key at that step: `pipeline.speculative.speculator`); the row
             gets its choices 0 .. a_b, appended to its context and to the chunk's output;
    draft    the next round's drafts from the context, by prompt lookup
             (`ngram.propose_rows`: the host drafter's rule, in jnp), at most T - 1 and
             no further than the row's limit, and kept only where the group's expected
             tokens pay for a pass of T against a step (the round rule's test, on the
             rows' kept fractions and the measured cost the host passes in);
    carry    [newest, drafts], step and count go back to stage 0 on the cyclic ppermute
             that carries decode's sampled tokens; stage 0 files them and runs them when
             the group comes round again, a period later.

With groups >= stages no stage idles in steady state; the pipeline's fill and drain are
paid once a chunk instead of once a pass. Round 0's drafts are the host's (the round rule
chooses T from them). A row without drafts runs its newest token alone, and a group
none of whose rows drafts runs one position a row, a decode step's work (where the
layers hold no `seq` collective, so a `lax.cond` may choose; with `seq` > 1 every round
is T wide, and only the head narrows). The slots of rejected drafts are written again
by the row's next round before any query can see them (they lie at its positions and
past them), so `cache.pos` lists every slot the chunk may reach up front and the host
rolls back past the kept tokens at the end.
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
from jax.sharding import Mesh, NamedSharding

from qwen3_spmd.model.cache import KVCache
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.pipeline.programs.decode import tick_through
from qwen3_spmd.pipeline.programs.sampling import (
    RowSampling,
    Sampling,
    choose_tokens,
)
from qwen3_spmd.pipeline.programs.schedule import decode_period
from qwen3_spmd.pipeline.programs.stage import (
    CACHE_SPECS,
    Run,
    StageCache,
    Weights,
    chunk_slot,
    on_last_stage,
    put_rows,
    rows,
    shift,
    vary,
)
from qwen3_spmd.pipeline.speculative import ngram
from qwen3_spmd.pipeline.speculative.policy import MAX_ROUNDS, PRIOR_DRAFTS
from qwen3_spmd.pipeline.speculative.verify import GroupPass, pass_stage
from qwen3_spmd.sharding.specs import SPECS


@dataclasses.dataclass(frozen=True)
class LoopShape:
    """A loop of speculative rounds over the first `rows` rows in `groups` groups, passes
    of the `widths` (ascending from 1), greedy or sampled; prompt lookup's n-gram
    lengths n_max, n_min and drafts a row k_max, and a pace's longest wait max_wait
    (`build_spec_loop`)."""

    rows: int
    groups: int
    widths: tuple[int, ...]
    sampled: bool
    n_max: int
    n_min: int
    k_max: int
    max_wait: int

    def name(self) -> tuple:
        """Its static choices, readably (rows show in its arrays' shapes)."""
        return ("spec_loop", self.groups, self.widths[-1], "sampled" if self.sampled else "greedy")

    @property
    def T(self) -> int:
        """The widest pass's positions a row."""
        return self.widths[-1]

    def build(self, engine) -> Callable:
        """The loop on `engine`, not yet jitted."""
        return build_spec_loop(engine.cfg, engine.graphdef, engine.state_specs, engine.mesh, self)


class LoopInputs(NamedTuple):
    """A chunk's inputs besides the weights and the cache; every field one per row (split
    over `data` with the rows) but `so_far`'s last, `pass_seconds` and `rounds`: a loop
    runs on one replica (`data` of 1; its round rule reads every row)."""

    tokens: jax.Array  # [B, T] int32: round 0's: the row's newest token, its drafts
    count: jax.Array  # [B] int32: round 0's tokens that run, 1 + drafts (0: an empty row)
    step: jax.Array  # [B] int32: the decode step j of tokens[:, 0]
    offset: jax.Array  # [B] int32: a step's position less the step (the prompt's length)
    limit: jax.Array  # [B] int32: steps j >= limit run nothing (decode's limit)
    prompt_slots: jax.Array  # [B] int32: the local slots the row's prompt took
    sampling: RowSampling  # [B] each: the row's sampling parameters, key and bans
    context: jax.Array  # [B, H] int32: the row's tokens so far (prompt, then output)
    length: jax.Array  # [B] int32: how many of them
    # [B + 1, 2] int32: each row's drafts and kept drafts so far (its Pace's), then all
    # rows' (the round rule's): the fractions kept, `RoundRule.fraction`, start from them
    so_far: jax.Array
    # [len(widths)] float32: the measured seconds of a pass of each width over the
    # rows (of width 1: a plain step's; 0: unmeasured), `RoundRule.seconds`
    pass_seconds: jax.Array
    # [B, 3] int32: each row's `policy.Pace` (k, misses, wait_until), which the
    # last stage keeps as the host does
    pace: jax.Array
    rounds: jax.Array  # [] int32: rounds that run, 1 .. MAX_ROUNDS

    @classmethod
    def specs(cls) -> LoopInputs:
        fields = {name: SPECS.rows for name in cls._fields}
        return cls(
            **{
                **fields,
                "sampling": RowSampling(*[SPECS.rows] * len(RowSampling._fields)),
                "pass_seconds": SPECS.replicated,
                "rounds": SPECS.replicated,
            }
        )

    @classmethod
    def zeros(cls, rows: int, T: int, H: int, widths: int) -> LoopInputs:
        """Host inputs of `rows` greedy rows that run nothing, contexts of H tokens, for
        a program of `widths` pass widths: the shapes a compile ahead of time needs."""
        none = np.zeros(rows, np.int32)
        greedy = RowSampling.stack([(Sampling(), 0, 0)] * rows)
        return cls(
            np.zeros((rows, T), np.int32),
            *[none] * 5,
            greedy,
            np.zeros((rows, H), np.int32),
            none,
            np.zeros((rows + 1, 2), np.int32),
            np.zeros(widths, np.float32),
            np.zeros((rows, 3), np.int32),
            np.int32(1),
        )

    def placed(self, mesh: Mesh) -> LoopInputs:
        return jax.tree.map(
            lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), self, self.specs()
        )


class LoopOutputs(NamedTuple):
    """What a chunk gave each row [B]: its new `tokens` [B, MAX_ROUNDS T] in order, of
    which the first `made` count; the drafts its rounds ran and kept, and how many
    rounds ran drafts; its pace after them."""

    tokens: jax.Array
    made: jax.Array
    drafted: jax.Array
    kept: jax.Array
    passes: jax.Array
    pace: jax.Array  # [B, 3] int32: as LoopInputs.pace


class LoopCarry(NamedTuple):
    """The tick loop's state on one device."""

    h: jax.Array  # [B/groups, T, D]: the hidden state received from the previous stage
    got: jax.Array  # [B/groups, T + 2] int32: the group's [tokens, step, count] received
    queued: jax.Array  # [B, T + 2] int32: stage 0's: each row's next [tokens, step, count]
    cache: StageCache  # this stage's cache slice
    context: jax.Array  # [B, H] int32: the last stage's: each row's tokens so far
    length: jax.Array  # [B] int32: how many
    out: LoopOutputs  # filled by the last stage


def pace_after(pace, drafted, kept, tokens, k_max: int, max_wait: int):
    """`policy.Pace.after` for many rows, in jnp: pace [R, 3] int32 (k, misses,
    wait_until) after a pass that kept `kept` of a row's `drafted` drafts, the row now
    `tokens` long ([R] each; a row with no drafts keeps its pace). After a pass that
    kept nothing: one draft at a time, not before 2, 4, .. max_wait more tokens; else
    twice the run kept, at most k_max."""
    k, misses, wait_until = (pace[:, i] for i in range(3))
    drew = drafted > 0
    missed = drew & (kept == 0)
    misses = jnp.where(missed, misses + 1, jnp.where(drew, 0, misses))
    wait = jnp.minimum(jnp.left_shift(1, jnp.minimum(misses, 30)), max_wait)
    wait_until = jnp.where(missed, tokens + wait, wait_until)
    k = jnp.where(drew, jnp.where(missed, 1, jnp.minimum(k_max, 2 * kept)), k)
    return jnp.stack([k, misses, wait_until], axis=1)


def kept_fraction(row, every):
    """`RoundRule.fraction` for many rows, in jnp: row [R, 2] int32 (each row's drafts,
    and those kept), every [2] (all rows') -> [R] float32."""
    overall = jnp.where(every[0] > 0, every[1] / jnp.maximum(every[0], 1), 1.0)
    return (row[:, 1] + PRIOR_DRAFTS * overall) / (row[:, 0] + PRIOR_DRAFTS)


def choose_width(d, f, runs, widths, seconds):
    """`RoundRule.choose` for a group's next round, in jnp: the index into `widths`
    ([W] int32, ascending from 1) of the pass to run, for rows' drafts d [R] (0 where
    none), kept fractions f [R] and running rows `runs` [R] bool, by the widths'
    measured `seconds` [W] (0: unmeasured). The drafts' own width while it is
    unmeasured, then a step while that is; else, of the measured widths up to the
    drafts' own, the one of most expected tokens a second, sum over rows of
    1 + f min(d, width - 1) (the narrowest of equals). The host's probe after rounds of
    declined drafts is the host's alone."""
    ask = jnp.searchsorted(widths, 1 + jnp.max(d))
    cut = jnp.minimum(d[None], widths[:, None] - 1)  # [W, R]
    tokens = jnp.sum(jnp.where(runs[None], 1 + f[None] * cut, 0), axis=1)  # [W]
    known = (seconds > 0) & (jnp.arange(widths.shape[0]) <= ask)
    rate = jnp.where(known, tokens / jnp.where(known, seconds, 1), -1.0)
    best = jnp.argmax(rate)
    return jnp.where(seconds[ask] == 0, ask, jnp.where(seconds[0] == 0, 0, best))


def _append(buf: jax.Array, at: jax.Array, new: jax.Array, n: jax.Array) -> jax.Array:
    """buf [R, W] with new[r, :n[r]] written from column at[r] (columns past W dropped)."""
    T = new.shape[1]
    cols = at[:, None] + jnp.arange(T, dtype=jnp.int32)
    cols = jnp.where(jnp.arange(T) < n[:, None], cols, buf.shape[1])
    return buf.at[jnp.arange(buf.shape[0])[:, None], cols].set(new, mode="drop")


# One shard_map program; the functions below it, read top to bottom, are the rounds of
# the module's docstring: a tick, a stage's pass, the model's choices, accept, draft.
def build_spec_loop(
    cfg: Qwen3Config, graphdef: nnx.GraphDef, state_specs, mesh: Mesh, shape: LoopShape
):
    """The loop program for passes of the `widths` (ascending from 1: 1 + the drafts
    of the k ladder) tokens a row, T the widest (not yet jitted).

    Returns f(weights: Weights, cache: KVCache, inputs: LoopInputs) -> (LoopOutputs,
    KVCache). `cache.pos` must list the slots of each row's steps up to
    min(limit, step + rounds T) (`RowBook.list_ahead`); the program writes k and v
    only, so `cache` is donated. sampled=False promises every row is greedy; n_max,
    n_min: the prompt lookup's n-gram lengths, k_max its drafts a row
    (`SpeculativeConfig`); max_wait: a pace's longest wait (`policy.MAX_WAIT`).
    """

    def local(weights: Weights, cache: KVCache, inputs: LoopInputs):
        run = Run(
            nnx.merge(graphdef, weights.state), cfg, weights, inputs, cache.pos, cache.table, shape
        )
        return tick_through(run, cache, inputs.rounds, loop_tick, first_carry(run, cache))

    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(Weights.specs(state_specs), CACHE_SPECS, LoopInputs.specs()),
        out_specs=(LoopOutputs(*[SPECS.rows] * len(LoopOutputs._fields)), CACHE_SPECS),
    )

    def spec_loop(weights: Weights, cache: KVCache, inputs: LoopInputs):
        return mapped(weights, cache, inputs)

    return spec_loop


def slot_of(run: Run, u):
    """Schedule slot u = t - s -> (runs a group?, its first row): a round is a decode
    chunk's step (`stage.chunk_slot`)."""
    groups = run.shape.groups
    period = decode_period(groups, jax.lax.axis_size("stage"))
    return chunk_slot(u, run.inputs.rounds * period, period, groups, run.B // groups)[:2]


def _width_of(run: Run) -> jax.Array:
    """The pass widths as an array [len(widths)] int32."""
    return jnp.array(run.shape.widths, jnp.int32)


def first_carry(run: Run, cache: KVCache) -> LoopCarry:
    """The loop's state before tick 0: nothing received, round 0's [tokens, step, count]
    queued for every row [B, T + 2], the stage's cache slice, the rows' contexts and
    paces as the host sent them, the outputs zero."""
    inputs, T, B = run.inputs, run.shape.T, run.B
    Bg = B // run.shape.groups
    zeros = lambda *shape: vary(jnp.zeros(shape, jnp.int32))  # noqa: E731
    meta = jnp.concatenate([inputs.tokens, inputs.step[:, None], inputs.count[:, None]], axis=1)
    return LoopCarry(
        vary(jnp.zeros((Bg, T, run.cfg.D), cache.k.dtype)),
        zeros(Bg, T + 2),
        vary(meta),
        StageCache(cache.k, cache.v),
        vary(inputs.context),
        vary(inputs.length),
        LoopOutputs(zeros(B, MAX_ROUNDS * T), *[zeros(B)] * 4, vary(inputs.pace)),
    )


def loop_tick(run: Run, t, carry: LoopCarry) -> LoopCarry:
    """Tick t on this device: stage 0 files the [tokens, step, count] the last stage sent
    at tick t - 1; stage s runs group (t - s) mod period's round, x [Bg, T, D], through
    its layers; the last stage accepts, books the round and drafts the next; hidden
    states and the next round's [tokens, step, count] move one stage on (the last
    stage's back to stage 0)."""
    s, stages = jax.lax.axis_index("stage"), jax.lax.axis_size("stage")
    Bg, T, inputs = run.B // run.shape.groups, run.shape.T, run.inputs
    filed, filed_row0 = slot_of(run, t - stages)
    queued = jnp.where(filed, put_rows(carry.queued, carry.got, filed_row0), carry.queued)

    active, row0 = slot_of(run, t - s)
    meta = jnp.where(s == 0, rows(queued, row0, Bg), carry.got)  # [Bg, T + 2]
    fed, step, count = meta[:, :T], meta[:, T], meta[:, T + 1]
    offset, prompt_slots = rows(inputs.offset, row0, Bg), rows(inputs.prompt_slots, row0, Bg)
    group = GroupPass(row0, step, offset + step, count, prompt_slots)
    x_in = vary(jnp.where(s == 0, run.model.embed(fed), carry.h))
    # The round runs the narrowest of the widths its rows' tokens fit (1: a decode
    # step's work), every stage alike: they all read the same counts.
    at = jnp.searchsorted(_width_of(run), jnp.max(count))
    x, kv = loop_stage(run, x_in, carry.cache, group, active, at)

    head = functools.partial(loop_head, run, carry, group, fed, at)
    shapes = _head_shapes(Bg, T, carry.context.shape[1])
    on_last, (meta_next, context, length, out) = on_last_stage(active, head, shapes, x)

    def put(buf, new):
        return jnp.where(on_last, put_rows(buf, new, row0), buf)

    h_next, got = shift((x, jnp.where(on_last, meta_next, meta)), cyclic=True)
    context, length = put(carry.context, context), put(carry.length, length)
    return LoopCarry(h_next, got, queued, kv, context, length, jax.tree.map(put, carry.out, out))


def loop_stage(run: Run, x_in, kv: StageCache, group: GroupPass, active, at):
    """This stage's pass over a group's round, x_in [Bg, T, D] -> (x [Bg, T, D], kv):
    `verify.pass_stage` over the first widths[at] positions (zeros past them) where the
    layers hold no `seq` collective (a switch may choose), else over all T."""
    T = run.shape.T

    def layers(width):
        def run_width(x_in, kv):
            x_in = x_in[:, :width]
            x, kv = pass_stage(run, kv, x_in, group, active)
            return jnp.pad(x, ((0, 0), (0, T - width), (0, 0))), kv

        return run_width

    if run.gated:  # a switch holds no seq collective (`stage.when`)
        return jax.lax.switch(at, [layers(w) for w in run.shape.widths], x_in, kv)
    return layers(T)(x_in, kv)


def loop_choices(run: Run, row0, step, at, x):
    """The model's token after each of the first widths[at] positions of a group's round,
    x [Bg, T, D] -> [Bg, T] (zeros past them): position i of a row is decode step
    step + i, drawn with the row's key there (`sampling.choose_tokens`)."""
    Bg, T = x.shape[:2]

    def choices(width):
        def choose(x):
            local = run.model.logits(x[:, :width]).reshape(Bg * width, -1)  # [Bg w, V'/X]
            params = jax.tree.map(
                lambda a: jnp.repeat(rows(a, row0, Bg), width, axis=0), run.inputs.sampling
            )
            ahead = jnp.arange(width, dtype=jnp.int32)
            key_step = (step[:, None] + ahead + 1).reshape(-1)  # the token made
            split, V = run.model.split, run.cfg.V
            choice = choose_tokens(local, params, key_step, split, V, run.shape.sampled).tokens
            return vary(jnp.pad(choice.reshape(Bg, width), ((0, 0), (0, T - width))))

        return choose

    return jax.lax.switch(at, [choices(w) for w in run.shape.widths], x)


def accept(fed, choice, count):
    """A round's acceptance for rows that fed `fed` [R, T] (newest token, then drafts;
    `count` [R] of them) and got the model's `choice` [R, T]: (drafted, kept, made,
    newest) [R] each: the drafts, the longest run of them equal to the choices, the
    tokens the row gets (kept + 1, 0 for a row that ran nothing), and its newest."""
    ahead = jnp.arange(fed.shape[1], dtype=jnp.int32)
    drafted = jnp.maximum(count - 1, 0)
    agree = (fed[:, 1:] == choice[:, :-1]) & (ahead[1:] < count[:, None])
    kept = jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1)
    made = jnp.where(count > 0, kept + 1, 0)
    newest = jnp.take_along_axis(choice, kept[:, None], axis=1)[:, 0]
    return drafted, kept, made, newest


def loop_head(run: Run, carry: LoopCarry, group: GroupPass, fed, at, x):
    """The last stage's round for a group, x [Bg, T, D] -> (its next [tokens, step,
    count] [Bg, T + 2], its rows' context [Bg, H] and length [Bg], its LoopOutputs):
    the model's choices, accepted against the drafts fed, appended to each row's
    context and output, its pace updated, the next round drafted."""
    Bg, row0, step, count = x.shape[0], group.row0, group.step, group.count
    choice = loop_choices(run, row0, step, at, x)
    drafted, kept, made, newest = accept(fed, choice, count)
    ran = count > 0

    old = jax.tree.map(lambda a: rows(a, row0, Bg), carry.out)
    length = rows(carry.length, row0, Bg)
    context = _append(rows(carry.context, row0, Bg), length, choice, made)
    length = length + made
    tokens = _append(old.tokens, old.made, choice, made)
    step_next = step + made
    drafted_ran = jnp.where(ran, drafted, 0)
    pace = pace_after(
        old.pace, drafted_ran, kept, step_next + 1, run.shape.k_max, run.shape.max_wait
    )

    drafts, d, runs_next = next_drafts(run, row0, context, length, step_next, pace, ran)
    this = jnp.stack([drafted_ran, kept], axis=1)  # [Bg, 2]
    count_next = next_count(run, carry, row0, old, this, d, runs_next)
    meta_next = jnp.concatenate(
        [newest[:, None], drafts, step_next[:, None], count_next[:, None]], axis=1
    )
    out = LoopOutputs(
        tokens,
        old.made + made,
        old.drafted + drafted_ran,
        old.kept + jnp.where(ran, kept, 0),
        old.passes + (ran & (drafted > 0)),
        pace,
    )
    return meta_next, context, length, out


def next_drafts(run: Run, row0, context, length, step_next, pace, ran):
    """A group's drafts for its next round by prompt lookup on each row's context
    [Bg, H] (`length` [Bg] tokens; its next step `step_next` [Bg]) -> (drafts
    [Bg, T - 1], how many of them it may run [Bg], whether it runs [Bg]): as many as
    its pace [Bg, 3] and its limit allow; none for a row that ran nothing or is at its
    limit."""
    Bg, T = context.shape[0], run.shape.T
    k_b, wait_until = pace[:, 0], pace[:, 2]
    drafts, found = ngram.propose_rows(context, length, T - 1, run.shape.n_max, run.shape.n_min)
    room = rows(run.inputs.limit, row0, Bg) - 1 - step_next  # drafts the limit allows
    may = found & (step_next + 1 >= wait_until)  # tokens so far: step + 1
    d = jnp.where(may, jnp.clip(jnp.minimum(room, k_b), 0, T - 1), 0)
    runs_next = ran & (room >= 0)
    return drafts, jnp.where(runs_next, d, 0), runs_next


def next_count(run: Run, carry: LoopCarry, row0, old: LoopOutputs, this, d, runs_next):
    """The tokens each row of a group feeds its next round [Bg] (0: none): 1 + its
    drafts d [Bg], cut to the width the round rule chooses by the rows' kept fractions
    as the host's rule would read them now: the chunk's passes so far count (`old`, the
    rows' outputs before this round; carry.out, every row's), this round's `this`
    [Bg, 2] (drafts, kept) included."""
    Bg, inputs = d.shape[0], run.inputs
    row_so_far = rows(inputs.so_far, row0, Bg) + jnp.stack([old.drafted, old.kept], axis=1)
    every = jnp.stack([carry.out.drafted, carry.out.kept], axis=1)  # [B, 2]
    all_so_far = inputs.so_far[-1] + jnp.sum(every, axis=0) + jnp.sum(this, axis=0)
    f = kept_fraction(row_so_far + this, all_so_far)
    width_of = _width_of(run)
    cut = width_of[choose_width(d, f, runs_next, width_of, inputs.pass_seconds)]
    return jnp.where(runs_next, jnp.minimum(1 + d, cut), 0)


def _head_shapes(Bg: int, T: int, H: int) -> tuple:
    """`loop_head`'s outputs' shapes: [tokens, step, count] [Bg, T + 2], context
    [Bg, H], length [Bg], LoopOutputs of a group's rows."""
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    outputs = LoopOutputs(i32(Bg, MAX_ROUNDS * T), *[i32(Bg)] * 4, i32(Bg, 3))
    return i32(Bg, T + 2), i32(Bg, H), i32(Bg), outputs
