#!/usr/bin/env bash
# The GPU measurements the open issues ask for, by part, on the GPU machine: back-to-back device calls on one warm
# machine, each running one or more parts (DEADLINE below). Qwen2.5-Coder-1.5B is staged for `lossless_bench.py real`
# in the same calls (benchmarks/gpu_eval.py: `prepare qwen2.5-coder-1.5b` here first; .gpu/ must be git-ignored).
#
#   bash benchmarks/gpu_runs.sh check COMMIT              lossless and verify-attention checks (42)
#                                                          carry [".gpu/qwen2.5-coder-1.5b/01"]
#   bash benchmarks/gpu_runs.sh fp8 COMMIT 2              fp8 K/V beside bf16 K/V, e2e (43); B=16/32k and B=4/128k
#                                                          need an H200's memory      carry [".gpu/qwen2.5-coder-1.5b/02"]
#   bash benchmarks/gpu_runs.sh shapes COMMIT 3           lossless step times at the paper's shapes (42)
#                                                          carry [".gpu/qwen2.5-coder-1.5b/03"]
#   bash benchmarks/gpu_runs.sh verify COMMIT             the verify kernel at the issue's points, 2-9 queries, with
#                                                          every launch of the sweep (42)
#   bash benchmarks/gpu_runs.sh stage - N                 carry [".gpu/qwen2.5-coder-1.5b/NN"], N = 4 .. last-1
#   bash benchmarks/gpu_runs.sh real COMMIT LAST SECONDS  lossless on the real model for SECONDS (42)
#                                                          carry [".gpu/qwen2.5-coder-1.5b/LAST", ".gpu/deps"]
#   bash benchmarks/gpu_runs.sh int4 COMMIT               the CUDA int4 kernels' tests, then every linear of a token
#                                                          at 1-256 rows as dispatched, int4 and int8 beside bf16 (44),
#                                                          and gemlite's int4 where .gpu/site holds it: carry
#                                                          [".gpu/site"] after, here,
#       .venv/bin/pip download gemlite==0.6.0.post2 --no-deps -d /tmp/gemlite && mkdir -p .gpu/site &&
#       tar -xzf /tmp/gemlite/gemlite-0.6.0.post2.tar.gz -C .gpu/site --strip-components=1 gemlite-0.6.0.post2/gemlite
#   bash benchmarks/gpu_runs.sh words COMMIT              the Triton int4 kernel's launches at 64-256 rows (llama3.1-8b),
#                                                          128-row tiles among them: where int4 is slower than bf16 (44)
#   bash benchmarks/gpu_runs.sh e2e COMMIT                the engine end to end, bf16 then int4 with the LM head in
#                                                          int4, C = 1 and 8, with the CUDA-vs-eager checks (44, 45)
#
# COMMIT: the literal hash of the tree sent (`git rev-parse HEAD` here, not on the GPU machine, whose .git may be
# stale): it goes into every result's provenance. Only `real` and `stage` need their chunk (the others run without
# one: nothing staged). FP8_ARGS / SHAPES_ARGS / E2E_ARGS: extra arguments (e.g. other --points: the last given
# counts). On a card of 80 GB (an H100) the parts that time the issue's B=16/32k and B=4/128k points (fp8, shapes,
# e2e) take instead the points that fit it: B=8/32k and B=2/128k, e2e B=4/32k.
# DEADLINE (epoch seconds): every benchmark ends 20 s before it, so that several parts fit one call, e.g.
#   DEADLINE=$(($(date +%s) + 580)) bash -c 'bash benchmarks/gpu_runs.sh int4 C; bash benchmarks/gpu_runs.sh e2e C'
# Each call copies every result so far (JSON + markdown, under /root/questkv-eval/results-lf) to $OUT as one
# results.tgz, and its log to $OUT.
set -uo pipefail
part=$1
commit=$2
alias=qwen2.5-coder-1.5b
results=/root/questkv-eval/results-lf
mkdir -p "$results"
export PYTHONPATH="/root/questkv-eval/site:$PWD" QUESTKV_CACHE_DIR=/root/questkv-eval/cache PYTHONUNBUFFERED=1
export QUESTKV_COMMIT=$commit TQDM_MININTERVAL=20
if [ -d .gpu/site ]; then  # pure-Python packages the image lacks (gemlite, for the int4 part's baseline)
    export PYTHONPATH="$PWD/.gpu/site:$PYTHONPATH"
