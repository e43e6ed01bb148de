"""The `data` axis (issue 61): D replicas in one program, each its own rows and KV pages,
the same weights, no collective along `data`; a static batch's rows split over them.

Against transformers (greedy tokens, request 0's logits at 1e-4), seeded sampling
against one device, the bytes per device (weights as at D = 1, KV pages 1/D), the
tables each replica reads, and the refusals in one line.
Budget: one engine per (fixture, mesh), one generate each (a sampled one on 2x1x1x1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import fixture

from qwen3_spmd.model.checkpoint.hf import HFCheckpoint
from qwen3_spmd.pipeline.batch.handles import Params
from qwen3_spmd.pipeline.batch.replicas import program_order, to_program
from qwen3_spmd.pipeline.batch.rowbook import RowBook
from qwen3_spmd.pipeline.programs.sampling import Sampling
from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.pipeline.scheduling import static_batch
from qwen3_spmd.pipeline.scheduling.scheduler import Scheduler
from qwen3_spmd.sharding.footprint import bytes_per_device
from qwen3_spmd.sharding.mesh import MeshError, MeshShape, make_mesh, parse_mesh

TOL = 1e-4  # float32, as every parity test here
SAMPLED = Sampling(temperature=0.8, top_p=0.9)
_ENGINES: dict[tuple, Engine] = {}


def _engine(name: str, D: int, S: int, C: int, X: int, **kw) -> Engine:
    key = (name, D, S, C, X)
    if key not in _ENGINES:
        folder, cfg, _, _ = fixture(name)
        mesh = make_mesh(S, C, jax.devices()[: D * S * C * X], tensor=X, data=D)
        _ENGINES[key] = Engine(cfg, HFCheckpoint(folder, cfg), mesh, max_seq_len=64, chunk=4)
    return _ENGINES[key]


MESHES = [(2, 1, 1, 1), (2, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2), (4, 1, 1, 2)]


@pytest.mark.parametrize(
    "name, mesh",
    [("wide", m) for m in MESHES] + [("moe", m) for m in MESHES],
    ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)),
)
def test_replicas_give_transformers_tokens_and_logits(name, mesh):
    """Each replica decodes its share of the prompts (the last ones padding) as one
    device would: every request's greedy tokens and request 0's logits are
    transformers'. MoE's experts split over data x tensor, each token sent to its
    experts' devices and back by all-to-alls (the default with replicas; the fixture
    mixes dense and sparse layers, so the all-to-alls run inside the layer's cond)."""
    _, _, ref, prompts = fixture(name)
    engine = _engine(name, *mesh)
    gen = static_batch.generate(engine, prompts, int(ref["max_new_tokens"]))
    assert gen.layout["batch"] % mesh[0] == 0 and gen.layout["batch"] >= len(prompts)
    for i, c in enumerate(gen.completions):
        assert c.token_ids == ref[f"greedy_tokens_{i}"].tolist(), i
    steps = ref["step_logits_0"].shape[0]
    np.testing.assert_allclose(gen.first_logits[:steps], ref["step_logits_0"], atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "name, meshes", [("wide", ((2, 1, 1, 1), (4, 1, 1, 2))), ("moe", ((2, 1, 1, 2),))]
)
def test_seeded_sampling_is_the_same_over_replicas(name, meshes):
    """A request samples with its own key wherever its row is: 2x1x1x1 and 4x1x1x2 give
    one device's sampled tokens, and so does Qwen3-MoE over 2x1x1x2 (its experts
    reached by all-to-alls)."""
    _, _, ref, prompts = fixture(name)
    runs = [
        static_batch.generate(_engine(name, *m), prompts, 6, sampling=SAMPLED, seed=5)
        for m in ((1, 1, 1, 1), *meshes)
    ]
    tokens = [[c.token_ids for c in r.completions] for r in runs]
    assert all(t == tokens[0] for t in tokens[1:])
    greedy = [ref[f"greedy_tokens_{i}"].tolist()[:6] for i in range(len(prompts))]
    assert tokens[0] != greedy  # it did sample


def test_weights_replicate_and_kv_pages_split_per_replica():
    """A device of 2x1x1x2 holds what a device of 1x1x1x2 holds of the weights, and of
    a static batch's pool half the pages (its replica's rows')."""
    one, two = _engine("wide", 1, 1, 1, 2), _engine("wide", 2, 1, 1, 2)

    def shard_bytes(tree):
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))

    assert shard_bytes(two.weights) == shard_bytes(one.weights)
    cache_one, cache_two = one.copies.empty_cache(4), two.copies.empty_cache(4)
    assert cache_two.k.addressable_shards[0].data.nbytes * 2 == (
        cache_one.k.addressable_shards[0].data.nbytes
    )
    assert two.copies.cache_bytes_per_device(4) * 2 == one.copies.cache_bytes_per_device(4)
    # the footprint tool says the same from the shardings alone
    cfg, f32 = one.cfg, jnp.float32
    fp_one = bytes_per_device(cfg, 1, 1, f32, batch=4, max_seq_len=64, tensor=2)
    fp_two = bytes_per_device(cfg, 1, 1, f32, batch=4, max_seq_len=64, tensor=2, data=2)
    assert fp_two["weights"] == fp_one["weights"] == shard_bytes(two.weights.state)
    assert fp_two["kv"] * 2 == fp_one["kv"]
    assert fp_two["kv"] == 2 * cache_two.k.addressable_shards[0].data.nbytes


