"""Build hook (pyproject.toml holds the package's settings): an installed shardline records the
commit of the checkout it was built from, which version.py reads where no checkout is beside it,
so a run's `start` event says which code trained it. A build from a tree without .git (an sdist)
records nothing and reports the number alone."""

import runpy
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithCommit(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False) or self.dry_run:  # an editable install reads the checkout's .git
            return
        version = runpy.run_path(str(ROOT / "src" / "shardline" / "version.py"))
        commit = version["_checkout_commit"](ROOT / ".git")
        target = Path(self.build_lib) / "shardline" / version["BUILD_COMMIT_FILE"]
        target.parent.mkdir(parents=True, exist_ok=True)
        if commit:
            target.write_text(commit + "\n", encoding="utf-8")
        elif target.exists():  # (a build dir reused from a build that had one)
            target.unlink()


setup(cmdclass={"build_py": BuildPyWithCommit})
