"""The in-memory checkpoint tier: which snapshot a restarted job can rebuild, the XOR
parity and replica codes on real gloo ranks, and the files' integrity checks."""

from __future__ import annotations

import re
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardline.errors import CheckpointError
from shardline.resilience import redundancy
from shardline.resilience.memory_tier import MemoryTier, choose_step
from tests.distributed.harness import start_ranks
from tests.ports import free_port


def report(own=(), replica=(), parity=()):
    return {"own": list(own), "replica": list(replica), "parity": list(parity)}


def test_choose_step_rebuilds_a_lost_rank_from_its_peer_replica():
    # 4 ranks, 2 per node: rank r's replica is on rank r+2 (the other node).
    full = report([3, 6], [3, 6])
    reports = [full, full, full, report([3], [3, 6])]  # rank 3 lost step 6 (its node's memory)
    assert choose_step(reports, 4, 2, "replica") == (6, {0: "own", 1: "own", 2: "own", 3: "replica"})
    # Losing rank 3 and its replica holder (rank 1): step 6 is gone everywhere it matters.
    reports = [full, report([3], [3]), full, report([3], [3])]
    assert choose_step(reports, 4, 2, "replica")[0] == 3
    assert choose_step([report(), report()], 2, 2, "replica") == (None, {})


def test_choose_step_with_xor_tolerates_one_loss_per_group():
    full = report([6], parity=[6])
    # 4 ranks on 2 nodes: groups {0, 2} and {1, 3}; one loss in each group is fine.
    assert choose_step([report(), report(), full, full], 4, 2, "xor")[1] == {0: "parity", 1: "parity",
                                                                            2: "own", 3: "own"}
    # Two losses in one group are not.
    assert choose_step([report(), full, report(), full], 4, 2, "xor") == (None, {})
    # A survivor without its parity cannot help either.
    assert choose_step([report(), report([6]), report([6], parity=[6])], 3, 3, "xor") == (None, {})