def test_moe_experts_split_over_data_and_tensor():
    """Over 2x1x1x2 each device holds 2 of the 8 experts (1/(D X) of them), the rest of
    the model as 1x1x1x2 does; the footprint tool says the same bytes."""
    engine = _engine("moe", 2, 1, 1, 2)
    assert engine.split.experts == "a2a"  # the default with replicas
    state = engine.weights.state
    E = engine.cfg.E
    for name in ("gate_efd", "up_efd", "down_edf"):
        for stack in jax.tree.leaves(state["layers"]["moe"][name]):  # a buffer a layer slot
            assert stack.shape[1] == E and stack.addressable_shards[0].data.shape[1] == E // 4
    one = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
    fp = bytes_per_device(engine.cfg, 1, 1, jnp.float32, tensor=2, data=2)
    assert fp["weights"] == one


def test_each_replica_reads_its_own_pages_by_its_own_numbers():
    """The row book deals its rows to the replicas in turn and hands a row pages of its
    replica's range; placed in the program's order (replica blocks), each replica's
    table names them from its own first page, and an entry past the pool stays past
    that replica's part of it."""
    book = RowBook(4, 1, 1, 8, block_size=4, pages=8, replicas=2)
    book.grow(0, 8)  # replica 0: pages 0, 1
    book.grow(1, 4)  # replica 1: page 4
    assert [book.replica_of(b) for b in range(4)] == [0, 1, 0, 1]
    assert book.table[0].tolist() == [0, 1] and book.table[1].tolist() == [4, 8]
    assert program_order(4, 2).tolist() == [0, 2, 1, 3]
    engine = _engine("wide", 2, 1, 1, 1)
    placed = engine.copies.with_rows(
        engine.copies.empty_cache(4, 8), book.slot_pos[:, :, : engine.slots_per_device]
    )
    local = engine.copies._table(to_program(book.table, 2), 8)
    assert np.asarray(local).tolist() == [[0, 1], [4, 4], [0, 4], [4, 4]]
    assert placed.table.sharding.spec == local.sharding.spec
    book.release(1)
    assert book.pages.free_in(1) == 4 and book.pages.free_in(0) == 2


def test_meshes_of_four_parts_and_their_refusals():
    assert parse_mesh("2x1x2x1") == MeshShape(1, 2, 1, data=2)
    assert str(parse_mesh("2x1x2x1")) == "2x1x2x1" and str(parse_mesh("1x2x1x4")) == "2x1x4"
    with pytest.raises(MeshError, match=r"mesh 3x1x1x1 needs 3 devices, but 2 are given"):
        make_mesh(1, 1, jax.devices()[:2], data=3)
    with pytest.raises(MeshError, match="DxSxCxX"):
        parse_mesh("2x1x1x1x1")


def test_a_scheduler_spreads_concurrent_requests_over_the_replicas():
    """Served over 2x1x1x1 with 4 rows a replica and the prefix cache: 16 requests
    submitted at once (the fixture's prompts in turn, 2 to 8 new tokens) start on both
    replicas, the one with the more free room first (the started count per replica
    shows the split), 8 decode at once, later ones of the 32-token prompt read its
    blocks where a replica holds them, and each gives transformers' greedy tokens;
    those of prompt 0 that ask for log-probabilities get transformers' (its logits at
    each token, 1e-4)."""
    _, _, ref, prompts = fixture("wide")
    engine = _engine("wide", 2, 1, 1, 1)
    sched = Scheduler(engine, max_batch=4, prefill_tokens=64, prefix_caching=True)
    asked = [(i % 3, 2 + i % 7, i % 3 == 0 and i % 2 == 0) for i in range(16)]
    handles = [
        sched.submit(prompts[p], Params(max_new_tokens=n, logprobs=lp)) for p, n, lp in asked
    ]
    busy = []  # each round's busy rows on each replica, after its admissions
    admit = sched.executor.admit

    def admitted(round):
        updates = admit(round)
        busy.append(_per_replica(sched.book))
        return updates

    sched.executor.admit = admitted
    sched.run()
    assert busy[0] == [4, 4]  # 8 at once, 4 on each
    assert sum(sched.replica_starts) == 16 and min(sched.replica_starts) >= 6
    assert sched.prefix.hits > 0
    steps = ref["step_logits_0"].shape[0]
    want = jax.nn.log_softmax(jnp.asarray(ref["step_logits_0"]), axis=-1)
    for h, (p, n, lp) in zip(handles, asked):
        assert h.tokens == ref[f"greedy_tokens_{p}"].tolist()[:n], (p, n)
        if lp:
            chosen = [x.chosen for x in h.logprobs][:steps]
            at = [want[k, t] for k, t in enumerate(h.tokens[:steps])]
            np.testing.assert_allclose(chosen, at, atol=TOL, rtol=0)


def _per_replica(book) -> list[int]:
    """The rows that hold a request on each replica."""
    return [sum(book.replica_of(b) == d for b in book.live()) for d in range(book.replicas)]
