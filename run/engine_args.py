"""One set of engine arguments for every door (vLLM's `EngineArgs`): `generate`, `serve`,
`bench` and `qwen3_spmd.LLM` take the same settings under the same names, with one
default each and one check, and start the same way.

    args = EngineArgs(model="tests/fixtures/tiny", mesh="2x2", max_seq_len=64)
    built = args.build()          # processes, devices, compile cache, weights: an Engine

`build()` is `start()` (the processes of a multi-host job, the emulated CPU devices, the
compile cache), `open_model()`, `Runtime.mesh()`, `engine()` and `scheduler()` in turn,
the last two through `pipeline.scheduling.build`. `LLM` calls it; the commands call the
steps, for they work between them (generate checks its prompts before it loads
anything, serve binds its port). Each door adds only its own flags.

Imports no JAX at module level: `add_cli_args` runs while `--help` is built, and the
checks of the values alone (`check`) answer before JAX loads.
"""

from __future__ import annotations

import argparse
import dataclasses

from qwen3_spmd.pipeline.bounds import LEAST
from qwen3_spmd.run import compile_cache, distributed
from qwen3_spmd.run.distributed import DEFAULT_PEER_TIMEOUT
from qwen3_spmd.run.flags import (
    CLIError,
    add_dtype,
    add_expert_split,
    add_model,
    byte_count,
    flag,
    local_cpu_devices,
    mesh_devices,
    platform_is_cpu,
    use_cpu_devices,
)

DEFAULT_MAX_SEQ_LEN = 4096  # per request, when the model allows as many positions
CP = ("ring", "ulysses", "auto")
RUNNERS = ("auto", "generate", "pooling")  # vLLM's --runner
# --max-num-seqs by default: vLLM's 256 on an accelerator, whose pool of pages holds many
# requests; 8 on a CPU, whose 2-core decode gains little past that (batch 8 decodes 5x
# the tokens/s of batch 1 on the 0.6B shapes), and whose pool is every row's most.
MAX_NUM_SEQS = {"cpu": 8, "accelerator": 256}

# Our name (a field below, or a request's parameter) -> the one users bring from vLLM,
# which every door that has the thing takes too: the command line as a flag
# (--max-model-len), LLM as a keyword (max_model_len), SamplingParams as its field
# (max_tokens). expert_split's is LLM's keyword from before it had that name.
ALIASES = {
    "max_seq_len": "max_model_len",
    "max_batch": "max_num_seqs",
    "prefill_tokens": "max_num_batched_tokens",
    "max_new_tokens": "max_tokens",
    "expert_split": "experts",
}


