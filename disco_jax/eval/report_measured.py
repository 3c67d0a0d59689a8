"""The measured platforms' parts of the benchmark report: what disco-jax did there (plans applied,
rejected, slower than JAX_default), the common reference (JAX_default's own ratio to it, speed-up
intervals, the decorator's overhead), the per-configuration cells and the simulator's accuracy
(DisCo's Table 2). `disco_jax.eval.report` places them; ratios are to the row's reference
(`disco_jax.eval.measured`), compared by `rows.ratio_between`."""

from __future__ import annotations

import statistics

from disco_jax.eval import report_text as fmt
from disco_jax.eval import rows
from disco_jax.eval.rows import DISCO, STRATEGY_ORDER, ratio_between

# What each measured platform is, and what its figures can and cannot say (the report prints it).
PLATFORM_LABELS: dict[str, str] = {
    rows.CPU_PLATFORM: "8 CPU devices in one process, sharing the machine's cores (2 here): work removed "
    "from one device is removed from all, so a sharded update's gain here is partly the cores' "
    "and predicts nothing about GPUs, where each device computes on its own",
    rows.CPU_CORE_PLATFORM: "2 CPU devices in one process on a 2-core machine, each device its own core: "
    "a device's work is its own, as on GPUs; collectives are XLA:CPU's in-process rendezvous, one "
    "per all-reduce operand (XLA:GPU all-reduces one flat buffer)",
    rows.GLOO_PLATFORM: "2 processes x 1 CPU device, collectives over gloo on loopback TCP: communication "
    "between processes, each round trip hundreds of microseconds",
}


def readable(row: dict) -> dict:
    """A row as the report reads it: a measured row written before disco-jax's simulated figure
    named its program (`simulated_by`) holds, where the weight-update choice sharded the state,
    the replicated program's simulation, not what ran: read as not simulated."""
    d = row.get("strategies", {}).get(DISCO) or {}
    if d.get("weight_update") == "sharded" and "simulated_by" not in d:
        d["simulated"] = None
    return row


def versus_default(r: dict) -> tuple[float, tuple[float, float] | None]:
    """disco-jax's time over JAX_default's in a measured row (both timed against the row's
    reference): the ratio of their median ratios, and its 95% interval (`rows.ratio_between`)."""
    disco, default = r["strategies"][DISCO]["measured"], r["strategies"]["JAX_default"]["measured"]
    return disco["ratio"] / default["ratio"], ratio_between(disco, default)


def changes(r: dict) -> list[str]:
    """What disco-jax changed in the program a measured row's step runs, each part accepted by its
    own measurement: the weight-update choice's sharded update (timed against the replicated
    step, `sharding.choice`) and the fusion/bucket plan (timed against XLA's plan of the program
    it was searched on, the acceptance rule). Empty: XLA's program runs unchanged."""
    d = r["strategies"][DISCO]
    return [
        part
        for part, done in (
            ("sharded weight update", d.get("weight_update") == "sharded"),
            ("fusion/bucket plan", d.get("applied")),
        )
        if done
    ]


def disco_summary(r: dict) -> str:
    """What ran for disco-jax in a measured row and how it measured against XLA's program (the
    reference), then what its fusion search decided."""
    d = r["strategies"][DISCO]
    ran = " + ".join(changes(r)) or "XLA's program unchanged"
    choice = f"; weight update: {d['weight_update_reason']}" if d.get("weight_update_reason") else ""
    return f"{ran}, {_measured(r)} of XLA's program{choice}; fusion search: {d['description']}"


