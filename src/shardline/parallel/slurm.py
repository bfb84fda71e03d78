"""Ranks started by Slurm's srun, one task a rank, without torchrun.

`srun --ntasks-per-node=8 python -m shardline train ...` starts every rank itself, as
Megatron-LM and NeMo jobs are often launched. The rest of shardline reads torchrun's
variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a
task of such a step gets them from its Slurm variables once, as the command starts
(`torchrun_env`). Only a job step srun started counts (SLURM_STEP_NUM_TASKS): a batch
script's own shell also shows SLURM_NTASKS and SLURM_PROCID=0, and a run started there
directly is one process.
"""

from __future__ import annotations

import re

from shardline.errors import ConfigError

# MASTER_PORT where the environment gives none: one per job step, so two steps of one allocation
# (or two jobs on a node) seldom meet; MASTER_PORT set by the user wins.
PORT_BASE, PORT_SPAN = 20000, 10000


def torchrun_env(env) -> dict[str, str]:
    """torchrun's variables for this srun task, {} where there is nothing to translate: not a step
    of several tasks, a torchrun worker (srun --ntasks-per-node=1 torchrun ...), or WORLD_SIZE=1 (one
    process inside a step of several, on purpose). A RANK or WORLD_SIZE in the environment (a batch
    script's export) that disagrees with Slurm's is one line; MASTER_ADDR and MASTER_PORT given win."""
    tasks = env.get("SLURM_STEP_NUM_TASKS", "1")
    if not tasks.isdigit() or int(tasks) <= 1 or env.get("WORLD_SIZE") == "1" or "TORCHELASTIC_RUN_ID" in env:
        return {}
    node = int(env.get("SLURM_NODEID", "0") or 0)
    ours = {"RANK": env.get("SLURM_PROCID", ""), "WORLD_SIZE": tasks, "LOCAL_RANK": env.get("SLURM_LOCALID", "")}
    if not ours["RANK"].isdigit() or not ours["LOCAL_RANK"].isdigit():
        raise ConfigError(f"srun started {tasks} tasks but SLURM_PROCID/SLURM_LOCALID are not set: start one torchrun "
                          "per node instead (srun --ntasks-per-node=1 torchrun --nproc_per_node=... -m shardline "
                          "train ...)")
    for key in ("RANK", "WORLD_SIZE"):
        if key in env and env[key] != ours[key]:
            raise ConfigError(f"{key}={env[key]} is set in the environment but srun started this task as "
                              f"{key}={ours[key]}: unset {key} (an sbatch export) and srun's tasks are the ranks")
    local = tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""), node)
    job, step = env.get("SLURM_JOB_ID", "0"), env.get("SLURM_STEP_ID", "0")
    port = PORT_BASE + (int(job) * 31 + int(step)) % PORT_SPAN if job.isdigit() and step.isdigit() else PORT_BASE
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    return {**ours, "LOCAL_WORLD_SIZE": str(local or int(tasks)), "GROUP_RANK": str(node),
            "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodes) or "127.0.0.1",
            "MASTER_PORT": env.get("MASTER_PORT") or str(port)}


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list ("gpu[03-05,9],cpu1" -> "gpu03"; "" for none): the one
    srun starts task 0 on, whose rank 0 serves the rendezvous."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first entry: up to a comma outside brackets
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = i
            break
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], nodelist[:end].strip())


def tasks_on_node(spec: str, node: int) -> int:
    """Tasks on node `node` of a Slurm tasks-per-node list ("4(x2),3" -> 4, 4, 3); 0 when not known."""
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return 0
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else 0
