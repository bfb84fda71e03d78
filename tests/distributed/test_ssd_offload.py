"""Optimizer states on an SSD (memory.ssd_offload_dir, shardline/optim/ssd_offload.py): AdamW's moments in
memory-mapped files, through the trainer. The same run with and without, in one process, resumed,
and under FSDP on 2 gloo ranks (with FSDP2's CPU offload, the GPU path), gives the same losses
and weights; the moments really are file mappings and no file outlives the mapping; bad folders
and layouts stop with one line before anything is written."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardline.optim import ssd_offload, windowed
from shardline.config import load_config
from shardline.dry_run import dry_run
from shardline.errors import ConfigError
from shardline.launch_notes import launch_notes
from shardline.optim.ssd_offload import IN_MEMORY, SSDAdamW, filesystem, problem
from shardline.trainer import Trainer
from tests.distributed.harness import PARITY_OVERRIDES, assert_same_run, gloo_rank, outcome, start_ranks
from tests.ports import free_port
from tests.unit.test_windowed_adamw import IMPLEMENTATIONS, assert_same_as_torch, params, stepped


@pytest.fixture
def folder(tmp_path):
    """A folder on a disk for the moments: the test's temporary one, or, where that is a tmpfs (which
    the option refuses: RAM), one in the checkout's build/ (git-ignored), removed after."""
    if filesystem(tmp_path) not in IN_MEMORY:
        path = tmp_path / "ssd"
        path.mkdir()
        yield path
        return
    path = (Path(__file__).parents[2] / "build").resolve() / f"ssd-test-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    if filesystem(path) in IN_MEMORY:
        path.rmdir()
        pytest.skip("no folder on a disk for the moments")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def moments_report(trainer: Trainer, folder: Path) -> dict:
    """Where this rank's moments are: each a mapping of its own unlinked file in `folder`, of its
    parameter's local shape, and every state the optimizer steps with one of them."""
    opt = trainer.optimizer
    states = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    held = {local(t).data_ptr() for files in opt.mapped.values() for t in files.values()}
    prefix = f"{folder}/{opt.file_prefix()}-"
    files = {line.split()[-2] for line in Path("/proc/self/maps").read_text().splitlines()
             if prefix in line and line.endswith("(deleted)")}
    return {"ssd": isinstance(opt, SSDAdamW), "states": len(states), "files": len(files),
            "all_mapped": all(local(v).data_ptr() in held for v in states),
            "shapes": all(local(t).shape == local(p).shape for p, ts in opt.mapped.items() for t in ts.values()),
            "subclass_params": any(type(local(p)) not in (torch.Tensor, torch.nn.Parameter) for p in opt.mapped),
            "files_left": sorted(p.name for p in folder.iterdir())}


def _train(run_dir: Path, overrides: list[str], folder: Path | None) -> None:
    trainer = Trainer(load_config(None, [*overrides, f"run.dir={run_dir}"])).build()
    trainer.train()
    if folder is not None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        (run_dir / f"moments-rank{rank}.json").write_text(json.dumps(moments_report(trainer, folder)))


def _worker(rank: int, world: int, port: int, jobs: list) -> None:
    with gloo_rank(rank, world, port):
        for run_dir, overrides, folder in jobs:
            _train(Path(run_dir), overrides, Path(folder) if folder else None)


def test_one_process_trains_and_resumes_as_without(tmp_path, folder, tiny_config):
    plain, ssd, resumed = tmp_path / "plain", tmp_path / "ssd_run", tmp_path / "resumed"
    Trainer(tiny_config(run_dir=plain)).build().train()
    trainer = Trainer(tiny_config(f"memory.ssd_offload_dir={folder}", run_dir=ssd)).build()
    trainer.train()
    report = moments_report(trainer, folder)
    # two moments of each parameter, every one a mapping of its own unlinked file in the folder
    assert report["ssd"] and report["all_mapped"] and report["shapes"]
    assert report["states"] == report["files"] == 2 * len(list(trainer.model.parameters()))
    assert report["files_left"] == []
    assert_same_run(ssd, plain, rtol=0, atol=0)  # the same update, bit for bit
    # Stopped at step 6 and resumed: the checkpoint's moments are loaded into the mapped files.
    Trainer(tiny_config(f"memory.ssd_offload_dir={folder}", "train.stop_at_step=6", run_dir=resumed)).build().train()
    again = Trainer(tiny_config(f"memory.ssd_offload_dir={folder}", run_dir=resumed)).build()
    again.train()
    assert moments_report(again, folder)["all_mapped"]
    assert_same_run(resumed, plain, rtol=0, atol=0)


