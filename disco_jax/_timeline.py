"""Pictures of simulated schedules: a PNG timeline and a Chrome/Perfetto trace.

Input is what the search phase stores beside a plan (`<plan>.timeline.json`): for each of
'default' and 'plan', the simulator's events `[lane, label, start_us, end_us]` with lane
'compute' or 'comm'.
"""

from __future__ import annotations

import json
from pathlib import Path

LANES = ("compute", "comm")


def chrome_trace(timelines: dict[str, list], kind: str = "simulated") -> dict:
    """Trace Event Format: one process per schedule, one thread per lane (open in Perfetto)."""
    events = []
    for pid, (name, schedule) in enumerate(timelines.items(), start=1):
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"{name} ({kind})"}})
        for tid, lane in enumerate(LANES):
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": lane}})
        for lane, label, start, end in schedule:
            events.append(
                {
                    "ph": "X",
                    "pid": pid,
                    "tid": LANES.index(lane),
                    "name": label,
                    "ts": start,
                    "dur": max(end - start, 0.0),
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def timeline_png(timelines: dict[str, list], path: str | Path, title: str = "", kind: str = "simulated") -> None:
    """One panel per schedule, compute and comm lanes, on a shared time axis; `kind` says where
    the times come from ('simulated', or 'traced' for a profiler's events)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(timelines)
    fig, axes = plt.subplots(len(names), 1, figsize=(12, 1.6 + 1.3 * len(names)), sharex=True, squeeze=False)
    end = max((e[3] for s in timelines.values() for e in s), default=1.0)
    colors = {"compute": "#4C72B0", "comm": "#DD8452"}
    for ax, name in zip(axes[:, 0], names):
        schedule = timelines[name]
        for row, lane in enumerate(LANES):
            spans = [(s, max(e - s, end * 1e-4)) for ln, _, s, e in schedule if ln == lane]
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=colors[lane], edgecolors="white", linewidth=0.3)
        finish = max((e[3] for e in schedule), default=0.0)
        ax.axvline(finish, color="black", linewidth=0.8, linestyle="--")
        ax.set_yticks(range(len(LANES)), LANES)
        ax.set_ylim(-0.6, len(LANES) - 0.4)
        ax.set_title(f"{name}: {finish / 1e3:.2f} ms {kind}", loc="left", fontsize=10)
    axes[-1, 0].set_xlabel("time (us)")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_timelines(
    timelines: dict[str, list], out_dir: str | Path, stem: str, title: str = "", kind: str = "simulated"
) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png, trace = out / f"{stem}.timeline.png", out / f"{stem}.trace.json"
    timeline_png(timelines, png, title, kind)
    trace.write_text(json.dumps(chrome_trace(timelines, kind)))
    return png, trace
