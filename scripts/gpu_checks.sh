#!/usr/bin/env bash
# The GPU checks a session runs when it is lent a GPU machine, in one short script (device time is scarce).
#
#   bash scripts/gpu_checks.sh wheels   # here (internet to the registries): tierlm's dependencies that a GPU
#                                       # image lacks, as wheels in .whl/ (pinned to this .venv's versions)
#   bash scripts/gpu_checks.sh run [--dry-run] [CHECK ...]
#                                       # there, from the repository's root, carrying .whl and runs/tiny_sft
#                                       # (bash scripts/main.sh makes it): the checks named, each with its own time
#                                       # limit, into $OUT/log.txt (or ./gpu-checks.log without $OUT)
#
# The checks: tests (the CUDA-only tests, ~1-2 min), card (bench/inference_card.py: the decode step's latency,
# throughput, memory and MBU at batch 1/16/64: tierlm's CUDA-graph engine, the same with its step compiled by Inductor,
# the same reading its tokens after every step, its eager step, and transformers' compiled static cache), card_pack (the
# compiled step with q/k/v and gate/up packed against apart, batch 1 and 64), card_attention (the same with attention
# compiled from its math, not cuDNN's kernel), card_autotune (the same compiled with Inductor's coordinate-descent
# tuning, batch-1 matmuls as its own tuned reductions, and with max-autotune too; up to 420 s), card_profile (the
# compiled decode step's kernels and host time, default and coordinate-descent), rollouts (bench/rollout_batch.py: an RL
# step's 8 prompts x 8 samples decoded as one batch against one prompt at a time), rl (bench/rl.py: one RL step split
# into generation / scoring / training on a 393 M random-weight policy, eager and with infra.compile), mfu
# (bench/gpu_mfu.py: training MFU eager, compiled and compiled FP8, with their loss curves), mfu_model (the whole
# forward compiled, with the fused loss and with logits; up to 300 s), mfu_batch (the same at nanochat's batch of 32 x
# 2048), profile (the compiled training step's kernels), decode (the batched decode step alone), serve_cuda and
# serve_cpu (`tierlm serve` under load on the GPU and on the machine's CPU, ~2 min each; bench/serve_load.py). None
# named: tests and card, whose limits add to 450 s (a call may run 600 s and a session has 900, each machine start about
# 40 s). Next: `run card_autotune mfu_batch` (the decode step compiled with coordinate-descent tuning and max-autotune
# against the default; training at nanochat's batch, not yet measured), then card_profile (the kernels of the winner)
# and card_attention if time is left (on the H200, 2026-11-29: tests 90-120 s, card_profile 67-75 s, card_pack ~170 s,
# profile 37 s, the card's three tierlm contenders 112 s, rollouts 28 s, mfu_model ~150 s, rl ~200 s, each later `run`
# ~8 s of setup; 2026-11-28: card 150 s before its compiled/every-step contenders, mfu 52 s; on the H100, 2026-11-26:
# serve_cuda 118 s, serve_cpu 135 s). Run only the checks named: a call that re-runs `tests` to set up costs its two
# minutes. The figures go to docs/benchmarks.md with the card named.
# `run --dry-run [names]` runs the checks' scripts at tiny sizes on this CPU instead, every check where none is named
# (~3 min on 2 cores: the scripts cannot rot).
set -uo pipefail

# The GPU image holds torch, transformers, tokenizers, safetensors, numpy, peft, jax, prometheus_client, httpx; these
# are what tierlm (with its serve and fp8 extras, and DeepSpeed) needs beyond them.
WHEELS=(datasets dill multiprocess omegaconf antlr4-python3-runtime pydantic pydantic-core annotated-types
    typing-inspection fastapi starlette uvicorn opentelemetry-api torchao hjson)

