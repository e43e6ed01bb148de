"""Token sampling: greedy, or temperature with top-k and top-p.

Random keys come from (seed, request index, step) only, so a request samples the same
tokens whatever its place in the batch, its group, the mesh or the tick it runs at.
Each row carries its own parameters (`RowSampling`), so greedy and sampled requests
with different settings share one compiled program.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qwen3_spmd.model.split import TensorSplit
from qwen3_spmd.ops.varying import make_varying
from qwen3_spmd.pipeline.requests import MAX_BANNED, RequestError
from qwen3_spmd.sharding.mesh import AXES


class SamplingError(RequestError):
    """Sampling parameters out of range (the message names them as `Sampling` does)."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 means greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __str__(self) -> str:
        if self == Sampling():
            return "greedy"
        return f"temperature {self.temperature} top-k {self.top_k} top-p {self.top_p}"

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):  # NaN fails too
            raise SamplingError(
                f"$temperature {self.temperature} must be a finite number >= 0 (0 = greedy)",
                "temperature",
            )
        if not 0 <= self.top_k < 2**31:  # a row's top_k is an int32
            raise SamplingError(
                f"$top_k {self.top_k} must be in [0, 2**31) (0 = off; past the vocabulary "
                "it keeps every token, as off)",
                "top_k",
            )
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"$top_p {self.top_p} must be in (0, 1] (1 = off)", "top_p")


def greedy(logits: jax.Array) -> jax.Array:
    """argmax over the last axis, first index on ties, [B, V] -> [B] int32.

    Written as max, then the smallest index holding it: XLA's CPU argmax over a
    150K-wide vocabulary is an order of magnitude slower for B > 1. A row holding NaN
    gives its first NaN, as numpy's argmax does (never an id outside the vocabulary)."""
    V = logits.shape[-1]
    hit = (logits == jnp.max(logits, axis=-1, keepdims=True)) | jnp.isnan(logits)
    return jnp.min(jnp.where(hit, jnp.arange(V, dtype=jnp.int32), V), axis=-1).astype(jnp.int32)


TOP_LOGPROBS = 5  # top log-probabilities reported per token, when asked


class Ban(NamedTuple):
    """Ids a row may not produce before step `until` (a request's min_tokens)."""

    until: int = 0
    ids: tuple[int, ...] = ()


class RowSampling(NamedTuple):
    """Each row's sampling parameters and key, [B] arrays (replicated, P()): one compiled
    program serves a batch that mixes greedy rows and rows with their own settings."""

    temperature: jax.Array  # [B] float32: 0 = greedy
    top_k: jax.Array  # [B] int32: 0 = off
    top_p: jax.Array  # [B] float32: 1 = off
    seed: jax.Array  # [B] int32: the request's seed
    request: jax.Array  # [B] int32: folded into the key after the seed
    ban_until: jax.Array  # [B] int32: steps before this one cannot produce ban_ids
    ban_ids: jax.Array  # [B, MAX_BANNED] int32, -1 padded
    # [B] int32: tokens the row's request made before it was preempted (its prompt ends
    # with them): its steps count from there, for its keys and bans
    step0: jax.Array

    @classmethod
    def of(cls, sampling: Sampling, seed: int, request) -> RowSampling:
        """Host arrays: every row with `sampling` and `seed`, keyed by its `request`."""
        request = np.asarray(request, np.int32)
        return cls.stack([(sampling, seed, int(r)) for r in request])

    @classmethod
    def stack(cls, rows: list[tuple]) -> RowSampling:
        """Host arrays from (sampling, seed, request[, Ban[, step0]]) for each row."""
        bans = [Ban(*r[3]) if len(r) > 3 else Ban() for r in rows]
        # A ban of more ids than MAX_BANNED was refused by requests.check_request.
        ids = np.full((len(rows), MAX_BANNED), -1, np.int32)
        for b, ban in enumerate(bans):
            ids[b, : len(ban.ids)] = ban.ids[:MAX_BANNED]
        return cls(
            np.array([r[0].temperature for r in rows], np.float32),
            np.array([r[0].top_k for r in rows], np.int32),
            np.array([r[0].top_p for r in rows], np.float32),
            np.array([r[1] for r in rows], np.int32),
            np.array([r[2] for r in rows], np.int32),
            np.array([ban.until for ban in bans], np.int32),
            ids,
            np.array([r[4] if len(r) > 4 else 0 for r in rows], np.int32),
        )


