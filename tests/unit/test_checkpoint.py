"""Checkpoints: atomic folders, manifests with checksums, fallback to the newest valid one."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from shardline.errors import CheckpointError, CheckpointUnreadable, ConfigError
from shardline.resilience.checkpoint import Checkpointer, step_of, verify
from shardline.resilience.recovery import memory_tier_resumable
from shardline.trainer import Trainer
from tests.conftest import resealed


@pytest.fixture
def trained(tiny_config, tmp_path):
    Trainer(tiny_config("train.steps=12")).build().train()  # checkpoints at 6 and 12
    return tmp_path / "run"


def test_manifest_lists_every_file_with_checksum(trained):
    ckpt = trained / "checkpoints" / "step-000012"
    manifest = verify(ckpt)
    assert manifest["step"] == 12
    files = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == files
    assert any(f.startswith("state/") for f in files) and "trainer/rank0.pt" in files


def test_corrupted_checkpoint_is_named_and_skipped(trained, tiny_config):
    shard = next((trained / "checkpoints" / "step-000012" / "state").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        verify(shard.parent.parent)
    trainer = Trainer(tiny_config("train.steps=12")).build()
    assert trainer.step == 6  # fell back to the previous valid checkpoint
    events = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    invalid = [e for e in events if e.get("event") == "invalid_checkpoint"]
    assert invalid and "step-000012" in invalid[-1]["error"]


def test_a_run_dir_whose_every_checkpoint_is_damaged_is_refused_not_trained_over(trained, tiny_config):
    """Auto-resume with no valid checkpoint left (both damaged) used to start at step 0 in the same
    run dir, set the damaged ones aside and train over the run's history, exiting 0."""
    for step in (6, 12):
        (trained / "checkpoints" / f"step-{step:06d}" / "meta.json").write_text("{}")
    before = (trained / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError, match=r"holds checkpoints but none is valid \(.*step-000012.*step-000006"):
        Trainer(tiny_config("train.steps=12")).build()
    assert (trained / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in (trained / "checkpoints").iterdir()) == ["step-000006", "step-000012"]


def test_truncated_and_unfinished_checkpoints_are_ignored(trained):
    ckpts = Checkpointer(trained, keep=3)
    (trained / "checkpoints" / "step-000018.tmp").mkdir()  # a save that died midway
    assert ckpts.latest_valid().name == "step-000012"
    trainer_file = trained / "checkpoints" / "step-000012" / "trainer" / "rank0.pt"
    trainer_file.write_bytes(trainer_file.read_bytes()[:10])
    with pytest.raises(CheckpointError, match="manifest says"):
        verify(trainer_file.parents[1])
    assert ckpts.latest_valid().name == "step-000006"
    (trained / "checkpoints" / "step-000006" / "manifest.json").write_text("{")
    assert ckpts.latest_valid() is None


def test_a_deleted_manifest_is_reported_like_a_truncated_file(trained, tiny_config):
    (trained / "checkpoints" / "step-000012" / "manifest.json").unlink()
    seen = []
    assert Checkpointer(trained, keep=3).latest_valid(lambda p, e: seen.append(str(e))).name == "step-000006"
    assert seen == [f"checkpoint {trained / 'checkpoints' / 'step-000012'} is incomplete: no manifest.json"]
    trainer = Trainer(tiny_config("train.steps=12")).build()
    assert trainer.step == 6
    events = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "invalid_checkpoint" and "no manifest.json" in e["error"] for e in events)


def test_checkpoint_of_another_model_is_refused(trained, tiny_config):
    """Named from the saved shape before the model is built, by the launch and the dry run; a
    load into another model (no meta to compare) still fails in one line."""
    from shardline.dry_run import dry_run
    from shardline.models.factory import build_model_on
    from shardline.models.llama import ModelArgs
    from shardline.resilience.checkpoint import load_weights

    shape = r"holds a model of another shape \(dim=64 -> 96, n_layers=2 -> 3, head_dim=16 -> 24\)"
    with pytest.raises(CheckpointError, match=shape):
        Trainer(tiny_config("train.steps=12", "model.dim=96", "model.n_layers=3")).build()
    with pytest.raises(CheckpointError, match=shape):
        dry_run(tiny_config("train.steps=12", "model.dim=96", "model.n_layers=3"), 1)
    Trainer(tiny_config("train.steps=12", "model.rope_theta=20000")).build()  # not the weights' shape
    other = build_model_on(ModelArgs(dim=96, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512), "cpu")
    with pytest.raises(CheckpointError, match="does not match this model"):
        load_weights(Checkpointer(trained, keep=3).latest_valid(), other)


