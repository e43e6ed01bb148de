"""Qwen3-MoE against Hugging Face transformers' Qwen3MoeForCausalLM, on one device and on
meshes, and the three expert formulations against each other.

Fixtures (tests/fixtures/make_moe_reference.py): `moe` (5 layers, layer 2 dense by
mlp_only_layers, top 2 of 8 renormalised, GQA 4:2, untied), `moe_tied` (4 layers,
decoder_sparse_step 2, top 3 of 6 not renormalised, GQA 4:1, tied) and `moe_fused`
(`moe`'s weights in transformers 5.x's fused expert layout; `moe`'s references).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from reference import FIXTURES, right_padded

from qwen3_spmd.model import moe
from qwen3_spmd.model.checkpoint.hf import HFCheckpoint, LoadError, load_model
from qwen3_spmd.model.config import ConfigError, Qwen3Config
from qwen3_spmd.model.split import TensorSplit
from qwen3_spmd.model.stack import forward
from qwen3_spmd.pipeline.programs.sampling import Sampling
from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.pipeline.scheduling import static_batch
from qwen3_spmd.run import traffic
from qwen3_spmd.sharding.mesh import make_mesh

TOL = 1e-4
REFERENCE = {"moe": "moe", "moe_tied": "moe_tied", "moe_fused": "moe"}
SAMPLED = Sampling(temperature=0.8, top_k=20, top_p=0.9)


@functools.cache
def _fixture(name):
    folder = FIXTURES / name
    cfg = Qwen3Config.from_hf(folder)
    ref = np.load(FIXTURES / REFERENCE[name] / "reference.npz")
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(int(ref["num_prompts"]))]
    return folder, cfg, ref, prompts


# ---- config ------------------------------------------------------------------------------------


def _raw(name="moe"):
    return json.loads((FIXTURES / name / "config.json").read_text())


def test_config_reads_the_moe_fields():
    cfg = _fixture("moe")[1]
    assert (cfg.E, cfg.A, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (8, 2, 10, True)
    assert cfg.sparse_layers == (True, True, False, True, True)  # mlp_only_layers [2]
    tied = _fixture("moe_tied")[1]
    assert tied.sparse_layers == (False, True, False, True)  # decoder_sparse_step 2
    assert tied.tie_word_embeddings and not tied.norm_topk_prob


def test_config_reads_num_experts_as_the_hub_writes_it():
    raw = _raw()
    assert "num_local_experts" in raw  # transformers 5.x writes this name
    raw["num_experts"] = raw.pop("num_local_experts")  # the hub's config.json says this
    assert Qwen3Config.from_hf(raw) == _fixture("moe")[1]


def test_config_refusals():
    raw = _raw()
    raw["num_experts"] = 6
    with pytest.raises(ConfigError, match="num_experts=6 and num_local_experts=8 disagree"):
        Qwen3Config.from_hf(raw)
    raw = _raw()
    raw["num_experts_per_tok"] = 9
    with pytest.raises(ConfigError, match="num_experts_per_tok=9 must be between 1 and"):
        Qwen3Config.from_hf(raw)
    raw = _raw()
    raw["model_type"] = "qwen3_next"
    with pytest.raises(ConfigError, match="Qwen3-Next, a different architecture") as e:
        Qwen3Config.from_hf(raw)
    assert "\n" not in str(e.value)


# ---- the expert formulations -------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_formulations_agree_with_the_dense_one(rows):
    """Random router, experts and rows; prime-ish sizes so a swapped axis shows."""
    E, A, D, F = 7, 3, 13, 11
    keys = jax.random.split(jax.random.key(rows), 5)
    x = jax.random.normal(keys[0], (rows, D))
    router = jax.random.normal(keys[1], (E, D))
    gate, up = (0.3 * jax.random.normal(k, (E, F, D)) for k in keys[2:4])
    down = 0.3 * jax.random.normal(keys[4], (E, D, F))
    weights, ids, logits = moe.route(x, router, A, True)
    np.testing.assert_allclose(jnp.sum(weights, -1), 1.0, rtol=1e-6)
    chosen = jax.nn.one_hot(ids, E).sum(1) > 0
    assert (
        jnp.where(chosen, logits, jnp.inf).min(-1) > jnp.where(chosen, -jnp.inf, logits).max(-1)
    ).all()
    # the reference: a loop over rows and chosen experts in numpy
    xn, ref = np.asarray(x, np.float64), np.zeros((rows, D))
    for r in range(rows):
        for a in range(A):
            e = int(ids[r, a])
            g, u = np.asarray(gate[e]) @ xn[r], np.asarray(up[e]) @ xn[r]
            ref[r] += float(weights[r, a]) * (np.asarray(down[e]) @ (g / (1 + np.exp(-g)) * u))
    for how, f in moe.FORMULATIONS.items():
        y = jax.jit(lambda x, w, i, *g, f=f: f(x, w, i, *map(moe.Stacked, g)))(
            x, weights, ids, gate, up, down
        )
        np.testing.assert_allclose(y, ref, atol=1e-4, rtol=1e-4, err_msg=how)


# CPU's two (which skip the empty slots) and a GPU's prefill form (which computes them)
@pytest.mark.parametrize("how", ["looped", "blocked", "grouped"])
def test_all_to_all_experts_are_dropless_whatever_the_routing(how):
    """The "a2a" split on 2x1x1x2 (4 devices of data x tensor, 2 of the 8 experts each)
    under a routing no capacity would survive: every token of replica 0 chooses
    experts 0 and 1 (both device 0's: one slot, two choices), every token of replica 1
    experts 0 and 7 (devices 0 and 3); devices 1 and 2 serve nothing, device 0 every
    token. Each replica's output is every expert computed on one device
    (`experts_dense`), for 5 tokens a replica (3 a tensor device, one padding)."""
    E, A, Dm, F, R = 8, 2, 12, 7, 5
    _, moe_cfg, _, _ = _fixture("moe")
    cfg = dataclasses.replace(moe_cfg, hidden_size=Dm, moe_intermediate_size=F)
    assert (cfg.E, cfg.A) == (E, A)
    split = TensorSplit(2, "a2a", data=2)
    layer = moe.MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), split=split)
    x = jax.random.normal(jax.random.key(1), (2 * R, Dm))
    ids = jnp.array([[0, 1]] * R + [[0, 7]] * R, jnp.int32)
    weights = jax.random.uniform(jax.random.key(2), (2 * R, A), minval=0.1)
    stacks = [moe.Stacked(getattr(layer, w)[...]) for w in ("gate_efd", "up_efd", "down_edf")]
    want = moe.experts_dense(x, weights, ids, *stacks)
    mesh = make_mesh(1, 1, jax.devices()[:4], tensor=2, data=2)
    graphdef, state = nnx.split(layer)
    experts = P(("data", "tensor"))
    specs = jax.tree.map(lambda x: P() if x.ndim == 2 else experts, state)

    def local(state, x, weights, ids):
        part = nnx.merge(graphdef, state)._all_to_all(x, weights, ids, how)
        return jax.lax.psum(part, "tensor")

    run = jax.jit(
        jax.shard_map(
            local, mesh=mesh, in_specs=(specs, P("data"), P("data"), P("data")), out_specs=P("data")
        )
    )
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, specs)
    rows = NamedSharding(mesh, P("data"))
    args = (placed, *(jax.device_put(a, rows) for a in (x, weights, ids)))
    np.testing.assert_allclose(run(*args), want, atol=1e-5, rtol=1e-5)
    # the bytes run.traffic counts are the program's: 4 all-to-alls over data x tensor,
    # of which a device sends all but its own row (a quarter)
    exchanged = list(_all_to_alls(jax.make_jaxpr(run)(*args).jaxpr))
    assert [axes for axes, _ in exchanged] == [("data", "tensor")] * 4
    layout = {"batch": 2 * R, "groups": 1, "microbatches": 1, "padded_prompt": 2}
    counted = traffic.bytes_all_to_all(cfg, split, 1, 1, layout, 4)
    assert counted["decode_per_step"] == sum(b for _, b in exchanged) * 3 // 4 * sum(
        cfg.sparse_layers
    )


def _all_to_alls(jaxpr):
    """(axes, operand bytes) of every all_to_all in a jaxpr and the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "all_to_all":
            aval = eqn.invars[0].aval
            yield tuple(eqn.params["axis_name"]), aval.size * aval.dtype.itemsize
    for sub in jax.extend.core.subjaxprs(jaxpr):
        yield from _all_to_alls(sub)


@pytest.mark.parametrize("fused_max_k", [0, 12, 2048])
def test_looped_products_fused_or_plain_agree(fused_max_k, monkeypatch):
    """Every product plain, gate and up (rows of D = 13) plain with down (rows of F = 11)
    fused, every product fused: the same sums as the dense formulation."""
    E, A, D, F = 5, 2, 13, 11
    keys = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(keys[0], (3, D))
    weights, ids, _ = moe.route(x, jax.random.normal(keys[1], (E, D)), A, False)
    w = [
        moe.Stacked(jax.random.normal(k, s))
        for k, s in zip(keys[2:], [(E, F, D), (E, F, D), (E, D, F)])
    ]
    monkeypatch.setattr(moe, "FUSED_MAX_K", fused_max_k)
    np.testing.assert_allclose(
        moe.experts_looped(x, weights, ids, *w),
        moe.experts_dense(x, weights, ids, *w),
        atol=1e-5,
        rtol=1e-5,
    )


def test_dense_formulation_chunks_rows():
    E, A, D, F = 5, 2, 8, 6
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (23, D))
    weights, ids, _ = moe.route(x, jax.random.normal(keys[1], (E, D)), A, False)
    w = [
        moe.Stacked(jax.random.normal(k, s))
        for k, s in zip(keys[2:], [(E, F, D), (E, F, D), (E, D, F)])
    ]
    whole = moe.experts_dense(x, weights, ids, *w, chunk=64)
    np.testing.assert_allclose(
        moe.experts_dense(x, weights, ids, *w, chunk=5), whole, atol=1e-5, rtol=1e-5
    )


