"""The `tensor` mesh axis (model.split): heads, MLP columns, vocabulary and experts split
over X devices inside the one shard_map, against transformers' fixtures and against
the single device.

The `wide` fixture has 8 query heads over 2 KV heads (so 4 and 8 tensor devices repeat
each KV head), an MLP width of 100 and a vocabulary of 333 (which 8 does not divide:
padded) and 5 layers (uneven over 2 stages); `tied` ties lm_head to the embedding.
Budget: one engine per (fixture, mesh), one generate per engine and kind of run.
"""

import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from reference import FIXTURES, Oracle, fixture

from qwen3_spmd.model.checkpoint.hf import HFCheckpoint
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.split import TensorError, TensorSplit
from qwen3_spmd.pipeline.batch.handles import Params
from qwen3_spmd.pipeline.programs.layout import lay_out
from qwen3_spmd.pipeline.programs.sampling import RowSampling, Sampling, greedy_split, sample_rows
from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.pipeline.runtime.shapes import DecodeShape, PrefillShape
from qwen3_spmd.pipeline.scheduling import static_batch
from qwen3_spmd.pipeline.scheduling.scheduler import Scheduler
from qwen3_spmd.pipeline.speculative.speculator import Speculator
from qwen3_spmd.run import traffic
from qwen3_spmd.sharding.footprint import bytes_per_device
from qwen3_spmd.sharding.mesh import make_mesh

TOL = 1e-4
SAMPLED = Sampling(temperature=0.8, top_k=20, top_p=0.9)


_ENGINES: dict[tuple, Engine] = {}


def _engine(name, S, C, X, cp="ring", experts="tp") -> Engine:
    key = (name, S, C, X, cp, experts)
    if key not in _ENGINES:
        folder, cfg, _, _ = fixture(name)
        mesh = make_mesh(S, C, jax.devices()[: S * C * X], tensor=X)
        _ENGINES[key] = Engine(
            cfg, HFCheckpoint(folder, cfg), mesh, max_seq_len=64, chunk=4, cp=cp, experts=experts
        )
    return _ENGINES[key]


def _check_against_transformers(engine: Engine, name: str):
    _, _, ref, prompts = fixture(name)
    gen = static_batch.generate(engine, prompts, int(ref["max_new_tokens"]))
    for i, c in enumerate(gen.completions):
        assert c.token_ids == ref[f"greedy_tokens_{i}"].tolist(), i
    np.testing.assert_allclose(gen.first_logits, ref["step_logits_0"], atol=TOL, rtol=0)


DENSE = [
    ("wide", 2, 1, 2),  # X divides K; 5 layers over 2 stages
    ("wide", 1, 1, 4),  # K = 2 < X: each KV head on 2 devices; V padded to 336
    ("wide", 1, 1, 8),  # each KV head on 4 devices; F = 100 padded to 104
    ("wide", 2, 1, 4),
    ("wide", 1, 2, 4),  # the ring over seq, each device 1/4 of the heads
    ("wide", 2, 2, 2),
    ("tied", 1, 1, 4),  # lm_head is the embedding, split by vocabulary rows
]


@pytest.mark.parametrize("mesh", DENSE, ids=lambda m: f"{m[0]}-{m[1]}x{m[2]}x{m[3]}")
def test_dense_meshes_match_transformers(mesh):
    _check_against_transformers(_engine(*mesh), mesh[0])


def test_ulysses_splits_each_devices_heads_over_seq():
    """Ulysses' all-to-all on 1x2x2: each device's 4 query heads split further over seq."""
    _check_against_transformers(_engine("wide", 1, 2, 2, cp="ulysses"), "wide")


MOE = [
    ("moe", 1, 1, 2, "ep"),
    ("moe", 1, 1, 2, "tp"),
    ("moe", 2, 1, 2, "tp"),  # 5 layers over 2 stages, the dense layer 2 on stage 0
    ("moe", 1, 2, 2, "ep"),  # the ring over seq, each device half the experts
    ("moe", 2, 2, 2, "ep"),
]


