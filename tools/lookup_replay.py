"""Prompt lookup replayed on a greedy run's tokens: how many drafts it proposes and keeps
when it looks up after every token (the device's loop of rounds, `pipeline.speculative.loop`)
and when a round that finds nothing decodes k + 1 plain steps before it looks again
(the host's rounds, `SpecPolicy` plain steps).

    python tools/lookup_replay.py --model /tmp/q06 --dtype float32 --batch 1 \\
        --prompt-len 64 --new 48 --k 8

Greedy tokens do not depend on how they were drafted, so a draft's fate is known from
the plain run alone: it is kept up to its first token that differs from the run's.
Both ways use the drafter (`ngram.propose`, n-grams 4 down to 1) and the pacing
(`policy.Pace`) of the engine; what is left out is the round rule (every proposal
is verified whole) and the loop's chunk boundaries. The prompts are the speculative
bench's (`bench.measure.prompts_for`), so the figures explain its acceptance column:
the loop drafts at tokens the host's plain chunks skip, where drafts are kept less
often, so its acceptance is lower while it keeps more drafts in all.
"""

from __future__ import annotations

import argparse
import json

from qwen3_spmd.pipeline.speculative.ngram import propose
from qwen3_spmd.pipeline.speculative.policy import Pace


def replay(prompt: list[int], tokens: list[int], k: int, every_token: bool) -> dict:
    """Drafts proposed and kept, and passes, over greedy `tokens` (the prefill's first):
    lookups after every token (every_token) or a plain chunk of k + 1 steps after a
    lookup that found nothing."""
    pace, g = Pace(k), 1
    drafted = kept = passes = 0
    while g < len(tokens):
        left = len(tokens) - g
        k_b = min(pace.k, k, left - 1)
        waits = pace.waits(g)
        drafts = propose(prompt + tokens[:g], k_b, 4, 1)[:k_b] if k_b > 0 and not waits else []
        if drafts:
            a = 0
            while a < len(drafts) and drafts[a] == tokens[g + a]:
                a += 1
            g += a + 1
            drafted, kept, passes = drafted + len(drafts), kept + a, passes + 1
            pace.after(a, len(drafts), k, g)
        else:
            g += min(left, 1 if every_token else max(k + 1, waits))
    return {"drafted": drafted, "kept": kept, "passes": passes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint folder (or a preset name)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=1, help="prompts (the bench's --batches)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=48, help="new tokens (the bench's --decode-steps)")
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    p.add_argument("--seed", type=int, default=0, help="the bench's --seed (prompt ids)")
    args = p.parse_args()

    from qwen3_spmd.run.bench.measure import prompts_for
    from qwen3_spmd.run.llm import LLM, SamplingParams

    llm = LLM(args.model, mesh="1x1", dtype=args.dtype)
    prompts = prompts_for(llm.engine.cfg, args.batch, args.prompt_len, args.seed)
    greedy = SamplingParams(max_tokens=args.new + 1, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": q} for q in prompts], greedy)
    report = {}
    for way, every_token in (("host rounds", False), ("device loops", True)):
        runs = [replay(q, o.token_ids, args.k, every_token) for q, o in zip(prompts, outs)]
        total = {key: sum(r[key] for r in runs) for key in runs[0]}
        total["acceptance"] = round(total["kept"] / max(1, total["drafted"]), 3)
        report[way] = total
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
