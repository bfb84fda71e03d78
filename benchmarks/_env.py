"""The machine a benchmark ran on, in one line.

A timing means little without the machine, its load and the library versions beside it
(benchmarks/README.md asks for them with every recorded figure), so each script prints
`header()` first, or puts `environment()` in its JSON. The load average is read when called:
call it before the measurement, so it shows what else was running, not the benchmark itself.
"""

from __future__ import annotations

import datetime
import os
import platform


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict:
    """Date, host, CPU, cores, load averages (1, 5, 15 min), python, torch and its threads."""
    try:
        import torch

        torch_version, threads = torch.__version__, torch.get_num_threads()
    except ImportError:
        torch_version, threads = None, None
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "cpu": cpu_model(), "cores": os.cpu_count(), "load": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(), "torch": torch_version, "threads": threads}


def load_warning(env: dict) -> str:
    """One line when the 1-minute load is above the core count (other work shares the cores), else ''."""
    if env["load"][0] > (env["cores"] or 1):
        return (f"WARNING: load average {env['load'][0]:.2f} over {env['cores']} cores: "
                "timings are unreliable under load")
    return ""


def header(env: dict | None = None) -> str:
    """`environment()` as one line (and the load warning as a second, where there is one)."""
    e = env or environment()
    line = (f"{e['date']} on {e['host']} ({e['cpu']}, {e['cores']} cores), load {'/'.join(map(str, e['load']))}; "
            f"python {e['python']}, torch {e['torch']}, {e['threads']} torch threads")
    warning = load_warning(e)
    return f"{line}\n{warning}" if warning else line
