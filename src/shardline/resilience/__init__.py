"""Fault tolerance: checkpoints (and, later, anomaly handling, watchdog, recovery)."""