def sample(
    logits: jax.Array, request: jax.Array, step: jax.Array, seed: jax.Array, cfg: Sampling
) -> jax.Array:
    """Next tokens, every row with the same `cfg` and `seed`.

    Args:
      logits: [B, V] float32; request: [B] int32 request indices; step: [B] or scalar
        int32, the index of the token being produced; seed: scalar int32.
    Returns:
      tokens [B] int32.
    """
    B = logits.shape[0]
    rows = RowSampling(
        jnp.full((B,), cfg.temperature, jnp.float32),
        jnp.full((B,), cfg.top_k, jnp.int32),
        jnp.full((B,), cfg.top_p, jnp.float32),
        jnp.broadcast_to(jnp.asarray(seed, jnp.int32), (B,)),
        request,
        jnp.zeros((B,), jnp.int32),
        jnp.full((B, MAX_BANNED), -1, jnp.int32),
        jnp.zeros((B,), jnp.int32),
    )
    return sample_rows(logits, rows, step, sampled=cfg.temperature > 0)


def sample_rows(
    logits: jax.Array,
    rows: RowSampling,
    step,
    sampled: bool = True,
    allowed: jax.Array | None = None,
) -> jax.Array:
    """Next tokens, each row with its own parameters; a row samples with the key
    (seed, request, step) and nothing else, so it draws the same token whatever its
    place in the batch, its group, the mesh or the tick it runs at.

    Args:
      logits: [B, V] float32; rows: RowSampling of [B] arrays; step: [B] or scalar int32,
        the index of the token being produced. sampled=False (static) promises every row
        is greedy and skips the filters. allowed: [B, ceil(V/32)] int32, each row's
        allowed tokens as packed bits (`only_allowed`; a structured output's grammar),
        None when no row is constrained.
    Returns:
      tokens [B] int32.
    """
    logits = only_allowed(ban(logits, rows, step), allowed)
    argmax = greedy(logits)
    if not sampled:
        return argmax
    hot = rows.temperature > 0
    # Rows that are all greedy skip the sort of the vocabulary, so a program that may
    # sample serves them as fast as a greedy one (a server then need not wait for both).
    return jax.lax.cond(
        jnp.any(hot), lambda: _filtered_draw(logits, rows, step, hot, argmax), lambda: argmax
    )


def _filtered_draw(logits, rows: RowSampling, step, hot, argmax) -> jax.Array:
    """`sample_rows`' draw: each hot row's token from its temperature, top-k and top-p;
    the others' argmax."""
    B, V = logits.shape
    x = logits / jnp.where(hot, rows.temperature, 1.0)[:, None]
    # Filters as thresholds on the row's sorted values (one sort serves every row's k
    # and p): top-k keeps values >= the k-th largest, top-p the smallest prefix of the
    # sorted values whose mass reaches p (the first always stays).
    desc = -jnp.sort(-x, axis=-1)
    k = jnp.where((rows.top_k > 0) & (rows.top_k < V), rows.top_k, V)
    x = jnp.where(x < jnp.take_along_axis(desc, k[:, None] - 1, axis=-1), -jnp.inf, x)
    desc = jnp.where(jnp.arange(V) < k[:, None], desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    kept = jnp.sum((jnp.cumsum(probs, axis=-1) - probs) < rows.top_p[:, None], axis=-1)
    last = jnp.take_along_axis(desc, jnp.maximum(kept, 1)[:, None] - 1, axis=-1)
    x = jnp.where((rows.top_p < 1.0)[:, None] & (x < last), -jnp.inf, x)
    step = jnp.broadcast_to(step, (B,)) + rows.step0

    def one(seed, r, s, row):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), r), s)
        return jax.random.categorical(key, row)

    drawn = jax.vmap(one)(rows.seed, rows.request, step, x).astype(jnp.int32)
    return jnp.where(hot, drawn, argmax)


def ban(logits: jax.Array, rows: RowSampling, step, first=0) -> jax.Array:
    """logits [B, V] with each row's banned ids at -inf while step < its ban_until.
    first: the id of column 0 (a device's block of a vocabulary split over `tensor`)."""
    B, V = logits.shape
    on = jnp.broadcast_to(step, (B,)) + rows.step0 < rows.ban_until
    ids = rows.ban_ids - first
    ids = jnp.where(on[:, None] & (rows.ban_ids >= 0) & (ids >= 0), ids, V)  # V: dropped
    return logits.at[jnp.arange(B)[:, None], ids].set(-jnp.inf, mode="drop")


