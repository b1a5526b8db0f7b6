"""`tierlm launch --slurm`: a Slurm batch script for a run on many machines, written from the run's config.

One task per node; each runs torchrun, which meets the others at a c10d rendezvous on the job's first node and
starts `--gpus-per-node` ranks (`--max-restarts` times over when one dies: the restarted group resumes from the
newest complete checkpoint by itself). The run directory is made absolute, on the storage the nodes share. Near the
time limit (SIGUSR1, `--signal=B:USR1@120`) or when preempted (SIGTERM) the script requeues the job and passes the
signal on: tierlm saves a checkpoint and stops, and the requeued job resumes from it.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from tierlm.commands.cli import STAGE_COMMANDS
from tierlm.commands.options import Command, add_config_args, non_negative_int, positive_int
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError

TIME_LIMIT = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$|^\d+$")


def check_shape(scheduler: str, nodes: int, gpus_per_node: int, max_restarts: int, port: int) -> None:
    """The job's shape, as both schedulers' files need it."""
    if nodes < 1 or gpus_per_node < 0 or max_restarts < 0 or not 0 < port < 65536:
        raise ConfigError(
            f"tierlm launch --{scheduler} needs --nodes >= 1, --gpus-per-node >= 0, --max-restarts >= 0 and a port "
            f"in 1..65535, got {nodes}, {gpus_per_node}, {max_restarts}, {port}"
        )


def tierlm_arguments(stage: str, config_name: str | None, overrides: list[str], output_dir: Path) -> list[str]:
    """`tierlm`'s arguments on every node: the stage, the config, the overrides, the run directory (absolute)."""
    return [stage, *(["--config", config_name] if config_name else []), *overrides, f"infra.output_dir={output_dir}"]


SLURM_SCRIPT = """#!/bin/bash
# tierlm {stage} on {nodes} node(s) x {ranks} rank(s), by `tierlm launch --slurm`; submit with sbatch
{sbatch}
set -euo pipefail

mkdir -p {output_dir}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS={threads}
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # a fresh store per restart (a shared one can hang it)

# Near the time limit or when preempted: requeue, and let tierlm save a checkpoint and stop.
# shellcheck disable=SC2329  # called by the trap
requeue() {{
  scontrol requeue "$SLURM_JOB_ID" || true
  [ -n "${{srun_pid:-}}" ] && kill -TERM "$srun_pid" 2>/dev/null || true
}}
trap requeue USR1 TERM

srun --kill-on-bad-exit=0 {python} -m torch.distributed.run \\
  --nnodes {nodes} --nproc_per_node {ranks} \\
  --rdzv-backend c10d --rdzv-endpoint "$head_node:{port}" --rdzv-id "$SLURM_JOB_ID" \\
  --max-restarts {max_restarts} \\
  {command} &
srun_pid=$!
status=0
wait "$srun_pid" || status=$?
while kill -0 "$srun_pid" 2>/dev/null; do  # a signal cut the wait short: tierlm is saving
  status=0
  wait "$srun_pid" || status=$?
done
exit "$status"
"""
"""The batch script `slurm_script` fills in (`str.format`: a brace of the shell's is doubled)."""


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
    check_shape("slurm", nodes, gpus_per_node, max_restarts, port)
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
    command = ["-m", "tierlm", *tierlm_arguments(stage, config_name, overrides, output_dir)]
    return SLURM_SCRIPT.format(
        stage=stage,
        nodes=nodes,
        ranks=ranks,
        sbatch="\n".join(f"#SBATCH {line}" for line in sbatch),
        output_dir=shlex.quote(str(output_dir)),
        threads=f"$(( ${{SLURM_CPUS_PER_TASK:-{ranks}}} / {ranks} ))",
        python=shlex.quote(python),
        port=port,
        max_restarts=max_restarts,
        command=" ".join(shlex.quote(part) for part in command),
    )


TORCHX_COMPONENT = '''\
"""tierlm {stage} on {nodes} node(s) x {ranks} rank(s), a TorchX component by `tierlm launch --torchx`.

    torchx run -s kubernetes {{this file}}:train --image <an image with tierlm installed>
    torchx run -s local_cwd {{this file}}:train      # here, as processes (torchrun and tierlm on PATH)
"""

import torchx.specs as specs
from torchx.components.dist import ddp


def train(
    image: str = {image},
    nodes: int = {nodes},
    gpus_per_node: int = {gpus_per_node},
    cpus: int = {cpus},
    mem_mb: int = {mem_mb},
    max_retries: int = {max_restarts},
    rdzv_port: int = {port},
) -> specs.AppDef:
    """tierlm {stage}; each retry resumes from the run's newest checkpoint.

    Args:
        image: the container image (with tierlm and its dependencies)
        nodes: machines
        gpus_per_node: ranks per machine (0: one CPU rank)
        cpus: CPU cores per machine
        mem_mb: memory per machine, in MB
        max_retries: times the scheduler starts the job again after a failure
        rdzv_port: the rendezvous port on the first machine
    """
    threads = str(max(cpus // max(gpus_per_node, 1), 1))  # BLAS threads per rank
    return ddp(
        *{arguments},
        m="tierlm",
        image=image,
        name="tierlm-{stage}",
        cpu=cpus,
        gpu=gpus_per_node,
        memMB=mem_mb,
        j=f"{{nodes}}x{{max(gpus_per_node, 1)}}",
        max_retries=max_retries,
        rdzv_port=rdzv_port,
        env={{"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": threads}},
    )
'''
"""The component file `torchx_component` fills in (`str.format`: a brace of its own is doubled)."""


