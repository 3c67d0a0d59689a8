"""Sharding rewrites: rules as data over partition / combine / replicate / reduce and the
collectives, each proven with z3 from a small set of axioms and checked numerically with numpy.

`disco_jax.sharding.rules` is the API (`RULES`, `prove`, `check_numeric`, `require`); `terms` the
term language, `axioms` what the prover assumes, `prover` the z3 translation, `numeric` the numpy
model. `disco-jax rules` prints every rule with its proof status.
"""
