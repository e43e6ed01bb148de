"""bench --scenario embed: the pooling runner's throughput, and the prefill memory of a
long input per device, on each mesh; with --peer transformers, the same inputs through
sentence-transformers' encode loop on transformers' Qwen3Model, after our 1x1 in the
same process.

The load: --embed-inputs inputs of random token ids, lengths uniform in --embed-lens
(seeded), all submitted at once to a Scheduler of --serve-max-batch rows over a pooling
Engine (`run.pooled.run`: prefill only, each input pooled at its last token), as a
server's burst of embedding requests. The first pass compiles (timed apart), then
--warmup untimed and --repeats timed passes: input tokens/s from the median. The memory
is XLA's analysis of the prefill of one input of the longest length (`Engine.
prefill_memory`'s temporaries, and that input's K/V), per device: on 1xC the ring's
share of one long document (the weights, replicated along seq, left out).

The peer (transformers' Qwen3Model on the same weights, float32 or bfloat16 as ours) runs
sentence-transformers' SentenceTransformer.encode loop: inputs sorted by length, batches
of 32 right-padded with an attention mask, the last real token's hidden state (the
model's output is after the final norm), L2-normalised; torch.no_grad, sdpa attention.
The first embeddings of both are compared (their largest difference is reported).
"""

from __future__ import annotations

import time

import numpy as np

from qwen3_spmd.run.bench.measure import spread

PEER_BATCH = 32  # sentence-transformers' encode default


def embed_inputs(cfg, settings) -> list[list[int]]:
    """The load's inputs: random ids, lengths uniform in embed_lens (seeded)."""
    n, (lo, hi) = settings["embed_inputs"], settings["embed_lens"]
    rng = np.random.default_rng([settings["seed"], n, lo, hi])
    return [rng.integers(0, cfg.V, int(L)).tolist() for L in rng.integers(lo, hi + 1, n)]


def embed_job(engines, settings, say) -> dict:
    """The load on `engines`' mesh (run.bench.jobs.MeshEngines); tokens/s and memory."""
    from qwen3_spmd.pipeline.scheduling.scheduler import Scheduler
    from qwen3_spmd.run import pooled

    s, inputs = settings, embed_inputs(engines.cfg, settings)
    C = engines.mesh.shape["seq"]
    engine = engines.get(-(-s["embed_lens"][1] // C) * C, runner="pooling")
    scheduler = Scheduler(engine, max_batch=s["serve_max_batch"])
    tokens = sum(len(p) for p in inputs)

    def run() -> tuple[float, list]:
        t0 = time.perf_counter()
        hidden = pooled.run(engine, scheduler, inputs)
        return time.perf_counter() - t0, hidden

    compile_s, hidden = run()
    for _ in range(s["warmup"]):
        run()
    times = [run()[0] for _ in range(s["repeats"])]
    # The prefill's temporaries and the input's K/V: what a longer input grows (the
    # weights, replicated along seq, do not).
    memory = engine.prefill_memory(1, s["embed_lens"][1])["temp"]
    memory += engine.copies.cache_bytes_per_device(1)
    out = {
        "inputs": len(inputs),
        "lens": list(s["embed_lens"]),
        "tokens": tokens,
        "rows": scheduler.B,
        "first_pass_s": compile_s,
        "time_s": spread(times),
        "tokens_per_s": tokens / spread(times)["median"],
        "longest_prefill_activations_and_kv_per_device": memory,
        "first_embedding": _normalised(hidden[0]).tolist(),
    }
    say(
        f"  embed: {len(inputs)} inputs, {tokens} tokens, {out['tokens_per_s']:.1f} tok/s; "
        f"prefill of one {s['embed_lens'][1]}-token input: {memory / 2**20:.1f} MiB of "
        "activations and K/V a device"
    )
    return out


def add_embed_ratios(meshes: list[dict]) -> None:
    """Each mesh's embed figures against 1x1's (meshes[0]): time and memory per device."""
    base = meshes[0].get("embed")
    for m in meshes:
        job = m.get("embed")
        if base and job:
            job["time_ratio_vs_1x1"] = job["time_s"]["median"] / base["time_s"]["median"]
            job["memory_ratio_vs_1x1"] = (
                job["longest_prefill_activations_and_kv_per_device"]
                / base["longest_prefill_activations_and_kv_per_device"]
            )


def _normalised(h) -> np.ndarray:
    h = np.asarray(h, np.float64)
    return h / np.linalg.norm(h)


def embed_peer(model, torch, device, ours: dict, cfg, settings, say) -> dict:
    """The same inputs through sentence-transformers' encode loop on `model`'s decoder
    (a transformers Qwen3ForCausalLM), timed as ours; ours: the 1x1 embed job."""
    s, inputs = settings, embed_inputs(cfg, settings)
    decoder = model.model

    def run() -> tuple[float, np.ndarray]:
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
        first = None
        t0 = time.perf_counter()
        with torch.no_grad():
            for at in range(0, len(order), PEER_BATCH):
                batch = [inputs[i] for i in order[at : at + PEER_BATCH]]
                T = max(len(p) for p in batch)
                ids = torch.zeros((len(batch), T), dtype=torch.long)
                mask = torch.zeros((len(batch), T), dtype=torch.long)
                for b, p in enumerate(batch):
                    ids[b, : len(p)] = torch.tensor(p)
                    mask[b, : len(p)] = 1
                h = decoder(input_ids=ids.to(device), attention_mask=mask.to(device))
                h = h.last_hidden_state
                last = mask.sum(1) - 1
                pooled = h[torch.arange(len(batch)), last.to(device)]
                pooled = torch.nn.functional.normalize(pooled.float(), dim=-1).cpu().numpy()
                if 0 in order[at : at + PEER_BATCH]:
                    first = pooled[order[at : at + PEER_BATCH].index(0)]
        return time.perf_counter() - t0, first

    run()  # warm-up: torch's first calls pay their own set-up
    times, first = [], None
    for _ in range(s["repeats"]):
        seconds, first = run()
        times.append(seconds)
    theirs = ours["tokens"] / spread(times)["median"]
    out = {
        "batch": PEER_BATCH,
        "time_s": spread(times),
        "theirs_tokens_per_s": theirs,
        "ours_tokens_per_s": ours["tokens_per_s"],
        "speedup": ours["tokens_per_s"] / theirs,
        "first_embedding_max_abs_diff": float(
            np.abs(np.asarray(ours["first_embedding"]) - first).max()
        ),
    }
    say(
        f"  embed: ours {ours['tokens_per_s']:.1f} tok/s, theirs {theirs:.1f}, speedup "
        f"{out['speedup']:.2f} (first embedding within {out['first_embedding_max_abs_diff']:.1e})"
    )
    return out
