"""Fit a GPU's per-kernel launch cost and achieved memory bandwidth to its timed kernels.

Reads `disco_jax/profiles/<device kind>/kernel_samples.jsonl` (kernels timed alone on the GPU,
`scripts/collect_kernel_samples.py`), fits them (`disco_jax.eval.gpus.fit_device_constants`) and
writes `device_constants.json` beside it, which the simulated clusters' `DeviceSpec` of that GPU
reads (`DeviceSpec.with_fitted`); prints the fit.

    python scripts/fit_device_constants.py [--device-kind nvidia-h100-80gb-hbm3]
"""

from __future__ import annotations

import argparse
import json

from disco_jax._profile_db import SHIPPED_PROFILE_DIR, sanitize_device_kind
from disco_jax.eval import gpus


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device-kind", default="nvidia-h100-80gb-hbm3")
    args = parser.parse_args(argv)
    device = gpus.device_for_kind(args.device_kind)
    if device is None:
        raise SystemExit(f"no DeviceSpec for device kind {args.device_kind!r}")
    directory = SHIPPED_PROFILE_DIR / sanitize_device_kind(args.device_kind)
    samples_file = directory / "kernel_samples.jsonl"
    with samples_file.open() as f:
        samples = [json.loads(line) for line in f if line.strip()]
    constants = gpus.fit_device_constants(samples, device.memory_bandwidth.value, samples_file.name)
    path = directory / gpus.CONSTANTS_FILE
    # Constants measured otherwise (the dot efficiency, scripts/gpu_programs_report.py) are kept.
    kept = json.loads(path.read_text())["constants"] if path.exists() else {}
    out = {"device_kind": device.device_kind, "samples": samples_file.name, "constants": {**kept, **constants}}
    path.write_text(json.dumps(out, indent=1) + "\n")
    for name, q in constants.items():
        print(f"{name} = {q['value']:.4g} {q['unit']}: {q['source']}")
    print(f"wrote {directory / gpus.CONSTANTS_FILE}")


if __name__ == "__main__":
    main()
