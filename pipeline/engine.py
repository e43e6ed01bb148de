"""The engine: one code path for every mesh shape, 1x1 included.

`Engine` places the weights on a ('stage', 'seq', 'tensor') mesh once and runs the programs
(prefill, decode chunk, in-place K/V inserts, row moves and the prefix cache's block
copies), each compiled once per shape. It knows nothing of requests and rounds: the
executor (`pipeline.executor`) runs a Round's programs through it, and a static batch
(`pipeline.static_batch.generate`) is a round of those.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qwen3_spmd.model.cache import KVCache
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.params import abstract_model, map_params
from qwen3_spmd.model.split import TensorSplit
from qwen3_spmd.pipeline import cp_cost
from qwen3_spmd.pipeline.decode import DecodeInputs, build_decode
from qwen3_spmd.pipeline.layout import Batch, bucket, lay_out
from qwen3_spmd.pipeline.prefill import PrefillInputs, build_prefill
from qwen3_spmd.pipeline.prefix import BlockPool, copy_blocks
from qwen3_spmd.pipeline.programs import Clock, OnCompile, Programs
from qwen3_spmd.pipeline.requests import RequestError, check_request
from qwen3_spmd.pipeline.sampling import (
    PromptLogprobs,
    RowSampling,
    Sampling,
    TokenLogprobs,
    sample_rows,
    token_logprobs,
)
from qwen3_spmd.pipeline.schedule import decode_grid, prefill_grid, stats
from qwen3_spmd.pipeline.stage import CACHE_SPECS, Weights
from qwen3_spmd.sharding.mesh import AXES, MeshError
from qwen3_spmd.sharding.place import WeightSource, place_state
from qwen3_spmd.sharding.specs import SPECS, param_spec
from qwen3_spmd.sharding.stages import StagePlan


def _put_rows(cache: KVCache, new: KVCache, rows) -> KVCache:
    """Engine.insert's update: row r of `new` into row rows[r] (past the rows: dropped)."""
    k = cache.k.at[:, rows].set(new.k, mode="drop")
    v = cache.v.at[:, rows].set(new.v, mode="drop")
    return KVCache(k, v, cache.pos)


def _move_rows(cache: KVCache, src, dst) -> KVCache:
    """Engine.move_rows' update: row src[i] into row dst[i] (past the rows: dropped)."""
    k = cache.k.at[:, dst].set(cache.k[:, src], mode="drop")
    v = cache.v.at[:, dst].set(cache.v[:, src], mode="drop")
    return KVCache(k, v, cache.pos)


