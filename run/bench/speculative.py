"""bench --scenario speculative: decode with speculation against plain decode, in one run.

On random weights the ngram drafter's acceptance says little about a trained model, so
the scenario measures the mechanism between two bounds (issue 46):

- the ceiling: an oracle drafter that proposes the plain run's own tokens (every draft
  accepted), for each k of --spec-tokens;
- the floor: a drafter that is always wrong (the plain run's tokens plus one), at the
  largest k: each pass then gives one token for k + 1 positions' work, until pacing
  and the round rule turn to plain chunks;
- ngram (prompt lookup, k the largest, n-grams 4 down to 1) on the same prompts:
  acceptance and tokens/s as they come, each round looped on the device
  (`pipeline.speculative.loop`) or run a pass at a time from the host as the round rule
  measures faster; then each way alone ("device loops", "host rounds");
- draft_model with the model drafting for itself (k the largest): every draft kept, and
  each draft costs a pass of the model, so this is what the drafter's passes cost
  beside the verify pass; a drafter c times the model's size pays about c of it. It
  verifies every round (`policy.Unmeasured`): the round rule would decode plain.

Each drafter keeps its own round rule (its costs and kept drafts) from run to run
(`pipeline.speculative.policy`), as a server's speculator does from its first requests on, so
the warm-up runs measure them.

Each drafter decodes the --batches' prompts of --decode-prompt-len tokens for
--decode-steps tokens through `static_batch.generate` (greedy), compiled first, then --warmup
and --repeats runs, the drafters alternating so all meet the same machine. Every run's
tokens are checked against the plain run's (`exact`; else `same_until`, the fewest
tokens any row kept in common with the plain run). In float32 they are the same tokens.
In bfloat16 on a GPU the verify pass's (k + 1)-row products round differently from the
decode step's one-row products, so a row may part from plain decoding at a near-tie, as
plain decoding's own rows do between batch sizes. tokens/s is the generated tokens over
`timing["decode_s"]` (the decode rounds, verify passes included, the prefill not).
"""

from __future__ import annotations

import dataclasses

from qwen3_spmd.pipeline.scheduling import static_batch
from qwen3_spmd.pipeline.speculative.config import SpeculativeConfig
from qwen3_spmd.pipeline.speculative.draft_model import DraftModel
from qwen3_spmd.pipeline.speculative.policy import RoundRule, Unmeasured, way_kind
from qwen3_spmd.pipeline.speculative.speculator import SpecMetrics, Speculator
from qwen3_spmd.pipeline.speculative.verify import common_prefix
from qwen3_spmd.run.bench.measure import decode_cache_len, prompts_for, spread


class HostRounds(RoundRule):
    """The round rule, but every prompt lookup round runs one pass from the host."""

    def on_device(self, n: int) -> bool:
        return False


class DeviceLoops(RoundRule):
    """The round rule, but prompt lookup's rounds loop on the device whenever they can
    (`pipeline.speculative.loop`) once the host's passes have been measured as the rule
    measures them first (the loop chooses its widths by their seconds): what the loop
    alone gives."""

    def on_device(self, n: int) -> bool:
        return self.seconds(way_kind(n, False)) is not None


@dataclasses.dataclass(frozen=True)
class Replay:
    """Drafts a known continuation of each prompt (`runs`: prompt -> its plain tokens),
    or, with wrong=True, each of its tokens plus one modulo the vocabulary (never
    accepted)."""

    runs: dict
    num_speculative_tokens: int
    vocab: int
    wrong: bool = False

    def propose(self, context, k: int) -> list[int]:
        for prompt, tokens in self.runs.items():
            if tuple(context[: len(prompt)]) == prompt:
                done = len(context) - len(prompt)
                return [(t + self.wrong) % self.vocab for t in tokens[done : done + k]]
        return []  # a padding row's copy of prompt 0 is found above; nothing else is


