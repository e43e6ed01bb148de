"""Test references: float64 numpy computations that the sharded and fused paths are
checked against, and the fixture folders."""

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np

from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.pipeline.speculative.policy import SAMPLES, RoundRule, pass_kind, step_kind

ROOT = Path(__file__).resolve().parent.parent  # the repository
FIXTURES = ROOT / "tests" / "fixtures"
TINY = FIXTURES / "tiny"
# The pooling runner's fixtures (make_pooling_reference.py): a Qwen3-Embedding folder as
# published, and a causal LM served as Qwen3-Reranker with vLLM's hf_overrides.
EMBED, RERANK = FIXTURES / "embed", FIXTURES / "rerank"
RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}


@functools.cache
def embed_reference():
    """(reference.npz of `embed`, [(input text with its sentence-transformers prompt,
    its index i in the file)] for every input)."""
    ref = np.load(EMBED / "reference.npz")
    prompts = json.loads((EMBED / "config_sentence_transformers.json").read_text())["prompts"]
    cases = []
    for i in range(int(ref["num_inputs"])):
        name = str(ref[f"prompt_name_{i}"])
        cases.append((prompts.get(name, "") + str(ref[f"text_{i}"]), i))
    return ref, cases


@functools.cache
def rerank_reference():
    """(reference.npz of `rerank`, [(formatted query, formatted document)] per pair)."""
    ref = np.load(RERANK / "reference.npz")
    n = int(ref["num_pairs"])
    return ref, [(str(ref[f"query_{i}"]), str(ref[f"document_{i}"])) for i in range(n)]


@dataclasses.dataclass(frozen=True)
class Oracle:
    """A speculative drafter (`propose(context, k)`) that drafts a known run's tokens,
    the one at each index i with i % every == at made wrong (plus one): rounds keep all
    their drafts, none, or a run cut in the middle."""

    runs: dict  # prompt (a tuple of ids) -> the run's tokens
    num_speculative_tokens: int
    every: int = 5
    at: int = 3

    def propose(self, context, k):
        for prompt, tokens in self.runs.items():
            if tuple(context[: len(prompt)]) == prompt:
                done = len(context) - len(prompt)
                out = list(tokens[done : done + k])
                return [
                    t + 1 if (done + i) % self.every == self.at else t for i, t in enumerate(out)
                ]
        raise AssertionError(f"no run for {context}")


@functools.cache
def fixture(name: str):
    """(folder, config, reference.npz, prompts as lists) of fixture `name`."""
    folder = FIXTURES / name
    cfg = Qwen3Config.from_hf(folder)
    ref = np.load(folder / "reference.npz")
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(int(ref["num_prompts"]))]
    return folder, cfg, ref, prompts


def dense_attention(q, k, v, q_pos, k_pos, scale):
    """Reference attention in float64 numpy, masked by positions (0 <= k_pos <= q_pos).

    q [B, T, N, H], k and v [B, S, K, H], q_pos [B, T], k_pos [B, S]; query head n
    uses KV head n // (N/K). Returns o [B, T, N, H] (0 on rows that see no key) and
    lse [B, T, N] (-inf on those rows).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    q_pos, k_pos = np.asarray(q_pos), np.asarray(k_pos)
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, k) * scale
    visible = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])
    s = np.where(visible[:, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=-1)
    o = np.einsum("bnts,bsnh->btnh", p, v) / np.where(l > 0, l, 1.0).transpose(0, 2, 1)[..., None]
    with np.errstate(divide="ignore"):
        lse = (m[..., 0] + np.log(l)).transpose(0, 2, 1)
    return o, lse


def right_padded(seqs, width: int | None = None):
    """Token lists -> right-padded tokens and positions [B, width] int32 (positions -1
    on padding; width defaults to the longest list)."""
    width = max(len(s) for s in seqs) if width is None else width
    tokens = np.zeros((len(seqs), width), np.int32)
    positions = np.full((len(seqs), width), -1, np.int32)
    for b, s in enumerate(seqs):
        tokens[b, : len(s)] = s
        positions[b, : len(s)] = np.arange(len(s))
    return tokens, positions


def split_parts(ckpt):
    """(path, layers, Part) for every axis of a checkpoint's parameters that `tensor`
    may split (under both expert splits): its first half, its last two thirds, all but
    its first and last rows (where any are left), none past its last (what a host
    whose rows are all padding reads); layer parameters of layers 3 and 1."""
    from qwen3_spmd.model.params import Part
    from qwen3_spmd.model.split import EXPERT_SPLITS
    from qwen3_spmd.sharding.specs import tensor_axis

    for path in ckpt.table:
        axes = {tensor_axis(path, experts) for experts in EXPERT_SPLITS} - {None}
        layers = [3, 1] if path[0] == "layers" else None
        shape = ckpt.read(path, np.float32, [0] if layers else None).shape
        for axis in sorted(axes):
            n = shape[axis]
            for start, stop in ((0, n // 2), (n // 3, n), (1, n - 1), (n, n)):
                if start < stop or start == n:
                    yield path, layers, Part(axis, start, stop)


def measured_rule(step: float | None, passes: dict) -> RoundRule:
    """A round rule that has seen each cost SAMPLES times: a step over 3 rows (None:
    never), passes {T: seconds}."""
    rule = RoundRule()
    for _ in range(SAMPLES):
        if step is not None:
            rule.saw(step_kind(3), step)
        for T, seconds in passes.items():
            rule.saw(pass_kind(3, T), seconds)
    rule.tick()
    return rule
