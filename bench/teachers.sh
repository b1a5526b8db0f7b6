#!/usr/bin/env bash
# Multi-teacher on-policy distillation on the tiny task, split into two domains (addition, subtraction): one RL
# specialist per domain (60 steps of the tiny RL recipe on its domain's prompts alone), then the main job's SFT
# model distilled from them — each prompt routed to its domain's teacher (rl.teachers), against one teacher for
# every prompt — and every result scored on each domain's held-out problems. Needs the main job's runs/tiny_sft;
# CPU, about 10 minutes on 2 cores, one run at a time.
#
#   bash bench/teachers.sh            # then: cat runs/teachers/results.txt
set -euo pipefail
cd "$(dirname "$0")/.."
TIERLM=.venv/bin/tierlm
OUT=runs/teachers
DATA=$OUT/data
mkdir -p "$DATA"
.venv/bin/python - "$DATA" <<'EOF'
import json, sys
from pathlib import Path
from tierlm.builders.tasks import open_task

folder = Path(sys.argv[1])
for split, count in (("train", 20000), ("val", 1000)):
    task = open_task("synthetic:arithmetic", split, count, seed=42)
    files = {name: (folder / f"{name}_{split}.jsonl").open("w") for name in ("all", "add", "sub")}
    for i in range(count):
        example = task.example(i)
        domain = "add" if "+" in example.prompt else "sub"
        line = json.dumps({"question": example.prompt, "answer": str(example.reference), "domain": domain}) + "\n"
        files["all"].write(line)
        files[domain].write(line)
    for f in files.values():
        f.close()
EOF
RL=(--config configs/tiny_rl.yaml infra.progress_bar=false)
for domain in add sub; do  # the specialists
    [ -f "$OUT/${domain}_rl/model/model.safetensors" ] || $TIERLM rl "${RL[@]}" \
        data.dataset_name=$DATA/${domain}_train.jsonl data.eval_dataset_name=$DATA/${domain}_val.jsonl \
        infra.output_dir=$OUT/${domain}_rl | tail -1
done
ROUTED="rl.teachers={add: $OUT/add_rl, sub: $OUT/sub_rl}"
DISTILL=(data.dataset_name=$DATA/all_train.jsonl data.eval_dataset_name=$DATA/all_val.jsonl)
distill() {  # NAME OVERRIDES...: one distillation run (kept if it is there)
    local name=$1; shift
    [ -f "$OUT/$name/model/model.safetensors" ] || $TIERLM rl "${RL[@]}" "${DISTILL[@]}" "$@" \
        infra.output_dir=$OUT/$name | tail -1
}
distill routed rl.loss=distill "$ROUTED"
distill routed_topk rl.loss=distill_topk "$ROUTED"
distill only_add rl.loss=distill rl.teacher=$OUT/add_rl
distill only_sub rl.loss=distill rl.teacher=$OUT/sub_rl
{
    echo "model: held-out pass@1 on addition / subtraction (200 problems each, 4 samples)"
    for run in runs/tiny_sft $OUT/add_rl $OUT/sub_rl $OUT/routed $OUT/routed_topk $OUT/only_add $OUT/only_sub; do
        line="$run:"
        for domain in add sub; do
            figure=$($TIERLM eval --checkpoint $run --config configs/tiny_rl.yaml \
                data.eval_dataset_name=$DATA/${domain}_val.jsonl 2>/dev/null | grep -o 'pass@1 [0-9.]*' | cut -d' ' -f2)
            line="$line $figure"
        done
        steps=$([ -f $run/metrics.jsonl ] && .venv/bin/python -c 'import json, sys
train = [r for r in map(json.loads, open(sys.argv[1])) if r["type"] == "train"]
step = sum(r["time_generation_s"] + r["time_scoring_s"] + r["time_training_s"] for r in train) / len(train)
print("%.2f s/step" % step)' $run/metrics.jsonl || true)
        echo "$line  $steps"
    done
} | tee $OUT/results.txt
