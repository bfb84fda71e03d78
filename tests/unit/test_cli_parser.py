"""The command line's parser: each command's module is imported only when that command runs, so
`shardline --help` and `shardline train --help` answer without importing torch (seconds)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from shardline.cli import FEATURE_COMMANDS, build_parser


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["--version"], ["prepare", "--help"],
                                  ["convert", "--help"]])
def test_the_listing_and_train_help_import_no_torch(argv):
    code = ("import sys\nfrom shardline.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('shardline'))")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    assert "usage: shardline" in done.stdout or "shardline " in done.stdout


def test_help_before_a_command_lists_every_command_with_its_line(capsys):
    from shardline.cli import main

    with pytest.raises(SystemExit):
        main(["--help", "plan"])
    out = capsys.readouterr().out
    assert all(line in " ".join(out.split()) for _, line in FEATURE_COMMANDS.values())


def test_every_command_is_listed_with_its_line_and_built_whole_when_given():
    listed = build_parser([])
    lines = {a.dest: a.help for a in next(a for a in listed._actions
                                          if isinstance(a, argparse._SubParsersAction))._choices_actions}
    assert set(FEATURE_COMMANDS) < set(lines) and {"train", "check"} < set(lines)
    for name, (module, line) in FEATURE_COMMANDS.items():
        assert lines[name] == line
        built = _commands(build_parser([name, "--help"]))[name]
        assert built.description.startswith(line) or name in ("plan", "simulate")  # (those have their own)
        assert built.get_default("func") is not None, f"{module} does not build `{name}`"
        assert _commands(listed)[name].get_default("func") is None  # a listing only: nothing of it imported