@pytest.mark.parametrize("mesh", MOE, ids=lambda m: f"{m[1]}x{m[2]}x{m[3]}-{m[4]}")
def test_moe_experts_over_tensor_match_transformers(mesh):
    """Whole experts per device (ep) or every expert's columns (tp); the fixture mixes
    sparse layers with a dense one (layer 2), so the dense MLP is split too."""
    name, S, C, X, experts = mesh
    _check_against_transformers(_engine(name, S, C, X, experts=experts), name)


def test_seeded_sampling_is_the_single_devices():
    """Temperature, top-k and top-p together: the logits of a row are gathered before the
    filters, so 2x1x4 draws exactly the tokens of 1x1 with the same keys."""
    _, _, ref, prompts = fixture("wide")
    runs = [
        static_batch.generate(_engine("wide", *mesh), prompts[:2], 8, sampling=SAMPLED, seed=3)
        for mesh in ((1, 1, 1), (2, 1, 4))
    ]
    one, split = ([c.token_ids for c in g.completions] for g in runs)
    assert one == split
    assert one[0] != ref["greedy_tokens_0"].tolist()  # it sampled, not a greedy rerun


def test_constrained_tokens_are_the_same_on_every_mesh():
    """A bounded JSON Schema's greedy answers through `static_batch.generate` on 2x1x4 (V =
    333 padded to 336: each device's 84 ids start inside a mask word, and greedy reads
    its block's bits before the (value, id) pairs are gathered) and on 1x1x1: the same
    tokens, and each answer validates, ended by its grammar. (Sampling masks the
    gathered vocabulary with the 1x1 code: test_structured's mask test.) The engines and
    prompts of the seeded sampling test above (its prefills)."""
    import jsonschema

    from qwen3_spmd.pipeline.structured.constraints import Constraint, Grammars
    from qwen3_spmd.run.text import Text

    folder, cfg, _, prompts = fixture("wide")
    text = Text(folder)
    grammars = Grammars.of_text(text, cfg.V, (302, 300))
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [7, "bc"]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }

    def answers(engine, speculator=None):
        return static_batch.generate(
            engine,
            prompts[:2],
            24,
            eos_ids=(302,),
            with_logits=False,
            constraint=Constraint.json_schema(schema),
            grammars=grammars,
            speculator=speculator,
        )

    runs = [answers(_engine("wide", *mesh)) for mesh in ((1, 1, 1), (2, 1, 4))]
    one, split = ([c.token_ids for c in g.completions] for g in runs)
    assert one == split
    for c in runs[0].completions:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(text.decode(c.token_ids, skip_special=True)), schema)
    # Speculation on 2x1x4: each verify position masked by the grammar in its block's
    # bits, as a decode step's; the drafts are the answers, every third made wrong.
    engine = _engine("wide", 2, 1, 4)
    drafter = Oracle({tuple(p): t for p, t in zip(prompts[:2], one)}, 2, every=3, at=1)
    speculator = Speculator(engine, drafter)
    spec = answers(engine, speculator)
    assert speculator.metrics.accepted_tokens > 0
    assert [c.token_ids for c in spec.completions] == one


def test_greedy_from_split_logits_is_argmax_with_bans_and_ties():
    """`greedy_split` gathers each device's best (value, id) only: the token is the
    lowest id of the largest value, as greedy over the whole row, bans applied."""
    B, V, X = 6, 40, 4
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((B, V)).astype(np.float32)
    logits[1, [3, 27]] = 9.0  # a tie across devices: the lower id wins
    logits[2, [25, 33]] = 9.0  # a tie on one side of a device boundary
    logits[3, 12] = 9.0  # banned below: the next best wins
    rows = RowSampling.stack([(Sampling(), 0, r, (5, (12, 1))) for r in range(B)])
    mesh = make_mesh(1, 1, jax.devices()[:X], tensor=X)
    split = TensorSplit(X)

    def local(x, rows):
        return greedy_split(x, rows, jnp.int32(2), split)[None]

    f = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(None, "tensor"), RowSampling(*[P()] * len(RowSampling._fields))),
        out_specs=P("tensor"),
    )
    got = np.asarray(jax.jit(f)(logits, rows))  # [X, B]: every device has them all
    want = np.asarray(sample_rows(jnp.asarray(logits), rows, jnp.int32(2), sampled=False))
    assert (got == want[None]).all()
    assert want[1] == 3 and want[2] == 25 and want[3] != 12


