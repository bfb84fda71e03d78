"""A save that fails on one rank fails on every rank, at the same point; every rank resumes
from the checkpoint rank 0 chose.

With checkpoint.on_error=continue a rank whose part of a save hit a full disk goes on
training; if its peers did not learn of it they would wait in the save's next barrier
(a hang) or pair that barrier with one of the next save's. Two real gloo ranks: rank 1's
trainer file meets a full disk, and both must raise the same storage error, leave no
folder behind, and still be in step for the next collective. Then the ranks' choices of
checkpoint differ (a name cache that lags on shared storage): rank 0's wins, and a rank
that cannot see it stops both ranks with the same one-line error; a halt's question whether
its step is on disk gets rank 0's answer on both, and a resume refused by one rank's listing
alone (run.resume=never beside a checkpoint the other's does not show yet) is refused on both.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardline.config import load_config
from shardline.errors import CheckpointError, ConfigError, DataError, ShardlineError
from shardline.parallel.distributed import agreed
from shardline.resilience.checkpoint import Checkpointer, write_state
from shardline.resilience.recovery import agree_on_resume, rank0_decides, resume_path
from tests.distributed.harness import PARITY_OVERRIDES, gloo_rank, outcome, start_ranks
from tests.ports import free_port


class DiskFull:
    """Pickling it fails as writing to a full disk does."""

    def __reduce__(self):
        raise OSError(errno.ENOSPC, "No space left on device")


class Bug:
    """Pickling it fails as a bug would: not the storage's error."""

    def __reduce__(self):
        raise ValueError("not picklable")


def _two_saves(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # A short timeout: a rank left waiting fails the test in seconds instead of hanging it.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        torch.manual_seed(0)
        state = {"model": torch.nn.Linear(4, 4).state_dict()}
        outcomes = []
        # Step 2: rank 1's disk is full. Step 4: rank 0's disk is full and rank 1 meets a bug, which
        # stops every rank, rank 0 too (not on_error=continue's storage path).
        faults = {2: {1: DiskFull()}, 4: {0: DiskFull(), 1: Bug()}}
        for step in (1, 2, 3, 4):
            bad = faults.get(step, {}).get(rank)
            trainer_state = {"step": step} if bad is None else {"bad": bad}
            try:
                write_state(Path(root) / f"step-{step:06d}", step, state, trainer_state, {}, rank, rank == 0)
                outcomes.append("ok")
            except OSError as e:
                outcomes.append(f"OSError {e.errno}")
            except Exception as e:
                outcomes.append(type(e).__name__)
        flag = torch.tensor([rank])
        dist.all_reduce(flag)  # both ranks are still in step: this pairs with the peer's, not a save's
        older, newer = Path(root) / "step-000001", Path(root) / "step-000003"
        outcomes.append(agree_on_resume(newer if rank == 0 else older, rank, world).name)
        try:  # rank 1's storage does not show rank 0's choice yet
            agree_on_resume(newer, rank, world, sees=lambda path: rank == 0)
            outcomes.append("resumed")
        except CheckpointError as e:
            outcomes.append(str(e))
        # a halt asks whether its step is on disk: rank 0's answer (it sealed it) is every rank's
        outcomes.append(rank0_decides(rank == 0, rank, world))
        # run.resume=never and a checkpoint only rank 0's listing shows yet: the refusal is both ranks'
        cfg = load_config(None, ["run.resume=never", f"run.dir={root}/run"])
        seen = Path(root) / ("run" if rank == 0 else "lagging")
        try:
            agreed(lambda: resume_path(cfg, Checkpointer(seen, 3, rank, rank == 0)), world)
            outcomes.append("fresh start")
        except ConfigError as e:
            outcomes.append(str(e))

        def stale_handle():  # a storage error, not a ShardlineError, on rank 1 alone
            if rank == 1:
                raise OSError(116, "Stale file handle")
            return "listed"

        try:
            outcomes.append(agreed(stale_handle, world))
        except Exception as e:
            outcomes.append(f"{type(e).__name__}: {e}")

        def each_its_own():  # another cause on each rank: only rank 0 prints, so its line names both
            raise (ConfigError("bad key here") if rank == 0 else DataError("no data there"))

        try:
            agreed(each_its_own, world)
        except ShardlineError as e:
            outcomes.append(f"{type(e).__name__}: {e} (every_rank={e.every_rank})")
        (Path(root) / f"rank{rank}.json").write_text(json.dumps([*outcomes, int(flag)]))
    finally:
        dist.destroy_process_group()


def test_a_save_that_fails_on_one_rank_fails_on_both(tmp_path):
    (tmp_path / "run" / "checkpoints" / "step-000001").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-000001" / "manifest.json").write_text("{}")
    start_ranks(_two_saves, (2, free_port(), str(tmp_path)), nprocs=2)
    first = ["ok", f"OSError {errno.ENOSPC}", "ok"]
    blind = f"rank 0 resumes from {tmp_path / 'step-000003'}, which rank(s) [1] cannot see: run.dir must be on " \
            "storage every node shares"
    never = f"run.resume='never' but {tmp_path / 'run'} already holds checkpoints that a new run would overwrite; " \
            "choose another run.dir or remove them"
    stale = "OSError: [Errno 116] Stale file handle"
    both = ["ConfigError: bad key here; also on rank 1: no data there (every_rank=True)",
            "DataError: no data there; also on rank 0: bad key here (every_rank=True)"]
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)] == [
        [*first, "CheckpointError", "step-000003", blind, True, never, f"TryLater: on rank 1: {stale}", both[0],
         1],
        [*first, "ValueError", "step-000003", blind, True, f"on rank 0: {never}", f"TryLater: on rank 1: {stale}",
         both[1], 1]]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["run", "step-000001", "step-000003"]


