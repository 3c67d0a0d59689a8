"""Bytes each device sends per step, by collective, for a zoo model's data-parallel step with Adam:
the replicated update against every optimizer-state group sharded over the data axis
(`disco_jax.sharding.update`). Both programs are lowered from shapes alone and captured at the hook
on XLA:CPU (8 virtual devices), and counted by `cost.allreduce.communication_bytes` (ring
algorithms). This is how the README's explanation of the falling bytes for the models with
embedding tables was checked.

    python scripts/sharded_update_bytes.py MODEL [CONFIG]     (CONFIG: tiny or paper, default paper)
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402

import optax  # noqa: E402

from disco_jax import backends, zoo  # noqa: E402
from disco_jax._compile import capture_program  # noqa: E402
from disco_jax.cost.allreduce import communication_bytes  # noqa: E402
from disco_jax.sharding import update  # noqa: E402

DEVICES = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=sorted(zoo.MODELS))
    parser.add_argument("config", nargs="?", default="paper", choices=("tiny", "paper"))
    args = parser.parse_args()
    spec, optimizer = zoo.get_model(args.model, args.config), optax.adam(1e-3)
    mesh = zoo.data_mesh(DEVICES)
    step_args = zoo.abstract_state_and_batch(spec, optimizer, mesh)
    step = zoo.build_train_step(spec, optimizer, mesh, "jit")
    replicated, compiled = capture_program(step.lower(*step_args), backends.CPU)
    lowered, _, reason = update.relower_positional(step, step_args, compiled)
    if lowered is None:
        raise SystemExit(f"{args.model}: no optimizer state to shard ({reason})")
    sharded, _ = capture_program(lowered, backends.CPU)
    print(f"{args.model} {args.config}, MB sent per device per step ({DEVICES} devices, ring):")
    for label, program in (("replicated", replicated), ("sharded", sharded)):
        sent = {k: f"{v / 1e6:,.1f}" for k, v in communication_bytes(program, DEVICES).items() if v}
        print(f"  {label:10s} {sent}")


if __name__ == "__main__":
    main()
