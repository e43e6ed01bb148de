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

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qwen3_spmd.model.cache import KVCache
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.pipeline.programs.sampling import (
    RowSampling,
    Sampling,
    gather_vocab,
    greedy_split,
    sample_rows,
)
from qwen3_spmd.pipeline.programs.schedule import decode_period, decode_ticks
from qwen3_spmd.pipeline.programs.stage import (
    CACHE_SPECS,
    StageCache,
    Weights,
    chunk_slot,
    from_device,
    on_last_stage,
    put_rows,
    rows,
    shift,
    vary,
)
from qwen3_spmd.pipeline.speculative import ngram
from qwen3_spmd.pipeline.speculative.policy import MAX_ROUNDS
from qwen3_spmd.pipeline.speculative.round_rule import PRIOR_DRAFTS
from qwen3_spmd.pipeline.speculative.verify import GroupPass, pass_stage


class LoopInputs(NamedTuple):
    """A chunk's inputs besides the weights and the cache; every field replicated
    (P()), one per row but `rounds`."""

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
        fields = {name: P() for name in cls._fields}
        return cls(**{**fields, "sampling": RowSampling(*[P()] * len(RowSampling._fields))})

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


def build_spec_loop(
    cfg: Qwen3Config,
    graphdef: nnx.GraphDef,
    state_specs,
    mesh: Mesh,
    groups: int,
    widths: tuple[int, ...],
    sampled: bool,
    n_max: int,
    n_min: int,
    k_max: int,
    max_wait: int,
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
    T = widths[-1]
    ahead = jnp.arange(T, dtype=jnp.int32)
    W = MAX_ROUNDS * T
    gated = mesh.shape["seq"] == 1  # no collectives inside the layers
    width_of = jnp.array(widths, jnp.int32)

    def local(weights: Weights, cache: KVCache, inputs: LoopInputs):
        model = nnx.merge(graphdef, weights.state)
        split = model.split
        stages, s = jax.lax.axis_size("stage"), jax.lax.axis_index("stage")
        B = inputs.tokens.shape[0]
        Bg = B // groups
        period = decode_period(groups, stages)
        busy = inputs.rounds * period

        def slot_of(u):
            """Schedule slot u = t - s -> (runs a group?, its first row): a round is a
            decode chunk's step."""
            return chunk_slot(u, busy, period, groups, Bg)[:2]

        def tick(t, carry: LoopCarry) -> LoopCarry:
            # Stage 0 files what the last stage sent at tick t - 1.
            filed, filed_row0 = slot_of(t - stages)
            queued = jnp.where(filed, put_rows(carry.queued, carry.got, filed_row0), carry.queued)

            active, row0 = slot_of(t - s)
            meta = jnp.where(s == 0, rows(queued, row0, Bg), carry.got)  # [Bg, T + 2]
            fed, step, count = meta[:, :T], meta[:, T], meta[:, T + 1]
            group = GroupPass(
                row0,
                step,
                rows(inputs.offset, row0, Bg) + step,
                count,
                rows(inputs.prompt_slots, row0, Bg),
            )
            x_in = vary(jnp.where(s == 0, model.embed(fed), carry.h))
            # The round runs the narrowest of the widths its rows' tokens fit (1: a
            # decode step's work), every stage alike: they all read the same counts.
            at = jnp.searchsorted(width_of, jnp.max(count))

            def layers(width):
                def run(x_in, kv):
                    x, kv = pass_stage(
                        model, cfg, weights, kv, cache.pos, x_in[:, :width], group, active
                    )
                    return jnp.pad(x, ((0, 0), (0, T - width), (0, 0))), kv

                return run

            if gated:  # a switch holds no seq collective (`stage.when`)
                x, kv = jax.lax.switch(at, [layers(w) for w in widths], x_in, carry.cache)
            else:
                x, kv = layers(T)(x_in, carry.cache)

            def choices(width):
                def choose(x):
                    """x [Bg, T, D] -> the model's token after each of the first `width`
                    positions [Bg, T] (zeros past them)."""
                    local = model.logits(x[:, :width]).reshape(Bg * width, -1)  # [Bg w, V'/X]
                    params = jax.tree.map(
                        lambda a: jnp.repeat(rows(a, row0, Bg), width, axis=0), inputs.sampling
                    )
                    key_step = (step[:, None] + ahead[:width] + 1).reshape(-1)  # token made
                    if split.size == 1 or sampled:
                        whole = gather_vocab(local, split, cfg.V)
                        choice = sample_rows(whole, params, key_step, sampled)
                    else:
                        choice = greedy_split(local, params, key_step, split)
                    return vary(jnp.pad(choice.reshape(Bg, width), ((0, 0), (0, T - width))))

                return choose

            def head(x):
                """x [Bg, T, D] -> the group's next [tokens, step, count], its rows'
                context, length and outputs after this round."""
                choice = jax.lax.switch(at, [choices(w) for w in widths], x)

                ran = count > 0
                drafted = jnp.maximum(count - 1, 0)
                agree = (fed[:, 1:] == choice[:, :-1]) & (ahead[1:] < count[:, None])
                kept = jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1)
                made = jnp.where(ran, kept + 1, 0)
                newest = jnp.take_along_axis(choice, kept[:, None], axis=1)[:, 0]

                old = jax.tree.map(lambda a: rows(a, row0, Bg), carry.out)
                length = rows(carry.length, row0, Bg)
                context = _append(rows(carry.context, row0, Bg), length, choice, made)
                length = length + made
                tokens = _append(old.tokens, old.made, choice, made)

                step_next = step + made
                with_drafts = ran & (drafted > 0)
                pace = pace_after(
                    old.pace, jnp.where(ran, drafted, 0), kept, step_next + 1, k_max, max_wait
                )
                k_b, wait_until = pace[:, 0], pace[:, 2]
                drafts, found = ngram.propose_rows(context, length, T - 1, n_max, n_min)
                room = rows(inputs.limit, row0, Bg) - 1 - step_next  # drafts the limit allows
                may = found & (step_next + 1 >= wait_until)  # tokens so far: step + 1
                d = jnp.where(may, jnp.clip(jnp.minimum(room, k_b), 0, T - 1), 0)
                runs_next = ran & (room >= 0)
                d = jnp.where(runs_next, d, 0)
                # Fractions kept as the host's rule would read them now: the chunk's
                # passes so far count, this one's included.
                this = jnp.stack([jnp.where(ran, drafted, 0), kept], axis=1)  # [Bg, 2]
                row_so_far = rows(inputs.so_far, row0, Bg) + jnp.stack(
                    [old.drafted, old.kept], axis=1
                )
                every = jnp.stack([carry.out.drafted, carry.out.kept], axis=1)  # [B, 2]
                all_so_far = inputs.so_far[-1] + jnp.sum(every, axis=0) + jnp.sum(this, axis=0)
                f = kept_fraction(row_so_far + this, all_so_far)
                cut = width_of[choose_width(d, f, runs_next, width_of, inputs.pass_seconds)]
                count_next = jnp.where(runs_next, jnp.minimum(1 + d, cut), 0)
                meta_next = jnp.concatenate(
                    [newest[:, None], drafts, step_next[:, None], count_next[:, None]], axis=1
                )
                out = LoopOutputs(
                    tokens,
                    old.made + made,
                    old.drafted + jnp.where(ran, drafted, 0),
                    old.kept + jnp.where(ran, kept, 0),
                    old.passes + with_drafts,
                    pace,
                )
                return meta_next, context, length, out

            shapes = (
                jax.ShapeDtypeStruct((Bg, T + 2), jnp.int32),
                jax.ShapeDtypeStruct((Bg, carry.context.shape[1]), jnp.int32),
                jax.ShapeDtypeStruct((Bg,), jnp.int32),
                LoopOutputs(
                    jax.ShapeDtypeStruct((Bg, W), jnp.int32),
                    *[jax.ShapeDtypeStruct((Bg,), jnp.int32)] * 4,
                    jax.ShapeDtypeStruct((Bg, 3), jnp.int32),
                ),
            )
            on_last, (meta_next, context, length, out) = on_last_stage(active, head, shapes, x)

            def put(buf, new):
                return jnp.where(on_last, put_rows(buf, new, row0), buf)

            h_next, got = shift((x, jnp.where(on_last, meta_next, meta)), cyclic=True)
            return LoopCarry(
                h_next,
                got,
                queued,
                kv,
                put(carry.context, context),
                put(carry.length, length),
                jax.tree.map(put, carry.out, out),
            )

        zeros = lambda *shape: vary(jnp.zeros(shape, jnp.int32))  # noqa: E731
        meta = jnp.concatenate([inputs.tokens, inputs.step[:, None], inputs.count[:, None]], axis=1)
        carry = LoopCarry(
            vary(jnp.zeros((Bg, T, cfg.D), cache.k.dtype)),
            zeros(Bg, T + 2),
            vary(meta),
            StageCache(cache.k, cache.v),
            vary(inputs.context),
            vary(inputs.length),
            LoopOutputs(zeros(B, W), *[zeros(B)] * 4, vary(inputs.pace)),
        )
        carry = jax.lax.fori_loop(0, decode_ticks(groups, stages, inputs.rounds), tick, carry)
        out = jax.tree.map(lambda a: from_device(a, stages - 1, 0), carry.out)
        return out, KVCache(carry.cache.k, carry.cache.v, cache.pos)

    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(Weights.specs(state_specs), CACHE_SPECS, LoopInputs.specs()),
        out_specs=(LoopOutputs(*[P()] * len(LoopOutputs._fields)), CACHE_SPECS),
    )

    def spec_loop(weights: Weights, cache: KVCache, inputs: LoopInputs):
        return mapped(weights, cache, inputs)

    return spec_loop