def test_async_checkpoints_resume_exactly_and_log_their_stall_and_write(tiny_config, tmp_path):
    from tests.unit.test_trainer import train_losses

    full = Trainer(tiny_config("train.steps=12", run_dir=tmp_path / "sync")).build()
    full.train()
    first = Trainer(tiny_config("train.steps=12", "train.stop_at_step=6", "checkpoint.mode=async",
                                run_dir=tmp_path / "async")).build()
    first.train()
    Trainer(tiny_config("train.steps=12", "checkpoint.mode=async", run_dir=tmp_path / "async")).build().train()
    assert train_losses(tmp_path / "async") == train_losses(tmp_path / "sync")
    events = [json.loads(line) for line in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    saves = [e for e in events if e.get("event") == "checkpoint"]
    persisted = [e for e in events if e.get("event") == "checkpoint_persisted"]
    assert {e["step"] for e in saves} == {e["step"] for e in persisted} == {6, 12}
    # the training-visible stall and the background write are both logged (how they compare is
    # a speed question: benchmarks/checkpoint_stall.py measures it, side by side with sync saves)
    assert all(s["stall_s"] >= 0 and p["background_s"] >= 0 for s, p in zip(saves, persisted))
    assert all(s["on_disk"] is False for s in saves)  # the line as it starts is not a checkpoint yet


def test_an_async_save_is_said_on_disk_once_its_write_ends_not_at_the_next_save(tiny_config, tmp_path):
    """A crash between an async save's end and the next save left the log without its
    checkpoint_persisted (the checkpoint was sealed): the step after the write says it, once."""
    with Trainer(tiny_config("train.steps=4", "checkpoint.mode=async", "train.eval_interval=0",
                             run_dir=tmp_path / "run")).build() as trainer:
        trainer.save_checkpoint()
        trainer.tiers.saver._work._thread.join()  # (the write ended: the step's end asks without waiting)
        trainer.guard.end_step(0)
        said = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [e["step"] for e in said if e.get("event") == "checkpoint_persisted"] == [0]
        assert trainer.tiers.landed == 0  # (counted at the drain, where every rank counts alike)
        trainer.tiers.drain()
        assert trainer.tiers.landed == 1
    said = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in said if e.get("event") == "checkpoint_persisted"] == [0]  # (not twice)


def test_an_interrupted_prune_leaves_no_checkpoint_that_looks_complete(trained):
    ckpts = Checkpointer(trained, keep=1)
    half = trained / "checkpoints" / "step-000006.deleting"  # renamed, then Ctrl-C before the removal
    (trained / "checkpoints" / "step-000006").rename(half)
    assert [p.name for p in ckpts.list()] == ["step-000012"]
    assert ckpts.latest_valid().name == "step-000012"
    ckpts.prune()  # the next save's prune removes the leftover
    assert not half.exists() and [p.name for p in ckpts.list()] == ["step-000012"]


def test_a_prune_that_cannot_rename_or_repair_does_not_fail_the_save_it_follows(trained, monkeypatch):
    """Pruning runs on the writer alone after every rank agreed the save landed: raising there
    failed that rank only, while its peers went on into the next collective."""
    from pathlib import Path

    from shardline.errors import CheckpointUnreadable

    ckpts, rename = Checkpointer(trained, keep=1), Path.rename

    def moved_away(path, target):
        if path.name == "step-000006":
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return rename(path, target)

    def unreadable():
        raise CheckpointUnreadable("cannot read a seal's leftover")

    aside = trained / "checkpoints" / "step-000003.deleting"  # a seal's aside repair must check first
    aside.mkdir()
    monkeypatch.setattr(Path, "rename", moved_away)
    monkeypatch.setattr(ckpts, "repair_interrupted_seal", unreadable)
    ckpts.prune()
    assert [p.name for p in ckpts.list()] == ["step-000006", "step-000012"]  # left for the next prune
    assert aside.is_dir()  # unchecked, it may be its step's only copy
    monkeypatch.undo()

    def stale_handle():  # the listing itself refused: a save's peers wait for the writer's prune to end
        raise OSError(116, "Stale file handle")

    monkeypatch.setattr(ckpts, "list", stale_handle)
    ckpts.prune()
    monkeypatch.undo()
    ckpts.prune()
    assert [p.name for p in ckpts.list()] == ["step-000012"] and not aside.exists()


def test_the_manifest_covers_what_every_rank_wrote_not_only_what_the_writer_lists(trained):
    """On a shared file system the writer's listing of a folder other nodes wrote into may lag:
    what the ranks wrote comes from DCP's metadata and the world size, and a file not there (or
    short) as the writer sees it fails the save instead of being left out of the manifest."""
    from shardline.resilience.checkpoint import _wait_visible, _written

    ckpt = trained / "checkpoints" / "step-000012"
    written = _written(ckpt, trainer_ranks=1)
    listed = {f.relative_to(ckpt).as_posix() for f in ckpt.rglob("*") if f.is_file()}
    assert set(written) == {n for n in listed if n.startswith(("state/", "trainer/"))}
    assert all((ckpt / n).stat().st_size >= size for n, size in written.items())
    assert set(json.loads((ckpt / "manifest.json").read_text())["files"]) >= set(written)
    with pytest.raises(CheckpointError, match=r"trainer/rank1.pt \(of 1 file\(s\) other ranks wrote\) is not there"):
        _wait_visible(ckpt, _written(ckpt, trainer_ranks=2), wait_s=0.3)
    data = next(n for n in written if n.endswith(".distcp"))
    with pytest.raises(CheckpointError, match=f"{data} .* is not there, or short"):
        _wait_visible(ckpt, {**written, data: written[data] + 1}, wait_s=0.3)