def _start_refused_on_one_node(rank: int, world: int, port: int, nodes: tuple, name: str, root: str,
                               rank1_extra: tuple = (), every_extra: tuple = ()) -> None:
    """Each rank reads data.path=`name` relative to its own node's folder (`nodes`: node-local
    storage): rank 1's may lack the file or hold a shorter copy, or rank 1 reads another config:
    its start fails there alone, or it differs from its peers."""
    from shardline.trainer import Trainer

    os.chdir(nodes[rank])
    with gloo_rank(rank, world, port, timeout_s=30):
        extra = [*every_extra, *(rank1_extra if rank == 1 else ())]
        cfg = load_config(None, [*PARITY_OVERRIDES, f"data.path={name}", f"run.dir={root}/run", *extra])
        ended = outcome(lambda: (Trainer(cfg).build(), "built")[1])
        (Path(root) / f"start{rank}.json").write_text(json.dumps(ended))


def _two_nodes(tmp_path: Path, corpus: Path, node1_text: str | None) -> tuple:
    """Node folders for ranks 0 and 1: the corpus, and node 1's copy (None: none)."""
    node1 = tmp_path / "node1"
    node1.mkdir()
    if node1_text is not None:
        (node1 / corpus.name).write_text(node1_text)
    return str(corpus.parent), str(node1)


def test_a_start_refused_on_one_node_is_refused_on_every_rank(tmp_path, small_corpus):
    """The input checks run on every rank before the first collective; one node's refusal (a file
    only the others have) is every rank's, in one line, not a wait for the process group's timeout."""
    nodes = _two_nodes(tmp_path, small_corpus, None)
    start_ranks(_start_refused_on_one_node, (2, free_port(), nodes, small_corpus.name, str(tmp_path)), nprocs=2)
    outcomes = [json.loads((tmp_path / f"start{r}.json").read_text()) for r in range(2)]
    assert outcomes[1].startswith("DataError: ") and small_corpus.name in outcomes[1]
    assert outcomes[0] == f"DataError: on rank 1: {outcomes[1].removeprefix('DataError: ')}"
    assert not (tmp_path / "run").exists()


