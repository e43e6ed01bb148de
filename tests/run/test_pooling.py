"""The pooling runner (`pipeline.pooling`, `run.pooled`, `LLM.embed` and `LLM.score`)
against sentence-transformers and transformers, on the fixtures
tests/fixtures/make_pooling_reference.py wrote: `embed`, a Qwen3-Embedding folder as
published (the bare decoder's weights, the sentence-transformers files, a tokenizer that
appends <|endoftext|>, Matryoshka dimensions 8, 16, 32), and `rerank`, a causal LM
served as Qwen3-Reranker through vLLM's hf_overrides.

- embeddings equal sentence-transformers' within 1e-5 (float32), the inputs' ids equal
  its tokenization (the post-processor's last token), with the query prompt and without,
  at every Matryoshka dimension, all inputs in one call (mixed lengths batched together)
  and on 2x1, 1x2, 1x1x2 and 2x2; a long input in 9 chunks of prefill on 1x4, with
  ring and with Ulysses attention;
- rerank scores equal transformers' P(yes) within 1e-5, in the same order;
- the folder loads as published and as the causal LM's names, untied config included;
- bad input and a folder that contradicts the task are one-line refusals naming them.
"""

import json
import shutil

import numpy as np
import pytest
from reference import EMBED, RERANK, RERANKER, embed_reference, rerank_reference
from safetensors.numpy import load_file, save_file

from qwen3_spmd import LLM
from qwen3_spmd.model.config import ConfigError
from qwen3_spmd.pipeline.requests import RequestError

MAX_SEQ = 512  # the reranker's pairs are up to 363 tokens; one setting, shared programs
TOL = 1e-5
REF, CASES = embed_reference()
TEXTS = [(text, i) for text, i in CASES if text]  # an empty string is refused (below)


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=TOL, rtol=0)


@pytest.fixture(scope="module")
def embedder():
    with LLM(str(EMBED), mesh="1x1", max_seq_len=MAX_SEQ) as llm:
        yield llm


@pytest.fixture(scope="module")
def reranker():
    with LLM(str(RERANK), mesh="1x1", max_seq_len=MAX_SEQ, hf_overrides=RERANKER) as llm:
        yield llm


def test_embeddings_equal_sentence_transformers_at_every_dimension(embedder):
    """The runner is found from modules.json; each text's ids are sentence-transformers'
    (ending in <|endoftext|>, the post-processor's), its embedding theirs within 1e-5
    whole and cut to 8 and 16 dimensions (renormalised), all in one call; the query
    prompt put before the text by prompt_name; the empty string's ids, sent as ids, give
    its embedding too."""
    assert embedder.engine.runner == "pooling" and embedder.pooling.matryoshka == (8, 16, 32)
    texts = [text for text, _ in TEXTS]
    for dims in (None, 16, 8):
        outs = embedder.embed(texts, dimensions=dims)
        for out, (_, i) in zip(outs, TEXTS):
            assert out.prompt_token_ids == REF[f"ids_{i}"].tolist()
            want = REF[f"embedding_{i}"] if dims in (None, 32) else REF[f"embedding_{dims}_{i}"]
            assert len(out.outputs.embedding) == (dims or 32)
            _close(out.outputs.embedding, want)
    queries = [(str(REF[f"text_{i}"]), i) for _, i in TEXTS if str(REF[f"prompt_name_{i}"])]
    outs = embedder.embed([text for text, _ in queries], prompt_name="query")
    for out, (_, i) in zip(outs, queries):  # the folder's query prompt put before each
        _close(out.outputs.embedding, REF[f"embedding_{i}"])
    (empty,) = [i for text, i in CASES if not text]
    (out,) = embedder.embed([REF[f"ids_{empty}"].tolist()])
    _close(out.outputs.embedding, REF[f"embedding_{empty}"])


@pytest.mark.parametrize("mesh", ["2x1", "1x2", "1x1x2", "2x2", "2x1x1x1"])
def test_embeddings_are_the_same_on_every_mesh(mesh):
    """Two inputs of one length bucket (33-64 tokens: one prefill program a mesh), one
    with the chat tokens, on each mesh (over two replicas, one on each)."""
    picked = [c for c in TEXTS if 32 < len(REF[f"ids_{c[1]}"]) <= 64]
    assert len(picked) == 2
    with LLM(str(EMBED), mesh=mesh, max_seq_len=MAX_SEQ) as llm:
        outs = llm.embed([text for text, _ in picked])
    for out, (_, i) in zip(outs, picked):
        _close(out.outputs.embedding, REF[f"embedding_{i}"])


@pytest.mark.parametrize("cp", ["ring", "ulysses"])
def test_a_long_input_is_embedded_in_chunks_along_seq(cp):
    """The longest input (141 tokens) in chunks of 16 tokens, 9 rounds of prefill, each
    attending to the earlier ones' K/V, split over 4 seq devices."""
    text, i = max(TEXTS, key=lambda c: len(REF[f"ids_{c[1]}"]))
    assert len(REF[f"ids_{i}"]) > 8 * 16
    with LLM(str(EMBED), mesh="1x4", max_seq_len=MAX_SEQ, prefill_tokens=16, cp=cp) as llm:
        (out,) = llm.embed(text)
    _close(out.outputs.embedding, REF[f"embedding_{i}"])


