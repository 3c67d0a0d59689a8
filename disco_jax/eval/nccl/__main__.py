"""``python -m disco_jax.eval.nccl``: the fit of the collective models per nccl-tests table."""

from disco_jax.eval.nccl.report import main

main()