def search_summary(r: dict) -> str:
    """A short form of what disco-jax's search did in a measured row (`measured.search_record`):
    the weight-update programs measured and their verdicts, whether packing was offered to the
    fusion search (and its packed start's simulated ratio to XLA's plan), every candidate the
    measured loop timed with its verdict, the validation, and what runs. Empty for a row written
    before the record existed."""
    rec = r["strategies"][DISCO].get("search")
    if not rec:
        return ""
    choice, fusion, chosen = rec["weight_update"], rec["fusion_search"], rec["chosen"]
    timed = [
        f"{c['label']} {fmt.ratio_text(c['ratio'], c.get('ratio_ci95'))} {c['verdict']}"
        for c in choice["candidates"]
        if c.get("ratio") is not None
    ]
    parts = [f"weight update {choice['mode']}" + (f" ({'; '.join(timed)})" if timed else "")]
    starts, packed = fusion.get("starts_us") or {}, fusion.get("packed_start_us")
    packing = "packing offered" if fusion.get("packing_offered") else "packing not offered"
    if fusion.get("packing_offered") and packed and starts.get("xla"):
        packing += f" (packed start simulated {packed / starts['xla']:.3f}x XLA's plan)"
    parts.append(f"fusion search {fusion.get('evaluated') or 0} simulated, {packing}")
    measured = [
        f"{c['origin']}{' packed' if c.get('packed') else ''} "
        + (
            "failed"
            if c.get("measured_ratio") is None
            else f"{fmt.ratio_text(c['measured_ratio'], c.get('ratio_ci95'))} {c.get('verdict') or ''}".rstrip()
        )
        + (" → validation" if c.get("picked") else f" ({c['ineligible']})" if c.get("ineligible") else "")
        for c in rec["measured_candidates"]
    ]
    stop = f" (loop stopped: {rec['measured_loop_stop']})" if rec.get("measured_loop_stop") else ""
    parts.append("measured " + ("; ".join(measured) if measured else "none") + stop)
    v = rec.get("validation")
    if v:
        parts.append(f"validated {fmt.ratio_text(v['ratio'], v.get('ratio_ci95'))} {v['verdict']}")
    plan = "XLA's fusion and buckets"
    if chosen["applied"]:
        plan = f"plan {chosen['origin']}, {chosen['buckets']} bucket(s){', packed' if chosen['packed'] else ''}"
    parts.append(f"runs: {plan}, weight update {chosen['weight_update']}")
    return f"{r['model']}: " + ", ".join(parts[:1]) + "; " + "; ".join(parts[1:])


def _measured(r: dict) -> str:
    m = r["strategies"][DISCO]["measured"]
    return fmt.ratio_text(m["ratio"], m.get("ratio_ci95"))


def plans_headline(prow: list[dict]) -> str:
    """What the product did on a measured platform: steps it changed (sharded weight update, a
    fusion/bucket plan, or both) and kept, how many of the changed ones measured faster than XLA's
    program with the 95% interval below 1, and any that measured slower than JAX_default in the
    row's own timing."""
    applied = [r for r in prow if changes(r)]
    parts = [sum(part in changes(r) for r in applied) for part in ("sharded weight update", "fusion/bucket plan")]
    faster = [r for r in applied if (r["strategies"][DISCO]["measured"].get("ratio_ci95") or (1.0, 1.0))[1] < 1.0]
    versus = {r["model"]: versus_default(r) for r in applied}
    slower = [r for r in applied if versus[r["model"]][0] > 1.0]
    significant = [r for r in slower if (versus[r["model"]][1] or (0.0,))[0] > 1.0]
    return fmt.fill(
        "headline_plans",
        applied=len(applied),
        models=len(prow),
        sharded=parts[0],
        fused=parts[1],
        faster=len(faster),
        faster_models=", ".join(f"{r['model']} {_measured(r)}" for r in faster) or "none",
        rejected=len(prow) - len(applied),
        slower=len(slower),
        slower_models="".join(f"; {r['model']} {fmt.ratio_text(*versus[r['model']])}" for r in slower),
        significant=len(significant),
    )


def fair_headline(prow: list[dict]) -> str:
    """The common reference of a measured platform: JAX_default's own ratio to it (the noise
    floor), how many speed-ups are told apart from 0 by their intervals, and the decorator's
    per-call overhead, timed apart. Empty for rows measured before the common reference."""
    if not all(r.get("reference") for r in prow):
        return ""
    floors = [r["strategies"]["JAX_default"]["measured"] for r in prow]
    holding = [m for m in floors if m["ratio_ci95"][0] <= 1.0 <= m["ratio_ci95"][1]]
    widest = max(floors, key=lambda m: m["ratio_ci95"][1] - m["ratio_ci95"][0])
    intervals = [r["speedup_ci95"] for r in prow if r.get("speedup_ci95")]
    overheads = sorted(r["strategies"][DISCO]["overhead"]["us_per_call"] for r in prow)
    return fmt.fill(
        "headline_fair",
        reference=fmt.reference(prow[0]),
        floor=f"{statistics.median(m['ratio'] for m in floors):.3f}",
        holding=len(holding),
        models=len(prow),
        widest=fmt.ratio_text(widest["ratio"], widest["ratio_ci95"]),
        faster=sum(low > 0 for low, _ in intervals),
        slower=sum(high < 0 for _, high in intervals),
        undecided=sum(low <= 0 <= high for low, high in intervals),
        without=len(prow) - len(intervals),
        overhead=fmt.us(statistics.median(overheads)),
        overhead_low=fmt.us(overheads[0]),
        overhead_high=fmt.us(overheads[-1]),
    )


