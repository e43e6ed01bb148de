"""`bench --peer transformers`: Hugging Face transformers' Qwen3ForCausalLM on the same
weights, dtype, prompts and batch, alternating run by run with our 1x1 engine.

torch and transformers are not requirements of this project; they are imported here
only. A checkpoint folder is loaded with from_pretrained; a preset's random weights are
copied from our source, each tensor turned back into Hugging Face's layout (checked by
turning it forward again). Their generate runs greedily with its KV cache,
`attn_implementation="sdpa"`, under torch.no_grad, min_new_tokens = max_new_tokens; a
logits processor marks the end of the prefill (first call) and of the last step, the
same cut points as our engine's streaming callback. When our engine runs on a GPU and
torch sees one, theirs runs on it too (the marks then wait for the GPU).
"""

from __future__ import annotations

import os
import time

import numpy as np

from qwen3_spmd.pipeline.requests import fitting_seq_len
from qwen3_spmd.run.bench.measure import decode_cache_len, prompts_for, run_once, spread
from qwen3_spmd.run.flags import CLIError


def _import():
    try:
        import torch
        import transformers
    except ImportError as e:
        raise CLIError(
            f"--peer transformers needs torch and transformers ({e}): "
            "pip install torch transformers"
        ) from None
    return torch, transformers


# Long because it builds transformers' config field by field from ours (dense and MoE)
# and copies each tensor under transformers' name: one table, read together.
def hf_model(spec, source, dtype_name: str):
    torch, transformers = _import()
    from qwen3_spmd.model.checkpoint.hf_names import name_table

    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    cfg = spec.cfg
    moe = (
        dict(
            num_experts=cfg.E,
            num_experts_per_tok=cfg.A,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
        )
        if cfg.E
        else {}
    )
    kind = transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM
    if spec.folder is not None:
        model = kind.from_pretrained(spec.folder, dtype=tdtype, attn_implementation="sdpa")
        return model.eval()
    if cfg.rope_scaling is not None:
        raise CLIError(
            "--peer transformers with a YaRN preset is not supported: use a checkpoint folder"
        )
    hf_cfg = (transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config)(
        vocab_size=cfg.V,
        hidden_size=cfg.D,
        intermediate_size=cfg.F,
        num_hidden_layers=cfg.L,
        num_attention_heads=cfg.N,
        num_key_value_heads=cfg.K,
        head_dim=cfg.H,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.attention_bias,
        use_sliding_window=False,
        attn_implementation="sdpa",
        **moe,
    )
    model = kind(hf_cfg).to(tdtype)
    # Each tensor is copied into the model's own as it is made (not collected first and
    # loaded): a peer of several GB then needs no second copy of itself.
    own, filled = model.state_dict(), set()

    def put(name: str, x, rows=slice(None)):
        if name not in own:
            raise AssertionError(f"weights for transformers: unexpected {name}")
        own[name][rows].copy_(torch.from_numpy(np.ascontiguousarray(x)))
        filled.add(name)

    for e in name_table(cfg):
        if e.path[:2] == ("layers", "moe") and e.path[2] != "router_ed":
            continue  # transformers holds the experts fused: below
        full = source.full(e.path, np.float32)
        for i in range(cfg.L) if e.stacked else [None]:
            for name, x in e.hf_tensors(full if i is None else full[i], cfg, i).items():
                put(name, x)
    if moe:  # transformers 5.x's Qwen3MoeExperts: gate_up_proj [E, 2F, D] (gate, then up),
        # down_proj [E, D, F]; one stacked source tensor at a time
        F = cfg.moe_intermediate_size
        sparse = [i for i in range(cfg.L) if cfg.is_sparse(i)]
        for n, name, rows in (
            ("gate_efd", "gate_up_proj", (slice(None), slice(0, F))),
            ("up_efd", "gate_up_proj", (slice(None), slice(F, 2 * F))),
            ("down_edf", "down_proj", slice(None)),
        ):
            full = source.full(("layers", "moe", n), np.float32)
            for i in sparse:
                put(f"model.layers.{i}.mlp.experts.{name}", full[i], rows)
            del full
    missing = [
        k
        for k in own
        if k not in filled and not (k == "lm_head.weight" and cfg.tie_word_embeddings)
    ]
    if missing:
        raise AssertionError(f"weights for transformers: missing {missing}")
    model.tie_weights()
    return model.to(tdtype).eval()


