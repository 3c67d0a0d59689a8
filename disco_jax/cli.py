"""The `disco-jax` command line.

disco-jax demo [--models mlp transformer] [--budget S] [--plan-dir DIR] [--style jit|shard_map]
disco-jax inspect PLAN.json [--out DIR]
disco-jax bench --out report            (baselines vs disco-jax per model and platform)
disco-jax launch -n N -- python train.py (an N-process job on loopback)
disco-jax rules [--json] [--axioms]      (the sharding rewrite rules, each proven with z3)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from disco_jax.eval import bench


def _inspect(plan_path: Path, out_dir: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    from disco_jax import _plan, _timeline

    console = Console()
    try:
        plan = _plan.read_plan_file(plan_path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"disco-jax inspect: {e}") from None
    m = plan.machine
    console.print(f"[bold]{plan.module_name}[/] fingerprint {plan.fingerprint}")
    console.print(
        f"machine: {m.backend} / {m.device_kind} x {m.num_devices} ({m.num_processes} process(es)), "
        f"jax {m.jax_version}, jaxlib {m.jaxlib_version}"
    )
    console.print(f"decision: {'XLA default' if plan.use_default else 'disco-jax plan'} — {plan.reason}")
    if plan.simulated:
        table = Table(title="simulated step", title_justify="left")
        for col in ("", "iteration us", "compute us", "comm us", "overlap", "FO us", "fusions", "all-reduces"):
            table.add_column(col, justify="right")
        for name in ("default", "plan"):
            s = plan.simulated.get(name)
            if s:
                table.add_row(
                    name,
                    f"{s['iteration_us']:.1f}",
                    f"{s['compute_us']:.1f}",
                    f"{s['comm_us']:.1f}",
                    f"{s['overlap_ratio']:.2f}",
                    f"{s['full_overlap_us']:.1f}",
                    str(s["num_fusions"]),
                    str(s["num_allreduces"]),
                )
        console.print(table)
    if plan.measured:
        meas = plan.measured
        outputs = "bitwise equal" if meas["bitwise_equal"] else f"max abs error {meas['max_abs_error']:.2g}"
        console.print(
            f"measured: default {meas['default_us']:.1f} us, plan {meas['plan_us']:.1f} us, ratio "
            f"{meas['ratio']:.3f} (IQR {meas['ratio_iqr'][0]:.3f}-{meas['ratio_iqr'][1]:.3f}); "
            f"outputs {outputs}"
        )
    if plan.strategy:
        buckets = plan.strategy["buckets"]
        console.print(f"all-reduce buckets ({len(buckets)}): " + ", ".join(f"[{len(b)}]" for b in buckets))
        console.print(f"fused groups: {len(plan.strategy['groups'])}")
    if plan.search:
        s = plan.search
        console.print(
            f"search: {s.get('evaluated')} candidates in {s.get('seconds', 0):.1f} s, stopped: {s.get('stop_reason')}"
        )
    timeline_path = plan_path.with_suffix(".timeline.json")
    if timeline_path.exists():
        timelines = json.loads(timeline_path.read_text())
        png, trace = _timeline.write_timelines(
            timelines, out_dir or plan_path.parent, plan_path.stem, title=f"{plan.module_name}: simulated schedule"
        )
        console.print(f"timeline picture: {png}\nPerfetto/Chrome trace: {trace} (open in ui.perfetto.dev)")
    else:
        console.print(f"no simulated timeline stored beside the plan ({timeline_path.name})")


def _rules(as_json: bool, timeout_s: float, with_axioms: bool) -> int:
    """Prove and numerically check every sharding rule; 1 when any is not proven or fails its check."""
    from disco_jax.sharding import rules

    rows = rules.summary(timeout_s, with_axioms=with_axioms)
    failed = [r["name"] for r in rows if not r["ok"]]
    if as_json:
        print(json.dumps({"rules": rows, "all_proven": not failed}, indent=2))
        return 1 if failed else 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="sharding rewrite rules: z3 proof from the axioms, numpy check", title_justify="left")
    table.add_column("rule: source => target, side conditions", overflow="fold")
    table.add_column("proof", no_wrap=True)
    table.add_column("time", no_wrap=True, justify="right")
    table.add_column("numeric", overflow="fold")
    for r in rows:
        statement = f"[bold]{r['name']}[/]\n{r['source']}\n=> {r['target']}"
        statement += "".join(f"\n  if {c}" for c in r["conditions"])
        statement += "".join(f"\n  proof uses the rule {lemma}" for lemma in r["lemmas"])
        if r["kind"] == "axiom":
            status, seconds = "axiom", ""
        else:
            status = f"[{'green' if r['proof'] == 'proven' else 'red'}]{r['proof']}[/]"
            seconds = f"{r['proof_seconds']:.2f} s"
        checks = f"{r['numeric_instances']} draws\nN=" + ",".join(map(str, r["replica_counts"]))
        numeric = (
            f"[green]passed[/]\n{checks}" if r["numeric"] == "passed" else f"[red]failed[/] {r['numeric_failure']}"
        )
        table.add_row(statement, status, seconds, numeric)
    console = Console()
    console.print(table)
    proven = sum(1 for r in rows if r["kind"] == "rule" and r["ok"])
    total = sum(1 for r in rows if r["kind"] == "rule")
    console.print(f"{proven} of {total} rules proven and numerically checked (z3 timeout {timeout_s} s per rule)")
    if failed:
        console.print(f"[red]not proven or failing:[/] {', '.join(failed)}")
    return 1 if failed else 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="disco-jax", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="search then enact on a Transformer and an MLP (8 CPU devices)")
    d.add_argument("--models", nargs="+", default=None, help="zoo models (default: mlp transformer)")
    d.add_argument("--config", default="tiny", choices=("tiny",))
    d.add_argument("--style", default="jit", choices=("jit", "shard_map"))
    d.add_argument("--budget", type=float, default=20.0, help="search time budget per model, seconds")
    d.add_argument("--plan-dir", default=None, help="where plans go (default: a new temporary directory)")
    i = sub.add_parser("inspect", help="print a plan and draw its simulated timeline")
    i.add_argument("plan", type=Path)
    i.add_argument("--out", type=Path, default=None, help="directory for the PNG and trace (default: beside the plan)")
    la = sub.add_parser("launch", help="run a command as an N-process JAX job on loopback (gloo CPU collectives)")
    la.add_argument("-n", "--num-processes", type=int, required=True)
    la.add_argument("--devices-per-process", type=int, default=None, help="CPU devices per process")
    la.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    la.add_argument("--timeout", type=float, default=None, help="terminate every process after S seconds")
    la.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command ...")
    b = sub.add_parser(
        "bench",
        help="DisCo's evaluation: baselines vs disco-jax per model and platform, "
        "measured (8 CPU devices) and simulated (GPU clusters); writes a report",
    )
    bench.add_arguments(b)
    r = sub.add_parser("rules", help="the sharding rewrite rules, each with its z3 proof and numeric check")
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.add_argument("--timeout", type=float, default=5.0, help="z3 timeout per rule, seconds")
    r.add_argument("--axioms", action="store_true", help="also list the axioms with their numeric checks")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from disco_jax import _demo

        _demo.demo(
            tuple(args.models or _demo.DEMO_MODELS),
            config=args.config,
            style=args.style,
            budget_s=args.budget,
            plan_dir=args.plan_dir,
        )
    elif args.command == "inspect":
        _inspect(args.plan, args.out)
    elif args.command == "bench":
        bench.main(args)
    elif args.command == "rules":
        sys.exit(_rules(args.json, args.timeout, args.axioms))
    elif args.command == "launch":
        from disco_jax import _launch

        sys.exit(_launch.main(args.cmd, args.num_processes, args.devices_per_process, args.port, args.timeout))


if __name__ == "__main__":
    main(sys.argv[1:])