def test_parity_groups_take_one_rank_per_node():
    assert redundancy.parity_groups(8, 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert redundancy.parity_groups(4, 4) == [[0, 1, 2, 3]]
    assert redundancy.replica_holder(1, 8, 4) == 5 and redundancy.replica_holder(3, 4, 4) == 0


def _codes_worker(rank: int, world: int, port: int, sizes: list[int], errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        bufs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
                for i, n in enumerate(sizes)]
        members = list(range(world))
        parity = redundancy.encode_parity(bufs[rank], sizes, members, rank, dist.group.WORLD)
        for lost in members:
            own = None if rank == lost else bufs[rank]
            got = redundancy.decode_lost(own, None if rank == lost else parity, sizes, members, lost, rank,
                                         dist.group.WORLD)
            if rank == lost and not torch.equal(got, bufs[lost]):
                errors.put(f"xor: rank {lost} rebuilt wrongly")
        held = redundancy.exchange_replicas(bufs[rank], sizes, rank, world, world, dist.group.WORLD)
        if not torch.equal(held, bufs[(rank - 1) % world]):
            errors.put(f"replica on rank {rank} is not rank {(rank - 1) % world}'s buffer")
    finally:
        dist.destroy_process_group()


def test_xor_parity_and_replicas_rebuild_any_one_rank_on_real_gloo_ranks():
    sizes = [1000, 37, 4096]  # uneven, not multiples of the word or the chunk
    errors = mp.get_context("spawn").SimpleQueue()
    start_ranks(_codes_worker, args=(3, free_port(), sizes, errors), nprocs=3)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, found


def _refused_worker(rank: int, world: int, port: int, root: str, errors) -> None:
    """Step 6's own write fails on rank 1 (xor), then its replica write on rank 0 (replica):
    a path the file cannot take, as a full /dev/shm refuses one."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model, opt = _tiny_state()
        for mode, kind, failing in (("xor", "own", 1), ("replica", "replica", 0)):
            tier = MemoryTier(Path(root) / mode, rank, world, world, mode, fingerprint="f")
            tier.save(3, model, opt, {"step": 3})
            if rank == failing:
                tier._path(kind, 6, ".bin.tmp").mkdir()
            stats = tier.save(6, model, opt, {"step": 6})
            held = sorted(p.name for p in tier.dir.iterdir() if p.suffix == ".json")
            expected = [f"{k}-000003.json" for k in ("own", "parity" if mode == "xor" else "replica")]
            if "error" not in stats or held != expected:
                errors.put(f"{mode} rank {rank}: {stats}, holds {held}")
            elif rank == failing and "Is a directory" not in stats["error"]:
                errors.put(f"{mode} rank {rank}: {stats['error']}")
            recovered = tier.recover()
            if recovered is None or recovered[0] != 3:
                errors.put(f"{mode} rank {rank} recovers {recovered and recovered[0]}")
    finally:
        dist.destroy_process_group()


def test_a_snapshot_write_refused_on_one_rank_is_dropped_on_all_and_the_last_one_kept(tmp_path):
    """A full /dev/shm on one rank ended the job (an exception there, its peers waiting in the
    exchange); now every rank agrees the step failed, drops its files, keeps the generation before."""
    errors = mp.get_context("spawn").SimpleQueue()
    start_ranks(_refused_worker, args=(2, free_port(), str(tmp_path), errors), nprocs=2)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, found


def _tiny_state():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_snapshot_round_trip_and_integrity(tmp_path):
    torch.manual_seed(0)
    model, opt = _tiny_state()
    tier = MemoryTier(tmp_path / "shm", 0, 1, 1, "replica", fingerprint="layout-a")
    tier.save(5, model, opt, {"step": 5, "note": "trainer state"})
    want = {k: v.clone() for k, v in model.state_dict().items()}
    moment = opt.state[model[0].weight]["exp_avg"].clone()

    other, other_opt = _tiny_state()  # different values, same shapes
    step, payload, sources = tier.recover()
    assert (step, sources) == (5, {0: "own"})
    assert MemoryTier.load_into(payload, other, other_opt) == {"step": 5, "note": "trainer state"}
    for k, v in other.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert torch.equal(other_opt.state[other[0].weight]["exp_avg"], moment)

    # Another layout never reads these local shards.
    assert MemoryTier(tmp_path / "shm", 0, 1, 1, "replica", fingerprint="layout-b").recover() is None
    # A flipped byte is caught by the CRC: the snapshot is not used.
    blob = tier.dir / "own-000005.bin"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert tier.recover() is None
    tier.clear()
    assert not (tmp_path / "shm").exists()


def test_new_snapshot_replaces_the_previous_generation(tmp_path):
    model, opt = _tiny_state()
    tier = MemoryTier(tmp_path / "shm", 0, 1, 1, "xor", fingerprint="x")
    tier.save(3, model, opt, {})
    tier.save(6, model, opt, {})
    assert sorted(p.name for p in tier.dir.iterdir()) == ["own-000006.bin", "own-000006.json"]


@pytest.mark.parametrize("key,value", [("checkpoint.memory_interval", -1), ("checkpoint.memory_redundancy", "raid6")])
def test_bad_memory_tier_settings_are_config_errors(tiny_config, key, value):
    from shardline.errors import ConfigError

    with pytest.raises(ConfigError, match=key):
        tiny_config(f"{key}={value}").check()


def test_snapshot_format_round_trips_every_kind_of_leaf(tmp_path):
    from shardline.resilience import snapshot_format

    tree = {"w": torch.randn(3, 5), "half": torch.randn(7).to(torch.bfloat16), "step": torch.tensor(4.0),
            "empty": torch.zeros(0, 3), "ints": torch.arange(5), "rng": (3, tuple(range(4)), None),
            "groups": [{"lr": 0.1, "params": ["a", "b"]}], "view": torch.arange(10.0)[2:6]}
    path = tmp_path / "snap.bin"
    snapshot_format.write(path, tree)
    back = snapshot_format.read(torch.from_numpy(__import__("numpy").fromfile(path, dtype="uint8")))
    assert back["rng"] == tree["rng"] and back["groups"] == tree["groups"]
    for key in ("w", "half", "step", "empty", "ints", "view"):
        assert back[key].dtype == tree[key].dtype and torch.equal(back[key], tree[key]), key


def test_snapshot_header_refuses_foreign_classes():
    import pickle

    from shardline.resilience import snapshot_format

    header = pickle.dumps((os.getcwd, []))  # a callable: loading it must not be allowed
    data = torch.tensor(list(len(header).to_bytes(8, "little")) + list(header), dtype=torch.uint8)
    with pytest.raises(pickle.UnpicklingError, match="not a shardline snapshot"):
        snapshot_format.read(data)


def test_background_snapshot_stalls_for_the_copy_and_is_recoverable(tmp_path):
    model, opt = _tiny_state()
    tier = MemoryTier(tmp_path / "shm", 0, 1, 1, "replica", fingerprint="x")
    stats = tier.save(7, model, opt, {"step": 7}, background=True)
    assert set(stats) == {"stall_s"}
    with torch.no_grad():
        model[0].weight.add_(1.0)  # training moves on: the snapshot must hold the old values
    done = tier.wait()
    assert [d["step"] for d in done] == [7] and done[0]["own_bytes"] > 0
    step, payload, _ = tier.recover()
    assert step == 7 and torch.equal(payload["state"]["model"]["0.weight"] + 1.0, model[0].weight)


def test_other_runs_snapshots_are_counted(tmp_path):
    model, opt = _tiny_state()
    crashed = MemoryTier(tmp_path / "base" / "run-a", 0, 1, 1, "replica", fingerprint="x")
    crashed.save(3, model, opt, {})
    mine = MemoryTier(tmp_path / "base" / "run-b", 0, 1, 1, "replica", fingerprint="x")
    assert mine.others_bytes() == sum(f.stat().st_size for f in crashed.dir.iterdir()) > 0
    assert crashed.others_bytes() == 0  # an empty folder of its own holds nothing


def _crashing(trainer, at_step: int):
    """The trainer's gradient computation fails when it reaches `at_step` (an OOM, a lost peer)."""
    compute = trainer.compute_gradients

    def crash():
        if trainer.step + 1 == at_step:
            raise RuntimeError("injected crash")
        return compute()

    trainer.compute_gradients = crash
    return trainer


def _held_steps(shm) -> set[int]:
    return {int(f.name.split("-")[1].split(".")[0]) for f in shm.rglob("own-*.bin")}


def _memory_run(tiny_config, tmp_path, *extra):
    from shardline.trainer import Trainer

    return Trainer(tiny_config("train.steps=8", "train.eval_interval=0", f"checkpoint.memory_dir={tmp_path / 'shm'}",
                               *extra, run_dir=tmp_path / "run")).build()


def test_a_run_dir_made_again_is_a_fresh_run_not_one_resumed_from_ram(tiny_config, tmp_path):
    """The snapshots are keyed by the run dir's path; a run dir deleted after a crash and made
    again by the same command must start from step 0, not from the crashed run's RAM."""
    import shutil

    memory = ["checkpoint.interval=0", "checkpoint.memory_interval=2"]
    with pytest.raises(RuntimeError, match="injected"):
        _crashing(_memory_run(tiny_config, tmp_path, *memory), at_step=6).train()
    assert _held_steps(tmp_path / "shm") == {4}
    assert _memory_run(tiny_config, tmp_path, *memory).step == 4  # the same run dir: resumed from RAM
    shutil.rmtree(tmp_path / "run")
    assert _memory_run(tiny_config, tmp_path, *memory).step == 0
    assert _held_steps(tmp_path / "shm") == set()


def test_a_memory_only_run_whose_snapshots_are_gone_is_refused_not_started_again(tiny_config, tmp_path):
    """A reboot empties RAM: the relaunch of a run kept in snapshots alone found nothing to resume and
    trained from step 0 over its history, without a word. Refused, as a run dir of damaged checkpoints is."""
    import shutil

    from shardline.errors import CheckpointError

    memory = ["checkpoint.interval=0", "checkpoint.memory_interval=2"]
    with pytest.raises(RuntimeError, match="injected"):
        _crashing(_memory_run(tiny_config, tmp_path, *memory), at_step=6).train()
    shutil.rmtree(tmp_path / "shm")
    with pytest.raises(CheckpointError, match=r"in-memory snapshots \(taken to step 4\), which no node holds now"):
        _memory_run(tiny_config, tmp_path, *memory)
    with pytest.raises(CheckpointError, match=r"which this launch does not read \(checkpoint.memory_interval=0"):
        _memory_run(tiny_config, tmp_path, "checkpoint.interval=0")  # (the tier off: not the RAM's fault)
    shutil.rmtree(tmp_path / "run")  # a run that crashed before its first snapshot was held starts again
    with pytest.raises(RuntimeError, match="injected"):
        _crashing(_memory_run(tiny_config, tmp_path, *memory), at_step=2).train()
    assert _memory_run(tiny_config, tmp_path, *memory).step == 0  # (no snapshot held: nothing of it to lose)
    assert (tmp_path / "run" / "metrics.jsonl").is_file()  # nothing of it touched


def test_a_run_id_that_cannot_be_read_stops_the_start_and_keeps_the_snapshots(tiny_config, tmp_path):
    """Only an absent (or damaged) id file means a new run; one that exists but cannot be read
    now (a stale NFS handle, EIO; here a folder in its place) once made the run new and
    cleared the RAM state newer than the disk."""
    from shardline.errors import CheckpointError
    from shardline.resilience.tiers import RUN_ID
    from shardline.trainer import Trainer

    memory = ["checkpoint.interval=0", "checkpoint.memory_interval=2"]
    with pytest.raises(RuntimeError, match="injected"):
        _crashing(_memory_run(tiny_config, tmp_path, *memory), at_step=6).train()
    id_file = tmp_path / "run" / RUN_ID
    saved = id_file.read_text()
    id_file.unlink()
    id_file.mkdir()
    with pytest.raises(CheckpointError, match=f"cannot read {id_file} .*the in-memory snapshots are kept"):
        _memory_run(tiny_config, tmp_path, *memory)
    assert _held_steps(tmp_path / "shm") == {4}
    id_file.rmdir()
    id_file.write_text(saved)
    assert _memory_run(tiny_config, tmp_path, *memory).step == 4
    # Nor may one it cannot write (a full or read-only run dir) raise on rank 0 alone: one line.
    other = tmp_path / "other"
    (other / f"{RUN_ID}.tmp").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=f"cannot write {other / RUN_ID} .*names the run"):
        Trainer(tiny_config(*memory, f"checkpoint.memory_dir={tmp_path / 'shm'}", run_dir=other)).build()


