"""Compiling a strategy, running what was compiled, and reading back what XLA kept.

These are the pipeline's hands (and the evaluation harness's, through the same public names):

* `compile_strategy` compiles the step with a strategy written into its module at the backend's
  hook stage (`program.backend.rewriter`);
* every compile of a step, XLA's own plan (`capture_program`) and each strategy's, gets the proven
  sharding rules the backend applies at the hook (`Backend.hook_rules`, `sharding.apply`): what
  was applied where is `Program.rules_applied` for XLA's plan and `rules_applied(program, strategy)`
  for a strategy's, and `keeps_plan` checks that XLA compiled the collectives the hook returned;
* `Runner` calls a compiled step repeatedly with fresh copies of the inputs it donates;
* `compiled_stats` counts what a compiled module holds (the truth of a plan: all-reduces and
  fusions as XLA emitted them);
* `compile_program` is the one path every strategy of a step takes to a `CompiledProgram`:
  compile options (XLA enacts it) or the rewriter (we enact it), timed, and marked not enacted,
  with the reason, where neither works;
* `rank_by_compiled_cost` orders a search's best candidates, and XLA's own program, by what
  their compiled programs cost (`cost.compiled`): how a plan is chosen wherever one is chosen;
* `step_devices` lists the devices a call's arrays live on;
* `capture` turns a lowered step into a `Captured` program: the `Program` (graph and backend) and
  XLA's own executable.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import jax

from disco_jax import _capture, _hlo, _output_check
from disco_jax._graph import Graph, build_graph
from disco_jax._plan import MachineKey
from disco_jax._program import Program
from disco_jax._strategy import Strategy
from disco_jax.backends import Backend
from disco_jax.sharding import apply


def donated(lowered: jax.stages.Lowered) -> list[bool]:
    """Per input leaf of a lowered step, whether the step donates its buffer."""
    return [bool(getattr(a, "donated", False)) for a in jax.tree.leaves(lowered.args_info)]


class Runner:
    """Calls a compiled step with fresh copies of the inputs it donates, so it can run again."""

    def __init__(
        self, compiled: Any, lowered: jax.stages.Lowered | None, args: tuple, kwargs: dict, donates: bool | None = None
    ):
        self.compiled, self.args, self.kwargs = compiled, args, kwargs
        self.donates = any(donated(lowered)) if donates is None else donates

    def __call__(self, *_ignored):
        args, kwargs = self.args, self.kwargs
        if self.donates:
            args, kwargs = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, (args, kwargs))
        return self.compiled(*args, **kwargs)

    def on(self, args: tuple, kwargs: dict) -> Any:
        """The executable's outputs on other values of the same arguments (the output check's
        moved state): each array placed in the sharding this runner's own argument has, so a
        program that shards its optimizer state takes values another program returned."""
        own = jax.tree.leaves((self.args, self.kwargs))
        values, tree = jax.tree.flatten((args, kwargs))
        placed = [_output_check.placed_like(v, o) for v, o in zip(values, own)]
        return Runner(self.compiled, None, *jax.tree.unflatten(tree, placed), donates=self.donates)()

    def as_text(self) -> str:
        return self.compiled.as_text()


def step_devices(args: tuple, kwargs: dict) -> list:
    """The devices the call's arrays live on, by id (JAX's default devices when none)."""
    devices = {}
    for leaf in jax.tree.leaves((args, kwargs)):
        if isinstance(leaf, jax.Array):
            for d in leaf.sharding.device_set:
                devices[d.id] = d
    return [devices[k] for k in sorted(devices)] or jax.devices()


_TRIVIAL = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast"})


def compiled_stats(text: str) -> dict[str, int]:
    """What a compiled module's entry computation holds: all-reduces (and how many tensors they
    carry), reduce-scatters, all-gathers, fusions of any kind, loop fusions, loop fusions of more
    than one compute instruction (op fusion proper: with the `fusion` pass off, XLA:CPU still
    wraps single ops in one-instruction kLoop fusions), library-call custom fusions, and custom
    fusions that compute more than their one op (XLA:GPU: a gemm with a fused elementwise
    prologue or epilogue, a Triton softmax fusion); and, inside the `while` bodies, the
    all-reduces of more than one tensor (what `Strategy.packed_loops` packs)."""
    module = _hlo.parse_module(text)
    stats = {
        "all-reduce": 0,
        "all-reduce-operands": 0,
        "reduce-scatter": 0,
        "all-gather": 0,
        "fusion": 0,
        "loop_fusions": 0,
        "multi_op_loop_fusions": 0,
        "custom_fusions": 0,
        "multi_op_custom_fusions": 0,
        "loop_variadic_all-reduces": 0,
    }
    bodies = {
        i.attr("body", "").lstrip("%") for c in module.computations for i in c.instructions if i.opcode == "while"
    }
    for comp in module.computations:
        if comp.name in bodies:
            stats["loop_variadic_all-reduces"] += sum(
                1 for i in comp.instructions if i.opcode in ("all-reduce", "all-reduce-start") and len(i.operands) > 1
            )
    for inst in module.entry.instructions:
        if inst.opcode in ("all-reduce", "all-reduce-start"):
            stats["all-reduce"] += 1
            stats["all-reduce-operands"] += len(inst.operands)
        elif inst.opcode.removesuffix("-start") in ("reduce-scatter", "all-gather"):
            stats[inst.opcode.removesuffix("-start")] += 1
        elif inst.opcode == "fusion":
            stats["fusion"] += 1
            comp = module.computation((inst.attr("calls") or "").lstrip("%"))
            multi_op = sum(1 for i in comp.instructions if i.opcode not in _TRIVIAL) > 1
            kind = "custom" if inst.attr("kind") == "kCustom" else "loop"
            stats[f"{kind}_fusions"] += 1
            stats[f"multi_op_{kind}_fusions"] += multi_op
    return stats


def plan_tag(fingerprint: str, strategy_json: dict, hook_rules: frozenset[str] = frozenset()) -> str:
    """Cache tag of a plan: JAX's executable cache must not serve one plan's executable for another
    (nor for the same plan compiled with other hook rules: a program whose layout gathers its
    parameters again has the module of one that does not, `update.hook_backend`)."""
    key = json.dumps([strategy_json, sorted(hook_rules)], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return f"{fingerprint}:{digest}"


def with_hook_rules(backend: Backend, text: str) -> apply.Applied:
    """`text` with the sharding rules `backend` applies at the hook (`Backend.hook_rules`)."""
    return apply.apply_rules(text, backend.hook_rules) if backend.hook_rules else apply.Applied(text)


def hook_rules_handler(backend: Backend, applied: list[apply.Applied]) -> Callable[[str], str | None]:
    """The hook handler that compiles XLA's own plan with `backend`'s hook rules: the module
    rewritten where a rule applied (None: unchanged); each result is appended to `applied`."""

    def handler(text: str) -> str | None:
        applied.append(with_hook_rules(backend, text))
        return applied[-1].text if applied[-1].applications else None

    return handler


# Per plan tag (`plan_tag`): the rules applied to the module `compile_strategy` returned at the
# hook, and the all-reduces and reduce-scatters that module holds (the latest few hundred plans;
# an older one is rewritten again when asked for).
_HOOK_RESULTS: dict[str, tuple[tuple[dict, ...], dict[str, int]]] = {}
_HOOK_RESULTS_KEPT = 256


def _rewritten(program: Program, strategy: Strategy, tag: str) -> str:
    """The module text the hook returns for `strategy`: its rewrite, with the hook rules."""
    backend = program.backend
    applied = with_hook_rules(backend, backend.rewriter.rewrite(program, strategy))
    counts = {"all-reduce": len(strategy.buckets), "reduce-scatter": 0}  # the rewrite's, no rule applied
    if applied.applications:
        counts = {"all-reduce": 0, "reduce-scatter": 0}
        for inst in _hlo.parse_module(applied.text).entry.instructions:
            if inst.opcode in counts:
                counts[inst.opcode] += 1
    _HOOK_RESULTS[tag] = (applied.applications, counts)
    while len(_HOOK_RESULTS) > _HOOK_RESULTS_KEPT:
        del _HOOK_RESULTS[next(iter(_HOOK_RESULTS))]
    return applied.text


def _hook_result(program: Program, strategy: Strategy) -> tuple[tuple[dict, ...], dict[str, int]]:
    tag = plan_tag(program.graph.fingerprint, strategy.to_json(program.graph), program.backend.hook_rules)
    if tag not in _HOOK_RESULTS:
        _rewritten(program, strategy, tag)
    return _HOOK_RESULTS[tag]


def rules_applied(program: Program, strategy: Strategy) -> list[dict]:
    """The sharding rules applied at the hook to `strategy`'s module: per application its rule,
    the instructions it matched (`at`) and the instruction it made (`result`)."""
    return list(_hook_result(program, strategy)[0])


def keeps_plan(counts: dict[str, int], program: Program, strategy: Strategy) -> bool:
    """Whether a compiled strategy (`compiled_stats` of it) holds the all-reduces the hook
    returned (one per bucket, less those the hook rules turned into reduce-scatters; its loop
    bodies' all-reduces each one flat buffer where it packs them) and, where
    the pipeline makes reduce-scatters itself (`apply.REDUCE_SCATTER_RULE` a hook rule), its
    reduce-scatters; a compiler that forms them after the hook (XLA:GPU) may add more."""
    planned = _hook_result(program, strategy)[1]
    if counts["all-reduce"] != planned["all-reduce"]:
        return False
    if strategy.packed_loops and counts.get("loop_variadic_all-reduces", 0):
        return False
    scatters = apply.REDUCE_SCATTER_RULE in program.backend.hook_rules
    return not scatters or counts.get("reduce-scatter", 0) == planned["reduce-scatter"]


def compile_strategy(
    lowered: jax.stages.Lowered, program: Program, strategy: Strategy, compiler_options: dict | None = None
) -> tuple[Any, str]:
    """Compile the step with `strategy` rewritten into its module at the hook (and the backend's
    hook rules applied to it). `compiler_options` (e.g. `backends.gpu.collective_options(...)`)
    go on top of the backend's `rewrite_options`.

    Returns (compiled, status): 'rewritten'; 'cached' when JAX served the executable compiled
    earlier for the same plan, in this process or from the persistent compilation cache (the
    cache key carries the plan's digest); or
    'fingerprint-mismatch' when the module at the hook is not the one the plan was made for
    (it is then compiled unmodified)."""
    graph, backend = program.graph, program.backend
    tag = plan_tag(graph.fingerprint, strategy.to_json(graph), backend.hook_rules)
    text = _rewritten(program, strategy, tag)
    status = ["cached"]

    def handler(module_text: str) -> str | None:
        if _hlo.fingerprint(module_text) != graph.fingerprint:
            status[0] = "fingerprint-mismatch"
            return None
        status[0] = "rewritten"
        return text

    options = {**backend.rewrite_options, **(compiler_options or {})}
    if compiler_options:
        tag += ":" + hashlib.sha256(json.dumps(compiler_options, sort_keys=True).encode()).hexdigest()[:16]
    compiled = _capture.compile_with_hook(
        lowered,
        handler,
        cache_tag=tag,
        compiler_options=options,
        platform=backend.platform,
        stage=backend.hook_stage,
    )
    return compiled, status[0]


ENACTED = ("compiled", "rewritten", "cached")  # a CompiledProgram's statuses where it holds the strategy


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """One strategy of a step as XLA compiled it: the program a simulated figure is costed on.

    name: the strategy's name (a baseline's, or the plan's). enacted_by: "compile options" (XLA
    compiles the step its own way under them) or "rewrite" (the strategy written into the module
    at the hook, `compile_strategy`). compiler_options: every XLA option the compile ran with (for
    a rewrite, the backend's `rewrite_options` included). status: 'compiled' (options), 'rewritten'
    or 'cached' (rewrite, see `compile_strategy`), or 'not enacted' with the `reason`; `compiled`
    (the `jax.stages.Compiled`) is None then. compile_s / compile_cpu_s: wall and process CPU
    seconds of the compile (CPU time is the figure to compare on a shared machine).
    same_program_as: the name the same program was compiled under first, when `Programs` served
    it again (its compile seconds are that compile's)."""

    name: str
    enacted_by: str
    compiler_options: dict
    status: str
    compiled: Any = dataclasses.field(default=None, repr=False, compare=False)
    reason: str | None = None
    compile_s: float = 0.0
    compile_cpu_s: float = 0.0
    same_program_as: str | None = None  # compiled before under this name (`Programs`): no compile of its own

    @property
    def enacted(self) -> bool:
        return self.status in ENACTED

    @functools.cached_property
    def text(self) -> str | None:
        """The compiled module (scheduled, after every pass of XLA's): what runs."""
        return None if self.compiled is None else self.compiled.as_text()

    @functools.cached_property
    def stats(self) -> dict[str, int] | None:
        return None if self.text is None else compiled_stats(self.text)

    def to_json(self) -> dict:
        """The record a row keeps (not the module text)."""
        return {
            "name": self.name,
            "enacted_by": self.enacted_by,
            "compiler_options": {k: str(v) for k, v in self.compiler_options.items()},
            "status": self.status,
            "reason": self.reason,
            "compiled": self.stats,
            "compile_s": round(self.compile_s, 3),
            "compile_cpu_s": round(self.compile_cpu_s, 3),
            "same_program_as": self.same_program_as,
        }


def compile_program(
    lowered: jax.stages.Lowered,
    program: Program | None,
    name: str,
    strategy: Strategy | None,
    compiler_options: dict | None,
    hook_rules_of: Backend | None = None,
) -> CompiledProgram:
    """Compile one strategy of the step the way it is enacted: with `compiler_options` (XLA's own
    program under them; neither `strategy` nor `program` is read, so a step never captured passes
    None) or, when they are None, by writing `strategy` into the module at the hook
    (`compile_strategy`). XLA's own program gets the hook rules of `program`'s backend (or of
    `hook_rules_of`, for a program not captured yet: a sharded update's, compiled for its peak),
    as the decorator's capture gives them to the program it runs, so that it is compared with
    rewritten strategies (which get them too) on one footing. A strategy the rewriter refuses, or
    a compile XLA fails, gives a program marked 'not enacted' with the reason instead of an error."""
    enacted_by = "rewrite" if compiler_options is None else "compile options"
    hook_rules_of = hook_rules_of or (program.backend if program is not None else None)
    options = {**program.backend.rewrite_options} if compiler_options is None else dict(compiler_options)
    started, cpu = time.perf_counter(), time.process_time()
    try:
        if compiler_options is None:
            compiled, status = compile_strategy(lowered, program, strategy)
        elif hook_rules_of is not None and hook_rules_of.hook_rules:
            compiled, status = _with_hook_rules(lowered, hook_rules_of, options), "compiled"
        else:
            compiled, status = lowered.compile(compiler_options=options or None), "compiled"
    except (ValueError, jax.errors.JaxRuntimeError) as e:
        compiled, status, reason = None, "not enacted", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    else:
        reason = None
        if status == "fingerprint-mismatch":  # compiled unmodified: not this strategy
            status, reason = "not enacted", "the module at the hook is not the captured one (compiled unmodified)"
    return CompiledProgram(
        name,
        enacted_by,
        options,
        status,
        compiled if reason is None else None,
        reason,
        time.perf_counter() - started,
        time.process_time() - cpu,
    )


def _with_hook_rules(lowered: jax.stages.Lowered, backend: Backend, options: dict) -> Any:
    """XLA's own program of `lowered` under `options`, with `backend`'s hook rules applied at its
    hook stage; cached under the module, the rules and the options (a cached executable was
    compiled with the same rules)."""
    key = json.dumps([sorted(backend.hook_rules), options], sort_keys=True) + lowered.as_text()
    return _capture.compile_with_hook(
        lowered,
        hook_rules_handler(backend, []),
        cache_tag="hook-rules:" + hashlib.sha256(key.encode()).hexdigest()[:24],
        compiler_options=options or None,
        platform=backend.platform,
        stage=backend.hook_stage,
    )


class Programs:
    """The compiled programs of one lowered step (`lowered`, captured as `program`), each compiled
    once: a program under compile options is shared by every strategy enacted with them, a
    rewritten one by every equal strategy (rows of several clusters share one target's programs)."""

    def __init__(self, lowered: jax.stages.Lowered, program: Program):
        self.lowered, self.program = lowered, program
        self._by_key: dict[tuple, CompiledProgram] = {}

    def compile(self, name: str, strategy: Strategy | None, compiler_options: dict | None) -> CompiledProgram:
        """`compile_program` of this step, or the same program compiled earlier (under `name`)."""
        if compiler_options is None:
            key: tuple = ("rewrite", strategy.key())
        else:
            key = ("compile options", json.dumps(compiler_options, sort_keys=True, default=str))
        if key not in self._by_key:
            self._by_key[key] = compile_program(self.lowered, self.program, name, strategy, compiler_options)
        found = self._by_key[key]
        return found if found.name == name else dataclasses.replace(found, name=name, same_program_as=found.name)

    def __iter__(self):
        """Every program compiled so far, under the name it was first compiled under."""
        return iter(list(self._by_key.values()))


@dataclasses.dataclass
class Captured:
    """One program of a decorated step, captured: the lowered step, its `Program` (the module as
    a graph at the backend's hook stage, with the backend), XLA's own executable, the call's
    dynamic arguments (what executables take), the devices they live on, and the machine key
    plans are stored under. `scope` names
    the program's multi-process exchanges (None in a single process). `exact`: the float64 run of
    the call (`_output_check.Float64Run`), shared by every program of the call; None where the
    function is not known (the ulp tolerance then judges candidates' outputs)."""

    lowered: jax.stages.Lowered
    program: Program
    default_compiled: Any
    args: tuple
    kwargs: dict
    devices: list
    machine: MachineKey
    scope: str | None = None
    exact: _output_check.Float64Run | None = None

    @functools.cached_property
    def output_check(self) -> _output_check.OutputCheck:
        """How candidates' outputs are judged against this program's (one per program: XLA's
        outputs are run once, the float64 run once per call)."""

        return _output_check.OutputCheck(self.runner(self.default_compiled).on, self.args, self.kwargs, self.exact)

    @property
    def graph(self) -> Graph:
        """The program's graph IR (`program.graph`)."""
        return self.program.graph

    @property
    def backend(self) -> Backend:
        """The compiler the program is captured for (`program.backend`)."""
        return self.program.backend

    @property
    def module_name(self) -> str:
        """The module's name as XLA compiles it (profiler traces name kernels under it)."""
        return _capture.module_name(self.lowered)

    def default_copy(self) -> Any:
        """XLA's own executable of this program compiled a second time: the same program and
        options as `default_compiled` (only the debug option that keys JAX's caches differs,
        `_capture.CACHE_KEY_OPTION`), a separate executable that others are timed against. Where
        the backend applies hook rules, they are applied to the copy as to `default_compiled`
        (`_with_hook_rules`: its cache tag names the rules, so a cached copy had them too)."""
        backend = self.backend
        if backend.hook_rules:
            return _with_hook_rules(self.lowered, backend, dict(backend.decisions_options))
        tag = _capture.cache_key_value(f"copy/{self.graph.fingerprint}")
        options = {**backend.decisions_options, _capture.CACHE_KEY_OPTION: tag}
        return self.lowered.compile(compiler_options=options)

    def runner(self, compiled: Any, args: tuple | None = None, kwargs: dict | None = None) -> Runner:
        """A `Runner` of `compiled` on this call's arguments (or on others of the same signature)."""
        return Runner(
            compiled, self.lowered, self.args if args is None else args, self.kwargs if kwargs is None else kwargs
        )


def capture_program(
    lowered: jax.stages.Lowered, backend: Backend, compiler_options: dict | None = None
) -> tuple[Program, Any]:
    """The step's program (its graph at `backend`'s hook stage) and XLA's unmodified executable,
    from one compile. Where the hook stage comes before XLA's own fusion and combining (XLA:GPU),
    the graph also carries those decisions, read at the backend's `decisions_stage` of the same
    compile. Needs no device: a step lowered for compile-only devices (`disco_jax.targets`)
    captures the same way. The compile runs with the backend's `decisions_options` (XLA's plan as
    the graph can express it); the executable is XLA's under them, with the backend's hook rules
    applied (`Program.rules_applied` says where)."""
    stages = (backend.hook_stage,) + ((backend.decisions_stage,) if backend.decisions_stage else ())
    options = {**backend.decisions_options, **(compiler_options or {})} or None
    applied: list[apply.Applied] = []
    texts, compiled = _capture.capture_stages(
        lowered,
        stages,
        options,
        platform=backend.platform,
        rewrites={backend.hook_stage: hook_rules_handler(backend, applied)},
    )
    graph = build_graph(texts[backend.hook_stage], backend.fusible)
    if backend.decisions_stage and backend.read_decisions is not None:
        graph = backend.read_decisions(graph, texts[backend.decisions_stage])
    return Program(graph, backend, applied[-1].applications if applied else ()), compiled


def capture(lowered: jax.stages.Lowered, backend: Backend, args: tuple, kwargs: dict) -> Captured:
    """Capture `lowered` at `backend`'s hook stage and compile it with XLA's plan (one compile;
    the backend's hook rules applied, as to every program of the step).
    `args`/`kwargs`: the call's dynamic arguments."""
    program, default_compiled = capture_program(lowered, backend)
    if backend.decisions_options:  # the unmodified step is XLA's own, all its passes on
        default_compiled = lowered.compile()
    devices = step_devices(args, kwargs)
    return Captured(lowered, program, default_compiled, args, kwargs, devices, MachineKey.current(devices))
