"""run.engine_args: one set of engine arguments behind generate, serve, bench and LLM.
The same settings give the same engine through each door, each setting has one default,
and vLLM's names are aliases. Nothing here loads weights or compiles."""

from types import SimpleNamespace

import pytest

from qwen3_spmd.pipeline.scheduling import build
from qwen3_spmd.pipeline.scheduling.build import pool_size, prefix_caching
from qwen3_spmd.run import llm
from qwen3_spmd.run.bench.command import _settings
from qwen3_spmd.run.bench.jobs import engine_args as bench_engine_args
from qwen3_spmd.run.cli import build_parser
from qwen3_spmd.run.engine_args import EngineArgs
from qwen3_spmd.run.flags import CLIError

# The engine's settings, as flags and as LLM's keyword arguments.
FLAGS = [
    "--dtype", "float32", "--chunk", "4", "--groups", "2", "--microbatches", "3",
    "--cp", "ulysses", "--expert-split", "ep", "--block-size", "8",
]  # fmt: skip
KWARGS = dict(
    dtype="float32",
    chunk=4,
    groups=2,
    microbatches=3,
    cp="ulysses",
    expert_split="ep",
    block_size=8,
)


def _cli(command: str, *argv: str) -> EngineArgs:
    args = build_parser().parse_args([command, *argv])
    return EngineArgs.from_cli(args)


def _bench(*argv: str) -> EngineArgs:
    """bench's engine for its one --cp (its jobs build it per mesh and strategy)."""
    args = build_parser().parse_args(["bench", *argv])
    cp = args.cp[0] if args.cp else EngineArgs.cp
    return bench_engine_args(_settings(args), cp, args.dtype)


def test_the_same_arguments_give_the_same_engine_through_each_door():
    doors = {
        "generate": _cli("generate", *FLAGS, "--mesh", "2x2", "--max-seq-len", "64"),
        "serve": _cli("serve", *FLAGS, "--mesh", "2x2", "--max-seq-len", "64"),
        "LLM": llm.engine_args(mesh="2x2", max_seq_len=64, **KWARGS),
        "bench": _bench(*FLAGS),  # bench's lengths are its jobs' own
    }
    kwargs = {door: args.engine_kwargs(64) for door, args in doors.items()}
    assert kwargs["LLM"] == dict(
        dtype="float32", max_seq_len=64, microbatches=3, groups=2, chunk=4, cp="ulysses",
        experts="ep", block_size=8,
    )  # fmt: skip
    for door in doors:
        assert kwargs[door] == kwargs["LLM"], door
    for door in ("generate", "serve"):
        assert doors[door].mesh_text(on_cpu=True) == "2x2" and doors[door].max_seq_len == 64


def test_each_setting_has_one_default():
    """A door that leaves a setting out gets the dataclass's default (bench's chunk is
    None until --smoke or its default fills it: the same 16)."""
    default = EngineArgs()
    for door in ("generate", "serve"):
        assert _cli(door) == default, door
    assert llm.engine_args() == default
    assert _bench().engine_kwargs(1) == default.engine_kwargs(1)


@pytest.mark.parametrize(
    "command, alias, canonical",
    [
        ("serve", ["--max-model-len", "96"], ["--max-seq-len", "96"]),
        ("generate", ["--max-model-len", "96"], ["--max-seq-len", "96"]),
        ("serve", ["--max-num-seqs", "3"], ["--max-batch", "3"]),
        ("serve", ["--max-num-batched-tokens", "128"], ["--prefill-tokens", "128"]),
        (
            "serve",
            ["-tp", "2", "-pp", "4"],
            ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "4"],
        ),
        ("generate", ["-tp", "2"], ["--tensor-parallel-size", "2"]),
    ],
)
def test_vllm_flags_are_aliases(command, alias, canonical):
    assert _cli(command, *alias) == _cli(command, *canonical) != _cli(command)


def test_parallel_sizes_build_the_mesh():
    assert _cli("serve", "-tp", "2", "-pp", "4").mesh_text(on_cpu=False) == "4x1x2"
    assert _cli("generate", "-pp", "2").mesh_text(on_cpu=True) == "2x1x1"
    assert _cli("generate", "--mesh", "2x1x2", "-tp", "2").mesh_shape(on_cpu=False).tensor == 2
    with pytest.raises(CLIError, match="--mesh 2x2 has 1 where --tensor-parallel-size says 2"):
        _cli("generate", "--mesh", "2x2", "-tp", "2").mesh_shape(on_cpu=False)
    assert _cli("generate", "-dp", "2", "-tp", "2").mesh_text(on_cpu=True) == "2x1x1x2"
    assert _cli("serve", "--data-parallel-size", "4").mesh_shape(on_cpu=False).data == 4
    assert _cli("generate", "--mesh", "2x1x2x1").mesh_shape(on_cpu=False).devices == 4
    with pytest.raises(CLIError, match="--mesh 2x1x1 has 1 where --data-parallel-size says 2"):
        _cli("generate", "--mesh", "2x1x1", "-dp", "2").mesh_shape(on_cpu=False)
    with pytest.raises(CLIError, match="--data-parallel-size 0 must be at least 1"):
        _cli("generate", "-dp", "0").check()


def test_speculation_over_replicas_is_refused_in_one_line():
    """Speculation runs one replica: serve and LLM refuse it on D > 1 before any weight
    loads."""
    flags = ["--mesh", "2x1x1x1", "--speculative-config", '{"method": "ngram"}']
    with pytest.raises(CLIError, match="--mesh 2x1x1x1: --speculative-config runs one replica"):
        _cli("serve", "--model", "/nowhere", *flags).build()


