"""What the pass hook receives at each stage on a real GPU, against the deviceless compile of the
same step for the same device kind (issue 15; docs/gpu-hook-stages.md records a run).

For each zoo model, the data-parallel Adam step is lowered from shapes (`zoo.lower_abstract`) twice:
over the real GPU (`zoo.data_mesh(1)`) and over one compile-only GPU of the shipped target whose
device kind matches (`disco_jax.targets`, in a child process with `JAX_PLATFORMS=cpu`). Each is
compiled once through disco-jax's hook with the GPU backend's options (`_compile.capture_program`),
and per stage the script records: entry instructions, opcode counts, fusions by kind, custom-call
targets, `is_scheduled`, the graph IR's summary, and the compiled module's `compiled_stats`. It
prints a table of both sides and every field that differs.

    python scripts/gpu_hook_stages.py [--models mlp transformer] [--config tiny] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

STAGES = ("PRE_SCHEDULER", "POST_SCHEDULER")


def stage_summary(text: str) -> dict:
    from disco_jax import _hlo

    module = _hlo.parse_module(text)
    entry = module.entry.instructions
    opcodes = collections.Counter(i.opcode for i in entry)
    fusion_kinds = collections.Counter(i.attr("kind") for i in entry if i.opcode == "fusion")
    custom_calls = collections.Counter(
        (i.attr("custom_call_target") or "?").strip('"')
        for c in module.computations
        for i in c.instructions
        if i.opcode == "custom-call"
    )
    return {
        "entry_instructions": len(entry),
        "computations": len(module.computations),
        "is_scheduled": "is_scheduled=true" in text.split("\n", 1)[0],
        "opcodes": dict(sorted(opcodes.items())),
        "fusion_kinds": dict(sorted(fusion_kinds.items())),
        "custom_call_targets": dict(sorted(custom_calls.items())),
    }


def side(kind: str, models: list[str], config: str) -> dict:
    """Capture every model on this process's GPU (`real`) or deviceless (`deviceless`)."""
    import jax
    import optax

    from disco_jax import _capture, backends, targets, zoo
    from disco_jax._compile import compiled_stats
    from disco_jax._graph import build_graph

    backend = backends.GPU
    if kind == "real":
        device = jax.devices()[0]
        if backends.for_platform(device.platform) is not backend:
            raise SystemExit(f"no GPU here: jax.devices()[0] is {device}")
        mesh = zoo.data_mesh(1)
    else:
        target = next(n for n in targets.TARGETS if f'"{os.environ["DISCO_DEVICE_KIND"]}"' in targets.target_config(n))
        mesh = targets.mesh(target, 1)
        device = mesh.devices.flat[0]
    out: dict = {"side": kind, "device_kind": device.device_kind, "jax": jax.__version__, "models": {}}
    for name in models:
        spec = zoo.get_model(name, config)
        batch = 4 if config == "paper" else None
        lowered = zoo.lower_abstract(spec, optax.adam(1e-3), mesh, global_batch_size=batch)
        started = time.perf_counter()
        options = dict(backend.decisions_options)
        texts, compiled = _capture.capture_stages(lowered, STAGES, options, platform=backend.platform)
        compile_s = time.perf_counter() - started
        graph = backend.read_decisions(
            build_graph(texts[backend.hook_stage], backend.fusible), texts[backend.decisions_stage]
        )
        out["models"][name] = {
            "compile_s": round(compile_s, 2),
            "stages": {s: stage_summary(texts[s]) for s in STAGES},
            "graph": graph.summary(),
            "compiled": compiled_stats(compiled.as_text()),
        }
        print(f"{kind}: {name} captured in {compile_s:.1f} s", file=sys.stderr, flush=True)
    return out


def differences(a, b, path=""):
    """(path, a, b) for every leaf that differs between two nested dicts."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            yield from differences(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
    elif a != b:
        yield path, a, b


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=["mlp", "transformer", "resnet50", "bert"])
    parser.add_argument("--config", default="tiny", choices=("tiny", "paper"))
    parser.add_argument("--json", help="write both sides and their differences here")
    parser.add_argument("--side", choices=("real", "deviceless"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:  # a child: print one side as JSON
        print(json.dumps(side(args.side, args.models, args.config)))
        return 0
    real = side("real", args.models, args.config)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "DISCO_DEVICE_KIND": real["device_kind"]}
    child = [sys.executable, __file__, "--side", "deviceless", "--config", args.config, "--models", *args.models]
    done = subprocess.run(child, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        raise SystemExit(f"the deviceless side failed (exit {done.returncode})")
    deviceless = json.loads(done.stdout.strip().splitlines()[-1])
    diffs = {}
    print(f"real: {real['device_kind']} (jax {real['jax']}); deviceless: {deviceless['device_kind']}")
    for name in args.models:
        r, d = real["models"][name], deviceless["models"][name]
        print(f"\n## {name} ({args.config})  compile s: real {r['compile_s']}, deviceless {d['compile_s']}")
        for s in STAGES:
            rs, ds = r["stages"][s], d["stages"][s]
            print(
                f"  {s:15s} entry {rs['entry_instructions']:5d} / {ds['entry_instructions']:5d}   fusions "
                f"{rs['fusion_kinds']} / {ds['fusion_kinds']}   custom calls {rs['custom_call_targets']} / "
                f"{ds['custom_call_targets']}"
            )
        found = [(p, a, b) for p, a, b in differences(r, d) if p != "compile_s"]
        diffs[name] = [{"field": p, "real": a, "deviceless": b} for p, a, b in found]
        print("  differences (real / deviceless): " + ("none" if not found else ""))
        for p, a, b in found:
            print(f"    {p}: {a} / {b}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"real": real, "deviceless": deviceless, "differences": diffs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
