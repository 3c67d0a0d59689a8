"""XLA:GPU compile options that enact DisCo's baselines (`backends.gpu.BASELINE_OPTIONS`): which
pass names turn off op fusion and all-reduce combining, what the compiled module then holds, and
what stays fused. Deviceless, 8 H100s; needs the CUDA PJRT plugin (the `gpu-compile` extra).
Run: `python docs/checks/cuda_baseline_options.py`.

`xla_disable_hlo_passes` ignores names it does not know, so each name is checked by what it
changes in the compiled module."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"  # compile-only CUDA devices come from the topology, not a client
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

import itertools  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _common import fact, finish  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from disco_jax import targets  # noqa: E402
from disco_jax._compile import compiled_stats  # noqa: E402
from disco_jax.backends.gpu import BASELINE_OPTIONS, NO_FUSION_PASSES  # noqa: E402

LAYERS, WIDTH = 3, 128
mesh = targets.mesh("h100-sxm", 8)
replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
fresh = itertools.count(400)


def step(params, x):
    def loss(params):
        h = x
        for w, b in params:
            h = jnp.tanh(h @ w + b)
        return jnp.sum(h**2)

    return jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params))


weight = jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32, sharding=replicated)
bias = jax.ShapeDtypeStruct((WIDTH,), jnp.float32, sharding=replicated)
params = [(weight, bias)] * LAYERS
x = jax.ShapeDtypeStruct((64, WIDTH), jnp.float32, sharding=batch)
lowered = jax.jit(step).lower(params, x)
GRADIENTS = 2 * LAYERS


def compiled(options: dict, on=lowered) -> str:
    return on.compile(compiler_options={"xla_debug_buffer_assignment_show_max": next(fresh), **options}).as_text()


def disabled(passes: str, **options) -> str:
    return compiled({"xla_disable_hlo_passes": passes, **options})


def brief(text: str) -> dict:
    s = compiled_stats(text)
    return {
        k: s[k] for k in ("fusion", "multi_op_loop_fusions", "custom_fusions", "multi_op_custom_fusions", "all-reduce")
    }


default = compiled({})
base = brief(default)
print(f"default: {base}")
fact(
    base["multi_op_loop_fusions"] > 0 and base["all-reduce"] == 1,
    "XLA:GPU's default fuses ops into multi-op loop fusions and combines every gradient into one all-reduce",
    base,
)

no_fusion = disabled("fusion")
observed = brief(no_fusion)
fact(
    observed["multi_op_loop_fusions"] == 0 and observed["fusion"] > base["fusion"],
    "'fusion' (the pipeline of priority-fusion and multi_output_fusion) disables XLA:GPU's op fusion: "
    "no multi-op loop fusion, each op alone in a fusion of its own (fusion-wrapper)",
    observed,
)
fact(
    observed["multi_op_custom_fusions"] > 0 and "__triton_nested_gemm_fusion" in no_fusion,
    "with 'fusion' off, Triton gemm fusions keep the elementwise prologues/epilogues the gemm rewriter fused "
    "into them before that pipeline",
    f"{observed['multi_op_custom_fusions']} of {observed['custom_fusions']} gemm fusions compute more than a dot",
)
priority_only = brief(disabled("priority-fusion"))
fact(
    priority_only["multi_op_loop_fusions"] > 0,
    "'priority-fusion' alone is not enough: multi_output_fusion still fuses (siblings, producers)",
    priority_only,
)
try:
    disabled("fusion-wrapper")
    wrapper = "compiled"
except jax.errors.JaxRuntimeError as e:
    wrapper = str(e).splitlines()[0][:120]
fact(
    wrapper != "compiled",
    "'fusion-wrapper' cannot be disabled: XLA:GPU emits an op only inside a fusion",
    wrapper,
)
cublas = disabled("fusion", xla_gpu_enable_triton_gemm=False)
epilogues = re.findall(r'"epilogue":"(\w+)"', cublas)
fact(
    "__cublas$lt$matmul" in cublas and "BIAS" in epilogues,
    "without Triton gemms (xla_gpu_enable_triton_gemm=False) dots are cuBLASLt calls, and the bias add is still "
    "fused into them (BIAS epilogue)",
    f"epilogues {sorted(set(epilogues))}",
)

per_gradient = brief(compiled({"xla_gpu_all_reduce_combine_threshold_bytes": "0"}))
no_combiner = brief(disabled("gpu-all-reduce-combiner"))
fact(
    per_gradient["all-reduce"] == no_combiner["all-reduce"] == GRADIENTS,
    "xla_gpu_all_reduce_combine_threshold_bytes=0, like disabling 'gpu-all-reduce-combiner', gives one "
    "all-reduce per gradient",
    f"{per_gradient['all-reduce']} / {no_combiner['all-reduce']} all-reduces for {GRADIENTS} gradients",
)
both = brief(compiled(BASELINE_OPTIONS["JAX_no_fusion"]))
fact(
    both["multi_op_loop_fusions"] == 0 and both["all-reduce"] == GRADIENTS,
    "JAX_no_fusion's options (backends.gpu.BASELINE_OPTIONS): no multi-op loop fusion, one all-reduce per gradient",
    both,
)


attention = jax.jit(lambda x: jax.nn.softmax(x, axis=-1)).lower(
    jax.ShapeDtypeStruct((64, WIDTH), jnp.float32, sharding=replicated)
)
triton = {
    passes: len(re.findall(r'"kind":"__triton"', compiled({"xla_disable_hlo_passes": passes}, attention)))
    for passes in ("fusion", NO_FUSION_PASSES)
}
fact(
    triton["fusion"] > 0 == triton[NO_FUSION_PASSES],
    "the Triton softmax rewriter fuses a softmax's reductions and elementwise ops ('__triton' fusions) outside "
    "the 'fusion' pipeline; disabling 'triton-softmax-rewriter' too leaves none",
    triton,
)


def shared(w, x):
    """One weight used twice: its gradient is the sum of two partial gradients, each reduced."""
    return jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w) ** 2))(w)


tied = jax.jit(shared).lower(weight, x)
threshold_0 = {"xla_gpu_all_reduce_combine_threshold_bytes": "0"}
on = compiled_stats(compiled(threshold_0, tied))["all-reduce"]
off = compiled_stats(compiled({**threshold_0, "xla_disable_hlo_passes": "all-reduce-reassociate"}, tied))["all-reduce"]
fact(
    on < off,
    "all-reduce reassociation (on by default) turns all-reduce(a) + all-reduce(b) into one all-reduce even with "
    "the combiner off: 'no all-reduce combining' needs 'all-reduce-reassociate' disabled too",
    f"tied weight, threshold 0: {on} all-reduce(s) with reassociation, {off} without",
)
finish()
