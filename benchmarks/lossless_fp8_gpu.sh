#!/usr/bin/env bash
# The lossless-Quest and FP8-KV measurements (issues 42 and 43) on the GPU machine, in back-to-back device calls on
# one warm machine, staging Qwen2.5-Coder-1.5B for `lossless_bench.py real` in the same calls
# (benchmarks/gpu_eval.py: `prepare qwen2.5-coder-1.5b` here first; .gpu/ must be git-ignored).
#
#   bash benchmarks/lossless_fp8_gpu.sh check COMMIT              carry [".gpu/qwen2.5-coder-1.5b/01"]
#   bash benchmarks/lossless_fp8_gpu.sh fp8 COMMIT 2              carry [".gpu/qwen2.5-coder-1.5b/02"]
#   bash benchmarks/lossless_fp8_gpu.sh shapes COMMIT 3           carry [".gpu/qwen2.5-coder-1.5b/03"]
#   bash benchmarks/lossless_fp8_gpu.sh stage - N                 carry [".gpu/qwen2.5-coder-1.5b/NN"], N = 4 .. last-1
#   bash benchmarks/lossless_fp8_gpu.sh real COMMIT LAST SECONDS  (`real` for SECONDS) carry [".gpu/qwen2.5-coder-1.5b/LAST", ".gpu/deps"]
#
# COMMIT: the literal hash of the tree sent (`git rev-parse HEAD` here, not on the GPU machine, whose .git may be
# stale): it goes into every result's provenance. check, fp8 and shapes also run without their chunk (nothing staged). FP8_ARGS / SHAPES_ARGS: extra arguments
# (e.g. --points that fit an 80 GB card); DEADLINE (epoch seconds): every benchmark ends 20 s before it, so that
# several parts fit one call. Each call copies every result so far (JSON + markdown, under
# /root/questkv-eval/results-lf) to $OUT as one results.tgz, and its log to $OUT.
set -uo pipefail
part=$1
commit=$2
alias=qwen2.5-coder-1.5b
results=/root/questkv-eval/results-lf
mkdir -p "$results"
export PYTHONPATH="/root/questkv-eval/site:$PWD" QUESTKV_CACHE_DIR=/root/questkv-eval/cache PYTHONUNBUFFERED=1
export QUESTKV_COMMIT=$commit TQDM_MININTERVAL=20
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
*H200*) gpu=h200 ;;
*H100*) gpu=h100 ;;
*) gpu=gpu ;;
esac
stage() { # N: copy chunk N there if this call carries it (check, fp8 and shapes run without the model)
    if [ -d ".gpu/$alias/$(printf %02d "$1")" ]; then
        python3 benchmarks/gpu_eval.py stage "$alias" "$1" || exit 1
    else
        echo "== chunk $1 not carried: not staged"
    fi
}
bench() { # SECONDS SCRIPT ARGS...: one benchmark, stopped after SECONDS (what it saved so far stays)
    local seconds=$1
    shift
    if [ -n "${DEADLINE:-}" ] && [ $((DEADLINE - $(date +%s) - 20)) -lt "$seconds" ]; then
        seconds=$((DEADLINE - $(date +%s) - 20))
    fi
    if [ "$seconds" -le 0 ]; then
        echo "== skipped (DEADLINE): $*"
        return
    fi
    echo "== $* (at most $seconds s)"
    timeout "$seconds" python3 "$@" --out-dir "$results" 2>&1 | tee -a "$OUT/log-$part.txt"
    echo "== rc ${PIPESTATUS[0]}"
}
case "$part" in
check)
    stage 1
    nvidia-smi -L
    bench 200 benchmarks/lossless_bench.py check --tag $gpu
    bench 200 benchmarks/verify_attention.py --tag $gpu
    ;;
fp8)
    stage "$3"
    bench 500 benchmarks/fp8_kv_bench.py --tag $gpu ${FP8_ARGS:-}
    ;;
shapes)
    stage "$3"
    # Acceptances: the 1.5B's lossless drafts at 2k on the CPU (1/16 and 1/8, Quest's pages: draft-selection-*-8windows)
    # and its teacher-forced agreement at 16k, 1/16 (eval-agreement-qwen2.5-coder-1.5b-16k: book 93.8 %, code 92.0 %).
    bench 400 benchmarks/lossless_bench.py shapes --tag $gpu --acceptance 0.722 0.821 0.929 ${SHAPES_ARGS:-}
    bench 150 benchmarks/verify_attention.py --tag $gpu-sweep --sweep
    ;;
stage)
    stage "$3"
    exit 0
    ;;
real)
    stage "$3"
    python3 benchmarks/gpu_eval.py finish "$alias" || exit 1
    # (a context plus 256 tokens and 64 within the model's 32768 positions, a multiple of 256)
    bench "$4" benchmarks/lossless_bench.py real --model "$alias" --tag qwen2.5-coder-1.5b-$gpu --memory 0.45 \
        --contexts 32256 16384
    ;;
*)
    echo "unknown part $part" >&2
    exit 2
    ;;
esac
tar -C "$results" -czf "$OUT/results.tgz" .
ls -la "$results"