def test_a_seal_that_cannot_see_a_ranks_file_fails_and_seals_nothing(trained, monkeypatch):
    from shardline.resilience import checkpoint

    tmp, final = trained / "checkpoints" / "step-000018.tmp", trained / "checkpoints" / "step-000018"
    shutil.copytree(trained / "checkpoints" / "step-000012", tmp)
    (tmp / "manifest.json").unlink()
    monkeypatch.setattr(checkpoint, "VISIBLE_WAIT_S", 0.3)
    with pytest.raises(CheckpointError, match="trainer/rank1.pt"):
        checkpoint._seal(tmp, final, 18, "full", {}, trainer_ranks=2)
    assert not final.exists() and not (tmp / "manifest.json").exists()
    checkpoint._seal(tmp, final, 18, "full", {}, trainer_ranks=1)
    assert verify(final)["step"] == 18


def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(trained, tiny_config):
    """Checkpoints after the resumed one are of a history the run leaves: moved (not deleted)
    where neither a later restart nor pruning finds them."""
    older = trained / "checkpoints" / "step-000006"
    trainer = Trainer(tiny_config("train.steps=12", f"run.resume={older}")).build()
    assert trainer.step == 6
    aside = trained / "checkpoints" / "set-aside" / "step-000012"
    assert verify(aside)["step"] == 12 and not (trained / "checkpoints" / "step-000012").exists()
    assert Checkpointer(trained, keep=3).latest_valid() == older
    events = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    (said,) = [e for e in events if e.get("event") == "checkpoints_set_aside"]
    assert said["moved"] == [str(aside)] and said["held"] == 1  # what set-aside holds in all: it only grows
    assert said["held_gib"] == pytest.approx(sum(f.stat().st_size for f in aside.rglob("*")) / 2**30, abs=1e-3)
    trainer.train()  # saves step 12 again, beside the one set aside
    assert [p.name for p in Checkpointer(trained, keep=3).list()] == ["step-000006", "step-000012"]
    assert aside.is_dir()


def test_a_restart_after_a_failed_first_restore_still_leaves_the_newer_history(trained, tiny_config, monkeypatch):
    """The first attempt of --resume PATH died while restoring (an OOM, a lost peer): the newer
    checkpoints were already set aside, so its restart resumes PATH, not the history it left."""
    older = trained / "checkpoints" / "step-000006"

    def dies(self, found):
        raise RuntimeError("injected: the restore died")

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "_restore", dies)
        with pytest.raises(RuntimeError, match="injected"):
            Trainer(tiny_config("train.steps=12", f"run.resume={older}")).build()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert Trainer(tiny_config("train.steps=12", f"run.resume={older}")).build().step == 6


def test_a_restarted_job_goes_on_from_its_newest_state_not_the_named_one(trained, tiny_config, monkeypatch):
    """torchrun --max-restarts and Slurm requeues rerun the first attempt's command line: its
    --resume PATH would take the job back there (and set aside what it trained since)."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    trainer = Trainer(tiny_config("train.steps=12", f"run.resume={trained / 'checkpoints' / 'step-000006'}")).build()
    assert trainer.step == 12 and not (trained / "checkpoints" / "set-aside").exists()


def test_a_restart_that_saved_nothing_newer_still_starts_from_the_named_checkpoint(trained, tiny_config, tmp_path,
                                                                                   monkeypatch):
    """Before its own first save, a restarted job (the first attempt's --resume PATH) goes back to
    PATH: not to step 0 in an empty run dir, nor to an older checkpoint the run dir held."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    named = trained / "checkpoints" / "step-000012"
    assert Trainer(tiny_config("train.steps=12", f"run.resume={named}", run_dir=tmp_path / "empty")).build().step == 12
    older = tmp_path / "older"
    shutil.copytree(trained / "checkpoints" / "step-000006", older / "checkpoints" / "step-000006")
    assert Trainer(tiny_config("train.steps=12", f"run.resume={named}", run_dir=older)).build().step == 12
    # The named one pruned since (keep < the saves after it): the job's own newest, not a config error.
    pruned = tmp_path / "pruned" / "step-000003"
    assert Trainer(tiny_config("train.steps=12", f"run.resume={pruned}", run_dir=older)).build().step == 6
    with pytest.raises(ConfigError, match=r"does not exist \(a checkpoint pruned by checkpoint.keep\?\)"):
        Trainer(tiny_config("train.steps=12", f"run.resume={pruned}", run_dir=tmp_path / "nothing")).build()
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="is not a checkpoint folder"):
        Trainer(tiny_config("train.steps=12", f"run.resume={a_file}", run_dir=tmp_path / "nothing")).build()
    with pytest.raises(ConfigError, match="run.resume='lastest' is not a checkpoint folder; valid: auto, latest"):
        Trainer(tiny_config("train.steps=12", "run.resume=lastest", run_dir=tmp_path / "nothing")).build()


