"""The stage plan, mesh construction and the two pipeline schedules as data."""

import itertools

import jax
import numpy as np
import pytest

from qwen3_spmd.pipeline.programs.schedule import decode_grid, prefill_grid, stats, timeline
from qwen3_spmd.sharding.mesh import MeshError, make_mesh, parse_mesh
from qwen3_spmd.sharding.stages import PlanError, StagePlan

# ---- StagePlan ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "L,S,want",
    [
        (28, 2, [[0, 13], [14, 27]]),
        (5, 2, [[0, 2], [3, 4]]),
        (5, 4, [[0, 1], [2, 2], [3, 3], [4, 4]]),
        (9, 8, [[0, 1]] + [[i, i] for i in range(2, 9)]),
        (36, 5, [[0, 7], [8, 14], [15, 21], [22, 28], [29, 35]]),
        (4, 4, [[0, 0], [1, 1], [2, 2], [3, 3]]),
        (3, 1, [[0, 2]]),
    ],
)
def test_stage_layers(L, S, want):
    assert StagePlan(L, S).stage_layers == want


@pytest.mark.parametrize("L,S", [(28, 2), (5, 2), (5, 3), (5, 4), (9, 8), (64, 7), (1, 1)])
def test_plan_invariants(L, S):
    plan = StagePlan(L, S)
    slots = plan.layer_of_slot
    per = plan.per_stage
    assert plan.padded_layers == S * -(-L // S) == len(slots)
    # every real layer exactly once, in order
    assert [i for i in slots if i is not None] == list(range(L))
    for s, (first, last) in enumerate(plan.stage_layers):
        mine = slots[s * per : (s + 1) * per]
        n = last - first + 1
        # the stage's real layers first, then identity slots
        assert mine == list(range(first, last + 1)) + [None] * (per - n)
    counts = [last - first + 1 for first, last in plan.stage_layers]
    assert max(counts) - min(counts) <= 1 and min(counts) >= 1
    np.testing.assert_array_equal(plan.real_slots, [i is not None for i in slots])
    assert plan.real_slots.dtype == bool and plan.real_slots.sum() == L


def test_layer_of_slot_5_on_4():
    plan = StagePlan(5, 4)
    assert plan.layer_of_slot == [0, 1, 2, None, 3, None, 4, None]
    assert plan.real_slots.tolist() == [True, True, True, False, True, False, True, False]


def test_more_stages_than_layers_is_refused():
    with pytest.raises(PlanError) as e:
        StagePlan(5, 8)
    assert "8" in str(e.value) and "5" in str(e.value)


# ---- mesh --------------------------------------------------------------------------------


def test_make_mesh_shapes():
    mesh = make_mesh(2, 4, jax.devices()[:8])
    assert dict(mesh.shape) == {"data": 1, "stage": 2, "seq": 4, "tensor": 1}
    assert mesh.axis_names == ("data", "stage", "seq", "tensor")
    # seq is the minor axis: neighbouring devices share a stage
    assert [d.id for d in mesh.devices[0, 0, :, 0]] == [d.id for d in jax.devices()[:4]]
    # tensor is innermost: a stage's tensor devices are neighbours
    mesh = make_mesh(2, 1, jax.devices()[:8], tensor=4)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()[:8]]
    assert [d.id for d in mesh.devices[0, 1, 0]] == [d.id for d in jax.devices()[4:8]]
    # data is outermost: a replica's devices are neighbours
    mesh = make_mesh(2, 1, jax.devices()[:8], tensor=2, data=2)
    assert [d.id for d in mesh.devices[1].flat] == [d.id for d in jax.devices()[4:8]]


@pytest.mark.parametrize("S,C,n", [(2, 2, 3), (4, 2, 4), (1, 3, 8), (8, 2, 8)])
def test_make_mesh_refuses_wrong_device_count(S, C, n):
    with pytest.raises(MeshError) as e:
        make_mesh(S, C, jax.devices()[:n])
    msg = str(e.value)
    assert f"{S}x{C}" in msg and str(S * C) in msg and str(n) in msg


@pytest.mark.parametrize(
    "text,want",
    [
        ("2x4", (2, 4, 1, 1)),
        ("1X1", (1, 1, 1, 1)),
        ("8x1", (8, 1, 1, 1)),
        ("2x1x4", (2, 1, 4, 1)),
        ("2x1x1x4", (1, 1, 4, 2)),  # D x S x C x X: the shape's fields are (S, C, X, D)
    ],
)
def test_parse_mesh(text, want):
    assert parse_mesh(text) == want
    assert str(parse_mesh(text)) == text.lower()


@pytest.mark.parametrize("text", ["2", "2x", "x2", "axb", "2x2x2x2x2", "2x2x", "2*2", "", "2.0x1"])
def test_parse_mesh_refuses_malformed(text):
    with pytest.raises(MeshError) as e:
        parse_mesh(text)
    assert repr(text) in str(e.value) and "SxC" in str(e.value)


