"""Expert parallelism: the all-to-all that takes tokens to the ranks holding their experts
(dispatch.py), and the per-step bookkeeping of expert load and balancing (balance.py)."""