def test_a_resume_folder_holding_no_checkpoint_is_one_line_before_the_run_dir(tiny_config, tmp_path, trained):
    """The folder of checkpoints, any other folder, or an unset variable (`--resume="$CKPT"`: the
    current directory) passed the check and failed only once the run dir was made."""
    (tmp_path / "empty").mkdir()
    for folder, says in [(trained / "checkpoints", r"is a folder of checkpoints; name one of them: --resume "
                                                   r".*checkpoints/step-000012$"),
                         (tmp_path / "empty", r"holds no checkpoint \(no manifest.json\)")]:
        with pytest.raises(ConfigError, match=says):
            Trainer(tiny_config(f"run.resume={folder}", run_dir=tmp_path / "new")).build()
    assert not (tmp_path / "new").exists()
    with pytest.raises(ConfigError, match="run.resume='' is invalid: one of auto, latest, never or a checkpoint"):
        Trainer(tiny_config("run.resume=", run_dir=tmp_path / "new"))


@pytest.mark.parametrize("resume, restart, expected", [("auto", "0", True), ("latest", "0", True),
                                                       ("never", "1", True), ("never", "0", False),
                                                       ("/ckpt/step-000006", "0", False),
                                                       ("/ckpt/step-000006", "1", True)])
def test_the_memory_tier_is_resumed_from_unless_the_run_leaves_its_history(resume, restart, expected, tiny_config,
                                                                           monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
    assert memory_tier_resumable(tiny_config(f"run.resume={resume}")) is expected


def test_an_error_after_an_async_save_began_still_lands_that_save(tiny_config, tmp_path):
    """One process: the save in flight is finished before the error ends the run (a daemon thread
    would die with it), and the run dir's lock is free for the rerun."""
    trainer = Trainer(tiny_config("train.steps=12", "checkpoint.mode=async", run_dir=tmp_path / "run")).build()
    compute = trainer.compute_gradients

    def fail_after_the_save():
        if trainer.step == 6:  # step 6's save was just handed to the background thread
            raise RuntimeError("CUDA out of memory (injected)")
        return compute()

    trainer.compute_gradients = fail_after_the_save
    with pytest.raises(RuntimeError, match="injected"):
        trainer.train()
    assert verify(tmp_path / "run" / "checkpoints" / "step-000006")["step"] == 6
    assert Trainer(tiny_config("train.steps=12", run_dir=tmp_path / "run")).build().step == 6


def test_a_second_save_of_a_step_replaces_the_first_and_leaves_nothing_behind(trained, tiny_config):
    """The first is renamed aside before the second takes its name (not deleted first, so a crash
    never falls in a whole rmtree with no complete folder of that step), then removed."""
    before = verify(trained / "checkpoints" / "step-000012")
    trainer = Trainer(tiny_config("train.steps=12")).build()
    assert trainer.step == 12 and trainer.save_checkpoint() == trained / "checkpoints" / "step-000012"
    assert verify(trained / "checkpoints" / "step-000012")["time"] > before["time"]
    assert sorted(p.name for p in (trained / "checkpoints").iterdir()) == ["step-000006", "step-000012"]


@pytest.mark.parametrize("new_one_sealed", [True, False])
def test_a_crash_between_a_second_saves_two_renames_loses_neither(trained, tiny_config, new_one_sealed):
    """Cut after the old folder went aside and before the new one took its name, only
    step-N.deleting and step-N.tmp are left: the next start puts back the new one when its
    manifest verifies, else the old one (before, keep=1 left nothing to resume, and --resume
    refused before the repair could run); the next prune removes the one not needed."""
    root = trained / "checkpoints"
    shutil.copytree(root / "step-000012", root / "step-000012.tmp")
    manifest = json.loads((root / "step-000012.tmp" / "manifest.json").read_text())
    (root / "step-000012.tmp" / "manifest.json").write_text(json.dumps({**manifest, "time": 1.0}))  # the new one
    if not new_one_sealed:
        (root / "step-000012.tmp" / "manifest.json").unlink()
    (root / "step-000012").rename(root / "step-000012.deleting")
    shutil.rmtree(root / "step-000006")  # keep=1: the only checkpoint is the one cut off
    trainer = Trainer(tiny_config("train.steps=12", "checkpoint.keep=1", "run.resume=latest")).build()
    assert trainer.step == 12 and (verify(root / "step-000012")["time"] == 1.0) == new_one_sealed
    events = [json.loads(line) for line in (trained / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["checkpoint"] for r in events if r.get("event") == "checkpoint_repaired"] == [str(root / "step-000012")]
    trainer.checkpointer.prune()
    assert sorted(p.name for p in root.iterdir()) == ["step-000012"] + (["step-000012.tmp"] * (not new_one_sealed))


def test_a_checkpoint_sealed_before_the_lock_was_taken_is_the_one_resumed(trained, tiny_config, tmp_path,
                                                                           monkeypatch):
    """The resume is chosen early (bad input fails before the run dir is touched); a run that still
    held the dir may seal a newer checkpoint meanwhile, even while the choice hashes the newest one:
    the choice is made again under the lock."""
    from shardline.trainer import state

    newest = trained / "checkpoints" / "step-000012"
    newest.rename(tmp_path / "sealing")
    choose = state.resume_path

    def the_other_run_seals_while_we_choose(cfg, checkpointer, **options):
        chosen = choose(cfg, checkpointer, **options)
        if (tmp_path / "sealing").exists():
            (tmp_path / "sealing").rename(newest)
        return chosen

    monkeypatch.setattr(state, "resume_path", the_other_run_seals_while_we_choose)
    trainer = Trainer(tiny_config("train.steps=12")).build()
    assert trainer.step == 12 and newest.is_dir()  # not step 6, with step 12 set aside


def test_a_resume_hashes_each_file_of_its_checkpoint_once(trained, tiny_config, monkeypatch):
    """Finding the newest valid checkpoint, choosing between tiers and loading each verified it
    again: every byte read two or three times at start-up. A file changed since is hashed again."""
    from shardline.resilience import checkpoint

    files = sorted(verify(trained / "checkpoints" / "step-000012")["files"])
    hashed = []
    sha256 = checkpoint._sha256
    monkeypatch.setattr(checkpoint, "_sha256", lambda f: hashed.append(f) or sha256(f))
    assert Trainer(tiny_config("train.steps=12")).build().step == 12
    assert sorted(f.relative_to(trained / "checkpoints" / "step-000012").as_posix() for f in hashed) == files
    ckpts = Checkpointer(trained, keep=3)
    ckpts.verify(trained / "checkpoints" / "step-000012")
    (trained / "checkpoints" / "step-000012" / "trainer" / "rank0.pt").write_bytes(b"changed")
    with pytest.raises(CheckpointError, match="rank0.pt is 7 bytes"):
        ckpts.verify(trained / "checkpoints" / "step-000012")


def test_an_unreadable_checkpoint_file_stops_the_resume_in_one_line(trained, monkeypatch):
    """EIO or a stale NFS handle while hashing is one line; the resume stops there instead of
    passing over it (to an older one, or to step 0 with the history set aside): a retry may read it."""
    import errno

    from shardline.resilience import checkpoint

    newest, sha256 = trained / "checkpoints" / "step-000012", checkpoint._sha256

    def failing_disk(f):
        if newest in f.parents:
            raise OSError(errno.EIO, "Input/output error")
        return sha256(f)

    monkeypatch.setattr(checkpoint, "_sha256", failing_disk)
    with pytest.raises(CheckpointError, match="cannot read .* \\(Input/output error\\)"):
        verify(newest)
    with pytest.raises(CheckpointError, match="the storage failed, so the run stops"):
        Checkpointer(trained, keep=3).latest_valid()


def test_checkpoints_order_by_step_past_six_digits(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (999_998, 999_999, 1_000_000):
        folder = root / f"step-{step:06d}"
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text(json.dumps({"step": step, "files": {}}))
    ckpts = Checkpointer(tmp_path, keep=2)
    assert [step_of(p) for p in ckpts.list()] == [999_998, 999_999, 1_000_000]
    assert ckpts.latest_valid().name == "step-1000000"
    ckpts.prune()
    assert [p.name for p in ckpts.list()] == ["step-999999", "step-1000000"]


@pytest.mark.parametrize("manifest", [b"\xff\xfe not text", b'{"files": {"state/x": {"sha256": "00"}}}',
                                      b'{"files": ["state/x"]}', b'{"files": {}}', b'{"step": "12", "files": {}}',
                                      b'{"step": 12, "kind": "fulm", "files": {}}'])  # (load said "weights only")
def test_a_damaged_manifest_makes_the_checkpoint_invalid_not_a_crash(trained, manifest):
    (trained / "checkpoints" / "step-000012" / "manifest.json").write_bytes(manifest)
    with pytest.raises(CheckpointError, match="malformed manifest.json"):
        verify(trained / "checkpoints" / "step-000012")
    assert Checkpointer(trained, keep=3).latest_valid().name == "step-000006"


@pytest.mark.parametrize("how", ["manifest edited", "folder renamed"])
def test_a_checkpoint_whose_name_and_manifest_disagree_is_passed_over_and_nothing_moved(trained, tiny_config, how):
    """step-000012 saying step 3 inside: the resume took its manifest's step (3) and set aside every
    folder named after it (6 too, the valid one), then failed to load the moved folder; a rerun
    started over at step 0. Now it is an invalid checkpoint: passed over and named; the valid one
    is resumed and stays, the invalid one is set aside as newer ones are."""
    import json

    held = trained / "checkpoints"
    if how == "manifest edited":
        manifest = json.loads((held / "step-000012" / "manifest.json").read_text())
        (held / "step-000012" / "manifest.json").write_text(json.dumps({**manifest, "step": 3}))
    else:
        (held / "step-000012").rename(held / "step-000020")
    trainer = Trainer(tiny_config("train.steps=12"))
    trainer.build().close()
    assert trainer.step == 6 and (held / "step-000006").is_dir()
    assert [p.name for p in (held / "set-aside").iterdir()] == ["step-000012" if how == "manifest edited" else
                                                                 "step-000020"]
    assert any("says step" in p for p in trainer._invalid_checkpoints)
    import shutil  # a folder of the user's own name (a date, a size: "1.5b") is no step's, whatever it holds

    shutil.copytree(held / "step-000006", trained / "1.5b")
    assert verify(trained / "1.5b")["step"] == 6


def test_a_prune_keeps_the_folder_just_written_beside_a_newer_one(trained):
    """An anomaly halt re-saves the older step it rolled back to; a newer folder that failed to
    verify (why the rollback went further back) ranked above it, and with keep=1 the re-save was
    the folder pruned: a halt that names a checkpoint it had just deleted."""
    import shutil

    root = trained / "checkpoints"
    shutil.copytree(root / "step-000012", root / "step-000018")  # newer, and
    (root / "step-000018" / "meta.json").write_text("{}")  # not what its manifest sealed
    ckpts = Checkpointer(trained, keep=1)
    ckpts.prune(root / "step-000012")
    assert [p.name for p in ckpts.list()] == ["step-000012", "step-000018"]
    ckpts.prune()  # an interval save's prune: the newest kept
    assert [p.name for p in ckpts.list()] == ["step-000018"]


def test_a_save_flushes_every_name_the_manifest_relies_on(tmp_path, monkeypatch):
    """Before the seal: each rank's trainer state (by its writer: the sealer's listing may not show
    it), the entries of the state and trainer folders (DCP renames its .metadata into place); a
    re-save of a step flushes both renames before the old copy is removed."""
    import torch

    from shardline.resilience import checkpoint

    flushed, rmtree = [], shutil.rmtree
    monkeypatch.setattr(checkpoint, "_fsync", lambda path: flushed.append(str(path.relative_to(tmp_path))))
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda path, **kw: flushed.append("rmtree") or rmtree(path, **kw))
    final = tmp_path / "step-000001"
    state = {"model": {"w": torch.ones(3)}}
    checkpoint.write_state(final, 1, state, {"step": 1}, {"model_args": {}})
    assert {"step-000001.tmp/trainer/rank0.pt", "step-000001.tmp/state", "step-000001.tmp/trainer",
            "step-000001.tmp/meta.json", "step-000001.tmp/manifest.json", "step-000001.tmp", "."} <= set(flushed)
    flushed.clear()
    checkpoint.write_state(final, 1, state, {"step": 1}, {"model_args": {}})  # the same step again
    renamed = flushed.index(".")  # the parent's entries: both renames
    assert renamed < len(flushed) - 1 and flushed[renamed + 1] == "rmtree", flushed
    assert verify(final)["step"] == 1


def test_a_save_before_any_update_leaves_the_training_as_it_was(tiny_config, tmp_path):
    """torch makes an optimizer's states for a save by an update of lr 0, which it counts: the
    first real update was then taken as the second (0.73x its size), and a run that saved before
    it trained otherwise than one that did not."""
    import torch

    common = ["faults.nan_step=1", "anomaly.action=skip", "train.steps=3", "train.eval_interval=0"]
    saved = Trainer(tiny_config(*common, "checkpoint.interval=1", run_dir=tmp_path / "saved")).build()
    saved.train()
    plain = Trainer(tiny_config(*common, "checkpoint.interval=0", run_dir=tmp_path / "plain")).build()
    plain.train()
    for a, b in zip(saved.model.parameters(), plain.model.parameters()):
        assert torch.equal(a, b)


def test_a_save_removes_the_half_written_folders_of_older_saves_a_crash_left(tiny_config):
    """A kill mid-save leaves step-N.tmp (hundreds of MB at scale) until step N was saved again:
    the next save's pruning removes such folders of older steps, never a newer one's."""
    trainer = Trainer(tiny_config("train.steps=4", "checkpoint.interval=2", "train.eval_interval=0")).build()
    root = trainer.checkpointer.root
    (root / "step-000001.tmp" / "model").mkdir(parents=True)
    (root / "step-000009.tmp").mkdir()
    trainer.train()
    assert not (root / "step-000001.tmp").exists() and (root / "step-000009.tmp").is_dir()


class _Payload:
    """What a crafted checkpoint hid: unpickling it writes a marker file (os.system's stand-in)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_someone_crafted_runs_no_code_when_it_is_read(trained, tiny_config, tmp_path):
    """torch's DCP unpickled a checkpoint's .metadata, and its non-tensor items, with plain pickle:
    a crafted checkpoint given as model.init_from, --resume, eval or convert ran what it named (its
    manifest's hashes, written by its maker, prove nothing). The metadata is now read by an unpickler
    of DCP's own classes, and each item with weights_only=True, before DCP reads them."""
    import io
    import pickle
    from types import SimpleNamespace

    import torch

    from shardline.resilience.safe_load import _CheckedPlanner

    folder, marker = trained / "checkpoints" / "step-000012", tmp_path / "ran"
    real = (folder / "state" / ".metadata").read_bytes()
    (folder / "state" / ".metadata").write_bytes(pickle.dumps((_Payload(marker), pickle.loads(real))))
    resealed(folder, "state/.metadata")
    with pytest.raises(CheckpointError, match=r"\.metadata names io\.open, which a checkpoint's metadata "
                                              r"never holds; not loaded \(reading it would run code\)"):
        Trainer(tiny_config("train.steps=2", f"model.init_from={folder}", run_dir=tmp_path / "new")).build()
    assert not marker.exists()

    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s.encode())]) + s.encode()

    # A dotted name reaches through a module's own imports (metadata's `os`): refused, not followed
    crafted = b"\x80\x04" + text("torch.distributed.checkpoint.metadata") + text("os.mkdir") + b"\x93" + \
        text(str(marker)) + b"\x85R."
    (folder / "state" / ".metadata").write_bytes(crafted)
    resealed(folder, "state/.metadata")
    with pytest.raises(CheckpointError, match=r"names torch\.distributed\.checkpoint\.metadata\.os\.mkdir"):
        Trainer(tiny_config("train.steps=2", f"model.init_from={folder}", run_dir=tmp_path / "new")).build()
    assert not marker.exists()
    import dataclasses

    metadata = pickle.loads(real)  # (a data file placed outside the checkpoint: read as its tensors)
    key = next(iter(metadata.storage_data))
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], relative_path="../../../x.distcp")
    (folder / "state" / ".metadata").write_bytes(pickle.dumps(metadata))
    resealed(folder, "state/.metadata")
    with pytest.raises(CheckpointError, match=r"names '\.\./\.\./\.\./x\.distcp' as a data file, which is not a file "):
        Trainer(tiny_config("train.steps=2", f"model.init_from={folder}", run_dir=tmp_path / "new")).build()
    item, buffer = SimpleNamespace(dest_index=SimpleNamespace(fqn="optim.param_groups.0.lr")), io.BytesIO()
    torch.save(_Payload(marker), buffer)
    buffer.seek(0)
    with pytest.raises(CheckpointError, match=r"a checkpoint item \(optim\.param_groups\.0\.lr\) holds more than"):
        _CheckedPlanner().load_bytes(item, buffer)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["/etc/hostname", "../../outside.bin", "state/../../x"])
