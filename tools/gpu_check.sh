#!/usr/bin/env bash
# The checks a lent GPU gets, in one call: the single-device tests on the GPU, then the
# benchmarks in bfloat16 (dense 0.6B against transformers, speculative decoding, an FP8
# checkpoint, what XLA launches a decode step, structured outputs, the MoE
# formulations). Each phase has its own time limit inside one overall deadline, and
# writes what it measured under $OUT as it goes, so a phase that runs long costs only
# itself.
#
#   OUT=/tmp/gpu tools/gpu_check.sh [WHEELS]     # WHEELS: wheels of packages the image lacks
#
# The lent machine reaches no package index, and its image has no fastapi, uvicorn or
# llguidance; make WHEELS here (its Python is 3.12) and carry it:
#   pip download -d .gpu/wheels --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_31_x86_64 --platform manylinux2014_x86_64 fastapi uvicorn llguidance
#   GPU_CHECK_SMOKE=1 OUT=/tmp/gpu tools/gpu_check.sh   # the same steps on CPU, tiny sizes
#
# Runs from the repository root under the machine's own python3 (its jax, torch and
# transformers); the package is imported from this tree through a link named qwen3_spmd.
set -u
OUT=${OUT:?set OUT to a folder for the results}
WHEELS=${1:-}
DEADLINE=$((SECONDS + ${GPU_CHECK_SECONDS:-570}))
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

link=$(mktemp -d)
ln -s "$PWD" "$link/qwen3_spmd"
export PYTHONPATH="$link${PYTHONPATH:+:$PYTHONPATH}"

# phase NAME FILE SECONDS COMMAND...: runs COMMAND for at most SECONDS (less if the
# deadline is nearer), its stdout to $OUT/FILE, its stderr to $OUT/log.txt (the device
# returns at most 8 files), and logs its status.
phase() {
    local name=$1 file=$2 limit=$3
    shift 3
    local left=$((DEADLINE - SECONDS - 5))
    ((left < limit)) && limit=$left
    if ((limit < 20)); then
        echo "== $name: not run (deadline)" | tee -a "$OUT/log.txt"
        return
    fi
    echo "== $name: $*" >>"$OUT/log.txt"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$file" 2>>"$OUT/log.txt"
    echo "== $name: rc $? in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/log.txt"
}

mkdir -p "$OUT"
if [[ -n "$WHEELS" ]]; then
    $PY -m pip install -q --no-index --find-links "$WHEELS" fastapi uvicorn llguidance \
        >>"$OUT/log.txt" 2>&1 || { cat "$OUT/log.txt"; exit 1; }
fi
{
    nvidia-smi -L 2>/dev/null
    $PY -c 'import jax, flax, torch, transformers, llguidance; print("jax", jax.__version__, jax.devices(), "flax", flax.__version__, "torch", torch.__version__, "transformers", transformers.__version__, "llguidance", llguidance.__version__)'
} 2>&1 | tee -a "$OUT/log.txt"
$PY -c 'import qwen3_spmd.run.cli, fastapi' || exit 1

if [[ -n "${GPU_CHECK_SMOKE:-}" ]]; then
    platform=cpu model=tiny sizes=(--smoke) fp8_sizes=(--smoke) spec=(--smoke) structured=(--smoke)
    moe=(--rows 1 --repeat 1 --experts 16)
    tests=(tests/model/test_rope.py tests/ring/test_ring_merge.py)
else
    platform=cuda model=0.6B
    sizes=(--prompt-lens 128,512,2048,8192 --batches 1,8,32 --repeats 3)
    spec=(--batches 1,8 --spec-tokens 4,8 --repeats 3)
    # Decode after the dense run's 128-token prompts, so the two read the same cache.
    fp8_sizes=(--prompt-lens 2048 --decode-prompt-len 128 --batches 1,8,32 --repeats 3)
    structured=(--serve-requests 2 --serve-prompt-lens 16,128 --serve-output-lens 16,64)
    moe=(--rows 1,8,512 --repeat 5)
    # The tests that need one device; a mesh's tests need as many as it has.
    tests=(tests/model/test_model.py tests/model/test_rope.py tests/ring/test_ring_merge.py tests/pipeline/programs/test_sampling.py
        tests/ring/test_ring_attention.py::test_prompt_attention_is_block_attention_on_real_rows
        tests/model/test_fp8.py tests/pipeline/speculative/test_speculative.py
        -k "not 2x and not x2 and not 4x and not x4 and not 2-1-1 and not 1-2-1 and not 1-1-2 and not through_orbax and not one_byte_on")
fi
bench=($PY -m qwen3_spmd.run bench --dtype bfloat16 --json)

phase tests tests.txt 200 env QWEN3_SPMD_TEST_PLATFORM=$platform \
    $PY -m pytest -q -n 0 -p no:cacheprovider -rfE --durations=10 "${tests[@]}"
phase dense dense.json 150 "${bench[@]}" --model $model "${sizes[@]}" --peer transformers
phase speculative speculative.json 100 "${bench[@]}" --model $model --scenario speculative "${spec[@]}"
fp8=$(mktemp -d)/fp8
$PY -m qwen3_spmd.run convert --random-preset $model --model "$fp8-hf" --out "$fp8" \
    --quantize fp8 >>"$OUT/log.txt" 2>&1 || echo "== convert failed" | tee -a "$OUT/log.txt"
phase fp8 fp8.json 70 "${bench[@]}" --model "$fp8" --scenario prefill --scenario decode "${fp8_sizes[@]}"
# What XLA launches per decode step (tools/hlo_kernels.py), plain and FP8: the lead for
# decode at batch 1 (launch-bound here) and for FP8's dequantization.
hlo() {
    for m in "$@"; do
        local d
        d=$(mktemp -d)
        XLA_FLAGS="--xla_dump_to=$d --xla_dump_hlo_as_text" $PY -m qwen3_spmd.run generate \
            --model "$m" --dtype bfloat16 --prompt-ids 1,2,3,4 --max-new-tokens 4 \
            --compile-cache off >/dev/null || continue
        echo "== $m"
        $PY tools/hlo_kernels.py "$d" --only decode
    done
}
export -f hlo
export PY
phase hlo hlo.txt 70 bash -c 'hlo "$@"' _ $model "$fp8"
phase structured structured.json 60 "${bench[@]}" --model $model --scenario structured "${structured[@]}"
phase moe moe.txt 50 $PY tools/moe_measure.py --dtype bfloat16 "${moe[@]}"
grep "^== " "$OUT/log.txt"
