"""pipeline.scheduling.scheduler: requests join and leave the decode rows while the mesh runs, and
each request gets exactly the tokens it gets alone (a scheduler that runs nothing else),
whatever arrived before, beside or after it, on every mesh shape."""

import asyncio

import jax
import numpy as np
import pytest
from children import child_env
from ports import free_port
from reference import TINY

from qwen3_spmd.model.checkpoint.hf import HFCheckpoint
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.pipeline.batch.handles import Params, Request
from qwen3_spmd.pipeline.programs.layout import bucket, lay_out, length_bucket
from qwen3_spmd.pipeline.programs.prefill import PrefillInputs
from qwen3_spmd.pipeline.programs.sampling import Sampling
from qwen3_spmd.pipeline.requests import RequestError
from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.pipeline.runtime.shapes import DecodeShape, PrefillShape
from qwen3_spmd.pipeline.scheduling import static_batch
from qwen3_spmd.pipeline.scheduling.planner import (
    Admission,
    Chunk,
    DecodeChunk,
    Round,
    chunk_while_waiting,
)
from qwen3_spmd.pipeline.scheduling.scheduler import QueueFull, Scheduler
from qwen3_spmd.sharding.mesh import make_mesh

MAX_SEQ = 64
MESHES = [(1, 1), (2, 2), (2, 1), (1, 2)]


@pytest.fixture(scope="module")
def cfg():
    return Qwen3Config.from_hf(TINY)


_ENGINES = {}


@pytest.fixture(scope="module", autouse=True)
def _engines_go_with_the_module():
    """The module's engines are let go when it ends, and their compiled programs with
    them (conftest's `_release_programs`)."""
    yield
    _ENGINES.clear()


def _engine(cfg, S, C, **kw):
    """One engine per mesh and settings for the module: its programs compile once for
    every test that runs the same shapes (a test that patches it restores it)."""
    key = (S, C, *sorted(kw.items()))
    if key not in _ENGINES:
        mesh = make_mesh(S, C, jax.devices()[: S * C])
        _ENGINES[key] = Engine(
            cfg, HFCheckpoint(TINY, cfg), mesh, max_seq_len=MAX_SEQ, chunk=4, **kw
        )
    return _ENGINES[key]


# Every scheduler of the module on an engine holds one pool of this many rows' pages
# (the most rows a test asks for), so they run the same prefill programs (a program
# takes the pool; rows of their own change only the decode programs).
POOL_ROWS = 8


def _scheduler(engine, max_batch, **kw) -> Scheduler:
    page = engine.copies.page_bytes_per_device()
    kw.setdefault("kv_cache_memory_bytes", POOL_ROWS * engine.pages_per_row * page)
    return Scheduler(engine, max_batch, **kw)


def _record_decodes(monkeypatch, engine) -> list[tuple[int, bool, bool]]:
    """(rows, sampled, logprobs) of every decode chunk `engine` runs from now on in this
    test: the shapes a shared engine's compiled programs no longer tell apart."""
    seen, decode = [], engine.decode

    def recording(
        cache, slot_pos, table, inputs, groups, sampled, with_logits, clock, logprobs=False
    ):
        seen.append((len(inputs.step), sampled, logprobs))
        return decode(cache, slot_pos, table, inputs, groups, sampled, with_logits, clock, logprobs)

    monkeypatch.setattr(engine, "decode", recording)
    return seen


@pytest.fixture(scope="module")
def alone(cfg):
    """(prompt, params) -> its tokens through a 1x1 scheduler that runs nothing else."""
    sched = _scheduler(_engine(cfg, 1, 1), 4)
    seen = {}

    def tokens(prompt, p: Params) -> list[int]:
        key = (tuple(prompt), p)
        if key not in seen:
            handle = sched.submit(list(prompt), p)
            sched.run()
            seen[key] = handle.tokens
        return seen[key]

    return tokens


def _prompts(cfg, n, seed=0, lengths=(5, 9, 3, 14, 7, 1, 11)):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.V, L).tolist() for L in lengths[:n]]