def test_continuous_batching_on_2x1x2_gives_each_request_its_tokens():
    """A request joins while another decodes, over the two decode groups of the 2
    stages: each request's tokens are the ones transformers gives it alone."""
    _, _, ref, prompts = fixture("wide")
    budgets = [8, 5]
    sched = Scheduler(_engine("wide", 2, 1, 2), max_batch=2, prefill_tokens=16)
    handles = [sched.submit(prompts[0], Params(budgets[0]))]
    sched.step()
    sched.step()
    handles.append(sched.submit(prompts[1], Params(budgets[1])))
    sched.run()
    for i, (h, n) in enumerate(zip(handles, budgets)):
        assert h.tokens == ref[f"greedy_tokens_{i}"].tolist()[:n], i
    cache = sched.executor.cache  # each device holds a stage's layers and half the heads
    held = [x.addressable_shards[0].data.nbytes for x in (cache.k, cache.v)]
    assert sched.kv_bytes_per_device == sum(held) == (cache.k.nbytes + cache.v.nbytes) // 4


@pytest.mark.parametrize("X", [4, 8])
def test_a_hosts_rows_are_those_of_the_whole_placed_parameter(X):
    """What a host reads for a block of the tensor devices (one device, or 2 or 4 in a
    row, as hosts hold them) and fits is that block of the whole parameter as placed:
    `wide`'s KV heads repeated X/2 times, F = 100 and V = 333 padded (to 104 and 336
    with X = 8)."""
    from qwen3_spmd.model.params import Part, abstract_model, map_params
    from qwen3_spmd.sharding.specs import tensor_axis

    folder, cfg, _, _ = fixture("wide")
    ckpt, split = HFCheckpoint(folder, cfg), TensorSplit(X)
    placed, checked = {}, 0
    map_params(
        lambda path, x: placed.__setitem__(path, x.shape), abstract_model(cfg, np.float32, split)[1]
    )
    for path, shape in placed.items():
        axis = tensor_axis(path)
        if axis is None:
            continue
        layers = [2] if path[0] == "layers" else None
        full = ckpt.read(path, np.float32, layers)
        n, rows = full.shape[axis], shape[axis]
        whole = split.cut(path, axis, n, rows, 0, rows).fit(full)
        assert whole.shape[axis] == rows
        for per_host in (1, 2, 4):
            for lo in range(0, rows, rows // X * per_host):
                hi = lo + rows // X * per_host
                cut = split.cut(path, axis, n, rows, lo, hi)
                got = cut.fit(ckpt.read(path, np.float32, layers, Part(axis, *cut.rows())))
                np.testing.assert_array_equal(got, Part(axis, lo, hi).of(whole))
                checked += 1
    assert checked >= 9 * (X + X // 2 + X // 4)


def test_refusals_name_the_sizes_that_fit():
    _, wide, _, _ = fixture("wide")  # N = 8, K = 2
    _, tiny, _, _ = fixture("tiny")  # N = 6, K = 2
    _, moe, _, _ = fixture("moe")  # N = 4, K = 2, E = 8
    with pytest.raises(TensorError, match=r"^tensor 3: its 8 query heads .* 1, 2, 4, 8$"):
        TensorSplit(3).check(wide)
    with pytest.raises(
        TensorError, match=r"^tensor 3: its 2 KV heads .*; use a tensor size of 1, 2, 6$"
    ):
        TensorSplit(3).check(tiny)
    six = Qwen3Config(**{**moe.__dict__, "num_experts": 6})
    with pytest.raises(TensorError, match=r"its 6 experts .* 'tp'\); use a tensor size of 1, 2$"):
        TensorSplit(4, experts="ep").check(six)
    TensorSplit(4).check(six)  # split by columns (the default), any count of experts fits
    with pytest.raises(TensorError, match=r"6 experts .* by 2 x 2 data x tensor .* size of 1$"):
        TensorSplit.of(2, data=2).check(six)  # whole experts over data x tensor
    with pytest.raises(TensorError, match="tensor 4: its 6 query heads"):
        Engine(
            tiny,
            HFCheckpoint(FIXTURES / "tiny", tiny),
            make_mesh(1, 1, jax.devices()[:4], tensor=4),
        )


@pytest.mark.parametrize("axes", [("stage", "seq"), ("stage", "seq", "tensor")])
def test_a_mesh_of_other_axes_is_refused_in_words(axes):
    from jax.sharding import AxisType

    from qwen3_spmd.sharding.mesh import MeshError

    folder, cfg, _, _ = fixture("tiny")
    mesh = jax.make_mesh(
        (1,) * len(axes), axes, devices=jax.devices()[:1], axis_types=(AxisType.Auto,) * len(axes)
    )
    with pytest.raises(MeshError, match=r"not \('data', 'stage', 'seq', 'tensor'\): build it"):
        Engine(cfg, HFCheckpoint(folder, cfg), mesh)


def test_the_cli_refuses_in_one_line(capsys):
    from qwen3_spmd.run.cli import main

    argv = ["generate", "--model", str(FIXTURES / "tiny"), "--mesh", "1x1x4", "--prompt-ids", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "tensor 4: its 6 query heads" in err, err


def test_per_device_bytes_are_the_footprints():
    """Weights and KV cache per device as placed equal `sharding.footprint` (repeated KV
    heads and padding counted), and split 1/(S*X) of the single device's but for the
    whole norms and the repeats."""
    _, cfg, _, prompts = fixture("wide")
    sizes = {}
    for mesh in ((1, 1, 1), (1, 1, 4), (2, 1, 4)):
        S, C, X = mesh
        engine = _engine("wide", *mesh)
        measured = max(traffic.bytes_per_device(engine.weights.state))
        cache = engine.copies.empty_cache(2)
        kv = max(traffic.bytes_per_device((cache.k, cache.v)))
        want = bytes_per_device(cfg, S, C, jnp.float32, batch=2, max_seq_len=64, tensor=X)
        assert (measured, kv) == (want["weights"], want["kv"]), mesh
        sizes[mesh] = want
    one, four = sizes[(1, 1, 1)], sizes[(1, 1, 4)]
    assert four["kv"] * 2 == one["kv"]  # 2 KV heads on 4 devices: each holds one, not 1/2
    # Whole on every device: input and post-attention norms, the final norm, q and k norms.
    norms = ((2 * cfg.L + 1) * cfg.D + 2 * cfg.L * cfg.H) * 4
    pad = 2 * (336 - 333) * cfg.D * 4  # embedding and lm_head rows
    k_v = 2 * cfg.L * (4 - 2) * cfg.H * cfg.D * 4  # k and v projections of the repeated heads
    assert four["weights"] * 4 == one["weights"] - norms + 4 * norms + pad + k_v


def test_the_prompts_logprobs_never_gather_the_vocabulary():
    """A prefill that scores every prompt token under tensor 4 (sampling.split_logprobs):
    no collective moves a [B, T, V] array, only each device's reductions and top
    candidates (the one gather of the vocabulary is the last token's logits [B, V],
    as without scoring)."""
    engine = _engine("wide", 1, 1, 4)
    _, cfg, _, prompts = fixture("wide")
    prompt = prompts[0]
    laid = lay_out([prompt], 1, 1, 1, engine.slots_per_device, targets=[prompt[1:] + [-1]])
    from qwen3_spmd.pipeline.programs.prefill import PrefillInputs

    inputs = engine.copies.abstract(laid.prefill, PrefillInputs.specs(targets=True))
    hlo = (
        engine.jitted(PrefillShape(laid.B, laid.P_pad, prompt_logprobs=True))
        .lower(engine.weights, engine.copies.abstract_cache(laid.B), inputs)
        .compile()
        .as_text()
    )
    ops = ("all-gather(", "all-reduce(", "collective-permute(", "all-to-all(")
    moved = [
        [int(d) for d in dims.split(",")]
        for line in hlo.splitlines()
        if any(op in line for op in ops)
        for dims in re.findall(r"\w+\[([\d,]+)\]", line.split("=", 1)[1].split("(")[0])
    ]
    assert [1, laid.P_pad, 4 * 5] in moved  # the devices' top candidates, gathered
    assert not [s for s in moved if len(s) == 3 and s[-1] >= cfg.V // 4]


def test_two_all_reduces_of_the_hidden_state_per_layer():
    """Megatron's count: the embedding's sum, then per layer one after attention's
    output projection and one after the MLP; nothing else of the hidden state's size."""
    engine = _engine("wide", 1, 1, 4)
    _, cfg, _, prompts = fixture("wide")
    laid = engine.lay_out(prompts[:1])
    from qwen3_spmd.pipeline.programs.prefill import PrefillInputs

    inputs = engine.copies.abstract(laid.prefill, PrefillInputs.specs())
    hlo = (
        engine.jitted(PrefillShape(laid.B, laid.P_pad))
        .lower(engine.weights, engine.copies.abstract_cache(laid.B), inputs)
        .compile()
        .as_text()
    )
    reduces = re.findall(r"= f32\[(\d+),(\d+),(\d+)\][^=]* all-reduce\(", hlo)
    hidden = [s for s in reduces if int(s[2]) == cfg.D]  # [B, T, D]
    assert len(hidden) == 2 * cfg.L + 1, reduces


def _collectives(jaxpr):
    """(primitive, axes) of every collective in a jaxpr and the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith(("psum", "pmax", "ppermute")):
            yield eqn.primitive.name, tuple(eqn.params.get("axes", eqn.params.get("axis_name")))
    for sub in jax.extend.core.subjaxprs(jaxpr):
        yield from _collectives(sub)


@pytest.mark.parametrize("mesh", [(1, 1, 1), (1, 2, 1), (2, 1, 2)], ids=["1x1", "1x2", "2x1x2"])
def test_merge_and_shift_collectives_only_where_the_mesh_has_several(mesh):
    """A decode chunk merges decode attention over `seq` (pmax, psums) only with several
    `seq` devices (over one, each all-reduce would still be a launch a layer), and
    shifts between stages (ppermute) only with several stages."""
    S, C, _ = mesh
    engine = _engine("wide", *mesh)
    B = 2
    shape = DecodeShape(B, False, False, groups=1, steps=engine.chunk, with_logits=False)
    args = engine.weights, engine.copies.abstract_cache(B), engine._abstract_decode_inputs(B)
    found = set(_collectives(jax.make_jaxpr(engine.jitted(shape))(*args).jaxpr))
    assert (("pmax", ("seq",)) in found) == (C > 1), found
    assert any(name == "ppermute" for name, _ in found) == (S > 1), found


@pytest.mark.parametrize(
    "mesh, stage_processes",
    [("2x1x4", [[0], [1]]), ("1x2x4", [[0, 1]])],
    ids=["stages-across", "ring-across"],
)
def test_two_processes_with_tensor_devices_inside_each(mesh, stage_processes):
    """Two processes of 4 devices (gloo on CPU), the tensor devices inside each: the
    stages across them (2x1x4), or the ring's two `seq` devices (1x2x4)."""
    from children import child_env
    from ports import free_port
    from reference import ROOT

    ENV = child_env()

    folder, _, ref, prompts = fixture("wide")
    argv = ["--model", str(folder), "--mesh", mesh, "--cpu-devices", "4"]
    argv += ["--max-new-tokens", "6", "--json"]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "qwen3_spmd.run", "generate", *argv]
            + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
            + ["--process-id", str(i)],
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    report = json.loads(outs[0][0])
    S, C, X = map(int, mesh.split("x"))
    assert report["mesh"] == {"data": 1, "stage": S, "seq": C, "tensor": X}
    assert report["stage_processes"] == stage_processes
    for i, r in enumerate(report["requests"]):
        assert r["token_ids"] == ref[f"greedy_tokens_{i}"].tolist()[:6], i
