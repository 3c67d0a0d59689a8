"""The term language of the sharding rules: typed S-expressions over distributed-tensor operators.

A term is a variable name or a tuple `(operator, *arguments)`, written like egg's rewrites:
`(all_gather (reduce_scatter g a N) a N)`. Every value has a kind:

- `tensor`: one whole array (what a single device would compute alone);
- `sharded`: one array per device of the replica group (SPMD: every device's array has the same shape);
- `axis`, `count`, `device`: integers (a tensor axis, a replica count N, a device index);
- `fn`, `fn2`: a unary / binary array function (`(elementwise f)` says it acts element by element);
- `shape`, `int`: a tensor's shape and one of its sizes (or a loop's iteration count);
- `stack`: a layer-stacked array (what a scan slices one layer of per iteration: `(at xs k)`).

`Rule` is one equation `source = target` between two terms under side conditions; the rewrite it
justifies replaces the source pattern by the target pattern. Axioms use the same record.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

Term = str | tuple

KINDS = ("tensor", "sharded", "axis", "count", "device", "fn", "fn2", "shape", "int", "stack")

# operator -> (argument kinds, result kind, meaning)
OPERATORS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "partition": (("tensor", "axis", "count"), "sharded", "device i holds the i-th of N equal blocks along the axis"),
    "combine": (("sharded", "axis", "count"), "tensor", "concatenation of the N devices' arrays along the axis"),
    "replicate": (("tensor", "count"), "sharded", "every device holds the tensor"),
    "reduce": (("sharded", "count"), "tensor", "sum of the N devices' arrays"),
    "all_reduce": (("sharded", "count"), "sharded", "every device holds the sum"),
    "reduce_scatter": (("sharded", "axis", "count"), "sharded", "device i holds block i (along the axis) of the sum"),
    "all_gather": (("sharded", "axis", "count"), "sharded", "every device holds the concatenation along the axis"),
    "apply": (("fn", "tensor"), "tensor", "f(x)"),
    "apply2": (("fn2", "tensor", "tensor"), "tensor", "u(x, y), e.g. an optimizer's update(param, grad)"),
    "map": (("fn", "sharded"), "sharded", "every device applies f to its own array"),
    "map2": (("fn2", "sharded", "sharded"), "sharded", "every device applies u to its own pair of arrays"),
    "concat": (("tensor", "tensor", "axis"), "tensor", "concatenation of two tensors along the axis"),
    "concat_each": (("sharded", "sharded", "axis"), "sharded", "every device concatenates its two arrays"),
    "own_block": (
        ("sharded", "axis", "count"),
        "sharded",
        "device i takes block i of its own array (a dynamic-slice at offset i * size / N, i its id)",
    ),
    # Tensor parallelism: a matrix product (x's axis 1 contracted with w's axis 0), whole or per device.
    "dot": (("tensor", "tensor"), "tensor", "x @ w: x's axis 1 contracted with w's axis 0"),
    "map_dot": (("sharded", "sharded"), "sharded", "every device multiplies its own pair of arrays"),
    # Loops over the layers of a stack (a scan; `sharding.prefetch`): what its carry is after k
    # iterations. `scan_read` reads g(xs[i]) in iteration i; the rotated loop of n iterations
    # carries, besides c, a prefetched p, and each iteration i computes (u(c, p), g(xs[min(i+1,
    # n-1)])): the next layer's g one iteration early, clamped at the last.
    "at": (("stack", "int"), "tensor", "layer k of the stack (xs[k])"),
    "prev": (("int",), "int", "k - 1"),
    "clamp_next": (("int", "int"), "int", "min(k + 1, n - 1): the layer after k in a loop of n, clamped at its last"),
    "scan_read": (("fn2", "fn", "tensor", "stack", "int"), "tensor", "c after k iterations of c <- u(c, g(xs[i]))"),
    "rotated_carry": (
        ("fn2", "fn", "tensor", "tensor", "stack", "int", "int"),
        "tensor",
        "c after k iterations of (c, p) <- (u(c, p), g(xs[clamp_next i n])) from (c, p)",
    ),
    "rotated_prefetch": (
        ("fn2", "fn", "tensor", "tensor", "stack", "int", "int"),
        "tensor",
        "p after k iterations of the same rotated loop",
    ),
    # Used by the axioms only: a tensor's blocks and a device's array.
    "block": (("tensor", "axis", "count", "device"), "tensor", "block i (mod N) of N equal blocks along the axis"),
    "block_each": (("sharded", "axis", "count", "device"), "sharded", "every device takes block i of its array"),
    "shard": (("sharded", "device"), "tensor", "the array device i (mod N) holds"),
    "shape": (("tensor",), "shape", "the tensor's shape"),
    "size": (("tensor", "axis"), "int", "the tensor's size along the axis"),
}

# predicate -> argument kinds ("any" = tensor or sharded; a sharded value's shape is its per-device shape)
PREDICATES: dict[str, tuple[str, ...]] = {
    "elementwise": ("function",),  # f or u acts element by element (commutes with any indexing)
    "divides": ("count", "any", "axis"),  # N divides the size of x along the axis
    "same_size": ("any", "any", "axis"),  # x and y have the same size along the axis
    "same_shape": ("any", "any"),
    "distinct": ("axis", "axis"),
    "contractible": ("any", "any"),  # x's size along axis 1 is w's along axis 0 (x @ w is defined)
    "positive": ("int",),  # k >= 1
    "keeps_shape": ("function",),  # f's result has its argument's shape
    "loop_length": ("int", "stack"),  # 1 <= n <= the stack's number of layers
}

_TOKEN = re.compile(r"\(|\)|[^\s()]+")


def parse(text: str) -> Term:
    """`"(f (g x) y)"` -> `("f", ("g", "x"), "y")`; a bare name stays a string."""
    tokens = _TOKEN.findall(text)
    pos = 0

    def read() -> Term:
        nonlocal pos
        if pos >= len(tokens):
            raise ValueError(f"unexpected end of term: {text!r}")
        tok = tokens[pos]
        pos += 1
        if tok == ")":
            raise ValueError(f"unexpected ')' in {text!r}")
        if tok != "(":
            return tok
        items = []
        while pos < len(tokens) and tokens[pos] != ")":
            items.append(read())
        if pos >= len(tokens):
            raise ValueError(f"missing ')' in {text!r}")
        pos += 1
        if not items or not isinstance(items[0], str):
            raise ValueError(f"a term starts with an operator name: {text!r}")
        return tuple(items)

    term = read()
    if pos != len(tokens):
        raise ValueError(f"trailing tokens in {text!r}")
    return term


def show(term: Term) -> str:
    return term if isinstance(term, str) else "(" + " ".join(show(t) for t in term) + ")"


def kind_of(term: Term, variables: dict[str, str]) -> str:
    """The kind of a term; raises ValueError on an unknown name or a kind mismatch."""
    if isinstance(term, str):
        if term.isdigit():  # a device index literal, e.g. (shard d 0)
            return "device"
        if term not in variables:
            raise ValueError(f"undeclared variable {term!r}")
        return variables[term]
    op, *args = term
    if op not in OPERATORS:
        raise ValueError(f"unknown operator {op!r}")
    wanted, result, _ = OPERATORS[op]
    if len(args) != len(wanted):
        raise ValueError(f"{op} takes {len(wanted)} arguments, got {len(args)}: {show(term)}")
    for arg, kind in zip(args, wanted):
        if kind_of(arg, variables) != kind and not _literal_of(arg, kind):
            raise ValueError(f"{op}: {show(arg)} is {kind_of(arg, variables)}, not {kind}")
    return result


def _literal_of(term: Term, kind: str) -> bool:
    """An integer literal stands for an axis or a count as well as a device (`(partition x 1 N)`)."""
    return isinstance(term, str) and term.isdigit() and kind in ("axis", "count", "device", "int")


def check_condition(cond: Term, variables: dict[str, str]) -> None:
    if isinstance(cond, str) or cond[0] not in PREDICATES:
        raise ValueError(f"unknown side condition {show(cond)}")
    pred, *args = cond
    wanted = PREDICATES[pred]
    if len(args) != len(wanted):
        raise ValueError(f"{pred} takes {len(wanted)} arguments: {show(cond)}")
    for arg, kind in zip(args, wanted):
        got = kind_of(arg, variables)
        ok = {"any": ("tensor", "sharded", "stack"), "function": ("fn", "fn2")}.get(kind, (kind,))
        if got not in ok and not _literal_of(arg, kind):
            raise ValueError(f"{pred}: {show(arg)} is {got}, not {kind}")


@dataclass(frozen=True)
class Induction:
    """How a rule over loops is proven: by induction on `counter` (an int variable of the rule)
    from 0 to `bound`, with the claim `claim[0] = claim[1]` and, while counter < bound, every
    `invariant` pair equal. The rule's source and target are the claim at counter = bound."""

    counter: str
    bound: str
    claim: tuple[str, str]
    invariants: tuple[tuple[str, str], ...] = ()

    def terms(self) -> list[tuple[Term, Term]]:
        return [(parse(a), parse(b)) for a, b in (self.claim, *self.invariants)]


