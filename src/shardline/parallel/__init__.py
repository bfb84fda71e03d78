"""Parallelism applied from outside the model: mesh, data/tensor/pipeline parallel, AC."""