def test_formulation_by_rows():
    backend = jax.default_backend()
    decode = moe.DECODE.get(backend, "gathered")
    assert decode in ("gathered", "looped")
    most = 16 * moe.DECODE_PAIRS_PER_EXPERT.get(backend, 1)  # rows x 8 = pairs x 128 experts
    assert moe.formulation(1, 128, 8) == moe.formulation(most, 128, 8) == decode
    assert moe.formulation(most + 1, 128, 8) == moe.PREFILL.get(backend, "grouped")


# ---- one device against transformers -----------------------------------------------------------


@functools.cache
def _forward_fn(name, how=None):
    folder, cfg, _, _ = _fixture(name)
    graphdef, state = nnx.split(load_model(folder, cfg, jnp.float32))

    def run(st, tokens, positions):
        return forward(nnx.merge(graphdef, st), cfg, tokens, positions)

    fn = jax.jit(run)
    return lambda tokens, positions: np.asarray(
        fn(state, jnp.asarray(tokens), jnp.asarray(positions))
    )


@pytest.mark.parametrize("name", list(REFERENCE))
def test_prefill_logits_match_transformers(name):
    _, cfg, ref, prompts = _fixture(name)
    logits = _forward_fn(name)(*right_padded(prompts))
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(
            logits[i, : len(p)],
            ref[f"prefill_logits_{i}"],
            atol=TOL,
            rtol=0,
            err_msg=f"{name} prompt {i}",
        )
    assert np.isfinite(logits).all()


