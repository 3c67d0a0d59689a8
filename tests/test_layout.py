"""The codebase's own rules, checked on the source tree: lint and format, module sizes, backend
knowledge only in `disco_jax/backends/`, no writes into other objects' `__dict__`, no private
names across modules, and the evaluation harness outside `import disco_jax`."""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = [p for d in ("disco_jax", "gnn_estimator") for p in sorted((ROOT / d).rglob("*.py"))]
PLATFORM_NAMES = ("cpu", "gpu", "cuda", "rocm", "tpu")


def _ruff(*args: str) -> subprocess.CompletedProcess:
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    return subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_check_and_format_are_clean():
    check = _ruff("check", ".")
    assert check.returncode == 0, check.stdout + check.stderr
    fmt = _ruff("format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_modules_are_at_most_500_lines_and_the_decorator_module_250():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in LIBRARY}
    assert {k: v for k, v in sizes.items() if v > 500} == {}
    defining = [k for k in sizes if "def optimize_distributed(" in (ROOT / k).read_text()]
    assert defining == ["disco_jax/_api.py"] and sizes["disco_jax/_api.py"] <= 250


def _platform_comparisons(path: Path) -> list[str]:
    """Comparisons (==, !=, in, not in) of anything with a platform-name string literal."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            literals = [c for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
            literals += [
                e
                for c in node.comparators
                if isinstance(c, ast.Tuple | ast.List | ast.Set)
                for e in c.elts
                if isinstance(e, ast.Constant)
            ]
            if any(isinstance(c.value, str) and c.value in PLATFORM_NAMES for c in literals):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_backend_name_comparison_outside_backends():
    outside = [p for p in LIBRARY if "backends" not in p.relative_to(ROOT).parts]
    outside += sorted((ROOT / "scripts").glob("*.py"))
    assert [hit for p in outside for hit in _platform_comparisons(p)] == []


def test_the_platform_check_sees_comparisons():
    """The check above must be able to fail: it finds the comparison in a backend's own code."""
    sample = ROOT / "tests" / "_platform_sample.py"
    sample.write_text('def f(backend):\n    return backend == "cpu" or backend in ("cuda", "x")\n')
    try:
        assert len(_platform_comparisons(sample)) == 2
    finally:
        sample.unlink()


def test_no_writes_into_dict_and_no_private_names_across_modules():
    dict_writes, private = [], []
    for p in LIBRARY:
        text = p.read_text()
        dict_writes += [
            f"{p.relative_to(ROOT)}:{m.start()}" for m in re.finditer(r"__dict__\s*(\[|\.setdefault)", text)
        ]
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.split(".")[0] in ("disco_jax", "gnn_estimator")
            ):
                private += [
                    f"{p.relative_to(ROOT)}: from {node.module} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                    and not a.name.startswith("__")
                    and not (ROOT / node.module.replace(".", "/") / f"{a.name}.py").exists()
                    and not (ROOT / node.module.replace(".", "/") / a.name).is_dir()
                ]
    assert dict_writes == []
    assert private == []


@pytest.mark.parametrize("module", ["disco_jax"])
def test_import_does_not_load_the_evaluation_harness_or_plugins(module):
    code = (
        f"import sys, {module}; bad = sorted(m for m in sys.modules if m.startswith(('disco_jax.eval', "
        "'gnn_estimator', 'matplotlib'))); print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
