"""Per-device peak memory of the three weight-update choices, from XLA's memory analysis.

For each zoo model (tiny config unless `--config`, `jax.jit` style, optax.adam) the step is compiled
three ways: replicated (XLA's data-parallel step), every group's optimizer state sharded (ZeRO-1,
`Layout.all_leaves(parameters=False)`) and every group's parameters and state sharded (ZeRO-3,
`Layout.all_leaves()`), and the footprint of each executable is printed (argument + output + temp -
alias bytes per device, `sharding.choice.footprint`), with its collectives. `--target cpu`: 8
virtual CPU devices (the hook's rules applied as in the decorator, `_compile.capture_program`; the
first step's outputs compared with the replicated step's); `--target h100`: a deviceless XLA:GPU
compile for 8 H100s (`disco_jax.targets.mesh`). Leaves kept replicated (no dimension divisible by
8) are counted.

    python scripts/zero3_memory.py [--target cpu|h100] [--models mlp transformer ...] [--config tiny]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from disco_jax import backends, targets, zoo  # noqa: E402
from disco_jax._compile import capture_program  # noqa: E402
from disco_jax.sharding import choice, update  # noqa: E402

CHOICES = {"replicated": None, "state": False, "params+state": True}
TARGETS = ("cpu", "h100")  # 8 virtual devices of this host, or 8 H100s compiled deviceless


def programs(name: str, config: str, on_host: bool) -> dict:
    spec, opt = zoo.get_model(name, config), optax.adam(1e-3)
    if on_host:
        step, state, batch = zoo.make_train_step(spec, opt, zoo.data_mesh(), "jit")
        args, backend = (state, batch), backends.CPU
    else:
        mesh = targets.mesh("h100-sxm", 8)
        args, backend = zoo.abstract_state_and_batch(spec, opt, mesh), backends.GPU
        step = zoo.build_train_step(spec, opt, mesh, "jit")
    _, default = capture_program(step.lower(*args), backend)
    out = {"replicated": (default, args, None)}
    for label, parameters in list(CHOICES.items())[1:]:
        lowered, layout, reason = update.relower_positional(
            step, args, default, lambda layout, p=parameters: layout.all_leaves(parameters=p)
        )
        if lowered is None:
            out[label] = (None, None, reason)
            continue
        _, compiled = capture_program(lowered, backend)
        out[label] = (compiled, layout.reshard(args, {})[0], layout)
    return {"step": step, "args": args, "programs": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(zoo.MODELS))
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--target", choices=TARGETS, default=TARGETS[0])
    args = parser.parse_args()
    on_host = args.target == TARGETS[0]
    print(f"target {args.target}, 8 devices, jax {jax.__version__}; footprint bytes per device (XLA memory analysis)")
    print(f"{'model':12} {'replicated':>12} {'state':>12} {'params+state':>13}  kept whole  collectives (params+state)")
    for name in args.models:
        found = programs(name, args.config, on_host)
        sizes, note = [], ""
        for label in CHOICES:
            compiled, call_args, layout = found["programs"][label]
            sizes.append("-" if compiled is None else str(choice.footprint(update.memory(compiled, {}))))
        compiled, call_args, layout = found["programs"]["params+state"]
        if compiled is None:
            note = f"not sharded: {layout}"
        else:
            counts = {k: v for k, v in update.collectives(compiled.as_text()).items() if v}
            note = f"{len(layout.kept_whole):>10}  {counts}"
            if on_host:
                reference = found["programs"]["replicated"][0](*found["args"])
                ours = compiled(*call_args)
                diff = max(
                    float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference))
                    if np.issubdtype(np.asarray(a).dtype, np.floating)
                )
                note += f"  max |diff| {diff:.1e}"
        print(f"{name:12} {sizes[0]:>12} {sizes[1]:>12} {sizes[2]:>13}  {note}")


if __name__ == "__main__":
    main()
