"""The benchmark report's prose and number formats: the sections of `report_template.md` (package
data beside this module: named sections, each a `string.Template`, `fill`) and how the report
writes times, ratios, intervals and percentages (`disco_jax.eval.report` uses both)."""

from __future__ import annotations

import functools
import math
import re
import string
from importlib import resources

TEMPLATE = "report_template.md"
_SECTION = re.compile(r"^<!-- (\w+) -->$", re.MULTILINE)


@functools.cache
def sections() -> dict[str, string.Template]:
    """The template's sections by name."""
    text = resources.files("disco_jax.eval").joinpath(TEMPLATE).read_text(encoding="utf-8")
    parts = _SECTION.split(text)  # [preamble, name, body, name, body, ...]
    return {name: string.Template(body.strip("\n")) for name, body in zip(parts[1::2], parts[2::2])}


def fill(name: str, **values) -> str:
    """The template's section `name` with `values` filled in."""
    return sections()[name].substitute(values)


def ms(us: float | None) -> str:
    if us is None:
        return "n/a"
    millis = us / 1e3
    return f"{millis:.3g}" if millis < 100 else f"{millis:.0f}"


def gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def frac(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def table_row(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def iqr(m: dict, digits: int) -> str:
    return f"{m['ratio']:.{digits}f} [{m['ratio_iqr'][0]:.{digits}f}-{m['ratio_iqr'][1]:.{digits}f}]"


def speedup(r: dict) -> str:
    """The row's speed-up over the best baseline, with its 95% interval where it was measured."""
    interval = r.get("speedup_ci95")
    return pct(r["speedup"]) + ("" if interval is None else f" [{pct(interval[0])}, {pct(interval[1])}]")


def ratio_text(ratio: float, interval: tuple[float, float] | None) -> str:
    """A ratio with its 95% interval, where there is one."""
    return f"{ratio:.3f}" + ("" if interval is None else f" [{interval[0]:.3f}, {interval[1]:.3f}]")


def us(x: float) -> str:
    return f"{x:+.0f}" if abs(x) >= 10 else f"{x:+.1f}"


def reference(r: dict) -> str:
    """What a measured row's configurations were timed against (rows before the common reference
    were timed against JAX_default's own executable)."""
    return (r.get("reference") or {}).get("executable", "JAX_default")