@pytest.mark.parametrize("how", list(moe.FORMULATIONS))
def test_every_formulation_matches_transformers(how, monkeypatch):
    """The whole model with each formulation forced: the prefill logits of `moe`."""
    _, cfg, ref, prompts = _fixture("moe")
    monkeypatch.setattr(moe, "formulation", lambda rows, experts, top: how)
    folder = _fixture("moe")[0]
    model = load_model(folder, cfg, jnp.float32)
    tokens, positions = right_padded(prompts)
    logits = np.asarray(forward(model, cfg, jnp.asarray(tokens), jnp.asarray(positions)))
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(
            logits[i, : len(p)],
            ref[f"prefill_logits_{i}"],
            atol=TOL,
            rtol=0,
            err_msg=f"{how} prompt {i}",
        )


@pytest.mark.parametrize("name", ["moe", "moe_tied"])
def test_router_margin_of_the_references(name):
    """Near-ties between the A-th and (A+1)-th expert could flip a choice: report the
    smallest router-logit margin over the fixture's tokens, ours and transformers'."""
    folder, cfg, ref, prompts = _fixture(name)
    model = load_model(folder, cfg, jnp.float32)
    seqs = [p + ref[f"greedy_tokens_{i}"].tolist() for i, p in enumerate(prompts)]
    margins = []

    def spy(x, router, top, normalize):
        out = route(x, router, top, normalize)
        ranked = jnp.sort(out[2], axis=-1)[:, ::-1]
        jax.debug.callback(
            lambda g: margins.append(float(g)), jnp.min(ranked[:, top - 1] - ranked[:, top])
        )
        return out

    route = moe.route
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "route", spy)
        for s in seqs:  # one at a time: no padding rows in the minimum
            forward(model, cfg, jnp.asarray([s]), jnp.arange(len(s))[None]).block_until_ready()
    ours = min(margins)
    print(
        f"{name}: smallest router margin {ours:.3e} (transformers' {float(ref['router_margin']):.3e})"
    )
    assert abs(ours - float(ref["router_margin"])) < 1e-4