def test_a_manifest_naming_a_file_outside_its_checkpoint_is_malformed(trained, name):
    """Each file a manifest named was stat'ed and hashed, wherever it was."""
    folder = trained / "checkpoints" / "step-000012"
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = {"size": 1, "sha256": "00"}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"malformed manifest.json: ValueError: it names a file outside the "
                                              f"checkpoint \\('{re.escape(name)}'\\)"):
        verify(folder)


def test_a_checkpoint_cannot_send_dcp_to_another_metadata_file_or_outside_its_folder(trained, tiny_config, tmp_path):
    """A re-test of the guard found DCP reading a rank's `__0.metadata` (plain pickle) where `.metadata`
    was missing or an empty look-alike, a path object standing for `relative_path` (its parts set to
    anything), and data files linked out of the folder: each is refused before DCP reads anything."""
    import pickle
    import shutil
    from pathlib import PosixPath

    folder, marker = trained / "checkpoints" / "step-000012", tmp_path / "ran"
    real = (folder / "state" / ".metadata").read_bytes()
    start = ("train.steps=2", f"model.init_from={folder}")

    def refused(match: str) -> None:
        if (folder / "state" / ".metadata").exists():
            resealed(folder, "state/.metadata")
        else:  # (dropped from the manifest too, as a crafted checkpoint's maker would)
            manifest = json.loads((folder / "manifest.json").read_text())
            manifest["files"].pop("state/.metadata", None)
            (folder / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match=match):
            Trainer(tiny_config(*start, run_dir=tmp_path / "new")).build()
        assert not marker.exists()

    (folder / "state" / "__0.metadata").write_bytes(pickle.dumps((_Payload(marker), pickle.loads(real))))
    refused(r"state/__0\.metadata is a file a checkpoint never holds \(DCP would read it, with plain pickle")
    (folder / "state" / ".metadata").unlink()
    refused(r"\.metadata is missing or damaged \(FileNotFoundError\)")  # (DCP read __0.metadata instead)
    (folder / "state" / "__0.metadata").unlink()
    (folder / "state" / ".metadata").write_bytes(b"\x80\x02ccollections\nOrderedDict\n)R}X\x0c\x00\x00\x00"
                                                 b"storage_dataNsb.")  # (an empty look-alike: falsy to DCP)
    refused(r"\.metadata is not the metadata DCP writes; not loaded")
    metadata = pickle.loads(real)
    for key, info in metadata.storage_data.items():
        metadata.storage_data[key] = type(info)(PosixPath(info.relative_path), info.offset, info.length,
                                                info.transform_descriptors)
    (folder / "state" / ".metadata").write_bytes(pickle.dumps(metadata))
    refused(r"names PosixPath\('__0_0\.distcp'\) as a data file, which is not a file of the checkpoint")
    (folder / "state" / ".metadata").write_bytes(real)
    resealed(folder, "state/.metadata")
    shutil.move(folder / "state" / "__0_0.distcp", tmp_path / "elsewhere.distcp")
    (folder / "state" / "__0_0.distcp").symlink_to(tmp_path / "elsewhere.distcp")
    with pytest.raises(CheckpointError, match=r"state/__0_0\.distcp links to .*elsewhere\.distcp, outside the "):
        verify(folder)


