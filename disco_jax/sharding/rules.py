"""The sharding rewrite rules, as data, each with a z3 proof and a numeric check.

    from disco_jax.sharding import rules
    rules.RULES                          # every rule (terms.Rule: name, source, target, variables, conditions)
    rules.prove(rule)                    # prover.Proof: status "proven" | "refuted" | "unknown", seconds
    rules.check_numeric(rule)            # numeric.NumericCheck: passed, instances, failure
    rules.require("sharded_weight_update")   # the rule, once proven and checked; else RuleNotProven

A rule `source => target` says the two terms are equal for every value of its variables that meets
its side conditions, so a plan may replace the source computation by the target one. Its proof is
from `axioms.AXIOMS` only (see `prover.py`); its numeric check evaluates both sides with numpy on
random arrays for N = 2, 4 and 8 replicas (`numeric.py`).
"""

from __future__ import annotations

import dataclasses
from functools import cache

from disco_jax.sharding import prover
from disco_jax.sharding.axioms import AXIOMS, LOOP_AXIOMS
from disco_jax.sharding.numeric import NumericCheck, check_numeric
from disco_jax.sharding.prover import Proof
from disco_jax.sharding.terms import Induction, Rule, rule

RULES: tuple[Rule, ...] = (
    rule(
        "all_reduce_as_reduce_scatter_all_gather",
        "(all_reduce g N)",
        "(all_gather (reduce_scatter g a N) a N)",
        "g:sharded a:axis N:count",
        "(divides N g a)",
        doc="An all-reduce is a reduce-scatter followed by an all-gather along the same axis.",
    ),
    rule(
        "elementwise_commutes_with_partition",
        "(partition (apply f x) a N)",
        "(map f (partition x a N))",
        "f:fn x:tensor a:axis N:count",
        "(elementwise f)",
        "(divides N x a)",
        doc="Applying an elementwise f and then partitioning equals every device applying f to its block.",
    ),
    rule(
        "combine_after_partition",
        "(combine (partition x a N) a N)",
        "x",
        "x:tensor a:axis N:count",
        "(divides N x a)",
        doc="Combining the blocks of a partition along the same axis gives the tensor back.",
    ),
    rule(
        "grouped_reduce_scatter",
        "(concat_each (reduce_scatter g a N) (reduce_scatter h a N) b)",
        "(reduce_scatter (concat_each g h b) a N)",
        "g:sharded h:sharded a:axis b:axis N:count",
        "(distinct a b)",
        "(same_size g h a)",
        "(divides N g a)",
        doc="Two reduce-scatters along axis a become one over the buffer that concatenates the gradients "
        "along another axis b (equal sizes along a). Layout: view each gradient as [N, k_j] (scatter "
        "axis 0), concatenate along axis 1; device i's block is then [shard i of g, shard i of h]. "
        "Concatenating along the scatter axis itself (a flat buffer) does not hold.",
    ),
    rule(
        "own_block_of_all_reduce",
        "(own_block (all_reduce g N) a N)",
        "(reduce_scatter g a N)",
        "g:sharded a:axis N:count",
        "(divides N g a)",
        doc="Each device reading only block i (along a) of an all-reduce's result, i its own position in "
        "the replica group, reads what a reduce-scatter along a gives it: the all-reduce becomes one "
        "(XLA's ReduceScatterCreator; applied at the hook where the compiler has none).",
    ),
    rule(
        "own_block_through_elementwise",
        "(own_block (map f d) a N)",
        "(map f (own_block d a N))",
        "f:fn d:sharded a:axis N:count",
        "(elementwise f)",
        "(divides N d a)",
        doc="Taking each device's own block after an elementwise f equals applying f to the block: the "
        "slice moves up to the value the collective produced.",
    ),
    rule(
        "own_block_through_elementwise2",
        "(own_block (map2 u d e) a N)",
        "(map2 u (own_block d a N) (own_block e a N))",
        "u:fn2 d:sharded e:sharded a:axis N:count",
        "(elementwise u)",
        "(same_shape d e)",
        "(divides N d a)",
        doc="The same for a binary elementwise u: both operands are sliced to the device's own block.",
    ),
    rule(
        "grouped_all_gather",
        "(concat_each (all_gather d a N) (all_gather e a N) b)",
        "(all_gather (concat_each d e b) a N)",
        "d:sharded e:sharded a:axis b:axis N:count",
        "(distinct a b)",
        "(same_size d e a)",
        doc="Two all-gathers along axis a become one of the buffer that concatenates the devices' arrays "
        "along another axis b. Layout: view each device's array as [1, k_j], concatenate along axis 1, "
        "all-gather along axis 0 into [N, sum k_j]; columns j are then the all-gather of array j. "
        "Concatenating along the gathered axis itself does not hold.",
    ),
    rule(
        "sharded_optimizer_state",
        "(partition (apply2 u s (reduce g N)) a N)",
        "(map2 u (partition s a N) (reduce_scatter g a N))",
        "u:fn2 s:tensor g:sharded a:axis N:count",
        "(elementwise u)",
        "(same_shape s g)",
        "(divides N s a)",
        doc="Optimizer state kept sharded between steps and updated with the reduce-scattered gradient "
        "is the shard of the replicated state's update (for an elementwise state update u(state, grad)).",
    ),
    rule(
        "sharded_weight_update",
        "(map2 u (replicate p N) (all_reduce g N))",
        "(all_gather (map2 u (partition p a N) (reduce_scatter g a N)) a N)",
        "u:fn2 p:tensor g:sharded a:axis N:count",
        "(elementwise u)",
        "(same_shape p g)",
        "(divides N p a)",
        doc="Every replica updating the whole parameter with the all-reduced gradient equals reduce-"
        "scattering the gradient, updating the local shard, and all-gathering the parameter, for an "
        "elementwise optimizer update u(param, grad) (SGD, Adam, momentum; not global-norm clipping).",
        lemmas=("sharded_optimizer_state",),
    ),
    # Parameters sharded too (ZeRO-3 / FSDP; `sharding.params`).
    rule(
        "all_gather_before_use",
        "(map2 u (replicate p N) d)",
        "(map2 u (all_gather (partition p a N) a N) d)",
        "u:fn2 p:tensor d:sharded a:axis N:count",
        "(divides N p a)",
        "(same_shape p d)",
        doc="A parameter kept partitioned between steps and all-gathered before use gives every op that "
        "uses it with a device's own data (the forward and backward dots; any u, not only elementwise "
        "ones) what the replicated parameter gives. `same_shape` only because the numeric model's u "
        "takes equal shapes; the proof does not use it.",
    ),
    rule(
        "sharded_parameter_gradient",
        "(partition (reduce g N) a N)",
        "(reduce_scatter g a N)",
        "g:sharded a:axis N:count",
        "(divides N g a)",
        doc="The gradient a device needs for its block of a partitioned parameter, its block of the "
        "devices' gradients summed (the replicated step's all-reduced gradient, partitioned), is the "
        "reduce-scatter of the devices' gradients.",
    ),
    rule(
        "own_block_of_all_gather",
        "(own_block (all_gather (partition p a N) a N) a N)",
        "(partition p a N)",
        "p:tensor a:axis N:count",
        "(divides N p a)",
        doc="Each device reading only its own block of a partitioned parameter's all-gather (along the "
        "partition's axis) reads its own shard: the update of a sharded parameter reads the shard the "
        "step took, not the gathered value (applied at the hook, `sharding.gathered`).",
    ),
)

