"""Cluster-scale simulation of a training run under failures (`shardline simulate`).

failures.py  failure causes and rates (Llama 3 Table 5 defaults)
settings.py  every tunable, from defaults, TOML, overrides and flags
job.py       the job: model, accelerators, step time (the planner hook), checkpoint costs
interval.py  Young and Daly optimal checkpoint intervals
engine.py    one seeded event-level run
montecarlo.py  seeds, summaries, interval sweeps
report.py, plot.py, cli.py  output and the command line
"""
