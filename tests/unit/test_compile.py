"""train.compile compiles each transformer block and the loss, and trains like eager."""

from __future__ import annotations

import pytest

from shardline.config import load_config
from shardline.errors import ConfigError
from shardline.preflight import preflight
from shardline.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.distributed.harness import losses

SHORT = ["train.steps=3", "train.eval_interval=3", "checkpoint.interval=0", "train.micro_batch_size=2"]


@pytest.mark.slow  # inductor on 2 CPU cores: ~30 s of compilation
def test_compiled_run_trains_like_eager_with_chunked_loss_and_ac(tmp_path, small_corpus):
    runs = {}
    for name, extra in {"eager": [], "compiled": ["train.compile=true"]}.items():
        cfg = load_config(None, tiny_overrides(tmp_path / name, small_corpus, *SHORT, "train.loss_chunk_tokens=24",
                                               "memory.activation_checkpoint=full", *extra))
        trainer = Trainer(cfg).build()
        if name == "compiled":  # every block runs compiled code, and the loss's scoring too
            assert all(b._compiled_call_impl is not None for b in trainer.model.layers.values())
            assert trainer.model.loss.score is not runs["eager"].model.loss.score
        trainer.train()
        runs[name] = trainer
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert sorted(compiled) == sorted(eager) == [1, 2, 3]
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-5), (step, compiled, eager)


@pytest.mark.parametrize("extra, key", [(["parallel.tp=2"], "parallel.tp=2"),
                                        (["model.preset=tiny-moe"], "mixture-of-experts")])
def test_compile_where_it_is_not_built_is_one_line_error(extra, key):
    cfg = load_config(None, ["train.compile=true", *extra])
    with pytest.raises(ConfigError, match=key):
        preflight(cfg, 2, 512)
    preflight(load_config(None, extra), 2, 512)  # the same layout without compile is fine
