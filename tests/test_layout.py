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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(package: str = "disco_jax") -> dict[str, set[str]]:
    """The package's import graph: module -> the package modules it imports, every `import` and
    `from ... import` counted (those only for type hints and those inside functions included). A
    name imported from a package that is not a submodule is an edge to the package's `__init__`;
    the parent packages Python loads on the way are not edges (every module would then import
    `disco_jax/__init__`, which imports the public API)."""
    modules = {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's own package upwards
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source not in modules:
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    edges.add(sub if sub in modules else source)
        graph[name] = edges - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one cycle
    through it (a path that returns to its start), so a failure names the imports to cut."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_through(graph, set(c), c[0]) for c in components]


def _cycle_through(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A shortest import path from `start` back to itself inside one strongly connected component."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"{start} is on no cycle")


def test_the_package_has_no_import_cycle():
    cycles = import_cycles(package_imports())
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_cycles():
    """The check above must be able to fail: a two-module loop, a three-module loop beside a module
    outside it, and a package whose submodule imports a name from it."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c", "f"}, "f": set()}
    assert import_cycles(graph) == [["a", "b", "a"], ["c", "d", "e", "c"]]
    imports = package_imports()
    assert "disco_jax._hlo" in imports["disco_jax._graph"]
    assert import_cycles({**imports, "disco_jax._hlo": {"disco_jax._graph"}}) != []


def test_the_graph_ir_imports_nothing_above_it():
    """`_graph.py` is the bottom of the package: it reads HLO text and nothing that costs,
    compiles or knows a backend; the program record beside it (`_program.py`) adds the compiler
    as a protocol and imports only the IR."""
    imports = package_imports()
    assert imports["disco_jax._graph"] <= {"disco_jax._hlo"}, imports["disco_jax._graph"]
    assert imports["disco_jax._program"] <= {"disco_jax._graph"}, imports["disco_jax._program"]


def _dataclass_fields(path: Path, name: str) -> list[str]:
    """The annotated fields of class `name` in the module at `path`, read from the source."""
    (cls,) = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == name]
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


def test_the_graph_holds_no_backend_and_no_cost():
    """`Graph` holds ops, edges, gradients and XLA's plan as read: no field for the compiler (it
    travels in `_program.Program`) nor for what the hook applied; the cost tables are `cost/`'s,
    kept in the one `derived` slot. The check reads the source, so it can fail on a field added
    back (the second half shows it finds `Program`'s backend)."""
    fields = _dataclass_fields(ROOT / "disco_jax" / "_graph.py", "Graph")
    assert "ops" in fields and "gradients" in fields and "xla_groups" in fields
    assert not {f for f in fields if "backend" in f or "compiler" in f or f == "rules_applied"}, fields
    assert not {f for f in fields if f in ("op_work", "transfer_bytes", "collective_ops", "op_flops")}, fields
    assert "backend" in _dataclass_fields(ROOT / "disco_jax" / "_program.py", "Program")


# The layers of docs/architecture.md ("Layers: who may import whom"), bottom first: a module imports
# only from its own layer or below. A module not named takes its package's layer (the last entry
# whose prefix it starts with).
LAYERS: dict[str, int] = {
    "disco_jax.zoo": 0,
    "disco_jax.targets": 0,
    "disco_jax._hlo": 0,
    "disco_jax._files": 0,
    "disco_jax._warnings": 0,
    "disco_jax._validate": 0,
    "disco_jax._distributed": 0,
    "disco_jax._timeline": 0,
    "disco_jax.sharding": 7,
    **{f"disco_jax.sharding.{m}": 0 for m in ("terms", "axioms", "numeric", "prover", "rules", "hlo_edit", "leaves")},
    "disco_jax._graph": 1,
    "disco_jax._program": 1,
    "disco_jax.cost.work": 2,
    **{f"disco_jax.sharding.{m}": 2 for m in ("slices", "gathers", "gathered", "regather", "apply")},
    **{f"disco_jax.{m}": 3 for m in ("_edit", "_strategy", "_search", "_rewrite")},
    "disco_jax.backends": 4,
    "disco_jax.cost": 5,
    **{f"disco_jax.{m}": 6 for m in ("_capture", "_compile", "_output_check", "_plan", "_ranking")},
    **{f"disco_jax.{m}": 6 for m in ("_device_timing", "_profile_db", "_console")},
    **{f"disco_jax.{m}": 7 for m in ("_profile_phase", "_tuning", "_tuning_devices")},
    **{f"disco_jax.sharding.{m}": 7 for m in ("update", "choice")},
    "disco_jax": 8,
}


def layer_of(module: str) -> int:
    """The layer of `module`: its own entry, else its closest enclosing package's."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    raise KeyError(module)


def test_imports_go_down_the_layers():
    upward = [
        f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
        for m, targets in package_imports().items()
        for t in sorted(targets)
        if layer_of(t) > layer_of(m)
    ]
    assert upward == [], "\n".join(upward)