@dataclasses.dataclass
class EngineArgs:
    """The engine's settings, one default each: a setting's flag is its name with dashes
    (`flags.flag`), and says what it means in its help (`add_cli_args`); vLLM's names are
    ALIASES. The comments note what no flag's help says."""

    model: str | None = None  # bench: None is the tiny preset, not the demo
    revision: str | None = None
    weights_seed: int = 0  # a preset's random weights' (generate's and bench's --seed)
    mesh: str | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    data_parallel_size: int | None = None
    cpu_devices: int | None = None
    dtype: str | None = None
    max_seq_len: int | None = None
    microbatches: int = 1
    groups: int | None = None
    chunk: int = 16
    cp: str = "ring"
    expert_split: str | None = None  # None: a2a with replicas, else tp (model.split)
    max_batch: int | None = None  # None: MAX_NUM_SEQS on the engine's platform
    block_size: int = 16
    kv_cache_memory_bytes: str | int | None = None  # "2G" as vLLM writes it (flags.byte_count)
    gpu_memory_utilization: float = 0.9
    prefill_tokens: int = 4096
    max_queue: int = 256
    enable_prefix_caching: bool | None = None
    speculative_config: str | dict | None = None  # JSON text or a mapping
    structured_outputs_config: str | dict | None = None  # JSON text or a mapping
    runner: str = "auto"
    hf_overrides: str | dict | None = None  # JSON text or a mapping
    compile_cache: str | None = None  # bench: off, its compile times are its figures
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
                metavar="MESH",
                help="a mesh shape to run, SxC, SxCxX or DxSxCxX (repeatable); 1x1 always "
                "runs as the baseline",
            )
        else:
            parser.add_argument(
                "--mesh",
                help="SxC, SxCxX or DxSxCxX: D replicas x S pipeline stages x C sequence "
                "devices x X tensor devices (default: DPxPPx1xTP of -dp, -pp and -tp, else "
                "1x1, but 2x2 emulated CPU devices on a CPU without --model or with several "
                "processes)",
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
                "--data-parallel-size",
                "-dp",
                type=int,
                metavar="D",
                help="D, the replicas (vLLM's name): each its own rows and KV pages, the same "
                "weights; with no --mesh, the mesh is DPxPPx1xTP",
            )
        parser.add_argument(
            "--cpu-devices",
            type=int,
            help="emulate this many CPU devices (default on CPU: the mesh's devices)",
        )
        parser.add_argument(
            "--block-size",
            type=int,
            default=d.block_size,
            help="KV cache slots a page holds on each seq device (vLLM's flag; default "
            f"{d.block_size})",
        )
        if bench:
            parser.add_argument(
                "--kv-cache-memory-bytes",
                metavar="BYTES",
                help="the paged scenario's pool of KV pages a device (e.g. 2G: K/M/G binary, "
                "k/m/g decimal; default: its rows' most)",
            )
        add_dtype(parser)
        add_expert_split(parser)
        if not bench:
            parser.add_argument(
                *_flags("max_seq_len"),
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
            parser.add_argument(
                "--structured-outputs-config",
                metavar="JSON",
                help="structured outputs' settings (vLLM's flag): "
                "'{\"disable_additional_properties\": false}' keeps JSON Schema's default, "
                "where an object that lists its properties takes other keys too (default "
                "true: it takes the listed ones only)",
            )
        if scheduler:
            _add_scheduler_args(parser, d)
            parser.add_argument(
                "--runner",
                choices=RUNNERS,
                default=d.runner,
                help="generate (text), pooling (embeddings and scores: Qwen3-Embedding, "
                "Qwen3-Reranker) or auto: pooling for a sentence-transformers folder "
                "(modules.json) or a reranker's --hf-overrides, else generate (vLLM's flag)",
            )
            parser.add_argument(
                "--hf-overrides",
                metavar="JSON",
                help="config.json keys over the folder's (vLLM's flag), for the pooling "
                'runner: \'{"architectures": ["Qwen3ForSequenceClassification"], '
                '"classifier_from_token": ["no", "yes"], '
                '"is_original_qwen3_reranker": true}\' serves Qwen3-Reranker; '
                "is_matryoshka, matryoshka_dimensions",
            )
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
        for name in (
            "microbatches",
            "groups",
            "chunk",
            "max_seq_len",
            "max_batch",
            "block_size",
            "prefill_tokens",
            "max_queue",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
            "cpu_devices",
        ):
            value, least = getattr(self, name), LEAST.get(name, 1)
            if value is not None and value < least:
                raise CLIError(f"{flag(name)} {value} must be at least {least}")
        if self.cp not in CP:
            raise CLIError(f"--cp {self.cp} is not one of {', '.join(CP)}")
        if self.kv_cache_memory_bytes is not None:
            given = byte_count(self.kv_cache_memory_bytes, "--kv-cache-memory-bytes")
            if given < 1:
                raise CLIError(f"--kv-cache-memory-bytes {given} must be at least 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise CLIError(
                f"--gpu-memory-utilization {self.gpu_memory_utilization} must be in (0, 1]"
            )
        if self.runner not in RUNNERS:
            raise CLIError(f"--runner {self.runner} is not one of {', '.join(RUNNERS)}")
        overrides = self.overrides()
        from qwen3_spmd.pipeline.pooling import asks_reranker

        if self.runner == "generate" and asks_reranker(overrides):
            raise CLIError(
                "--hf-overrides ask for a reranker, which the pooling runner serves: "
                "--runner pooling (or auto)"
            )
        from qwen3_spmd.pipeline.speculative.config import SpeculativeConfig, SpeculativeConfigError

        try:
            SpeculativeConfig.parse(self.speculative_config)
        except SpeculativeConfigError as e:
            raise CLIError(f"--speculative-config: {e.problem}") from None
        try:
            self.structured_outputs()
        except ValueError as e:
            raise CLIError(f"--structured-outputs-config: {e}") from None
        distributed.check_flags(self)

    def overrides(self) -> dict:
        """hf_overrides, read (`pipeline.pooling.read_overrides`; CLIError naming it)."""
        from qwen3_spmd.pipeline.pooling import read_overrides

        try:
            return read_overrides(self.hf_overrides)
        except ValueError as e:
            raise CLIError(f"--hf-overrides {e}") from None

    def runner_for(self, spec) -> str:
        """The runner for model `spec` (`run.models.ModelSpec`): --runner, or auto's
        choice; a model only the pooling runner can serve, asked to generate, is refused
        naming the file that says so."""
        from qwen3_spmd.pipeline.pooling import MODULES, asks_reranker, is_embedding_folder

        embedding = is_embedding_folder(spec.folder)
        if self.runner == "generate" and (embedding or spec.headless):
            why = (
                f"{spec.folder / MODULES} says it is a sentence-transformers embedding model"
                if embedding
                else "its weights are the bare decoder, with no lm_head"
            )
            raise CLIError(f"--runner generate: {why}: serve it with --runner pooling")
        if self.runner != "auto":
            return self.runner
        pooled = embedding or spec.headless or asks_reranker(self.overrides())
        return "pooling" if pooled else "generate"

    def pooling(self, spec, engine):
        """The pooling runner's `pipeline.pooling.Pooling` for model `spec` on `engine`
        (an embedding model's, or the reranker's that hf_overrides ask for); None for the
        generate runner. A folder that contradicts the task is refused naming its file."""
        from qwen3_spmd.pipeline import pooling

        if not engine.pooling:
            return None
        if self.speculative_config is not None:
            raise CLIError(
                "--speculative-config speeds up generation, and the pooling runner generates "
                "nothing: leave it out"
            )
        overrides = self.overrides()
        if pooling.asks_reranker(overrides):
            if spec.headless and not pooling.is_embedding_folder(spec.folder):
                raise CLIError(
                    f"--hf-overrides ask for a reranker, but {spec.label}'s weights are the "
                    "bare decoder, with no lm_head to score with: pass the reranker's folder"
                )
            return pooling.reranker(spec.folder, spec.cfg, overrides, spec.source, spec.text())
        return pooling.embedding(spec.folder, spec.cfg, overrides)

    def structured_outputs(self):
        """structured_outputs_config, read (`run.request_fields.StructuredOutputsConfig`;
        ValueError naming the fault)."""
        from qwen3_spmd.run.request_fields import StructuredOutputsConfig

        return StructuredOutputsConfig.parse(self.structured_outputs_config)

    def mesh_text(self, on_cpu: bool) -> str:
        """--mesh, or the one default rule (said in --mesh's help)."""
        if self.mesh is not None:
            return self.mesh
        pp, tp, dp = self.pipeline_parallel_size, self.tensor_parallel_size, self.data_parallel_size
        if dp is not None:
            return f"{dp}x{pp or 1}x1x{tp or 1}"
        if tp is not None or pp is not None:
            return f"{pp or 1}x1x{tp or 1}"
        demo = on_cpu and (self.model is None or self.num_processes is not None)
        return "2x2" if demo else "1x1"

    def mesh_shape(self, on_cpu: bool):
        """The MeshShape of `mesh_text`, checked against -tp, -pp and -dp."""
        from qwen3_spmd.sharding.mesh import parse_mesh

        shape = parse_mesh(self.mesh_text(on_cpu))
        for name, size in (
            ("tensor_parallel_size", shape.tensor),
            ("pipeline_parallel_size", shape.stage),
            ("data_parallel_size", shape.data),
        ):
            given = getattr(self, name)
            if given is not None and given != size:
                raise CLIError(
                    f"--mesh {self.mesh} has {size} where {flag(name)} says {given}: "
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
        """The Engine of these settings on `mesh` (`pipeline.scheduling.build.engine`: the
        one place an Engine is built from them). door: what a door adds that is not a
        setting (on_compile; bench: cp per run, dtype and the measured rates)."""
        from qwen3_spmd.pipeline.scheduling import build

        return build.engine(spec_cfg, source, mesh, **self.engine_kwargs(max_seq_len), **door)

    def speculator(self, engine, **door):
        """The Speculator of speculative_config over `engine` (None: plain decoding); a
        draft model opened as the model is, its Engine built as `engine` was (door: as
        `engine`'s)."""
        from qwen3_spmd.model.config import ConfigError
        from qwen3_spmd.pipeline.scheduling import build
        from qwen3_spmd.run.models import open_model

        def open_draft(name: str):
            try:
                draft = open_model(name, self.weights_seed)
            except ConfigError as e:
                raise CLIError(f"--speculative-config: model {name}: {e}") from None
            return draft.cfg, draft.source

        kwargs = {**self.engine_kwargs(engine.max_seq_len), **door}
        try:
            return build.speculator(engine, self.speculative_config, open_draft, **kwargs)
        except build.DraftError as e:
            raise CLIError(f"--speculative-config: {e}") from None

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
            block_size=self.block_size,
        )

    def scheduler(self, engine, many: bool = False, decisions=None, speculator=None, **door):
        """The continuous-batching Scheduler over `engine` with these settings, speculating
        with `speculator` (`pipeline.scheduling.build.scheduler`; many: several processes,
        decisions: how they share each round; door: what a door adds that is not a
        setting)."""
        from qwen3_spmd.pipeline.requests import RequestError
        from qwen3_spmd.pipeline.scheduling import build

        try:
            rows = self.rows(engine)
            pool = build.pool_size(
                engine,
                rows,
                self.kv_cache_bytes(),
                self.gpu_memory_utilization,
                many,
                speculator,
                self.prefill_tokens,
            )
            return build.scheduler(
                engine,
                rows,
                pool,
                self.enable_prefix_caching,
                prefill_tokens=self.prefill_tokens,
                max_queue=self.max_queue,
                decisions=decisions,
                speculator=speculator,
                **door,
            )
        except RequestError as e:  # a pool under a page
            if e.param != "kv_cache_memory_bytes":
                raise
            given = self.kv_cache_memory_bytes
            if given is None:  # sized from the device's memory: too little of it is free
                raise CLIError(
                    f"{e}; the pool was sized by {pool.how}: give --kv-cache-memory-bytes "
                    "or a higher --gpu-memory-utilization"
                ) from None
            raise CLIError(f"--kv-cache-memory-bytes {given}: {e}") from None

    def check_serving(self, shape) -> None:
        """A CLIError before any weight loads where the scheduler would refuse the mesh
        (`shape`, a MeshShape): over `data` replicas it runs no speculation."""
        if shape.data > 1 and self.speculative_config is not None:
            raise CLIError(
                f"--mesh {shape}: --speculative-config runs one replica, and D = "
                f"{shape.data}: leave --speculative-config out, or use D = 1"
            )

    def rows(self, engine) -> int:
        """--max-num-seqs, or its default on the engine's platform (MAX_NUM_SEQS)."""
        if self.max_batch is not None:
            return self.max_batch
        cpu = engine.mesh.devices.flat[0].platform == "cpu"
        return MAX_NUM_SEQS["cpu" if cpu else "accelerator"]

    def kv_cache_bytes(self) -> int | None:
        """--kv-cache-memory-bytes as a count (None: every row's most)."""
        given = self.kv_cache_memory_bytes
        return None if given is None else byte_count(given, "--kv-cache-memory-bytes")

    def build(self, mesh=None) -> Built:
        """Everything at once, in one process: started, the model opened, its weights on
        the mesh (or on `mesh`, a jax Mesh given as it is), the scheduler over them."""
        from qwen3_spmd.pipeline.structured.constraints import Grammars
        from qwen3_spmd.sharding.mesh import MeshShape

        runtime = self.start()
        self.check_serving(MeshShape.of(mesh) if mesh is not None else runtime.shape)
        spec = self.open_model()
        mesh = mesh if mesh is not None else runtime.mesh()
        runner = self.runner_for(spec)
        max_seq_len = self.seq_len(spec.cfg, runtime.shape.seq)
        engine = self.engine(spec.cfg, spec.source, mesh, max_seq_len, runner=runner)
        pooling = self.pooling(spec, engine)
        if pooling is not None:  # prefills only: no grammar, no drafter, no prefix cache
            scheduler = self.scheduler(engine)
            return Built(runtime, spec, engine, scheduler, pooling)
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
        """The ('data', 'stage', 'seq', 'tensor') Mesh over the job's first D*S*C*X
        devices, process 0's first (so they form replica 0's stage 0)."""
        from qwen3_spmd.sharding.mesh import make_mesh

        s = self.shape
        devices = mesh_devices(s.devices, self.procs, self.mesh_text)
        return make_mesh(s.stage, s.seq, devices, tensor=s.tensor, data=s.data)


@dataclasses.dataclass(frozen=True)
class Built:
    runtime: Runtime
    spec: object  # run.models.ModelSpec
    engine: object  # pipeline.runtime.engine.Engine
    scheduler: object  # pipeline.scheduling.scheduler.Scheduler
    pooling: object = None  # the pooling runner's pipeline.pooling.Pooling


def _flags(name: str) -> tuple[str, str]:
    """A setting's flag and its vLLM alias (ALIASES)."""
    return flag(name), flag(ALIASES[name])


def _add_scheduler_args(parser, d: EngineArgs) -> None:
    parser.add_argument(
        *_flags("max_batch"),
        type=int,
        metavar="N",
        default=d.max_batch,
        help="decode rows: requests running at once (default "
        f"{MAX_NUM_SEQS['accelerator']} on a GPU, {MAX_NUM_SEQS['cpu']} on a CPU)",
    )
    parser.add_argument(
        "--kv-cache-memory-bytes",
        metavar="BYTES",
        help="each device's memory for the pool of KV cache pages (vLLM's flag): an "
        "integer, or with k/m/g (decimal) or K/M/G (binary), e.g. 2G; requests take pages "
        "for the tokens they may reach and wait for free ones (default: every row's "
        "--max-model-len)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        metavar="FRACTION",
        default=d.gpu_memory_utilization,
        help="without --kv-cache-memory-bytes: the share of each device's memory for "
        "weights, activations and KV pages, the pages being what is left (vLLM's flag; "
        "default %(default)s); a CPU tells no memory: every row's --max-model-len, "
        "within that share of the host's available memory",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=d.max_queue,
        help=f"requests waiting for a row at most; more get 503 (default {d.max_queue})",
    )
    parser.add_argument(
        *_flags("prefill_tokens"),
        type=int,
        metavar="N",
        default=d.prefill_tokens,
        help="prompt tokens prefilled per round; longer prompts go in chunks "
        f"(default {d.prefill_tokens})",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="the prefix cache on or off: the KV pages of requests' whole blocks stay "
        "named, and a later prompt that begins alike shares them instead of computing "
        "(default: on with one seq device, off with several)",
    )
