"""`shardline calibrate`: measure this machine and write a hardware profile for the planner.

A package of its own because calibration is a program beside the cost model, not part of
it: `run` fits and writes the profile; `ops` (compute, memory traffic, overheads), `comm`
(gloo collectives), `dist` (host time of the TP/FSDP2 wrappers) and `corun` (busy cores
slowing each other) measure. `shardline comm-bench` lives here too, for the same reason: it
measures a job's collectives under torchrun (`cluster`), fits them (`cluster_fit`) and writes
the profile (`cluster_cli`, the command). Nothing in the planner's estimates imports it.
"""

from shardline.planner.calibrate.run import calibrate, measure, measure_baseline_gib

__all__ = ["calibrate", "measure", "measure_baseline_gib"]
