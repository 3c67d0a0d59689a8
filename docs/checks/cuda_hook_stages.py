"""XLA:GPU without a GPU: deviceless compilation for 8 H100s, what the pass hook receives at
each stage, and that a module returned at PRE_SCHEDULER is what XLA:GPU compiles.
Needs the CUDA PJRT plugin (the `gpu-compile` extra). Run: `python docs/checks/cuda_hook_stages.py`."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"  # compile-only CUDA devices come from the topology, not a client
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _common import Recorder, count, fact, finish, operand_counts  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from disco_jax import targets  # noqa: E402

LAYERS, WIDTH = 4, 256
rec = Recorder("cuda")
mesh = targets.mesh("h100-sxm", 8)
fact(
    mesh.devices.flat[0].device_kind == "NVIDIA H100 80GB HBM3" and mesh.size == 8,
    "get_topology_desc(platform='cuda', target_config=H100 text) gives 8 compile-only H100s",
    mesh.devices.flat[0].device_kind,
)


def step(ws, x):
    def loss(ws):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.sum(h**2)

    return [w - 0.1 * g for w, g in zip(ws, jax.grad(loss)(ws))]


ws = [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32, sharding=NamedSharding(mesh, P()))] * LAYERS
x = jax.ShapeDtypeStruct((64, WIDTH), jnp.float32, sharding=NamedSharding(mesh, P("data")))
lowered = jax.jit(step).lower(ws, x)

rec.reset()
final = lowered.compile(compiler_options={"xla_debug_buffer_assignment_show_max": 301}).as_text()
pre, post = rec.texts["PRE_SCHEDULER"], rec.texts["POST_SCHEDULER"]
fact(
    len(pre) == 1 and len(post) == 1,
    "the hook registered for 'cuda' runs at both stages without a GPU",
    f"{len(pre)} / {len(post)} modules",
)
pre, post = pre[-1], post[-1]
fact(
    count(pre, "fusion") == 0 and operand_counts(pre, "all-reduce") == [1] * LAYERS,
    "PRE_SCHEDULER on XLA:GPU is before fusion and before all-reduce combining (one all-reduce per gradient)",
    f"{count(pre, 'fusion')} fusions, all-reduce operand counts {operand_counts(pre, 'all-reduce')}",
)


def reduced_elements(text: str) -> list[int]:
    """Elements each async all-reduce carries (its result shape)."""
    return [int(n) for n in re.findall(r"all-reduce-start = \(\(f32\[(\d+)\]", text)]


fact(
    count(post, "fusion") > 0
    and reduced_elements(post) == [LAYERS * WIDTH * WIDTH]
    and "is_scheduled=true" in post.split("\n", 1)[0],
    "POST_SCHEDULER on XLA:GPU is fused, combined and scheduled: one async all-reduce of every gradient, "
    "concatenated into one flat buffer and sliced after",
    f"{count(post, 'fusion')} fusions, async all-reduces of {reduced_elements(post)} elements",
)
fact(
    "__cublas$gemm" in post or "kCustom" in post,
    "XLA:GPU's dots become cuBLAS / Triton gemm fusions",
    f"{post.count('kCustom')} kCustom fusions",
)
fact(
    count(final, "all-reduce") == 1
    and count(final, "all-reduce-start") == 0
    and count(final, "concatenate") + final.count("wrapped_concatenate") > 0,
    "after POST_SCHEDULER an async all-reduce with nothing to overlap becomes a synchronous one "
    "over a concatenated buffer",
    f"compiled: {count(final, 'all-reduce')} all-reduce, {count(final, 'all-reduce-start')} all-reduce-start",
)


def drop_one_allreduce(text: str) -> str:
    """The first gradient's all-reduce becomes a copy (compile-only: what matters is the edit)."""
    return re.sub(r"= (f32\[\d+,\d+\]\{1,0\}) all-reduce\((%[\w.\-]+)\)[^\n]*", r"= \1 copy(\2)", text, count=1)


rec.reset(edit=("PRE_SCHEDULER", drop_one_allreduce))
final = lowered.compile(compiler_options={"xla_debug_buffer_assignment_show_max": 302}).as_text()
post = rec.texts["POST_SCHEDULER"][-1]
fact(
    reduced_elements(post) == [(LAYERS - 1) * WIDTH * WIDTH],
    "a module returned at PRE_SCHEDULER is what XLA:GPU compiles "
    "(one all-reduce replaced: the combined one carries 3 gradients)",
    f"async all-reduces of {reduced_elements(post)} elements",
)


def barrier_after_sine(text: str) -> str:
    """sin's result passes through tuple -> opt-barrier -> get-tuple-element before its user."""
    m = re.search(r"%([\w.\-]+) = (f32\[[\d,]*\]\{[\d,]*\}) sine\(", text)
    name, shape = m.groups()
    lines, out = text.split("\n"), []
    for line in lines:
        if f"%{name} = " in line:
            out.append(line)
            out.append(f"  %{name}.t = ({shape}) tuple(%{name})")
            out.append(f"  %{name}.b = ({shape}) opt-barrier(%{name}.t)")
            out.append(f"  %{name}.g = {shape} get-tuple-element(%{name}.b), index=0")
        else:
            out.append(
                re.sub(rf"%{re.escape(name)}(?=[,)])", f"%{name}.g", line)
                if "= " in line and f"%{name}" in line.split("=", 1)[1]
                else line
            )
    return "\n".join(out)


@jax.jit
def step_chain(x):
    return jnp.exp(jnp.sin(x)) * 2


chain = step_chain.lower(jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=NamedSharding(mesh, P())))
plain = chain.compile(compiler_options={"xla_debug_buffer_assignment_show_max": 303}).as_text()
rec.reset(edit=("PRE_SCHEDULER", barrier_after_sine))
split = chain.compile(compiler_options={"xla_debug_buffer_assignment_show_max": 304}).as_text()
fact(
    count(plain, "fusion") == 1 and count(split, "fusion") == 2 and "opt-barrier" not in split,
    "an optimization barrier added at PRE_SCHEDULER is a fusion boundary on XLA:GPU, removed after fusion",
    f"{count(plain, 'fusion')} fusion without, {count(split, 'fusion')} with the barrier; "
    f"barrier left: {'opt-barrier' in split}",
)
finish()