def test_a_refused_snapshot_is_an_event_and_training_goes_on(tiny_config, tmp_path):
    import json

    memory = ["checkpoint.interval=0", "checkpoint.memory_interval=2"]
    trainer = _memory_run(tiny_config, tmp_path, *memory)
    (trainer.guard.tiers.memory.dir / "own-000004.bin.tmp").mkdir(parents=True)  # a path its write cannot take
    trainer.train()
    lines = list(map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()))
    failed = [r for r in lines if r.get("event") == "memory_snapshot_failed"]
    assert trainer.step == 8 and [r["step"] for r in failed] == [4] and "Is a directory" in failed[0]["error"]
    assert [r["step"] for r in lines if r.get("event") == "memory_snapshot_held"] == [2, 6, 8]


def test_snapshots_newer_than_the_disk_checkpoint_resumed_are_dropped(tiny_config, tmp_path):
    """A restart under another layout resumes from disk (the snapshots hold the old layout's
    shards); the old history's newer snapshots go, so returning to the first layout later
    cannot resume that abandoned history."""
    tiers = ["checkpoint.interval=4", "checkpoint.memory_interval=3"]
    with pytest.raises(RuntimeError, match="injected"):
        _crashing(_memory_run(tiny_config, tmp_path, *tiers), at_step=7).train()
    assert _held_steps(tmp_path / "shm") == {6}  # and step 4 on disk
    other_layout = "parallel.pp_microbatches=4"  # part of the layout fingerprint, inert in one process
    restarted = _memory_run(tiny_config, tmp_path, *tiers, other_layout)
    assert restarted.step == 4 and _held_steps(tmp_path / "shm") == set()