class Engine:
    """Qwen3 on a mesh. Weights are placed once; programs compile per batch shape.

    Args:
      cfg: the model config.
      source: where weights come from (HFCheckpoint, RandomWeights, ...).
      mesh: a ('stage', 'seq', 'tensor') mesh (sharding.make_mesh).
      dtype: compute and storage dtype.
      max_seq_len: KV cache capacity per request (prompt + new tokens); each `seq`
        device holds ceil(max_seq_len / C) slots.
      microbatches: M for prefill.
      groups: decode groups (default: the stage count, or the number of requests when
        fewer; a batch smaller than the stage count then runs with bubbles).
      chunk: decode steps per on-device chunk.
      poison: NaN in pipeline bubbles (tests).
      on_compile: called with a program's name around each compile the caller waits for
        (`pipeline.programs.OnCompile`).
      cp: how prompt attention splits along `seq`: "ring", "ulysses" (C must divide
        the N query heads) or "auto" (per batch, the smaller time of
        pipeline.cp_cost's model). The KV cache left behind is the same either way.
      experts: Qwen3-MoE over `tensor`: "tp" every expert's columns split (default),
        "ep" whole experts per device (model.split).
      link_bytes_per_s, flops_per_s: the link bandwidth (one figure, or one per
        collective: cp_cost.link_rate) and matmul throughput `auto` assumes (default:
        cp_cost.nominal for the platform; bench measures them). On CPU the throughput
        is the host's, shared by the mesh's emulated devices.
    """

    def __init__(
        self,
        cfg: Qwen3Config,
        source: WeightSource,
        mesh: Mesh,
        dtype=jnp.float32,
        max_seq_len: int = 512,
        microbatches: int = 1,
        groups: int | None = None,
        chunk: int = 16,
        poison: bool = False,
        on_compile: OnCompile | None = None,
        cp: str = "ring",
        link_bytes_per_s: float | dict | None = None,
        flops_per_s: float | None = None,
        experts: str = "tp",
    ):
        if tuple(mesh.axis_names) != AXES:
            raise MeshError(
                f"the mesh's axes are {tuple(mesh.axis_names)}, not {AXES}: build it with "
                "qwen3_spmd.sharding.mesh.make_mesh(stage, seq, devices, tensor=X)"
            )
        self.cfg, self.mesh, self.dtype = cfg, mesh, jnp.dtype(dtype)
        self.stages, self.C = mesh.shape["stage"], mesh.shape["seq"]
        self.split = TensorSplit(mesh.shape["tensor"], experts)
        self.split.check(cfg)
        self.plan = StagePlan(cfg.L, self.stages)
        for name, value, least in (
            ("microbatches", microbatches, 1),
            ("groups", groups, 1),
            ("max_seq_len", max_seq_len, 1),
            ("chunk", chunk, 1),
        ):
            if value is not None and value < least:
                raise RequestError(f"${name} {value} must be at least {least}", name)
        self.M, self.groups, self.chunk, self.poison = microbatches, groups, chunk, poison
        self.max_seq_len = max_seq_len
        cp_cost.check_cp(self.split.local(cfg), self.C, cp)
        self.cp = cp
        platform = mesh.devices.flat[0].platform
        link, flops = cp_cost.nominal(platform)
        self.link_bytes_per_s = link_bytes_per_s or link
        # CPU devices are emulated on one host: working at once, they share its rate.
        shared = mesh.devices.size if platform == "cpu" else 1
        self.flops_per_s = (flops_per_s or flops) / shared
        self.slots_per_device = math.ceil(max_seq_len / self.C)
        graphdef, abstract = abstract_model(cfg, self.dtype, self.split)
        self.graphdef = graphdef
        state = place_state(abstract, self.plan, mesh, source, self.split)
        self.weights = Weights(
            state, jax.device_put(self.plan.real_slots, NamedSharding(mesh, SPECS.layers))
        )
        self.state_specs = map_params(lambda path, x: param_spec(path, experts), state)
        self.programs = Programs(self.dtype, on_compile)
        self._prefill: dict[tuple, Callable] = {}  # (cp strategy, with context) -> jitted
        self._decode: dict[tuple, Callable] = {}
        # Small jitted helpers: zeros per cache shape, row inserts per inserted rows.
        self._helpers: dict[tuple, Callable] = {}
        self._making = threading.Lock()  # guards the dicts of jitted functions above
        # A pipeline.speculative.Speculator (set by speculative.attach) makes decode
        # rounds verify its drafts, with the same tokens; None: plain decoding.
        self.speculator = None
        self._sample = jax.jit(sample_rows, static_argnames="sampled")
        self._logprobs = jax.jit(token_logprobs)

    # ---- checks and sizes ----------------------------------------------------------

    def check(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        min_tokens: int = 0,
        eos_ids: tuple[int, ...] = (),
    ) -> None:
        """Every precondition of a request, in words, before anything compiles
        (`requests.check_request` on this engine's model and cache)."""
        check_request(
            self.cfg, self.C, self.max_seq_len, prompts, max_new_tokens, min_tokens, eos_ids
        )

    def groups_for(self, n: int) -> int:
        """Decode groups for n requests."""
        return self.groups if self.groups is not None else min(self.stages, n)

    def lay_out(self, prompts: list[list[int]]) -> Batch:
        return lay_out(
            prompts, self.M, self.groups_for(len(prompts)), self.C, self.slots_per_device
        )

    def cache_shape(self, B: int) -> tuple[int, ...]:
        """k and v [L_pad, B, K', S_cap, H] (heads-major: model.cache; K' the KV heads as
        placed, repeats included: model.split)."""
        K = self.split.kv_heads(self.cfg)
        return (self.plan.padded_layers, B, K, self.slots_per_device * self.C, self.cfg.H)

    def _placed(self, x: np.ndarray, spec) -> jax.Array:
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def new_cache(self, batch: Batch) -> KVCache:
        """Zeroed k, v and the batch's slot positions, sharded as CACHE_SPECS."""
        return self._zeroed_cache(batch.B, self._slot_pos(batch))

    def empty_cache(self, B: int) -> KVCache:
        """A cache of B rows that holds nothing (every slot position -1)."""
        empty = np.full((B, self.slots_per_device * self.C), -1, np.int32)
        return self._zeroed_cache(B, self._placed(empty, SPECS.slots_bs))

    def _zeroed_cache(self, B: int, pos: jax.Array) -> KVCache:
        zeros = self._zeros(B)
        return KVCache(zeros(), zeros(), pos)

    def _zeros(self, B: int):
        """The jitted maker of a zeroed k (or v) of B rows, sharded as the cache."""
        shape = self.cache_shape(B)
        return self._jitted(
            self._helpers,
            shape,
            lambda: jax.jit(
                lambda: jnp.zeros(shape, self.dtype),
                out_shardings=NamedSharding(self.mesh, SPECS.cache_lbksh),
            ),
        )

    def insert(self, cache: KVCache, new: KVCache, rows: np.ndarray) -> KVCache:
        """cache (donated, updated in place) with k and v row r of `new` written into row
        rows[r] (rows[r] >= cache's B: row r is left out). Both caches have the same
        slots; the caller keeps the slot positions."""
        return self._insert_fn(new.k.shape[1])(cache, new, np.asarray(rows, np.int32))

    def _insert_fn(self, B: int):
        return self._in_place(("insert", B), _put_rows)

    def move_rows(self, cache: KVCache, src: np.ndarray, dst: np.ndarray) -> KVCache:
        """cache (donated, updated in place) with the k and v of row src[i] copied into
        row dst[i], for src, dst [n] (padded to a power of two: few programs). The
        caller moves the slot positions."""
        n = bucket(len(src), 1)
        src = np.pad(np.asarray(src, np.int32), (0, n - len(src)))
        past = cache.k.shape[1]  # padding moves to past the rows: dropped
        dst = np.pad(np.asarray(dst, np.int32), (0, n - len(dst)), constant_values=past)
        return self._move_fn(n)(cache, src, dst)

    def _move_fn(self, n: int):
        return self._in_place(("move", n), _move_rows)

    # ---- the prefix cache's pool (pipeline.prefix) -------------------------------------

    def empty_pool(self, slots: int, block: int) -> BlockPool:
        """A pool of `slots` prompt blocks of `block` tokens, zeroed, sharded as the
        cache: k and v [L_pad, slots, K', block, H] (each `seq` device its block / C
        slots of every block)."""
        L, _, K, _, H = self.cache_shape(1)
        shape = (L, slots, K, block, H)
        zeros = self._jitted(
            self._helpers,
            ("pool", shape),
            lambda: jax.jit(
                lambda: jnp.zeros(shape, self.dtype),
                out_shardings=NamedSharding(self.mesh, SPECS.cache_lbksh),
            ),
        )
        return BlockPool(zeros(), zeros())

    def cache_bytes_per_device(self, B: int) -> int:
        """Bytes of a KV cache of B rows (k and v) on each device."""
        return 2 * math.prod(self.cache_shape(B)) * self.dtype.itemsize // self.mesh.devices.size

    def pool_bytes_per_block(self, block: int) -> int:
        """Bytes of one pool block (k and v) on each device."""
        L, _, K, _, H = self.cache_shape(1)
        per_device = L // self.stages * (K // self.split.size) * (block // self.C) * H
        return 2 * per_device * self.dtype.itemsize

    def save_blocks(self, pool: BlockPool, cache: KVCache, saves, slots=None) -> BlockPool:
        """pool (donated, updated in place) with, for each `pipeline.prefix.Save`, block
        `block` of cache row `row` written into pool slot `slot`. slots: [len(saves), n]
        the local row slots each block's n pool slots take, in order (the same on every
        device); None: a prompt's block layout, block j at [j n, (j + 1) n). No byte moves
        between devices: each holds the same share of a block in the row and in the
        pool."""
        n = pool.k.shape[3] // self.C  # a block's local slots
        if slots is None:
            slots = [s.block * n + np.arange(n) for s in saves]
        at_pool = [(s.slot, 0) for s in saves]
        k, v = self._copy_blocks(pool, (cache.k, cache.v), at_pool, [s.row for s in saves], slots)
        return BlockPool(k, v)

    def load_blocks(self, cache: KVCache, pool: BlockPool, row: int, slots) -> KVCache:
        """cache (donated, updated in place) with pool slots[j] written into block j of
        row `row` (its slot positions are the caller's to set)."""
        n = pool.k.shape[3] // self.C
        at_row = [(row, j * n) for j in range(len(slots))]
        whole = [np.arange(n)] * len(slots)
        k, v = self._copy_blocks((cache.k, cache.v), pool, at_row, list(slots), whole)
        return cache._replace(k=k, v=v)

    def _copy_blocks(self, dst, src, dst_at, src_at, src_slots):
        """(k, v) of dst (donated) with blocks of src copied in
        (`pipeline.prefix.copy_blocks`); the index lists are padded to the most blocks a
        row holds, so one program serves every count."""
        fn, most, n = self._copy_fn(dst[0].shape, src[0].shape)
        for i in range(0, len(dst_at), most):  # a round's saves may span several rows
            count = len(dst_at[i : i + most])
            pad = most - count
            at = np.array(list(dst_at[i : i + most]) + [(0, 0)] * pad, np.int32)
            rows = np.array(list(src_at[i : i + most]) + [0] * pad, np.int32)
            slots = np.zeros((most, n), np.int32)
            slots[:count] = np.asarray(src_slots[i : i + most], np.int32).reshape(count, n)
            dst = fn(*dst, *src, np.int32(count), at, rows, slots)
        return dst

    def _copy_fn(self, dst_shape: tuple, src_shape: tuple):
        """(the jitted copy between arrays of these shapes, the most blocks it copies at
        once: a row's, a block's local slots)."""
        n = min(src_shape[3], dst_shape[3]) // self.C  # a block's local slots: the pool's
        key = ("blocks", dst_shape, src_shape)
        fn = self._jitted(self._helpers, key, self._copy_program)
        return fn, self.slots_per_device // n, n

    def _copy_program(self):
        spec, one = SPECS.cache_lbksh, P()

        def local(dst_k, dst_v, src_k, src_v, count, dst_at, src_at, src_slots):
            return (
                copy_blocks(dst_k, src_k, count, dst_at, src_at, src_slots),
                copy_blocks(dst_v, src_v, count, dst_at, src_at, src_slots),
            )

        mapped = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(spec, spec, spec, spec, one, one, one, one),
            out_specs=(spec, spec),
        )
        return jax.jit(mapped, donate_argnums=(0, 1))

    def _in_place(self, key: tuple, update):
        """update(cache, ...) -> KVCache, jitted once per key with the cache donated, so
        XLA writes the rows it changes into the cache's own buffers."""

        def make():
            spec = NamedSharding(self.mesh, SPECS.cache_lbksh)
            pos = NamedSharding(self.mesh, SPECS.slots_bs)
            return jax.jit(update, donate_argnums=0, out_shardings=KVCache(spec, spec, pos))

        return self._jitted(self._helpers, key, make)

    def _jitted(self, table: dict, key, make: Callable):
        """table[key], made by make() the first time: once, though precompile's threads
        ask at once (a second jitted function would compile again)."""
        if key not in table:
            with self._making:
                if key not in table:
                    table[key] = make()
        return table[key]

    def with_slot_pos(self, cache: KVCache, slot_pos: np.ndarray) -> KVCache:
        """cache with its slot positions replaced by the host's slot_pos [B, C, S_loc]."""
        B = slot_pos.shape[0]
        return cache._replace(pos=self._placed(slot_pos.reshape(B, -1), SPECS.slots_bs))

    def _slot_pos(self, batch: Batch) -> jax.Array:
        return self._placed(batch.slot_pos.reshape(batch.B, -1), SPECS.slots_bs)

    def _abstract(self, tree, specs):
        """Arrays' shapes, dtypes and shardings on the mesh, for lowering ahead."""
        return jax.tree.map(
            lambda x, spec: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(self.mesh, spec)
            ),
            tree,
            specs,
        )

    def _abstract_cache(self, B: int) -> KVCache:
        kv = jax.ShapeDtypeStruct(self.cache_shape(B), self.dtype)
        return self._abstract(
            KVCache(kv, kv, jax.ShapeDtypeStruct((B, self.slots_per_device * self.C), jnp.int32)),
            CACHE_SPECS,
        )

    def prefill_memory(self, batch: int, prompt_len: int) -> dict:
        """Per-device bytes of the prefill program for `batch` prompts of `prompt_len`
        tokens, from XLA's memory analysis of the compiled program (nothing runs).

        total = arguments (weights, cache, tokens) + outputs + temporaries - aliased
        (the donated cache is updated in place, so it counts once).
        """
        laid = lay_out([[0] * prompt_len] * batch, 1, 1, self.C, self.slots_per_device)
        inputs = self._abstract(laid.prefill, PrefillInputs.specs())
        prefill = self._prefill_fn(self.cp_plan(batch, laid.P_pad)[0])
        m = (
            prefill.lower(self.weights, self._abstract_cache(batch), inputs)
            .compile()
            .memory_analysis()
        )
        out = {
            "argument": m.argument_size_in_bytes,
            "output": m.output_size_in_bytes,
            "temp": m.temp_size_in_bytes,
            "alias": m.alias_size_in_bytes,
        }
        out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
        return out

    # ---- the programs --------------------------------------------------------------

    def _prefill_fn(
        self,
        strategy: str,
        with_context: bool = False,
        block: int | None = None,
        prompt_logprobs: bool = False,
    ):
        key = (strategy, with_context, block, prompt_logprobs)
        return self._jitted(
            self._prefill,
            key,
            lambda: jax.jit(
                build_prefill(
                    self.cfg,
                    self.graphdef,
                    self.state_specs,
                    self.mesh,
                    self.M,
                    self.dtype,
                    self.poison,
                    strategy,
                    with_context,
                    block,
                    prompt_logprobs,
                ),
                donate_argnames="cache",
            ),
        )

    def cp_plan(self, batch: int, padded_len: int) -> tuple[str, dict]:
        """(the strategy prefill runs for `batch` prompts padded to `padded_len`,
        pipeline.cp_cost.predict's figures for each strategy that can run)."""
        prefill = cp_cost.Prefill(
            cfg=self.split.local(self.cfg),  # per device: its heads and columns
            seq=self.C,
            stages=self.stages,
            microbatches=self.M,
            batch=batch,
            padded_len=padded_len,
            itemsize=self.dtype.itemsize,
        )
        return cp_cost.choose(
            self.cp,
            prefill,
            cp_cost.Rates(link_bytes_per_s=self.link_bytes_per_s, flops_per_s=self.flops_per_s),
        )

    @staticmethod
    def prefill_name(
        strategy: str, with_context: bool, block: int | None = None, prompt_logprobs: bool = False
    ) -> tuple:
        """The prefill program's name: its cp strategy, whether it continues a cache, the
        block of a prefix cache's layout, and whether it scores every prompt token."""
        name = ("prefill",) if strategy == "ring" else ("prefill", strategy)
        name += ("context",) if with_context else ()
        name += ("blocks", block) if block is not None else ()
        return name + (("prompt_logprobs",) if prompt_logprobs else ())

    @staticmethod
    def decode_name(
        groups: int,
        steps: int,
        sampled: bool,
        with_logits: bool,
        logprobs: bool = False,
        constrained: bool = False,
    ) -> tuple:
        """The decode program's name: every static choice that shapes it."""
        name = ("decode", groups, steps, "sampled" if sampled else "greedy", with_logits)
        return name + (("logprobs",) if logprobs else ()) + (("allowed",) if constrained else ())

    def _decode_fn(
        self,
        groups: int,
        steps: int,
        sampled: bool,
        with_logits: bool,
        logprobs: bool = False,
        constrained: bool = False,
    ):
        key = (groups, steps, sampled, with_logits, logprobs, constrained)
        return self._jitted(
            self._decode,
            key,
            lambda: jax.jit(
                build_decode(
                    self.cfg,
                    self.graphdef,
                    self.state_specs,
                    self.mesh,
                    groups,
                    steps,
                    sampled,
                    with_logits,
                    logprobs,
                    constrained,
                ),
                donate_argnames="cache",
            ),
        )

    def _abstract_decode_inputs(self, rows: int, constrained: bool = False) -> DecodeInputs:
        """A decode chunk's inputs over `rows` rows as shapes on the mesh (for lowering
        ahead); constrained: with each row's allowed tokens."""
        inputs = DecodeInputs.empty(rows)
        if constrained:
            inputs = inputs._replace(allowed=np.zeros((rows, self.mask_words), np.int32))
        return self._abstract(inputs, DecodeInputs.specs(constrained))

    @property
    def mask_words(self) -> int:
        """W: int32 words of a row's allowed tokens, ceil(V / 32) (`sampling.only_allowed`)."""
        return -(-self.cfg.V // 32)

    def compile_decode_ahead(self, B: int, groups: int, sampled: bool, with_logits: bool):
        """Starts compiling a decode chunk's program over B rows while the prefill
        compiles and runs."""
        self.programs.ahead(
            self.decode_name(groups, self.chunk, sampled, with_logits),
            self._decode_fn(groups, self.chunk, sampled, with_logits),
            self.weights,
            self._abstract_cache(B),
            self._abstract_decode_inputs(B),
        )

    def _place_inputs(self, inputs, specs):
        """Host inputs onto the mesh as `specs` say (before the clock starts, as the old
        positional arguments were)."""
        return jax.tree.map(self._placed, inputs, specs)

    def _run(self, name: tuple, fn, clock: Clock, cache: KVCache, inputs):
        """The compiled program `name` on (weights, cache, inputs placed on the mesh)."""
        program, waited = self.programs.get(name, fn, self.weights, cache, inputs)
        clock.compile_s += waited
        return program(self.weights, cache, inputs)

    def prefill(
        self,
        batch: Batch,
        strategy: str,
        params: RowSampling,
        sampled: bool,
        clock: Clock,
        cache: KVCache | None = None,
        allowed: np.ndarray | None = None,
    ):
        """Runs the prefill of `batch` into a new cache and samples each row's first token
        with its `params` (host arrays [B]; sampled=False: every row is greedy) within
        its `allowed` tokens ([B, ceil(V/32)] packed bits, `sampling.only_allowed`;
        None: no row is constrained).
        A batch of later chunks (batch.offset > 0) continues `cache` (donated), whose pos
        must list the earlier chunks' slots; its prefill attends to them too. A batch
        laid out with targets (`layout.lay_out`) scores its prompts' tokens too.
        Returns (first tokens [B] numpy, logits [B, V], the cache, PromptLogprobs of
        numpy arrays [B, P_pad, ...] in the batch's device order, or None without
        targets)."""
        with_context = batch.offset > 0
        scored = batch.prefill.targets is not None
        if cache is None:
            cache = self.new_cache(batch)
        inputs = self._place_inputs(batch.prefill, PrefillInputs.specs(scored))
        fn = self._prefill_fn(strategy, with_context, batch.block, scored)
        name = self.prefill_name(strategy, with_context, batch.block, scored)
        compile_before = clock.compile_s
        t0 = time.perf_counter()
        logits, cache, *prompt = self._run(name, fn, clock, cache, inputs)
        first = self._sample(logits, params, np.int32(0), sampled=sampled, allowed=allowed)
        first = np.asarray(first)
        prompt = PromptLogprobs(*(np.asarray(x) for x in prompt[0])) if scored else None
        clock.prefill_s += time.perf_counter() - t0 - (clock.compile_s - compile_before)
        return first, logits, cache, prompt

    def logprobs(self, logits: jax.Array, tokens: np.ndarray) -> TokenLogprobs:
        """The log-probabilities of `tokens` [B] under `logits` [B, V] (a prefill's), and
        the top ones: TokenLogprobs of numpy arrays."""
        out = self._logprobs(logits, jnp.asarray(tokens, jnp.int32))
        return TokenLogprobs(*(np.asarray(x) for x in out))

    def decode(
        self,
        cache: KVCache,
        slot_pos: np.ndarray,
        inputs: DecodeInputs,
        groups: int,
        sampled: bool,
        with_logits: bool,
        clock: Clock,
        logprobs: bool = False,
    ):
        """One decode chunk (the program of `self.chunk` steps, `inputs.run_steps` of
        them run) on `cache`, donated, with its slot positions replaced by the host's
        slot_pos [B, C, S_loc] (which must list the slots the chunk writes:
        `layout.list_decode_slots`). inputs: host arrays (with `allowed`: the program
        that masks each row's choice). logprobs: also each new token's
        log-probabilities (DecodeOutputs.logprobs). Returns (DecodeOutputs on device,
        the cache)."""
        constrained = inputs.allowed is not None
        cache = self.with_slot_pos(cache, slot_pos)
        inputs = self._place_inputs(inputs, DecodeInputs.specs(constrained))
        name = self.decode_name(groups, self.chunk, sampled, with_logits, logprobs, constrained)
        fn = self._decode_fn(groups, self.chunk, sampled, with_logits, logprobs, constrained)
        compile_before = clock.compile_s
        t0 = time.perf_counter()
        out, cache = self._run(name, fn, clock, cache, inputs)
        out.tokens.block_until_ready()
        clock.decode_s += time.perf_counter() - t0 - (clock.compile_s - compile_before)
        return out, cache

    # ---- compiling ahead: what a server compiles at start -----------------------------

    def compile_prefill(
        self,
        B: int,
        P_pad: int,
        cache_rows: int,
        with_context: bool,
        announce: bool = True,
        block: int | None = None,
        prompt_logprobs: bool = False,
    ) -> None:
        """Compiles, where not compiled yet, all that `prefill` of B prompts padded to
        P_pad runs (with_context: later chunks of prompts, continuing a cache;
        prompt_logprobs: scoring every prompt token): a new cache's zeros, the prefill
        program, the first tokens' sampling (greedy and sampled) and log-probabilities,
        and `insert` of its rows into a cache of `cache_rows` rows. Nothing runs
        (compiling is local to this process: no collective, so a background thread may
        compile while rounds run). announce=False: no on_compile for the program.
        block: a prefix cache's layout."""
        targets = [[0] * P_pad] * B if prompt_logprobs else None
        laid = lay_out(
            [[0] * P_pad] * B, 1, 1, self.C, self.slots_per_device, block=block, targets=targets
        )
        strategy = self.cp_plan(B, P_pad)[0]
        program, _ = self.programs.get(
            self.prefill_name(strategy, with_context, block, prompt_logprobs),
            self._prefill_fn(strategy, with_context, block, prompt_logprobs),
            self.weights,
            self._abstract_cache(B),
            self._abstract(laid.prefill, PrefillInputs.specs(prompt_logprobs)),
            announce,
        )
        logits, new, *_ = (
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), out)
            for out in program.out_info
        )
        params = RowSampling.of(Sampling(), 0, laid.request)
        tokens = jax.ShapeDtypeStruct((B,), jnp.int32)
        step = jax.ShapeDtypeStruct((), jnp.int32)
        for sampled in (False, True):  # as `prefill` calls it (allowed: a keyword, None)
            self._sample.lower(logits, params, step, sampled=sampled, allowed=None).compile()
        self._logprobs.lower(logits, tokens).compile()
        if not with_context:
            self._zeros(B).lower().compile()
        self._insert_fn(B).lower(self._abstract_cache(cache_rows), new, tokens).compile()

    def compile_decode(
        self,
        rows: int,
        cache_rows: int,
        groups: int,
        sampled: bool,
        logprobs: bool,
        announce: bool = True,
        constrained: bool = False,
    ) -> None:
        """Compiles, unless compiled, the decode chunk (of `self.chunk` steps, without
        logits) over `rows` rows of a cache of `cache_rows` rows (constrained: with each
        row's allowed tokens). Nothing runs. announce=False: no on_compile."""
        self.programs.get(
            self.decode_name(groups, self.chunk, sampled, False, logprobs, constrained),
            self._decode_fn(groups, self.chunk, sampled, False, logprobs, constrained),
            self.weights,
            self._abstract_cache(cache_rows),
            self._abstract_decode_inputs(rows, constrained),
            announce,
        )

    def compile_copy(self, pool: BlockPool, cache_rows: int, into_pool: bool) -> None:
        """Compiles, unless compiled, the prefix cache's block copy between `pool` and a
        cache of `cache_rows` rows: into the pool (`save_blocks`) or out of it
        (`load_blocks`)."""
        cache = self._abstract_cache(cache_rows)
        pool = self._abstract(tuple(pool), (SPECS.cache_lbksh,) * 2)
        dst, src = (pool, (cache.k, cache.v)) if into_pool else ((cache.k, cache.v), pool)
        fn, most, n = self._copy_fn(dst[0].shape, src[0].shape)
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        fn.lower(*dst, *src, i32(), i32(most, 2), i32(most), i32(most, n)).compile()

    def compile_move(self, n: int, cache_rows: int) -> None:
        """Compiles, unless compiled, `move_rows` of n (a power of two) rows."""
        rows = jax.ShapeDtypeStruct((n,), jnp.int32)
        self._move_fn(n).lower(self._abstract_cache(cache_rows), rows, rows).compile()

    # ---- reporting -------------------------------------------------------------------

    def schedules(self, layout: dict) -> dict:
        pre = prefill_grid(self.M, self.stages)
        dec = decode_grid(
            layout["groups"], self.stages, min(layout["chunk"], max(layout["decode_steps"], 1))
        )
        steady = stats(dec, skip_edges=self.stages - 1)
        return {
            "prefill": stats(pre),
            "decode": {**stats(dec), "steady_idle_fraction": steady["idle_fraction"]},
        }