def _device(torch) -> str:
    import jax

    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def _theirs(model, prompts, new_tokens: int) -> dict:
    torch, transformers = _import()
    marks = []
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    class Mark(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            sync()
            marks.append(time.perf_counter())
            return scores

    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            num_beams=1,
            logits_processor=transformers.LogitsProcessorList([Mark()]),
            pad_token_id=0,
        )
    return {"prefill_s": marks[0] - t0, "decode_s": marks[-1] - marks[0]}


def _pairs(engine, model, prompts, new_tokens, settings, phase: str, tokens: int) -> dict:
    run_once(engine, prompts, new_tokens)  # compiles
    for _ in range(settings["warmup"]):
        run_once(engine, prompts, new_tokens)
    for _ in range(max(settings["warmup"], 1)):
        _theirs(model, prompts, new_tokens)
    ours, theirs = [], []
    for _ in range(settings["repeats"]):
        ours.append(run_once(engine, prompts, new_tokens)[phase])
        theirs.append(_theirs(model, prompts, new_tokens)[phase])
    return {
        "ours_time_s": spread(ours),
        "theirs_time_s": spread(theirs),
        "ours_tokens_per_s": spread([tokens / t for t in ours]),
        "theirs_tokens_per_s": spread([tokens / t for t in theirs]),
        "speedup_pairs": [b / a for a, b in zip(ours, theirs)],
        "speedup": spread([b / a for a, b in zip(ours, theirs)]),
    }


def run_peer(spec, source, engines, settings, scenarios, say, embed=None) -> dict:
    """engines: our 1x1 MeshEngines (already compiled where the 1x1 jobs ran); embed:
    our 1x1 embed job's figures (run.bench.embed), which the peer's are set beside."""
    torch, transformers = _import()

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    device = _device(torch)
    model = hf_model(spec, source, engines.dtype.name).to(device)
    cfg, s = spec.cfg, settings
    out = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "threads": threads,
        "device": device,
        "attn_implementation": "sdpa",
        "mesh": "1x1",
        "prefill": [],
        "decode": [],
    }
    say("peer: transformers")
    if "prefill" in scenarios:
        B = s["prefill_batch"]
        for T in s["prompt_lens"]:
            engine = engines.get(fitting_seq_len(T, 1, 1))
            job = _pairs(engine, model, prompts_for(cfg, B, T, s["seed"]), 1, s, "prefill_s", B * T)
            out["prefill"].append({"prompt_len": T, "batch": B, **job})
            say(
                f"  prefill T={T}: ours {job['ours_tokens_per_s']['median']:.1f} tok/s, "
                f"theirs {job['theirs_tokens_per_s']['median']:.1f}, speedup "
                f"{job['speedup']['median']:.2f}"
            )
    if "decode" in scenarios:
        T, N = s["decode_prompt_len"], s["decode_steps"]
        for B in s["batches"]:
            engine = engines.get(decode_cache_len(s, 1))
            job = _pairs(
                engine, model, prompts_for(cfg, B, T, s["seed"]), N + 1, s, "decode_s", B * N
            )
            out["decode"].append({"batch": B, "prompt_len": T, "steps": N, **job})
            say(
                f"  decode B={B}: ours {job['ours_tokens_per_s']['median']:.1f} tok/s, "
                f"theirs {job['theirs_tokens_per_s']['median']:.1f}, speedup "
                f"{job['speedup']['median']:.2f}"
            )
    if embed is not None:
        from qwen3_spmd.run.bench.embed import embed_peer

        out["embed"] = embed_peer(model, torch, device, embed, cfg, s, say)
    return out