def only_allowed(logits: jax.Array, allowed: jax.Array | None, first=0) -> jax.Array:
    """logits [B, V] with each row's tokens outside `allowed` at -inf (before greedy or
    sampled choice, so both pick within the grammar).

    allowed: [B, W] int32, bit i % 32 of word i // 32 set where id i may come next (the
    layout of llguidance's bitmasks, W = ceil(V_model / 32)); an unconstrained row's
    words are all ones (-1). Ids past 32 W (a vocabulary padded for `tensor`) are never
    allowed. None: logits unchanged. first: the id of column 0 (a device's block of a
    vocabulary split over `tensor`: each device reads its block's bits only)."""
    if allowed is None:
        return logits
    B, V = logits.shape
    # Unpacked by shifts and a reshape, not a gather of words per id (an order of
    # magnitude slower on XLA's CPU over a 150K vocabulary): bit i of the row is id i.
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    bits = jnp.pad(bits.reshape(B, -1).astype(jnp.bool_), ((0, 0), (0, V)))  # past 32 W: off
    on = jax.lax.dynamic_slice_in_dim(bits, first, V, axis=1)
    return jnp.where(on, logits, -jnp.inf)


# ---- logits split by vocabulary over `tensor` (model.split) ----------------------------


def gather_vocab(local: jax.Array, split: TensorSplit, vocab: int) -> jax.Array:
    """Each device's vocabulary block [B, V'/X] -> the whole logits [B, V] on every
    `tensor` device (X = 1: local)."""
    if split.size == 1:
        return local
    return jax.lax.all_gather(local, split.axis, axis=1, tiled=True)[:, :vocab]


def greedy_split(
    local: jax.Array,
    rows: RowSampling,
    step,
    split: TensorSplit,
    allowed: jax.Array | None = None,
) -> jax.Array:
    """`sample_rows`' greedy tokens [B] from logits split by vocabulary, local
    [B, V'/X]: each device's best value and id (its bans and its block's part of the
    `allowed` bits applied), then only those X pairs gathered, never the vocabulary.
    The first device holding the largest value wins, which is the lowest id, as
    `greedy` breaks ties."""
    first = split.first(local.shape[-1])
    local = only_allowed(ban(local, rows, step, first), allowed, first)
    best = greedy(local)
    value = jnp.take_along_axis(local, best[:, None], axis=-1)[:, 0]
    values = jax.lax.all_gather(value, split.axis)  # [X, B]
    ids = jax.lax.all_gather(best + first, split.axis)  # [X, B]
    device = greedy(values.T)
    return jnp.take_along_axis(ids.T, device[:, None], axis=-1)[:, 0]


class TokenLogprobs(NamedTuple):
    """Log-probabilities of the model's distribution (the raw logits, before
    temperature and filters, as vLLM reports them by default)."""

    chosen: jax.Array  # [B] float32: of the token produced
    top: jax.Array  # [B, TOP_LOGPROBS] float32: the largest, in decreasing order
    top_ids: jax.Array  # [B, TOP_LOGPROBS] int32: their ids


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> TokenLogprobs:
    """logits [B, V], tokens [B] -> TokenLogprobs of [B] / [B, TOP_LOGPROBS] arrays."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    top, top_ids = jax.lax.top_k(lp, TOP_LOGPROBS)
    return TokenLogprobs(chosen, top, top_ids.astype(jnp.int32))


# ---- the sampling head: a program's last-position logits to tokens ---------------------


class Chosen(NamedTuple):
    """The sampling head's result for R rows (`choose_tokens`)."""

    tokens: jax.Array  # [R] int32
    logprobs: TokenLogprobs | None  # fields [R] and [R, TOP_LOGPROBS] where asked, else None
    logits: jax.Array  # [keep, V] float32: the first `keep` rows' whole logits


def choose_tokens(
    local: jax.Array,
    rows: RowSampling,
    step,
    split: TensorSplit,
    vocab: int,
    sampled: bool,
    allowed: jax.Array | None = None,
    logprobs: bool = False,
    keep: int = 0,
    lazy: bool = False,
) -> Chosen:
    """Each row's token from this device's block of its logits, local [R, V'/X]
    (`model.split`), as `sample_rows` chooses from the whole row: with the row's
    parameters and bans `rows` ([R]), its key at `step` ([R] or scalar), within its
    `allowed` tokens ([R, W] packed bits, or None). logprobs: also the tokens'
    TokenLogprobs; keep: also the first `keep` rows' whole logits.

    Filters and log-probabilities need a row's whole distribution: the vocabulary is
    gathered over `tensor` (small beside the weights). Greedy rows need only each
    device's best (value, id) pair (`greedy_split`). sampled=False promises every row is
    greedy; sampled=True samples where a row asks to, and with lazy=True decides at run
    time whether the vocabulary is gathered: a block of greedy rows only takes the pairs
    (every `tensor` device holds the same rows' parameters, so all take one branch).
    Called inside the programs' shard_map (decode, verify, the speculative loop)."""

    def whole() -> Chosen:
        logits = gather_vocab(local, split, vocab)  # [R, V]
        tokens = sample_rows(logits, rows, step, sampled, allowed)
        return Chosen(tokens, token_logprobs(logits, tokens) if logprobs else None, logits[:keep])

    def pairs() -> Chosen:
        tokens = greedy_split(local, rows, step, split, allowed)
        kept = gather_vocab(local[:keep], split, vocab) if keep else jnp.zeros((0, vocab))
        return Chosen(tokens, None, kept)

    if split.size == 1 or logprobs or (sampled and not lazy):
        return whole()
    if not sampled:
        return pairs()

    def varying(chosen: Chosen) -> Chosen:  # both branches typed alike (as on_last_stage's)
        return jax.tree.map(lambda x: make_varying(x, frozenset(AXES)), chosen)

    return jax.lax.cond(
        jnp.any(rows.temperature > 0), lambda: varying(whole()), lambda: varying(pairs())
    )


