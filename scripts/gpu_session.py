"""The prepared command for a lent GPU: every recording `scripts/gpu_programs.py` can make, in
order of value, each stage a process of its own under one deadline, written to a folder as it goes.

    python scripts/gpu_session.py --out DIR [--deadline-s 540] [--cpu-check]

On the device machine (`device` tool; the project from source, z3-solver carried as a wheel):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
      PYTHONPATH=/tmp/site:. python3 scripts/gpu_session.py --out $OUT --deadline-s 540

Stages (files in DIR; each row as `gpu_programs.py` writes it):

1. ``env.json``: the device as JAX and the CUDA runtime describe it (multiprocessors, clocks,
   memory bus, L2), and `nvidia-smi -q`: what a new kind's XLA target config is made from.
2. ``gemm.jsonl``: bf16 products at 7B-class sizes, the backward layouts, attention's batched
   products, two float32 products (`gpu_programs.py gemm`).
3. ``decoder.jsonl``: a Llama2-7B-shaped decoder of 1 and 2 layers (the per-layer cost), one
   layer with cuDNN's fused attention; later a mid-size decoder in float32 and in bfloat16
   (`gpu_programs.py decoder --set llama7b`, then ``--set dtype``), each with its peak memory.
4. ``paper1.jsonl``, ``paper2.jsonl``: the zoo's paper configs at the 8-GPU rows' per-device batch,
   one process per model (so the allocator's peak is that step's), each timed beside its two
   trivial programs (`gpu_programs.py steps --trivial`), the models alternating between the files
   (a file comes back only under 16 MiB).
5. ``tiny.jsonl``: the tiny configs the same way (the per-call cost over 27-300 argument buffers).
6. ``scan.jsonl``: a bfloat16 decoder of 4 layers unrolled and scanned, and of 8 layers scanned
   (`gpu_programs.py decoder --set scan`): the scanned step's error against its unrolled twin's.
7. ``gemm_tp.jsonl``: the products of a Megatron-sharded 7B layer at 2, 4 and 8 ways
   (`gpu_programs.py gemm --tp`): a tensor-parallel shard's dot efficiency.

``--stages`` runs only the named stages, in the order given (a second session on a kind already
recorded skips what it has: ``--stages env scan tp paper tiny``).

Every traced stage runs with command buffers off (`gpu_programs.CB_OFF`), so each kernel is its
own event of the instruction it belongs to. A stage past its share of the deadline is cut (its
rows so far are kept) and the next starts; ``session.log`` holds every stage's output.
``--cpu-check`` runs every stage at toy sizes on the CPU (what the tests run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAPER_MODELS = ("rnnlm", "dlrm", "reformer", "bert", "transformer", "resnet50", "vgg19", "mlp")
TINY_MODELS = ("mlp", "bert", "transformer", "resnet50", "vgg19", "rnnlm", "dlrm", "reformer")
CB_OFF = "--xla_gpu_enable_command_buffer="


ENV_PROGRAM = r"""
import json, sys
import jax
d = jax.devices()[0]
out = {"device_kind": d.device_kind, "platform": d.platform, "jax": jax.__version__}
for a in ("core_count", "compute_capability"):
    out[a] = getattr(d, a, None)
try:
    out["memory_stats"] = {k: int(v) for k, v in (d.memory_stats() or {}).items()}
except Exception as e:
    out["memory_stats"] = str(e)
try:
    import cupy
    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(0)
    out["cuda_properties"] = {k: (v.decode(errors="replace") if isinstance(v, bytes) else v)
                              for k, v in props.items() if isinstance(v, (int, float, str)) or k == "name"}
    attrs = {"clock_rate_khz": 13, "memory_clock_rate_khz": 36, "memory_bus_width_bits": 37, "l2_cache_bytes": 38,
             "multiprocessors": 16, "max_threads_per_multiprocessor": 39, "max_threads_per_block": 1,
             "shared_memory_per_block": 8, "shared_memory_per_multiprocessor": 81,
             "shared_memory_per_block_optin": 97, "registers_per_multiprocessor": 82, "registers_per_block": 12,
             "compute_capability_major": 75, "compute_capability_minor": 76, "warp_size": 10}
    out["cuda_attributes"] = {}
    for name, code in attrs.items():
        try:
            out["cuda_attributes"][name] = int(rt.deviceGetAttribute(code, 0))
        except Exception as e:
            out["cuda_attributes"][name] = f"error: {e}"
    out["mem_get_info"] = list(rt.memGetInfo())
    out["runtime_version"] = rt.runtimeGetVersion()
    out["driver_version"] = rt.driverGetVersion()
except Exception as e:
    out["cuda_properties"] = f"error: {type(e).__name__}: {e}"