wheels() {
    local pins=() name version
    for name in "${WHEELS[@]}"; do
        version=$(.venv/bin/python -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
        [ -n "$version" ] || { echo "gpu_checks: $name is not in .venv: run bash scripts/setup.sh first" >&2; exit 2; }
        pins+=("$name==$version")
    done
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "${pins[@]}" || exit 1
    # DeepSpeed is published as source only: built here into a wheel (pure Python; its kernels compile where used)
    version=$(.venv/bin/python -m pip show deepspeed 2>/dev/null | awk '/^Version:/ {print $2}')
    [ -z "$version" ] || DS_BUILD_OPS=0 .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation \
        -w .whl "deepspeed==$version" || exit 1
    du -sh .whl
}

check() {
    local dry=() gpu=cuda few="" clients=""
    [ -z "${DRY:-}" ] || dry=(--dry-run) gpu=cpu few=1 clients=1,8  # a dry run: tiny sizes, on this CPU
    case "$1" in
        tests) timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=line -rf "tests/test_distributed.py::test_fsdp_bf16_on_one_gpu" \
            "tests/test_primitives.py::test_fp8_trains_on_a_gpu" "tests/test_ablate.py::test_forked_runs_train_on_a_gpu" \
            "tests/test_rl.py::test_cuda_graph_decoding_equals_the_eager_step" \
            "tests/test_rl.py::test_cuda_decoding_compiled_ahead_and_batched_samples_the_eager_tokens" \
            "tests/test_batching.py::test_sequences_joining_and_leaving_a_batch_compute_what_each_computes_alone[None-cuda]" \
            2>&1 | grep -E "^(E |/|FAILED|[0-9]+ (passed|failed))" | tail -12 ;;  # a failure's line and where it was
        card) timeout 300 python3 bench/inference_card.py "${dry[@]}" 2>&1 | grep -v Warning | tail -16 ;;
        card_pack) timeout 200 python3 bench/inference_card.py "${dry[@]}" --contenders tierlm-compiled,tierlm-compiled-apart \
            --batches 1,64 2>&1 | grep -v Warning | tail -6 ;;  # dry: its own batches
        card_attention) timeout 200 python3 bench/inference_card.py "${dry[@]}" --batches 1,64 \
            --contenders tierlm-compiled,tierlm-compiled-math 2>&1 | grep -v Warning | tail -6 ;;
        card_autotune) timeout 420 python3 bench/inference_card.py "${dry[@]}" --batches 1,64 \
            --contenders tierlm-compiled,tierlm-compiled-descent,tierlm-compiled-autotune 2>&1 | grep -v Warning | tail -8 ;;
        card_profile) timeout 200 python3 bench/inference_card.py "${dry[@]}" --profile --batches 1 --new-tokens 32 \
            --contenders tierlm-compiled,tierlm-compiled-descent 2>&1 | grep -v Warning | tail -110 ;;
        rollouts) timeout 120 python3 bench/rollout_batch.py "${dry[@]}" 2>&1 | grep -v Warning | tail -4 ;;
        rl) if [ -n "${DRY:-}" ]; then
                timeout 120 python3 bench/rl.py --sft runs/tiny_sft --random-model 2x32 --max-new-tokens 16 \
                    --repeats 1 --steps 4 --only "1 process on-policy" 2>&1 | tail -4
            else
                local only="1 process on-policy,1 process on-policy compiled,1 process on-policy all compiled"
                timeout 420 python3 bench/rl.py --device-type cuda --random-model 20x64 --sft runs/tiny_sft \
                    --max-new-tokens 128 --repeats 1 --steps 6 --threads 8 --only "$only" 2>&1 | tail -7
            fi ;;
        mfu) timeout 190 python3 bench/gpu_mfu.py "${dry[@]}" 2>&1 | grep -v Warning | tail -8 ;;
        mfu_model) for loss in "" --logits-loss; do  # the whole forward compiled: with the fused loss, with logits
                timeout 150 python3 bench/gpu_mfu.py "${dry[@]}" --modes compiled-model $loss 2>&1 | grep -v Warning \
                    | tail -2
            done ;;
        mfu_batch) timeout 150 python3 bench/gpu_mfu.py "${dry[@]}" --modes compiled-model --batch 32 2>&1 \
            | grep -v Warning | tail -2 ;;  # nanochat's batch a GPU for its depth-20 run: 32 x 2048
        profile) timeout 150 python3 bench/gpu_mfu.py "${dry[@]}" --modes compiled --steps 5 --profile 2>&1 | grep -v Warning \
            | tail -24 ;;
        decode) timeout 60 python3 bench/serve_load.py --checkpoint runs/tiny_sft --decode-step --device-type "$gpu" 2>&1 \
            | tail -3 ;;
        serve_cuda) timeout 170 python3 bench/serve_load.py --checkpoint runs/tiny_sft --random-weights \
            --requests "${few:-4}" --clients "${clients:-1,8,32}" --device-type "$gpu" 2>&1 | grep -v Warn | tail -10 ;;
        serve_cpu) timeout 150 python3 bench/serve_load.py --checkpoint runs/tiny_sft --random-weights \
            --requests "${few:-8}" --clients "${clients:-1,8,32}" 2>&1 | grep -v Warn | tail -10 ;;
    esac
}

