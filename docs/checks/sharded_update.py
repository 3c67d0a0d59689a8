"""The sharded weight update as XLA compiles it: Adam's moments sharded over the data axis at the
step's input and output, parameters replicated (what `disco_jax.sharding.update` lowers), on
XLA:CPU (8 devices) and XLA:GPU (deviceless, 8 H100s). Needs the CUDA PJRT plugin (the
`gpu-compile` extra). Run: `python docs/checks/sharded_update.py`."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import functools  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _common import fact, finish  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from disco_jax import targets  # noqa: E402

SIZES = (64, 256, 256, 64)
opt = optax.adam(1e-3)


def counts(text: str) -> dict[str, int]:
    ops = ("all-reduce", "reduce-scatter", "all-gather", "dynamic-slice")
    return {op: len(re.findall(rf"\s{op}(?:-start)?\(", text)) for op in ops}


def loss(params, x):
    h = x
    for w in params:
        h = jnp.tanh(h @ w)
    return jnp.mean(h**2)


def make_step(constrain=None):
    def step(params, state, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        if constrain is not None:
            grads = constrain(grads)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return step


def sharded_lowering(mesh, constrain=None):
    """The step lowered with mu/nu split over 'data' on dimension 0, everything else replicated."""
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = [jax.ShapeDtypeStruct((a, b), jnp.float32) for a, b in zip(SIZES[:-1], SIZES[1:])]
    state = jax.eval_shape(opt.init, params)
    state_shardings = jax.tree.map(lambda a: split if a.ndim else replicated, state)
    abstract = lambda tree, sharding: jax.tree.map(  # noqa: E731
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, sharding
    )
    outs = ([replicated] * len(params), state_shardings, replicated)
    return jax.jit(make_step(constrain), out_shardings=outs).lower(
        abstract(params, [replicated] * len(params)),
        abstract(state, state_shardings),
        jax.ShapeDtypeStruct((64, SIZES[0]), jnp.float32, sharding=split),
    )


cpu_mesh = jax.make_mesh((8,), ("data",))
cpu = counts(sharded_lowering(cpu_mesh).compile().as_text())
fact(
    cpu["reduce-scatter"] == 0 and cpu["all-reduce"] == 1 and cpu["all-gather"] == 3 and cpu["dynamic-slice"] > 0,
    "XLA:CPU compiles the sharded update to the replicated step's all-reduce, a dynamic-slice of each "
    "device's part and one all-gather per parameter: no reduce-scatter (no reduce-scatter creator on CPU)",
    cpu,
)

reshard = functools.partial(jax.tree.map, lambda g: jax.sharding.reshard(g, NamedSharding(cpu_mesh, P("data"))))
constrained = counts(sharded_lowering(cpu_mesh, reshard).compile().as_text())
fact(
    constrained["reduce-scatter"] == 0 and constrained["all-reduce"] == 1,
    "XLA:CPU: the gradients resharded to P('data') in the function still compile to all-reduce + dynamic-slice",
    constrained,
)


@jax.jit
@functools.partial(jax.shard_map, mesh=cpu_mesh, in_specs=P(), out_specs=P("data"))
def scatter(a):
    return jax.lax.psum_scatter(a, "data", scatter_dimension=0, tiled=True)


a = jax.device_put(jnp.arange(64.0), NamedSharding(cpu_mesh, P()))
fact(
    counts(scatter.lower(a).compile().as_text())["reduce-scatter"] == 1
    and np.array_equal(np.asarray(scatter(a)), 8 * np.arange(64.0)),
    "XLA:CPU runs a reduce-scatter (psum_scatter under shard_map compiles to one, with the right sums)",
    counts(scatter.lower(a).compile().as_text()),
)

gpu_text = sharded_lowering(targets.mesh("h100-sxm", 8)).compile().as_text()
gpu = counts(gpu_text)
all_reduced = re.findall(r"= ([^=]*?) all-reduce(?:-start)?\(", gpu_text)  # result shapes
gpu["all-reduce results"] = all_reduced
scalars_only = bool(all_reduced) and all(set(re.findall(r"\w+\[[\d,]*\]", r)) == {"f32[]"} for r in all_reduced)
fact(
    gpu["reduce-scatter"] == 1 and gpu["all-gather"] == 1 and scalars_only,
    "XLA:GPU (deviceless, 8 x H100) compiles the same lowering to one reduce-scatter of the gradients, one "
    "all-gather of the parameters and an all-reduce of the loss only",
    gpu,
)
finish()
