"""The trainer: `loop.py` is the training loop (read `Trainer.train()` first), `step.py`
what one rank computes of a step (forward, loss, backward, under any layout)."""

from shardline.trainer.loop import Trainer

__all__ = ["Trainer"]
