"""`generate --check`: the same requests on one device of this process, and whether the
mesh's tokens match them (and how far its logits are from them)."""

from __future__ import annotations

import dataclasses

from qwen3_spmd.run.engine_args import EngineArgs
from qwen3_spmd.run.generate.job import Job


def check_single_device(args, engine_args: EngineArgs, job: Job, out) -> dict:
    """--check: the same requests on one device; do the tokens and logits agree?"""
    import jax

    from qwen3_spmd.pipeline.requests import key_seed
    from qwen3_spmd.pipeline.scheduling import static_batch
    from qwen3_spmd.run import traffic
    from qwen3_spmd.sharding.mesh import make_mesh

    # The same settings on one device: one microbatch and group, ring (nothing to split).
    one = dataclasses.replace(engine_args, microbatches=1, groups=1, cp="ring")
    single = one.engine(
        job.spec.cfg, job.spec.source, make_mesh(1, 1, jax.local_devices()[:1]), job.max_seq_len
    )
    ref = static_batch.generate(
        single,
        job.prompts,
        args.max_new_tokens,
        sampling=job.sampling,
        seed=key_seed(args.seed),
        eos_ids=job.eos,
        constraint=job.constraint,
        grammars=job.grammars,
    )
    return {
        "matches_single_device": all(
            a.token_ids == b.token_ids for a, b in zip(out.completions, ref.completions)
        ),
        "max_error_vs_single_device": traffic.max_abs_error(out.first_logits, ref.first_logits),
    }