def test_a_launch_with_the_tier_off_drops_the_snapshots_an_earlier_one_left(tiny_config, tmp_path):
    """Crashed with a snapshot newer than the disk, relaunched with checkpoint.memory_interval=0 (and
    another lr): that launch resumes the disk and trains another history; the snapshot it could not
    see stayed, and a third launch with the tier on resumed it, the abandoned history, in silence
    (its RAM held past the run's end too)."""
    from shardline.metrics import history

    tiers = ["checkpoint.interval=4", "checkpoint.memory_interval=3"]
    with pytest.raises(RuntimeError, match="injected"):
        _crashing(_memory_run(tiny_config, tmp_path, *tiers), at_step=7).train()
    assert _held_steps(tmp_path / "shm") == {6}  # and step 4 on disk
    off = _memory_run(tiny_config, tmp_path, "checkpoint.interval=4", "checkpoint.memory_interval=0",
                      "optim.lr=1e-3", "train.stop_at_step=5")
    assert off.step == 4 and _held_steps(tmp_path / "shm") == set()
    off.train()  # (saves step 5)
    dropped = [r for r in history(tmp_path / "run" / "metrics.jsonl") if r.get("event") == "memory_snapshots_dropped"]
    assert len(dropped) == 1 and dropped[0]["steps"] == [6] and dropped[0]["step"] == 4, dropped
    assert _memory_run(tiny_config, tmp_path, *tiers, "optim.lr=1e-3").step == 5  # the disk, not step 6's RAM


