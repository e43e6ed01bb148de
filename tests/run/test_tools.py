"""tools/: the scripts beside the package (not installed), on made-up reports."""

import importlib.util

import pytest
from reference import ROOT

TOOLS = ROOT / "tools"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ab_bench_reads_each_job_and_the_bandwidth():
    """Prefill, decode and each speculative drafter's tokens/s, and the bandwidth."""
    ab = load("ab_bench")
    spread = lambda v: {"median": v, "min": v, "max": v, "n": 1}  # noqa: E731
    report = {
        "roofline": {"bandwidth_bytes_per_s": spread(20e9)},
        "meshes": [
            {
                "mesh": "1x1",
                "prefill": [{"prompt_len": 512, "tokens_per_s": spread(300.0)}],
                "decode": [
                    {"batch": 1, "tokens_per_s": spread(6.5)},
                    {"batch": 8, "tokens_per_s": spread(30.0)},
                ],
                "speculative": [
                    {
                        "batch": 1,
                        "drafters": {
                            "plain": {"tokens_per_s": spread(7.0)},
                            "oracle k=4": {"tokens_per_s": spread(21.0)},
                        },
                    }
                ],
            }
        ],
    }
    assert ab.figures(report) == {
        "1x1 prefill P=512 tok/s": 300.0,
        "1x1 decode B=1 tok/s": 6.5,
        "1x1 decode B=8 tok/s": 30.0,
        "1x1 speculative B=1 plain tok/s": 7.0,
        "1x1 speculative B=1 oracle k=4 tok/s": 21.0,
        "bandwidth GB/s": 20.0,
    }


def test_ab_bench_refuses_no_rounds():
    with pytest.raises(SystemExit):
        load("ab_bench").main(["a", "b", "--rounds", "0", "--", "--model", "tiny"])


HLO = """HloModule jit_decode, entry_computation_layout={()->f32[4]}

%fused_add (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %add = f32[4]{0} add(%p, %p)
}

%body.1 (carry: (s32[], f32[4])) -> (s32[], f32[4]) {
  %carry = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%carry), index=1
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_add
  %g = (f32[4]{0}, s8[0]{0}) custom-call(%f, %f), custom_call_target="__cublas$gemm"
  %r = f32[4]{0} all-reduce(%f), channel_id=1, replica_groups={{0}}, to_apply=%fused_add
  %i = s32[] get-tuple-element(%carry), index=0
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %r)
}

%cond.1 (carry: (s32[], f32[4])) -> pred[] {
  %carry = (s32[], f32[4]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main.9 (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %z = s32[] constant(0)
  %c = f32[4]{0} copy(%a)
  %init = (s32[], f32[4]{0}) tuple(%z, %c)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond.1, body=%body.1, backend_config={"known_trip_count":{"n":"16"}}
  ROOT %o = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_hlo_kernels_counts_the_work_of_the_entry_and_each_loop_body(tmp_path):
    """A made-up module: the entry's copy, then a loop body of 16 trips with a fusion, a
    cuBLAS call and an all-reduce; a fused computation's own instructions are not
    counted (they run inside their fusion)."""
    hlo = load("hlo_kernels")
    path = tmp_path / "module_0002.jit_decode.sm_9.0_gpu_after_optimizations.txt"
    path.write_text(HLO)
    assert hlo.report(path) == [
        "jit_decode.sm_9.0_gpu",
        "  entry: 1 work instructions (copy 1)",
        "  loop body body.1 (trips: 16): 3 work instructions "
        "(fusion 1, custom-call 1, all-reduce 1)",
        "    custom calls: __cublas$gemm 1",
    ]


def test_lookup_replay_drafts_after_every_token_or_after_plain_chunks():
    """The host's way decodes k + 1 plain steps after a lookup that found nothing; the
    loop's looks up again a token later, so it drafts where the host's chunk ran."""
    replay = load("lookup_replay").replay
    prompt, tokens = [1, 2], [3, 1, 2, 3, 1, 2, 3]
    # Host: [1, 2, 3] has no earlier n-gram; 3 plain steps, then [1, 2, 3] drafts [1, 2].
    assert replay(prompt, tokens, 2, every_token=False) == {
        "drafted": 2,
        "kept": 2,
        "passes": 1,
    }
    # Loop: after [.., 3, 1] it drafts [2, 3]; then one (the last token left) [2].
    assert replay(prompt, tokens, 2, every_token=True) == {"drafted": 3, "kept": 3, "passes": 2}


@pytest.mark.parametrize("name", ["gate_fd", "down_df"])  # D the input; D the output
def test_fp8_measure_formulations_compute_the_dequantized_product(name):
    """Each FP8 formulation the tool times is the product on the dequantized weight:
    `blocked` to float32 rounding, `w8a8` (activations in float8 too) to a few percent."""
    import jax.numpy as jnp
    import numpy as np

    tool = load("fp8_measure")
    rng = np.random.default_rng(0)
    O, I = (256, 384) if name == "gate_fd" else (384, 256)
    w = rng.standard_normal((O, I)).astype(np.float32)
    w8, scale_inv = tool.fp8.quantize_blocks(w, tool.BLOCKS)
    scale = jnp.asarray(tool.fp8.expand_scales(scale_inv, (O, I), name, tool.BLOCKS))
    h = jnp.asarray(rng.standard_normal((3, I)).astype(np.float32))
    want = np.asarray(h) @ tool.fp8.dequantize_blocks(w8, scale_inv, tool.BLOCKS).T
    w8 = jnp.asarray(w8)
    for how, tol in (("float32", 1e-5), ("blocked", 1e-5), ("w8a8", 0.1)):
        got = np.asarray(tool.product(how, h, w8, scale, name))
        assert np.max(np.abs(got - want)) <= tol * np.max(np.abs(want)), how
