"""The engine: one code path for every mesh shape, 1x1 included.

`Engine` places the weights on a ('data', 'stage', 'seq', 'tensor') mesh once (every
`data` replica the same weights, its own rows and pages) and runs the
programs, prefill and the decode chunk, each compiled once per shape; the cache's other
programs (in-place K/V inserts, row moves, the prefix cache's block copies) are its
`copies` (`pipeline.runtime.copies`). It knows nothing of requests and rounds: the
executor (`pipeline.scheduling.executor`) runs a Round's programs through it, and a static batch
(`pipeline.scheduling.static_batch.generate`) is a round of those.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from qwen3_spmd.model.cache import KVCache
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.params import abstract_model, map_params
from qwen3_spmd.model.split import TensorSplit
from qwen3_spmd.pipeline.bounds import LEAST
from qwen3_spmd.pipeline.programs.decode import DecodeInputs
from qwen3_spmd.pipeline.programs.layout import Batch, lay_out
from qwen3_spmd.pipeline.programs.prefill import PrefillInputs
from qwen3_spmd.pipeline.programs.sampling import (
    PromptLogprobs,
    RowSampling,
    Sampling,
    TokenLogprobs,
    sample_rows,
    token_logprobs,
)
from qwen3_spmd.pipeline.programs.schedule import decode_grid, prefill_grid, stats
from qwen3_spmd.pipeline.programs.stage import Weights
from qwen3_spmd.pipeline.requests import RequestError, check_request
from qwen3_spmd.pipeline.runtime import cp_cost
from qwen3_spmd.pipeline.runtime.copies import Copies
from qwen3_spmd.pipeline.runtime.registry import Clock, OnCompile, Program, Programs, Stopwatch
from qwen3_spmd.pipeline.runtime.shapes import DecodeShape, PrefillShape
from qwen3_spmd.sharding.mesh import AXES, MeshError
from qwen3_spmd.sharding.place import WeightSource, place_state
from qwen3_spmd.sharding.specs import SPECS, param_spec
from qwen3_spmd.sharding.stages import StagePlan

RUNNERS = ("generate", "pooling")


def to_host(x: jax.Array) -> np.ndarray:
    """A program's output whole on this process's host. Rows other processes hold (the
    `data` replicas of a job over several hosts) are gathered from them, so every
    process keeps the same books: each process must ask for the same outputs in the
    same order, as it runs the same rounds."""
    if getattr(x, "is_fully_addressable", True) or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


class Engine:
    """Qwen3 on a mesh. Weights are placed once; programs compile per batch shape.

    Args:
      cfg: the model config.
      source: where weights come from (HFCheckpoint, RandomWeights, ...).
      mesh: a ('data', 'stage', 'seq', 'tensor') mesh (sharding.make_mesh).
      dtype: compute and storage dtype.
      max_seq_len: KV cache capacity per request (prompt + new tokens, so at least 2);
        each `seq` device holds ceil(max_seq_len / C) slots of it, in whole pages.
      block_size: cache slots a page holds on each `seq` device (vLLM's --block-size;
        `ring.pages`): a row's table lists S_loc / block_size pages.
      microbatches: M for prefill.
      groups: decode groups (default: the stage count, or the number of requests when
        fewer; a batch smaller than the stage count then runs with bubbles).
      chunk: decode steps per on-device chunk.
      poison: NaN in pipeline bubbles (tests).
      on_compile: called with a program's name around each compile the caller waits for
        (`pipeline.runtime.registry.OnCompile`).
      cp: how prompt attention splits along `seq`: "ring", "ulysses" (C must divide
        the N query heads) or "auto" (per batch, the smaller time of
        pipeline.runtime.cp_cost's model). The KV cache left behind is the same either way.
      experts: Qwen3-MoE's split (model.split): "tp" every expert's columns over
        `tensor`, "ep" whole experts over `tensor`, "a2a" whole experts over `data` x
        `tensor` reached by all-to-alls; None: "a2a" with D > 1 replicas, else "tp".
      runner: "generate" (prefill, then decode) or "pooling" (vLLM's name: prefill
        only, each prompt's last hidden state after the final norm, for embeddings and
        scores, `model.pooling`; its requests ask for no new tokens).
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
        experts: str | None = None,
        runner: str = "generate",
        block_size: int = 16,
    ):
        if runner not in RUNNERS:
            raise RequestError(f"$runner {runner!r} is not one of {', '.join(RUNNERS)}", "runner")
        self.runner = runner
        if tuple(mesh.axis_names) != AXES:
            raise MeshError(
                f"the mesh's axes are {tuple(mesh.axis_names)}, not {AXES}: build it with "
                "qwen3_spmd.sharding.mesh.make_mesh(stage, seq, devices, tensor=X, data=D)"
            )
        self.cfg, self.mesh, self.dtype = cfg, mesh, jnp.dtype(dtype)
        self.D, self.stages, self.C = mesh.shape["data"], mesh.shape["stage"], mesh.shape["seq"]
        self.split = TensorSplit.of(mesh.shape["tensor"], self.D, experts)
        experts = self.split.experts
        self.split.check(cfg)
        self.plan = StagePlan(cfg.L, self.stages)
        for name, value in (
            ("microbatches", microbatches),
            ("groups", groups),
            ("max_seq_len", max_seq_len),
            ("chunk", chunk),
            ("block_size", block_size),
        ):
            if value is not None and value < LEAST[name]:
                raise RequestError(f"${name} {value} must be at least {LEAST[name]}", name)
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
        self.block_size = block_size
        # A row's most pages (its table's entries), and its local slots in them.
        self.pages_per_row = math.ceil(math.ceil(max_seq_len / self.C) / block_size)
        self.slots_per_device = self.pages_per_row * block_size
        graphdef, abstract = abstract_model(cfg, self.dtype, self.split)
        self.graphdef = graphdef
        state = place_state(abstract, self.plan, mesh, source, self.split)
        self.weights = Weights(
            state, jax.device_put(self.plan.real_slots, NamedSharding(mesh, SPECS.layers))
        )
        self.state_specs = map_params(lambda path, x: param_spec(path, experts), state)
        self.programs = Programs(self.dtype, self.jitted, on_compile)
        # The cache's other programs: zeroed pools, the prefix cache's copies.
        self.copies = Copies(mesh, self.dtype, self.pool_shape, self.pages_per_row)
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
            self.cfg,
            self.C,
            self.max_seq_len,
            prompts,
            max_new_tokens,
            min_tokens,
            eos_ids,
            pooling=self.pooling,
        )

    @property
    def pooling(self) -> bool:
        """A pooling runner: prefills give hidden states (`pool`), nothing decodes."""
        return self.runner == "pooling"

    def groups_for(self, n: int) -> int:
        """Decode groups for n requests."""
        return self.groups if self.groups is not None else min(self.stages, n)

    def lay_out(self, prompts: list[list[int]]) -> Batch:
        return lay_out(
            prompts, self.M, self.groups_for(len(prompts)), self.C, self.slots_per_device
        )

    def pool_shape(self, pages: int) -> tuple[int, ...]:
        """k and v of a pool of `pages` pages, [L_pad, pages, K', C bs, H] (model.cache;
        K' the KV heads as placed, repeats included: model.split)."""
        K = self.split.kv_heads(self.cfg)
        return (self.plan.padded_layers, pages, K, self.block_size * self.C, self.cfg.H)

    def prefill_memory(self, batch: int, prompt_len: int) -> dict:
        """Per-device bytes of the prefill program for `batch` prompts of `prompt_len`
        tokens, from XLA's memory analysis of the compiled program (nothing runs).

        total = arguments (weights, cache, tokens) + outputs + temporaries - aliased
        (the donated cache is updated in place, so it counts once).
        """
        laid = lay_out([[0] * prompt_len] * batch, 1, 1, self.C, self.slots_per_device)
        inputs = self.copies.abstract(laid.prefill, PrefillInputs.specs())
        shape = PrefillShape(laid.B, laid.P_pad, cp=self.cp_plan(batch, laid.P_pad)[0])
        prefill = self.jitted(dataclasses.replace(shape, pooled=self.pooling))
        m = (
            prefill.lower(self.weights, self.copies.abstract_cache(batch), inputs)
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

    def jitted(self, program: Program):
        """`program`'s function (a shape record: `pipeline.runtime.registry.Program`) on
        this engine's model and mesh, jitted with the cache donated; not compiled."""
        return jax.jit(program.build(self), donate_argnames="cache")

    def cp_plan(self, batch: int, padded_len: int) -> tuple[str, dict]:
        """(the strategy prefill runs for `batch` prompts padded to `padded_len`,
        pipeline.runtime.cp_cost.predict's figures for each strategy that can run)."""
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

    def _abstract_decode_inputs(self, rows: int, constrained: bool = False) -> DecodeInputs:
        """A decode chunk's inputs over `rows` rows as shapes on the mesh (for lowering
        ahead); constrained: with each row's allowed tokens."""
        inputs = DecodeInputs.empty(rows)
        if constrained:
            inputs = inputs._replace(allowed=np.zeros((rows, self.mask_words), np.int32))
        return self.copies.abstract(inputs, DecodeInputs.specs(constrained))

    @property
    def mask_words(self) -> int:
        """W: int32 words of a row's allowed tokens, ceil(V / 32) (`sampling.only_allowed`)."""
        return -(-self.cfg.V // 32)

    def compile_decode_ahead(self, B: int, groups: int, sampled: bool, with_logits: bool):
        """Starts compiling a decode chunk's program over B rows while the prefill
        compiles and runs."""
        self.programs.ahead(
            DecodeShape(
                B, sampled, False, groups=groups, steps=self.chunk, with_logits=with_logits
            ),
            self.weights,
            self.copies.abstract_cache(B),
            self._abstract_decode_inputs(B),
        )

    def _place_inputs(self, inputs, specs):
        """Host inputs onto the mesh as `specs` say (before the clock starts, as the old
        positional arguments were)."""
        return jax.tree.map(self.copies.placed, inputs, specs)

    def run_program(self, program: Program, clock: Clock, cache: KVCache, inputs):
        """`program` (a shape record), compiled, on (weights, cache, inputs placed on the
        mesh); the seconds waited for its compile go to clock.compile_s (the caller times
        the run)."""
        compiled, waited = self.programs.get(program, self.weights, cache, inputs)
        clock.compile_s += waited
        return compiled(self.weights, cache, inputs)

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
        """Runs the prefill of `batch` into `cache` (donated; its pos and table the batch
        rows', `Copies.with_rows`; None: a new cache of the batch's rows, each its own
        pages) and samples each row's first token
        with its `params` (host arrays [B]; sampled=False: every row is greedy) within
        its `allowed` tokens ([B, ceil(V/32)] packed bits, `sampling.only_allowed`;
        None: no row is constrained).
        A batch of later chunks (batch.offset > 0) continues `cache`, whose pos must list
        the earlier chunks' slots; its prefill attends to them too. A batch
        laid out with targets (`layout.lay_out`) scores its prompts' tokens too.
        Returns (first tokens [B] numpy, logits [B, V], the cache, PromptLogprobs of
        numpy arrays [B, P_pad, ...] in the batch's device order, or None without
        targets)."""
        if self.pooling:
            raise RequestError("a pooling runner prefills with `pool`: it samples no tokens")
        watch, (logits, cache, *prompt) = self._run_prefill(batch, strategy, clock, cache)
        scored = bool(prompt)
        first = self._sample(logits, params, np.int32(0), sampled=sampled, allowed=allowed)
        first = to_host(first)
        prompt = PromptLogprobs(*(to_host(x) for x in prompt[0])) if scored else None
        clock.prefill_s += watch.seconds()
        return first, logits, cache, prompt

    def pool(self, batch: Batch, strategy: str, clock: Clock, cache: KVCache | None = None):
        """A pooling runner's prefill of `batch` (a later chunk continues `cache`, as in
        `prefill`): (each row's last prompt token's hidden state after the final norm
        [B, D] float32 numpy, the cache)."""
        watch, (hidden, cache) = self._run_prefill(batch, strategy, clock, cache)
        hidden = to_host(hidden)
        clock.prefill_s += watch.seconds()
        return hidden, cache

    def _run_prefill(self, batch: Batch, strategy: str, clock: Clock, cache: KVCache | None):
        """The prefill program of `batch` on `cache` (None: a new one): (a stopwatch
        started once its inputs are on the mesh, its outputs)."""
        scored = batch.prefill.targets is not None
        if cache is None:
            cache = self.copies.with_rows(self.copies.empty_cache(batch.B), batch.slot_pos)
        inputs = self._place_inputs(batch.prefill, PrefillInputs.specs(scored))
        program = PrefillShape(
            batch.B, batch.P_pad, batch.offset > 0, scored, strategy, batch.block, self.pooling
        )
        watch = Stopwatch(clock)
        return watch, self.run_program(program, clock, cache, inputs)

    def logprobs(self, logits: jax.Array, tokens: np.ndarray) -> TokenLogprobs:
        """The log-probabilities of `tokens` [B] under `logits` [B, V] (a prefill's), and
        the top ones: TokenLogprobs of numpy arrays."""
        out = self._logprobs(logits, jnp.asarray(tokens, jnp.int32))
        return TokenLogprobs(*(to_host(x) for x in out))

    def decode(
        self,
        cache: KVCache,
        slot_pos: np.ndarray,
        table: np.ndarray,
        inputs: DecodeInputs,
        groups: int,
        sampled: bool,
        with_logits: bool,
        clock: Clock,
        logprobs: bool = False,
    ):
        """One decode chunk (the program of `self.chunk` steps, `inputs.run_steps` of
        them run) on `cache`, donated, with its rows' slot positions and pages replaced by
        the host's slot_pos [B, C, S_loc] (which must list the slots the chunk writes:
        `layout.list_decode_slots`) and table [B, n] (which must give them pages). inputs: host arrays (with `allowed`: the program
        that masks each row's choice). logprobs: also each new token's
        log-probabilities (DecodeOutputs.logprobs). Returns (DecodeOutputs on device,
        the cache)."""
        constrained = inputs.allowed is not None
        cache = self.copies.with_rows(cache, slot_pos, table)
        rows = inputs.tokens.shape[0]
        inputs = self._place_inputs(inputs, DecodeInputs.specs(constrained))
        program = DecodeShape(rows, sampled, logprobs, constrained, groups, self.chunk, with_logits)
        watch = Stopwatch(clock)
        out, cache = self.run_program(program, clock, cache, inputs)
        out.tokens.block_until_ready()
        clock.decode_s += watch.seconds()
        return out, cache

    # ---- compiling ahead: what a server compiles at start -----------------------------

    def compile_prefill(
        self, shape: PrefillShape, pages: int | None, announce: bool = True
    ) -> None:
        """Compiles, where not compiled yet, all that `prefill` runs for `shape` (its cp
        strategy and layout included): the prefill program into a pool of `pages` pages
        (None: a new cache of its own rows, whose zeros compile too), the first tokens'
        sampling (greedy and sampled) and log-probabilities (the rows a prefill's cache
        lists are its batch's). Nothing runs (compiling is local
        to this process: no collective, so a background thread may compile while rounds
        run). announce=False: no on_compile for the program."""
        shape = dataclasses.replace(shape, pooled=self.pooling)
        B, P_pad, scored = shape.B, shape.P_pad, shape.prompt_logprobs
        prompts = [[0] * P_pad] * B
        laid = lay_out(
            prompts,
            1,
            1,
            self.C,
            self.slots_per_device,
            P_pad=P_pad,
            rows=B,
            block=shape.block,
            targets=prompts if scored else None,
        )
        inputs = self.copies.abstract(laid.prefill, PrefillInputs.specs(scored))
        if pages is None:
            self.copies.compile_zeros(B * self.pages_per_row)
        program, _ = self.programs.get(
            shape, self.weights, self.copies.abstract_cache(B, pages), inputs, announce
        )
        if self.pooling:  # no token to sample, no row to fill: a pooled prompt is done
            return
        logits = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            program.out_info[0],
        )
        params = RowSampling.of(Sampling(), 0, laid.request)
        tokens = jax.ShapeDtypeStruct((B,), jnp.int32)
        step = jax.ShapeDtypeStruct((), jnp.int32)
        for sampled in (False, True):  # as `prefill` calls it (allowed: a keyword, None)
            self._sample.lower(logits, params, step, sampled=sampled, allowed=None).compile()
        self._logprobs.lower(logits, tokens).compile()

    def compile_decode(
        self, shape: DecodeShape, cache_rows: int, pages: int | None, announce: bool = True
    ) -> None:
        """Compiles, unless compiled, the decode chunk of `shape` (its groups and steps
        given) over a cache of `cache_rows` rows on a pool of `pages` pages (None: the
        rows' own). Nothing runs. announce=False: no on_compile."""
        self.programs.get(
            shape,
            self.weights,
            self.copies.abstract_cache(cache_rows, pages),
            self._abstract_decode_inputs(shape.rows, shape.constrained),
            announce,
        )

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
