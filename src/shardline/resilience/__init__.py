"""Fault tolerance: checkpoints (sync, async, in-memory tiers), anomaly detection, the
watchdog (hangs, stragglers), recovery on restart and fault injection for drills."""
