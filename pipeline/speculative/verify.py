"""Verify: one pass of the model over T = k + 1 tokens a row, each row after its own
cached context (speculative decoding's check).

One `shard_map` over the whole ('stage', 'seq', 'tensor') mesh, scheduled as a decode
chunk of one step (`pipeline.programs.decode`): the batch is cut into `groups` groups of B /
groups rows, and at tick t stage s runs group t - s. A row feeds its newest token
(whose K/V is not cached yet) and then its k draft tokens, at positions p .. p + k.
Token i of the row is decode step j + i and writes its K/V where that step would
(`ring.decode_slot`: device (j + i) mod C, after the prompt's slots), so the cache a
verify leaves is the cache plain decoding leaves for the positions it keeps. The T
queries attend over each `seq` device's own slots, masked by position (so token i sees
the context and tokens 0 .. i of its own row, which it has just written), and the C
partial results merge with LSE (`ring.decode_attention`, whose T may exceed 1).

The last stage gives each position's token as decode would choose it there
(`sampling.sample_rows` with the row's parameters, bans and key (seed, request, step)
at that step, and its grammar's allowed tokens there when it has one, or
`sampling.greedy_split` for greedy rows under `tensor`): out[b, i] is the model's
choice after tokens 0 .. i of row b. A sampled row's draw at a position is the one
plain decoding makes there from the same logits, since its key depends on the step
alone. Which of them to keep is the host's (`pipeline.speculative.speculator`); the slots of
positions it rejects are unlisted there, and written again by later steps before any
query can see them.
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
from qwen3_spmd.pipeline.programs.sampling import (
    TOP_LOGPROBS,
    RowSampling,
    Sampling,
    TokenLogprobs,
    choose_tokens,
)
from qwen3_spmd.pipeline.programs.schedule import decode_ticks
from qwen3_spmd.pipeline.programs.stage import (
    CACHE_SPECS,
    Run,
    StageCache,
    Weights,
    from_device,
    on_last_stage,
    put_rows,
    rows,
    run_stage,
    seq_axis,
    shift,
    vary,
    when,
    write_kv,
)
from qwen3_spmd.pipeline.runtime.shapes import RoundSettings
from qwen3_spmd.ring import decode_attention, decode_slot
from qwen3_spmd.sharding.specs import SPECS


@dataclasses.dataclass(frozen=True, order=True)
class VerifyShape:
    """A verify pass over the first `rows` rows, T positions a row, greedy or sampled,
    constrained (each position's tokens masked by a grammar) or not
    (`pipeline.speculative.speculator`). Not among `ShapeRules.declared()`: a server with a
    speculative config compiles them last, in the background (`Speculator.shapes`).
    groups: the rows' decode groups (the runner's: None in that list); logprobs: each
    position's log-probabilities too; last_only: a draft model's pass, each row's token
    after its last position only (`build_verify`)."""

    rows: int
    T: int
    sampled: bool
    constrained: bool = False
    groups: int | None = None
    logprobs: bool = False
    last_only: bool = False

    @property
    def T_out(self) -> int:
        """Positions a row's output holds: T, or 1 with last_only."""
        return 1 if self.last_only else self.T

    def name(self) -> tuple:
        """Its static choices, readably (rows show in its arrays' shapes)."""
        name = ("draft" if self.last_only else "verify", self.groups, self.T)
        name += ("sampled" if self.sampled else "greedy",)
        name += ("logprobs",) if self.logprobs else ()
        return name + (("constrained",) if self.constrained else ())

    def build(self, engine) -> Callable:
        """The pass on `engine` (the model's, or a draft model's), not yet jitted."""
        return build_verify(engine.cfg, engine.graphdef, engine.state_specs, engine.mesh, self)

    def compile(self, engine, settings: RoundSettings, announce: bool = True) -> None:
        """Compiles, unless compiled, this pass in the rounds' groups and what it runs
        beside it (`Speculator.compile`: a draft model's passes, a loop of rounds)."""
        settings.speculator.compile(
            self, settings.cache_rows, settings.pages, settings.groups, announce
        )


