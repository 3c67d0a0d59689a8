"""XLA:GPU's own collective and scheduling options, searched per program on the compiled program.

What users of JAX on GPUs tune by hand: how many bytes XLA:GPU's combiners pack into one
all-reduce, all-gather and reduce-scatter (three thresholds, XLA's default 30 MiB each) and how
many collectives at most (a count bound every kind shares), the latency-hiding scheduler and the
memory it may schedule into, when collectives start against the compute that needs them (how many
in flight at once, or each as early as its operands allow), and where the step has loops,
collective pipelining (a loop's collective moved to the previous iteration) and loop
double-buffering. Each of these changes the program XLA compiles without a rewrite of ours,
and keeps XLA's own passes (all-reduce reassociation among them), which the GPU rewriter has to
turn off (docs/collectives.md, "Why rewritten GPU candidates lost").

`search_options(lowered, costs)` compiles the step under option sets chosen one dimension at a
time (`dimensions`: each kind's threshold in powers of two, the count bound, the scheduler on and
off, its memory limit, the collectives' order, the loop options where the program has loops),
starting from XLA's defaults (or a given `start`: a sharded update under the replicated step's
options, `eval.ranked.combine`, which searches `update_dimensions` on top) and keeping
each dimension's best before the next (coordinate descent, one pass). Every candidate is compiled
(deviceless for GPU targets: `lowered` on `disco_jax.targets` devices), fingerprinted by its
compiled text (option sets that compile to the same program are one candidate) and costed by the
compiled-program model (`_ranking.ProgramCosts`); its per-device peak is XLA's memory analysis of
the executable. Under `memory_limit_bytes` the choice is the cheapest candidate that fits; where
XLA's default does not fit and another does, the choice says so. `OptionsChoice.to_json()` is what
a plan records: the options chosen, the program they produced (fingerprint, collectives), both
peaks and every candidate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Callable

from disco_jax._compile import CompiledProgram, compile_program
from disco_jax._ranking import ProgramCosts
from disco_jax.cost.compiled import CompiledCost
from disco_jax.sharding import choice

MiB = 1 << 20
# XLA:GPU's combine threshold of each collective kind (bytes; XLA's default 30 MiB each).
THRESHOLDS = {
    "all-reduce": "xla_gpu_all_reduce_combine_threshold_bytes",
    "all-gather": "xla_gpu_all_gather_combine_threshold_bytes",
    "reduce-scatter": "xla_gpu_reduce_scatter_combine_threshold_bytes",
}
# Powers of two from 1 MiB to 1 GiB, and 0 (no combining): what users sweep.
THRESHOLD_VALUES = (0, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB)
SCHEDULER = "xla_gpu_enable_latency_hiding_scheduler"
# The latency-hiding scheduler's memory limit: this percentage of the device's memory (XLA's
# default 95). Lower keeps more collectives from overlapping where their buffers would not fit.
SCHEDULER_MEMORY = "xla_gpu_memory_limit_slop_factor"
SCHEDULER_MEMORY_VALUES = ("50", "80")
PIPELINE_ON = "COLLECTIVE_PIPELINING_MODE_ON"
# Collective pipelining of a loop's collectives (layer l+1's issued in iteration l), per kind.
PIPELINING = {
    "all-reduce": "xla_gpu_pipeline_all_reduce",
    "all-gather": "xla_gpu_pipeline_all_gather",
    "reduce-scatter": "xla_gpu_pipeline_reduce_scatter",
}
DOUBLE_BUFFERING = "xla_gpu_enable_while_loop_double_buffering"
# The combiners' second bound: at most this many collectives in one (every kind). With a bytes
# threshold it draws bucket boundaries a threshold alone cannot: many small gradients split by
# count (tiny Transformer's sharded update: 2 reduce-scatters and 2 all-gathers become 23 each).
COMBINE_COUNT = "xla_gpu_collective_combine_threshold_count"
COMBINE_COUNT_VALUES = ("4", "16")
# The order of collectives against the compute that needs them, as XLA's scheduler sets it: how
# many collectives it keeps in flight at once (a gather issued further ahead of its use), and
# every collective started as soon as its operands are ready.
OVERLAP_LIMIT = "xla_gpu_experimental_parallel_collective_overlap_limit"
OVERLAP_LIMIT_VALUES = ("2", "4")
EARLY_START = "xla_gpu_experimental_collective_start_as_early_as_possible"
DEFAULTS = "XLA's defaults"


def collective_kinds(text: str) -> set[str]:
    """The combinable collective kinds a compiled module runs (anywhere, loop bodies too)."""
    return {kind for kind in THRESHOLDS if re.search(rf"\s{kind}(?:-start)?\(", text)}


def dimensions(text: str) -> list[tuple[str, list[dict]]]:
    """The option dimensions that can change this program (XLA's default program's `text`), in
    the order they are searched: per collective kind it runs, its combine threshold, then the
    combiners' count bound; the latency-hiding scheduler on and off, and on, its memory limit; the
    collectives' order against compute (overlap limit, early start); where the program has a
    `while`, collective pipelining of the kinds it runs and loop double-buffering. Each dimension:
    (name, option sets to try on top of the best so far)."""
    kinds = collective_kinds(text)
    dims = threshold_dimensions(kinds)
    # Both ways: jax 0.12's XLA:GPU already compiles async, overlapped collectives without the option
    # (the paper MLP: the same program with it on), so off is a program of its own.
    dims.append(("latency-hiding scheduler", [{SCHEDULER: True}, {SCHEDULER: False}]))
    dims.append(("scheduler memory limit", [{SCHEDULER: True, SCHEDULER_MEMORY: v} for v in SCHEDULER_MEMORY_VALUES]))
    if kinds:
        dims.extend(order_dimensions())
    return dims + loop_dimensions(text, kinds)


def loop_dimensions(text: str, kinds) -> list[tuple[str, list[dict]]]:
    """Where the program has a `while`: collective pipelining of these kinds (those it runs) and
    loop double-buffering; none without one."""
    if not re.search(r"\swhile\(", text):
        return []
    piped = [{PIPELINING[k]: PIPELINE_ON} for k in PIPELINING if k in kinds]
    dims = [("collective pipelining", [{**p, SCHEDULER: True} for p in piped])] if piped else []
    return [*dims, ("loop double-buffering", [{DOUBLE_BUFFERING: True}])]


def threshold_dimensions(kinds) -> list[tuple[str, list[dict]]]:
    """The combiners' dimensions for these collective kinds: each kind's bytes threshold (0 and
    `THRESHOLD_VALUES`), then the count bound every kind shares (`COMBINE_COUNT_VALUES`)."""
    dims = [
        (f"{kind} combine threshold", [{option: str(v)} for v in THRESHOLD_VALUES])
        for kind, option in THRESHOLDS.items()
        if kind in kinds
    ]
    if dims:
        dims.append(("combine count bound", [{COMBINE_COUNT: v} for v in COMBINE_COUNT_VALUES]))
    return dims


def order_dimensions() -> list[tuple[str, list[dict]]]:
    """When collectives start against the compute that needs them: how many in flight at once,
    then each as early as its operands allow (two dimensions: the knobs combine, and coordinate
    descent only combines across dimensions)."""
    return [
        ("collectives in flight", [{OVERLAP_LIMIT: v} for v in OVERLAP_LIMIT_VALUES]),
        ("collectives started early", [{EARLY_START: True}]),
    ]


def update_dimensions(text: str) -> list[tuple[str, list[dict]]]:
    """The dimensions a sharded weight update's program (`text`) adds to those searched on the
    replicated step (`ranked.combine`): the thresholds of the kinds it runs beside all-reduce
    (its gradients' reduce-scatters, its parameters' all-gathers), the count bound, the order of
    those collectives against compute and, where it has loops, their pipelining and loop
    double-buffering; none where it runs neither kind."""
    kinds = collective_kinds(text) - {"all-reduce"}
    if not kinds:
        return []
    return [*threshold_dimensions(kinds), *order_dimensions(), *loop_dimensions(text, kinds)]


def program_fingerprint(text: str) -> str:
    """The compiled program's identity: its module text without the header line (which names
    the module and its layout only)."""
    return hashlib.sha256(text.split("\n", 1)[-1].encode()).hexdigest()[:16]


def collective_summary(text: str) -> dict[str, dict[str, int]]:
    """Per collective kind in a compiled XLA:GPU module: how many it runs per step (`count`, loop
    bodies' once per iteration), their bytes per device per step (`bytes`, the larger of input and
    output) and how many run asynchronously (a start/done pair the scheduler can overlap)."""
    from disco_jax import backends
    from disco_jax.cost.compiled import compiled_program

    out: dict[str, dict[str, int]] = {}
    for k in compiled_program(text, backends.GPU).collectives:
        row = out.setdefault(k.collective, {"count": 0, "bytes": 0, "async": 0})
        row["count"] += k.repeat
        row["bytes"] += sum(k.tensor_bytes) * k.repeat
        row["async"] += k.repeat if k.done_position is not None else 0
    return out


@dataclasses.dataclass
class OptionsCandidate:
    """One option set compiled: its label, options, compiled program, fingerprint, cost by the
    compiled-program model and per-device peak; `same_as`: the earlier candidate it compiled to
    the same program as (costed once)."""

    label: str
    options: dict
    program: CompiledProgram
    fingerprint: str | None = None
    cost: CompiledCost | None = None
    peak_bytes: int | None = None
    same_as: str | None = None

    @property
    def compiled_us(self) -> float | None:
        return None if self.cost is None else self.cost.iteration_us

    def fits(self, limit: int | None) -> bool:
        return limit is None or (self.peak_bytes is not None and self.peak_bytes <= limit)

    def to_json(self, collectives: bool = False) -> dict:
        out = {
            "label": self.label,
            "options": {k: str(v) for k, v in self.options.items()},
            "fingerprint": self.fingerprint,
            "same_program_as": self.same_as,
            "compiled_us": self.compiled_us,
            "peak_bytes": self.peak_bytes,
            "compile_s": round(self.program.compile_s, 2),
            "status": self.program.status,
            "reason": self.program.reason,
        }
        if collectives and self.program.text is not None:
            out["collectives"] = collective_summary(self.program.text)
        return out


@dataclasses.dataclass
class OptionsChoice:
    """What `search_options` found: XLA's defaults, the chosen candidate, every candidate, the
    memory limit and why."""

    default: OptionsCandidate
    chosen: OptionsCandidate
    candidates: list[OptionsCandidate]
    memory_limit_bytes: int | None
    reason: str

    @property
    def options(self) -> dict:
        """The compile options of the chosen program ({}: XLA's defaults)."""
        return dict(self.chosen.options)

    @property
    def gain(self) -> float | None:
        """XLA's default program's compiled cost over the chosen one's (1.0: no gain)."""
        if self.default.compiled_us is None or not self.chosen.compiled_us:
            return None
        return self.default.compiled_us / self.chosen.compiled_us

    def to_json(self) -> dict:
        return {
            "options": {k: str(v) for k, v in self.options.items()},
            "chosen": self.chosen.to_json(collectives=True),
            "default": self.default.to_json(collectives=True),
            "gain": self.gain,
            "default_fits": self.default.fits(self.memory_limit_bytes),
            "memory_limit_bytes": self.memory_limit_bytes,
            "reason": self.reason,
            "candidates": [c.to_json() for c in self.candidates],
        }


def search_options(
    lowered,
    costs: ProgramCosts,
    *,
    memory_limit_bytes: int | None = None,
    hook_rules_of=None,
    dims: list[tuple[str, list[dict]]] | None = None,
    default: CompiledProgram | None = None,
    progress: Callable[[str], None] | None = None,
    compile: Callable[[str, dict], CompiledProgram | None] | None = None,
    start: tuple[str, dict] = (DEFAULTS, {}),
) -> OptionsChoice:
    """Search XLA:GPU's collective options for one lowered step (see the module docstring).
    `costs`: the compiled-program model (a cluster's, `offline.program_costs`). `hook_rules_of`:
    the backend whose hook rules the step's programs get (a sharded update's, as the decorator
    captures it). `dims`: the dimensions to search (default: `dimensions` of XLA's default
    program). `default`: XLA's program already compiled (else compiled here). `compile(label,
    options)`: how a candidate is compiled where it is not `lowered` with `hook_rules_of` (a
    sharded update relowered, `ranked.combine`). `start`: the label and options the search starts
    from, the program `default` was compiled with (XLA's defaults unless given; every candidate
    adds to them). Returns the choice (`default` is the start's candidate); `ValueError` where the
    start's program does not compile."""
    by_fingerprint: dict[str, OptionsCandidate] = {}
    candidates: list[OptionsCandidate] = []

    def build(label: str, options: dict) -> CompiledProgram:
        if compile is not None:
            built = compile(label, options)
            if built is None:
                return CompiledProgram(label, "compile options", dict(options), "not enacted", reason="not lowered")
            return built
        return compile_program(lowered, None, label, None, options, hook_rules_of=hook_rules_of)

    def compiled(label: str, options: dict, program: CompiledProgram | None = None) -> OptionsCandidate:
        program = program or build(label, options)
        c = OptionsCandidate(label, dict(options), program)
        if program.text is not None:
            c.fingerprint = program_fingerprint(program.text)
            first = by_fingerprint.get(c.fingerprint)
            if first is not None:
                c.same_as, c.cost, c.peak_bytes = first.label, first.cost, first.peak_bytes
            else:
                by_fingerprint[c.fingerprint] = c
                c.cost, c.peak_bytes = costs(program), choice.executable_peak(program.compiled)
        candidates.append(c)
        if progress is not None:
            cost = "not costed" if c.compiled_us is None else f"{c.compiled_us:.1f} us, peak {c.peak_bytes} bytes"
            progress(f"{label}: {cost}" + (f" (= {c.same_as})" if c.same_as else ""))
        return c

    xla = compiled(start[0], dict(start[1]), default)
    if xla.cost is None:
        raise ValueError(f"{start[0]}: the program could not be compiled or costed: {xla.program.reason}")
    limit = memory_limit_bytes

    def better(a: OptionsCandidate, b: OptionsCandidate) -> bool:
        """a before b: fitting first, then cheaper, then smaller."""
        if a.cost is None:
            return False
        if b.cost is None:
            return True
        key = lambda c: (not c.fits(limit), c.compiled_us, c.peak_bytes or 0)  # noqa: E731
        return key(a) < key(b)

    best = xla
    for _dimension, option_sets in dims if dims is not None else dimensions(xla.program.text):
        base = best
        for options in option_sets:
            merged = {**base.options, **options}
            if merged == base.options:
                continue
            label = ", ".join(f"{k}={v}" for k, v in sorted(merged.items()))
            c = compiled(label, merged)
            if better(c, best):
                best = c
    if not best.fits(limit):
        reason = (
            f"no option set fits {limit} bytes per device (the smallest peak: "
            f"{min((c.peak_bytes for c in candidates if c.peak_bytes is not None), default=None)})"
        )
    elif best is xla:
        reason = "XLA's defaults: no option set compiles to a cheaper program" + (
            f" within {limit} bytes" if limit is not None else ""
        )
    else:
        reason = f"{best.label}: {best.compiled_us:.1f} us against XLA's defaults' {xla.compiled_us:.1f} us"
        if not xla.fits(limit):
            reason = (
                f"XLA's default schedule does not fit {limit} bytes per device (peak {xla.peak_bytes}); "
                f"{best.label} does (peak {best.peak_bytes}, {best.compiled_us:.1f} us against "
                f"{xla.compiled_us:.1f} us)"
            )
    return OptionsChoice(xla, best, candidates, limit, reason)


def apply_to_plan(plan, choice: OptionsChoice) -> None:
    """Fold an options search into an offline plan (`offline.plan_for_target`): the search is
    recorded (`plan.search["schedule_options"]`), and the plan becomes XLA's own program under the
    chosen options (`plan.compile_options`, no strategy) where that compiles cheaper than the plan's
    program, or where the plan's program does not fit the memory limit and it does. A rewritten
    plan that is cheaper and fits stays as it was."""
    plan.search["schedule_options"] = choice.to_json()
    chosen, limit = choice.chosen, choice.memory_limit_bytes
    if not choice.options or chosen.cost is None or not chosen.fits(limit):
        return
    figures = plan.simulated.get("plan") or {}
    plan_us, plan_peak = figures.get("compiled_us"), figures.get("peak_bytes")
    plan_fits = limit is None or (plan_peak is not None and plan_peak <= limit)
    if not plan.use_default and plan_us is not None and plan_fits and plan_us <= chosen.compiled_us:
        return
    plan.use_default, plan.strategy, plan.compile_options = False, None, choice.options
    plan.simulated = {
        **plan.simulated,
        "default": {**(plan.simulated.get("default") or {}), "peak_bytes": choice.default.peak_bytes},
        "plan": {"iteration_us": None, "compiled_us": chosen.compiled_us, "peak_bytes": chosen.peak_bytes},
    }
    plan.reason = (
        f"{plan.search.get('offline', {}).get('cluster', {}).get('name', 'offline')}: XLA's program under "
        f"compile options, {choice.reason}; not measured yet: measured against XLA's step on its first run"
    )


def smallest_update(candidates: list, limit: int) -> dict:
    """The weight-update decision (`offline.choose_weight_update`'s record) where no update fits
    `limit` under XLA's default schedule: the one with the smallest peak, handed to the options
    search, which may find a schedule of it that fits (`offline.plan_for_target` stops with
    `NothingFits` where it does not)."""
    built = [c for c in candidates if c.xla is not None and c.peak_bytes is not None]
    smallest = min(built, key=lambda c: c.peak_bytes)
    peaks = ", ".join(f"{c.label} {c.peak_bytes}" for c in built)
    return {
        "requested": "search",
        "mode": "replicated" if smallest.layout is None else "sharded",
        "chosen": smallest.label,
        "forced": smallest.layout is not None,
        "reason": (
            f"no weight update fits {limit} bytes per device under XLA's default schedule ({peaks}); "
            f"{smallest.label}, the smallest, goes to the search of XLA's collective options"
        ),
        "memory_limit_bytes": limit,
        "candidates": [c.to_json(limit) for c in candidates],
    }
