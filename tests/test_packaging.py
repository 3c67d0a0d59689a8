"""A wheel built from the repository carries the shipped estimator weights and finds them where it
is installed (importlib.resources), not in the source tree."""

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_ships_and_loads_the_cpu_estimator_weights(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(tmp_path / "dist"),
            str(REPO),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("disco_jax-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "disco_jax/profiles/cpu/gnn_estimator.msgpack" in names
    assert "disco_jax/profiles/cpu/gnn_estimator.json" in names
    assert "disco_jax/profiles/nvidia-h100-80gb-hbm3/gnn_estimator.msgpack" in names  # measured on an H100
    assert "disco_jax/targets/h100_sxm.txtpb" in names
    # The nccl-tests tables the simulated clusters' collectives are fitted to, with their README.
    tables = sorted((REPO / "disco_jax/eval/nccl/data").iterdir())
    assert len(tables) > 20 and {f"disco_jax/eval/nccl/data/{p.name}" for p in tables} <= set(names)
    assert not any(n.endswith("kernel_samples.jsonl") for n in names), "training data belongs in the source tree"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", str(wheel)],
        check=True,
        timeout=300,
    )
    # jax, flax, ... come from this environment's site-packages; disco_jax from the wheel (an entry
    # on PYTHONPATH does not run the editable install's .pth hook, and the cwd is not the repo).
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"], "JAX_PLATFORMS": "cpu"}
    probe = (
        "import json, disco_jax, gnn_estimator\n"
        "from disco_jax import _profile_db, cost\n"
        "from disco_jax.eval import nccl\n"
        "e = gnn_estimator.load_estimator('cpu')\n"
        "print(json.dumps({'package': disco_jax.__file__, 'shipped': str(_profile_db.SHIPPED_PROFILE_DIR),"
        " 'loaded': e is not None, 'plugins': [type(p).__name__ for p in cost.plugin_estimators('cpu')],"
        " 'nccl': nccl.__file__, 'allreduce_us': nccl.collective_model(8, 4, 'ib').time_us(1 << 20)}))\n"
    )
    out = subprocess.run([str(python), "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["package"].startswith(str(venv)) and result["shipped"].startswith(str(venv)), result
    assert result["loaded"], "the installed wheel did not load its shipped GNN weights"
    assert result["plugins"] == ["GnnEstimator"], "the wheel's entry point did not register the GNN with the core"
    assert result["nccl"].startswith(str(venv)) and result["allreduce_us"] > 0, "the wheel's nccl-tests tables"
