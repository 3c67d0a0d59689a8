"""What disco-jax tells the user while it works: one-line messages, the search's progress bar, and
the summary table after a search. Everything goes to the `disco_jax` logger and, when `verbose`,
to stderr through rich."""

from __future__ import annotations

import logging
from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from disco_jax._plan import Plan
from disco_jax._search import SearchConfig, SearchResult

logger = logging.getLogger("disco_jax")


class Ui:
    """Messages of one decorated step (`verbose=False`: the logger only)."""

    def __init__(self, verbose: bool):
        self.verbose = verbose

    def say(self, message: str) -> None:
        logger.info(message)
        if self.verbose:
            Console(stderr=True).print(f"[bold cyan]disco-jax[/] {message}", highlight=False)

    def search(self, run: Callable[..., SearchResult], config: SearchConfig, default_cost: float) -> SearchResult:
        """`run(progress=callback)` with a progress bar showing the best simulated step so far."""
        if not self.verbose:
            return run(progress=None)
        columns = [
            TextColumn("[bold cyan]disco-jax[/] search"),
            BarColumn(),
            TextColumn("best {task.fields[best]:.1f} us ({task.fields[ratio]:.3f}x default)"),
            TextColumn("{task.fields[n]} candidates"),
            TimeElapsedColumn(),
        ]
        with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
            task = bar.add_task("search", total=config.budget_s, best=default_cost, ratio=1.0, n=0)

            def progress(best, n, elapsed):
                bar.update(task, completed=min(elapsed, config.budget_s), best=best, ratio=best / default_cost, n=n)

            result = run(progress=progress)
            bar.update(task, completed=config.budget_s)
        return result

    def summary(
        self, module_name: str, plan: Plan, default_counts: dict, plan_counts: dict | None, plan_path: str | None
    ) -> None:
        """The search's outcome: simulated and measured step times, counts, and the decision."""
        if not self.verbose:
            return
        sim, meas, stats = plan.simulated, plan.measured, plan.search
        table = Table(title=f"disco-jax: {module_name}", title_justify="left")
        table.add_column("")
        table.add_column("JAX default", justify="right")
        table.add_column("disco-jax plan", justify="right")
        d, p = sim["default"], sim["plan"]
        table.add_row("simulated step (us)", f"{d['iteration_us']:.1f}", f"{p['iteration_us']:.1f}")
        table.add_row(
            "  compute / comm (us)",
            f"{d['compute_us']:.0f} / {d['comm_us']:.0f}",
            f"{p['compute_us']:.0f} / {p['comm_us']:.0f}",
        )
        table.add_row("  overlap ratio", f"{d['overlap_ratio']:.2f}", f"{p['overlap_ratio']:.2f}")
        if meas:
            table.add_row("measured step (us)", f"{meas['default_us']:.1f}", f"{meas['plan_us']:.1f}")
        plan_counts = plan_counts or default_counts
        table.add_row("all-reduces", str(default_counts["all-reduce"]), str(plan_counts["all-reduce"]))
        table.add_row("fusions", str(default_counts["fusion"]), str(plan_counts["fusion"]))
        console = Console(stderr=True)
        console.print(table)
        if stats:
            console.print(
                f"search: {stats['evaluated']} candidates in {stats['seconds']:.1f} s "
                f"({stats['candidates_per_second']:.0f}/s), stopped: {stats['stop_reason']}"
            )
        console.print(f"decision: {'XLA default' if plan.use_default else 'disco-jax plan'} — {plan.reason}")
        if plan_path:
            console.print(f"plan: {plan_path}")
