"""One set of engine arguments for every door (vLLM's `EngineArgs`): `generate`, `serve`,
`bench` and `qwen3_spmd.LLM` take the same settings under the same names, with one
default each, documented once (the fields below), and start and build the same way.

    args = EngineArgs(model="tests/fixtures/tiny", mesh="2x2", max_seq_len=64)
    built = args.build()          # processes, devices, compile cache, weights: an Engine

`build()` is `start()` (the processes of a multi-host job, the emulated CPU devices, the
compile cache), `open_model()`, `Runtime.mesh()` and `engine()` in turn. `LLM` calls it;
the commands call the steps, for they work between them (generate checks its prompts
before it loads anything, serve binds its port). Each door adds only its own flags.
vLLM's names are aliases (`--max-model-len`, `--tensor-parallel-size`/`-tp`, ...).

Imports no JAX at module level: `add_cli_args` runs while `--help` is built, and the
checks of the values alone (`check`) answer before JAX loads.
"""

from __future__ import annotations

import argparse
import dataclasses

from qwen3_spmd.run import compile_cache, distributed
from qwen3_spmd.run.distributed import DEFAULT_PEER_TIMEOUT
from qwen3_spmd.run.flags import (
    CLIError,
    add_dtype,
    add_expert_split,
    add_model,
    local_cpu_devices,
    mesh_devices,
    platform_is_cpu,
    use_cpu_devices,
)

DEFAULT_MAX_SEQ_LEN = 4096  # per request, when the model allows as many positions
CP = ("ring", "ulysses", "auto")


