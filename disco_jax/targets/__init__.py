"""GPU targets for deviceless compilation: XLA:GPU compiles for these without a GPU.

Each target is an XLA `GpuTargetConfig` text proto shipped as package data (the figures and their
sources are in the file's header). `topology(name, devices)` gives compile-only devices of that
kind; `mesh(...)` a 1-D data-parallel mesh over them, for `jax.ShapeDtypeStruct` arguments:

    mesh = targets.mesh("h100-sxm", 8)
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    jax.jit(step).lower(..., x).compile()          # XLA:GPU's whole pipeline, on a CPU machine

Needs the CUDA PJRT plugin (`pip install -e ".[gpu-compile]"`, part of `dev`); no NVIDIA library
wheels and no GPU. Set `JAX_PLATFORMS=cpu` so JAX does not try to open a CUDA device.
"""

from __future__ import annotations

import importlib.resources

import jax
from jax.sharding import AxisType, Mesh

# Target name -> its text proto in this package (every figure is sourced in the file's header).
TARGETS = {"h100-sxm": "h100_sxm.txtpb", "h200-sxm": "h200_sxm.txtpb", "a100-sxm": "a100_sxm.txtpb"}


def target_config(name: str) -> str:
    """The `GpuTargetConfig` text proto of a shipped target."""
    if name not in TARGETS:
        raise ValueError(f"unknown GPU target {name!r}; shipped targets: {', '.join(sorted(TARGETS))}")
    return importlib.resources.files(__name__).joinpath(TARGETS[name]).read_text()


def topology(name: str = "h100-sxm", devices: int = 8):
    """A compile-only topology of `devices` GPUs of target `name` on one host."""
    from jax.experimental import topologies

    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive int, got {devices!r}")
    config = target_config(name)

    try:
        return topologies.get_topology_desc(platform="cuda", target_config=config, topology=f"1x1x{devices}")
    except Exception as e:  # the plugin is missing, or it refused to load (no CUDA libraries)
        hint = (
            f"install the CUDA PJRT plugin matching jaxlib (pip install 'jax[cuda12-local]=={jax.__version__}')"
            " and, on a machine without a GPU, set JAX_PLATFORMS=cpu before jax is imported (otherwise the"
            " plugin looks for CUDA libraries at start-up and is not loaded)"
        )
        raise RuntimeError(f"cannot compile for GPU target {name!r}: {e}; {hint}") from e


def mesh(name: str = "h100-sxm", devices: int = 8, axis_name: str = "data") -> Mesh:
    """A 1-D mesh with an Auto axis over a compile-only topology (see `topology`)."""
    from jax.experimental import topologies

    auto = topologies.make_mesh(topology(name, devices), (devices,), (axis_name,))
    return Mesh(auto.devices, auto.axis_names, axis_types=(AxisType.Auto,))
