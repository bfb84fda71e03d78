"""Context parallelism: one sequence split over cp ranks (ring attention, Ulysses, both).

`sharding` says which tokens each rank holds, `ring` and `ulysses` are the two ways
of letting every query see every key, and `attention` puts them together as the
attention core the model calls.
"""