@pytest.mark.parametrize("text", ["0x2", "2x0", "-1x4", "1x1x0", "0x1x1x1"])
def test_parse_mesh_refuses_non_positive(text):
    with pytest.raises(MeshError, match="positive"):
        parse_mesh(text)


# ---- schedules ---------------------------------------------------------------------------


@pytest.mark.parametrize("M,S", [(1, 1), (1, 2), (3, 2), (4, 4), (8, 3), (2, 8), (5, 1)])
def test_prefill_idle_fraction(M, S):
    grid = prefill_grid(M, S)
    st = stats(grid)
    assert st["ticks"] == M + S - 1
    assert st["idle_fraction"] == pytest.approx((S - 1) / (M + S - 1))
    assert st["busy_slots"] == M * S
    # stage s runs microbatch m at tick m + s, each microbatch once per stage
    for s, row in enumerate(grid):
        assert [t for t, m in enumerate(row) if m is not None] == [m + s for m in range(M)]
        assert [m for m in row if m is not None] == list(range(M))


def test_prefill_grid_picture():
    assert prefill_grid(3, 2) == [[0, 1, 2, None], [None, 0, 1, 2]]


def _assert_tokens_arrive_in_time(grid, G, S):
    """Step i + 1 of a group may enter stage 0 only after its step i left the last stage
    (the token it feeds is sampled there)."""
    for g in range(G):
        first = [t for t, x in enumerate(grid[0]) if x == g]
        last = [t for t, x in enumerate(grid[S - 1]) if x == g]
        assert len(first) == len(last)
        for i in range(1, len(first)):
            assert first[i] > last[i - 1], (
                f"G={G} S={S}: group {g} step {i} enters stage 0 at tick {first[i]}, before "
                f"its step {i - 1} left stage {S - 1} at tick {last[i - 1]}"
            )


@pytest.mark.parametrize(
    "G,S,n", [(2, 2, 3), (4, 2, 2), (3, 3, 4), (5, 4, 3), (8, 8, 2), (1, 1, 5)]
)
def test_decode_steady_state_has_no_idle_when_groups_cover_stages(G, S, n):
    grid = decode_grid(G, S, n)
    assert stats(grid, skip_edges=S - 1)["idle_fraction"] == 0
    _assert_tokens_arrive_in_time(grid, G, S)
    # every group visits every stage n times, in stage order
    for s, row in enumerate(grid):
        for g in range(G):
            ticks = [t for t, x in enumerate(row) if x == g]
            assert len(ticks) == n
            if s > 0:
                prev = [t for t, x in enumerate(grid[s - 1]) if x == g]
                assert [t - 1 for t in ticks] == prev


@pytest.mark.parametrize("G,S,n", [(1, 2, 4), (2, 4, 4), (3, 4, 3), (1, 8, 2)])
def test_decode_with_fewer_groups_than_stages_must_idle(G, S, n):
    """A request's next step needs the token its last step sampled on the last stage:
    with G < S, group g cannot re-enter stage 0 until S ticks after it did, so some
    slots of the steady state must be idle."""
    grid = decode_grid(G, S, n)
    _assert_tokens_arrive_in_time(grid, G, S)
    assert stats(grid, skip_edges=S - 1)["idle_fraction"] > 0


def test_decode_grid_picture():
    assert decode_grid(2, 2, 2) == [[0, 1, 0, 1, None], [None, 0, 1, 0, 1]]


@pytest.mark.parametrize("S,M", [(1, 1), (2, 3), (4, 12)])
def test_timeline_has_a_row_per_stage_and_a_header(S, M):
    grid = prefill_grid(M, S)
    lines = timeline(grid, "prefill").splitlines()
    assert len(lines) == S + 1
    assert lines[0].startswith("prefill")
    for s in range(S):
        assert lines[1 + s].startswith(f"stage {s}")
    # the header lists every tick; cells line up with it
    assert lines[0].split()[1:] == [str(t) for t in range(M + S - 1)]
    assert len({len(line) for line in lines}) == 1
    for s, row in enumerate(grid):
        cells = lines[1 + s].split()[2:]
        assert cells == [str(m) for m in row if m is not None]


def test_stats_window():
    grid = [[0, None, 1, None], [None, 0, None, 1]]
    assert stats(grid) == {"ticks": 4, "busy_slots": 4, "idle_fraction": 0.5}
    assert stats(grid, skip_edges=1) == {"ticks": 2, "busy_slots": 2, "idle_fraction": 0.5}
    assert (
        stats(grid, skip_edges=2)["ticks"] == 0
        and stats(grid, skip_edges=2)["idle_fraction"] == 0.0
    )


def test_all_small_shapes_idle_fraction_formula():
    for M, S in itertools.product(range(1, 6), range(1, 6)):
        assert stats(prefill_grid(M, S))["idle_fraction"] == pytest.approx((S - 1) / (M + S - 1))