def test_a_training_checkpoint_is_not_taken_for_a_converted_one(trained):
    """The hint that an old `convert from-hf` copied no tokenizer showed for training checkpoints
    too: their meta.json holds an `hf` section as well (empty from scratch)."""
    from shardline.preflight import _converted_from_hf

    meta = json.loads((trained / "checkpoints" / "step-000012" / "meta.json").read_text(encoding="utf-8"))
    assert "hf" in meta and not _converted_from_hf(str(trained / "checkpoints" / "step-000012"))


def test_a_checkpoint_a_run_prunes_while_it_is_read_is_not_called_damaged(trained, tiny_config, monkeypatch,
                                                                          capsys):
    """convert, eval and generate read a live run's newest checkpoint while its trainer may prune it
    (checkpoint.keep): a folder renamed away while verified is passed over in silence (the newest
    still there is found), and one gone while loaded is said to be, not "does not match"."""
    import torch.distributed.checkpoint as dcp

    from shardline.interop.convert import resolve_checkpoint
    from shardline.resilience import checkpoint
    from shardline.resilience.safe_load import load_state

    run = trained
    newest = Checkpointer(run, keep=9).list()[-1]
    real_verify = checkpoint.verify

    def pruned_first(path):  # the trainer's prune renames the folder away as it is verified
        if path == newest and newest.exists():
            newest.rename(newest.with_name(newest.name + ".pruning"))
        return real_verify(path)

    monkeypatch.setattr(checkpoint, "verify", pruned_first)
    chosen = resolve_checkpoint(run)
    assert chosen != newest and chosen.exists() and "passed over" not in capsys.readouterr().err
    # ... also where the rename lands mid-read, which verify takes for the storage failing
    newest.with_name(newest.name + ".pruning").rename(newest)

    def pruned_mid_read(path):
        if path == newest and newest.exists():
            newest.rename(newest.with_name(newest.name + ".pruning"))
            raise CheckpointUnreadable(f"checkpoint {path}: the storage failed reading it (FileNotFoundError)")
        return real_verify(path)

    monkeypatch.setattr(checkpoint, "verify", pruned_mid_read)
    assert resolve_checkpoint(run) == chosen and "passed over" not in capsys.readouterr().err
    monkeypatch.setattr(checkpoint, "verify", real_verify)

    def pruned_while_loading(state, checkpoint_id, planner):
        chosen.rename(chosen.with_name(chosen.name + ".pruning"))
        raise FileNotFoundError(f"{checkpoint_id}/__0_0.distcp")

    monkeypatch.setattr(dcp, "load", pruned_while_loading)
    with pytest.raises(CheckpointError, match=r"was removed while it was read \(a run pruning its older checkpoints"):
        load_state(chosen, {"model": {}})


