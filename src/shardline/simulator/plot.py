"""The goodput-vs-checkpoint-interval plot (matplotlib: PNG, SVG or PDF, by the file name)."""

from __future__ import annotations

from pathlib import Path

from shardline.errors import ConfigError
from shardline.simulator.montecarlo import Setup

_COLORS = {"sync": "tab:red", "async": "tab:blue", "memory": "tab:green"}
_KINDS = {".png": b"\x89PNG\r\n\x1a\n", ".svg": b"<?xml", ".pdf": b"%PDF"}  # what each kind's file starts with


def check_plot_path(path: str | Path) -> None:
    """Refuse a --plot target before the minutes of simulating: a missing folder, a folder, a name
    whose ending is no image kind written (p.txt got a PNG), or an existing file that is not such
    an image already (a mistyped config path would be overwritten)."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"--plot {path}: is a folder; give a file name such as goodput.png")
    magic = _KINDS.get(target.suffix.lower())
    if magic is None:
        raise ConfigError(f"--plot {path}: give a file name ending in {', '.join(_KINDS)} (the kind of image written)")
    if not target.parent.is_dir():
        raise ConfigError(f"--plot {path}: folder {target.parent} does not exist")
    if target.exists():
        with open(target, "rb") as f:
            if f.read(len(magic)) != magic:
                raise ConfigError(f"--plot {path}: exists and is not a {target.suffix[1:].upper()}; "
                                  "refusing to overwrite it")


def plot_sweeps(path: str | Path, setup: Setup, sweeps: dict[str, list[dict[str, float]]]) -> None:
    """One curve per checkpoint mode (mean ± std over seeds), Daly's optimum dashed."""
    try:
        from matplotlib.figure import (
            Figure,  # no pyplot: no global figure state, no GUI backend
        )
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib") from None
    fig = Figure(figsize=(8, 5), dpi=120)
    ax = fig.add_subplot()
    for mode, points in sweeps.items():
        x = [p["interval_s"] for p in points]
        y = [p["goodput"] for p in points]
        spread = [p["goodput_std"] for p in points]
        color = _COLORS[mode]
        ax.plot(x, y, marker="o", ms=3, color=color, label=f"{mode} (stall {setup.stall_s(mode):.3g} s)")
        low = [a - b for a, b in zip(y, spread, strict=True)]
        high = [a + b for a, b in zip(y, spread, strict=True)]
        ax.fill_between(x, low, high, color=color, alpha=0.15)
        ax.axvline(setup.optimal_s(mode), color=color, ls="--", lw=1)
    best = max(p["goodput"] for points in sweeps.values() for p in points)
    lowest = min(p["goodput"] for points in sweeps.values() for p in points)
    ax.set_ylim(max(lowest, best - 0.25) - 0.01, min(1.0, best + 0.02))  # keep the peaks readable
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (s of training between checkpoints)")
    ax.set_ylabel("goodput (useful training / wall time), ±1 std over seeds")
    job = setup.job
    ax.set_title(f"{job.model_name} on {job.gpus:,} {job.gpu}, {job.days:g} days "
                 f"(MTBF {setup.mtbf_s / 3600:.3g} h); dashed: Daly optimum")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    try:
        fig.savefig(path, format=Path(path).suffix[1:].lower())
    except OSError as e:
        raise ConfigError(f"--plot {path}: cannot write ({e.strerror})") from None
