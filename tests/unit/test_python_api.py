"""The Python API's mistakes are one-line ShardlineErrors, as the CLI's are: a dict for a Config,
a history of a run that logged nothing, a sampling option of the wrong type; and a Trainer runs
on a notebook's background thread."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest

from shardline.config import from_dict, load_config
from shardline.errors import ConfigError
from shardline.metrics import history
from shardline.models.sampling import SampleOptions
from shardline.trainer import Trainer


def test_a_dict_where_a_config_belongs_is_one_line_naming_from_dict():
    with pytest.raises(ConfigError, match=r"^Trainer takes a Config \(load_config, or from_dict of a dict\), not dict"):
        Trainer({"train": {"steps": 5}})  # (an AttributeError on check_sections)
    with pytest.raises(ConfigError, match=r"^load_config takes a TOML file's path, not a dict: .* from_dict's"):
        load_config({"train": {"steps": 5}})  # (a TypeError from the TOML reader)
    assert from_dict({"train": {"steps": 5}}).train.steps == 5


def test_the_history_of_a_run_that_logged_nothing_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"nope/metrics.jsonl does not exist|nope does not exist"):
        history(tmp_path / "nope")
    (tmp_path / "run").mkdir()
    with pytest.raises(ConfigError, match=r"run/metrics.jsonl does not exist: give a run dir that has trained"):
        history(tmp_path / "run")


@pytest.mark.parametrize("option, says", [
    ({"max_new_tokens": 5.5}, "max_new_tokens=5.5 is invalid: an integer (must be in [1, 2**20])"),
    ({"temperature": "0"}, "temperature='0' is invalid: a number (must be a finite number >= 0"),
    ({"top_k": True}, "top_k=True is invalid: an integer (must be >= 0"),
])
def test_a_sampling_option_of_the_wrong_type_is_refused_where_it_is_made(option, says):
    """A float token count failed deep in the sampling with a TypeError; a string temperature too."""
    with pytest.raises(ConfigError, match="^" + re.escape(says)):
        SampleOptions(**option)
    assert SampleOptions(temperature=0, top_p=1).temperature == 0  # (an int where a float belongs: a number)
    numpy = SampleOptions(max_new_tokens=np.int64(5), temperature=np.float32(0.5))  # (a sweep's values: taken)
    assert (type(numpy.max_new_tokens), type(numpy.temperature), numpy.temperature) == (int, float, 0.5)


def test_a_trainer_trains_on_a_background_thread(tiny_config):
    """Stop signals are the main thread's to take: installing them elsewhere raised ValueError."""
    done = {}
    thread = threading.Thread(target=lambda: done.update(Trainer(tiny_config("train.steps=2",
                                                                             "train.eval_interval=0")).build().train()))
    thread.start()
    thread.join()
    assert done.get("step") == 2, done


def test_evaluate_from_python_takes_one_override_string_as_load_config_does(tiny_config, tmp_path):
    """`evaluate(run, "train.eval_batches=1")` read the string a character at a time ("override 't'")."""
    from shardline.evaluate import evaluate

    cfg = tiny_config("train.steps=2", "checkpoint.interval=2", "train.eval_interval=2", "train.eval_batches=1")
    Trainer(cfg).build().train()
    logged = [r for r in history(cfg.run.dir) if r["kind"] == "eval"][-1]["eval_loss"]
    one = evaluate(cfg.run.dir, "train.eval_batches=1")
    assert one.step == 2 and one.loss == pytest.approx(logged, abs=1e-6)
    assert evaluate(cfg.run.dir, ["train.eval_batches=1"]).loss == one.loss
    # A notebook's own draws after an evaluation: not reseeded by its build to train.seed
    import random

    import torch

    torch.manual_seed(99), random.seed(99)
    evaluate(cfg.run.dir, "train.eval_batches=1")
    after = (torch.rand(1).item(), random.random())
    torch.manual_seed(99), random.seed(99)
    assert after == (torch.rand(1).item(), random.random())
    from shardline.generate import load_generator

    gen = load_generator(cfg.run.dir)
    assert isinstance(gen.complete("the", None), str)  # (None: the default options)
    with pytest.raises(ConfigError, match=r"takes a string and a SampleOptions \(SampleOptions\(\*\*a_dict\)"):
        gen.complete("the", {"max_new_tokens": 3})


def test_arguments_of_the_wrong_kind_are_one_line_and_from_dict_reads_as_code_sets():
    """None or a number as the overrides, a list or None for from_dict's dict, a str batch count, no
    source: raw TypeErrors and AttributeErrors. A Path and numpy's numbers, which attributes take,
    were refused by from_dict."""
    from pathlib import Path

    from shardline.evaluate import evaluate

    assert load_config(None, None).train.steps == load_config(None).train.steps  # (None: no overrides)
    for overrides in (5, [5], [Path("train.steps=3")]):
        with pytest.raises(ConfigError, match=r"^overrides are 'section.key=value' strings, a list of them or one"):
            load_config(None, overrides)
    for raw in (None, [1], "train", {1: {"steps": 5}}):
        with pytest.raises(ConfigError, match=r"^from_dict takes a dict of sections"):
            from_dict(raw)
    cfg = from_dict({"run": {"dir": Path("x")}, "train": {"steps": np.int64(5)}})
    assert (cfg.run.dir, cfg.train.steps, type(cfg.train.steps)) == ("x", 5, int)
    with pytest.raises(ConfigError, match=r"^batches='2' is invalid"):
        evaluate("somewhere", batches="2")
    with pytest.raises(ConfigError, match=r"^evaluate takes a checkpoint folder or a run dir, not None"):
        evaluate(None)
