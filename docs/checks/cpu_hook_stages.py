"""XLA:CPU: what the pass hook receives at each stage, and that a module returned from the
PRE_SCHEDULER stage is what XLA:CPU compiles. Run: `python docs/checks/cpu_hook_stages.py`."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import re  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from _common import Recorder, count, entry, fact, finish, operand_counts  # noqa: E402

from disco_jax import _compile, _program, _strategy, backends, zoo  # noqa: E402

rec = Recorder("cpu")
spec = zoo.get_model("mlp", "tiny")
step, state, batch = zoo.make_train_step(spec, optax.sgd(0.1), zoo.data_mesh(8), "jit")
gradients = len(jax.tree.leaves(state.params))
lowered = step.lower(state, batch)

rec.reset()
compiled = lowered.compile(compiler_options={"xla_debug_buffer_assignment_show_max": 101})
pre, post = rec.texts["PRE_SCHEDULER"][-1], rec.texts["POST_SCHEDULER"][-1]
fact(count(pre, "fusion") > 0, "PRE_SCHEDULER on CPU is after fusion", f"{count(pre, 'fusion')} fusions")
fact(
    operand_counts(pre, "all-reduce") == [gradients + 1],
    "PRE_SCHEDULER on CPU is after the all-reduce combiner (one variadic all-reduce of every gradient and the loss)",
    f"all-reduce operand counts {operand_counts(pre, 'all-reduce')}, {gradients} parameters",
)
fact(
    "is_scheduled=true" not in pre.split("\n", 1)[0] and "is_scheduled=true" in post.split("\n", 1)[0],
    "PRE_SCHEDULER is unscheduled, POST_SCHEDULER scheduled",
    post.split("\n", 1)[0][:80],
)


@jax.jit
def step_in_place(x):
    return x.at[0].set(1.0), x  # the input is still returned: the update needs its own buffer


rec.reset()
step_in_place.lower(jax.numpy.zeros(8)).compile()
fact(
    "copy(" in rec.texts["PRE_SCHEDULER"][-1],
    "copy insertion has run before PRE_SCHEDULER on CPU (an in-place update gets a copy of its input)",
    f"{rec.texts['PRE_SCHEDULER'][-1].count(' copy(')} copies",
)


def kernels(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """(fusion kind, ops inside) of every entry fusion."""
    result = []
    for m in re.finditer(r"= [^\n]* fusion\([^\n]*kind=(\w+)[^\n]*calls=%([\w.\-]+)", entry(text)):
        body = text.split(f"%{m.group(2)} ", 1)[1].split("\n}\n", 1)[0]
        ops = [o for o in re.findall(r"= [^=\n]*? ([a-z\-]+)\(", body) if o not in ("parameter", "constant")]
        result.append((m.group(1), tuple(ops)))
    return result


# Every fusible op returned bare (disco-jax's unfused strategy): XLA:CPU wraps each lone op,
# broadcasts included, in a one-op kLoop fusion after the hook; it forms no multi-op fusion.
program = _program.build_program(pre, backends.CPU)
unfused, _ = _compile.compile_strategy(lowered, program, _strategy.unfused(program.graph))
after = kernels(unfused.as_text())
loop = [ops for kind, ops in after if kind == "kLoop"]
fact(
    max((len(o) for o in loop), default=0) == 1,
    "XLA:CPU forms no multi-op fusion after PRE_SCHEDULER: ops returned bare stay one kernel each",
    f"{len(loop)} kLoop fusions after the hook, largest {max((len(o) for o in loop), default=0)} op(s)",
)
import jaxlib  # noqa: E402

wraps = tuple(int(p) for p in jaxlib.__version__.split(".")[:2]) >= (0, 12)
fact(
    (("broadcast",) in loop) == wraps,
    "jaxlib 0.12 wraps lone ops returned from PRE_SCHEDULER, broadcasts included, in one-op kLoop fusions; "
    "0.11.2 leaves broadcasts bare",
    f"one-op kLoop fusions: {sorted(set(o[0] for o in loop))}",
)


def split_allreduce(text: str) -> str:
    """The variadic all-reduce becomes one all-reduce per operand (tuple rebuilt for its users)."""
    lines = text.split("\n")
    out = []
    for line in lines:
        m = re.match(r"(\s*)%([\w.\-]+) = \((.*)\) all-reduce\(([^)]*)\), (.*)$", line)
        if not m:
            out.append(line)
            continue
        indent, name, shapes, operands, attrs = m.groups()
        shapes = re.findall(r"[a-z0-9]+\[[^\]]*\](?:\{[^}]*\})?", shapes)
        operands = [o.strip() for o in operands.split(",")]
        attrs = re.sub(r"channel_id=\d+", "channel_id={}", attrs)
        parts = []
        for i, (shape, operand) in enumerate(zip(shapes, operands)):
            out.append(
                f"{indent}%{name}.split{i} = {shape} all-reduce({operand}), "
                + attrs.replace("channel_id={}", f"channel_id={900 + i}")
            )
            parts.append(f"%{name}.split{i}")
        out.append(f"{indent}%{name} = ({', '.join(shapes)}) tuple({', '.join(parts)})")
    return "\n".join(out)


rec.reset(edit=("PRE_SCHEDULER", split_allreduce))
edited = lowered.compile(compiler_options={"xla_debug_buffer_assignment_show_max": 102})
final = edited.as_text()
fact(
    operand_counts(final, "all-reduce") == [1] * (gradients + 1),
    "a module returned at PRE_SCHEDULER is what XLA:CPU compiles "
    "(the combined all-reduce, split by the hook, stays split)",
    f"compiled all-reduce operand counts {operand_counts(final, 'all-reduce')}",
)
reference, result = compiled(state, batch), edited(state, batch)
fact(
    all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(result))),
    "splitting the all-reduce leaves outputs bitwise equal",
    "compared every output leaf",
)

rec.reset()
lowered.compile(compiler_options={"xla_debug_buffer_assignment_show_max": 101})
fact(
    not rec.texts["PRE_SCHEDULER"],
    "the same compile options hit JAX's in-memory cache: the hook does not run again",
    f"{len(rec.texts['PRE_SCHEDULER'])} modules seen",
)
rec.reset()
lowered.compile(compiler_options={"xla_debug_buffer_assignment_show_max": 103})
fact(
    len(rec.texts["PRE_SCHEDULER"]) == 1,
    "a fresh xla_debug_buffer_assignment_show_max value forces a compile through the hook",
    f"{len(rec.texts['PRE_SCHEDULER'])} modules seen",
)
finish()