def fair_details(prow: list[dict]) -> str:
    """Per model of a measured platform: JAX_default against the reference, disco-jax against
    JAX_default, and the decorator's per-call overhead, each with its 95% interval."""
    floor, versus, overhead = [], [], []
    for r in prow:
        m = r["strategies"]["JAX_default"]["measured"]
        floor.append(f"{r['model']} {fmt.ratio_text(m['ratio'], m['ratio_ci95'])}")
        versus.append(f"{r['model']} {fmt.ratio_text(*versus_default(r))}")
        o = r["strategies"][DISCO]["overhead"]
        low, high = o["us_per_call_ci95"]
        overhead.append(f"{r['model']} {fmt.us(o['us_per_call'])} [{fmt.us(low)}, {fmt.us(high)}]")
    return fmt.fill("fair_details", floor="; ".join(floor), versus="; ".join(versus), overhead="; ".join(overhead))


def measured_cell(st: dict) -> str:
    m, h, o = st.get("measured"), st.get("hlo") or {}, st.get("outputs") or {}
    if not m:
        return "n/a"
    ok = "=" if o.get("bitwise_equal") else ("≈" if o.get("within_tolerance") else "✗")
    return (
        f"{fmt.iqr(m, 2)} AR {h.get('all-reduce', '?')}/{h.get('all-reduce-operands', '?')} "
        f"F {h.get('multi_op_loop_fusions', '?')} {ok}"
    )


def accuracy(measured: list[dict], figures: dict[str, str]) -> list[str]:
    """DisCo's Table 2: simulated against measured step times on one measured platform."""
    lines, all_errors, all_ratio_errors = [], [], []
    for r in measured:
        errs, ratio_errs = {}, {}
        sim_default = r["strategies"]["JAX_default"]["simulated"]["iteration_us"]
        for s in STRATEGY_ORDER:
            st = r["strategies"].get(s) or {}
            if st.get("simulated") and st.get("measured"):
                errs[s] = abs(st["simulated"]["iteration_us"] - r["time_us"][s]) / r["time_us"][s]
                if s != "JAX_default":  # drift-free: what the search compares is the ratio
                    measured_ratio = r["time_us"][s] / r["time_us"]["JAX_default"]
                    ratio_errs[s] = abs(st["simulated"]["iteration_us"] / sim_default - measured_ratio) / measured_ratio
        all_errors.extend(errs.values())
        all_ratio_errors.extend(ratio_errs.values())
        d, x = r["strategies"][DISCO], r["strategies"]["JAX_default"]
        at_calibration = (r.get("calibration") or {}).get("measured_default_us")
        lines.append(
            fmt.table_row(
                [
                    r["model"],
                    fmt.ms(at_calibration),
                    fmt.ms(r["time_us"]["JAX_default"]),
                    fmt.ms(x["simulated"]["iteration_us"]),
                    f"{errs.get('JAX_default', float('nan')):.1%}",
                    fmt.ms(r["time_us"][DISCO]),
                    fmt.ms((d.get("simulated") or {}).get("iteration_us")),
                    f"{errs.get(DISCO, float('nan')):.1%}",
                    f"{sum(errs.values()) / max(1, len(errs)):.1%}",
                    f"{sum(ratio_errs.values()) / max(1, len(ratio_errs)):.1%}",
                ]
            )
        )
    platform = measured[0]["platform"]
    blocks = [
        fmt.fill(
            "accuracy_platform",
            platform=platform,
            label=PLATFORM_LABELS.get(platform, ""),
            devices=measured[0]["num_devices"],
            configurations=len(STRATEGY_ORDER),
            rows="\n".join(lines),
        )
    ]
    if all_errors:
        srt, rsrt = sorted(all_errors), sorted(all_ratio_errors)
        blocks.append(
            fmt.fill(
                "accuracy_summary",
                pairs=len(srt),
                median=f"{srt[len(srt) // 2]:.1%}",
                p90=f"{srt[int(0.9 * (len(srt) - 1))]:.1%}",
                ratio_median=f"{rsrt[len(rsrt) // 2]:.1%}",
                ratio_p90=f"{rsrt[int(0.9 * (len(rsrt) - 1))]:.1%}",
            )
        )
    if f"table2_{platform}" in figures:
        blocks.append(fmt.fill("table2", file=figures[f"table2_{platform}"]))
    return blocks
