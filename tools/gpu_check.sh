#!/usr/bin/env bash
# The checks a lent GPU gets, in one call, most wanted first: single-device tests on the
# GPU, then benchmarks in bfloat16 (dense 0.6B, an FP8 checkpoint and its products'
# formulations, decode under XLA's command-buffer settings, decode of earlier trees for
# the before and after, what XLA launches a decode step, paged decode attention's
# kernels, speculative decoding; with WHEELS also transformers as the peer, structured
# outputs and the MoE formulations). Each phase has its own time limit inside one
# overall deadline, and writes what it measured under $OUT as it goes, so a phase that
# runs long costs only itself.
#
#   OUT=/tmp/gpu tools/gpu_check.sh [WHEELS]     # WHEELS: wheels of packages the image lacks
#
# Earlier trees to time decode on: folders .gpu/trees/NAME (carried with the call), each
# `git archive REV model pipeline ring run sharding ...` of a commit: one with a
# top-level __init__.py is imported as qwen3_spmd through a link, one without (before
# 2026-11-30) runs as `python3 -m run` from its folder.
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

# phase NAME SECONDS COMMAND...: runs COMMAND for at most SECONDS (less if the deadline
# is nearer); its stdout goes to $OUT/results.txt under a line "### NAME", its stderr to
# $OUT/log.txt (the device returns at most 8 files), and its status is logged.
phase() {
    local name=$1 limit=$2
    shift 2
    local left=$((DEADLINE - SECONDS - 5))
    ((left < limit)) && limit=$left
    if ((limit < 20)); then
        echo "== $name: not run (deadline)" | tee -a "$OUT/log.txt"
        return
    fi
    echo "== $name: $*" >>"$OUT/log.txt"
    local t0=$SECONDS
    echo "### $name" >>"$OUT/results.txt"
    timeout "$limit" "$@" >>"$OUT/results.txt" 2>>"$OUT/log.txt"
    echo "== $name: rc $? in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/log.txt"
}

mkdir -p "$OUT"
if [[ -n "$WHEELS" ]]; then
    $PY -m pip install -q --no-index --find-links "$WHEELS" fastapi uvicorn llguidance \
        >>"$OUT/log.txt" 2>&1 || { cat "$OUT/log.txt"; exit 1; }
fi
{
    nvidia-smi -L 2>/dev/null
    $PY -c 'import jax, flax, torch, transformers; print("jax", jax.__version__, jax.devices(), "flax", flax.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
} 2>&1 | tee -a "$OUT/log.txt"
$PY -c 'import qwen3_spmd.run.cli' || exit 1

if [[ -n "${GPU_CHECK_SMOKE:-}" ]]; then
    platform=cpu model=tiny sizes=(--smoke) fp8_sizes=(--scenario decode --smoke) spec=(--smoke) structured=(--smoke)
    decode=(--scenario decode --smoke) old=(--scenario decode --smoke) measure=(--layers 1 --rows 1 --repeat 2)
    paged=(--batches 2 --context 64 --repeat 2 --dtype float32)
    moe=(--rows 1 --repeat 1 --experts 16)
    tests=(tests/ring/test_ring_merge.py)
else
    platform=cuda model=0.6B
    sizes=(--prompt-lens 128,2048,8192 --batches 1,8,32 --repeats 3)
    decode=(--scenario decode --batches 1,8,32 --repeats 3)
    old=(--scenario decode --batches 1,8 --repeats 3)
    spec=(--batches 1 --spec-tokens 4 --repeats 3)
    # Decode after the dense run's 128-token prompts, so the two read the same cache.
    fp8_sizes=(--scenario decode --batches 1,8,32 --repeats 3)
    measure=(--rows 1,8,32 --repeat 20)
    paged=(--batches 8,32 --context 2048)
    structured=(--serve-requests 2 --serve-prompt-lens 16,128 --serve-output-lens 16,64)
    moe=(--rows 1,8,512 --repeat 5)
    # Single-device tests of what this call measures: FP8's products, decode attention
    # on one seq device, the LSE merge.
    tests=(tests/model/test_fp8.py tests/ring/test_ring_merge.py
        -k "(equal_float32 and 1x1x1) or merge")
fi
bench=($PY -m qwen3_spmd.run bench --dtype bfloat16 --json)

phase tests 70 env QWEN3_SPMD_TEST_PLATFORM=$platform \
    $PY -m pytest -q -n 0 -p no:cacheprovider -rfE --durations=5 "${tests[@]}"
phase dense 90 "${bench[@]}" --model $model --scenario prefill --scenario decode --scenario roofline "${sizes[@]}"
fp8=$(mktemp -d)/fp8
$PY -m qwen3_spmd.run convert --random-preset $model --model "$fp8-hf" --out "$fp8" \
    --quantize fp8 >>"$OUT/log.txt" 2>&1 || echo "== convert failed" | tee -a "$OUT/log.txt"
phase fp8 55 "${bench[@]}" --model "$fp8" "${fp8_sizes[@]}"
# The products alone, formulation by formulation, over the preset's layers.
phase fp8-products 60 $PY tools/fp8_measure.py --model $model "${measure[@]}"
# Decode under XLA's command buffers (CUDA graphs): off, and with the loops inside.
phase cmdbuf-off 55 env XLA_FLAGS=--xla_gpu_enable_command_buffer= \
    "${bench[@]}" --model $model "${decode[@]}"
phase cmdbuf-loops 45 env \
    XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1" \
    "${bench[@]}" --model $model "${decode[@]}"
# Decode of earlier trees on the same GPU (before this tree's change; the 11-29 figures').
tree() {
    local dir=$1 link
    shift
    if [[ -f "$dir/__init__.py" ]]; then
        link=$(mktemp -d)
        ln -s "$PWD/$dir" "$link/qwen3_spmd"
        PYTHONPATH=$link $PY -m qwen3_spmd.run bench --dtype bfloat16 --json "$@"
    else
        (cd "$dir" && PYTHONPATH= $PY -m run bench --dtype bfloat16 --json "$@")
    fi
}
export -f tree
export PY
for dir in .gpu/trees/*/; do
    [[ -d "$dir" ]] || continue
    name=$(basename "$dir")
    phase "tree-$name" 40 bash -c 'tree "$@"' _ "${dir%/}" --model $model "${old[@]}"
done
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
phase hlo 45 bash -c 'hlo "$@"' _ $model "$fp8"
phase paged 25 $PY tools/paged_measure.py --model $model "${paged[@]}"
phase speculative 55 "${bench[@]}" --model $model --scenario speculative "${spec[@]}"
if [[ -n "$WHEELS" || -n "${GPU_CHECK_SMOKE:-}" ]]; then
    phase peer 90 "${bench[@]}" --model $model --scenario peer "${sizes[@]}" --peer transformers
    phase structured 60 "${bench[@]}" --model $model --scenario structured "${structured[@]}"
    phase moe 50 $PY tools/moe_measure.py --dtype bfloat16 "${moe[@]}"
fi
grep "^== " "$OUT/log.txt"
