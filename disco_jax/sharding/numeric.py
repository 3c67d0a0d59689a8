"""The numpy model of the term language, and the numeric check of a rule (or an axiom) in it.

A tensor is a 2-D float64 array, a sharded value a tuple of N arrays (one per device), axes are 0
or 1. The collectives are implemented the way a reduce-scatter or an all-gather runs (device i sums
block i of every device's array; every device concatenates every device's array), not from their
definitions in `axioms.py`, so checking the axioms checks those definitions. Function symbols are
drawn from pools of concrete functions: an `(elementwise f)` condition restricts f to elementwise
ones; without it f ranges over non-elementwise ones too (centering, cumulative sums, global-norm
clipping).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from disco_jax.sharding.terms import Rule, Term, kind_of, show

REPLICA_COUNTS = (2, 4, 8)


@dataclass(frozen=True)
class NumericFunction:
    name: str
    call: Callable
    elementwise: bool


UNARY = (
    NumericFunction("tanh", np.tanh, True),
    NumericFunction("x*x-3x", lambda x: x * x - 3 * x, True),
    NumericFunction("abs", np.abs, True),
    NumericFunction("sigmoid", lambda x: 1 / (1 + np.exp(-x)), True),
    NumericFunction("center_axis0", lambda x: x - x.mean(axis=0, keepdims=True), False),
    NumericFunction("cumsum_axis1", lambda x: np.cumsum(x, axis=1), False),
    NumericFunction("flip_axis0", lambda x: x[::-1], False),
    NumericFunction("divide_by_norm", lambda x: x / (1 + np.linalg.norm(x)), False),
    NumericFunction("mean_axis0", lambda x: x.mean(axis=0, keepdims=True), False),
)
BINARY = (
    NumericFunction("sgd", lambda p, g: p - 0.1 * g, True),
    NumericFunction("adam_first_step", lambda p, g: p - 1e-3 * g / (np.sqrt(g * g) + 1e-8), True),
    NumericFunction("momentum", lambda p, g: 0.9 * p + g, True),
    NumericFunction("sgd_weight_decay", lambda p, g: p - 0.1 * (g + 0.01 * p), True),
    NumericFunction("sgd_clip_global_norm", lambda p, g: p - 0.1 * g / max(1.0, np.linalg.norm(g) / 0.5), False),
    NumericFunction("sgd_mean_gradient", lambda p, g: p - 0.1 * g.mean(), False),
)


class Undefined(ValueError):
    """An operator applied outside its domain (e.g. N does not divide the axis)."""


def _blocks(x: np.ndarray, axis: int, n: int) -> list[np.ndarray]:
    if n < 1 or x.shape[axis] % n:
        raise Undefined(f"{n} does not divide size {x.shape[axis]} of axis {axis}")
    return np.split(x, n, axis=axis)


def _devices(d: Sequence[np.ndarray], n: int) -> Sequence[np.ndarray]:
    if len(d) != n or len({a.shape for a in d}) != 1:
        raise Undefined(f"a sharded value over {len(d)} devices used with N={n}, or devices' shapes differ")
    return d


def _same_shape(x: np.ndarray, y: np.ndarray) -> None:
    if x.shape != y.shape:
        raise Undefined(f"shapes {x.shape} and {y.shape} differ")


def _reduce_scatter(d, a, n):
    return tuple(sum(_blocks(dj, a, n)[i] for dj in _devices(d, n)) for i in range(n))


def _dot(x, w):
    if x.shape[1] != w.shape[0]:
        raise Undefined(f"x @ w of shapes {x.shape} and {w.shape}")
    return x @ w


def _apply2(u, x, y):
    _same_shape(x, y)
    return u.call(x, y)


def _at(xs, k):
    if not 0 <= k < xs.shape[0]:
        raise Undefined(f"layer {k} of a stack of {xs.shape[0]}")
    return xs[k]


def _iterations(k: int) -> range:
    if k < 0:
        raise Undefined(f"{k} iterations")
    return range(k)


def _scan_read(u, g, c, xs, k):
    """The loop as a scan runs it: iteration i reads g of layer i."""
    for i in _iterations(k):
        c = _apply2(u, c, g.call(_at(xs, i)))
    return c


def _clamp_next(k, n):
    return min(k + 1, n - 1)


def _rotated(u, g, c, p, xs, n, k, carry: bool = True):
    """The rotated loop: iteration i reads the carried p and prefetches g of layer i + 1 (clamped).
    With `carry` its c after k iterations (the last iteration's prefetch, which c never reads, is
    not computed), else its p (that part of the loop never reads c)."""
    for i in _iterations(k):
        c = _apply2(u, c, p) if carry else c
        if not carry or i < k - 1:
            p = g.call(_at(xs, _clamp_next(i, n)))
    return c if carry else p


SEMANTICS: dict[str, Callable] = {
    "partition": lambda x, a, n: tuple(_blocks(x, a, n)),
    "combine": lambda d, a, n: np.concatenate(_devices(d, n), axis=a),
    "replicate": lambda x, n: tuple(x.copy() for _ in range(n)),
    "reduce": lambda d, n: sum(_devices(d, n)),
    "all_reduce": lambda d, n: tuple(sum(_devices(d, n)) for _ in range(n)),
    "reduce_scatter": _reduce_scatter,
    "all_gather": lambda d, a, n: tuple(np.concatenate(_devices(d, n), axis=a) for _ in range(n)),
    "apply": lambda f, x: f.call(x),
    "apply2": _apply2,
    "map": lambda f, d: tuple(f.call(x) for x in d),
    "map2": lambda u, d, e: tuple(_apply2(u, x, y) for x, y in zip(d, e, strict=True)),
    "concat": lambda x, y, b: np.concatenate([x, y], axis=b),
    "concat_each": lambda d, e, b: tuple(np.concatenate([x, y], axis=b) for x, y in zip(d, e, strict=True)),
    "block": lambda x, a, n, i: _blocks(x, a, n)[i % n],
    "block_each": lambda d, a, n, i: tuple(_blocks(x, a, n)[i % n] for x in d),
    "own_block": lambda d, a, n: tuple(_blocks(x, a, n)[i] for i, x in enumerate(_devices(d, n))),
    "dot": _dot,
    "map_dot": lambda d, e: tuple(_dot(x, w) for x, w in zip(d, e, strict=True)),
    "at": _at,
    "prev": lambda k: k - 1,
    "clamp_next": _clamp_next,
    "scan_read": _scan_read,
    "rotated_carry": _rotated,
    "rotated_prefetch": lambda u, g, c, p, xs, n, k: _rotated(u, g, c, p, xs, n, k, carry=False),
    "shard": lambda d, i: d[i % len(d)],
    "shape": lambda x: x.shape,
    "size": lambda x, a: x.shape[a],
}


def evaluate(term: Term, env: dict) -> object:
    """The value of `term` in the numpy model, variables from `env`."""
    if isinstance(term, str):
        return int(term) if term.isdigit() else env[term]
    op, *args = term
    return SEMANTICS[op](*(evaluate(a, env) for a in args))


def _shape(value) -> tuple[int, ...]:
    if isinstance(value, tuple):
        _devices(value, len(value))
        return value[0].shape
    return value.shape[1:] if value.ndim == 3 else value.shape  # a stack: its layers' shape


def holds(cond: Term, env: dict) -> bool:
    """A side condition's truth in the numpy model."""
    pred, *args = cond
    vals = [int(a) if a.isdigit() else env[a] for a in args]
    if pred == "elementwise":
        return vals[0].elementwise
    if pred == "divides":
        n, x, a = vals
        return _shape(x)[a] % n == 0
    if pred == "same_size":
        x, y, a = vals
        return _shape(x)[a] == _shape(y)[a]
    if pred == "same_shape":
        return _shape(vals[0]) == _shape(vals[1])
    if pred == "distinct":
        return vals[0] != vals[1]
    if pred == "contractible":
        return _shape(vals[0])[1] == _shape(vals[1])[0]
    if pred == "positive":
        return vals[0] >= 1
    if pred == "keeps_shape":
        return _keeps_shape(vals[0])
    if pred == "loop_length":
        return 1 <= vals[0] <= vals[1].shape[0]
    raise ValueError(f"unknown predicate {pred}")


