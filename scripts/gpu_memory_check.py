"""On one GPU: does XLA's compiled memory analysis (what the memory planner trusts) predict what the
GPU uses? For a mid-size decoder (the zoo's GPT, a few layers, bfloat16 compute, Adam, its state
donated) and each weight update of `offline.SHARDED_UPDATES` plus the replicated one, the
8-device data-parallel step is

(a) compiled deviceless for ``h100-sxm`` (what an offline plan reads): its memory analysis;
(b) compiled on this GPU under the mock topology ``1x8x1`` (8 processes of one GPU, this process
    one of them, mock NCCL; `scripts/gpu_programs.py` ``mock``): its memory analysis;
(c) run there (global arrays built from this process's shards, the state fed back a few steps):
    the device's ``peak_bytes_in_use`` and ``bytes_in_use`` (`memory_stats()`), and the step time.

Each program runs in its own process, so the allocator's peak is the program's own: the GPU's
programs first, then the deviceless compiles, each process within what is left of
``--time-budget-s``; a failure or a timeout is written as a row and the others go on. Rows are
JSON lines appended to ``--out`` and flushed as they come; the summary printed at the end
compares (a), (b) and (c) per program. Footprint = arguments + outputs + temporaries - aliased
bytes (`sharding.choice.footprint`).

    python scripts/gpu_memory_check.py --out out/memory_check.jsonl            # the GPU machine
    python scripts/gpu_memory_check.py --out /tmp/m.jsonl --dry-run --tiny     # CPU, a quick check

``--dry-run`` (no GPU): (a) as on the GPU machine, and the (b)/(c) path with 8 virtual CPU
devices instead of the mock topology (CPU devices report no memory statistics).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

MOCK_TOPOLOGY = "1x8x1"
DEVICES = 8
TARGET = "h100-sxm"
# The mid-size decoder: about 0.27B parameters; replicated with Adam about 3.2 GB of state per
# device plus gradients and activations (one sequence of 1024 tokens per device).
MID = dict(vocab_size=32000, d_model=2048, num_heads=16, num_layers=4, seq_len=1024, global_batch=8)
TINY = dict(vocab_size=64, d_model=32, num_heads=2, num_layers=2, seq_len=8, global_batch=8)
MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")


def write_row(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
    print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)


def analysis(compiled) -> dict:
    stats = compiled.memory_analysis()
    figures = {f: int(getattr(stats, f)) for f in MEMORY_FIELDS if stats is not None and hasattr(stats, f)}
    if len(figures) == len(MEMORY_FIELDS):
        figures["footprint_bytes"] = sum(figures[f] for f in MEMORY_FIELDS[:3]) - figures["alias_size_in_bytes"]
    return figures


def decoder(mesh, tiny: bool):
    """(jitted step, abstract state, abstract batch) of the mid-size (or tiny) GPT on `mesh`."""
    import optax

    from disco_jax import zoo
    from disco_jax.zoo import _gpt

    cfg = _gpt.GPTConfig(**(TINY if tiny else MID), compute_dtype="float32" if tiny else "bfloat16")
    spec = _gpt.spec_of(cfg, "tiny" if tiny else "mid")
    optimizer = optax.adam(1e-4)
    state, batch = zoo.abstract_state_and_batch(spec, optimizer, mesh)
    return zoo.build_train_step(spec, optimizer, mesh, "jit", donate=True), state, batch, spec


def programs(step, state, batch, only: str | None = None, backend=None):
    """Yield (label, compiled program or None, why not, compile seconds): the replicated step,
    then each of `offline.SHARDED_UPDATES` (`only`: just that one; the replicated step is then
    compiled too where the update needs its shardings, but not yielded). Each is compiled as the
    decorator captures it: with `backend`'s hook rules for its layout (`update.hook_backend`;
    default XLA:GPU's), e.g. the re-gathered update's `all_gather_before_use` per use."""
    from disco_jax import backends, offline
    from disco_jax._compile import compile_program
    from disco_jax.sharding import update

    backend = backend or backends.GPU
    started = time.perf_counter()
    replicated = step.lower(state, batch).compile()
    if only in (None, offline.REPLICATED):
        yield offline.REPLICATED, replicated, None, time.perf_counter() - started
    for label, build in offline.SHARDED_UPDATES.items():
        if only not in (None, label):
            continue
        started = time.perf_counter()
        lowered, layout, why = build(step, (state, batch), {}, replicated)
        compiled = None
        if lowered is not None:
            program = compile_program(lowered, None, label, None, {}, update.hook_backend(backend, layout))
            compiled, why = program.compiled, program.reason or why
        yield label, compiled, why, time.perf_counter() - started


# ------------------------------------------------------------------------------- (a) deviceless


def child_deviceless(out: str, tiny: bool) -> None:
    from disco_jax import targets

    step, state, batch, spec = decoder(targets.mesh(TARGET, DEVICES), tiny)
    base = {"phase": "deviceless", "target": TARGET, "model": spec.description}
    found = programs(step, state, batch)
    while True:
        try:
            label, compiled, why, seconds = next(found)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - recorded; the programs after it need it
            write_row(out, {**base, "error": f"{type(e).__name__}: {str(e)[:1000]}"})
            return
        if compiled is None:
            write_row(out, {**base, "program": label, "skipped": why})
        else:
            write_row(out, {**base, "program": label, "memory": analysis(compiled), "compile_s": seconds})


# ----------------------------------------------------------------------------- (b), (c) on the GPU


def memory_stats(device) -> dict:
    stats = device.memory_stats()
    return {} if stats is None else {k: int(v) for k, v in stats.items() if isinstance(v, int | float)}


def child_device(out: str, label: str, tiny: bool, steps: int) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from disco_jax import backends

    device = jax.local_devices()[0]
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("data",))
    step, state, batch, spec = decoder(mesh, tiny)
    base = {"phase": "device", "program": label, "model": spec.description, "device_kind": device.device_kind}
    base.update(platform=device.platform, devices=len(jax.devices()), local_devices=len(jax.local_devices()))
    before_compile = memory_stats(device)
    backend = backends.for_platform(device.platform)  # XLA:GPU's hook rules on the GPU, XLA:CPU's in a dry run
    found = [(c, why, seconds) for _, c, why, seconds in programs(step, state, batch, only=label, backend=backend)]
    if not found or found[0][0] is None:
        write_row(out, {**base, "skipped": found[0][1] if found else "unknown program"})
        return
    compiled, _, seconds = found[0]
    row = {**base, "memory": analysis(compiled), "compile_s": seconds}
    row["stats_before_compile"], row["stats_after_compile"] = before_compile, memory_stats(device)
    write_row(out, {**row, "stage": "compiled"})  # kept should the run fail
    leaves, treedef = jax.tree.flatten((state, batch))
    shardings = jax.tree.leaves(compiled.input_shardings[0])
    rng = np.random.default_rng(0)
    block = np.abs(rng.standard_normal(1 << 20, dtype=np.float32)) * 0.02

    def host(aval):  # small positive floats cut from one block (Adam's nu too); token ids 0
        dtype = np.dtype(aval.dtype)
        return np.resize(block, aval.shape).astype(dtype) if dtype.kind == "f" else np.zeros(aval.shape, dtype)

    arrays = [
        jax.make_array_from_callback(a.shape, s, lambda index, a=a: host(a)[index]) for a, s in zip(leaves, shardings)
    ]
    args_state, args_batch = jax.tree.unflatten(treedef, arrays)
    jax.block_until_ready((args_state, args_batch))
    row["stats_with_arguments"] = memory_stats(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        args_state, loss = compiled(args_state, args_batch)
        jax.block_until_ready((args_state, loss))
        times.append(time.perf_counter() - t0)
    row["stats_after_steps"] = memory_stats(device)
    row["step_s"] = times
    row["step_median_s"] = float(np.median(times[1:] if len(times) > 1 else times))
    loss_value = np.asarray(loss.addressable_data(0))
    row["loss"] = float(loss_value)
    write_row(out, {**row, "stage": "ran"})


# ---------------------------------------------------------------------------------- the parent


def run_child(args, extra: list[str], env: dict, what: dict, timeout: float) -> None:
    command = [sys.executable, __file__, "--out", args.out, *(["--tiny"] if args.tiny else []), *extra]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-3000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        write_row(args.out, {**what, "error": f"timed out after {timeout:.0f} s", "stderr_tail": tail})
        return
    sys.stdout.write(done.stdout)
    if done.returncode != 0:
        seconds = time.perf_counter() - started
        write_row(
            args.out,
            {**what, "error": f"exit status {done.returncode}", "seconds": seconds, "stderr_tail": done.stderr[-3000:]},
        )


def summary(path: str) -> None:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    by_program: dict[str, dict] = {}
    for r in rows:
        if "program" not in r:
            continue
        entry = by_program.setdefault(r["program"], {})
        if r.get("phase") == "deviceless" and "memory" in r:
            entry["a"] = r["memory"].get("footprint_bytes")
        if r.get("phase") == "device" and r.get("stage") == "ran":
            entry["b"] = r["memory"].get("footprint_bytes")
            stats = r["stats_after_steps"]
            entry["c"] = stats.get("peak_bytes_in_use")
            entry["args"] = r["stats_with_arguments"].get("bytes_in_use")
            entry["step_ms"] = r["step_median_s"] * 1e3
        if "error" in r:
            entry["error"] = r["error"][:120]
    gb = lambda v: "-" if v is None else f"{v / 1e9:.3f}"  # noqa: E731
    columns = ("(a) deviceless GB", "(b) GPU compile GB", "(c) peak GB", "c/a", "step ms")
    print(f"\n{'program':32} " + " ".join(f"{c:>{max(len(c), 6)}}" for c in columns))
    for label, e in by_program.items():
        ratio = f"{e['c'] / e['a']:.3f}" if e.get("a") and e.get("c") else "-"
        step = f"{e['step_ms']:.1f}" if "step_ms" in e else "-"
        cells = (gb(e.get("a")), gb(e.get("b")), gb(e.get("c")), ratio, step)
        print(f"{label:32} " + " ".join(f"{v:>{max(len(c), 6)}}" for v, c in zip(cells, columns)))
        if "error" in e:
            print(f"{'':32} error: {e['error']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON lines appended here")
    parser.add_argument("--tiny", action="store_true", help="the tiny GPT (a quick check of the script)")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: (a), and the run path on 8 CPU devices")
    parser.add_argument("--steps", type=int, default=5, help="steps run per program")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per process at most")
    parser.add_argument("--time-budget-s", type=float, default=280.0, help="the whole run's seconds at most")
    parser.add_argument("--child", choices=("deviceless", "device"), help=argparse.SUPPRESS)
    parser.add_argument("--program", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    if args.child == "deviceless":
        child_deviceless(args.out, args.tiny)
        return 0
    if args.child == "device":
        import jax

        if not os.environ.get("GPU_MEMORY_CHECK_CPU"):
            jax.config.update("jax_mock_gpu_topology", MOCK_TOPOLOGY)
        child_device(args.out, args.program, args.tiny, args.steps)
        return 0
    started = time.perf_counter()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    write_row(args.out, {"phase": "start", "argv": sys.argv[1:], "xla_flags": os.environ.get("XLA_FLAGS", "")})
    cpu_env = {**env, "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "-1"}
    from disco_jax import offline  # the labels only; no backend starts here

    if args.dry_run:
        flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
        device_env = {**cpu_env, "XLA_FLAGS": flags.strip(), "GPU_MEMORY_CHECK_CPU": "1"}
    else:  # XLA:GPU shards gemm autotuning across the job's processes: the 7 mock ones never answer
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_gpu_shard_autotuning" not in flags:
            flags = f"{flags} --xla_gpu_shard_autotuning=false".strip()
        device_env = {**env, "XLA_FLAGS": flags}
    # The device's programs first (what only the GPU can give), then the deviceless compiles (which
    # any CPU machine can also give), each process within what is left of the time budget.
    children = [
        *(
            (
                {"phase": "device", "program": label},
                ["--child", "device", "--program", label, "--steps", str(args.steps)],
                device_env,
            )
            for label in [offline.REPLICATED, *offline.SHARDED_UPDATES]
        ),
        ({"phase": "deviceless"}, ["--child", "deviceless"], cpu_env),
    ]
    for what, extra, child_env in children:
        left = args.time_budget_s - (time.perf_counter() - started)
        if left < 20:
            write_row(args.out, {**what, "skipped": "time budget spent"})
            continue
        run_child(args, extra, child_env, what, min(args.timeout, left))
    write_row(args.out, {"phase": "end", "seconds": time.perf_counter() - started})
    summary(args.out)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001 - the rows written so far stay; say why it stopped
        traceback.print_exc()
        sys.exit(1)