BUDGETS = [6, 3, 9, 5, 1, 8, 4]


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_staggered_greedy_requests_get_their_tokens_alone(cfg, alone, mesh):
    """Seven requests of different lengths and budgets (one of a single token) over
    fewer rows than requests, arriving in three waves: rows are reused, and every
    request's tokens and finish reason are those it gets alone."""
    prompts = _prompts(cfg, 7)
    params = [Params(n) for n in BUDGETS]
    # An EOS id the third request meets in its third token: it must stop there.
    eos = alone(prompts[2], params[2])[2]
    params[2] = Params(BUDGETS[2], eos_ids=(eos,))
    sched = _scheduler(_engine(cfg, *mesh, microbatches=2), max_batch=3, prefill_tokens=20)
    handles = [sched.submit(p, q) for p, q in zip(prompts[:2], params[:2])]
    sched.step()
    handles += [sched.submit(p, q) for p, q in zip(prompts[2:5], params[2:5])]
    sched.step()
    sched.step()
    handles += [sched.submit(p, q) for p, q in zip(prompts[5:], params[5:])]
    sched.run()
    assert sched.B == (4 if mesh[0] == 2 else 3)  # a multiple of the decode groups
    for h, prompt, p in zip(handles, prompts, params):
        want = alone(prompt, p)
        assert h.tokens == want, h.id
        stopped = bool(p.eos_ids) and want[-1] in p.eos_ids
        assert h.finish_reason == ("stop" if stopped else "length")
        assert (h.prompt_tokens, h.completion_tokens) == (len(prompt), len(want))
        assert len(h.token_times_s) == len(want) and h.time_to_first_token_s > 0
        assert h.token_times_s == sorted(h.token_times_s)
    assert handles[2].finish_reason == "stop" and len(handles[2].tokens) == 3


@pytest.mark.parametrize("mesh", [(1, 1), (2, 2), (1, 2)], ids=lambda m: f"{m[0]}x{m[1]}")
def test_long_prompts_prefill_in_chunks_while_rows_decode(cfg, alone, mesh):
    """Prompts longer than a chunk (8 tokens) are prefilled a chunk a round, each chunk
    attending to the earlier ones in the cache (across the seq devices on C > 1),
    while the requests already in rows keep decoding; every request's tokens are
    those it gets alone, the long ones' included (a sampled one too)."""
    rng = np.random.default_rng(5)
    short, long_a, long_b = (rng.integers(0, cfg.V, n).tolist() for n in (4, 30, 17))
    sampled = Params(6, Sampling(temperature=0.9, top_k=20), seed=4)
    sched = _scheduler(_engine(cfg, *mesh), max_batch=3, prefill_tokens=8)
    first = sched.submit(short, Params(12))
    sched.step()
    a = sched.submit(long_a, Params(5))
    b = sched.submit(long_b, sampled)
    c = sched.submit(short[::-1], Params(3))
    during = []
    while a.completion_tokens == 0:
        before = first.completion_tokens
        sched.step()
        during.append((sched.prefilling, first.completion_tokens - before))
    # 30 tokens in chunks of 8: three rounds holding a row before the fourth finishes,
    # and the row already decoding got tokens in each of them
    assert [p for p, _ in during] == [1, 1, 1, 0] and all(n > 0 for _, n in during[:3])
    sched.run()
    for h, prompt, p in [
        (first, short, Params(12)),
        (a, long_a, Params(5)),
        (b, long_b, sampled),
        (c, short[::-1], Params(3)),
    ]:
        assert h.tokens == alone(prompt, p), h.id


def test_long_prompt_chunks_run_ulysses_when_asked(cfg, alone):
    """cp="ulysses" on 1x2: every chunk of a long prompt, the later ones attending to
    the cached earlier ones too, splits its attention by heads (the programs say so),
    and the tokens are the prompt's alone."""
    rng = np.random.default_rng(8)
    prompt = rng.integers(0, cfg.V, 21).tolist()
    engine = _engine(cfg, 1, 2, cp="ulysses")
    sched = _scheduler(engine, max_batch=2, prefill_tokens=8)
    handle = sched.submit(prompt, Params(5))
    sched.run()
    assert handle.tokens == alone(prompt, Params(5))
    prefills = sorted({n.split(" [")[0] for n in engine.programs.compiled if "prefill" in n})
    assert prefills == ["prefill ulysses", "prefill ulysses context"], prefills


def test_mixed_sampling_in_one_program_each_request_as_alone(cfg, alone, monkeypatch):
    """Greedy and seeded sampled requests with different settings decode together in
    one compiled program; each request's tokens are those it samples alone."""
    settings = [
        Params(6, Sampling(), 0),
        Params(6, Sampling(temperature=0.8), 3),
        Params(6, Sampling(temperature=1.2, top_k=5), 3),
        Params(6, Sampling(temperature=0.9, top_p=0.7), 11),
        Params(6, Sampling(temperature=0.7, top_k=9, top_p=0.9), 5),
    ]
    prompts = _prompts(cfg, 5, seed=1)
    engine = _engine(cfg, 2, 2)
    sched = _scheduler(engine, max_batch=6)
    decodes = _record_decodes(monkeypatch, engine)
    handles = [sched.submit(p, q) for p, q in zip(prompts, settings)]
    sched.run()
    for h, prompt, p in zip(handles, prompts, settings):
        assert h.tokens == alone(prompt, p), p
    assert len(set(decodes)) == 1 and decodes[0][1], decodes  # one shape, sampled
    # the blocking iterator runs the rounds itself: the same request alone in the
    # scheduler streams the same tokens as under load
    lone = _scheduler(engine, max_batch=6)
    assert list(lone.submit(prompts[3], settings[3])) == handles[3].tokens