def _keeps_shape(f: NumericFunction) -> bool:
    x = np.ones((2, 3))
    return (f.call(x) if isinstance(f, NumericFunction) and f in UNARY else f.call(x, x)).shape == x.shape


def _close(x, y) -> bool:
    if isinstance(x, tuple) and isinstance(y, tuple) and not isinstance(x[0] if x else None, int | np.integer):
        return len(x) == len(y) and all(_close(a, b) for a, b in zip(x, y))
    if isinstance(x, np.ndarray) and isinstance(y, np.ndarray):
        return x.shape == y.shape and np.allclose(x, y, rtol=1e-9, atol=1e-9)
    return x == y


def _size(n: int, rng: np.random.Generator) -> int:
    """A multiple of N four times in five, else any size from 1 to 2N - 1."""
    return int(n * rng.integers(1, 4)) if rng.random() < 0.8 else int(rng.integers(1, 2 * n))


def _instance(rule: Rule, n: int, draw: int, rng: np.random.Generator) -> dict:
    """Random values for the rule's variables (2-D arrays; sizes often, not always, multiples of N).
    Function symbols take the pool's functions in turn (`draw` counts the check's instances)."""
    env: dict = {}
    kinds = rule.kinds
    for index, (name, kind) in enumerate(rule.variables):
        if kind == "axis":
            env[name] = int(rng.integers(0, 2))
        elif kind == "count":  # the first count is the replica count, any other one 1, 2 or N
            first = name == next(v for v, k in rule.variables if k == "count")
            env[name] = n if first else int(rng.choice([1, 2, n]))
        elif kind in ("device", "int"):
            env[name] = int(rng.integers(-n, 2 * n))
        elif kind in ("fn", "fn2"):
            pool = UNARY if kind == "fn" else BINARY
            if ("elementwise", name) in rule.condition_terms:
                pool = tuple(f for f in pool if f.elementwise)
            if ("keeps_shape", name) in rule.condition_terms:
                pool = tuple(f for f in pool if _keeps_shape(f))
            env[name] = pool[(draw + index) % len(pool)]
    # One shape per class of variables the conditions say have the same shape or size.
    shapes: dict[str, list[int]] = {}
    for name, kind in rule.variables:
        if kind in ("tensor", "sharded", "stack"):
            shapes[name] = [
                int(n * rng.integers(1, 4)) if rng.random() < 0.8 else int(rng.integers(1, 2 * n)) for _ in "ab"
            ]
    if rng.random() < 0.5:  # half the draws give every array one shape (concatenations are defined)
        first = next(iter(shapes.values()), None)
        shapes = dict.fromkeys(shapes, first)
    for cond in rule.condition_terms:
        if cond[0] == "same_shape":
            shapes[cond[2]] = shapes[cond[1]]
        elif cond[0] == "same_size":
            shapes[cond[2]][env[cond[3]]] = shapes[cond[1]][env[cond[3]]]
        elif cond[0] == "contractible":
            shapes[cond[2]] = [shapes[cond[1]][1], shapes[cond[2]][1]]
    for name, shape in shapes.items():
        if kinds[name] == "tensor":
            env[name] = rng.standard_normal(shape)
        elif kinds[name] == "stack":  # 1 to 2N layers
            env[name] = rng.standard_normal([int(rng.integers(1, 2 * n + 1)), *shape])
        else:
            env[name] = tuple(rng.standard_normal(shape) for _ in range(n))
    return env