def test_a_halt_with_nothing_on_disk_keeps_the_ram_snapshot_for_the_rerun(tiny_config, tmp_path):
    from shardline.trainer.anomalies import AnomalyHalt

    memory = ["checkpoint.interval=0", "checkpoint.memory_interval=3", "anomaly.action=halt", "anomaly.min_history=3"]
    with pytest.raises(AnomalyHalt, match="nothing saved to disk .*; the in-memory snapshots stay for a rerun"):
        _memory_run(tiny_config, tmp_path, *memory, "faults.nan_step=5").train()
    assert _held_steps(tmp_path / "shm") == {3}
    assert _memory_run(tiny_config, tmp_path, *memory).step == 3


def test_snapshots_that_cannot_be_used_are_said_and_a_memory_only_run_is_not_started_over(tiny_config, tmp_path):
    """A memory-only run (no disk saves) whose snapshot is damaged, or of another layout (relaunched
    on more ranks), started again from step 0 in silence, its logged history superseded: refused
    now in one line naming the snapshot, which stays. With a disk checkpoint to fall back on, the
    run resumes from it and the passed-over snapshot is an invalid_checkpoint event."""
    import json

    memory = ["checkpoint.interval=0", "checkpoint.memory_interval=3"]
    with pytest.raises(RuntimeError, match="injected"):
        _crashing(_memory_run(tiny_config, tmp_path, *memory), at_step=8).train()
    assert _held_steps(tmp_path / "shm") == {6}
    with pytest.raises(CheckpointError, match=r"nothing to resume in .*: the in-memory snapshot of step 6 \(rank 0\) "
                                              r"is written under another layout .*relaunch with the layout"):
        _memory_run(tiny_config, tmp_path, *memory, "parallel.pp_microbatches=4")
    snapshot = next((tmp_path / "shm").rglob("own-000006.bin"))
    with open(snapshot, "r+b") as f:  # one byte flipped: the RAM went bad, or a write was torn
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=r"the in-memory snapshot of step 6 \(rank 0\) is damaged: its size or "
                                              r"CRC-32 is not the one recorded"):
        _memory_run(tiny_config, tmp_path, *memory)
    assert _held_steps(tmp_path / "shm") == {6}  # (kept for a look, or for the layout that wrote it)
    (tmp_path / "run" / "metrics.jsonl").unlink()  # (a fresh start there: run.resume=never refuses a run's records)
    with pytest.raises(RuntimeError, match="injected"):  # disk at 4, RAM at 6, damaged again below
        _crashing(_memory_run(tiny_config, tmp_path, "checkpoint.interval=4", "checkpoint.memory_interval=3",
                              "run.resume=never"), at_step=8).train()
    snapshot = next((tmp_path / "shm").rglob("own-000006.bin"))
    snapshot.write_bytes(snapshot.read_bytes()[:-10])
    resumed = _memory_run(tiny_config, tmp_path, "checkpoint.interval=4", "checkpoint.memory_interval=3")
    resumed.close()
    assert resumed.step == 4
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    said = [e["error"] for e in events if e.get("event") == "invalid_checkpoint"]
    assert said == ["the in-memory snapshot of step 6 (rank 0) is damaged: its size or CRC-32 is not the one recorded"]