# ---- the engine: meshes ------------------------------------------------------------------------


@functools.cache
def _engine(name, S, C):
    folder, cfg, _, _ = _fixture(name)
    return Engine(
        cfg,
        HFCheckpoint(folder, cfg),
        make_mesh(S, C, jax.devices()[: S * C]),
        max_seq_len=64,
        chunk=4,
    )


@functools.cache
def _generate(name, S, C, sampled=False):
    _, _, ref, prompts = _fixture(name)
    kw = dict(sampling=SAMPLED, seed=5) if sampled else {}
    return static_batch.generate(_engine(name, S, C), prompts, int(ref["max_new_tokens"]), **kw)


MESHES = [
    ("moe", 1, 1),
    ("moe", 2, 2),
    ("moe", 4, 1),
    ("moe", 1, 4),
    ("moe", 2, 4),
    ("moe_tied", 1, 1),
    ("moe_tied", 2, 2),
    ("moe_fused", 1, 1),
]


@pytest.mark.parametrize("name,S,C", MESHES, ids=[f"{n}-{s}x{c}" for n, s, c in MESHES])
def test_engine_greedy_tokens_match_transformers(name, S, C):
    _, _, ref, prompts = _fixture(name)
    out = _generate(name, S, C)
    for i, c in enumerate(out.completions):
        assert c.token_ids == ref[f"greedy_tokens_{i}"].tolist(), f"{name} {S}x{C} prompt {i}"
    np.testing.assert_allclose(out.first_logits, ref["step_logits_0"], atol=TOL, rtol=0)


def test_seeded_sampling_identical_across_meshes():
    base = _generate("moe", 1, 1, sampled=True)
    assert [c.token_ids for c in base.completions] != [
        c.token_ids for c in _generate("moe", 1, 1).completions
    ]  # it really samples
    for S, C in [(2, 2), (4, 1), (1, 4)]:
        out = _generate("moe", S, C, sampled=True)
        assert [c.token_ids for c in out.completions] == [c.token_ids for c in base.completions], (
            f"{S}x{C}"
        )


# ---- the loader --------------------------------------------------------------------------------


def _edited(tmp_path: Path, name: str, edit) -> Path:
    """A copy of fixture `name` whose tensors went through edit(dict) -> dict."""
    from safetensors.numpy import load_file, save_file

    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    tensors = edit(load_file(out / "model.safetensors"))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _load_error(folder: Path) -> str:
    with pytest.raises(LoadError) as e:
        HFCheckpoint(folder, Qwen3Config.from_hf(folder))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_loader_names_a_missing_expert(tmp_path):
    name = "model.layers.3.mlp.experts.5.up_proj.weight"
    folder = _edited(tmp_path, "moe", lambda t: {k: v for k, v in t.items() if k != name})
    assert f"lacks tensor {name}" in _load_error(folder)


def test_loader_names_a_wrong_expert_count(tmp_path):
    def drop_last(t):  # the checkpoint has 7 experts; config.json says 8
        return {k: v for k, v in t.items() if ".mlp.experts.7." not in k}

    msg = _load_error(_edited(tmp_path, "moe", drop_last))
    assert "has 7 experts in layer 0" in msg and "num_experts=8" in msg

    def nine(t):
        for i in (0, 1, 3, 4):
            for p in ("gate", "up", "down"):
                t[f"model.layers.{i}.mlp.experts.8.{p}_proj.weight"] = t[
                    f"model.layers.{i}.mlp.experts.0.{p}_proj.weight"
                ]
        return t

    assert "has 9 experts in layer 0" in _load_error(_edited(tmp_path / "9", "moe", nine))


