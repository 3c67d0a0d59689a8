"""The XLA facts the library builds on (docs/xla-facts.md) still hold for the installed jax: each
check script under docs/checks/ runs in its own process and exits 0 only when every fact holds."""

import subprocess
import sys
from pathlib import Path

import pytest

CHECKS = sorted(
    p for p in (Path(__file__).resolve().parents[1] / "docs" / "checks").glob("*.py") if not p.name.startswith("_")
)


def test_every_documented_fact_has_a_check():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "xla-facts.md").read_text()
    assert len(CHECKS) >= 4
    for script in CHECKS:
        assert f"checks/{script.name}" in doc, f"docs/xla-facts.md does not cite {script.name}"


@pytest.mark.parametrize("script", CHECKS, ids=lambda p: p.stem)
def test_fact_check_passes(script):
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=script.parent
    )
    verdicts = [line for line in result.stdout.splitlines() if line.startswith(("[", "jax "))]
    assert result.returncode == 0, "\n".join(verdicts) + "\n" + result.stderr[-3000:]
    assert any(line.startswith("[holds]") for line in verdicts)