# ---- the prompt's log-probabilities (vocabulary-parallel) ------------------------------


class PromptLogprobs(NamedTuple):
    """Per prompt token (the prefill's [B, T] layout: zigzag device order): the
    log-probability of the next prompt token under the model (the raw logits), its rank
    (1 = the most likely), and the TOP_LOGPROBS most likely, in decreasing order. Where
    a token has no next one (a prompt's last, padding) the fields hold zeros."""

    chosen: jax.Array  # [B, T] float32
    rank: jax.Array  # [B, T] int32
    top: jax.Array  # [B, T, TOP_LOGPROBS] float32
    top_ids: jax.Array  # [B, T, TOP_LOGPROBS] int32


def split_logprobs(local: jax.Array, targets: jax.Array, split: TensorSplit) -> PromptLogprobs:
    """Log-probabilities of `targets` [B, T] (-1: none) under logits split by vocabulary,
    local [B, T, V'/X] (this device's block, padding ids at -inf), and the top ones:
    a log-softmax whose max, sum of exponentials, chosen logit, rank and top candidates
    are reduced over `tensor` (never the vocabulary gathered). X = 1: plain log_softmax.

    The chosen and the top values are one expression, (logit - max) - log(sum), so a
    token that is its position's most likely has its top-1 value bit for bit (harnesses
    decide "greedy" by equality)."""
    rows = local.shape[-1]
    first = split.first(rows)
    m = jnp.max(local, axis=-1)
    if split.size > 1:
        m = jax.lax.pmax(m, split.axis)
    log_sum = jnp.log(split.sum(jnp.sum(jnp.exp(local - m[..., None]), axis=-1)))

    def normed(logit):  # [B, T] or [B, T, k] logits -> log-probabilities
        shape = (*m.shape, *([1] * (logit.ndim - m.ndim)))
        return (logit - m.reshape(shape)) - log_sum.reshape(shape)

    here = targets - first
    mine = (here >= 0) & (here < rows)
    picked = jnp.take_along_axis(local, jnp.clip(here, 0, rows - 1)[..., None], axis=-1)[..., 0]
    logit = split.sum(jnp.where(mine, picked, 0.0))  # one device adds it, the rest zeros
    rank = split.sum(jnp.sum(local > logit[..., None], axis=-1, dtype=jnp.int32)) + 1
    top, ids = jax.lax.top_k(local, TOP_LOGPROBS)
    ids = ids.astype(jnp.int32) + first
    if split.size > 1:
        # Each device's k best, gathered in device order (ascending ids), then the k
        # best of those: ties go to the lowest id, as top_k over the whole row.
        top = jax.lax.all_gather(top, split.axis, axis=-1, tiled=True)
        ids = jax.lax.all_gather(ids, split.axis, axis=-1, tiled=True)
        top, at = jax.lax.top_k(top, TOP_LOGPROBS)
        ids = jnp.take_along_axis(ids, at, axis=-1)
    some = targets >= 0
    return PromptLogprobs(
        jnp.where(some, normed(logit), 0.0),
        jnp.where(some, rank, 0),
        normed(top),
        ids,
    )


def prompt_logprob_shapes(B: int, T: int) -> PromptLogprobs:
    """PromptLogprobs' shapes for B rows of T tokens."""
    return PromptLogprobs(
        jax.ShapeDtypeStruct((B, T), jnp.float32),
        jax.ShapeDtypeStruct((B, T), jnp.int32),
        jax.ShapeDtypeStruct((B, T, TOP_LOGPROBS), jnp.float32),
        jax.ShapeDtypeStruct((B, T, TOP_LOGPROBS), jnp.int32),
    )
