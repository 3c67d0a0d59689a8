"""z3 proofs of rules, in the style of TASO's verifier.

Tensors are an uninterpreted sort, a sharded value is an array from device index to tensor (so two
sharded values are equal when every device holds the same tensor), functions are uninterpreted
sorts applied through `apply`/`apply2`, shapes an uninterpreted sort with `size(shape, axis)`. Every
operator is an uninterpreted function; what it means comes only from the axioms (`axioms.AXIOMS`),
each asserted as a universally quantified formula. A rule is proven when z3 answers `unsat` for
`source != target` under the axioms and the rule's side conditions, within the timeout. `sat` means
the axioms admit a counter-model (refuted: not derivable); `unknown` (timeout, or quantifiers z3 could
not decide) is not a proof.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import z3

from disco_jax.sharding.axioms import AXIOMS
from disco_jax.sharding.terms import OPERATORS, Rule, Term, kind_of

# Operators z3 reads as what they are, not as uninterpreted functions: a device's array or a
# stack's layer (array select), a tensor's size, and the loop counters' arithmetic.
INTERPRETED = ("shard", "size", "at", "prev", "clamp_next")


@dataclass(frozen=True)
class Proof:
    """The prover's answer for one rule: `status` is "proven", "refuted" or "unknown"."""

    rule: str
    status: str
    seconds: float
    axioms: int
    timeout_s: float
    lemmas: tuple[str, ...] = ()  # rules proven before that this proof assumed besides the axioms

    @property
    def proven(self) -> bool:
        return self.status == "proven"


class _Signature:
    """The z3 sorts and function symbols of the term language (one set per z3 context)."""

    def __init__(self, ctx: z3.Context) -> None:
        self.ctx = ctx
        self.tensor = z3.DeclareSort("Tensor", ctx)
        self.shape = z3.DeclareSort("Shape", ctx)
        self.fn = z3.DeclareSort("Fn", ctx)
        self.fn2 = z3.DeclareSort("Fn2", ctx)
        integer = z3.IntSort(ctx)
        self.sharded = z3.ArraySort(integer, self.tensor)
        self.sorts = {
            "tensor": self.tensor,
            "sharded": self.sharded,
            "axis": integer,
            "count": integer,
            "device": integer,
            "int": integer,
            "fn": self.fn,
            "fn2": self.fn2,
            "shape": self.shape,
            "stack": self.sharded,  # layer k of a stack as device i of a sharded value: an array from Int
        }
        self.functions = {
            op: z3.Function(op, *[self.sorts[k] for k in args], self.sorts[result])
            for op, (args, result, _) in OPERATORS.items()
            if op not in INTERPRETED
        }
        self.size = z3.Function("size", self.shape, integer, integer)
        self.elementwise = z3.Function("elementwise", self.fn, z3.BoolSort(ctx))
        self.elementwise2 = z3.Function("elementwise2", self.fn2, z3.BoolSort(ctx))
        self.keeps_shape = z3.Function("keeps_shape", self.fn, z3.BoolSort(ctx))
        self.keeps_shape2 = z3.Function("keeps_shape2", self.fn2, z3.BoolSort(ctx))
        self.layers = z3.Function("layers", self.sharded, integer)  # a stack's number of layers

    def term(self, term: Term, env: dict[str, z3.ExprRef]) -> z3.ExprRef:
        if isinstance(term, str):
            return z3.IntVal(int(term), self.ctx) if term.isdigit() else env[term]
        op, *args = term
        zargs = [self.term(a, env) for a in args]
        if op == "shard":
            return z3.Select(zargs[0], zargs[1])
        if op == "size":
            return self.size(self.functions["shape"](zargs[0]), zargs[1])
        if op == "at":
            return z3.Select(zargs[0], zargs[1])
        if op == "prev":
            return zargs[0] - 1
        if op == "clamp_next":
            k, n = zargs
            return z3.If(k + 1 <= n - 1, k + 1, n - 1)
        return self.functions[op](*zargs)

    def shape_of(self, term: Term, env: dict[str, z3.ExprRef], kind: str) -> z3.ExprRef:
        value = self.term(term, env)
        if kind in ("sharded", "stack"):  # the shape every device holds (SPMD); a stack's layer's
            value = z3.Select(value, 0)
        return self.functions["shape"](value)

    def condition(self, cond: Term, env: dict[str, z3.ExprRef], kinds: dict[str, str]) -> z3.BoolRef:
        pred, *args = cond

        def kind(t: Term) -> str:
            return kind_of(t, kinds)

        if pred == "elementwise":
            f = self.term(args[0], env)
            return self.elementwise(f) if kind(args[0]) == "fn" else self.elementwise2(f)
        if pred == "divides":
            n, x, axis = args
            return self.size(self.shape_of(x, env, kind(x)), self.term(axis, env)) % self.term(n, env) == 0
        if pred == "same_size":
            x, y, axis = args
            a = self.term(axis, env)
            return self.size(self.shape_of(x, env, kind(x)), a) == self.size(self.shape_of(y, env, kind(y)), a)
        if pred == "same_shape":
            x, y = args
            return self.shape_of(x, env, kind(x)) == self.shape_of(y, env, kind(y))
        if pred == "positive":
            return self.term(args[0], env) >= 1
        if pred == "keeps_shape":
            f = self.term(args[0], env)
            return self.keeps_shape(f) if kind(args[0]) == "fn" else self.keeps_shape2(f)
        if pred == "loop_length":
            n, xs = (self.term(a, env) for a in args)
            return z3.And(n >= 1, n <= self.layers(xs))
        if pred == "distinct":
            return self.term(args[0], env) != self.term(args[1], env)
        if pred == "contractible":
            x, w = args
            one, zero = z3.IntVal(1, self.ctx), z3.IntVal(0, self.ctx)
            return self.size(self.shape_of(x, env, kind(x)), one) == self.size(self.shape_of(w, env, kind(w)), zero)
        raise ValueError(f"unknown predicate {pred}")

    def variables(self, rule: Rule, prefix: str) -> tuple[dict[str, z3.ExprRef], list[z3.BoolRef]]:
        """z3 constants for the rule's variables, and the facts their kinds carry (N >= 1, 0 <= axis)."""
        env = {name: z3.Const(prefix + name, self.sorts[kind]) for name, kind in rule.variables}
        facts = [env[name] >= 1 for name, kind in rule.variables if kind == "count"]
        facts += [env[name] >= 0 for name, kind in rule.variables if kind == "axis"]
        return env, facts

    def equation(self, rule: Rule, prefix: str) -> tuple[dict, list[z3.BoolRef], z3.BoolRef]:
        env, facts = self.variables(rule, prefix)
        conds = facts + [self.condition(c, env, rule.kinds) for c in rule.condition_terms]
        return env, conds, self.term(rule.source_term, env) == self.term(rule.target_term, env)

    def axiom(self, axiom: Rule) -> z3.BoolRef:
        env, conds, eq = self.equation(axiom, "")
        return z3.ForAll(list(env.values()), z3.Implies(z3.And(conds), eq) if conds else eq)


