#!/usr/bin/env bash
# The GPU checks a session runs when it is lent a GPU machine, in one short script (device time is scarce).
#
#   bash scripts/gpu_checks.sh wheels   # here (internet to the registries): tierlm's dependencies that a GPU
#                                       # image lacks, as wheels in .whl/ (pinned to this .venv's versions)
#   bash scripts/gpu_checks.sh run [CHECK ...]
#                                       # there, from the repository's root, carrying .whl and runs/tiny_sft
#                                       # (bash scripts/main.sh makes it): the checks named, each with its own time
#                                       # limit, into $OUT/log.txt (or ./gpu-checks.log without $OUT)
#
# The checks: tests (the CUDA-only tests, ~1 min), mfu (bench/gpu_mfu.py, eager then compiled), generation
# (bench/gpu_generation.py), decode (the batched decode step alone), serve_cuda and serve_cpu (`tierlm serve` under
# load on the GPU and on the machine's CPU, ~2 min each; bench/serve_load.py). None named: tests, mfu and generation,
# whose limits add to 470 s (a call may run 600 s and a session has 900, starts included); serve_cuda and serve_cpu
# in a second call if time is left (on the H100, 2026-11-26: tests 46 s, serve_cuda 118 s, serve_cpu 135 s). The figures go
# to docs/benchmarks.md with the card named.
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
    case "$1" in
        tests) timeout 150 python3 -m pytest -q -p no:cacheprovider "tests/test_distributed.py::test_fsdp_bf16_on_one_gpu" \
            "tests/test_primitives.py::test_fp8_trains_on_a_gpu" 2>&1 | tail -3 ;;
        mfu) timeout 200 python3 bench/gpu_mfu.py 2>&1 | grep -v Warning | tail -8 ;;
        generation) timeout 120 python3 bench/gpu_generation.py 2>&1 | grep -v Warning | tail -8 ;;
        decode) timeout 60 python3 bench/serve_load.py --checkpoint runs/tiny_sft --decode-step --device-type cuda 2>&1 \
            | tail -3 ;;
        serve_cuda) timeout 170 python3 bench/serve_load.py --checkpoint runs/tiny_sft --random-weights --requests 4 \
            --device-type cuda 2>&1 | grep -v Warn | tail -10 ;;
        serve_cpu) timeout 150 python3 bench/serve_load.py --checkpoint runs/tiny_sft --random-weights --requests 8 2>&1 \
            | grep -v Warn | tail -10 ;;
    esac
}

run() {
    local log=${OUT:+$OUT/log.txt} site name
    for name in "$@"; do
        case "$name" in
            tests | mfu | generation | decode | serve_cuda | serve_cpu) ;;
            *) echo "gpu_checks: no check named $name (tests, mfu, generation, decode, serve_cuda, serve_cpu)" >&2; exit 2 ;;
        esac
    done
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
    run) shift; [ $# -gt 0 ] || set -- tests mfu generation; run "$@" ;;
    *) echo "usage: bash scripts/gpu_checks.sh wheels|run (see the comment at its top)" >&2; exit 2 ;;
esac