def test_a_damaged_checkpoint_passed_over_for_ram_is_not_counted_by_pruning(tiny_config, tmp_path):
    """Disk 4 and 8 (keep 2), RAM 9; step 8 damaged: the resume from RAM left step 8 in place, and
    the next save's pruning counted it among the two kept and deleted the valid step 4. It stays in
    place (a start finding no valid state is still refused over it), not counted."""
    tiers = ["train.steps=12", "checkpoint.interval=4", "checkpoint.keep=2", "checkpoint.memory_interval=3"]
    with pytest.raises(RuntimeError, match="injected"):
        _crashing(_memory_run(tiny_config, tmp_path, *tiers), at_step=10).train()
    held = tmp_path / "run" / "checkpoints"
    (held / "step-000008" / "meta.json").write_text("{}")
    resumed = _memory_run(tiny_config, tmp_path, *tiers)
    assert resumed.step == 9
    resumed.train()
    assert sorted(p.name for p in held.iterdir()) == ["step-000004", "step-000008", "step-000012"]


def test_a_memory_dir_that_cannot_be_made_is_one_line(tiny_config, tmp_path):
    """checkpoint.memory_dir is a folder of each node's own: one that cannot be made there (a file
    in the way, no permission) stops the start in one line naming the key and the way out."""
    from shardline.errors import CheckpointError
    from shardline.trainer import Trainer

    (tmp_path / "shm").write_text("a file, not a folder")
    with pytest.raises(CheckpointError, match=r"checkpoint.memory_dir: cannot create .*shm.* on this node"):
        Trainer(tiny_config("checkpoint.memory_interval=2", f"checkpoint.memory_dir={tmp_path / 'shm'}")).build()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_run_whose_disk_checkpoints_are_all_damaged_resumes_from_a_newer_ram_snapshot(tiny_config, tmp_path):
    """No valid checkpoint on disk but a snapshot held in RAM (newer): auto resumes from it (a
    restart after a crash), and is refused only where no state at all is left."""
    from shardline.trainer import Trainer

    shm = f"checkpoint.memory_dir={tmp_path / 'shm'}"
    common = ["train.steps=12", "checkpoint.interval=6", "checkpoint.memory_interval=2", "train.eval_interval=0", shm]
    first = Trainer(tiny_config(*common, "train.stop_at_step=8")).build()
    save = first.tiers.save  # the last save refused (as under checkpoint.on_error=continue): RAM keeps step 8
    first.tiers.save = lambda step, *rest: None if step == 8 else save(step, *rest)
    first.train()
    held = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in held.iterdir()) == ["step-000006"]
    (held / "step-000006" / "meta.json").write_text("{}")
    # A launch that cannot use those snapshots (another layout) is refused, and leaves them for one that can.
    with pytest.raises(CheckpointError, match="holds checkpoints but none is valid"):
        Trainer(tiny_config(*common, "parallel.sequence_parallel=false")).build()
    resumed = Trainer(tiny_config(*common)).build()
    assert resumed.step == 8
    resumed.metrics.close()
    resumed.lock.release()
    shutil.rmtree(tmp_path / "shm")  # with no state left at all, the start is refused
    with pytest.raises(CheckpointError, match="holds checkpoints but none is valid"):
        Trainer(tiny_config(*common)).build()