json.dump(out, open(sys.argv[1], "w"), indent=1, default=str)
print(json.dumps({k: v for k, v in out.items() if k != "cuda_properties"}, default=str))
"""


class Session:
    def __init__(self, out: Path, deadline_s: float, cpu_check: bool):
        self.out, self.cpu_check = out, cpu_check
        self.end = time.time() + deadline_s
        self.log = out / "session.log"
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.end - time.time()

    def say(self, text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}, {self.left():.0f} s left] {text}"
        print(line, flush=True)
        with self.log.open("a") as f:
            f.write(line + "\n")

    def run(self, label: str, argv: list[str], cap_s: float, *, cb_off: bool = True) -> None:
        """One stage's process, cut at `cap_s` seconds or the deadline, whichever is first."""
        timeout = min(cap_s, self.left() - 5)
        if timeout < 10:
            self.say(f"{label}: skipped, {self.left():.0f} s left")
            return
        env = dict(os.environ)
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
        if cb_off and not self.cpu_check:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + CB_OFF).strip()
        if self.cpu_check:
            env["JAX_PLATFORMS"] = "cpu"
        env["PYTHONUNBUFFERED"] = "1"
        self.say(f"{label}: start, at most {timeout:.0f} s")
        started = time.time()
        with self.log.open("a") as log:
            try:
                rc = subprocess.run(
                    [sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "cut at its time"
        self.say(f"{label}: done in {time.time() - started:.0f} s, exit {rc}")

    def programs(self, mode: str, out_file: str, *extra: str) -> list[str]:
        return [str(HERE / "gpu_programs.py"), mode, "--out", str(self.out / out_file), *extra]


def stage_env(s: Session, small: bool) -> None:
    if shutil.which("nvidia-smi") and not small:
        smi = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True, timeout=30).stdout
    else:
        smi = ""
    env_file = s.out / "env.json"
    s.run("env", ["-c", ENV_PROGRAM, str(env_file)], 40, cb_off=False)
    if env_file.exists():
        env = json.loads(env_file.read_text())
        env["nvidia_smi_q"] = smi
        env_file.write_text(json.dumps(env, indent=1, default=str))


def stage_gemm(s: Session, small: bool) -> None:
    s.run("gemm", s.programs("gemm", "gemm.jsonl", "--time-budget-s", "60", *(["--small"] if small else [])), 75)


def stage_decoder(s: Session, small: bool) -> None:
    which = "small" if small else "llama7b"
    s.run("decoder", s.programs("decoder", "decoder.jsonl", "--set", which, "--time-budget-s", "80"), 110)


def stage_paper(s: Session, small: bool) -> None:
    paper_end = time.time() + 230
    for i, model in enumerate(PAPER_MODELS[:2] if small else PAPER_MODELS):
        config = "tiny" if small else "paper"
        file = f"paper{1 + i % 2}.jsonl"
        cap = min(60, paper_end - time.time())
        argv = s.programs("steps", file, "--models", model, "--config", config, "--budget", "0", "--trivial")
        s.run(f"paper {model}", argv, cap)


def stage_dtype(s: Session, small: bool) -> None:
    if not small:
        s.run("dtype", s.programs("decoder", "decoder.jsonl", "--set", "dtype", "--time-budget-s", "30"), 45)


def stage_tiny(s: Session, small: bool) -> None:
    tiny = TINY_MODELS[:2] if small else TINY_MODELS
    argv = s.programs("steps", "tiny.jsonl", "--models", *tiny, "--budget", "0", "--trivial", "--time-budget-s", "35")
    s.run("tiny", argv, 45)


def stage_scan(s: Session, small: bool) -> None:
    which = "small" if small else "scan"
    labels = ["--labels", "small_f32", "small_scanned"] if small else []
    s.run("scan", s.programs("decoder", "scan.jsonl", "--set", which, "--time-budget-s", "90", *labels), 120)


def stage_tp(s: Session, small: bool) -> None:
    s.run(
        "tp gemm",
        s.programs("gemm", "gemm_tp.jsonl", "--tp", "--time-budget-s", "60", *(["--small"] if small else [])),
        75,
    )


STAGES = {
    "env": stage_env,
    "gemm": stage_gemm,
    "decoder": stage_decoder,
    "paper": stage_paper,
    "dtype": stage_dtype,
    "tiny": stage_tiny,
    "scan": stage_scan,
    "tp": stage_tp,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder the files are written to")
    parser.add_argument("--deadline-s", type=float, default=540.0)
    parser.add_argument("--cpu-check", action="store_true", help="every stage at toy sizes on the CPU")
    parser.add_argument("--stages", nargs="*", choices=STAGES, default=list(STAGES), help="these, in this order")
    args = parser.parse_args(argv)
    s = Session(Path(args.out), args.deadline_s, args.cpu_check)
    small = args.cpu_check
    s.say(f"session: {'CPU check' if small else 'GPU'} run into {s.out}")

    for stage in args.stages:
        STAGES[stage](s, small)
    for f in sorted(s.out.iterdir()):
        s.say(f"{f.name}: {f.stat().st_size / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