def test_rerank_scores_equal_transformers_in_the_same_order(reranker):
    """Each query against its documents (1:N, vLLM's score): the pair's ids are the
    query's then the document's; P(yes) equals transformers' within 1e-5."""
    ref, pairs = rerank_reference()
    assert reranker.pooling.labels == (int(ref["no_id"]), int(ref["yes_id"]))
    for query in dict.fromkeys(q for q, _ in pairs):
        at = [i for i, (q, _) in enumerate(pairs) if q == query]
        outs = reranker.score(query, [pairs[i][1] for i in at])
        got = [o.outputs.score for o in outs]
        want = [float(ref[f"score_{i}"]) for i in at]
        for o, i in zip(outs, at):
            assert o.prompt_token_ids == ref[f"ids_{i}"].tolist()
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
        assert np.argsort(got).tolist() == np.argsort(want).tolist()


def _copy(tmp_path, rename=None, config=None):
    """The embed folder copied, its tensors renamed by `rename` and config.json updated."""
    folder = tmp_path / "model"
    shutil.copytree(EMBED, folder)
    if rename is not None:
        tensors = load_file(str(EMBED / "model.safetensors"))
        save_file({rename(k): v for k, v in tensors.items()}, str(folder / "model.safetensors"))
    if config is not None:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **config}))
    return folder


@pytest.mark.parametrize(
    "rename, config",
    [
        (lambda name: "model." + name, None),  # the causal LM's names
        (None, {"tie_word_embeddings": False}),  # the bare decoder, untied (as the 8B)
    ],
    ids=["causal-names", "untied-bare"],
)
def test_the_folder_loads_as_published_and_as_the_causal_lm(tmp_path, rename, config):
    text, i = TEXTS[0]
    with LLM(str(_copy(tmp_path, rename, config)), mesh="1x1", max_seq_len=MAX_SEQ) as llm:
        (out,) = llm.embed(text)
    _close(out.outputs.embedding, REF[f"embedding_{i}"])


def test_bad_input_is_refused_naming_it(embedder, reranker):
    cases = [
        (lambda: embedder.embed([]), "prompts", "no prompt"),
        (lambda: embedder.embed([""]), "prompts", "empty string"),
        (lambda: embedder.embed([[1, 99999]]), "prompts", "outside the vocabulary"),
        (lambda: embedder.embed([[1] * (MAX_SEQ + 1)]), "max_seq_len", "more than"),
        (lambda: embedder.embed("a", dimensions=12), "dimensions", "one of [8, 16, 32]"),
        (lambda: embedder.embed("a", prompt_name="doc"), "prompt_name", "has: document, query"),
        (lambda: embedder.score("a", "b"), "runner", "needs a reranker"),
        (lambda: reranker.embed("a"), "runner", "needs an embedding model"),
        (lambda: reranker.score(["a", "b"], ["c", "d", "e"]), "data_1", "as many as"),
        (lambda: embedder.generate("a"), "max_tokens", "generates no tokens"),
    ]
    for call, param, words in cases:
        with pytest.raises(RequestError) as e:
            call()
        assert e.value.param == param and words in str(e.value), str(e.value)
        assert "\n" not in str(e.value)


def test_a_folder_that_contradicts_the_task_is_refused_naming_its_file(tmp_path):
    with pytest.raises(RequestError, match="modules.json says it is a sentence-transformers"):
        LLM(str(EMBED), mesh="1x1", runner="generate")
    with pytest.raises(ConfigError, match="modules.json says this is a sentence-transformers"):
        LLM(str(EMBED), mesh="1x1", max_seq_len=64, hf_overrides=RERANKER)
    folder = _copy(tmp_path)
    pooling = folder / "1_Pooling" / "config.json"
    modes = json.loads(pooling.read_text())
    modes.update(pooling_mode_lasttoken=False, pooling_mode_mean_tokens=True)
    pooling.write_text(json.dumps(modes))
    with pytest.raises(ConfigError, match=r"1_Pooling/config.json asks for pooling_mode_mean"):
        LLM(str(folder), mesh="1x1", max_seq_len=64)
    with pytest.raises(RequestError, match="hf_overrides has 'architecture'"):
        LLM(str(RERANK), mesh="1x1", hf_overrides={"architecture": ["x"]})


def test_the_embed_command_prints_a_json_line_an_input(capsys):
    """`qwen3-spmd embed`: embeddings, a reranker's scores against --query, and a
    refusal in one line with status 2."""
    from qwen3_spmd.run.cli import main

    (text, i), (_, j) = TEXTS[0], TEXTS[1]
    ids = ",".join(map(str, REF[f"ids_{j}"].tolist()))
    base = ["embed", "--mesh", "1x1", "--max-model-len", str(MAX_SEQ)]
    argv = [*base, "--model", str(EMBED), "--input", text, "--input-ids", ids, "--dimensions", "16"]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["index"] for line in lines] == [0, 1]
    for line, k in zip(lines, (i, j)):
        assert line["prompt_tokens"] == len(REF[f"ids_{k}"])
        _close(line["embedding"], REF[f"embedding_16_{k}"])
    ref, pairs = rerank_reference()
    overrides = json.dumps(RERANKER)
    argv = [*base, "--model", str(RERANK), "--hf-overrides", overrides, "--query", pairs[0][0]]
    assert main([*argv, "--input", pairs[0][1], "--input", pairs[1][1]]) == 0
    scores = [json.loads(line)["score"] for line in capsys.readouterr().out.splitlines()]
    np.testing.assert_allclose(scores, [ref["score_0"], ref["score_1"]], atol=TOL, rtol=0)
    assert main([*base, "--model", str(EMBED), "--input", "a", "--dimensions", "12"]) == 2
    err = capsys.readouterr().err.strip()
    assert "dimensions 12 is not one of [8, 16, 32]" in err and "\n" not in err