@dataclasses.dataclass
class EngineArgs:
    """The engine's settings, one default each. The flag of each is its name with dashes
    (`max_seq_len`: `--max-seq-len`); vLLM's names are aliases (listed below).

    model: a Hugging Face checkpoint folder, an orbax folder written by `convert`, a hub
      id (downloaded on first use), or a preset name (tiny, 0.6B, ..., 32B: seeded random
      weights). None: the demo, the tiny preset's layers with Qwen3's tokenizer and
      vocabulary, seeded random weights. bench differs: None is the tiny preset itself
      (its figures are of a model, and Qwen3's 151,936-row vocabulary would dwarf
      tiny's layers).
    revision: with a hub id, its branch, tag or commit (None: main).
    weights_seed: a preset's random weights' seed (generate and bench: their --seed).
    mesh: "SxC" or "SxCxX" (S stages x C seq devices x X tensor devices). None:
      pipeline_parallel_size x 1 x tensor_parallel_size when either is given, else 1x1,
      but 2x2 emulated CPU devices on a CPU for the demo (no model) or several processes.
      bench compares meshes: its --mesh (and --cp) repeat, and 1x1 always runs.
    tensor_parallel_size, pipeline_parallel_size (vLLM's `-tp`, `-pp`): X and S of the
      mesh when `mesh` is None; with a mesh, they must agree with it.
    cpu_devices: CPU devices to emulate (None: the mesh's; an accelerator refuses it).
    dtype: "float32" or "bfloat16" (None: float32 on CPU, bfloat16 elsewhere).
    max_seq_len (vLLM's `max_model_len`): a request's prompt + new tokens at most; each
      seq device holds ceil(max_seq_len / C) cache slots. None: the model's positions, at
      most 4096, rounded up to a multiple of C. generate differs: its static batch is
      known before it starts, so None there is just enough for its prompts (a smaller
      cache decodes faster).
    microbatches: prefill microbatches M. groups: decode groups G (None: S). chunk:
      decode steps per on-device chunk. cp: prefill's split of attention along seq:
      ring, ulysses or auto (the cost model's pick). expert_split: Qwen3-MoE over tensor,
      tp (every expert's columns split) or ep (E/X whole experts a device).
    max_batch (vLLM's `max_num_seqs`): decode rows, requests running at once.
    prefill_tokens (vLLM's `max_num_batched_tokens`): prompt tokens a round prefills;
      longer prompts go in chunks. max_queue: requests waiting for a row at most.
    enable_prefix_caching: None: a prefix cache with one seq device, none with several
      (a mesh for long prompts would pay the block layout on every prompt); True or
      False: on or off. prefix_cache_mib: its pool's MiB a device (None: half the memory
      free after weights and rows on one process with a GPU, else as much as the rows'
      own KV cache). The static batch of generate has no scheduler, so none of these.
    speculative_config (vLLM's flag and keys): speculative decoding, JSON text or a
      mapping, e.g. {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max":
      4} (`pipeline.speculative.config`); decode rounds then run as verify rounds, with
      the same tokens. None: plain decoding.
    compile_cache: a folder for compiled programs, reused by later runs of the same
      shapes; "off" (None: $QWEN3_SPMD_COMPILE_CACHE, else ~/.cache/qwen3-spmd/xla).
      bench turns it off: its compile times are part of its figures.
    coordinator, num_processes, process_id, distributed, peer_timeout: a job of several
      processes (run.distributed).
    """

    model: str | None = None
    revision: str | None = None
    weights_seed: int = 0
    mesh: str | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    cpu_devices: int | None = None
    dtype: str | None = None
    max_seq_len: int | None = None
    microbatches: int = 1
    groups: int | None = None
    chunk: int = 16
    cp: str = "ring"
    expert_split: str = "tp"
    max_batch: int = 8
    prefill_tokens: int = 4096
    max_queue: int = 256
    enable_prefix_caching: bool | None = None
    prefix_cache_mib: float | None = None
    speculative_config: str | dict | None = None
    compile_cache: str | None = None
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    distributed: str | None = None
    peer_timeout: float = DEFAULT_PEER_TIMEOUT

    # ---- flags -------------------------------------------------------------------------

    @staticmethod
    def add_cli_args(parser, model_help: str, scheduler: bool = False, bench: bool = False):
        """Declares the settings' flags on a subcommand's parser, defaults from the
        fields. scheduler: the scheduler's too (serve). bench: --mesh and --cp repeat
        (each mesh and strategy is a run of its own) and the start-up flags are left out
        (bench runs in one process, without the compile cache)."""
        d = EngineArgs()
        add_model(parser, model_help)
        if bench:
            parser.add_argument(
                "--mesh",
                action="append",
                default=[],
                metavar="SxC[xX]",
                help="a mesh shape to run (repeatable); 1x1 always runs as the baseline",
            )
        else:
            parser.add_argument(
                "--mesh",
                help="SxC or SxCxX: S pipeline stages x C sequence devices x X tensor devices "
                "(default: PPx1xTP of -pp and -tp, else 1x1, but 2x2 emulated CPU devices on "
                "a CPU without --model or with several processes)",
            )
            parser.add_argument(
                "--tensor-parallel-size",
                "-tp",
                type=int,
                metavar="X",
                help="X, the tensor devices (vLLM's name): with no --mesh, the mesh is PPx1xTP",
            )
            parser.add_argument(
                "--pipeline-parallel-size",
                "-pp",
                type=int,
                metavar="S",
                help="S, the pipeline stages (vLLM's name): with no --mesh, the mesh is PPx1xTP",
            )
        parser.add_argument(
            "--cpu-devices",
            type=int,
            help="emulate this many CPU devices (default on CPU: the mesh's devices)",
        )
        add_dtype(parser)
        add_expert_split(parser)
        if not bench:
            parser.add_argument(
                "--max-seq-len",
                "--max-model-len",
                type=int,
                metavar="N",
                help="prompt + new tokens per request at most (default: the model's positions, "
                f"at most {DEFAULT_MAX_SEQ_LEN}; generate: just enough for its prompts)",
            )
        parser.add_argument(
            "--microbatches", type=int, default=d.microbatches, help="prefill microbatches M"
        )
        if bench:
            parser.add_argument(
                "--cp",
                action="append",
                choices=CP,
                default=[],
                help="seq attention of prefill (repeatable: each mesh with C > 1 runs each); "
                f"default {d.cp}",
            )
        else:
            parser.add_argument(
                "--cp",
                default=d.cp,
                choices=CP,
                help="how prefill splits attention along seq: ring (K/V blocks around the "
                "ring), ulysses (all-to-all to a head split; seq must divide the query heads) "
                f"or auto (the cost model's pick); default {d.cp}",
            )
        parser.add_argument("--groups", type=int, help="decode request groups G (default: S)")
        parser.add_argument(
            "--chunk",
            type=int,
            # bench: None, so that --smoke can choose its own
            default=None if bench else d.chunk,
            help=f"decode steps per on-device chunk (default {d.chunk})",
        )
        if not bench:
            parser.add_argument(
                "--speculative-config",
                metavar="JSON",
                help="speculative decoding (vLLM's flag and keys), e.g. "
                '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\': '
                "decoding checks k drafted tokens a pass, with the same tokens",
            )
        if scheduler:
            _add_scheduler_args(parser, d)
        if not bench:
            compile_cache.add_argument(parser)
            distributed.add_flags(parser)

    @classmethod
    def from_cli(cls, args: argparse.Namespace, **overrides) -> EngineArgs:
        """The settings a parsed command line gives (absent flags: the fields' defaults);
        `overrides` for what a door names its own way (generate's --seed)."""
        given = {
            f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)
        }
        return cls(**{**given, **overrides})

    # ---- checks, before JAX --------------------------------------------------------------

    def check(self) -> None:
        """The values alone, in words, before JAX loads (CLIError naming the flags)."""
        for name, least in (
            ("microbatches", 1),
            ("groups", 1),
            ("chunk", 1),
            ("max_seq_len", 2),
            ("max_batch", 1),
            ("prefill_tokens", 1),
            ("max_queue", 1),
            ("tensor_parallel_size", 1),
            ("pipeline_parallel_size", 1),
            ("cpu_devices", 1),
        ):
            value = getattr(self, name)
            if value is not None and value < least:
                raise CLIError(f"{_flag(name)} {value} must be at least {least}")
        if self.cp not in CP:
            raise CLIError(f"--cp {self.cp} is not one of {', '.join(CP)}")
        if self.prefix_cache_mib is not None and not self.prefix_cache_mib >= 0:
            raise CLIError(f"--prefix-cache-mib {self.prefix_cache_mib} must be >= 0 (0: no cache)")
        if self.enable_prefix_caching is False and self.prefix_cache_mib:
            raise CLIError(
                f"--no-enable-prefix-caching and --prefix-cache-mib {self.prefix_cache_mib} "
                "disagree: give one"
            )
        from qwen3_spmd.pipeline.speculative.config import SpeculativeConfig, SpeculativeConfigError

        try:
            SpeculativeConfig.parse(self.speculative_config)
        except SpeculativeConfigError as e:
            raise CLIError(f"--speculative-config: {e.problem}") from None
        distributed.check_flags(self)

    def mesh_text(self, on_cpu: bool) -> str:
        """--mesh, or the one default rule (see the `mesh` field)."""
        if self.mesh is not None:
            return self.mesh
        if self.tensor_parallel_size is not None or self.pipeline_parallel_size is not None:
            return f"{self.pipeline_parallel_size or 1}x1x{self.tensor_parallel_size or 1}"
        demo = on_cpu and (self.model is None or self.num_processes is not None)
        return "2x2" if demo else "1x1"

    def mesh_shape(self, on_cpu: bool):
        """The MeshShape of `mesh_text`, checked against -tp and -pp."""
        from qwen3_spmd.sharding.mesh import parse_mesh

        shape = parse_mesh(self.mesh_text(on_cpu))
        for name, size in (
            ("tensor_parallel_size", shape.tensor),
            ("pipeline_parallel_size", shape.stage),
        ):
            given = getattr(self, name)
            if given is not None and given != size:
                raise CLIError(
                    f"--mesh {self.mesh} has {size} where {_flag(name)} says {given}: "
                    "give one of them"
                )
        return shape

    def seq_len(self, cfg, seq: int) -> int:
        """max_seq_len, or its default (the model's positions, at most 4096), as a
        multiple of the C = seq devices (each holds the same number of slots)."""
        n = self.max_seq_len or min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
        return -(-n // seq) * seq

    # ---- start-up ------------------------------------------------------------------------

    def launch(self, args: argparse.Namespace, body) -> int:
        """A command's life: the values checked, a supervised child when it joins several
        processes, `start()`, `body(runtime)`, and leaving the job together."""
        self.check()
        status = distributed.supervise(args)  # a multi-process run: re-run as a child
        if status is not None:
            return status
        runtime = self.start()
        try:
            return body(runtime)
        finally:
            distributed.finish(runtime.procs)

    def start(self) -> Runtime:
        """Joins the job's processes, emulates the CPU devices and turns the compile cache
        on: before anything touches a JAX backend."""
        on_cpu = platform_is_cpu()
        mesh_text = self.mesh_text(on_cpu)
        shape = self.mesh_shape(on_cpu)
        if on_cpu and self.num_processes is not None:  # the numbers agree before anyone waits
            local_cpu_devices(self.cpu_devices, mesh_text, shape.devices, self.num_processes)
        procs = distributed.start(self)
        try:
            if on_cpu:
                n = local_cpu_devices(self.cpu_devices, mesh_text, shape.devices, procs.count)
                try:
                    use_cpu_devices(n if n > 1 or self.cpu_devices else None)
                except RuntimeError:  # JAX started before us (LLM in a user's process):
                    pass  # its devices are the ones; Runtime.mesh says if they are too few
            elif self.cpu_devices is not None:
                raise CLIError(
                    "--cpu-devices emulates CPU devices, but this run is on an accelerator: "
                    "leave it out (or set JAX_PLATFORMS=cpu)"
                )
            cache = compile_cache.use(self.compile_cache)
        except BaseException:
            distributed.finish(procs)  # the others leave with us, not after a timeout
            raise
        return Runtime(procs, mesh_text, shape, cache)

    def open_model(self):
        """The model's config, weights' source and tokenizer (`run.models.ModelSpec`)."""
        from qwen3_spmd.run.models import demo_model, open_model

        if self.model is None:
            return demo_model(self.weights_seed, self.revision)
        return open_model(self.model, self.weights_seed, self.revision)

    def dtype_name(self) -> str:
        """dtype, or the platform's (float32 on CPU, bfloat16 elsewhere), checked. Asks
        JAX for the backend: call after `start()`."""
        from qwen3_spmd.run.flags import dtype_name

        return dtype_name(self.dtype)

    # ---- the engine ----------------------------------------------------------------------

    def engine(self, spec_cfg, source, mesh, max_seq_len: int, **door):
        """The Engine of these settings on `mesh` (the one place an Engine is built from
        them). door: what a door adds that is not a setting (on_compile; bench: cp per
        run, dtype and the measured rates)."""
        from qwen3_spmd.pipeline.runtime.engine import Engine

        return Engine(spec_cfg, source, mesh, **{**self.engine_kwargs(max_seq_len), **door})

    def speculator(self, engine, **door):
        """The Speculator of speculative_config over `engine` (None: plain decoding), a
        draft model's Engine built as `engine` was (door: as `engine`'s)."""
        from qwen3_spmd.pipeline.speculative.config import SpeculativeConfig
        from qwen3_spmd.pipeline.speculative.speculator import make_speculator

        spec = SpeculativeConfig.parse(self.speculative_config)
        kwargs = {**self.engine_kwargs(engine.max_seq_len), **door}
        return make_speculator(engine, spec, self._draft(spec, engine, kwargs))

    def _draft(self, spec, engine, kwargs: dict):
        """The draft model of `spec` (a SpeculativeConfig of method draft_model; else
        None): opened as the main model is, on the same mesh with the same settings
        (`pipeline.speculative.draft_model`)."""
        from qwen3_spmd.model.config import ConfigError
        from qwen3_spmd.pipeline.runtime.engine import Engine
        from qwen3_spmd.run.models import open_model

        if spec is None or spec.method != "draft_model":
            return None
        where = f"--speculative-config: model {spec.model}"
        try:
            draft = open_model(spec.model, self.weights_seed)
        except ConfigError as e:
            raise CLIError(f"{where}: {e}") from None
        if draft.cfg.V != engine.cfg.V:
            raise CLIError(
                f"{where}: its vocabulary has {draft.cfg.V} tokens and the model's "
                f"{engine.cfg.V}: a drafter must share the model's tokenizer"
            )
        try:
            return Engine(draft.cfg, draft.source, engine.mesh, **kwargs)
        except ValueError as e:  # a mesh the draft model cannot take (heads, layers)
            raise CLIError(f"{where}: {e}") from None

    def engine_kwargs(self, max_seq_len: int) -> dict:
        """Engine's keyword arguments of these settings (asks JAX for the backend when
        dtype is None)."""
        import jax.numpy as jnp

        return dict(
            dtype=jnp.dtype(self.dtype_name()),
            max_seq_len=max_seq_len,
            microbatches=self.microbatches,
            groups=self.groups,
            chunk=self.chunk,
            cp=self.cp,
            experts=self.expert_split,
        )

    def scheduler(self, engine, many: bool = False, decisions=None, speculator=None, **door):
        """The continuous-batching Scheduler over `engine` with these settings, speculating
        with `speculator` (door: what a door adds that is not a setting)."""
        from qwen3_spmd.pipeline.requests import RequestError
        from qwen3_spmd.pipeline.scheduling.scheduler import Scheduler

        try:
            return Scheduler(
                engine,
                self.max_batch,
                prefill_tokens=self.prefill_tokens,
                max_queue=self.max_queue,
                decisions=decisions,
                prefix_cache_bytes=self.prefix_cache_bytes(engine, many, speculator),
                speculator=speculator,
                **door,
            )
        except RequestError as e:  # a --prefix-cache-mib under one block
            if e.param != "prefix_cache_bytes":
                raise
            raise CLIError(f"--prefix-cache-mib {self.prefix_cache_mib}: {e}") from None

    def prefix_cache_bytes(self, engine, many: bool, speculator=None) -> int:
        """Each device's bytes for the prefix cache's pool (see the fields). Where the
        device says nothing of its memory (CPU), or with several processes (whose pools
        must hold the same blocks, and whose free memory may differ), as much as the rows'
        own KV cache. Free memory is what the weights (a draft model's too) leave, less
        the rows' caches (a draft model's too)."""
        if self.enable_prefix_caching is False:
            return 0
        if self.prefix_cache_mib is not None:
            return int(self.prefix_cache_mib * 2**20)
        if engine.C > 1 and not self.enable_prefix_caching:
            return 0  # long prompts: the block layout would cost the ring's skipped pairs
        rows = engine.copies.cache_bytes_per_device(self.max_batch)
        stats = None if many else engine.mesh.devices.flat[0].memory_stats()
        if stats and "bytes_limit" in stats:
            drafter = getattr(speculator, "drafter", None)
            draft_rows = 0  # made at its first proposal, after the pool: set aside now
            if drafter is not None:
                draft_rows = drafter.engine.copies.cache_bytes_per_device(self.max_batch)
            return max(0, (stats["bytes_limit"] - stats["bytes_in_use"] - rows - draft_rows) // 2)
        return rows

    def build(self, mesh=None) -> Built:
        """Everything at once, in one process: started, the model opened, its weights on
        the mesh (or on `mesh`, a jax Mesh given as it is), the scheduler over them."""
        from qwen3_spmd.pipeline.structured.constraints import Grammars

        runtime = self.start()
        spec = self.open_model()
        mesh = mesh if mesh is not None else runtime.mesh()
        engine = self.engine(spec.cfg, spec.source, mesh, self.seq_len(spec.cfg, runtime.shape.seq))
        # Structured outputs: a grammar engine over the model's tokenizer (none without one).
        grammars = Grammars.of_text(spec.text(), spec.cfg.V, spec.eos_ids())
        speculator = self.speculator(engine)
        scheduler = self.scheduler(engine, grammars=grammars, speculator=speculator)
        return Built(runtime, spec, engine, scheduler)


@dataclasses.dataclass(frozen=True)
class Runtime:
    """What `EngineArgs.start()` set up: the job's processes (`run.distributed`), the
    mesh's text and shape, and the compile cache."""

    procs: object  # run.distributed.Processes
    mesh_text: str
    shape: object  # sharding.mesh.MeshShape
    cache: object  # run.compile_cache.CompileCache

    def mesh(self):
        """The ('stage', 'seq', 'tensor') Mesh over the job's first S*C*X devices,
        process 0's first (so they form stage 0)."""
        from qwen3_spmd.sharding.mesh import make_mesh

        s = self.shape
        devices = mesh_devices(s.devices, self.procs, self.mesh_text)
        return make_mesh(s.stage, s.seq, devices, tensor=s.tensor)


@dataclasses.dataclass(frozen=True)
class Built:
    runtime: Runtime
    spec: object  # run.models.ModelSpec
    engine: object  # pipeline.runtime.engine.Engine
    scheduler: object  # pipeline.scheduling.scheduler.Scheduler


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_scheduler_args(parser, d: EngineArgs) -> None:
    parser.add_argument(
        "--max-batch",
        "--max-num-seqs",
        type=int,
        metavar="N",
        default=d.max_batch,
        help=f"decode rows: requests running at once (default {d.max_batch})",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=d.max_queue,
        help=f"requests waiting for a row at most; more get 503 (default {d.max_queue})",
    )
    parser.add_argument(
        "--prefill-tokens",
        "--max-num-batched-tokens",
        type=int,
        metavar="N",
        default=d.prefill_tokens,
        help="prompt tokens prefilled per round; longer prompts go in chunks "
        f"(default {d.prefill_tokens})",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="the prefix cache on or off (default: on with one seq device, off with several)",
    )
    parser.add_argument(
        "--prefix-cache-mib",
        type=float,
        help="MiB of each device for the prefix cache's pool of prompt blocks, whose K/V a "
        "later prompt that begins alike copies instead of computing; 0 turns it off "
        "(default: half the device memory free after weights and rows on one process with "
        "a GPU, else as much as the rows' own KV cache; none with several seq devices)",
    )
