"""Planner: cost models for memory, compute and communication, and a search over layouts.

Reads the same model spec (`shardline.models`) and parallel config (`shardline.config`)
as the trainer and never imports the trainer. The modules, from the bottom up:

    hardware.py     accelerator + interconnect table, TOML overrides and calibrated profiles
    layout.py       Layout (one parallel layout) and Workload (model, sequence, batch, dtype)
    activations.py  saved-tensor accounting per transformer block (Llama and Korthikanti's GPT)
    memory.py       bytes per rank: model states by ZeRO stage, activations, buffers
    pipeline.py     bubble and in-flight micro-batches of each pipeline schedule
    comm.py         alpha-beta collective costs on a node/network topology
    compute.py      matmul, attention, elementwise and optimizer time
    estimate.py     one layout -> step time, tokens/s, MFU, memory, breakdown
    search.py       enumerate layouts, prune, rank (`shardline plan`)
    report.py       the tables and JSON of `plan` and `estimate`
    published.py    published GPU runs (validation/gpu_runs.toml) predicted and compared
    calibrate/      measure this machine (`shardline calibrate`): run.py fits and writes
                    the profile from ops.py (compute, memory traffic), comm.py (gloo
                    collectives), dist.py (TP/FSDP2 wrapper host time) and corun.py
                    (how much busy CPU cores slow each other)
    cli.py          `plan`, `estimate`, `calibrate` (registered by shardline.cli)

Import the submodules directly; this file stays empty so importing one does not
pull in the rest.
"""