class VerifyInputs(NamedTuple):
    """A verify pass's inputs besides the weights and the cache; every field one per row,
    split over `data` with the rows."""

    tokens: jax.Array  # [B, T] int32: the row's newest token, its drafts, then padding
    positions: jax.Array  # [B] int32: the position of tokens[:, 0]
    step: jax.Array  # [B] int32: the decode step index j of tokens[:, 0]
    count: jax.Array  # [B] int32: tokens of the row that run, 1 + drafts (0: an empty row)
    prompt_slots: jax.Array  # [B] int32: the local slots the row's prompt took
    sampling: RowSampling  # [B] each: the row's sampling parameters, key and bans
    # [B] int32: the steps of a row before its first generated token (a draft model's,
    # whose steps count the prompt's tokens too; 0 for the model's, whose steps count
    # generated tokens): a token's sampling key and bans take its step less these.
    key_offset: jax.Array
    # [B, T, ceil(V/32)] int32: the tokens allowed at each position as packed bits
    # (`sampling.only_allowed`; a structured output's grammar after the drafts before
    # it, all ones for a row under none), for a pass with a constrained row; else None.
    allowed: jax.Array | None = None

    @classmethod
    def specs(cls, constrained: bool = False) -> VerifyInputs:
        fields = {name: SPECS.rows for name in cls._fields}
        fields["sampling"] = RowSampling(*[SPECS.rows] * len(RowSampling._fields))
        return cls(**{**fields, "allowed": SPECS.rows if constrained else None})

    @classmethod
    def zeros(cls, rows: int, T: int, words: int | None = None) -> VerifyInputs:
        """Host inputs of `rows` greedy rows that run nothing: the shapes a compile
        ahead of time needs (with masks of `words` int32 words a position, if given)."""
        none = np.zeros(rows, np.int32)
        greedy = RowSampling.stack([(Sampling(), 0, 0)] * rows)
        allowed = None if words is None else np.full((rows, T, words), -1, np.int32)
        return cls(np.zeros((rows, T), np.int32), none, none, none, none, greedy, none, allowed)

    def placed(self, mesh: Mesh) -> VerifyInputs:
        """These host inputs on `mesh`, split over `data` by rows, in the dtypes a pass's
        compiled program is keyed by."""
        return jax.tree.map(
            lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)),
            self,
            self.specs(self.allowed is not None),
        )


class VerifyCarry(NamedTuple):
    """The tick loop's state on one device."""

    h: jax.Array  # [B/groups, T, D]: the hidden state received from the previous stage
    cache: StageCache  # this stage's cache slice
    out: jax.Array  # [B, T'] int32: each position's token (filled by the last stage)
    # Each position's TokenLogprobs, fields [B, T'] and [B, T', TOP_LOGPROBS] (a program
    # with logprobs; else None).
    logprobs: TokenLogprobs | None = None


def build_verify(
    cfg: Qwen3Config, graphdef: nnx.GraphDef, state_specs, mesh: Mesh, shape: VerifyShape
):
    """The verify program for `shape.T` tokens a row in `shape.groups` groups (not yet
    jitted).

    Returns f(weights: Weights, cache: KVCache, inputs: VerifyInputs) -> (out [B, T']
    int32, TokenLogprobs of [B, T'] / [B, T', TOP_LOGPROBS] or None, KVCache), T' = T,
    or 1 with last_only: each row's token after its last running position only (a
    draft model's pass, which reads no other; the head's logits, and a sampled row's
    sort of the vocabulary, for one position instead of T). `cache.pos` must already
    list the slots of each row's `count` tokens (`RowBook.list_ahead`); the program
    writes k and v only, so `cache` is donated and updated in place. sampled=False
    promises every row is greedy (no sort of the vocabulary compiled, and under
    `tensor` no gather of it); sampled=True draws where a row asks to. logprobs=True
    also gives each position's token's log-probability and the top TOP_LOGPROBS, from
    the raw logits as decode reports them. constrained=True: `inputs.allowed` masks
    each position's choice, as a constrained decode chunk's.
    """

    def local(weights: Weights, cache: KVCache, inputs: VerifyInputs):
        run = Run(
            nnx.merge(graphdef, weights.state), cfg, weights, inputs, cache.pos, cache.table, shape
        )
        stages = jax.lax.axis_size("stage")
        ticks = decode_ticks(shape.groups, stages, 1)
        tick = functools.partial(verify_tick, run)
        carry = jax.lax.fori_loop(0, ticks, tick, first_carry(run, cache))
        out = from_device(carry.out, stages - 1, 0)
        lp = jax.tree.map(lambda a: from_device(a, stages - 1, 0), carry.logprobs)
        return out, lp, cache._replace(k=carry.cache.k, v=carry.cache.v)

    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(Weights.specs(state_specs), CACHE_SPECS, VerifyInputs.specs(shape.constrained)),
        out_specs=(
            SPECS.rows,
            TokenLogprobs(*[SPECS.rows] * 3) if shape.logprobs else None,
            CACHE_SPECS,
        ),
    )

    def verify(weights: Weights, cache: KVCache, inputs: VerifyInputs):
        return mapped(weights, cache, inputs)

    return verify


