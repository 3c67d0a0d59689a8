"""The axioms the prover assumes: what partition, combine, replicate, reduce, the collectives and
elementwise functions mean, one small fact each, in the same term language as the rules.

Each axiom is also checked numerically (`numeric.check_numeric`) in the numpy model of the
operators, so an axiom that is false in that model fails a test instead of proving false rules.
Device indices are taken modulo N (`block x a N i` is block i mod N), so the axioms hold for every
integer i. The collectives are defined from the four parallel operators (Unity's Reduce followed
by Replicate is an AllReduce), not axiomatized directly.
"""

from __future__ import annotations

from disco_jax.sharding.terms import Rule, rule

AXIOMS: tuple[Rule, ...] = (
    # What a device holds.
    rule(
        "partition_shards",
        "(shard (partition x a n) i)",
        "(block x a n i)",
        "x:tensor a:axis n:count i:device",
        "(divides n x a)",
    ),
    rule("replicate_shards", "(shard (replicate x n) i)", "x", "x:tensor n:count i:device"),
    rule("map_shards", "(shard (map f d) i)", "(apply f (shard d i))", "f:fn d:sharded i:device"),
    rule(
        "map2_shards",
        "(shard (map2 u d e) i)",
        "(apply2 u (shard d i) (shard e i))",
        "u:fn2 d:sharded e:sharded i:device",
        "(same_shape d e)",
    ),
    rule(
        "concat_each_shards",
        "(shard (concat_each d e b) i)",
        "(concat (shard d i) (shard e i) b)",
        "d:sharded e:sharded b:axis i:device",
    ),
    rule(
        "block_each_shards",
        "(shard (block_each d a n i) j)",
        "(block (shard d j) a n i)",
        "d:sharded a:axis n:count i:device j:device",
        "(divides n d a)",
    ),
    rule(
        "own_block_shards",
        "(shard (own_block d a n) i)",
        "(block (shard d i) a n i)",
        "d:sharded a:axis n:count i:device",
        "(divides n d a)",
    ),
    # The collectives, defined from the parallel operators.
    rule("all_reduce_def", "(all_reduce d n)", "(replicate (reduce d n) n)", "d:sharded n:count"),
    rule(
        "reduce_scatter_def",
        "(reduce_scatter d a n)",
        "(partition (reduce d n) a n)",
        "d:sharded a:axis n:count",
        "(divides n d a)",
    ),
    rule(
        "all_gather_def",
        "(all_gather d a n)",
        "(replicate (combine d a n) n)",
        "d:sharded a:axis n:count",
    ),
    # A tensor is the concatenation of its blocks.
    rule(
        "combine_partition",
        "(combine (partition x a n) a n)",
        "x",
        "x:tensor a:axis n:count",
        "(divides n x a)",
    ),
    # Elementwise functions commute with taking a block and keep the shape.
    rule(
        "elementwise_block",
        "(block (apply f x) a n i)",
        "(apply f (block x a n i))",
        "f:fn x:tensor a:axis n:count i:device",
        "(elementwise f)",
        "(divides n x a)",
    ),
    rule(
        "elementwise2_block",
        "(block (apply2 u x y) a n i)",
        "(apply2 u (block x a n i) (block y a n i))",
        "u:fn2 x:tensor y:tensor a:axis n:count i:device",
        "(elementwise u)",
        "(same_shape x y)",
        "(divides n x a)",
    ),
    rule("elementwise_shape", "(shape (apply f x))", "(shape x)", "f:fn x:tensor", "(elementwise f)"),
    rule(
        "elementwise2_shape",
        "(shape (apply2 u x y))",
        "(shape x)",
        "u:fn2 x:tensor y:tensor",
        "(elementwise u)",
        "(same_shape x y)",
    ),
    # The sum over devices is elementwise across devices: it commutes with blocks and concatenation.
    rule(
        "reduce_block",
        "(block (reduce d n) a m i)",
        "(reduce (block_each d a m i) n)",
        "d:sharded n:count a:axis m:count i:device",
        "(divides m d a)",
    ),
    rule(
        "reduce_concat",
        "(reduce (concat_each d e b) n)",
        "(concat (reduce d n) (reduce e n) b)",
        "d:sharded e:sharded n:count b:axis",
    ),
    # Combining devices' arrays along one axis commutes with concatenating them along another.
    rule(
        "combine_concat",
        "(combine (concat_each d e b) a n)",
        "(concat (combine d a n) (combine e a n) b)",
        "d:sharded e:sharded a:axis b:axis n:count",
        "(distinct a b)",
        "(same_size d e a)",
    ),
    rule("reduce_shape", "(shape (reduce d n))", "(shape (shard d 0))", "d:sharded n:count"),
    rule(
        "block_shape",
        "(shape (block x a n i))",
        "(shape (block y a n j))",
        "x:tensor y:tensor a:axis n:count i:device j:device",
        "(same_shape x y)",
        "(divides n x a)",
    ),
    # SPMD: every device holds an array of the same shape.
    rule("spmd_shape", "(shape (shard d i))", "(shape (shard d 0))", "d:sharded i:device"),
    rule(
        "concat_size",
        "(size (concat x y b) a)",
        "(size x a)",
        "x:tensor y:tensor a:axis b:axis",
        "(distinct a b)",
        "(same_size x y a)",
    ),
    # Slicing along one axis commutes with concatenating along another.
    rule(
        "block_concat",
        "(block (concat x y b) a n i)",
        "(concat (block x a n i) (block y a n i) b)",
        "x:tensor y:tensor a:axis b:axis n:count i:device",
        "(distinct a b)",
        "(same_size x y a)",
        "(divides n x a)",
    ),
    # Matrix products (tensor parallelism): per device, and the block-matrix identities.
    rule(
        "map_dot_shards",
        "(shard (map_dot d e) i)",
        "(dot (shard d i) (shard e i))",
        "d:sharded e:sharded i:device",
        "(contractible d e)",
    ),
    rule(
        "dot_sum_of_contraction_blocks",
        "(reduce (map_dot (partition x 1 n) (partition w 0 n)) n)",
        "(dot x w)",
        "x:tensor w:tensor n:count",
        "(contractible x w)",
        "(divides n x 1)",
        doc="x @ w is the sum over i of x's i-th column block times w's i-th row block.",
    ),
    rule(
        "dot_column_block",
        "(block (dot x w) 1 n i)",
        "(dot x (block w 1 n i))",
        "x:tensor w:tensor n:count i:device",
        "(contractible x w)",
        "(divides n w 1)",
        doc="Column block i of x @ w is x times w's column block i.",
    ),
    rule(
        "block_keeps_other_sizes",
        "(size (block x a n i) b)",
        "(size x b)",
        "x:tensor a:axis b:axis n:count i:device",
        "(distinct a b)",
        "(divides n x a)",
    ),
    rule(
        "dot_columns",
        "(size (dot x w) 1)",
        "(size w 1)",
        "x:tensor w:tensor",
        "(contractible x w)",
    ),
)

