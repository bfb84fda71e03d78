"""Sampling one token from a model's logits: greedy, temperature, top-k and top-p (nucleus), seeded,
with the options' rules (what `shardline generate` draws each token with)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from shardline.errors import ConfigError


@dataclass(frozen=True)
class SampleOptions:
    max_new_tokens: int = 64
    temperature: float = 0.8  # 0: greedy (the most likely token each time)
    top_k: int = 50  # sample among the k most likely tokens; 0: among all
    top_p: float = 1.0  # then among the likeliest whose probabilities sum to top_p; 1: all of them
    seed: int = 0

    def __post_init__(self) -> None:
        self.check()  # (a caller from Python hears of a bad option where it made it)
        for name, value in vars(self).items():  # numpy's numbers (a sweep over np.arange) as Python's
            object.__setattr__(self, name, float(value) if name in ("temperature", "top_p") else int(value))

    def check(self) -> None:
        """A ConfigError naming the first invalid option and its valid values."""
        check_options(vars(self))


# Each option's rule: a test of its value, and the words that say the valid ones.
_OPTION_RULES = {
    "max_new_tokens": (lambda v: 1 <= v <= 2**20, "must be in [1, 2**20]"),  # (printed at the end: a typo hung)
    "temperature": (lambda v: 0 <= v < math.inf, "must be a finite number >= 0 (0 = greedy)"),  # (NaN fails it)
    "top_k": (lambda v: v >= 0, "must be >= 0 (0 = all tokens)"),
    "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1] (1 = all tokens)"),
    "seed": (lambda v: -2**63 <= v < 2**64, "must be in [-2**63, 2**64)"),  # what torch's generator takes
}


def check_options(values: dict, flags: bool = False) -> None:
    """A ConfigError naming the first invalid sampling option and its valid values: as SampleOptions'
    field (top_p=0.0), or with `flags` as the CLI's flag (--top-p=0.0)."""
    for name, (valid, rule) in _OPTION_RULES.items():
        value = values[name]
        whole = name in ("max_new_tokens", "top_k", "seed")  # (a float there failed deep in the sampling)
        kind = numbers.Integral if whole else numbers.Real  # (numpy's too; not a bool)
        typed = isinstance(value, kind) and not isinstance(value, (bool, np.bool_))
        if not typed or not valid(value):
            shown = "--" + name.replace("_", "-") if flags else name
            rule = rule if typed else f"{'an integer' if whole else 'a number'} ({rule})"
            raise ConfigError(f"{shown}={value!r} is invalid: {rule}")


def next_token(logits: torch.Tensor, opts: SampleOptions, draw: torch.Generator) -> int:
    """One token from a vector of fp32 logits: the argmax at temperature 0, else a draw from the
    softmax of logits / temperature over the top_k most likely (all with top_k 0), and of those
    over the fewest likeliest whose probabilities sum to top_p (nucleus sampling)."""
    if opts.temperature == 0:
        return int(logits.argmax())
    # (shifted: a tiny temperature overflows no logit; in float64, where 1e-46 is no 0 as in float32)
    scaled = (logits.double() - logits.max()) / opts.temperature
    if 0 < opts.top_k < scaled.numel():
        kth = torch.topk(scaled, opts.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if opts.top_p < 1:
        ranked, order = probs.sort(descending=True)
        likelier = ranked.cumsum(0) - ranked  # the mass of the tokens ranked above each (0 for the first)
        probs[order[likelier >= opts.top_p]] = 0  # multinomial takes weights: no need to renormalise
    return int(torch.multinomial(probs, 1, generator=draw))