def test_loader_names_a_wrong_expert_count_in_the_fused_layout(tmp_path):
    def cut(t):
        return {k: (v[:6] if ".mlp.experts." in k else v) for k, v in t.items()}

    msg = _load_error(_edited(tmp_path, "moe_fused", cut))
    assert "holds 6 experts" in msg and "num_experts=8" in msg


def test_loader_refuses_a_router_in_a_dense_layer(tmp_path):
    def extra(t):
        t["model.layers.2.mlp.gate.weight"] = t["model.layers.0.mlp.gate.weight"]
        return t

    assert "unexpected tensor model.layers.2.mlp.gate.weight" in _load_error(
        _edited(tmp_path, "moe", extra)
    )


def test_mixed_layers_hold_zeros_for_the_other_kind():
    folder, cfg, _, _ = _fixture("moe")
    ckpt = HFCheckpoint(folder, cfg)
    gate = ckpt.read(("layers", "moe", "gate_efd"), np.float32)
    dense = ckpt.read(("layers", "gate_fd"), np.float32)
    assert gate.shape == (5, 8, 10, 24) and dense.shape == (5, 36, 24)
    assert not gate[2].any() and all(gate[i].any() for i in (0, 1, 3, 4))
    assert dense[2].any() and not any(dense[i].any() for i in (0, 1, 3, 4))
    fused = HFCheckpoint(FIXTURES / "moe_fused", cfg)
    for path in [("layers", "moe", p) for p in ("gate_efd", "up_efd", "down_edf", "router_ed")]:
        np.testing.assert_array_equal(fused.read(path, np.float32), ckpt.read(path, np.float32))


# ---- presets at scale (shapes only) ------------------------------------------------------------

