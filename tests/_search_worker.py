"""One training process for the fault tests (test_faults.py): decorates the small MLP step of
`_steps.py` on 8 CPU devices and calls it once, in the phase ENABLE_SEARCH says.

    python tests/_search_worker.py PLAN_DIR BUDGET_S

Prints the decorator's progress on stderr and one line `RESULT {json}` on stdout at the end
(`outputs_match`: the decorated call's outputs against the unmodified step's, computed first).
The replicated weight update: one program and one plan per search (the weight-update choice,
which measures the sharded program too, is not what these faults are about; its own tests are
in test_weight_update_choice.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _xla_cache  # noqa: E402

_xla_cache.share()  # the test run's compilation cache, before jax is imported

import jax  # noqa: E402
import optax  # noqa: E402

from disco_jax import _validate, optimize_distributed  # noqa: E402

from _steps import make_step  # noqa: E402

plan_dir, budget_s = sys.argv[1], float(sys.argv[2])
step, args = make_step("jit", optimizer=optax.adam(1e-2))
reference = step(*args)  # the unmodified step, compiled (and cached, where a cache is set) first
wrapped = optimize_distributed(
    budget_s=budget_s, validation_pairs=4, plan_dir=plan_dir, verbose=True, weight_update="replicated"
)(step)
out = jax.block_until_ready(wrapped(*args))
report = wrapped.last_report
keys = ("phase", "search_ran", "applied", "plan_path", "fingerprint", "compile_status", "plan_counts")
result = {key: report.to_json()[key] for key in keys}
result["outputs_match"] = _validate.compare_outputs(reference, out, bitwise=False).within_tolerance
print("RESULT " + json.dumps(result), flush=True)