def test_a_memory_only_run_stopped_at_a_step_goes_on_from_ram(tiny_config, tmp_path):
    """checkpoint.interval=0: a launch ending at train.stop_at_step freed its snapshots as if the
    run were over, so the next launch started again at step 0. It now snapshots the step it stops
    at and keeps it; the next launch goes on from there with the losses of one uninterrupted run."""
    from shardline.metrics import history
    from shardline.trainer import Trainer

    shm = f"checkpoint.memory_dir={tmp_path / 'shm'}"
    common = ["train.steps=8", "checkpoint.interval=0", "checkpoint.memory_interval=3", "train.eval_interval=0", shm]
    Trainer(tiny_config(*common, "train.stop_at_step=5")).build().train()
    account = json.loads((tmp_path / "run" / "progress.json").read_text())  # (a wrapper reads it)
    assert account["finished"] is True and account["run_complete"] is False  # a planned stop: more to train
    resumed = Trainer(tiny_config(*common)).build()
    assert resumed.step == 5
    resumed.train()
    losses = {r["step"]: r["loss"] for r in history(tmp_path / "run") if r["kind"] == "train"}
    whole = tiny_config(*common, f"run.dir={tmp_path / 'whole'}", f"checkpoint.memory_dir={tmp_path / 'shm2'}")
    Trainer(whole).build().train()
    assert losses == {r["step"]: r["loss"] for r in history(tmp_path / "whole") if r["kind"] == "train"}
    assert json.loads((tmp_path / "run" / "progress.json").read_text())["run_complete"] is True
    assert not any((tmp_path / "shm").rglob("*.bin"))  # the run over: its RAM given back


def test_the_snapshots_of_ranks_a_shrunk_job_no_longer_has_are_dropped(tmp_path):
    """2 ranks killed at step 7, resumed on 1: rank 1's folder (its own and its peer's replica, 60 MB
    in a walkthrough) stayed in RAM for good, since only a rank's own folder was ever cleared."""
    root = tmp_path / "shm"
    gone = MemoryTier.rank_dir(root, 1)
    gone.mkdir(parents=True)
    (gone / "own-000007.bin").write_bytes(b"x" * 64)
    (root / "rankings").mkdir()  # (not a rank's folder: left alone)
    tier = MemoryTier(root, 0, 1, 1, "replica", fingerprint="f")
    tier.discard_after(4)  # the resume's: a history the run left
    assert not gone.exists() and tier.dir.is_dir() and (root / "rankings").is_dir()
    gone.mkdir()
    MemoryTier.rank_dir(root, 0).mkdir(exist_ok=True)
    tier.clear()  # the run's end: every snapshot folder of the run on this node goes
    assert not gone.exists() and not tier.dir.exists() and (root / "rankings").is_dir()