def test_cancel_frees_the_row_for_a_waiting_request(cfg, alone):
    prompts = _prompts(cfg, 3, seed=2)
    sched = _scheduler(_engine(cfg, 1, 1), max_batch=2)
    handles = [sched.submit(p, Params(12)) for p in prompts]
    sched.step()
    assert [len(h.tokens) > 0 for h in handles] == [True, True, False] and sched.waiting == 1
    sched.cancel(handles[0])
    with pytest.raises(RequestError, match="cancelled already"):
        sched.cancel(handles[0])
    sched.step()
    assert handles[0].finish_reason == "cancelled"
    assert handles[2].tokens and sched.waiting == 0  # admitted into the freed row
    sched.run()
    for h, prompt in zip(handles[1:], prompts[1:]):
        assert h.tokens == alone(prompt, Params(12))
    with pytest.raises(RequestError, match="nothing to cancel"):
        sched.cancel(handles[1])  # finished


def test_admission_prefills_each_length_bucket_in_whole_batches(cfg, alone, monkeypatch):
    """A round admits every waiting prompt a free row takes, prefilled with those of
    its length bucket only, in batches a bucketed shape fills without padding rows."""
    prompts = _prompts(cfg, 4, seed=5, lengths=(17, 30, 20, 18))  # buckets 24, 32, 24, 24
    engine = _engine(cfg, 1, 1)
    sched = _scheduler(engine, max_batch=4)
    prefill, shapes = engine.prefill, []

    def recording(batch, *args, **kw):
        shapes.append((batch.requests, batch.B, batch.P_pad))
        return prefill(batch, *args, **kw)

    monkeypatch.setattr(engine, "prefill", recording)
    handles = [sched.submit(p, Params(4)) for p in prompts]
    sched.step()
    assert all(h.tokens for h in handles) and sched.waiting == 0
    # prompts 0, 2, 3 of bucket 24: three rows would pad to four, so two then one
    assert shapes == [(2, 2, 24), (1, 1, 24), (1, 1, 32)]
    sched.run()
    for h, prompt in zip(handles, prompts):
        assert h.tokens == alone(prompt, Params(4))


def test_stand_ins_run_while_programs_compile_and_give_the_same_tokens(cfg, alone, monkeypatch):
    """While the background compiles (`Planner.ready` is the compiled set), two prompts
    of bucket 24 are prefilled one at a time padded to 48, and the decode runs over both
    rows when one is left: each request's tokens are its tokens alone."""
    engine = _engine(cfg, 1, 1)
    sched = _scheduler(engine, max_batch=2)
    prefill, shapes = engine.prefill, []
    monkeypatch.setattr(
        engine, "prefill", lambda b, *a: shapes.append((b.B, b.P_pad)) or prefill(b, *a)
    )
    sched._compiled |= {PrefillShape(1, 48), DecodeShape(2, True, False)}
    sched.planner.ready = sched._compiled.__contains__  # as compile_later sets it
    prompts = _prompts(cfg, 2, seed=8, lengths=(17, 20))
    handles = [sched.submit(p, Params(n)) for p, n in zip(prompts, (3, 9))]
    sched.run()
    assert shapes == [(1, 48), (1, 48)]
    for h, p, n in zip(handles, prompts, (3, 9)):
        assert h.tokens == alone(p, Params(n))


def test_background_loop_streams_to_async_and_blocking_readers(cfg, alone):
    prompts = _prompts(cfg, 4, seed=3)
    sched = _scheduler(_engine(cfg, 2, 1), max_batch=2)
    sched.start()
    try:

        async def read_all():
            handles = [sched.submit(p, Params(7)) for p in prompts]

            async def read(h):
                return [t async for t in h.stream()]

            return handles, await asyncio.wait_for(
                asyncio.gather(*(read(h) for h in handles)), timeout=240
            )

        handles, streamed = asyncio.run(read_all())
        for h, prompt, got in zip(handles, prompts, streamed):
            assert got == h.tokens == alone(prompt, Params(7))
        assert list(sched.submit(prompts[0], Params(7))) == streamed[0]  # blocking
    finally:
        sched.close()
    assert sched.idle


