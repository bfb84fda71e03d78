"""Learning-rate schedules: a linear warmup, then cosine / linear / WSD down to the floor, constant, or an
inverse square root that stops at the floor."""

from __future__ import annotations

import pytest

from shardline.config import OptimConfig
from shardline.optim import lr_multiplier


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd", "constant"])
def test_warmup_then_the_schedule_to_its_floor(schedule):
    cfg = OptimConfig(schedule=schedule, warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2)
    curve = [lr_multiplier(step, 100, cfg) for step in range(100)]
    assert curve[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])  # the warmup's last update at 1.0
    after = curve[10:]
    assert all(a >= b for a, b in zip(after, after[1:]))  # never rises after the warmup
    assert after[-1] == pytest.approx(1.0 if schedule == "constant" else 0.1)
    if schedule == "wsd":  # flat until the last 20% of the steps
        assert set(curve[9:80]) == {1.0} and curve[80] < 1.0


def test_rsqrt_falls_as_one_over_the_square_root_of_the_update_and_stops_at_the_floor():
    """Update k of T past W warm-up steps takes lr x sqrt(W / k): the peak at k = W, no jump after it,
    and min_lr_ratio a floor it may reach (here at k = W / 0.1**2 = 400) rather than an end point."""
    cfg = OptimConfig(schedule="rsqrt", warmup_steps=4, min_lr_ratio=0.1)
    curve = [lr_multiplier(step, 1000, cfg) for step in range(1000)]
    assert curve[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert curve[4] == pytest.approx((4 / 5) ** 0.5) and curve[15] == pytest.approx(0.5)  # k = 16: sqrt(4 / 16)
    assert all(a >= b for a, b in zip(curve[3:], curve[4:]))
    assert min(curve) == pytest.approx(0.1) and curve[398] > 0.1 and curve[399:] == pytest.approx([0.1] * 601)
    # The curve does not depend on train.steps (beyond a warm-up it cuts), so a longer resume keeps it
    assert [lr_multiplier(s, 50, cfg) for s in range(50)] == curve[:50]


def test_wsd_whose_warmup_overlaps_the_decay_decays_after_the_warmup_without_a_jump():
    cfg = OptimConfig(schedule="wsd", warmup_steps=90, min_lr_ratio=0.1, decay_fraction=0.2)
    curve = [lr_multiplier(step, 100, cfg) for step in range(100)]
    assert curve[89] == 1.0 and curve[-1] == pytest.approx(0.1)
    assert max(a - b for a, b in zip(curve[89:], curve[90:])) == pytest.approx(0.9 / 10)  # ten even steps


def test_the_wsd_decay_rounds_half_up_and_a_warmup_that_shortens_it_is_noted(tiny_config):
    """decay_fraction 0.25 of 10 steps asked 2 decay steps (Python's round: half to even) and of 14
    steps 4; a decay the warm-up shortened was not said."""
    from shardline.launch_notes import launch_notes
    from shardline.optim import wsd_decay_steps

    for steps, want in ((10, 3), (14, 4), (18, 5), (2, 1)):
        assert wsd_decay_steps(steps, OptimConfig(schedule="wsd", warmup_steps=0, decay_fraction=0.25)) == (want, want)
        curve = [lr_multiplier(s, steps, OptimConfig(schedule="wsd", warmup_steps=0, decay_fraction=0.25))
                 for s in range(steps)]
        assert sum(m < 1.0 for m in curve) == want and curve[-1] == pytest.approx(0.1)
    assert wsd_decay_steps(10, OptimConfig(schedule="wsd", warmup_steps=8, decay_fraction=0.5)) == (5, 2)
    notes = dict(launch_notes(tiny_config("train.steps=10", "optim.schedule=wsd", "optim.warmup_steps=8",
                                          "optim.decay_fraction=0.5", "metrics.peak_tflops=1"), "cpu", 1.0, 1))
    assert notes["wsd_decay_cut"]["decay_steps"] == 2 and notes["wsd_decay_cut"]["asked"] == 5
    assert "wsd_decay_cut" not in dict(launch_notes(tiny_config("train.steps=10", "optim.schedule=wsd",
                                                                "optim.warmup_steps=5", "optim.decay_fraction=0.5"),
                                                    "cpu", 1.0, 1))


def test_the_next_lr_a_resume_changes_is_given_before_and_after():
    """Extending a cosine run that decayed to its floor raises the lr again (the curve is computed
    from step 0 over the new train.steps): next_lr_change gives the two values; None where the
    resume changes nothing of it."""
    from dataclasses import asdict

    from shardline.optim import next_lr_change

    cfg = OptimConfig(lr=3e-3, warmup_steps=5, schedule="cosine", min_lr_ratio=0.1)
    saved = {"optim": asdict(cfg), "train": {"steps": 20}}
    old, new = next_lr_change(20, saved, 40, cfg)
    assert old == pytest.approx(3e-4) and new == pytest.approx(3e-3 * lr_multiplier(20, 40, cfg)) and new > 6 * old
    assert next_lr_change(10, saved, 20, cfg) is None
    assert next_lr_change(10, saved, 20, OptimConfig(lr=1e-3, warmup_steps=5, min_lr_ratio=0.1)) == \
        pytest.approx([3e-3 * lr_multiplier(10, 20, cfg), 1e-3 * lr_multiplier(10, 20, cfg)])
    assert next_lr_change(10, {}, 20, cfg) is None  # (a saved config that does not say)


def test_every_listed_schedule_has_its_own_curve():
    """A name added to config.SCHEDULES without a curve in lr_multiplier fell through to cosine and
    trained as it in silence: each now has a curve of its own, and an unknown name is refused."""
    from shardline.config import SCHEDULES
    from shardline.errors import ConfigError

    curves = {name: tuple(lr_multiplier(s, 100, OptimConfig(schedule=name, warmup_steps=5)) for s in range(100))
              for name in SCHEDULES}
    assert len(set(curves.values())) == len(SCHEDULES), curves.keys()
    with pytest.raises(ConfigError, match="optim.schedule='rsqrtt' has no learning-rate curve here: one of cosine"):
        lr_multiplier(50, 100, OptimConfig(schedule="rsqrtt", warmup_steps=5))
    # A checkpoint's saved schedule this shardline does not know: no lr to compare with, not a refusal
    from shardline.optim import next_lr_change

    assert next_lr_change(50, {"optim": {"schedule": "foo"}, "train": {"steps": 100}}, 100, OptimConfig()) is None