# Tensor parallelism (Megatron-LM; `sharding.operators`): a dot split on its contracting dimension
# (a row-parallel kernel) or on an output dimension (a column-parallel one).
TENSOR_PARALLEL_RULES = ("row_parallel_dot", "column_parallel_dot")
RULES += (
    rule(
        "column_blocks_of_dot",
        "(map_dot (replicate x N) (partition w 1 N))",
        "(partition (dot x w) 1 N)",
        "x:tensor w:tensor N:count",
        "(contractible x w)",
        "(divides N w 1)",
        doc="Each device multiplying the whole x by its column block of w holds its column block of x @ w.",
    ),
    rule(
        "row_parallel_dot",
        "(replicate (dot x w) N)",
        "(all_reduce (map_dot (partition x 1 N) (partition w 0 N)) N)",
        "x:tensor w:tensor N:count",
        "(contractible x w)",
        "(divides N x 1)",
        doc="A dot split on its contracting dimension (each device holds a column block of the activation "
        "and the matching row block of the kernel, Megatron's row-parallel layer) computes partial products "
        "whose all-reduce is the dot; with sequence parallelism the all-reduce is a reduce-scatter then an "
        "all-gather (all_reduce_as_reduce_scatter_all_gather).",
    ),
    rule(
        "column_parallel_dot",
        "(replicate (dot x w) N)",
        "(all_gather (map_dot (replicate x N) (partition w 1 N)) 1 N)",
        "x:tensor w:tensor N:count",
        "(contractible x w)",
        "(divides N w 1)",
        doc="A dot split on an output dimension (each device holds the whole activation and a column block "
        "of the kernel, Megatron's column-parallel layer: some heads, some MLP columns) gives each device a "
        "column block of the dot; their all-gather is the dot (a row-parallel dot next consumes the blocks "
        "as they are, so the all-gather is not run).",
        lemmas=("column_blocks_of_dot",),
    ),
)

