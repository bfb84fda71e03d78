"""`torchrun -m shardline train` as a user launches it, on 2 CPU processes with gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from shardline.parallel.distributed import PEER_GONE
from tests.conftest import tiny_overrides
from tests.ports import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    """`torchrun [--max-restarts=N] --nproc_per_node=nproc -m shardline train args...`"""
    launcher = [a for a in args if a.startswith("--max-restarts")]
    args = [a for a in args if a not in launcher]
    # c10d rendezvous, as the README recommends: a restarted round gets a fresh store, where
    # the static --master_port rendezvous would hand the new workers the dead ones' addresses.
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *launcher,
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "-m", "shardline", "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


def test_torchrun_impossible_degrees_fail_clearly(tmp_path, small_corpus):
    run = tmp_path / "run"
    out = torchrun(2, *[f"--{o}" for o in tiny_overrides(run, small_corpus, "parallel.tp=3")])
    assert out.returncode != 0
    assert ("does not divide the world size 2 (dp_shard=-1 takes what they leave); with 2 processes that product "
            "must be one of 1, 2") in out.stderr
    # refused alike on every rank: rank 0 says the one line; the only stack is torchrun's own report
    assert out.stderr.count("shardline: error: parallel degrees") == 1
    assert not [line for line in out.stderr.splitlines() if line.strip().startswith("File ") and "shardline" in line]
    assert not run.exists()


def test_a_dead_rank_leaves_its_peers_one_line_each_not_a_traceback(tmp_path, small_prepared):
    """A rank killed mid-run: its peer's collective fails; the peer says so in one line, naming the
    collective, instead of a traceback through FSDP and c10d, and torchrun's summary names the
    killed rank as the root cause. (torchrun stops the peer as soon as it sees the death: where
    that comes first, the peer says nothing at all, which is no traceback either.)"""
    run = tmp_path / "run"
    out = torchrun(2, *[f"--{o}" for o in tiny_overrides(run, small_prepared, "train.eval_interval=0",
                                                         "faults.kill_rank=1", "faults.kill_step=3")])
    assert out.returncode != 0 and "faults.kill_step=3 kills rank 1" in out.stderr, out.stderr[-3000:]
    assert "[rank0]: Traceback" not in out.stderr, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if line.startswith("shardline: rank 0 lost a peer: ")]
    stopped_first = "rank      : 0 (local_rank: 0)\n  exitcode  : -15" in out.stderr
    assert said or stopped_first, out.stderr[-3000:]
    assert not said or ("another rank failed or stopped answering first" in said[0]
                        and any(mark in said[0] for mark in PEER_GONE)), said
    root = out.stderr.split("Root Cause", 1)[-1]
    assert "rank      : 1 (local_rank: 1)" in root and "SIGKILL" in root, out.stderr[-3000:]


def test_torchrun_context_parallel_matches_one_process(tmp_path, small_prepared):
    # The user's path for long sequences: the same command with --parallel.cp=2 under
    # torchrun splits every sequence over the two ranks and trains like one process: its
    # losses, gradient norms and final weights. (A launched FSDP run's logging and checkpoint
    # files: tests/e2e/test_recovery.py.)
    from shardline.config import load_config
    from shardline.trainer import Trainer
    from tests.distributed.harness import assert_same_run

    # optim.eps as in the parity suite: at 1e-8 AdamW carries a sum-order difference in an
    # element with a near-zero gradient to 3e-5 (one element of 2048, seen here)
    short = ["train.eval_interval=0", "train.steps=6", "checkpoint.interval=6", "optim.eps=1e-6"]
    single, split = tmp_path / "single", tmp_path / "cp2"
    Trainer(load_config(None, tiny_overrides(single, small_prepared, *short))).build().train()
    out = torchrun(2, *[f"--{o}" for o in tiny_overrides(split, small_prepared, *short, "parallel.cp=2",
                                                         "parallel.dp_shard=1")])
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_run(split, single, evaluated=False)


def test_srun_tasks_train_as_ranks_like_one_process(tmp_path, small_prepared):
    """`srun --ntasks-per-node=2 python -m shardline train ...` without torchrun: each task takes
    its rank from Slurm's variables (parallel/slurm.py; rank 0's host from the step's node list),
    and FSDP 2 over them trains like one process. The two tasks are started here as srun would,
    with the variables it sets."""
    from shardline.config import load_config
    from shardline.trainer import Trainer
    from tests.distributed.harness import assert_same_run

    short = ["train.eval_interval=0", "train.steps=4", "checkpoint.interval=4", "optim.eps=1e-6"]
    single, tasks = tmp_path / "single", tmp_path / "srun"
    Trainer(load_config(None, tiny_overrides(single, small_prepared, *short))).build().train()
    slurm = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "0",
             "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "localhost", "MASTER_PORT": str(free_port())}
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    train = [sys.executable, "-m", "shardline", "train",
             *[f"--{o}" for o in tiny_overrides(tasks, small_prepared, *short, "parallel.dp_shard=2")]]
    cmd = ["sh", "-c", 'SLURM_TASK_PID=$$ exec "$@"', "task", *train]  # srun's task: its pid is SLURM_TASK_PID
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**base, **slurm, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r),
                                   "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    start = next(json.loads(line) for line in (tasks / "metrics.jsonl").read_text().splitlines()
                 if '"event": "start"' in line)
    assert start["world_size"] == 2, start
    assert_same_run(tasks, single, evaluated=False)
