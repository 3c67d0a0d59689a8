"""Sharding rewrites: which tensors of a data-parallel step are replicated, sharded or reduced.

`disco_jax.sharding.update`: the sharded weight update (optimizer state kept sharded over the
data axis; XLA's SPMD partitioner emits the collectives).
"""