def torchx_component(
    stage: str,
    config_name: str | None,
    overrides: list[str],
    config: TierlmConfig,
    *,
    nodes: int,
    gpus_per_node: int,
    cpus_per_task: int | None = None,
    max_restarts: int = 3,
    port: int = 29500,
    image: str = "ghcr.io/pytorch/torchx:0.7.0",
) -> str:
    """A TorchX component file for the run (TorchX's `dist.ddp` under the hood): `torchx run -s <scheduler>
    FILE:train` submits it to Kubernetes, Slurm, AWS Batch, Ray or a local process (`local_cwd`) as TorchX supports.
    Each node runs torchrun (`nodes` x `gpus_per_node` ranks, a c10d rendezvous on the first replica); the scheduler
    retries the job `max_restarts` times, and each retry resumes from the newest checkpoint.

    >>> config = TierlmConfig.load("tiny_pretrain", ["infra.output_dir=/shared/runs/a"])
    >>> text = torchx_component("pretrain", "tiny_pretrain", [], config, nodes=2, gpus_per_node=8)
    >>> compile(text, "tierlm_torchx.py", "exec") is not None, "nodes: int = 2," in text, "per_node: int = 8," in text
    (True, True, True)
    """
    check_shape("torchx", nodes, gpus_per_node, max_restarts, port)
    arguments = tierlm_arguments(stage, config_name, overrides, Path(config.infra.output_dir).absolute())
    ranks = gpus_per_node or 1
    cpus = cpus_per_task or 2 * ranks
    return TORCHX_COMPONENT.format(
        stage=stage,
        nodes=nodes,
        ranks=ranks,
        image=repr(image),
        gpus_per_node=gpus_per_node,
        cpus=cpus,
        mem_mb=max(4096, 8192 * ranks),
        max_restarts=max_restarts,
        port=port,
        arguments=repr(arguments),
    )


# -- the command ----------------------------------------------------------------------------
def arguments(launch: argparse.ArgumentParser) -> None:
    scheduler = launch.add_mutually_exclusive_group(required=True)
    scheduler.add_argument("--slurm", action="store_true", help="an sbatch script")
    scheduler.add_argument(
        "--torchx", action="store_true", help="a TorchX component (Kubernetes and the other schedulers TorchX supports)"
    )
    launch.add_argument("stage", choices=sorted(STAGE_COMMANDS), help="the stage to run")
    add_config_args(launch, required=False)
    launch.add_argument("--nodes", type=positive_int, required=True, help="machines")
    launch.add_argument("--gpus-per-node", type=non_negative_int, default=0, help="ranks a machine (0: one CPU rank)")
    launch.add_argument("--time", default=None, help="Slurm: the job's time limit: MINUTES, HH:MM:SS or D-HH:MM:SS")
    launch.add_argument("--partition", default=None)
    launch.add_argument("--account", default=None)
    launch.add_argument("--cpus-per-task", type=positive_int, default=None, help="CPU cores per node")
    launch.add_argument("--max-restarts", type=non_negative_int, default=3, help="torchrun restarts after a rank dies")
    launch.add_argument("--port", type=int, default=29500, help="the rendezvous port on the first node")
    launch.add_argument("--python", default="python", help="the Python on the nodes (a venv's, on shared storage)")
    launch.add_argument("--out", default=None, help="write the script here (default: print it)")


def warn(line: str) -> None:
    sys.stderr.write(line + "\n")


def run(args: argparse.Namespace) -> None:
    config = TierlmConfig.load(args.config, args.overrides)  # a bad config is refused here, not on the cluster
    shape = dict(nodes=args.nodes, gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task)
    shape.update(max_restarts=args.max_restarts, port=args.port)
    if args.torchx:
        if args.time or args.partition or args.account:
            raise ConfigError("--time, --partition and --account are Slurm's: the TorchX scheduler takes its own")
        script = torchx_component(args.stage, args.config, args.overrides, config, **shape)
    else:
        if args.time is None:
            raise ConfigError("tierlm launch --slurm needs --time (the job's limit: MINUTES, HH:MM:SS or D-HH:MM:SS)")
        script = slurm_script(
            args.stage,
            args.config,
            args.overrides,
            config,
            time_limit=args.time,
            partition=args.partition,
            account=args.account,
            python=args.python,
            **shape,
        )
    if not config.training.save_steps:
        warn(
            "tierlm: warning: training.save_steps=0 saves only at the end: a restarted or requeued job starts over; "
            "set training.save_steps"
        )
    if args.out is None:
        print(script, end="")
        return
    out = Path(args.out)
    if out.exists():
        raise ConfigError(f"--out {out} exists; choose another file (nothing is overwritten)")
    out.write_text(script)
    out.chmod(0o755)
    how = f"torchx run -s <scheduler> {out}:train" if args.torchx else f"sbatch {out}"
    print(f"wrote {out}: submit it with `{how}`")


COMMAND = Command(arguments, run)