def prove(
    rule: Rule, timeout_s: float = 5.0, axioms: tuple[Rule, ...] = AXIOMS, seed: int = 0, lemmas: tuple[Rule, ...] = ()
) -> Proof:
    """Ask z3 whether `rule` follows from `axioms`: unsat of `source != target` is a proof.

    `lemmas` are proven rules assumed like axioms (the caller proves them first: `rules.prove`).
    Each proof runs in its own z3 context with a fixed seed, so its answer does not depend on what
    was proven before in the process."""
    sig = _Signature(z3.Context())
    solver = z3.Solver(ctx=sig.ctx)
    solver.set("timeout", max(1, int(timeout_s * 1000)))
    solver.set("random_seed", seed)
    for axiom in (*axioms, *lemmas):
        solver.add(sig.axiom(axiom))
    env, conds, eq = sig.equation(rule, "rule_")
    solver.add(*conds)
    obligations = [eq] if rule.induction is None else _induction(sig, rule, env, eq)
    start = time.perf_counter()
    answers = []
    for goal in obligations:  # each one unsat when negated; the first that is not decides
        solver.push()
        solver.add(z3.Not(goal))
        answers.append(solver.check())
        solver.pop()
        if answers[-1] != z3.unsat:
            break
    seconds = time.perf_counter() - start
    answer = answers[-1]
    status = "proven" if answer == z3.unsat else "refuted" if answer == z3.sat else "unknown"
    return Proof(rule.name, status, seconds, len(axioms), timeout_s, tuple(lemma.name for lemma in lemmas))


def _induction(sig: _Signature, rule: Rule, env: dict, eq: z3.BoolRef) -> list[z3.BoolRef]:
    """The three obligations of a rule proven by induction on its counter k up to its bound n
    (`terms.Induction`): the claim (with the invariants, while k < n) at k = 0; from k to k + 1
    for 0 <= k < n; and the rule's equation from the claim at k = n."""
    ind = rule.induction
    k, n = env[ind.counter], env[ind.bound]
    pairs = ind.terms()

    def holds(at: z3.ArithRef) -> z3.BoolRef:
        local = {**env, ind.counter: at}
        (claim_a, claim_b), *invariants = [(sig.term(a, local), sig.term(b, local)) for a, b in pairs]
        inv = z3.And([a == b for a, b in invariants]) if invariants else z3.BoolVal(True, sig.ctx)
        return z3.Implies(z3.And(at >= 0, at <= n), z3.And(claim_a == claim_b, z3.Implies(at < n, inv)))

    zero = z3.IntVal(0, sig.ctx)
    base = holds(zero)
    step = z3.Implies(z3.And(k >= 0, k < n, holds(k)), holds(k + 1))
    conclusion = z3.Implies(z3.And(n >= 0, holds(n)), eq)
    return [base, step, conclusion]
