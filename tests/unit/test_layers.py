"""The package's layers point down only: a module imports nothing from a layer above its own.

    errors, version < config < layout < models < data, parallel < optim, precision, metrics, devices, profiling
           < resilience < interop < preflight < launch_notes, eval_notes < trainer, planner
           < simulator, dry_run, generate, evaluate < cli

Modules of one layer do not import each other's packages either (data and parallel are
independent; so are the trainer and the planner). Every import counts, including those
inside functions, so no cycle hides in a function body.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "src" / "shardline"

LAYERS = [
    {"errors", "version"},
    {"config"},
    {"layout"},
    {"models"},
    {"data", "parallel"},
    {"optim", "precision", "metrics", "devices", "profiling"},
    {"resilience"},
    {"interop"},
    {"preflight"},
    {"launch_notes", "eval_notes"},
    {"trainer", "planner"},
    {"simulator", "dry_run", "generate", "evaluate"},
    {"cli"},
    {"__main__", "__init__"},
]
# A model family's own parallel plan is built from parallel/ blocks: it sits just above them.
MODULE_LAYERS = {"models.llama.parallelize": 5, "models.moe.parallelize": 5}


def layer_of(module: str) -> int:
    """`module` is dotted below shardline (e.g. "parallel.dims")."""
    for prefix, layer in MODULE_LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    top = module.split(".")[0]
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"shardline.{module} is in no layer; add its package to LAYERS")


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module below shardline) of every `shardline` import in the file."""
    here = path.relative_to(PACKAGE).with_suffix("").parts
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = list(here[:-node.level]) if here[-1] != "__init__" else list(here[:len(here) - node.level + 1])
                name = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "shardline":
                name = node.module.removeprefix("shardline").lstrip(".")
            else:
                continue
            targets = [name] if name else [a.name for a in node.names]
            out += [(node.lineno, t) for t in targets]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name.removeprefix("shardline.")) for a in node.names
                    if a.name.split(".")[0] == "shardline" and a.name != "shardline"]
    return out


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = module_name(path)
        mine = layer_of(me)
        for line, target in imports_of(path):
            if target.split(".")[0] == me.split(".")[0] and not _crosses_model_plan(me, target):
                continue  # inside one package
            theirs = layer_of(target)
            if theirs >= mine:
                bad.append(f"{path.relative_to(PACKAGE)}:{line} (layer {mine}) imports shardline.{target} "
                           f"(layer {theirs})")
    return bad


def _crosses_model_plan(me: str, target: str) -> bool:
    """Inside models/, only the parallel plans sit apart from the rest."""
    return layer_of(me) != layer_of(target)


def test_imports_point_down_only():
    assert violations() == []


def test_the_check_can_fail(tmp_path, monkeypatch):
    assert layer_of("parallel.dims") > layer_of("models.llama") > layer_of("config")
    fake = tmp_path / "shardline"
    (fake / "models").mkdir(parents=True)
    (fake / "models" / "bad.py").write_text("def f():\n    from shardline.trainer import Trainer\n")
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    assert violations() == ["models/bad.py:2 (layer 3) imports shardline.trainer (layer 10)"]


@pytest.mark.parametrize("module", ["layout", "config", "config.reader", "errors"])
def test_the_layout_and_config_need_no_torch(module):
    """The layout and config load without torch, so a dry run or a plan starts fast."""
    import subprocess
    import sys

    code = (f"import sys, shardline.{module}; "
            "sys.exit(1 if any(m == 'torch' or m.startswith('torch.') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def _layer_line(text: str) -> list[set[str]]:
    """The `a, b < c < ...` rule as written in a text (the first line naming errors, up to cli)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("errors, version <"))
    end = next(i for i in range(start, len(lines)) if lines[i].rstrip().endswith("< cli"))
    rule = " ".join(line.strip() for line in lines[start:end + 1])
    return [{name.strip() for name in group.split(",")} for group in rule.split("<")]


def test_the_rule_as_written_is_the_rule_tested():
    """The README's and this file's copies of the rule had fallen behind LAYERS (devices,
    launch_notes, evaluate missing): both are held to it."""
    want = LAYERS[:-1]  # (the package's entry points sit on top of everything)
    assert _layer_line(__doc__) == want
    assert _layer_line((PACKAGE.parents[1] / "README.md").read_text(encoding="utf-8")) == want


MAX_LINES = 400  # a module read in one sitting; past it, split by what its parts do


def test_no_module_is_past_the_line_limit():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"over {MAX_LINES} lines: {long}"