def _engine(stats: dict | None = None, devices: int = 1):
    """What pool_size reads of an Engine: its first device's memory `stats` (a CPU says
    nothing), its devices, the rows' KV bytes (1000 a row), a prefill's temporaries."""
    device = SimpleNamespace(memory_stats=lambda: stats, platform="gpu" if stats else "cpu")
    return SimpleNamespace(
        mesh=SimpleNamespace(devices=SimpleNamespace(flat=[device], size=devices)),
        copies=SimpleNamespace(cache_bytes_per_device=lambda rows: 1000 * rows),
        max_seq_len=64,
        M=1,
        D=1,
        prefill_memory=lambda batch, tokens: {"temp": 3 * tokens},
    )


def test_the_pool_is_what_the_device_leaves_or_every_rows_most(monkeypatch):
    """vLLM's sizing: --kv-cache-memory-bytes as given; on a device that tells its memory,
    --gpu-memory-utilization of it less what is in use, a draft model's rows and the
    largest prefill's temporaries (a microbatch of min(prefill_tokens, max_seq_len));
    several processes, or a CPU: every row's most, on a CPU within that share of the
    host's available memory over its devices."""
    gpu = {"bytes_limit": 100_000, "bytes_in_use": 20_000}
    assert pool_size(_engine(gpu), 8, asked=5000).bytes == 5000
    got = pool_size(_engine(gpu), 8, utilization=0.9)
    assert got.bytes == 90_000 - 20_000 - 3 * 64 and "--gpu-memory-utilization 0.9" in got.how
    drafter = SimpleNamespace(
        drafter=SimpleNamespace(engine=SimpleNamespace(copies=_engine().copies))
    )
    assert pool_size(_engine(gpu), 8, speculator=drafter).bytes == 90_000 - 20_000 - 192 - 8000
    assert pool_size(_engine(gpu), 8, many=True).bytes is None
    monkeypatch.setattr(build, "host_available_bytes", lambda: 10**9)
    assert pool_size(_engine(), 8).bytes is None  # 8 rows of 1000 bytes fit
    monkeypatch.setattr(build, "host_available_bytes", lambda: 10_000)
    cpu = pool_size(_engine(devices=2), 8, utilization=0.5)
    assert cpu.bytes == 2500 and "no memory stats on cpu" in cpu.how
    with pytest.raises(CLIError, match="--gpu-memory-utilization 1.5 must be in"):
        _cli("serve", "--gpu-memory-utilization", "1.5").check()
    assert llm.engine_args(gpu_memory_utilization=0.5).gpu_memory_utilization == 0.5


def test_max_num_seqs_defaults_to_vllms_on_a_gpu_and_to_8_on_a_cpu():
    gpu = {"bytes_limit": 100_000, "bytes_in_use": 20_000}
    assert (_cli("serve").rows(_engine(gpu)), _cli("serve").rows(_engine())) == (256, 8)
    assert _cli("serve", "--max-num-seqs", "3").rows(_engine(gpu)) == 3


@pytest.mark.parametrize(
    "flags, C, D, expected",
    [
        ([], 1, 1, True),
        ([], 2, 1, False),  # several seq devices: none by default
        ([], 1, 2, True),  # each replica its own blocks
        (["--enable-prefix-caching"], 2, 1, True),
        (["--no-enable-prefix-caching"], 1, 1, False),
    ],
)
def test_prefix_caching_switch(flags, C, D, expected):
    args = _cli("serve", *flags)
    assert prefix_caching(args.enable_prefix_caching, SimpleNamespace(C=C, D=D)) is expected


def test_llm_takes_vllm_names_and_refuses_unknown_ones():
    assert llm.engine_args(max_model_len=96) == EngineArgs(max_seq_len=96)
    assert llm.engine_args(max_num_seqs=3, tensor_parallel_size=2) == EngineArgs(
        max_batch=3, tensor_parallel_size=2
    )
    with pytest.raises(TypeError, match="'max_model_length': did you mean max_model_len"):
        llm.engine_args(max_model_length=96)
    with pytest.raises(TypeError, match="'max_seq_len' twice"):
        llm.engine_args(max_seq_len=96, max_model_len=96)
    with pytest.raises(llm.RequestError, match=r"^chunk 0 must be at least 1$"):
        llm.engine_args(chunk=0)  # said as LLM's argument, not as the flag


def test_structured_outputs_config_is_read_once_for_every_door():
    """--structured-outputs-config (vLLM's flag and key): objects are closed unless it
    says disable_additional_properties false, through the flag and LLM's keyword alike;
    a value that is not served is one CLIError naming the flag and the fault."""
    assert EngineArgs().structured_outputs().disable_additional_properties is True
    kept_open = '{"disable_additional_properties": false}'
    for args in (
        _cli("serve", "--structured-outputs-config", kept_open),
        _cli("generate", "--structured-outputs-config", kept_open),
        llm.engine_args(structured_outputs_config={"disable_additional_properties": False}),
    ):
        args.check()
        assert args.structured_outputs().disable_additional_properties is False
    for value, words in (
        ("{nope", "not JSON"),
        ("[1]", "is not a JSON object"),
        ('{"backend": "xgrammar"}', "'backend' is not a key served here"),
        ('{"disable_additional_properties": "no"}', "must be true or false"),
    ):
        with pytest.raises(CLIError, match=f"^--structured-outputs-config: .*{words}"):
            _cli("serve", "--structured-outputs-config", value).check()