def test_fp8_trains_as_without(tmp_path, folder, tiny_config):
    """float8's Linear layers (emulated here) in one process: plain weights, moments mapped as any."""
    short = ["train.precision=fp8", "train.steps=4", "train.eval_interval=0", "checkpoint.interval=4"]
    Trainer(tiny_config(*short, run_dir=tmp_path / "plain")).build().train()
    trainer = Trainer(tiny_config(*short, f"memory.ssd_offload_dir={folder}", run_dir=tmp_path / "ssd_run")).build()
    trainer.train()
    assert moments_report(trainer, folder)["all_mapped"]
    events = [json.loads(x) for x in (tmp_path / "ssd_run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["folder"] for e in events if e.get("event") == "ssd_offload"] == [str(folder)]
    assert_same_run(tmp_path / "ssd_run", tmp_path / "plain", rtol=0, atol=0, evaluated=False)


@pytest.mark.slow
def test_fsdp_on_two_ranks_matches_without(tmp_path, folder):
    """FSDP 2 with FSDP2's CPU offload (a GPU run's path: DTensor moments on the host) against one
    process; and FSDP 2 under fp8 with float8 all-gather, whose weights are tensor subclasses,
    against the same layout without the offload, bit for bit."""
    single, offload, fp8, fp8_ssd = (tmp_path / n for n in ("single", "offload", "fp8", "fp8_ssd"))
    ssd = f"memory.ssd_offload_dir={folder}"
    fsdp, f8 = [*PARITY_OVERRIDES, "parallel.dp_shard=2"], ["train.precision=fp8", "fp8.fsdp_all_gather=true"]
    _train(single, PARITY_OVERRIDES, None)
    jobs = [(str(offload), [*fsdp, "memory.cpu_offload=true", ssd], str(folder)), (str(fp8), [*fsdp, *f8], ""),
            (str(fp8_ssd), [*fsdp, *f8, ssd], str(folder))]
    start_ranks(_worker, (2, free_port(), jobs), 2)
    for run in (offload, fp8_ssd):
        for rank in (0, 1):
            report = json.loads((run / f"moments-rank{rank}.json").read_text())
            assert report["ssd"] and report["all_mapped"] and report["shapes"], (run.name, rank, report)
            assert report["states"] == report["files"] > 0 and report["files_left"] == [], (run.name, rank, report)
    assert json.loads((fp8_ssd / "moments-rank0.json").read_text())["subclass_params"]
    assert_same_run(offload, single)
    assert_same_run(fp8_ssd, fp8, rtol=0, atol=0)


def test_bad_folders_and_layouts_stop_with_one_line(tmp_path, folder, tiny_config, monkeypatch):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match="memory.ssd_offload_dir=.*is not a folder"):
        Trainer(tiny_config(f"memory.ssd_offload_dir={missing}", run_dir=tmp_path / "run")).build()
    assert not (tmp_path / "run").exists()  # stopped before the run dir was made
    cfg = tiny_config(f"memory.ssd_offload_dir={folder}").memory
    if filesystem(Path("/dev/shm")) == "tmpfs":  # the usual Linux; RAM is no place for the moments
        shm = tiny_config("memory.ssd_offload_dir=/dev/shm").memory
        assert "is on tmpfs, which is RAM" in problem(shm, 3, on_cuda=False)
    def disk_full(fd, offset, length):  # the file system's answer to a reservation it cannot make
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", disk_full)
    with pytest.raises(ConfigError, match="cannot reserve this rank's optimizer moments .No space.* GiB free"):
        SSDAdamW([torch.nn.Parameter(torch.zeros(4))], str(folder), 0, lr=0.1)
    monkeypatch.undo()
    assert list(folder.iterdir()) == []  # the failed file is gone too

    def no_mapping(*args, **kwargs):  # vm.max_map_count reached, or no memory for the mapping
        raise RuntimeError("unable to mmap 16 bytes from file </proc/self/fd/9>: Cannot allocate memory (12)\nmore")

    monkeypatch.setattr(torch, "from_file", no_mapping)
    with pytest.raises(ConfigError, match=r"moments \(unable to mmap 16 bytes .*\(12\); .* GiB free\)$"):
        SSDAdamW([torch.nn.Parameter(torch.zeros(4))], str(folder), 0, lr=0.1)
    monkeypatch.undo()
    assert list(folder.iterdir()) == []
    with pytest.raises(ConfigError, match="not with amsgrad"):
        SSDAdamW([torch.nn.Parameter(torch.zeros(4))], str(folder), 0, lr=0.1, amsgrad=True)
    assert "needs memory.cpu_offload=true on a GPU" in problem(cfg, 3, on_cuda=True)
    assert "parallel.zero=1" in problem(cfg, 1, on_cuda=False)
    assert problem(cfg, 3, on_cuda=False) is None
    with pytest.raises(ConfigError, match="parallel.zero=1"):
        Trainer(tiny_config(f"memory.ssd_offload_dir={folder}", "parallel.zero=1",
                            run_dir=tmp_path / "run")).build()
    # A dry run may run where the training nodes' disks are not: it checks the layout, not the folder.
    assert dry_run(tiny_config(f"memory.ssd_offload_dir={missing}", "run.device=cpu"), 1)[0]
    with pytest.raises(ConfigError, match="parallel.zero=1"):
        dry_run(tiny_config(f"memory.ssd_offload_dir={missing}", "run.device=cpu", "parallel.zero=1"), 1)
    # What copies the moments back into RAM at each save is named at launch.
    notes = dict(launch_notes(tiny_config(f"memory.ssd_offload_dir={folder}", "checkpoint.mode=async"), "cpu", None, 1))
    assert notes["ssd_offload"]["ram_copies"].startswith("checkpoint.mode=async copy")
    assert "ram_copies" not in dict(launch_notes(tiny_config(f"memory.ssd_offload_dir={folder}"), "cpu", None, 1))[
        "ssd_offload"]


def _full_on_rank1(rank: int, world: int, port: int, folder: str, out: str) -> None:
    """Rank 1's node has no room on its SSD: its reservation fails there alone."""
    if rank == 1:
        def disk_full(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.posix_fallocate = disk_full
    with gloo_rank(rank, world, port, timeout_s=30):
        cfg = load_config(None, [*PARITY_OVERRIDES, "parallel.dp_shard=2", f"memory.ssd_offload_dir={folder}",
                                 f"run.dir={out}/run"])
        ended = outcome(lambda: (Trainer(cfg).build(), "built")[1])
        Path(out, f"rank{rank}.json").write_text(json.dumps(ended))


def test_an_ssd_full_on_one_node_stops_every_rank(tmp_path, folder):
    """The moments are reserved as the optimizer is built, after the start's agreed checks: a node
    whose SSD is full stopped its own ranks alone, its peers waiting in the next collective."""
    start_ranks(_full_on_rank1, (2, free_port(), str(folder), str(tmp_path)), 2)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert rank1.startswith("ConfigError: memory.ssd_offload_dir=") and "No space left" in rank1
    assert rank0 == f"ConfigError: on rank 1: {rank1.removeprefix('ConfigError: ')}"


def test_a_loaded_state_lands_in_the_mapped_files(folder):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    plain = torch.optim.AdamW(model.parameters(), lr=0.1)
    ssd = SSDAdamW(model.parameters(), str(folder), 0, lr=0.1)
    model(torch.randn(3, 8)).sum().backward()
    plain.step()
    ssd.load_state_dict(plain.state_dict())  # other tensors arrive: copied into the same files
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert ssd.state[p][key] is ssd.mapped[p][key] and torch.equal(ssd.state[p][key], plain.state[p][key])
        assert ssd.state[p]["step"].item() == 1
    assert ssd.mapped_bytes() == 2 * 4 * sum(p.numel() for p in model.parameters())
    assert list(folder.iterdir()) == []
    # A parameter the loaded state lacks starts over as a fresh run's, in its files (not in RAM).
    weight, bias = model.weight, model.bias
    partial = plain.state_dict()
    del partial["state"][1]  # the bias's
    ssd.load_state_dict(partial)
    assert ssd.state[bias]["exp_avg"] is ssd.mapped[bias]["exp_avg"] and not ssd.state[bias]["exp_avg"].any()
    assert ssd.state[bias]["step"].item() == 0 and ssd.state[weight]["step"].item() == 1



@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_the_windowed_step_is_torchs_adamw_bit_for_bit(folder, impl):
    """Stepped a window at a time (tests/unit/test_windowed_adamw.py's tensors and checks), the
    mapped moments laid out as their parameters: torch's AdamW bit for bit, in the files."""
    ssd = assert_same_as_torch(lambda groups, **hyper: SSDAdamW(groups, str(folder), 0, **hyper), impl)
    assert all(ssd.state[p][k] is files[k] for p, files in ssd.mapped.items() for k in files)

def _pages(t: torch.Tensor, libc) -> tuple[int, int]:
    """(resident pages, pages) of the memory under t (mincore)."""
    page = ssd_offload.PAGE
    start = t.data_ptr() & ~(page - 1)
    n = (t.data_ptr() + t.nbytes - start + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * page), vec) == 0
    return sum(b & 1 for b in vec), n


def _page_out(opt: SSDAdamW, libc) -> None:
    """Write every moment back to its file and drop its pages (msync, madvise MADV_PAGEOUT)."""
    for files in opt.mapped.values():
        for t in files.values():
            span = (ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(t.nbytes))
            if libc.msync(*span, 4) != 0 or libc.madvise(*span, 21) != 0:
                pytest.skip("msync or madvise(MADV_PAGEOUT) refused (Linux >= 5.4 needed)")


def test_the_next_window_is_read_back_before_it_isstepped(folder, monkeypatch):
    """Paged out to the file, a window's moments are asked of the disk (prefetched) before the window
    before them steps: the pages come back without being touched (mincore), while pages nobody asked
    for stay out; and a step over moments that were on the disk updates as torch's AdamW does."""
    libc = ctypes.CDLL(None, use_errno=True)
    plain_params, ssd_params = params(), params()
    plain = torch.optim.AdamW(plain_params, lr=1e-2, foreach=True)
    ssd = SSDAdamW(ssd_params, str(folder), 0, lr=1e-2, foreach=True)
    ssd.window = 2 * windowed.ALIGN
    stepped(plain, plain_params, 1)
    stepped(ssd, ssd_params, 1)
    _page_out(ssd, libc)
    big = ssd.mapped[ssd_params[4]]  # 33153 elements: 33 pages a moment
    first, rest = (big["exp_avg_sq"][:8192], big["exp_avg_sq"][8192:])
    if _pages(first, libc)[0] or _pages(rest, libc)[0]:
        pytest.skip("the kernel kept the paged-out moments resident")
    ssd._prefetch([(None, None, big["exp_avg"][:8192], first, None, None)])
    for _ in range(100):
        if _pages(first, libc)[0] == _pages(first, libc)[1]:
            break
        time.sleep(0.05)
    assert _pages(first, libc)[0] == _pages(first, libc)[1]
    assert _pages(rest, libc)[0] <= 2  # not asked for (the read may round out to a page)
    # The order: window i + 1 asked for, then window i stepped.
    events = []
    prefetch, step = ssd._prefetch, windowed.adam
    monkeypatch.setattr(ssd, "_prefetch", lambda w: (events.append(("ask", w[0][2].data_ptr())), prefetch(w)))
    monkeypatch.setattr(windowed, "adam", lambda p, g, m, *a, **k: (events.append(("step", m[0].data_ptr())),
                                                                       step(p, g, m, *a, **k)))
    _page_out(ssd, libc)
    stepped(plain, plain_params, 2)
    stepped(ssd, ssd_params, 2)
    starts = [ptr for kind, ptr in events if kind == "step"]
    n = len(starts) // 2
    assert n >= 4 and starts[:n] == starts[n:]  # the same windows each step
    one_step = [e for i in range(n) for e in ([("ask", starts[i + 1])] if i + 1 < n else []) + [("step", starts[i])]]
    assert events == one_step * 2
    for a, b in zip(plain_params, ssd_params):
        assert torch.equal(a, b) and torch.equal(plain.state[a]["exp_avg_sq"], ssd.state[b]["exp_avg_sq"])
