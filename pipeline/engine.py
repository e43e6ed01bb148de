"""The generate engine: one code path for every mesh shape, 1x1 included.

`Engine` places the weights on a ('stage', 'seq') mesh, then for a batch of prompts:
checks everything up front; pads the batch to a multiple of the microbatch and group
counts (with copies of the first prompt, whose results are dropped) and the prompts to
a multiple of 2C in zigzag order; runs the prefill program once and the decode
program chunk by chunk (each chunk on device; the host only looks at the new tokens
between chunks, to stream them and to stop once every request has finished).
"""

from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model.cache import KVCache
from model.config import Qwen3Config
from model.loader import abstract_model, map_params
from pipeline import cp_cost
from pipeline.decode import build_decode
from pipeline.prefill import build_prefill
from pipeline.sampling import Sampling, sample
from pipeline.schedule import decode_grid, prefill_grid, stats
from ring import padded_length, to_device_order, zigzag
from sharding.place import WeightSource, place_state
from sharding.plan import StagePlan
from sharding.specs import SPECS, param_spec


class RequestError(ValueError):
    """A request the engine cannot serve as asked: the message says what to change."""


@dataclasses.dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (an EOS id was produced, and kept) or "length"


@dataclasses.dataclass
class Generation:
    completions: list[Completion]
    first_logits: np.ndarray  # [steps, V] float32: request 0's logits at each generated token
    timing: dict
    layout: dict  # batch and prompt padding, microbatches, groups, chunks run


def _spec_tree(state):
    return map_params(lambda path, x: param_spec(path), state)


def check_request(cfg: Qwen3Config, seq: int, max_seq_len: int, prompts: list[list[int]],
                  max_new_tokens: int) -> None:
    """Every precondition of a request on C = seq devices, in words; needs no weights, so
    a caller can check before loading them."""
    if not prompts:
        raise RequestError("no prompt given: pass --prompt TEXT or --prompt-ids 1,2,3")
    if max_new_tokens < 1:
        raise RequestError(f"--max-new-tokens {max_new_tokens} must be at least 1")
    for n, p in enumerate(prompts):
        if len(p) == 0:
            raise RequestError(f"prompt {n} is empty: give it at least one token")
        bad = [t for t in p if not 0 <= t < cfg.V]
        if bad:
            raise RequestError(f"prompt {n} has token id {bad[0]} outside the vocabulary "
                               f"[0, {cfg.V}): use ids the model's tokenizer produces")
        total = len(p) + max_new_tokens
        if total > cfg.max_position_embeddings:
            raise RequestError(
                f"prompt {n} ({len(p)} tokens) + --max-new-tokens {max_new_tokens} = {total} "
                f"exceeds the model's {cfg.max_position_embeddings} positions: shorten one")
        if total > max_seq_len:
            raise RequestError(
                f"prompt {n} ({len(p)} tokens) + --max-new-tokens {max_new_tokens} = {total} "
                f"exceeds --max-seq-len {max_seq_len}: raise --max-seq-len to {total}")
    P_len = padded_length(max(len(p) for p in prompts), seq)
    slots = math.ceil(max_seq_len / seq)
    need = P_len // seq + math.ceil((max_new_tokens - 1) / seq)
    if need > slots:
        raise RequestError(
            f"the longest prompt padded to {P_len} tokens (a multiple of 2C = {2 * seq}) "
            f"plus {max_new_tokens} new tokens needs {need} cache slots per seq device, but "
            f"--max-seq-len {max_seq_len} gives {slots}: raise "
            f"--max-seq-len to {need * seq}")


