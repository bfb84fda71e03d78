"""The config a Trainer was made of, as the caller holds it.

A Trainer works on a copy of it, so what the Trainer settles (its run.dir made absolute, its
precision) is not written back: a notebook makes several Trainers of one object, edited between them. An
edit of that object made while no later Trainer was made of it was meant for this one: it is
refused, not passed over, as an edit of the Trainer's own config after build() is.
"""

from __future__ import annotations

import copy

from shardline.config.job import Config, changed_keys
from shardline.errors import ConfigError


class GivenConfig:
    def __init__(self, cfg: Config):
        self.held, self.as_given = cfg, copy.deepcopy(cfg)
        self.nth = cfg.__dict__["_trainers_made"] = getattr(cfg, "_trainers_made", 0) + 1  # (to_dict skips it)

    def refuse_changed(self, since: str) -> None:
        """The caller's object changed since this Trainer was made, where no later Trainer was made
        of it (whose edits those are); `since` says which step of this one would pass them over."""
        if getattr(self.held, "_trainers_made", 0) == self.nth:
            refuse_changed_since(self.as_given, self.held, since, reads="the Trainer works on a copy made then")


def refuse_changed_since(built: Config | None, now: Config, since: str = "build()",
                         reads: str = "build() reads it and train() trains what was built") -> None:
    """A Trainer's config changed after `since`, build() by default (between build() and train()): the
    model, data and schedule were built from it as it was, so a change was partly used and mislogged
    (train.steps) or not at all (optim.lr); `reads` says why. `built` None: no build finished, nothing to compare."""
    changed = changed_keys(built, now) if built is not None else []
    if changed:
        raise ConfigError(f"the config was changed after {since} ({', '.join(changed[:5])}): {reads}; build a new "
                          "Trainer of the changed config")
