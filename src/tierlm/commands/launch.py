"""`tierlm launch --slurm`: a Slurm batch script for a run on many machines, written from the run's config.

One task per node; each runs torchrun, which meets the others at a c10d rendezvous on the job's first node and
starts `--gpus-per-node` ranks (`--max-restarts` times over when one dies: the restarted group resumes from the
newest complete checkpoint by itself). The run directory is made absolute, on the storage the nodes share. Near the
time limit (SIGUSR1, `--signal=B:USR1@120`) or when preempted (SIGTERM) the script requeues the job and passes the
signal on: tierlm saves a checkpoint and stops, and the requeued job resumes from it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError

TIME_LIMIT = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$|^\d+$")


def slurm_script(
    stage: str,
    config_name: str | None,
    overrides: list[str],
    config: TierlmConfig,
    *,
    nodes: int,
    gpus_per_node: int,
    time_limit: str,
    partition: str | None = None,
    account: str | None = None,
    cpus_per_task: int | None = None,
    max_restarts: int = 3,
    port: int = 29500,
    python: str = "python",
) -> str:
    """The sbatch script of `tierlm STAGE --config CONFIG_NAME OVERRIDES` over `nodes` x `gpus_per_node` ranks
    (`gpus_per_node` 0: CPU ranks, one per node).

    >>> config = TierlmConfig.load("tiny_pretrain", ["infra.output_dir=/shared/runs/a"])
    >>> script = slurm_script("pretrain", "tiny_pretrain", [], config, nodes=2, gpus_per_node=8, time_limit="4:00:00")
    >>> [line for line in script.splitlines() if line.startswith("#SBATCH --nodes") or "--nproc_per_node" in line]
    ['#SBATCH --nodes=2', '  --nnodes 2 --nproc_per_node 8 \\\\']
    """
    if nodes < 1 or gpus_per_node < 0 or max_restarts < 0 or not 0 < port < 65536:
        raise ConfigError(
            f"tierlm launch --slurm needs --nodes >= 1, --gpus-per-node >= 0, --max-restarts >= 0 and a port in "
            f"1..65535, got {nodes}, {gpus_per_node}, {max_restarts}, {port}"
        )
    if not TIME_LIMIT.match(time_limit):
        raise ConfigError(f"--time {time_limit!r}: Slurm's time limits read MINUTES, HH:MM:SS or D-HH:MM:SS")
    output_dir = Path(config.infra.output_dir).absolute()
    ranks = gpus_per_node or 1
    sbatch = [
        f"--job-name=tierlm-{stage}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        f"--time={time_limit}",
        f"--output={output_dir}/slurm-%j.out",
        "--open-mode=append",
        "--requeue",
        "--signal=B:USR1@120",
    ]
    sbatch += [f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []
    sbatch += [f"--cpus-per-task={cpus_per_task}"] if cpus_per_task else []
    sbatch += [f"--partition={partition}"] if partition else []
    sbatch += [f"--account={account}"] if account else []
    command = ["-m", "tierlm", stage, *(["--config", config_name] if config_name else []), *overrides]
    command += [f"infra.output_dir={output_dir}"]
    threads = f"$(( ${{SLURM_CPUS_PER_TASK:-{ranks}}} / {ranks} ))"
    return "\n".join(
        [
            "#!/bin/bash",
            f"# tierlm {stage} on {nodes} node(s) x {ranks} rank(s), by `tierlm launch --slurm`; submit with sbatch",
            *(f"#SBATCH {line}" for line in sbatch),
            "set -euo pipefail",
            "",
            f"mkdir -p {shlex.quote(str(output_dir))}",
            'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f"export OMP_NUM_THREADS={threads}",
            "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # a fresh store per restart (a shared one can hang it)",
            "",
            "# Near the time limit or when preempted: requeue, and let tierlm save a checkpoint and stop.",
            "# shellcheck disable=SC2329  # called by the trap",
            "requeue() {",
            '  scontrol requeue "$SLURM_JOB_ID" || true',
            '  [ -n "${srun_pid:-}" ] && kill -TERM "$srun_pid" 2>/dev/null || true',
            "}",
            "trap requeue USR1 TERM",
            "",
            f"srun --kill-on-bad-exit=0 {shlex.quote(python)} -m torch.distributed.run \\",
            f"  --nnodes {nodes} --nproc_per_node {ranks} \\",
            f'  --rdzv-backend c10d --rdzv-endpoint "$head_node:{port}" --rdzv-id "$SLURM_JOB_ID" \\',
            f"  --max-restarts {max_restarts} \\",
            f"  {' '.join(shlex.quote(part) for part in command)} &",
            "srun_pid=$!",
            "status=0",
            'wait "$srun_pid" || status=$?',
            'while kill -0 "$srun_pid" 2>/dev/null; do  # a signal cut the wait short: tierlm is saving',
            "  status=0",
            '  wait "$srun_pid" || status=$?',
            "done",
            'exit "$status"',
            "",
        ]
    )