def fitting_seq_len(prompt_len: int, new_tokens: int, seq: int) -> int:
    """The smallest --max-seq-len check_request accepts for a prompt of prompt_len tokens
    and new_tokens more on C = seq devices: the padded prompt plus the decode slots, at
    least prompt + new tokens, as a multiple of C."""
    slots = seq * (padded_length(prompt_len, seq) // seq + math.ceil(max(new_tokens - 1, 0) / seq))
    return seq * math.ceil(max(slots, prompt_len + new_tokens) / seq)


class Engine:
    """Qwen3 on a mesh. Weights are placed once; programs compile per batch shape.

    Args:
      cfg: the model config.
      source: where weights come from (HFCheckpoint, RandomWeights, ...).
      mesh: a ('stage', 'seq') mesh (sharding.make_mesh).
      dtype: compute and storage dtype.
      max_seq_len: KV cache capacity per request (prompt + new tokens); each `seq`
        device holds ceil(max_seq_len / C) slots.
      microbatches: M for prefill.
      groups: G for decode (default: S, or the number of requests when fewer; a batch
        smaller than S then runs with bubbles).
      chunk: decode steps per on-device chunk.
      poison: NaN in pipeline bubbles (tests).
      cp: how prompt attention splits along `seq`: "ring", "ulysses" (C must divide
        the N query heads) or "auto" (per batch, the smaller time of
        pipeline.cp_cost's model). The KV cache left behind is the same either way.
      link_bytes_per_s, flops_per_s: the link bandwidth (one figure, or one per
        collective: cp_cost.link_rate) and one device's matmul throughput the cost
        model assumes (default: cp_cost.nominal for the platform; bench measures them).
        Emulated CPU devices share their host's cores, so there each of the n devices
        of this process computes at flops_per_s / n.
    """

    def __init__(self, cfg: Qwen3Config, source: WeightSource, mesh: Mesh, dtype=jnp.float32,
                 max_seq_len: int = 512, microbatches: int = 1, groups: int | None = None,
                 chunk: int = 16, poison: bool = False, cp: str = "ring",
                 link_bytes_per_s: float | dict | None = None,
                 flops_per_s: float | None = None):
        self.cfg, self.mesh, self.dtype = cfg, mesh, jnp.dtype(dtype)
        self.S, self.C = mesh.shape["stage"], mesh.shape["seq"]
        self.plan = StagePlan(cfg.L, self.S)
        if microbatches < 1:
            raise RequestError(f"--microbatches {microbatches} must be at least 1")
        self.M = microbatches
        if groups is not None and groups < 1:
            raise RequestError(f"--groups {groups} must be at least 1")
        self.groups = groups
        if max_seq_len < 1:
            raise RequestError(f"--max-seq-len {max_seq_len} must be positive")
        self.max_seq_len = max_seq_len
        self.slots_per_device = math.ceil(max_seq_len / self.C)
        # Each seq device holds the same number of slots: capacity rounds up to C's multiple.
        self.capacity = self.slots_per_device * self.C
        if chunk < 1:
            raise RequestError(f"--chunk {chunk} must be at least 1 decode step")
        self.chunk = chunk
        self.poison = poison
        try:
            cp_cost.check_cp(cfg, self.C, cp)
        except ValueError as e:
            raise RequestError(str(e)) from None
        self.cp = cp
        platform = mesh.devices.flat[0].platform
        link, flops = cp_cost.nominal(platform)
        self.link_bytes_per_s = link_bytes_per_s or link
        sharing = (sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
                   if platform == "cpu" else 1)
        self.flops_per_s = (flops_per_s or flops) / sharing
        self.graphdef, abstract = abstract_model(cfg, self.dtype)
        self.state = place_state(abstract, self.plan, mesh, source)
        self.state_specs = _spec_tree(self.state)
        self.real = jax.device_put(self.plan.real_slots, NamedSharding(mesh, SPECS.layers))
        self._prefill: dict[str, Callable] = {}  # cp strategy -> jitted prefill
        self._decode: dict[tuple, Callable] = {}
        self._compiled: dict[tuple, Callable] = {}
        self._ahead: dict[tuple, Future] = {}  # compiles started on self._pool
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile")
        self.programs: dict[str, Callable] = {}  # readable name -> compiled program
        self._zeros: dict[tuple, Callable] = {}  # cache shape -> jitted zeros
        self._sample = jax.jit(sample, static_argnums=4)

    # ---- checks and layout -------------------------------------------------------

    def check(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """Every precondition of a request, in words, before anything compiles."""
        check_request(self.cfg, self.C, self.max_seq_len, prompts, max_new_tokens)

    def groups_for(self, n: int) -> int:
        """Decode groups G for n requests."""
        return self.groups if self.groups is not None else min(self.S, n)

    def batch_size(self, n: int) -> int:
        """Requests padded to a multiple of lcm(M, G)."""
        unit = math.lcm(self.M, self.groups_for(n))
        return math.ceil(n / unit) * unit

    # ---- the programs --------------------------------------------------------------

    def _compile(self, name: tuple, fn, *args):
        """fn compiled for args' shapes, once per (name, shapes); name must say every
        static choice that shapes the program (sampling, groups, chunk). The time the
        caller waits (compiling, or for a compile started ahead) counts in compile_s."""
        key = self._key(name, args)
        if key not in self._compiled:
            t0 = time.perf_counter()
            ahead = self._ahead.pop(key, None)
            # result() re-raises whatever the background compile raised.
            compiled = ahead.result() if ahead is not None else self._build(fn, args)
            self.compile_s += time.perf_counter() - t0
            self._compiled[key] = compiled
            shapes = "x".join(map(str, args[2].shape))  # tokens [B, P] / cache [L_pad, B, K, S, H]
            self.programs[f"{' '.join(map(str, name))} [{shapes}]"] = compiled
        return self._compiled[key]

    def _compile_ahead(self, name: tuple, fn, *args) -> None:
        """Starts compiling fn for args (arrays or ShapeDtypeStructs with shardings) on a
        background thread, so it overlaps the compile and run of another program (XLA
        compiles outside the GIL); the `_compile` call with the same key collects it."""
        key = self._key(name, args)
        if key not in self._compiled and key not in self._ahead:
            self._ahead[key] = self._pool.submit(self._build, fn, args)

    @staticmethod
    def _key(name: tuple, args) -> tuple:
        return (*name, *(getattr(a, "shape", a) for a in args[2:]))

    def _build(self, fn, args):
        # float32 means float32: XLA may otherwise run its matmuls in TF32 on GPUs.
        precision = "highest" if self.dtype == jnp.float32 else "default"
        with jax.default_matmul_precision(precision):
            return fn.lower(*args).compile()

    def _prefill_fn(self, strategy: str):
        if strategy not in self._prefill:
            self._prefill[strategy] = jax.jit(
                build_prefill(self.cfg, self.graphdef, self.state_specs, self.mesh, self.M,
                              self.dtype, self.poison, strategy),
                donate_argnums=(5, 6))
        return self._prefill[strategy]

    def cp_plan(self, batch: int, padded_len: int) -> tuple[str, dict]:
        """(the strategy prefill runs for `batch` prompts padded to `padded_len`,
        pipeline.cp_cost.predict's figures for each strategy that can run)."""
        return cp_cost.choose(self.cp, self.cfg, self.C, self.S, self.M, batch, padded_len,
                              self.dtype.itemsize, self.link_bytes_per_s, self.flops_per_s)

    def _decode_fn(self, groups: int, steps: int, sampling: Sampling, with_logits: bool):
        key = (groups, steps, sampling, with_logits)
        if key not in self._decode:
            self._decode[key] = jax.jit(
                build_decode(self.cfg, self.graphdef, self.state_specs, self.mesh, groups, steps,
                             sampling, with_logits),
                donate_argnums=(2, 3))
        return self._decode[key]

    def _abstract(self, shape, dtype, spec) -> jax.ShapeDtypeStruct:
        """An argument's shape, dtype and sharding on the mesh, for lowering ahead."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.mesh, spec))

    def cache_shape(self, B: int) -> tuple[int, ...]:
        """[L_pad, B, K, S_cap, H] (heads-major: model.cache)."""
        return (self.plan.padded_layers, B, self.cfg.K, self.slots_per_device * self.C,
                self.cfg.H)

    def new_cache(self, B: int) -> tuple[jax.Array, jax.Array]:
        """Zeroed k, v [L_pad, B, K, S_cap, H], sharded P('stage', None, None, 'seq', None)."""
        shape = self.cache_shape(B)
        sharding = NamedSharding(self.mesh, SPECS.cache_lbksh)
        if shape not in self._zeros:
            self._zeros[shape] = jax.jit(lambda: jnp.zeros(shape, self.dtype),
                                         out_shardings=sharding)
        return self._zeros[shape](), self._zeros[shape]()

    def prefill_memory(self, batch: int, prompt_len: int) -> dict:
        """Per-device bytes of the prefill program for `batch` prompts of `prompt_len`
        tokens, from XLA's memory analysis of the compiled program (nothing runs).

        total = arguments (weights, cache, tokens) + outputs + temporaries - aliased
        (the donated cache is updated in place, so it counts once).
        """
        P_len = padded_length(prompt_len, self.C)
        arg = self._abstract
        cache = arg(self.cache_shape(batch), self.dtype, SPECS.cache_lbksh)
        tokens = arg((batch, P_len), jnp.int32, SPECS.tokens_bt)
        args = (self.state, self.real, tokens, tokens, arg((batch,), jnp.int32, P()), cache, cache)
        prefill = self._prefill_fn(self.cp_plan(batch, P_len)[0])
        m = prefill.lower(*args).compile().memory_analysis()
        out = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
               "temp": m.temp_size_in_bytes, "alias": m.alias_size_in_bytes}
        out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
        return out

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 sampling: Sampling = Sampling(), seed: int = 0,
                 eos_ids: tuple[int, ...] = (),
                 on_tokens: Callable[[list[list[int]]], None] | None = None,
                 with_logits: bool = True) -> Generation:
        """Generates up to max_new_tokens tokens for each prompt.

        with_logits=False skips collecting request 0's logits at every decode step
        (Generation.first_logits then holds the prefill step only).

        on_tokens, if given, is called after the prefill and after each decode chunk with
        every request's tokens so far (for streaming).
        """
        self.check(prompts, max_new_tokens)
        C, mesh = self.C, self.mesh
        self.compile_s = 0.0
        n_req = len(prompts)
        G = self.groups_for(n_req)
        B = self.batch_size(n_req)
        batch = [list(p) for p in prompts] + [list(prompts[0])] * (B - n_req)
        lengths = np.array([len(p) for p in batch], np.int32)
        P_len = padded_length(int(lengths.max()), C)
        part = zigzag(P_len, C)
        tokens = np.zeros((B, P_len), np.int32)
        positions = np.full((B, P_len), -1, np.int32)
        for b, p in enumerate(batch):
            tokens[b, :len(p)] = p
            positions[b, :len(p)] = np.arange(len(p))
        tokens, positions = to_device_order(tokens, part), to_device_order(positions, part)
        tok_sharding = NamedSharding(mesh, SPECS.tokens_bt)
        rep = NamedSharding(mesh, P())

        # Slot positions: device c's first P/C slots hold its zigzag share of the prompt.
        S_loc = self.slots_per_device
        prompt_slots = P_len // C
        slot_pos = np.full((B, C, S_loc), -1, np.int32)
        slot_pos[:, :, :prompt_slots] = positions.reshape(B, C, prompt_slots)

        if max_new_tokens > 1:
            # The first decode chunk's program compiles while the prefill compiles and runs.
            arg = self._abstract
            cache = arg(self.cache_shape(B), self.dtype, SPECS.cache_lbksh)
            vec, scalar = arg((B,), jnp.int32, P()), jax.ShapeDtypeStruct((), jnp.int32)
            self._compile_ahead(("decode", G, self.chunk, sampling, with_logits),
                                self._decode_fn(G, self.chunk, sampling, with_logits),
                                self.state, self.real, cache, cache,
                                arg((B, C * S_loc), jnp.int32, SPECS.slots_bs), vec, vec, vec,
                                *[scalar] * 5)
        cache_k, cache_v = self.new_cache(B)
        args = (self.state, self.real, jax.device_put(tokens, tok_sharding),
                jax.device_put(positions, tok_sharding), jax.device_put(lengths - 1, rep),
                cache_k, cache_v)
        strategy, predictions = self.cp_plan(B, P_len)
        prefill = self._compile(("prefill",) if strategy == "ring" else ("prefill", strategy),
                                self._prefill_fn(strategy), *args)
        t0 = time.perf_counter()
        logits, cache_k, cache_v = prefill(*args)
        request = np.arange(B, dtype=np.int32)
        request[n_req:] = 0
        first = self._sample(logits, jnp.asarray(request), jnp.int32(0), jnp.int32(seed),
                             sampling)
        first = np.asarray(first)
        prefill_s = time.perf_counter() - t0

        generated = [[int(first[b])] for b in range(B)]
        step_logits = [np.asarray(logits[:1])]
        done = np.array([t in eos_ids for t in first])
        if on_tokens:
            on_tokens([g for g in generated[:n_req]])
        limit = max_new_tokens - 1  # decode steps: token 0 came from the prefill
        steps_run, chunks, decode_ticks = 0, 0, 0
        t_decode = 0.0
        while steps_run < limit and not done[:n_req].all():
            n = self.chunk
            j0 = steps_run
            take = min(n, limit - j0)
            # List the slots this chunk writes; positions ahead of a query are masked.
            for j in range(j0, j0 + take):
                slot_pos[:, j % C, prompt_slots + j // C] = lengths + j
            cur = np.array([g[-1] for g in generated], np.int32)
            args = (self.state, self.real, cache_k, cache_v,
                    jax.device_put(slot_pos.reshape(B, C * S_loc), NamedSharding(mesh, SPECS.slots_bs)),
                    jax.device_put(cur, rep), jax.device_put(lengths + j0, rep),
                    jax.device_put(request, rep), jnp.int32(j0), jnp.int32(take), jnp.int32(limit),
                    jnp.int32(prompt_slots), jnp.int32(seed))
            decode = self._compile(("decode", G, n, sampling, with_logits),
                                   self._decode_fn(G, n, sampling, with_logits), *args)
            t0 = time.perf_counter()
            new_tokens, new_logits, cache_k, cache_v = decode(*args)
            new_tokens = np.asarray(new_tokens)
            t_decode += time.perf_counter() - t0
            decode_ticks += (take - 1) * max(G, self.S) + G + self.S - 1
            for b in range(B):
                if not done[b]:
                    for t in new_tokens[b, :take]:
                        generated[b].append(int(t))
                        if t in eos_ids:
                            done[b] = True
                            break
            if with_logits:
                step_logits.append(np.asarray(new_logits)[:take])
            steps_run += take
            chunks += 1
            if on_tokens:
                on_tokens([g for g in generated[:n_req]])
        # The cache as the last decode left it (slots of steps never run stay -1).
        self.cache = KVCache(cache_k, cache_v, jax.device_put(
            slot_pos.reshape(B, C * S_loc), NamedSharding(mesh, SPECS.slots_bs)))

        completions = []
        for b in range(n_req):
            toks = generated[b][:max_new_tokens]
            stop = bool(toks) and toks[-1] in eos_ids
            completions.append(Completion(list(prompts[b]), toks, "stop" if stop else "length"))
        n_prompt = int(lengths[:n_req].sum())
        n_new = sum(len(c.token_ids) - 1 for c in completions)
        timing = {
            "compile_s": self.compile_s,
            "prefill_s": prefill_s,
            "decode_s": t_decode,
            "prefill_tokens_per_s": n_prompt / prefill_s if prefill_s > 0 else 0.0,
            "decode_tokens_per_s": n_new / t_decode if t_decode > 0 else 0.0,
        }
        layout = {"batch": B, "requests": n_req, "padded_prompt": P_len, "microbatches": self.M,
                  "groups": G, "decode_steps": steps_run, "chunks": chunks,
                  "chunk": self.chunk, "decode_ticks": decode_ticks,
                  "cp_strategy": strategy, "cp": predictions}
        first_logits = np.concatenate(step_logits)[:len(completions[0].token_ids)]
        return Generation(completions, first_logits, timing, layout)

    # ---- reporting -------------------------------------------------------------------

    def schedules(self, layout: dict) -> dict:
        pre = prefill_grid(self.M, self.S)
        dec = decode_grid(layout["groups"], self.S,
                          min(layout["chunk"], max(layout["decode_steps"], 1)))
        steady = stats(dec, skip_edges=self.S - 1)
        return {"prefill": stats(pre),
                "decode": {**stats(dec), "steady_idle_fraction": steady["idle_fraction"]}}