def test_ranks_that_read_other_data_are_refused_on_every_rank(tmp_path, small_corpus):
    """A shorter copy on one node (a file still being written, a lagging listing) opens fine there,
    and that rank would draw other batches than its peers: the ranks compare what they read."""
    lines = small_corpus.read_text().splitlines()
    nodes = _two_nodes(tmp_path, small_corpus, "\n".join(lines[: len(lines) * 3 // 4]) + "\n")
    start_ranks(_start_refused_on_one_node, (2, free_port(), nodes, small_corpus.name, str(tmp_path)), nprocs=2)
    outcomes = [json.loads((tmp_path / f"start{r}.json").read_text()) for r in range(2)]
    assert outcomes[0] == outcomes[1]
    assert re.fullmatch(r"DataError: rank 1 read other data than rank 0 \(\d+ training and \d+ held-out sequences, "
                        r"vocabulary \w+, tokens \w+; rank 0: .*\): the data must be the same files on every node .*",
                        outcomes[0])
    assert not (tmp_path / "run").exists()


def test_a_start_checkpoint_damaged_on_one_node_is_refused_on_every_rank(tmp_path, small_corpus):
    """model.init_from is verified on every rank before its load (a collective), the refusal agreed:
    one node's damaged copy stops every rank with one line, not a hang in the load."""
    import shutil

    from shardline.trainer import Trainer

    first = tmp_path / "first"
    Trainer(load_config(None, [*PARITY_OVERRIDES, f"data.path={small_corpus}", f"run.dir={first}",
                               "train.eval_interval=0"])).build().train()
    nodes = _two_nodes(tmp_path, small_corpus, small_corpus.read_text())
    for node in nodes[1], tmp_path / "node0":
        shutil.copytree(first, Path(node) / "first")
    start = "first/checkpoints/step-000003"
    shard = next((tmp_path / "node1" / start / "state").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    shutil.copy(small_corpus, tmp_path / "node0" / small_corpus.name)
    nodes = (str(tmp_path / "node0"), nodes[1])
    start_ranks(_start_refused_on_one_node, (2, free_port(), nodes, small_corpus.name, str(tmp_path), (),
                                             (f"model.init_from={start}",)), nprocs=2)
    outcomes = [json.loads((tmp_path / f"start{r}.json").read_text()) for r in range(2)]
    assert outcomes[1].startswith("CheckpointError: ") and "corrupted (sha256 mismatch)" in outcomes[1]
    assert outcomes[0] == f"CheckpointError: on rank 1: {outcomes[1].removeprefix('CheckpointError: ')}"
    assert not (tmp_path / "run").exists()


def test_ranks_that_read_another_config_are_refused_on_every_rank(tmp_path, small_corpus):
    """A relaunch reads the run dir's saved config.toml where it sees checkpoints: a node whose
    listing lags reads the defaults instead (another lr here; another layout would hang)."""
    nodes = _two_nodes(tmp_path, small_corpus, small_corpus.read_text())
    start_ranks(_start_refused_on_one_node, (2, free_port(), nodes, small_corpus.name, str(tmp_path),
                                             ("optim.lr=0.5", "train.seed=3")), nprocs=2)
    outcomes = [json.loads((tmp_path / f"start{r}.json").read_text()) for r in range(2)]
    assert outcomes[0] == outcomes[1]
    assert outcomes[0].startswith("ConfigError: rank 1 runs another config than rank 0 (train.seed, optim.lr "
                                  "differ): every rank must read the same config")
    assert not (tmp_path / "run").exists()
    # A path a node may give its own (its scratch folder; the data by another path) is no difference.
    start_ranks(_start_refused_on_one_node, (2, free_port(), nodes, small_corpus.name, str(tmp_path),
                                             (f"checkpoint.memory_dir={tmp_path}/node1-shm",
                                              f"data.path={nodes[1]}/{small_corpus.name}")), nprocs=2)
    assert [json.loads((tmp_path / f"start{r}.json").read_text()) for r in range(2)] == ["built", "built"]


def test_agreed_in_one_process_gives_a_storage_error_as_one_line():
    """As with ranks: a storage error is a one-line ShardlineError; a bug keeps its traceback."""
    from shardline.errors import ShardlineError

    def stale_handle():
        raise OSError(116, "Stale file handle")

    with pytest.raises(ShardlineError, match=r"^OSError: \[Errno 116\] Stale file handle$"):
        agreed(stale_handle, 1)
    with pytest.raises(KeyError):
        agreed(lambda: {}["missing"], 1)
    assert agreed(lambda: "listed", 1) == "listed"


def _slow_prune_on_rank0(rank: int, world: int, port: int, corpus: str, root: str) -> None:
    """Rank 0, the writer, prunes for longer than the watchdog's step limit after a save."""
    import time

    from shardline.trainer import Trainer

    with gloo_rank(rank, world, port, timeout_s=60):
        if rank == 0:
            prune, slowed = Checkpointer.prune, []

            def slow(self, written):
                if not slowed:
                    slowed.append(time.sleep(6.0))
                return prune(self, written)

            Checkpointer.prune = slow
        cfg = load_config(None, [*PARITY_OVERRIDES, "parallel.dp_shard=2", f"data.path={corpus}", f"run.dir={root}/run",
                                 "train.steps=3", "checkpoint.interval=2", "train.eval_interval=0",
                                 "watchdog.timeout_s=3", "watchdog.long_timeout_s=60"])
        Trainer(cfg).build().train()
        (Path(root) / f"done{rank}").write_text("trained")


def test_a_writer_pruning_after_a_save_is_no_hang(tmp_path, small_prepared):
    """After a synchronous save the writer alone prunes (an rmtree, minutes on slow storage): its
    peers left the save's long limit and waited for it under the step's, and named it hung."""
    with contextlib.suppress(Exception):  # a rank the watchdog ends (exit 4) fails the spawn
        start_ranks(_slow_prune_on_rank0, (2, free_port(), str(small_prepared), str(tmp_path)), nprocs=2)
    assert not [p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("hang-")]
    assert (tmp_path / "done0").is_file() and (tmp_path / "done1").is_file()


def _rollback_listing_fails_on_rank1(rank: int, world: int, port: int, corpus: str, root: str) -> None:
    """A NaN at step 4 rolls back; rank 1's listing of the checkpoints then fails (a stale handle)."""
    from shardline.trainer import Trainer

    with gloo_rank(rank, world, port, timeout_s=30):
        cfg = load_config(None, [*PARITY_OVERRIDES, "parallel.dp_shard=2", f"data.path={corpus}", f"run.dir={root}/run",
                                 "train.steps=6", "checkpoint.interval=3", "train.eval_interval=0",
                                 "anomaly.action=rollback", "anomaly.min_history=2", "faults.nan_step=4"])
        trainer = Trainer(cfg).build()
        if rank == 1:
            def stale_handle(*args, **kwargs):
                raise OSError(116, "Stale file handle")
            trainer.checkpointer.latest_valid = stale_handle
        ended = outcome(lambda: (trainer.train(), "trained")[1])
        (Path(root) / f"rollback{rank}.json").write_text(json.dumps(ended))


def test_a_rollback_whose_listing_fails_on_one_rank_stops_every_rank(tmp_path, small_prepared):
    """The rollback chooses its checkpoint as a start does, agreed: one node's storage error was
    that rank's exit and its peers' wait in the next collective."""
    start_ranks(_rollback_listing_fails_on_rank1, (2, free_port(), str(small_prepared), str(tmp_path)), nprocs=2)
    outcomes = [json.loads((tmp_path / f"rollback{r}.json").read_text()) for r in range(2)]
    assert outcomes == ["TryLater: on rank 1: OSError: [Errno 116] Stale file handle"] * 2, outcomes


def _zero1_save_before_any_update(rank: int, world: int, port: int, corpus: str, root: str) -> None:
    """ZeRO-1 on 2 ranks: step 1 is skipped (a NaN), saved, and resumed."""
    from shardline.trainer import Trainer

    with gloo_rank(rank, world, port, timeout_s=60):
        common = [*PARITY_OVERRIDES, "parallel.dp_shard=2", "parallel.zero=1", f"data.path={corpus}",
                  "train.eval_interval=0", "anomaly.action=skip", "train.stop_at_step=3"]
        saved = [*common, f"run.dir={root}/run", "checkpoint.interval=1"]
        Trainer(load_config(None, [*saved, "faults.nan_step=1", "train.stop_at_step=1"])).build().train()
        try:
            resumed = Trainer(load_config(None, saved)).build()
            resumed.train()
            ended = f"resumed at 1, trained to {resumed.step}"
        except Exception as e:  # DCP's "Missing key" for the states a save before any update lacked
            ended, resumed = f"{type(e).__name__}: {str(e)[:200]}", None
        # the same steps never saved: the save's states count no update (the first real one is the first)
        plain = Trainer(load_config(None, [*common, f"run.dir={root}/plain", "checkpoint.interval=0",
                                           "faults.nan_step=1"])).build()
        plain.train()
        if resumed is not None:
            same = all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), plain.model.parameters()))
            ended += ", as never saved" if same else ", unlike a run never saved"
        (Path(root) / f"zero1-{rank}.json").write_text(json.dumps(ended))


def test_a_zero1_save_before_any_update_resumes(tmp_path, small_prepared):
    """Only skipped steps yet (fp16's first overflows, an anomaly): ZeRO-1's optimizer held no
    state and saved none, and the resume, which loads every state in place, refused it."""
    start_ranks(_zero1_save_before_any_update, (2, free_port(), str(small_prepared), str(tmp_path)), nprocs=2)
    assert [json.loads((tmp_path / f"zero1-{r}.json").read_text()) for r in range(2)] == [
        "resumed at 1, trained to 3, as never saved"] * 2
