"""XLA:CPU pass names in `xla_disable_hlo_passes`: which ones take effect, which are silently
ignored. Run: `python docs/checks/cpu_pass_names.py`.

A pass counts as taking effect when disabling it changes the compiled module the way its name
says (fewer multi-op fusions, more all-reduces, a barrier kept). Names XLA does not know are not
an error: they are ignored, which is why each name the library uses is checked here."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import itertools  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from _common import count, entry, fact, finish  # noqa: E402

from disco_jax import zoo  # noqa: E402

spec = zoo.get_model("mlp", "tiny")
step, state, batch = zoo.make_train_step(spec, optax.sgd(0.1), zoo.data_mesh(8), "jit")
lowered = step.lower(state, batch)
fresh = itertools.count(200)


def compiled_text(disabled: str | None, lowered=lowered) -> str:
    options = {"xla_debug_buffer_assignment_show_max": next(fresh)}
    if disabled:
        options["xla_disable_hlo_passes"] = disabled
    return lowered.compile(compiler_options=options).as_text()


def multi_op_fusions(text: str) -> int:
    n = 0
    for m in re.finditer(r"= [^\n]* fusion\([^\n]*kind=kLoop[^\n]*calls=%([\w.\-]+)", entry(text)):
        body = text.split(f"%{m.group(1)} ", 1)[1].split("\n}\n", 1)[0]
        ops = [o for o in re.findall(r"= [^=\n]*? ([a-z\-]+)\(", body) if o not in ("parameter", "constant")]
        n += len(ops) > 1
    return n


default = compiled_text(None)
base = {"multi-op fusions": multi_op_fusions(default), "all-reduces": count(default, "all-reduce")}
print(f"default: {base}")
observed = {}
for name in (
    "fusion",
    "cpu-all-reduce-combiner",
    "all-reduce-combiner",
    "cpu-instruction-fusion",
    "fusion_wrapper",
    "loop-fusion",
):
    text = compiled_text(name)
    observed[name] = {"multi-op fusions": multi_op_fusions(text), "all-reduces": count(text, "all-reduce")}
fact(
    observed["fusion"]["multi-op fusions"] == 0 < base["multi-op fusions"],
    "'fusion' disables XLA:CPU's loop fusion (no multi-op kLoop fusion left)",
    observed["fusion"],
)
fact(
    observed["cpu-all-reduce-combiner"]["all-reduces"] > base["all-reduces"] == 1,
    "'cpu-all-reduce-combiner' disables the CPU all-reduce combiner",
    observed["cpu-all-reduce-combiner"],
)
for name in ("all-reduce-combiner", "cpu-instruction-fusion", "fusion_wrapper", "loop-fusion"):
    fact(observed[name] == base, f"'{name}' is silently ignored by XLA:CPU", observed[name])


@jax.jit
def step_barrier(x):
    y = jax.lax.optimization_barrier(jax.numpy.sin(x))
    return jax.numpy.exp(y) * 2


barrier = step_barrier.lower(jax.numpy.ones(8))
fact(
    "opt-barrier" not in compiled_text(None, barrier),
    "XLA:CPU strips optimization barriers by default",
    "no opt-barrier in the compiled module",
)
fact(
    "opt-barrier" in compiled_text("cse_barrier_expander", barrier),
    "disabling 'cse_barrier_expander' keeps them",
    "opt-barrier in the compiled module",
)
finish()
