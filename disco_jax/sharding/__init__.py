"""Sharding rewrites of a data-parallel step, and the rules that justify them.

* Rules as data over partition / combine / replicate / reduce and the collectives, each proven
  with z3 from a small set of axioms and checked numerically with numpy:
  `disco_jax.sharding.rules` is the API (`RULES`, `prove`, `check_numeric`, `require`); `terms`
  the term language, `axioms` what the prover assumes, `prover` the z3 translation, `numeric` the
  numpy model. `disco-jax rules` prints every rule with its proof status.
* `disco_jax.sharding.update`: the sharded weight update (optimizer state kept sharded over the
  data axis; XLA's SPMD partitioner emits the collectives), justified by the rule
  `sharded_weight_update`.
"""