run() {
    local log=${OUT:+$OUT/log.txt} site name
    for name in "$@"; do
        case "$name" in
            tests | card | card_pack | card_attention | card_autotune | card_profile | rollouts | rl | mfu | mfu_model | mfu_batch | \
                profile | decode | serve_cuda | serve_cpu) ;;
            *) echo "gpu_checks: no check named $name (tests card card_pack card_attention card_autotune card_profile rollouts rl" \
                    "mfu mfu_model mfu_batch profile decode serve_cuda serve_cpu)" >&2
               exit 2 ;;
        esac
    done
    if [ -n "${DRY:-}" ]; then  # here, on CPU, with .venv: each check's script at its tiny sizes
        export PATH="$PWD/.venv/bin:$PATH" PYTHONWARNINGS=ignore
        for name in "$@"; do
            [ "$name" = tests ] && continue
            echo "=== $name --dry-run ($(date +%T))"
            check "$name"
        done
        return
    fi
    command -v nvidia-smi > /dev/null || { echo "gpu_checks: run is for the GPU machine (no nvidia-smi here)" >&2; exit 2; }
    export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
    log=${log:-./gpu-checks.log}
    echo "=== setup ($(date +%T))" | tee -a "$log"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        2>&1 | tail -3 | tee -a "$log"
    site=$(python3 -c "import site; print(site.getsitepackages()[0])")
    printf '%s\n%s\n' "$PWD/src" /tmp/site > "$site/zz_tierlm.pth"
    nvidia-smi -L | tee -a "$log"
    python3 -c "import torch, tierlm; print(torch.__version__, torch.cuda.get_device_name())" 2>&1 | tail -1 | tee -a "$log"
    for name in "$@"; do
        echo "=== $name ($(date +%T))" | tee -a "$log"
        check "$name" 2>&1 | tee -a "$log"
    done
    echo "=== finished ($(date +%T))" | tee -a "$log"
}

case "${1:-}" in
    wheels) wheels ;;
    run) shift
        if [ "${1:-}" = --dry-run ]; then DRY=1; shift; fi
        if [ $# -eq 0 ] && [ -n "${DRY:-}" ]; then  # a dry run names none: every check, here (~3 min on 2 cores)
            set -- card card_pack card_attention card_autotune card_profile rollouts rl mfu mfu_model mfu_batch profile \
                decode serve_cuda serve_cpu
        fi
        [ $# -gt 0 ] || set -- tests card
        run "$@" ;;
    *) echo "usage: bash scripts/gpu_checks.sh wheels|run (see the comment at its top)" >&2; exit 2 ;;
esac
