"""Which shardline trained a run: the version with the checkout's commit (the number alone stays
0.1.0 from commit to commit), read from git's own files without a git process."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import shardline
from shardline.version import _checkout_commit, version

A, B = "1" * 40, "2" * 40


def test_head_on_a_branch_a_packed_branch_a_detached_head_and_a_worktree(tmp_path):
    git = tmp_path / "repo" / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text(A + "\n")
    assert _checkout_commit(git) == A
    (git / "refs" / "heads" / "main").unlink()  # after `git gc`: in packed-refs
    (git / "packed-refs").write_text(f"# pack-refs with: peeled fully-peeled sorted\n{B} refs/heads/main\n")
    assert _checkout_commit(git) == B
    (git / "HEAD").write_text(A + "\n")  # detached
    assert _checkout_commit(git) == A
    # A worktree: .git is a file naming its folder, whose branches are in the shared one
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    tree = git / "worktrees" / "wt"
    tree.mkdir(parents=True)
    (tree / "HEAD").write_text("ref: refs/heads/main\n")
    (tree / "commondir").write_text("../..\n")
    (tmp_path / "wt").mkdir()
    (tmp_path / "wt" / ".git").write_text(f"gitdir: {tree}\n")
    assert _checkout_commit(tmp_path / "wt" / ".git") == B
    assert _checkout_commit(tmp_path / "none" / ".git") == ""  # an installed package
    (git / "HEAD").write_text("ref: refs/heads/gone\n")
    assert _checkout_commit(git) == ""
    (git / "refs" / "heads" / "sym").write_text("ref: refs/heads/main\n")  # a symbolic branch: not a commit
    (git / "HEAD").write_text("ref: refs/heads/sym\n")
    assert _checkout_commit(git) == ""


def test_this_checkouts_version_names_its_commit():
    repo = Path(shardline.__file__).resolve().parents[2]
    if not (repo / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not run from a git checkout")
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert version() == f"{shardline.__version__}+git.{head[:10]}"


def test_an_installed_package_names_the_commit_it_was_built_from(tmp_path):
    """setup.py's build hook writes the checkout's commit beside the built version.py, which an
    installed package (no checkout above it) reads; a build without one says the number alone."""
    import runpy
    import sys

    pytest.importorskip("setuptools")
    repo = Path(shardline.__file__).resolve().parents[2]
    if not (repo / ".git").exists():
        pytest.skip("not run from a git checkout")
    built = tmp_path / "lib"
    done = subprocess.run([sys.executable, str(repo / "setup.py"), "-q", "build_py", "--build-lib", str(built)],
                          cwd=repo, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    installed = runpy.run_path(str(built / "shardline" / "version.py"))
    assert installed["version"]() == version()  # the checkout's own commit
    (built / "shardline" / "build_commit.txt").write_text("not a commit\n")
    assert runpy.run_path(str(built / "shardline" / "version.py"))["version"]() == shardline.__version__
