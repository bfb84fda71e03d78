"""The launch environment a process finds (parallel.distributed.check_launch_env): what cannot
work is one line before anything waits on it, not a CUDA or rendezvous traceback."""

from __future__ import annotations

import datetime
import os
import re
import time

import pytest
import torch.distributed as dist

from shardline.errors import ConfigError
from shardline.parallel.distributed import check_launch_env

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "5", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}


def test_a_torchrun_worker_on_a_node_with_enough_gpus_passes():
    check_launch_env(TORCHRUN, gpus=8)
    check_launch_env(TORCHRUN, gpus=0)  # not on CUDA: no GPUs to count
    check_launch_env({}, gpus=1)  # one process
    check_launch_env({"WORLD_SIZE": "1"}, gpus=1)


@pytest.mark.parametrize("env,gpus,says", [
    ({"WORLD_SIZE": "8"}, 8, "WORLD_SIZE=8 is set but RANK is not"),  # an sbatch export without torchrun
    ({**TORCHRUN, "MASTER_ADDR": None}, 8, "MASTER_ADDR not"),
    ({**TORCHRUN, "MASTER_ADDR": None, "MASTER_PORT": None}, 8, "MASTER_ADDR and MASTER_PORT not"),
    (TORCHRUN, 4, "LOCAL_RANK=5 but this node shows 4 GPU(s): start at most 4 ranks a node"),
    ({**TORCHRUN, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4, "(CUDA_VISIBLE_DEVICES=0,1,2,3)"),
])
def test_a_launch_that_cannot_work_is_one_line(env, gpus, says):
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(ConfigError) as caught:
        check_launch_env(env, gpus)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_cuda_n_past_the_machines_cards_is_one_line_for_one_process_torchrun_too(monkeypatch):
    """torchrun --nproc-per-node 1 keeps run.device=cuda:N (one rank picks its card): past the
    machine's cards it was a CUDA traceback at set_device."""
    import torch

    from shardline.parallel.distributed import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match=r"run.device='cuda:5' but this machine has 2 CUDA device\(s\)"):
        pick_device("cuda:5")
    monkeypatch.setenv("WORLD_SIZE", "2")  # ranks take their local rank's card: not refused here
    assert pick_device("cuda:5").index == 5


LEAVER = """
import sys, time
import torch.distributed as dist
from shardline.parallel.distributed import leave_together
rank, port, leaving = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
if str(rank) in leaving:  # (both leaving: a long limit, as a loaded machine may starve one for seconds)
    leave_together("shardline: halted: the line", 7, timeout_s=30 if len(leaving) == 2 else 3)
    sys.exit(0)
time.sleep(60)  # a peer that failed otherwise and never comes
"""


@pytest.mark.parametrize("leaving", ["0,1", "0", "1"])
def test_ranks_that_stopped_alike_leave_together_and_a_missing_peer_holds_none_long(leaving):
    """Both leave: each exits at once (0), the line printed once, by rank 0. A peer never comes:
    the rank waits at most its timeout, then exits with the code it was leaving with (7) instead
    of waiting for the group's; a rank 1 left alone prints the line itself (rank 0 may be gone
    before it spoke)."""
    import subprocess
    import sys
    import time

    from tests.ports import free_port

    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", LEAVER, str(r), port, leaving], stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    try:
        start = time.monotonic()
        leaver = procs[int(leaving[-1])]  # one that leaves
        code = leaver.wait(timeout=60)
        waited = time.monotonic() - start
        assert code == (0 if leaving == "0,1" else 7) and waited < 30, (code, waited)
        if leaving == "0,1":
            assert procs[0].wait(timeout=30) == 0
        said = [p.communicate(timeout=5)[1].count("shardline: halted: the line") if p.poll() is not None else 0
                for p in procs]
        assert said == {"0,1": [1, 0], "0": [1, 0], "1": [0, 1]}[leaving], said
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize("argv", [["train", "--train.bogus=1"], ["train", "--config", "a.toml", "--config", "b.toml"]])
def test_a_command_line_mistake_is_said_once_a_node(monkeypatch, capsys, argv):
    """Every rank reads the same command line and its node's files: under torchrun the node's
    first rank says the one line, the others exit with the same code in silence (it was
    printed once per rank)."""
    from shardline.cli import main

    import shardline.cli

    said, waits = {}, []
    monkeypatch.setattr(shardline.cli, "_let_the_first_say_it", lambda: waits.append(os.environ["LOCAL_RANK"]))
    monkeypatch.setenv("WORLD_SIZE", "2")
    for local_rank in ("1", "0"):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        said[local_rank] = (code, capsys.readouterr().err)
    assert said["1"] == (2, "") and said["0"][0] == 2 and said["0"][1].count("\n") == 1, said
    # the silent rank waits before it exits: torchrun stops the others at the first failure, and the
    # node's first rank, which says it, lost that race in 3 of 6 launches
    assert waits == ["1"]


