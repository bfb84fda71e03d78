"""Which shardline this is: the release number and, run from a git checkout, its commit."""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"
BUILD_COMMIT_FILE = "build_commit.txt"  # an installed package's commit, written by setup.py's build hook


def version() -> str:
    """This shardline's version, with the commit of the git checkout it runs from where it runs
    from one (`0.1.0+git.1a2b3c4d5e`), else of the checkout an installed package was built from:
    the number alone stays the same from commit to commit, and a run's `start` event records
    this to say which code trained it."""
    here = Path(__file__).resolve().parents  # src/shardline/ of a checkout: not a copy inside another repo
    ours = here[1].name == "src" and _names_shardline(here[2] / "pyproject.toml")  # (src is never the root)
    commit = _checkout_commit(here[2] / ".git") if ours else _built_commit(here[0] / BUILD_COMMIT_FILE)
    return f"{__version__}+git.{commit[:10]}" if commit else __version__


def _built_commit(file: Path) -> str:
    """The commit an installed package was built from (setup.py's hook wrote it), else ""."""
    try:
        return _commit(file.read_text(encoding="utf-8").strip())
    except (OSError, UnicodeDecodeError):
        return ""


def _names_shardline(pyproject: Path) -> bool:
    """Whether `pyproject` is shardline's own (not another project's that holds a copy of it)."""
    try:
        return 'name = "shardline"' in pyproject.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False


def _checkout_commit(git: Path) -> str:
    """The commit a checkout's HEAD names, read from its files (no git process); "" where there is
    none (an installed package) or it cannot be read as a commit's hex name."""
    try:
        if git.is_file():  # a worktree's or submodule's pointer: "gitdir: PATH"
            git = (git.parent / git.read_text(encoding="utf-8").split(":", 1)[1].strip()).resolve()
        head = (git / "HEAD").read_text(encoding="utf-8").strip()
        if not head.startswith("ref: "):
            return _commit(head)  # a detached HEAD: the commit itself
        ref = head[5:]
        for root in (git, _common_dir(git)):
            if (root / ref).is_file():
                return _commit((root / ref).read_text(encoding="utf-8").strip())
            if (root / "packed-refs").is_file():
                for line in (root / "packed-refs").read_text(encoding="utf-8").splitlines():
                    if line.endswith(" " + ref):
                        return _commit(line.split(" ", 1)[0])
    except (OSError, IndexError, UnicodeDecodeError):
        pass
    return ""


def _commit(text: str) -> str:
    """`text` where it is a commit's name (40 hex digits, 64 under SHA-256), else ""."""
    return text if len(text) in (40, 64) and all(c in "0123456789abcdef" for c in text) else ""


def _common_dir(git: Path) -> Path:
    """A worktree's shared git folder (where its branches are), else the folder itself."""
    common = git / "commondir"
    return (git / common.read_text(encoding="utf-8").strip()).resolve() if common.is_file() else git