@dataclass(frozen=True)
class Rule:
    """`source = target` for every value of the variables that satisfies the side conditions.

    `variables` maps each name to its kind; `conditions` are predicate terms such as
    `(elementwise f)` or `(divides N x a)`. Construction checks that both sides are well kinded,
    of the same kind, and use only declared variables.
    """

    name: str
    source: str
    target: str
    variables: tuple[tuple[str, str], ...]
    conditions: tuple[str, ...] = ()
    doc: str = ""
    lemmas: tuple[str, ...] = ()  # earlier rules its proof may use besides the axioms
    induction: Induction | None = None  # a rule over loops: proven by induction (`Induction`)

    def __post_init__(self) -> None:
        kinds = self.kinds
        bad = [k for k in kinds.values() if k not in KINDS]
        if bad:
            raise ValueError(f"{self.name}: unknown kinds {bad}")
        left, right = kind_of(self.source_term, kinds), kind_of(self.target_term, kinds)
        if left != right:
            raise ValueError(f"{self.name}: source is {left}, target is {right}")
        for cond in self.condition_terms:
            check_condition(cond, kinds)
        if self.induction is not None:
            if kinds.get(self.induction.counter) != "int" or kinds.get(self.induction.bound) != "int":
                raise ValueError(f"{self.name}: the induction's counter and bound must be int variables")
            for a, b in self.induction.terms():
                if kind_of(a, kinds) != kind_of(b, kinds):
                    raise ValueError(f"{self.name}: {show(a)} and {show(b)} are of different kinds")

    @cached_property
    def kinds(self) -> dict[str, str]:
        return dict(self.variables)

    @cached_property
    def source_term(self) -> Term:
        return parse(self.source)

    @cached_property
    def target_term(self) -> Term:
        return parse(self.target)

    @cached_property
    def condition_terms(self) -> tuple[Term, ...]:
        return tuple(parse(c) for c in self.conditions)

    @property
    def kind(self) -> str:
        """The kind of both sides (tensor, sharded, shape, ...)."""
        return kind_of(self.source_term, self.kinds)

    def __str__(self) -> str:
        conds = f"  if {', '.join(self.conditions)}" if self.conditions else ""
        return f"{self.source} => {self.target}{conds}"


def rule(
    name: str,
    source: str,
    target: str,
    variables: str,
    *conditions: str,
    doc: str = "",
    lemmas: tuple = (),
    induction: Induction | None = None,
) -> Rule:
    """Shorthand: `variables` as `"g:sharded a:axis N:count"`."""
    pairs = tuple(tuple(v.split(":")) for v in variables.split())
    return Rule(name, source, target, pairs, tuple(conditions), doc, tuple(lemmas), induction)