fi
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
*H200*) gpu=h200 ;;
*H100*) gpu=h100 ;;
*) gpu=gpu ;;
esac
if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ]; then
    fp8_points="llama3.1-8b:16:32768:2048,llama3.1-8b:4:131072:4096,llama3.1-8b:1:32768:2048"
    shape_points="llama2-7b-int4-b1-32k llama3.1-8b-b16-32k llama3.1-8b-b4-128k"
    bf16_points=5,1,2
    int4_points=4,1,6
else  # the points that fit 80 GB
    fp8_points="llama3.1-8b:8:32768:2048,llama3.1-8b:2:131072:4096,llama3.1-8b:1:32768:2048"
    shape_points="llama2-7b-int4-b1-32k llama3.1-8b-b8-32k llama3.1-8b-b2-128k"
    bf16_points=5,8,1
    int4_points=4,8,6
fi
stage() { # N: copy chunk N there if this call carries it (check, fp8 and shapes run without the model)
    if [ -d ".gpu/$alias/$(printf %02d "$1")" ]; then
        python3 benchmarks/gpu_eval.py stage "$alias" "$1" || exit 1
    else
        echo "== chunk $1 not carried: not staged"
    fi
}
bench() { # SECONDS SCRIPT ARGS...: one benchmark, stopped after SECONDS (what it saved so far stays); ARGS name
    # where it writes (--out-dir "$results", or linear_bench.py's --out "$results/NAME")
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
    timeout "$seconds" python3 "$@" 2>&1 | tee -a "$OUT/log-$part.txt"
    echo "== rc ${PIPESTATUS[0]}"
}
case "$part" in
check)
    stage 1
    nvidia-smi -L
    bench 200 benchmarks/lossless_bench.py check --tag $gpu --out-dir "$results"
    bench 200 benchmarks/verify_attention.py --tag $gpu --out-dir "$results"
    ;;
fp8)
    stage "$3"
    bench 500 benchmarks/fp8_kv_bench.py --tag $gpu --points "$fp8_points" ${FP8_ARGS:-} --out-dir "$results"
    ;;
shapes)
    stage "$3"
    # Acceptances: the 1.5B's lossless drafts at 2k on the CPU (1/16 and 1/8, Quest's pages: draft-selection-*-8windows)
    # and its teacher-forced agreement at 16k, 1/16 (eval-agreement-qwen2.5-coder-1.5b-16k: book 93.8 %, code 92.0 %).
    bench 400 benchmarks/lossless_bench.py shapes --tag $gpu --acceptance 0.722 0.821 0.929 --points $shape_points \
        ${SHAPES_ARGS:-} --out-dir "$results"
    ;;
verify)
    nvidia-smi -L
    # 14 launches a query count; the results are written after each point, the issue's miss (B=1/32k, 9 queries) first
    bench 540 benchmarks/verify_attention.py --tag $gpu-sweep --sweep --queries 2,3,5,9 --reps 30 --out-dir "$results"
    ;;
int4)
    nvidia-smi -L
    echo "== GPU tests of the CUDA int4 kernels"
    python3 -m pytest --noconftest -q -p no:cacheprovider tests/ops/test_cuda_int4_gemv.py \
        tests/ops/test_cuda_int4_mma.py 2>&1 | tail -5 | tee -a "$OUT/log-$part.txt"
    bench 540 benchmarks/linear_bench.py --models llama3.1-8b llama2-7b --ms 1 2 4 8 16 32 64 128 256 \
        --methods int4 int8 --no-sweep --out "$results/linear-$gpu-dispatch"
    ;;
words)
    nvidia-smi -L
    bench 540 benchmarks/linear_bench.py --models llama3.1-8b --ms 64 128 256 --methods int4 --sweep-ms 64 128 256 \
        --sweep-kernels int4-words --out "$results/linear-$gpu-words-rows"
    ;;
e2e)
    nvidia-smi -L
    bench 300 benchmarks/e2e_bench.py --tag $gpu-bf16 --skip-hf --checks fp32,mixed --points $bf16_points \
        --selection-intervals 8 ${E2E_ARGS:-} --out-dir "$results"
    bench 300 benchmarks/e2e_bench.py --tag $gpu-int4-lm-head --skip-hf --checks int4 --quantization int4 \
        --quantize-lm-head --points $int4_points --selection-intervals 8 ${E2E_ARGS:-} --out-dir "$results"
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
        --contexts 32256 16384 --out-dir "$results"
    ;;
*)
    echo "unknown part $part" >&2
    exit 2
    ;;
esac
tar -C "$results" -czf "$OUT/results.tgz" .
ls -la "$results"
