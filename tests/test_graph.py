"""The graph IR built from real compiled HLO."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from disco_jax import _capture, _graph, _hlo, _program, backends
from disco_jax.cost import allreduce, sharded, work

from _steps import make_step


@pytest.fixture(scope="module", params=["jit", "shard_map"])
def graph(request):
    step, args = make_step(request.param)
    text, _ = _capture.capture(step.lower(*args))
    return _graph.build_graph(text, backends.CPU.fusible)


def test_gradients_are_the_allreduce_operands(graph):
    # 3 layers x (w, b) + the loss; producers are real ops, sizes are the parameter sizes.
    assert len(graph.gradients) == 7
    sizes = sorted(g.nbytes for g in graph.gradients)
    assert sizes == sorted([16 * 32 * 4, 32 * 4, 32 * 32 * 4, 32 * 4, 32 * 4 * 4, 4 * 4, 4])
    for g in graph.gradients:
        assert graph.ops[g.producer].kind in ("fusible", "opaque")
        assert graph.ops[g.reduced].kind == "reduced"
    assert [len(b) for b in graph.xla_buckets] == [7]


def test_xla_groups_cover_every_fusible_op_and_share_duplicates(graph):
    covered = set().union(*graph.xla_groups)
    assert covered == set(graph.fusible_ops)
    for op, home in graph.xla_homes.items():
        assert op in graph.xla_groups[home]
    # XLA duplicated producers into several fusions; the IR holds each once, in several groups.
    counts = {}
    for g in graph.xla_groups:
        for o in g:
            counts[o] = counts.get(o, 0) + 1
    assert max(counts.values()) > 1


def test_dots_and_custom_fusions_are_opaque(graph):
    for op in graph.ops:
        if op.opcode in ("dot", "convolution", "custom-call", "all-gather", "while"):
            assert op.kind == "opaque"
        if op.opcode == "fusion":
            assert op.kind == "opaque" and op.inst.attr("kind") == "kCustom"


def test_operands_come_before_users(graph):
    for op in graph.ops:
        assert all(o < op.id for o in op.operands)


def test_control_flow_is_one_opaque_kernel_and_its_bodies_are_read_on_request():
    # Auto axes: with Explicit ones (jax.make_mesh's default) jax >= 0.12 refuses the gradient's
    # dot, whose contracting dimension is sharded, without an out_sharding.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

    @jax.jit
    def step(w, x):
        def loss(w):
            h = jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x)
            return jnp.sum(h**2)

        return w - 0.1 * jax.grad(loss)(w)

    w = jax.device_put(jnp.eye(8), NamedSharding(mesh, P()))
    x = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("data")))
    text, _ = _capture.capture(step.lower(w, x))
    graph = _graph.build_graph(text, backends.CPU.fusible)
    whiles = [op for op in graph.ops if op.opcode == "while"]
    assert whiles and all(op.kind == "opaque" for op in whiles)
    # Only entry-level all-reduces become gradients; one inside a loop body stays untouched.
    entry_allreduce_operands = sum(len(i.operands) for i in graph.module.entry.instructions if i.opcode == "all-reduce")
    assert len(graph.gradients) == entry_allreduce_operands
    assert all(op.kind != "fusible" or op.opcode != "all-reduce" for op in graph.ops)
    # control_flow=True: the loop bodies' and conditions' ops too, after the entry's, XLA's fusions
    # there opened; the gradients, the entry's values and the while itself are as before.
    full = _graph.build_graph(text, backends.CPU.fusible, control_flow=True)
    bodies = {c.name for c in _hlo.control_flow_computations(full.module)}
    assert bodies and len(full.ops) > len(graph.ops)
    assert [op.name for op in full.ops[: len(graph.ops)]] == [op.name for op in graph.ops]
    assert len(full.gradients) == len(graph.gradients) and full.entry_values == graph.entry_values
    assert all(o < op.id for op in full.ops for o in op.operands)
    in_bodies = {i.name for c in full.module.computations if c.name in bodies for i in c.instructions}
    assert {op.xla_kernel for op in full.ops[len(graph.ops) :]} <= in_bodies
    assert set(full.xla_kernel_names) - set(graph.xla_kernel_names) <= in_bodies


def _backward_through_free(graph, o):
    """Reference: the non-free ops reachable from op `o` going backwards through free ops only."""
    if graph.ops[o].kind != "free":
        return {o}
    return set().union(set(), *(_backward_through_free(graph, v) for v in graph.ops[o].operands))


def _forward_through_free(graph, o):
    """Reference: non-free users reachable through free ops, -1 where a value is a module output."""
    found, stack, seen = set(), [o], set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if u in graph.output_set and (u == o or graph.ops[u].kind == "free"):
            found.add(-1)
        for user in graph.users[u]:
            if graph.ops[user].kind == "free":
                stack.append(user)
            else:
                found.add(user)
    return found


def test_cached_graph_queries_equal_a_fresh_computation():
    step, args = make_step("jit")
    text, _ = _capture.capture(step.lower(*args))
    graph, fresh = _graph.build_graph(text, backends.CPU.fusible), _graph.build_graph(text, backends.CPU.fusible)
    for o in range(len(graph.ops)):
        sources = graph.free_sources[o]
        assert len(set(sources)) == len(sources) and set(sources) == _backward_through_free(graph, o)
        assert set(graph.consumers(o)) == _forward_through_free(graph, o)
        assert graph.consumers(o) is graph.consumers(o)  # cached on the graph
        assert work.work_per_op(graph)[o] == work.op_work(fresh, o)
    assert graph.free_sources is graph.free_sources and work.work_per_op(graph) is work.work_per_op(graph)
    assert work.work_per_op(fresh) is not work.work_per_op(graph)  # kept per graph object
    assert work.flops_per_op(graph) == [w.flops for w in work.work_per_op(graph)]
    for gradient, mask in zip(graph.gradients, graph.reduced_dependencies):
        reached, stack = set(), [gradient.producer]
        while stack:
            o = stack.pop()
            if o not in reached:
                reached.add(o)
                stack.extend(graph.ops[o].operands)
        assert mask == sum(1 << graph.ops[o].gradient for o in reached if graph.ops[o].kind == "reduced")
    kernels = list(graph.xla_groups) + [frozenset([o]) for o in graph.opaque_ops]
    assert [graph.kernel_signature(k) for k in kernels] == [fresh.kernel_signature(k) for k in kernels]
    assert len({graph.kernel_signature(k) for k in graph.xla_groups}) > 1


def test_a_program_keeps_the_tables_that_read_its_compiler_and_the_graph_none(graph):
    """The tables that depend on the compiler (which gradients reduce-scatter) are kept per
    `Program`, not on the graph: two programs of one graph with different compilers each compute
    their own, and the graph's `derived` slot never holds them."""
    program = _program.Program(graph, backends.CPU)
    assert allreduce.transfer_bytes(program) is allreduce.transfer_bytes(program)
    other = _program.Program(graph, dataclasses.replace(backends.CPU, hook_rules=frozenset()))
    assert allreduce.transfer_bytes(other) is not allreduce.transfer_bytes(program)
    assert sharded.scattered_gradients(other) == frozenset()  # no rule applied: nothing reduce-scatters
    assert not {allreduce.transfer_bytes, sharded.scattered_gradients} & set(graph.derived)
    assert not hasattr(graph, "backend") and not hasattr(graph, "rules_applied")