def test_a_run_dir_moved_while_the_run_trains_stops_it_before_a_save_lands_apart(tiny_config, tmp_path):
    """A save recreated the old path's folder: the run split in two, its log in one and its newer
    checkpoints in the other, and it exited 0. It stops at that save now, on every rank."""
    trainer = Trainer(tiny_config("train.steps=12", "train.eval_interval=0")).build()  # (checkpoints at 6, 12)
    moved = tmp_path / "moved"
    original = trainer.save_checkpoint

    def move_then_save():
        if trainer.step == 12:
            (tmp_path / "run").rename(moved)
        return original()

    trainer.save_checkpoint = move_then_save
    with pytest.raises(CheckpointError, match=rf"the run dir {tmp_path / 'run'} was moved or removed while the run "
                                              "trained .*relaunch with --run.dir where it is now"):
        trainer.train()
    trainer.close()
    assert not (tmp_path / "run").exists() and Checkpointer(moved, keep=9).latest_valid().name == "step-000006"
    resumed = Trainer(tiny_config("train.steps=12", run_dir=moved)).build()
    assert resumed.step == 6
    resumed.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_dir_moved_just_after_the_check_fails_that_save_not_recreating_it(tiny_config, tmp_path, mode):
    """The move can land between the check before a save and its write (an async save writes later,
    on its own thread): the save made its folder with parents, the old path again. It fails now,
    as a save the storage refused, and the next save's check stops the run."""
    trainer = Trainer(tiny_config("train.steps=12", "train.eval_interval=0", f"checkpoint.mode={mode}")).build()
    moved, check = tmp_path / "moved", trainer._check_run_dir

    def check_then_move():
        check()
        if trainer.step == 6:
            (tmp_path / "run").rename(moved)

    trainer._check_run_dir = check_then_move
    with pytest.raises(CheckpointError, match="was moved or removed while the run trained"):
        trainer.train()
    trainer.close()
    assert not (tmp_path / "run").exists() and Checkpointer(moved, keep=9).latest_valid() is None
