"""Measure a training command's peak memory, to check the planner against (`tierlm.plan.memory`).

    python -m tierlm.commands.probe pretrain --config tiny_pretrain training.num_train_steps=3
    torchrun --nproc-per-node 2 -m tierlm.commands.probe pretrain ...

Everything a run imports is imported first; then the resident set (RSS) is read as the baseline,
the command runs, and the probe prints one JSON line per rank: the baseline, the peak RSS (the
kernel's high-water mark, VmHWM), their difference (what the run grew by: what the planner
estimates), the peak CUDA memory when there is a GPU, and the run's own `memory_estimate.json`.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    import torch  # noqa: F401  (everything a run imports, before the baseline)
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import transformers  # noqa: F401
    from torch.distributed._tools import mem_tracker  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    import tierlm.commands.cli
    import tierlm.plan.memory  # noqa: F401
    import tierlm.stages  # noqa: F401
    from tierlm.metrics.memory import peak_rss_mb, rss_mb

    baseline = rss_mb()
    try:
        code = tierlm.commands.cli.main(argv) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    peak = peak_rss_mb()
    record = {
        "rank": int(os.environ.get("RANK", "0")),
        "exit_code": code,
        "baseline_mb": baseline,
        "peak_mb": peak,
        "growth_mb": peak - baseline,
    }
    if torch.cuda.is_available():
        record["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    output = next((a.split("=", 1)[1] for a in argv if a.startswith("infra.output_dir=")), None)
    if output and os.path.exists(os.path.join(output, "memory_estimate.json")):
        with open(os.path.join(output, "memory_estimate.json")) as f:
            record["estimate_mb"] = json.load(f)["total_bytes"] / 2**20
    sys.stdout.flush()  # one write of one line: the ranks of a torchrun job share the stream
    os.write(sys.stdout.fileno(), ("\nMEMORY_PROBE " + json.dumps(record) + "\n").encode())
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