def test_admitted_prompts_are_prefilled_into_the_pool_in_place(cfg):
    """A prefill donates the running pool and writes the admitted rows' pages: XLA
    aliases the pool to the output (no copy of it), the old buffers are gone, and the
    request's pages are the lowest free ones."""
    engine = _engine(cfg, 2, 2)
    sched = _scheduler(engine, max_batch=4)
    before = sched.executor.cache
    sched.submit([1, 2, 3], Params(2))
    sched.step()
    assert before.k.is_deleted() and before.v.is_deleted()
    assert sched.executor.cache.k.shape == before.k.shape
    laid = engine.lay_out([[1, 2, 3]])
    shape = PrefillShape(laid.B, laid.P_pad)
    cache = engine.copies.abstract_cache(laid.B, sched.pages)
    inputs = engine.copies.abstract(laid.prefill, PrefillInputs.specs())
    program, _ = engine.programs.get(shape, engine.weights, cache, inputs)
    assert program.memory_analysis().alias_size_in_bytes >= sched.kv_bytes_per_device


def test_refusals_are_one_line_errors_and_disturb_nothing(cfg, alone):
    sched = _scheduler(_engine(cfg, 1, 2), max_batch=2, max_queue=2)
    prompt = _prompts(cfg, 1)[0]
    running = sched.submit(prompt, Params(5))
    for bad, match in [
        (([], Params(4)), "empty"),
        (([cfg.V], Params(4)), "outside the vocabulary"),
        ((list(range(60)), Params(10)), "max_seq_len"),
        (([1, 2], Params(0)), "at least 1"),
    ]:
        with pytest.raises(RequestError, match=match):
            sched.submit(*bad)
    group = [([1, 2], Params(2), i) for i in range(4)]  # one more than the places left
    with pytest.raises(QueueFull, match="these 4 do not fit"):
        sched.submit_all(group)
    assert sched.waiting == 1  # all or none: the refused group holds no place
    for _ in range(3):  # 2 free rows + max_queue 2 waiting: the fifth is refused
        sched.submit([1, 2], Params(2))
    with pytest.raises(QueueFull, match="max_queue"):
        sched.submit([1, 2], Params(2))
    with pytest.raises(RequestError, match="max_batch"):
        Scheduler(sched.engine, max_batch=0)
    sched.run()
    assert running.tokens == alone(prompt, Params(5))


def test_buckets_are_the_unit_times_a_power_of_two_or_three_quarters_of_one_for_lengths():
    assert [bucket(n, 4) for n in (1, 4, 5, 8, 9, 16, 17)] == [4, 4, 8, 8, 16, 16, 32]
    assert [bucket(n, 3) for n in (1, 3, 4, 7, 10)] == [3, 3, 6, 12, 12]
    got = [length_bucket(n, 4) for n in (1, 4, 5, 8, 9, 12, 13, 16, 17, 24, 25, 33, 49, 97)]
    assert got == [4, 4, 8, 8, 12, 12, 16, 16, 24, 24, 32, 48, 64, 128]
    for n in range(1, 2000):  # a prompt's padding is less than a third of its bucket
        assert n <= length_bucket(n, 2) < 3 * max(n, 2) // 2 + 2
    laid = lay_out([[1] * 5, [2] * 17, [3]], 1, 1, 2, 64, bucketed=True)
    assert (laid.B, laid.P_pad) == (4, 24) and laid.requests == 3


_PROCESS = r"""
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
rank, port = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank,
                           heartbeat_timeout_seconds=30)
from qwen3_spmd.model.checkpoint.hf import HFCheckpoint
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.pipeline.scheduling.decisions import SharedDecisions
from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.pipeline.batch.handles import Params
from qwen3_spmd.pipeline.programs.sampling import Sampling
from qwen3_spmd.pipeline.scheduling.scheduler import Scheduler
from qwen3_spmd.sharding.mesh import make_mesh

folder, mesh_text, requests = sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
cached, later = sys.argv[6] == "cached", json.loads(sys.argv[7])
S, C, X = [*map(int, mesh_text.split("x")), 1][:3]
cfg = Qwen3Config.from_hf(folder)
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
engine = Engine(cfg, HFCheckpoint(folder, cfg), make_mesh(S, C, devices, tensor=X),
                max_seq_len=64, chunk=4, block_size=8)
sched = Scheduler(engine, max_batch=2, prefill_tokens=8, decisions=SharedDecisions(30),
                  prefix_caching=cached)
if rank:
    sched.follow()
    print("FOLLOWED", sched.rounds, flush=True)
else:
    handles = []
    for wave in requests:  # a wave is submitted, then one round runs
        handles += [sched.submit(p, Params(n, Sampling(temperature=t), seed=3))
                    for p, n, t in wave]
        sched.step()
    sched.cancel(handles[-1])
    sched.run()
    for p, n, t in later:  # once the others ended
        handles.insert(-1, sched.submit(p, Params(n, Sampling(temperature=t), seed=3)))
        sched.run()
    sched.close()
    result = [[h.tokens, h.finish_reason, h.cached_tokens] for h in handles]
    print("RESULT", json.dumps(result), flush=True)
"""