def first_carry(run: Run, cache: KVCache) -> VerifyCarry:
    """The loop's state before tick 0: nothing received, the stage's cache slice, the
    outputs zero ([B, T'], and log-probabilities where asked)."""
    shape, B = run.shape, run.B
    lp = _logprob_shapes(B, shape.T_out, shape.logprobs)
    return VerifyCarry(
        vary(jnp.zeros((B // shape.groups, shape.T, run.cfg.D), cache.k.dtype)),
        StageCache(cache.k, cache.v),
        vary(jnp.zeros((B, shape.T_out), jnp.int32)),
        jax.tree.map(lambda a: vary(jnp.zeros(a.shape, a.dtype)), lp),
    )


def verify_tick(run: Run, t, carry: VerifyCarry) -> VerifyCarry:
    """Tick t on this device (one step of the decode schedule): stage s runs group t - s
    (if that is a group), its T tokens a row, x [Bg, T, D], through its layers
    (`pass_stage`); the last stage writes each position's token; hidden states move one
    stage on."""
    s, inputs, shape = jax.lax.axis_index("stage"), run.inputs, run.shape
    Bg, u = run.B // shape.groups, t - s
    active = (u >= 0) & (u < shape.groups)
    row0 = jnp.clip(u, 0, shape.groups - 1) * Bg
    group = GroupPass(
        row0,
        rows(inputs.step, row0, Bg),
        rows(inputs.positions, row0, Bg),
        rows(inputs.count, row0, Bg),
        rows(inputs.prompt_slots, row0, Bg),
    )
    x_in = vary(jnp.where(s == 0, run.model.embed(rows(inputs.tokens, row0, Bg)), carry.h))
    x, kv = pass_stage(run, carry.cache, x_in, group, active)

    shapes = (
        jax.ShapeDtypeStruct((Bg, shape.T_out), jnp.int32),
        _logprob_shapes(Bg, shape.T_out, shape.logprobs),
    )
    head = functools.partial(verify_head, run, group)
    on_last, (tok, lp) = on_last_stage(active, head, shapes, x)

    def put(buf, new):
        return jnp.where(on_last, put_rows(buf, new, row0), buf)

    lp = jax.tree.map(put, carry.logprobs, lp) if shape.logprobs else None
    return VerifyCarry(shift(x, cyclic=False), kv, put(carry.out, tok), lp)


def verify_head(run: Run, group: GroupPass, x):
    """The last stage's sampling head for a group, x [Bg, T, D] -> (each position's
    token [Bg, T'], its TokenLogprobs [Bg, T', ...] or None): position i of a row is
    decode step j + i, and its token is drawn with the row's key at that step (less
    its key_offset) among the tokens allowed there (`sampling.choose_tokens`)."""
    shape, inputs, row0 = run.shape, run.inputs, group.row0
    Bg, T_out = x.shape[0], shape.T_out
    steps = group.step[:, None] + jnp.arange(shape.T, dtype=jnp.int32)  # [Bg, T]
    allowed = rows(inputs.allowed, row0, Bg) if shape.constrained else None
    if shape.last_only:
        at = jnp.maximum(group.count - 1, 0)[:, None]  # [Bg, 1]
        x = jnp.take_along_axis(x, at[:, :, None], axis=1)
        steps = jnp.take_along_axis(steps, at, axis=1)
        if shape.constrained:
            allowed = jnp.take_along_axis(allowed, at[:, :, None], axis=1)
    local = run.model.logits(x).reshape(Bg * T_out, -1)  # [Bg T', V'/X]
    params = jax.tree.map(lambda a: jnp.repeat(rows(a, row0, Bg), T_out, axis=0), inputs.sampling)
    # The index of the token each position produces, as its key counts it.
    step = (steps + 1 - rows(inputs.key_offset, row0, Bg)[:, None]).reshape(-1)
    if shape.constrained:
        allowed = allowed.reshape(Bg * T_out, -1)
    split, V = run.model.split, run.cfg.V
    tok, lp, _ = choose_tokens(
        local, params, step, split, V, shape.sampled, allowed, shape.logprobs
    )
    lp = jax.tree.map(lambda a: a.reshape(Bg, T_out, *a.shape[1:]), lp)
    return tok.reshape(Bg, T_out), lp


class GroupPass(NamedTuple):
    """One group's rows in a pass of T tokens a row: `row0`, its first row in the
    batch, and per row [Bg]: the `step` and `position` of its first token, the `count`
    of its tokens that run (0: none) and its prompt's local slots."""

    row0: jax.Array
    step: jax.Array
    position: jax.Array
    count: jax.Array
    prompt_slots: jax.Array


def pass_stage(run: Run, kv: StageCache, x_in, group: GroupPass, active):
    """This stage's layers over a group's T tokens a row, x_in [Bg, T, D] -> (x [Bg, T,
    D], kv): token i of a row is decode step step + i and writes its K/V where that step
    would (`ring.decode_slot`), then the T queries attend over each `seq` device's own
    slots (`run.slot_pos` [B, slots/C], masked by position, so token i sees the context
    and tokens 0 .. i of its own row) and merge with LSE. Nothing runs where not
    `active`."""
    C, c = jax.lax.axis_size("seq"), jax.lax.axis_index("seq")
    T = x_in.shape[1]
    ahead = jnp.arange(T, dtype=jnp.int32)
    row0 = group.row0
    j = group.step[:, None] + ahead  # [Bg, T]: each token's step
    q_pos = group.position[:, None] + ahead  # [Bg, T]
    prompt_slots = group.prompt_slots[:, None]
    device, slot = decode_slot(j, prompt_slots, C)  # [Bg, T] each
    runs = ahead < group.count[:, None]  # [Bg, T]
    mine = active & runs & (c == device)
    # A bound on the local slots the row's tokens reach on any device: slots past it
    # hold nothing the row may see.
    filled = decode_slot(j[:, -1], group.prompt_slots, C)[1] + 1  # [Bg]
    group_slot_pos = rows(run.slot_pos, row0, x_in.shape[0])
    group_table = rows(run.table, row0, x_in.shape[0])
    scale = run.cfg.head_dim**-0.5

    def attend_at(layer):
        def attend(q, k, v, kv: StageCache):
            # Every token's K/V first (each at its own step's slot), then the queries
            # over the cache: token i sees tokens 0 .. i by position.
            ck = write_kv(kv.k, k, layer, group_table, slot, mine)
            cv = write_kv(kv.v, v, layer, group_table, slot, mine)
            o, _ = decode_attention(
                q,
                ck,
                cv,
                q_pos,
                group_slot_pos,
                table=group_table,
                axis_name=seq_axis(),
                scale=scale,
                at=(layer,),
                filled=filled,
            )
            return o, StageCache(ck, cv)

        return attend

    def compute(x, kv, gate):
        real = run.weights.real
        x, kv = run_stage(run.model, run.cfg, real, x, q_pos, kv, attend_at, run.gated, gate)
        return vary(x), kv

    return when(active, compute, x_in, kv, run.gated, run.always_active)


def _logprob_shapes(B: int, T: int, logprobs: bool) -> TokenLogprobs | None:
    if not logprobs:
        return None
    return TokenLogprobs(
        jax.ShapeDtypeStruct((B, T), jnp.float32),
        jax.ShapeDtypeStruct((B, T, TOP_LOGPROBS), jnp.float32),
        jax.ShapeDtypeStruct((B, T, TOP_LOGPROBS), jnp.int32),
    )


def common_prefix(a, b) -> int:
    """How many tokens sequences a and b share from the start (a row's drafts and the
    pass's tokens; a draft model's cached tokens and a row's; a run's tokens and plain
    decoding's)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