def test_a_planted_link_or_another_users_folder_under_the_memory_dir_is_refused(tiny_config, tmp_path):
    """The snapshots' folders have names anyone can work out (/dev/shm/shardline-<user>/<hash>/rankN):
    a link planted as rank0 had a run remove files of the linked folder as old snapshots and write
    its state there. A link, or a folder of another user's, is refused in one line; nothing in the
    linked folder is touched."""
    import os

    from shardline.errors import CheckpointError
    from shardline.resilience.memory_tier import run_root
    from shardline.trainer import Trainer

    shm, victim = tmp_path / "shm", tmp_path / "victim"
    victim.mkdir()
    (victim / "report-1.txt").write_text("kept")
    root = run_root(tmp_path / "run", str(shm))
    root.mkdir(parents=True)
    (root / "rank0").symlink_to(victim)
    settings = ("checkpoint.memory_interval=1", f"checkpoint.memory_dir={shm}", "train.steps=2")
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint.memory_dir: {root / 'rank0'} is a symbolic "
                                                        "link, not a folder of this user's own")):
        Trainer(tiny_config(*settings)).build()
    assert [p.name for p in victim.iterdir()] == ["report-1.txt"]
    (root / "rank0").unlink()
    if os.getuid() == 0:  # (only root can give a folder to another user)
        os.chown(root, 4242, 4242)
        with pytest.raises(CheckpointError, match=re.escape(f"{root} is another user's (uid 4242)")):
            Trainer(tiny_config(*settings)).build()
        os.chown(root, 0, 0)
    Trainer(tiny_config(*settings)).build().train()  # its own folders: as before
    from shardline.resilience.own_folder import make_own

    (tmp_path / "shared" / "a").mkdir(parents=True, mode=0o755)  # (an earlier version's, open to all)
    make_own(tmp_path / "shared" / "a" / "b", tmp_path, "checkpoint.memory_dir", "")  # made private
    folders = (tmp_path / "shared", tmp_path / "shared" / "a", tmp_path / "shared" / "a" / "b")
    assert {oct(p.stat().st_mode & 0o777) for p in folders} == {"0o700"}


def test_the_snapshot_folders_made_again_after_a_fresh_runs_clear_stay_private(tiny_config, tmp_path):
    """A fresh run clears the tier's folders after making them; its first snapshot made them again with
    the umask's 0755 (and followed whatever another user had put there), and a memory_dir the user
    named was removed as an empty parent."""
    from shardline.trainer import Trainer

    shm = tmp_path / "shm"
    shm.mkdir()
    trainer = Trainer(tiny_config("checkpoint.memory_interval=1", f"checkpoint.memory_dir={shm}",
                                  "train.steps=2", "checkpoint.interval=0")).build()
    tier = trainer.tiers.memory
    tier.clear()
    assert shm.is_dir() and not tier.root.exists()  # (the user's folder stays)
    trainer.step = 1
    trainer.snapshot_to_memory()
    tier.wait()
    assert {oct(p.stat().st_mode & 0o777) for p in (tier.root, tier.dir)} == {"0o700"}
    trainer.close()


def test_an_async_snapshot_a_reboot_cut_before_its_held_record_still_counts(tmp_path):
    """Under memory_mode=async a snapshot's `memory_snapshot_held` is logged as the next one starts: a reboot
    before that left only `memory_snapshot`, and counting held ones alone let that run start again from 0."""
    import json

    from shardline.resilience.recovery import snapshots_gone

    def log(*records):
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"kind": "event", "time": 0.0, **r}) + "\n"
                                                        for r in records))

    log({"event": "start", "step": 0}, {"event": "memory_snapshot", "step": 500})
    assert snapshots_gone(tmp_path) == 500
    log({"event": "start", "step": 0}, {"event": "memory_snapshot", "step": 500},
        {"event": "memory_snapshot_failed", "step": 500})  # (/dev/shm full: nothing held)
    assert snapshots_gone(tmp_path) == 0
    log({"event": "start", "step": 0}, {"event": "memory_snapshot", "step": 500},
        {"event": "memory_snapshot_failed", "step": 500}, {"event": "memory_snapshot", "step": 500})  # (taken again)
    assert snapshots_gone(tmp_path) == 500