# 2x1x2: stages across the processes, tensor inside each (seq across two processes is
# test_serve's two-process server, on 1x2).
@pytest.mark.parametrize("mesh, cached", [("2x1x2", True)])
def test_two_processes_follow_process_0_rounds(cfg, alone, mesh, cached):
    """Two processes of two CPU devices each run one scheduler: process 0 takes staggered
    requests (a long one prefilled in chunks, greedy and sampled, a cancellation) and
    the other follows its rounds; every request's tokens are those it gets alone. On
    2x1x2 (a stage per process, its heads over the process's two devices) with a prefix
    cache in pages of 8 tokens (room for every block, no eviction): a later request
    that begins as the long one hits both blocks, and a next turn of the first request
    (its prompt, its reply, more) hits the block its reply completed, so the blocks
    named and shared, those of ended requests included, are the same on both
    processes."""
    import json
    import subprocess
    import sys

    rng = np.random.default_rng(9)
    long = rng.integers(0, cfg.V, 21).tolist()
    waves = [
        [(rng.integers(0, cfg.V, 5).tolist(), 7, 0.0)],
        [(long, 4, 0.8), (rng.integers(0, cfg.V, 3).tolist(), 6, 0.0)],
        [(rng.integers(0, cfg.V, 9).tolist(), 12, 0.0)],
        [(long[:18], 3, 0.0)],  # its first two blocks are the long one's
        [(rng.integers(0, cfg.V, 4).tolist(), 5, 0.0)],  # cancelled
    ]
    first = waves[0][0]
    reply = alone(first[0], Params(first[1], Sampling(temperature=first[2]), seed=3))
    later = [(first[0] + reply + rng.integers(0, cfg.V, 3).tolist(), 4, 0.0)]  # 15 tokens
    port = free_port()
    env = child_env()
    argv = [
        str(port),
        str(TINY),
        mesh,
        json.dumps(waves),
        "cached" if cached else "-",
        json.dumps(later),
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PROCESS, str(r), *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert "FOLLOWED" in outs[1][0]
    (line,) = [l for l in outs[0][0].splitlines() if l.startswith("RESULT")]
    got = json.loads(line.split(" ", 1)[1])
    requests = [r for wave in waves for r in wave][:-1] + later
    for (tokens, reason, _), (prompt, n, t) in zip(got[:-1], requests):
        assert tokens == alone(prompt, Params(n, Sampling(temperature=t), seed=3))
        assert reason == "length"
    assert got[-1][1] == "cancelled"
    # the first request's 5 + 6 tokens with K/V make one block
    hits = [0, 0, 0, 0, 16, 8] if cached else [0] * 6
    assert [c for _, _, c in got[:-1]] == hits


def test_a_round_survives_its_json():
    """What process 0 sends its followers: every part of a round, requests and shapes
    included, comes back equal."""
    sampled = Params(
        5, Sampling(0.7, 3, 0.9), 11, (2, 9), min_tokens=2, logprobs=True, prompt_logprobs=True
    )
    first = Request(7, (1, 2, 3), sampled)
    scored = PrefillShape(1, 8, prompt_logprobs=True)
    plan = Round(
        cancels=(3, 5),
        chunk=Chunk(row=1, start=0, end=8, shape=scored, request=first),
        admissions=(Admission((Request(8, (4,), Params()),), (0,), PrefillShape(1, 2)),),
        moves=((3, 2),),
        decode=DecodeChunk(DecodeShape(4, sampled=True, logprobs=False), steps=3),
    )
    back = Round.from_json(plan.to_json())
    assert back == plan and not back.close
    later = Round(chunk=Chunk(row=1, start=8, end=12, shape=PrefillShape(1, 4, True)))
    assert Round.from_json(later.to_json()) == later
    assert Round.from_json(Round(close=True).to_json()).close


def test_a_light_load_decodes_only_the_rows_up_to_the_highest_busy_one(cfg, alone, monkeypatch):
    """One request among 8 rows in 2 groups takes row 0: the chunks run over the first
    group's worth of rows (2), not all 8, and give the same tokens."""
    engine = _engine(cfg, 2, 1)
    sched = _scheduler(engine, max_batch=8)
    decodes = _record_decodes(monkeypatch, engine)
    prompt = _prompts(cfg, 1, seed=6)[0]
    handle = sched.submit(prompt, Params(6))
    sched.run()
    assert handle.tokens == alone(prompt, Params(6))
    assert decodes and all(rows == 2 for rows, _, _ in decodes), decodes


def test_a_request_left_in_a_high_row_moves_down_and_the_chunks_run_over_few_rows(
    cfg, alone, monkeypatch
):
    """4 rows on 1x1: once the requests in rows 0 and 2 have ended, the one in row 3
    moves to row 0 (its K/V copied in place, the cache not copied whole), so the chunks
    run over 2 rows, then 1, not 4, with the same tokens."""
    engine = _engine(cfg, 1, 1)
    sched = _scheduler(engine, max_batch=4)
    decodes = _record_decodes(monkeypatch, engine)
    prompts = _prompts(cfg, 4, seed=12)
    budgets = [2, 3, 2, 9]
    handles = [sched.submit(p, Params(n)) for p, n in zip(prompts, budgets)]
    sched.step()  # admits all four; the chunk ends where rows 0 and 2 are done
    assert handles[0].done and handles[2].done and not handles[3].done
    pages = sched.book.table[3].copy()
    sched.step()
    assert sched.book.rows[0].request.id == handles[3].id and sched.book.rows[3] is None
    # its pages moved with it (no K/V is copied); row 3 holds none
    np.testing.assert_array_equal(sched.book.table[0], pages)
    assert (sched.book.table[3] == sched.pages).all()
    sched.run()
    for h, prompt, n in zip(handles, prompts, budgets):
        assert h.tokens == alone(prompt, Params(n))
    rows = [n for n, _, _ in decodes]
    assert rows == sorted(rows, reverse=True) and sorted(set(rows)) == [1, 2, 4], rows


def test_a_chunk_ends_where_the_first_row_reaches_its_budget(cfg, alone):
    """Two full rows with budgets 3 and 12 and a request waiting: the round's chunk
    stops when the first row is done (no step past it), and the waiting request takes
    that row the next round. The accounting sees every row-step used."""
    prompts = _prompts(cfg, 3, seed=7)
    sched = _scheduler(_engine(cfg, 1, 1), max_batch=2, short_chunk=4)
    budgets = [3, 12, 5]
    handles = [sched.submit(p, Params(n)) for p, n in zip(prompts, budgets)]
    sched.step()  # admits two; a 4-step chunk would run 2 steps past the first's end
    assert handles[0].finish_reason == "length" and len(handles[1].tokens) == 3
    assert sched.decode_counts() == (2 * 2, 2 * 2, 2)  # rows x steps, busy, ticks
    sched.step()
    assert handles[2].tokens and sched.waiting == 0
    sched.run()
    for h, prompt, n in zip(handles, prompts, budgets):
        assert h.tokens == alone(prompt, Params(n))
    rows, busy, ticks = sched.decode_counts()
    assert busy == sum(n - 1 for n in budgets)  # each request's first token is the prefill's
    assert sched.decode_use() == {
        "row_occupancy": busy / rows,
        "stage_idle_fraction": 1 - busy / (2 * ticks),
    }


@pytest.mark.parametrize("first_budget,take", [(2, 1), (3, 4)])
def test_on_two_stages_a_chunk_ends_early_only_when_the_empty_row_costs_more(
    cfg, first_budget, take
):
    """2x1, 4 rows in 2 groups, a request waiting (4-step chunks): ending the chunk at
    the first row's budget costs a pipeline fill and drain (2 stage-ticks), running on
    costs that row's empty steps (1 stage-tick each). 3 empty steps: it ends; 2: it
    runs on."""
    engine = _engine(cfg, 2, 1)
    sched = _scheduler(engine, max_batch=4, short_chunk=4)
    budgets = [first_budget, 12, 12, 12, 3]
    for p, n in zip(_prompts(cfg, 5, seed=9), budgets):
        sched.submit(p, Params(n))
    sched.step()  # admits four; the fifth waits
    used = (first_budget - 1) + 3 * take
    assert sched.decode_counts() == (4 * take, used, (take - 1) * 2 + 3)


def test_chunks_while_requests_wait_shorten_with_the_early_ends_seen():
    """Full rows, requests waiting: one stage keeps short chunks; on several, chunks
    are long until a row has ended before its budget, then sqrt(2 (S - 1) / (G q)) at
    q early ends per busy row-step, within [short, long]."""
    kw = dict(groups=2, short=4, long=16)
    assert chunk_while_waiting(stages=1, early_ends=0, row_steps=100, **kw) == 4
    assert chunk_while_waiting(stages=2, early_ends=0, row_steps=100, **kw) == 16
    assert chunk_while_waiting(stages=2, early_ends=1, row_steps=40, **kw) == 6  # sqrt 40
    assert chunk_while_waiting(stages=4, early_ends=1, row_steps=40, **kw) == 11  # sqrt 120
    assert chunk_while_waiting(stages=2, early_ends=1, row_steps=10_000, **kw) == 16
    assert chunk_while_waiting(stages=2, early_ends=10, row_steps=40, **kw) == 4
    lengths = [
        chunk_while_waiting(stages=2, early_ends=e, row_steps=400, **kw) for e in (1, 2, 4, 8)
    ]
    assert lengths == sorted(lengths, reverse=True) and len(set(lengths)) == 4


def test_a_cancel_shortens_the_chunks_while_requests_wait(cfg, alone):
    """2x1, 4 rows, requests waiting: the first chunk runs the engine's whole chunk (no
    row has ended early: a short one would only add a pipeline fill and drain); after
    two cancels in 16 busy row-steps, round(sqrt(2 * 16 / (2 * 2))) = 3 steps."""
    sched = _scheduler(_engine(cfg, 2, 1), max_batch=4, short_chunk=2)
    prompts = _prompts(cfg, 7, seed=11)
    handles = [sched.submit(p, Params(12)) for p in prompts]
    sched.step()  # admits four; three wait
    assert sched.decode_counts()[:2] == (4 * 4, 4 * 4)
    sched.cancel(handles[0])
    sched.cancel(handles[1])
    sched.step()  # two of the waiting take the cancelled rows; one still waits
    assert sched.early_ends == 2 and sched.waiting == 1
    assert sched.decode_counts()[0] == 4 * 4 + 4 * 3
    sched.run()
    for h, prompt in zip(handles[2:], prompts[2:]):
        assert h.tokens == alone(prompt, Params(12))


def test_logprobs_are_the_models_and_min_tokens_bans_the_end(cfg, alone):
    """logprobs: each token's log-probability under generate's own logits (request 0's
    at each step) and the top 5, first token (prefill) and decode steps alike.
    min_tokens: an end id greedy would emit at step 2 is banned until step 3, so the
    token there is the runner-up, and the request goes on to its budget or a later end."""
    prompt, n = _prompts(cfg, 1)[0], 8
    engine = _engine(cfg, 2, 2)
    gen = static_batch.generate(engine, [prompt], n, Sampling(), 0, (), with_logits=True)
    tokens = gen.completions[0].token_ids
    logp = jax.nn.log_softmax(np.asarray(gen.first_logits, np.float64), axis=-1)
    sched = _scheduler(engine, max_batch=2)
    got = sched.submit(prompt, Params(n, logprobs=True))
    sched.run()
    assert got.tokens == tokens and len(got.logprobs) == n
    for k, (t, lp) in enumerate(zip(tokens, got.logprobs)):
        np.testing.assert_allclose(lp.chosen, logp[k, t], atol=1e-5)
        ids = [i for i, _ in lp.top]
        assert ids[0] == t and ids == np.argsort(-logp[k])[:5].tolist()
        np.testing.assert_allclose([v for _, v in lp.top], np.sort(logp[k])[::-1][:5], atol=1e-5)

    end = tokens[2]
    assert end not in tokens[:2]
    banned = sched.submit(prompt, Params(n, eos_ids=(end,), min_tokens=3))
    sched.run()
    assert banned.tokens[:2] == tokens[:2]
    runner_up = np.argsort(-np.asarray(gen.first_logits[2]))[1]
    assert banned.tokens[2] == runner_up != end
    assert end not in banned.tokens[:-1]
    if banned.finish_reason == "stop":
        assert banned.tokens[-1] == end and len(banned.tokens) > 3
    else:
        assert len(banned.tokens) == n
    # The one request check (requests.check_request) refuses it, naming both parameters.
    with pytest.raises(RequestError, match="min_tokens holds back at most 8 end ids") as e:
        sched.submit(prompt, Params(n, eos_ids=tuple(range(9)), min_tokens=1))
    assert e.value.params == ("eos_ids", "min_tokens")


def test_after_precompile_a_load_of_every_kind_compiles_nothing(cfg, alone, monkeypatch):
    """`precompile` compiles what every round can run: then a load with batches of four
    prompts and of two, a long prompt in two chunks (the last one padded to its
    bucket), greedy and sampled rows, log-probabilities and a row moving down compiles
    nothing (XLA's compile events are counted while it runs), and the greedy tokens
    are those of each request alone."""
    sched = _scheduler(_engine(cfg, 2, 2), max_batch=4, prefill_tokens=32)
    declared = sched.rules.declared()
    assert sched.precompile() == len(declared)
    moves, chunks = [], []
    move, prefill = sched.book.move, sched.engine.prefill
    monkeypatch.setattr(sched.book, "move", lambda a, b: moves.append(a) or move(a, b))
    monkeypatch.setattr(
        sched.engine,
        "prefill",
        lambda b, *a: chunks.append((b.B, b.P_pad, b.offset)) or prefill(b, *a),
    )
    compiles = []

    def heard(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    prompts = _prompts(cfg, 7, lengths=(2, 2, 2, 2, 50, 3, 3))
    sampled = Sampling(0.8, 5, 0.9)
    params = [Params(2), Params(2), Params(3, logprobs=True), Params(12, sampled, seed=4)]
    params += [Params(3), Params(3, sampled, seed=1, logprobs=True), Params(2)]
    jax.monitoring.register_event_duration_secs_listener(heard)
    try:
        handles = [sched.submit(p, q) for p, q in zip(prompts, params)]
        sched.run()
    finally:
        jax.monitoring.unregister_event_duration_listener(heard)
    assert compiles == []
    # the four short prompts together; the long one in chunks of 32 and 18 tokens (the
    # last padded to its bucket, 24); then two together
    assert chunks == [(4, 16, 0), (1, 32, 0), (1, 24, 16), (2, 16, 0)]
    assert moves
    for h, p, q in zip(handles, prompts, params):
        assert len(h.tokens) == q.max_new_tokens
        if q.sampling == Sampling():
            assert h.tokens == alone(p, q)


def test_a_pool_of_few_pages_preempts_and_resumes_with_the_same_tokens(cfg, alone):
    """A pool of 4 pages (of 16 slots a seq device) under 4 rows: requests start when their
    prompt's and first chunk's pages are free, take pages as decode reaches them, and
    when those run out the youngest is preempted and prefilled again later from its
    prompt and tokens so far. Every request, greedy or seeded sampling, gets exactly its
    tokens alone (its stream has no gap and no repeat); after every round no page is
    held twice, and at the end every page is free. A request a pool of 1 page could
    not hold is refused, naming the pool and the flag. On 2x2: stages, and seq devices
    each holding its share of a request's slots in the same pages."""
    engine = _engine(cfg, 2, 2)
    page = engine.copies.page_bytes_per_device()
    sched = Scheduler(engine, max_batch=4, kv_cache_memory_bytes=4 * page + page // 2)
    assert sched.pages == 4 and sched.kv_bytes_per_device == 4 * page
    prompts = _prompts(cfg, 6, seed=5)
    sampled = Sampling(0.9, 0, 1.0)
    params = [Params(20), Params(26, sampled, seed=3), Params(6), Params(24), Params(9)]
    params.append(Params(18, sampled, seed=1, min_tokens=4, eos_ids=(7,)))
    handles = [sched.submit(p, q) for p, q in zip(prompts, params)]
    while not sched.idle:
        sched.step()
        held = [int(p) for p in sched.book.table.flat if p < sched.pages]
        assert len(held) == len(set(held)) and len(held) + sched.book.pages.free == 4
    assert sched.preemptions > 0 and sched.most_running >= 2
    assert sched.book.pages.free == 4
    roomy = _scheduler(engine, max_batch=4)  # 8 rows' most: no request waits for pages
    unpressured = [roomy.submit(p, q) for p, q in zip(prompts, params)]
    roomy.run()
    assert roomy.preemptions == 0
    for h, u, p, q in zip(handles, unpressured, prompts, params):
        assert h.tokens == u.tokens and h.finish_reason == u.finish_reason
        if q.min_tokens == 0:
            assert h.tokens == alone(p, q)
    # 30 tokens and 20 new: 16 + 10 slots a device, 2 pages
    small = Scheduler(engine, max_batch=4, kv_cache_memory_bytes=page)
    with pytest.raises(
        RequestError, match=r"need 52 tokens.*pool holds 32 \(1 pages of 32\).*kv_cache"
    ):
        small.submit(list(range(1, 31)), Params(20))
