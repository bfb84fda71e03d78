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

import contextlib
import os
import re
import zlib

from shardline.errors import ConfigError

# MASTER_PORT where the environment gives none: a hash of the job and step ids, so two steps of one
# allocation (or two jobs on a node) seldom meet; MASTER_PORT set by the user wins.
PORT_BASE, PORT_SPAN = 20000, 10000


@contextlib.contextmanager
def srun_ranks(environ, ranked: bool, strict: bool = True):
    """srun's tasks as the ranks of a command (`ranked`: one whose processes may be a job's ranks):
    torchrun's variables (torchrun_env) set in `environ` (os.environ) before anything reads them, for
    the command's length, its error handling included (an in-process caller of the command keeps
    its environment). Yields the one-line error of a task that cannot be a rank, else None."""
    try:
        added = torchrun_env(environ, os.getpid(), strict) if ranked else {}
    except ConfigError as e:
        yield e
        return
    before = {key: environ.get(key) for key in added}
    environ.update(added)
    try:
        yield None
    finally:
        for key, value in before.items():
            if value is None:
                environ.pop(key, None)
            else:
                environ[key] = value


def torchrun_env(env, pid: int, strict: bool = True) -> dict[str, str]:
    """torchrun's variables for srun's task `pid` (this process), {} where there is nothing to
    translate: not a step of several tasks, WORLD_SIZE=1 (one process inside a step of several, on
    purpose), or a process that a launcher or script ranked (torchrun's workers, or any process
    whose RANK, WORLD_SIZE and LOCAL_RANK are set). A process below a task that nothing ranked (a shell
    of `srun --pty bash`, a sweep's script: each would take the task's rank and wait for peers) is
    refused in one line, unless SHARDLINE_SRUN_RANK=1 says it is its task's rank (a wrapper that
    forks: apptainer, nsys), or not `strict` (a dry run, which starts no group: one process).
    Refused alike on every task: a RANK or WORLD_SIZE exported to the tasks, uneven task counts.
    Ranks are numbered in node blocks (node x tasks a node + local id), as torchrun numbers them,
    whatever order srun gave its tasks (cyclic, plane)."""
    tasks = env.get("SLURM_STEP_NUM_TASKS", "1")
    if not tasks.isdigit() or int(tasks) <= 1 or env.get("WORLD_SIZE") == "1" or "TORCHELASTIC_RUN_ID" in env:
        return {}
    task_pid = env.get("SLURM_TASK_PID", "")
    ranked = all(key in env for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if ranked and (task_pid != str(pid) or _agree(env, tasks)):  # ranked by a launcher below the task, or by a
        return {}  # script that set them from SLURM_PROCID and exec'd python (Megatron's way): theirs stand
    if task_pid != str(pid) and env.get("SHARDLINE_SRUN_RANK") != "1":  # below a task
        if not strict:
            return {}
        raise ConfigError(f"srun started {tasks} tasks, and this process is not one of them (SLURM_TASK_PID="
                          f"{task_pid or 'unset'}, this one {pid}: a shell or script below a task): run shardline as "
                          "srun's task itself (srun ... python -m shardline train ..., or a script that ends in "
                          "`exec python ...`), set SHARDLINE_SRUN_RANK=1 where a wrapper forks it (apptainer, "
                          "nsys), start one torchrun per node, or set WORLD_SIZE=1 for one process")
    exported = [key for key in ("RANK", "WORLD_SIZE") if key in env]
    if exported:
        raise _alike(f"{' and '.join(exported)} set in the environment of srun's tasks (an sbatch export?): srun "
                     f"starts the {tasks} ranks itself; unset {' and '.join(exported)}")
    local_id, node = env.get("SLURM_LOCALID", ""), env.get("SLURM_NODEID", "")
    if not (local_id.isdigit() and node.isdigit()):
        raise _alike(f"srun started {tasks} tasks but SLURM_LOCALID or SLURM_NODEID is not set: start one torchrun "
                     "per node instead (srun --ntasks-per-node=1 torchrun ...)")
    if env.get("SLURM_HET_SIZE", "1") not in ("", "1"):
        raise _alike("srun's tasks may span the components of a heterogeneous job (SLURM_HET_SIZE="
                     f"{env['SLURM_HET_SIZE']}): start one torchrun per node instead")
    spec = env.get("SLURM_STEP_TASKS_PER_NODE", "")
    counts = tasks_per_node(spec)
    if len(set(counts)) != 1 or sum(counts) != int(tasks) or int(node) >= len(counts):
        raise _alike(f"srun placed its {tasks} tasks {spec or 'in an unknown layout'} over the nodes: shardline "
                     "needs the same number on every node (srun --ntasks-per-node=N), or one torchrun per node")
    local = counts[0]
    job, step = env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "")
    port = PORT_BASE + zlib.crc32(f"{job}.{step}".encode()) % PORT_SPAN
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    return {"RANK": str(int(node) * local + int(local_id)), "WORLD_SIZE": tasks, "LOCAL_RANK": local_id,
            "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": node,
            "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodes) or "127.0.0.1",
            "MASTER_PORT": env.get("MASTER_PORT") or str(port)}


def _agree(env, tasks: str) -> bool:
    """RANK, WORLD_SIZE and LOCAL_RANK set on srun's task say what Slurm says of it (a batch script's
    export, worked out once for every task, does not)."""
    return (env["WORLD_SIZE"] == tasks and env["LOCAL_RANK"] == env.get("SLURM_LOCALID")
            and env["RANK"] == env.get("SLURM_PROCID"))


def _alike(line: str) -> ConfigError:
    """A refusal every task of the step meets alike: said by each node's first task (cli's node_alike)."""
    error = ConfigError(line)
    error.node_alike = True
    return error


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


def tasks_left_idle(env) -> int:
    """The task count of a Slurm job whose one process runs outside srun (a batch script's own shell,
    which shows SLURM_NTASKS but no step), else 0: `python -m shardline train` there trains alone
    while the job holds its other tasks' GPUs, where `srun python ...` was meant."""
    tasks = env.get("SLURM_NTASKS", "")
    if not tasks.isdigit() or int(tasks) <= 1 or any(k in env for k in (
            "SLURM_STEP_NUM_TASKS", "TORCHELASTIC_RUN_ID", "WORLD_SIZE")):
        return 0
    return int(tasks)