# Loops (`sharding.prefetch`): a scan's iterations rotated so that the next layer's gather runs
# one iteration early.
RULES += (
    rule(
        "loop_rotation",
        "(scan_read u g c xs n)",
        "(rotated_carry u g c (apply g (at xs 0)) xs n n)",
        "u:fn2 g:fn c:tensor xs:stack n:int k:int",
        "(keeps_shape g)",
        "(same_shape c xs)",
        "(loop_length n xs)",
        doc="A loop of n iterations whose body reads g(xs[i]) (g: a layer's all-gather) computes what the "
        "loop computes that carries g of its layer, computed one iteration earlier: g(xs[0]) before the "
        "loop, and in iteration i g(xs[min(i + 1, n - 1)]) (the last iteration's is never read). Proven "
        "by induction on the iterations: after k of them the carries agree and the prefetched value is "
        "g(xs[k]). A reversed scan is the same loop over the reversed stack (it prefetches i - 1). "
        "`keeps_shape g`, `same_shape c xs` only because the numeric model's u takes equal shapes.",
        induction=Induction(
            "k",
            "n",
            ("(scan_read u g c xs k)", "(rotated_carry u g c (apply g (at xs 0)) xs n k)"),
            (("(rotated_prefetch u g c (apply g (at xs 0)) xs n k)", "(apply g (at xs k))"),),
        ),
    ),
)

_BY_NAME = {r.name: r for r in RULES}


def prove(rule: Rule, timeout_s: float = 5.0, axioms: tuple[Rule, ...] = AXIOMS, seed: int = 0) -> Proof:
    """z3's proof of `rule` from `axioms` and its lemmas (earlier rules in RULES, proven first; a
    lemma not proven leaves the rule "unknown"); a rule over loops (`Rule.induction`) also from
    the loops' axioms (`axioms.LOOP_AXIOMS`)."""
    if rule.induction is not None:
        axioms = (*axioms, *(a for a in LOOP_AXIOMS if a not in axioms))
    lemmas = []
    for name in rule.lemmas:
        lemma = _BY_NAME[name]
        if rule in RULES and RULES.index(lemma) >= RULES.index(rule):
            raise ValueError(f"{rule.name}: lemma {name} must come before it in RULES")
        proof = prove(lemma, timeout_s, axioms, seed)
        if not proof.proven:
            return dataclasses.replace(proof, rule=rule.name, status="unknown", lemmas=(name,))
        lemmas.append(lemma)
    return prover.prove(rule, timeout_s, axioms, seed, tuple(lemmas))


class RuleNotProven(RuntimeError):
    """`require` found the rule unknown, not proven by z3, or failing its numeric check."""


@cache
def verified(name: str, timeout_s: float = 5.0) -> tuple[Proof, NumericCheck]:
    """The proof and the numeric check of the named rule (computed once per process)."""
    r = _BY_NAME[name]
    return prove(r, timeout_s), check_numeric(r)


def check_axiom(axiom: Rule) -> NumericCheck:
    """An axiom's numeric check: both sides may be undefined together (z3's functions are total)."""
    return check_numeric(axiom, undefined_agrees=True)


def require(name: str, timeout_s: float = 5.0) -> Rule:
    """The rule called `name` if z3 proved it and its numeric check passed; raises RuleNotProven otherwise.

    For code that cites the rule justifying a rewrite (e.g. a plan's sharded weight update).
    """
    if name not in _BY_NAME:
        raise RuleNotProven(f"no rule named {name!r}; rules: {', '.join(_BY_NAME)}")
    proof, numeric = verified(name, timeout_s)
    if not proof.proven or not numeric.passed:
        raise RuleNotProven(
            f"rule {name}: proof {proof.status} in {proof.seconds:.2f} s, numeric check "
            f"{'passed' if numeric.passed else 'failed: ' + str(numeric.failure)}"
        )
    return _BY_NAME[name]


def summary(timeout_s: float = 5.0, with_axioms: bool = False) -> list[dict]:
    """One JSON-ready dict per rule (and per axiom with `with_axioms`): statement, proof status and
    time, numeric check; `ok` is False for a rule not proven or an axiom or rule failing its check."""
    rows = []
    for r in RULES:
        proof, numeric = verified(r.name, timeout_s)
        rows.append(_row("rule", r, proof, numeric, timeout_s))
    if with_axioms:
        rows += [_row("axiom", a, None, check_axiom(a), timeout_s) for a in (*AXIOMS, *LOOP_AXIOMS)]
    return rows


def _row(kind: str, r: Rule, proof: Proof | None, numeric: NumericCheck, timeout_s: float) -> dict:
    return {
        "kind": kind,
        "name": r.name,
        "source": r.source,
        "target": r.target,
        "conditions": list(r.conditions),
        "proof": None if proof is None else proof.status,
        "proof_seconds": None if proof is None else round(proof.seconds, 4),
        "lemmas": [] if proof is None else list(proof.lemmas),
        "timeout_s": timeout_s,
        "numeric": "passed" if numeric.passed else "failed",
        "numeric_instances": numeric.instances,
        "replica_counts": list(numeric.replica_counts),
        "numeric_failure": numeric.failure,
        "ok": numeric.passed and (proof is None or proof.proven),
    }


__all__ = [
    "RULES",
    "NumericCheck",
    "Proof",
    "Rule",
    "RuleNotProven",
    "check_axiom",
    "check_numeric",
    "prove",
    "require",
    "summary",
    "verified",
]