# Published totals and active parameters (model cards), as printed there: truncated, not
# rounded (30B-A3B has 3,353,032,704 active parameters; its card says 3.3B).
PUBLISHED = {"30B-A3B": ("30.5", "3.3"), "235B-A22B": ("235", "22")}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_moe_preset_parameter_counts_match_model_cards(name):
    from qwen3_spmd.model.config import PRESETS
    from qwen3_spmd.model.layers import Qwen3

    cfg = PRESETS[name]
    model = nnx.eval_shape(lambda: Qwen3(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    total = sum(x.size for x in leaves)
    assert total == cfg.param_count()
    assert model.layers.moe.gate_efd.shape == (cfg.L, 128, cfg.moe_intermediate_size, cfg.D)
    assert not hasattr(model.layers, "gate_fd")  # every layer sparse: no dense MLP buffers
    for count, printed in zip((total, cfg.param_count(active=True)), PUBLISHED[name]):
        digits = len(printed.split(".")[1]) if "." in printed else 0
        assert math.floor(count / 10 ** (9 - digits)) / 10**digits == float(printed)


def test_235b_fits_h200s_at_8_stages_in_bfloat16():
    from qwen3_spmd.model.config import PRESETS
    from qwen3_spmd.sharding.footprint import bytes_per_device

    cfg = PRESETS["235B-A22B"]
    b = bytes_per_device(cfg, 8, 2, jnp.bfloat16, batch=8, max_seq_len=32768)
    # 94 layers on 8 stages: 12 slots each (two stages hold an identity slot)
    layer = (cfg.param_count() - 2 * cfg.V * cfg.D - cfg.D) * 2 / cfg.L
    assert b["weights"] == pytest.approx(12 * layer + 2 * 2 * cfg.V * cfg.D + 2 * cfg.D)
    assert b["kv"] == 2 * 96 // 8 * 8 * cfg.K * (32768 // 2) * cfg.H * 2
    assert b["total"] < 141e9 * 0.5  # an H200 holds 141 GB
    half = bytes_per_device(cfg, 4, 2, jnp.bfloat16, batch=8, max_seq_len=32768)
    assert half["weights"] == pytest.approx(24 * layer + 2 * 2 * cfg.V * cfg.D + 2 * cfg.D)


# ---- orbax --------------------------------------------------------------------------------------


def test_orbax_round_trip_of_a_moe_checkpoint(tmp_path):
    """`convert` of the mixed dense/sparse fixture: every parameter reads back bitwise
    (the unused kind's zeros included), and a 2x2 engine on it gives transformers'
    tokens and the safetensors run's logits."""
    from qwen3_spmd.model.checkpoint import orbax_io as ob
    from qwen3_spmd.run import conversion

    folder, cfg, ref, prompts = _fixture("moe")
    conversion.convert(folder, tmp_path / "orbax", "float32")
    orb, hf = ob.OrbaxCheckpoint(tmp_path / "orbax", cfg), HFCheckpoint(folder, cfg)
    for path in [("layers", "moe", p) for p in ("router_ed", "gate_efd", "up_efd", "down_edf")] + [
        ("layers", "gate_fd"),
        ("embed_vd",),
    ]:
        np.testing.assert_array_equal(orb.read(path, np.float32), hf.read(path, np.float32))
    out = static_batch.generate(
        Engine(cfg, orb, make_mesh(2, 2, jax.devices()[:4]), max_seq_len=64, chunk=4),
        prompts,
        int(ref["max_new_tokens"]),
    )
    for i, c in enumerate(out.completions):
        assert c.token_ids == ref[f"greedy_tokens_{i}"].tolist(), i
    np.testing.assert_array_equal(out.first_logits, _generate("moe", 2, 2).first_logits)


# ---- bench: the transformers peer and random checkpoints of a MoE preset -----------------------


def test_bench_peer_and_random_checkpoint_hold_the_same_moe(tmp_path):
    """The bench's transformers peer (fused experts, built from a weight source) and
    `convert --random-preset`'s safetensors (per-expert tensors) are the same model as
    ours on the mixed fixture config."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from qwen3_spmd.model.checkpoint.random_weights import RandomWeights
    from qwen3_spmd.run.bench.measure import MemoSource
    from qwen3_spmd.run.bench.peer import hf_model
    from qwen3_spmd.run.convert import write_random_hf
    from qwen3_spmd.run.models import ModelSpec, open_model

    cfg = _fixture("moe")[1]
    source = RandomWeights(cfg, 3)
    theirs = hf_model(ModelSpec(cfg, source, None, "random", True), MemoSource(source), "float32")
    theirs.config._experts_implementation = "eager"  # grouped_mm wants 16-byte strides
    ids = np.array([[1, 5, 9, 200, 3]])
    with torch.no_grad():
        want = theirs(input_ids=torch.tensor(ids)).logits.numpy()
    write_random_hf(cfg, tmp_path / "hf", 3)
    spec = open_model(str(tmp_path / "hf"))
    assert spec.cfg == cfg
    ours = forward(
        load_model(tmp_path / "hf", cfg, jnp.float32), cfg, jnp.asarray(ids), jnp.arange(5)[None]
    )
    np.testing.assert_allclose(ours, want, atol=TOL, rtol=0)


def test_decode_roofline_counts_the_experts_a_step_needs():
    from qwen3_spmd.model.config import PRESETS
    from qwen3_spmd.run.bench.measure import decode_bytes_per_step, distinct_experts

    cfg = PRESETS["30B-A3B"]
    assert distinct_experts(cfg, 1) == pytest.approx(8)
    assert 8 < distinct_experts(cfg, 8) < 64
    one = decode_bytes_per_step(cfg, 1, 0, 2)["weights"]
    # a token meets its active parameters (and one embedding row) only
    assert one == 2 * (cfg.param_count(active=True) - cfg.V * cfg.D + cfg.D)


def test_other_platforms_formulations_on_a_mesh(monkeypatch):
    """GPU and TPU take `gathered` for decode and `grouped` for prefill (not the CPU's
    choice): forced here, inside the mesh program of a 2x2 engine, they give
    transformers' tokens too."""
    monkeypatch.setitem(moe.DECODE, jax.default_backend(), "gathered")
    monkeypatch.setitem(moe.PREFILL, jax.default_backend(), "grouped")
    folder, cfg, ref, prompts = _fixture("moe")
    out = static_batch.generate(
        Engine(
            cfg,
            HFCheckpoint(folder, cfg),
            make_mesh(2, 2, jax.devices()[:4]),
            max_seq_len=64,
            chunk=4,
        ),
        prompts,
        int(ref["max_new_tokens"]),
    )
    for i, c in enumerate(out.completions):
        assert c.token_ids == ref[f"greedy_tokens_{i}"].tolist(), i
    np.testing.assert_allclose(out.first_logits, ref["step_logits_0"], atol=TOL, rtol=0)