# What a loop over a stack's layers computes (a scan: `rules.loop_rotation`), one iteration at a
# time: each loop's value after 0 iterations, and after k >= 1 from its value after k - 1. Asserted
# only for rules over loops (`rules.prove`), so that the other rules' proofs search what they did.
_LOOP = "u:fn2 g:fn c:tensor p:tensor xs:stack n:int k:int"
_ROTATED = "u g c p xs n"
LOOP_AXIOMS: tuple[Rule, ...] = (
    rule("scan_read_start", "(scan_read u g c xs 0)", "c", "u:fn2 g:fn c:tensor xs:stack"),
    rule(
        "scan_read_step",
        "(scan_read u g c xs k)",
        "(apply2 u (scan_read u g c xs (prev k)) (apply g (at xs (prev k))))",
        "u:fn2 g:fn c:tensor xs:stack k:int",
        "(positive k)",
        doc="Iteration k - 1 reads layer k - 1 through g.",
    ),
    rule("rotated_carry_start", f"(rotated_carry {_ROTATED} 0)", "c", _LOOP),
    rule("rotated_prefetch_start", f"(rotated_prefetch {_ROTATED} 0)", "p", _LOOP),
    rule(
        "rotated_carry_step",
        f"(rotated_carry {_ROTATED} k)",
        f"(apply2 u (rotated_carry {_ROTATED} (prev k)) (rotated_prefetch {_ROTATED} (prev k)))",
        _LOOP,
        "(positive k)",
        doc="The rotated loop's body reads what it carries.",
    ),
    rule(
        "rotated_prefetch_step",
        f"(rotated_prefetch {_ROTATED} k)",
        "(apply g (at xs (clamp_next (prev k) n)))",
        _LOOP,
        "(positive k)",
        doc="Iteration k - 1 prefetches the next layer, clamped at the loop's last.",
    ),
)