def test_a_config_file_one_rank_cannot_read_is_said_by_that_rank(monkeypatch, capsys, tmp_path):
    """A read the storage refuses (EIO, a stale handle on one rank) may be that rank's alone: said.
    A missing file or a folder is the node's: said by its first rank."""
    import errno
    from pathlib import Path

    from shardline.cli import main

    import shardline.cli

    monkeypatch.setattr(shardline.cli, "SILENT_EXIT_DELAY_S", 0.0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    (tmp_path / "dir.toml").mkdir()
    assert main(["train", "--config", str(tmp_path / "dir.toml")]) == 2
    assert capsys.readouterr().err == ""
    config = tmp_path / "ok.toml"
    config.write_text("[train]\nsteps = 5\n")
    read = Path.read_text

    def stale(self, *args, **kwargs):
        if self == config:
            raise OSError(errno.ESTALE, "Stale file handle")
        return read(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", stale)
    assert main(["train", "--config", str(config)]) == 75  # (a stale handle may read later: try again)
    assert "ok.toml cannot be read: Stale file handle" in capsys.readouterr().err


def test_convert_says_an_export_warning_in_one_line(monkeypatch, capsys, tmp_path):
    """The routers' bias warning came as Python's two lines (a torch file path, then its source)."""
    import warnings

    import shardline.interop.convert as conversion
    from shardline.cli import main

    def converted(direction, src, dst, dtype, tokenizer, drop_router_bias):
        warnings.warn("the routers' balancing bias is not zero", stacklevel=3)
        (tmp_path / "hf").mkdir()
        return tmp_path / "hf"

    monkeypatch.setattr(conversion, "convert", converted)
    assert main(["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    assert err == "shardline: warning: the routers' balancing bias is not zero\n", err


def test_only_a_collective_whose_peer_went_away_is_said_in_one_line(monkeypatch, tmp_path):
    """lost_peer: a collective failing on gloo's reset connection or NCCL's remote error is a peer's
    doing (one line names the collective and the failure, gloo's source location dropped). A
    timeout (every waiting rank gets one: a hang's traceback shows where), an error in setting up
    the group, another error in a collective (a fault of the program) and any error outside one
    keep their traceback."""
    from shardline.parallel.distributed import lost_peer

    # Raised from a function of a file named as torch's c10d module, as torch's own would be.
    c10d = tmp_path / "distributed_c10d.py"
    c10d.write_text("def all_gather_into_tensor(e):\n    raise e\n\ndef init_process_group(e):\n    raise e\n")
    scope: dict = {}
    exec(compile(c10d.read_text(), str(c10d), "exec"), scope)

    def raised(text: str, error_type=RuntimeError, where="all_gather_into_tensor") -> BaseException:
        try:
            scope[where](error_type(text))
        except BaseException as e:
            return e

    text = ("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:101: "
            "Connection reset by peer. This is typically caused by a remote worker hanging")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert lost_peer(raised(text)) == "all_gather_into_tensor: Read error [127.0.0.1]:101: Connection reset by peer"
    assert lost_peer(raised("NCCL error: remote process exited or there was a network error", dist.DistBackendError))
    assert lost_peer(raised("[pair.cc:1] Timed out waiting 1800000ms for recv operation to complete")) is None
    assert lost_peer(raised("Tensors must be the same size: [4] vs [8]")) is None
    assert lost_peer(raised(text, where="init_process_group")) is None
    assert lost_peer(RuntimeError(text)) is None  # not raised in a collective
    assert lost_peer(raised(text, ValueError)) is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert lost_peer(raised(text)) is None


# ---- srun's tasks as the ranks (parallel/slurm.py) ----------------------------------------------
SRUN = {"SLURM_STEP_NUM_TASKS": "6", "SLURM_PROCID": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "3(x2)", "SLURM_STEP_NODELIST": "gpu-a[07-08]", "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0", "SLURM_TASK_PID": "777"}
TASK = 777  # this process's pid, as srun's task


def test_an_srun_task_gets_torchruns_variables_from_slurms():
    from shardline.parallel.slurm import PORT_BASE, PORT_SPAN, torchrun_env

    env = torchrun_env(SRUN, TASK)
    assert env == {"RANK": "4", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "1",
                   "MASTER_ADDR": "gpu-a07", "MASTER_PORT": env["MASTER_PORT"]}
    assert PORT_BASE <= int(env["MASTER_PORT"]) < PORT_BASE + PORT_SPAN
    ports = {torchrun_env({**SRUN, "SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step)}, TASK)["MASTER_PORT"]
             for job in (4242, 4243) for step in (0, 1, 31)}
    assert len(ports) == 6  # neighbouring jobs and steps apart
    given = torchrun_env({**SRUN, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29400"}, TASK)
    assert (given["MASTER_ADDR"], given["MASTER_PORT"]) == ("10.0.0.7", "29400")  # the user's
    # Ranks in node blocks whatever order srun numbered its tasks in (cyclic: task 3 is node 1's second)
    assert torchrun_env({**SRUN, "SLURM_PROCID": "3"}, TASK)["RANK"] == "4"
    # A wrapper that forks python below the task (apptainer, nsys), said to be the task's rank
    assert torchrun_env({**SRUN, "SHARDLINE_SRUN_RANK": "1"}, 12345)["RANK"] == "4"
    # nothing to translate: one task, a torchrun worker inside the step, one process on purpose, a batch shell, a
    # process below the task that another launcher ranked (deepspeed, an mpirun wrapper), a dry run below a task
    for env, pid, strict in (({**SRUN, "SLURM_STEP_NUM_TASKS": "1"}, TASK, True),
                             ({**SRUN, "TORCHELASTIC_RUN_ID": "x", **TORCHRUN}, 9, True),
                             ({**SRUN, "WORLD_SIZE": "1"}, TASK, True),
                             ({"SLURM_NTASKS": "8", "SLURM_PROCID": "0"}, TASK, True),
                             ({**SRUN, "RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1"}, 9, True),
                             ({**SRUN, "RANK": "4", "WORLD_SIZE": "6", "LOCAL_RANK": "1"}, TASK, True),  # exec'd
                             (SRUN, 12345, False)):
        assert torchrun_env(env, pid, strict) == {}
    check_launch_env({**SRUN, **torchrun_env(SRUN, TASK)}, gpus=8)  # what the launch check then sees passes
    with pytest.raises(ConfigError, match="LOCAL_RANK=1 but this node shows 1 GPU.*let every srun task see"):
        check_launch_env({**SRUN, **torchrun_env(SRUN, TASK), "CUDA_VISIBLE_DEVICES": "5"}, gpus=1)


@pytest.mark.parametrize("nodes, first", [("node1", "node1"), ("gpu[03-05,9],cpu1", "gpu03"),
                                          ("rack[2-3]-n[010-012]", "rack2-n010"), ("a,b[1-2]", "a"), ("", "")])
def test_the_first_host_of_a_slurm_host_list(nodes, first):
    from shardline.parallel.slurm import first_host

    assert first_host(nodes) == first


def test_tasks_per_node_from_slurms_list():
    from shardline.parallel.slurm import tasks_per_node

    assert tasks_per_node("4(x2),3") == [4, 4, 3] and tasks_per_node("2") == [2]
    assert tasks_per_node("") == tasks_per_node("weird") == []


@pytest.mark.parametrize("env, pid, says", [
    # `srun --pty bash`, then shardline in that shell: it would be rank 4 of 6 and wait for peers that never come
    (SRUN, 12345, "this process is not one of them (SLURM_TASK_PID=777, this one 12345: a shell or script below"),
    # an sbatch script's export reaching a script below the task: without LOCAL_RANK no launcher ranked it
    ({**SRUN, "RANK": "0", "WORLD_SIZE": "16"}, 12345, "this process is not one of them"),
    ({**SRUN, "SLURM_LOCALID": ""}, TASK, "SLURM_LOCALID or SLURM_NODEID is not set"),
    ({**SRUN, "WORLD_SIZE": "8"}, TASK, "WORLD_SIZE set in the environment of srun's tasks (an sbatch export?)"),
    ({**SRUN, "RANK": "4"}, TASK, "RANK set in the environment of srun's tasks"),
    # all three exported by the batch script, worked out once: every task would be rank 0
    ({**SRUN, "RANK": "0", "WORLD_SIZE": "6", "LOCAL_RANK": "0"}, TASK, "RANK and WORLD_SIZE set in the environment"),
    ({**SRUN, "SLURM_HET_SIZE": "2"}, TASK, "heterogeneous job (SLURM_HET_SIZE=2)"),
    ({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "4,2"}, TASK, "placed its 6 tasks 4,2 over the nodes"),  # uneven
    ({**SRUN, "SLURM_STEP_TASKS_PER_NODE": ""}, TASK, "in an unknown layout"),
])
def test_an_srun_task_that_cannot_be_a_rank_is_one_line(env, pid, says):
    from shardline.parallel.slurm import torchrun_env

    with pytest.raises(ConfigError, match=re.escape(says)) as refused:
        torchrun_env(env, pid)
    # what every task meets alike is said by each node's first; a process below a task says its own
    assert getattr(refused.value, "node_alike", False) == (pid == TASK)


def test_the_ranks_agree_on_a_fresh_key_prefix_though_a_dead_sets_keys_remain():
    """The set-up keys were named by the agent's restart count, which differs between a node's
    relaunched agent (0) and living ones: the ranks never met. Rank 0 now names each set of processes;
    a dead predecessor's keys (its asks, answers, acknowledgements) do not mislead the next set."""
    import threading

    import torch.distributed as dist

    from shardline.parallel.distributed import _fresh_prefix

    store, world = dist.HashStore(), 3

    def one_set() -> list[str]:
        got = [""] * world

        def rank(r):
            got[r] = _fresh_prefix(store, r, world)

        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (2, 1, 0)]  # (rank 0 last)
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads), "the set-up handshake hung"
        return got

    first = one_set()
    assert len(set(first)) == 1 and first[0]
    store.set("shardline/asks/1", "a-dead-rank-1s-token")  # (a rank that died after asking)
    second = one_set()
    assert len(set(second)) == 1 and second[0] != first[0]
    # A rank that never comes, or a rank 0 that never answers: one line each after the store's timeout
    from datetime import timedelta

    from shardline.errors import ShardlineError

    lonely = dist.HashStore()
    lonely.set_timeout(timedelta(seconds=1))
    with pytest.raises(ShardlineError, match=r"rank 0: 1 rank\(s\) did not take part in this job's set-up in "
                                             r"0:00:01 \(never asked: ranks \[1\]\)"):
        _fresh_prefix(lonely, 0, 2)
    with pytest.raises(ShardlineError, match="rank 1: rank 0 did not name this job's set-up keys in 0:00:01"):
        _fresh_prefix(lonely, 1, 2)


def test_a_rank_running_other_code_than_rank_0_is_one_line():
    """Node 1 on a 40-commit-older shardline: its first collective was not rank 0's, and both hung
    without a word for the process group's 30-minute timeout. Compared through the job's store, said
    by the rank that differs and by rank 0 (which waited out the set-up before); a wheel built without
    .git (no commit in its version) is compared by its number alone."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from shardline.errors import ShardlineError
    from shardline.parallel.distributed import same_code

    def job(codes: list[str | None], timeout: float = 10) -> dict[int, str]:
        store, said = dist.HashStore(), {}
        store.set_timeout(timedelta(seconds=timeout))

        def rank(r: int) -> None:
            time.sleep(0.3 * (r == len(codes) - 1 > 1))  # (the odd one last: the others were in, and went on)
            if codes[r] is None:  # (a node too old to take part, or a rank that failed)
                return
            try:
                same_code(store, r, len(codes), codes[r])
            except ShardlineError as e:
                said[r] = str(e)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(1, len(codes))]
        for t in threads:
            t.start()
        rank(0)
        for t in threads:
            t.join()
        return said

    ours, older = "shardline 0.1.0+git.aaaa with torch 2.13.0", "shardline 0.1.0+git.bbbb with torch 2.13.0"
    assert job([ours, ours, ours]) == {}
    assert job([ours, "shardline 0.1.0 with torch 2.13.0"]) == {}  # (a wheel built without .git)
    said = job([ours, ours, older])
    line = f"rank 2 runs {older}, rank 0 {ours}: every node of a job must run the same shardline and torch"
    assert said[0] == said[1] == said[2] and said[0].startswith(line)  # (each rank stops: none waits on the others)
    said = job([ours, ours, None], timeout=2)  # (rank 0 answers before the others' wait runs out: one line)
    assert said[0] == said[1] == "1 rank(s) did not compare their code with rank 0's in time (a node running a " \
                                 "shardline from before this check, or a rank that failed: its log says why)"


def test_a_port_another_process_holds_is_one_line(monkeypatch):
    """srun's port, derived from the job and step ids, met another job's on the node: a traceback."""
    import socket as sockets

    from shardline.parallel.rendezvous import meet

    with sockets.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        with pytest.raises(ConfigError, match=rf"rank 0 cannot serve the rendezvous at 127.0.0.1:{port}: another "
                                              "process holds that port"):
            meet(0, datetime.timedelta(seconds=5))


def test_a_rank_left_waiting_says_where_it_waits(monkeypatch, capsys):
    """A rank whose peers never came waited 30 minutes in silence (srun told of 2 tasks, 1 started)."""
    import socket as sockets

    from shardline.parallel import rendezvous

    with sockets.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # (closed below: nobody serves it)
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(rendezvous, "WAIT_SAID_S", 0.2)
    with pytest.raises(Exception):  # torch's own time-out, shortened here
        rendezvous.meet(0, datetime.timedelta(seconds=1.5))
    assert (f"shardline: rank 1 has waited 0.2 s to meet the job's 2 ranks at 127.0.0.1:{port} (rank 0's host): "
            "a rank that did not start") in capsys.readouterr().err