def speculative_job(engines, B: int, say) -> dict:
    """Plain decode and each drafter's, B requests at once."""
    cfg, s = engines.cfg, engines.s
    T, N = s["decode_prompt_len"], s["decode_steps"]
    engine = engines.get(decode_cache_len(s, engines.mesh.shape["seq"]))
    prompts = prompts_for(cfg, B, T, s["seed"])
    ks = s["spec_tokens"]
    plain = static_batch.generate(engine, prompts, N + 1, with_logits=False)
    tokens = [c.token_ids for c in plain.completions]
    runs = {tuple(p): t for p, t in zip(prompts, tokens)}
    drafters = {"plain": None}
    drafters.update({f"oracle k={k}": Replay(runs, k, cfg.V) for k in ks})
    drafters[f"wrong k={max(ks)}"] = Replay(runs, max(ks), cfg.V, wrong=True)
    lookup = SpeculativeConfig(max(ks), "ngram", 4, 1)
    drafters[f"ngram k={max(ks)}"] = lookup  # the round rule's way each round
    # The same drafter each way alone: its rounds looped on the device, or one pass
    # at a time from the host.
    device_loops = f"ngram k={max(ks)}, device loops"
    host_rounds = f"ngram k={max(ks)}, host rounds"
    drafters[device_loops] = drafters[host_rounds] = lookup
    itself = SpeculativeConfig(max(ks), "draft_model", model="the model itself")
    itself_name = f"draft model (itself) k={max(ks)}"
    drafters[itself_name] = (itself, DraftModel(engine))

    # A Speculator a run: the compiled verify programs are the engine's, so they serve
    # every drafter. Each drafter keeps its own round rule (a draft model's rounds cost more, its
    # drafts are kept as they are), as a server's speculator does from its first
    # requests on.
    # The model drafting for itself verifies every round (the rule would decode plain,
    # its drafts costing as much as the model): what the drafter's passes cost.
    rules = {name: RoundRule() for name in drafters}
    rules[itself_name] = Unmeasured()
    rules[device_loops] = DeviceLoops()
    rules[host_rounds] = HostRounds()
    seen = {name: SpecMetrics() for name in drafters}  # every run's, for the acceptance

    def run(name) -> dict:
        drafter, spec = drafters[name], None
        if drafter is not None:
            spec = Speculator(engine, *(drafter if isinstance(drafter, tuple) else (drafter,)))
            spec.rule = rules[name]
        out = static_batch.generate(engine, prompts, N + 1, with_logits=False, speculator=spec)
        m = spec.metrics if spec is not None else None
        if m is not None:
            seen[name] += m
        new = sum(len(c.token_ids) - 1 for c in out.completions)  # decode's tokens
        return {
            "decode_s": out.timing["decode_s"],
            "tokens_per_s": new / out.timing["decode_s"],
            "exact": [c.token_ids for c in out.completions] == tokens,
            "same_until": min(
                common_prefix(c.token_ids, t) for c, t in zip(out.completions, tokens)
            ),
            "drafts": m.drafts if m else 0,
            "draft_tokens": m.draft_tokens if m else 0,
            "accepted_tokens": m.accepted_tokens if m else 0,
        }

    for name in drafters:  # compiles, then warms up
        for _ in range(1 + s["warmup"]):
            run(name)
    got = {name: [] for name in drafters}
    for _ in range(s["repeats"]):
        for name in drafters:
            got[name].append(run(name))
    base = spread([r["tokens_per_s"] for r in got["plain"]])["median"]
    out = {"batch": B, "prompt_len": T, "steps": N, "drafters": {}}
    for name, rs in got.items():
        rate = spread([r["tokens_per_s"] for r in rs])
        m = seen[name]
        entry = {
            "tokens_per_s": rate,
            "vs_plain": rate["median"] / base,
            "exact": all(r["exact"] for r in rs),
            "same_until": min(r["same_until"] for r in rs),
            # Over every run, the first ones included (later ones may verify few rounds).
            "acceptance": m.accepted_tokens / m.draft_tokens if m.draft_tokens else None,
            "mean_acceptance_length": m.mean_acceptance_length if m.drafts else None,
            # Rows' verify passes in the last run: fewer where the round rule decoded plain.
            "passes": rs[-1]["drafts"],
        }
        out["drafters"][name] = entry
        said = f", acceptance {entry['acceptance']:.2f}" if entry["acceptance"] is not None else ""
        say(
            f"  speculative B={B} {name}: {rate['median']:.1f} tok/s "
            f"({entry['vs_plain']:.2f}x plain){said}"
            + ("" if entry["exact"] else f", NOT EXACT: a row parts at token {entry['same_until']}")
        )
    return out