@dataclass(frozen=True)
class NumericCheck:
    """`passed` when source and target agreed on every instance that met the side conditions."""

    rule: str
    passed: bool
    instances: int
    replica_counts: tuple[int, ...]
    seconds: float
    failure: str | None = None


def _side(term: Term, env: dict) -> tuple[object, str | None]:
    try:
        return evaluate(term, env), None
    except (Undefined, ValueError, IndexError) as e:
        return None, str(e)


def check_numeric(
    rule: Rule,
    replica_counts: Sequence[int] = REPLICA_COUNTS,
    trials: int = 8,
    seed: int = 0,
    undefined_agrees: bool = False,
) -> NumericCheck:
    """Evaluate both sides on `trials` random instances per replica count; the first mismatch fails it.

    Instances that miss a side condition are redrawn (up to 50 times per trial); a rule whose side
    conditions no draw meets fails, so contradictory conditions cannot pass vacuously. A side that
    is undefined (an operator outside its domain) fails the check, except with `undefined_agrees`
    (used for the axioms, whose functions z3 treats as total) when both sides are undefined; at
    least a quarter of the instances must then be defined.
    """
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    checked = defined = 0
    kind = kind_of(rule.source_term, rule.kinds)

    def result(failure: str | None) -> NumericCheck:
        return NumericCheck(
            rule.name, failure is None, checked, tuple(replica_counts), time.perf_counter() - start, failure
        )

    for n in replica_counts:
        for _ in range(trials):
            for _redraw in range(50):
                env = _instance(rule, n, checked, rng)
                if all(holds(c, env) for c in rule.condition_terms):
                    break
            else:
                return result(f"N={n}: no random instance met the side conditions")
            where = f"replicas={n}: " + ", ".join(f"{k}={_describe(v)}" for k, v in env.items())
            (left, left_error), (right, right_error) = _side(rule.source_term, env), _side(rule.target_term, env)
            checked += 1
            if left_error and right_error and undefined_agrees:
                continue
            if left_error or right_error:
                return result(f"{where}: undefined ({left_error or right_error})")
            if not _close(left, right):
                return result(f"{where}: {show(rule.source_term)} != {show(rule.target_term)} ({kind})")
            defined += 1
    if 4 * defined < checked:
        return result(f"only {defined} of {checked} instances were defined")
    return result(None)


def _describe(value) -> str:
    if isinstance(value, NumericFunction):
        return value.name
    if isinstance(value, np.ndarray):
        return "x".join(map(str, value.shape))
    if isinstance(value, tuple) and value and isinstance(value[0], np.ndarray):
        return f"{len(value)}x[{'x'.join(map(str, value[0].shape))}]"
    return str(value)
