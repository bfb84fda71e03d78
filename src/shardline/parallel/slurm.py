"""Ranks started by Slurm's srun, one task a rank, without torchrun.

`srun --ntasks-per-node=8 python -m shardline train ...` starts every rank itself, as
Megatron-LM and NeMo jobs are often launched. The rest of shardline reads torchrun's
variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a
task of such a step gets them from its Slurm variables once, as the command starts
(`torchrun_env`). Only srun's task process itself is a rank (its pid is SLURM_TASK_PID): a
batch script's own shell shows SLURM_NTASKS and SLURM_PROCID=0 but no step, and a process
below a task (an interactive `srun --pty bash`, a sweep's script) inherits the task's variables
without being a rank of its own.
"""

from __future__ import annotations

import re
import zlib

from shardline.errors import ConfigError

# MASTER_PORT where the environment gives none: a hash of the job and step ids, so two steps of one
# allocation (or two jobs on a node) seldom meet; MASTER_PORT set by the user wins.
PORT_BASE, PORT_SPAN = 20000, 10000


def torchrun_env(env, pid: int) -> dict[str, str]:
    """torchrun's variables for srun's task `pid` (this process), {} where there is nothing to
    translate: not a step of several tasks, WORLD_SIZE=1 (one process inside a step of several, on
    purpose), or a process below a task that another launcher ranked (torchrun's workers, or any
    that set both RANK and WORLD_SIZE). Refused in one line: a process below a task that nothing
    ranked (a shell of `srun --pty bash`, a sweep's script: every such process would be the task's
    rank and wait for peers), exports that disagree with srun's, and placements whose ranks are not
    in node blocks of one size (node-local groups and peer replicas assume torchrun's layout)."""
    tasks = env.get("SLURM_STEP_NUM_TASKS", "1")
    if not tasks.isdigit() or int(tasks) <= 1 or env.get("WORLD_SIZE") == "1" or "TORCHELASTIC_RUN_ID" in env:
        return {}
    task_pid = env.get("SLURM_TASK_PID", "")
    if task_pid != str(pid):  # below a task: ranked by its launcher, or not at all
        if "RANK" in env and "WORLD_SIZE" in env:
            return {}
        raise ConfigError(f"srun started {tasks} tasks, and this process is not one of them (SLURM_TASK_PID="
                          f"{task_pid or 'unset'}, this one {pid}: a shell or script below a task): run shardline as "
                          "srun's task itself (srun ... python -m shardline train ...), start one torchrun per node "
                          "(srun --ntasks-per-node=1 torchrun --nproc_per_node=... -m shardline train ...), or set "
                          "WORLD_SIZE=1 for one process")
    ours = {"RANK": env.get("SLURM_PROCID", ""), "WORLD_SIZE": tasks, "LOCAL_RANK": env.get("SLURM_LOCALID", "")}
    node = env.get("SLURM_NODEID", "")
    if not (ours["RANK"].isdigit() and ours["LOCAL_RANK"].isdigit() and node.isdigit()):
        raise ConfigError(f"srun started {tasks} tasks but SLURM_PROCID, SLURM_LOCALID or SLURM_NODEID is not set: "
                          "start one torchrun per node instead (srun --ntasks-per-node=1 torchrun ...)")
    if env.get("SLURM_HET_SIZE", "1") not in ("", "1"):
        raise ConfigError("srun's tasks span the components of a heterogeneous job (SLURM_HET_SIZE="
                          f"{env['SLURM_HET_SIZE']}): start one torchrun per node instead")
    for key in ("RANK", "WORLD_SIZE"):
        if key in env and env[key] != ours[key]:
            raise ConfigError(f"{key}={env[key]} is set in the environment but srun started this task as "
                              f"{key}={ours[key]}: unset {key} (an sbatch export) and srun's tasks are the ranks")
    spec = env.get("SLURM_STEP_TASKS_PER_NODE", "")
    counts = tasks_per_node(spec)
    local = counts[int(node)] if int(node) < len(counts) else 0
    if len(set(counts)) != 1 or not local or int(ours["RANK"]) != int(node) * local + int(ours["LOCAL_RANK"]):
        raise ConfigError(f"srun placed its {tasks} tasks {spec or 'in an unknown layout'} over the nodes, task "
                          f"{ours['RANK']} as local task {ours['LOCAL_RANK']} of node {node}: shardline needs the "
                          "same number of tasks on every node, in blocks (srun --ntasks-per-node=N "
                          "--distribution=block), or one torchrun per node")
    job, step = env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "")
    port = PORT_BASE + zlib.crc32(f"{job}.{step}".encode()) % PORT_SPAN
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    return {**ours, "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": node,
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


def tasks_per_node(spec: str) -> list[int]:
    """Each node's task count from a Slurm tasks-per-node list ("4(x2),3" -> [4, 4, 3]); [] when not
    read."""
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return []
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts
