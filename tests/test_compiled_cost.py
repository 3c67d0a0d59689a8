"""The compiled-program cost model (`disco_jax.cost.compiled`): it costs exactly the kernels and
collectives of the module XLA compiled (XLA:GPU deviceless for 8 H100s, every zoo model at the
size `conftest.xla_gpu_zoo` compiles; XLA:CPU), in XLA's schedule on a compute and a
communication stream, by measurement where a profile timed the kernel, and 16-bit dots at the
tensor cores' 16-bit rate."""

import json

import jax
import jax.numpy as jnp
import optax
import pytest
from _hlo_text import COLLECTIVES, executed_kernels, module_kernels
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from disco_jax import _device_timing, backends, cost, targets, zoo
from disco_jax.eval import clusters, gpus

H100_ROOFLINE = gpus.RooflineEstimator(gpus.H100_SXM)
H100_COLLECTIVES = clusters.get_cluster("8xH100-NVLink").allreduce_model()


@pytest.mark.parametrize("model", sorted(zoo.MODELS))
def test_every_kernel_and_collective_of_xla_gpu_program_is_costed_once(model, xla_gpu_zoo):
    text = xla_gpu_zoo(model)[2]
    compute, collectives = module_kernels(text)
    program = cost.compiled_program(text, backends.GPU)
    costed = cost.cost_program(program, H100_ROOFLINE, H100_COLLECTIVES)
    record = costed.to_json()
    assert record["num_kernels"] == compute > 0
    assert [(k.name, k.lane) for k in costed.kernels if k.method == "collective model"] == [
        (name, "comm") for name, _ in collectives
    ]
    assert collectives and {k.kind for k in costed.kernels if k.lane == "comm"} <= COLLECTIVES
    assert record["costed_by"] == {"roofline": compute, "collective model": len(collectives)}
    assert costed.iteration_us >= max(costed.compute_us, costed.comm_us) > 0
    assert costed.compute_us == pytest.approx(sum(k.time_us for k in costed.kernels if k.lane == "compute"))
    json.dumps(costed.to_json(kernels=True))
    # Library calls and gemm fusions carry their flops (cuDNN convolutions: from their attributes).
    matrix = [k for k in program.compute_kernels if k.kind in ("gemm", "conv")]
    assert matrix and all(cost.kernel_work(program.graph, program.ops[k.name]).dot > 0 for k in matrix)


def test_h100_estimator_costs_fusions_by_the_gnn_within_its_range_and_the_rest_by_the_fitted_roofline(xla_gpu_zoo):
    """XLA:GPU's horizontally fused Adam updates exceed the GNN's training range (its largest
    kernel): the roofline at the fitted bandwidth costs them; gemms are roofline at the dot
    efficiency measured on an H100, so nothing they cost is marked assumed."""
    text = xla_gpu_zoo("transformer")[2]
    program = cost.compiled_program(text, backends.GPU)
    estimator = clusters.get_cluster("8xH100-NVLink").kernel_estimator()
    costed = cost.cost_program(program, estimator, H100_COLLECTIVES)
    gnn = estimator.estimators[0].base  # the GNN under `gpus.DtypeTrueEstimator`
    kinds = {k.name: k for k in costed.kernels}
    largest = max(program.compute_kernels, key=lambda k: len(program.ops[k.name]))
    assert len(program.ops[largest.name]) > gnn.max_ops and kinds[largest.name].method == "roofline"
    assert all(len(program.ops[k.name]) <= gnn.max_ops for k in costed.kernels if k.method == "gnn")
    assert {k.method for k in costed.kernels if k.kind == "gemm"} == {"roofline"}
    assert not any("dot_efficiency" in k.assumed for k in costed.kernels if k.kind == "gemm")
    assert costed.costed_by["gnn"] > 0 and "none" not in costed.costed_by


# The reduction and two loop fusions the hand-written modules below call.
COMPUTATIONS = """
%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

%fused_exp (p0: f32[1024]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  ROOT %exp = f32[1024]{0} exponential(%p0)
}

%fused_neg (p1: f32[1024]) -> f32[1024] {
  %p1 = f32[1024]{0} parameter(0)
  ROOT %neg = f32[1024]{0} negate(%p1)
}
"""

SCHEDULE = (
    """HloModule schedule, is_scheduled=true
"""
    + COMPUTATIONS
    + """
%fused_mul (p2: f32[1024], p3: f32[1024]) -> f32[1024] {
  %p2 = f32[1024]{0} parameter(0)
  %p3 = f32[1024]{0} parameter(1)
  ROOT %mul = f32[1024]{0} multiply(%p2, %p3)
}

ENTRY %main (a: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  %f1 = f32[1024]{0} fusion(%a), kind=kLoop, calls=%fused_exp
  %ars = ((f32[1024]{0}), f32[1024]{0}) all-reduce-start(%f1), replica_groups={}, to_apply=%sum
  %f2 = f32[1024]{0} fusion(%a), kind=kLoop, calls=%fused_neg
  %ard = f32[1024]{0} all-reduce-done(%ars)
  %ar = f32[1024]{0} all-reduce(%f2), replica_groups={}, to_apply=%sum
  ROOT %f3 = f32[1024]{0} fusion(%ard, %ar), kind=kLoop, calls=%fused_mul
}
"""
)


class _Fixed:
    """Every kernel 10 us; every collective 100 us."""

    name = "fixed"

    def estimate(self, graph, kernels):
        return [10.0] * len(kernels)

    def time_us(self, nbytes):
        return 100.0

    def to_json(self):
        return {}


def test_async_collective_overlaps_until_its_done_and_a_synchronous_one_blocks():
    costed = cost.compiled_cost(SCHEDULE, backends.GPU, _Fixed(), _Fixed())
    spans = {k.name: (k.lane, k.start_us, k.end_us) for k in costed.kernels}
    assert spans == {
        "f1": ("compute", 0.0, 10.0),
        "ars": ("comm", 10.0, 110.0),  # starts where the compute stream reaches it
        "f2": ("compute", 10.0, 20.0),  # runs under the async all-reduce
        "ar": ("comm", 110.0, 210.0),  # after the done: waits for the channel, blocks compute
        "f3": ("compute", 210.0, 220.0),
    }
    assert (costed.iteration_us, costed.compute_us, costed.comm_us) == (220.0, 30.0, 200.0)
    assert costed.full_overlap_us == 200.0
    step = cost.compiled_cost(SCHEDULE, backends.GPU, _Fixed(), _Fixed(), cost.SimulatorParams(2.0, 0.0, 1.0, 5.0))
    assert step.iteration_us == 21.0 + 200.0 + 21.0 + 5.0  # f1, the collectives (f2 under the first), f3


def test_unscheduled_modules_and_unknown_async_starts_are_refused():
    with pytest.raises(ValueError, match="is_scheduled"):
        backends.GPU.read_kernels(SCHEDULE.replace(", is_scheduled=true", ""))
    copied = SCHEDULE.replace("all-reduce-start(%f1), replica_groups={}, to_apply=%sum", "copy-start(%f1)")
    with pytest.raises(ValueError, match="async copy-start of no collective"):
        backends.GPU.read_kernels(copied.replace("all-reduce-done(%ars)", "copy-done(%ars)"))


# A loop of 3 layers: each iteration a kernel, an async all-reduce of its result under a second
# kernel, then the done; a kernel before and after the loop. `{TRIP}` is the while's backend config.
LOOP = (
    """HloModule loop, is_scheduled=true
"""
    + COMPUTATIONS
    + """
%fused_step (i0: s32[]) -> s32[] {
  %i0 = s32[] parameter(0)
  %one = s32[] constant(1)
  ROOT %next = s32[] add(%i0, %one)
}

%fused_less (i1: s32[], n1: s32[]) -> pred[] {
  %i1 = s32[] parameter(0)
  %n1 = s32[] parameter(1)
  ROOT %lt = pred[] compare(%i1, %n1), direction=LT
}

%body (state: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %state = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %h = f32[1024]{0} get-tuple-element(%state), index=1
  %b1 = f32[1024]{0} fusion(%h), kind=kLoop, calls=%fused_exp
  %bar = ((f32[1024]{0}), f32[1024]{0}) all-reduce-start(%b1), replica_groups={}, to_apply=%sum
  %b2 = f32[1024]{0} fusion(%h), kind=kLoop, calls=%fused_neg
  %bad = f32[1024]{0} all-reduce-done(%bar)
  %inc = s32[] fusion(%i), kind=kLoop, calls=%fused_step
  ROOT %next_state = (s32[], f32[1024]{0}) tuple(%inc, %bad)
}

%condition (cstate: (s32[], f32[1024])) -> pred[] {
  %cstate = (s32[], f32[1024]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%cstate), index=0
  %limit = s32[] constant({LIMIT})
  ROOT %more = pred[] fusion(%ci, %limit), kind=kLoop, calls=%fused_less
}

ENTRY %main (a: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  %before = f32[1024]{0} fusion(%a), kind=kLoop, calls=%fused_exp
  %zero = s32[] constant(0)
  %init = (s32[], f32[1024]{0}) tuple(%zero, %before)
  %loop = (s32[], f32[1024]{0}) while(%init), condition=%condition, body=%body{TRIP}
  %out = f32[1024]{0} get-tuple-element(%loop), index=1
  ROOT %after = f32[1024]{0} fusion(%out), kind=kLoop, calls=%fused_neg
}
"""
)
KNOWN = ', backend_config={"known_trip_count":{"n":"3"},"known_init_step":{"init":"0","step":"1"}}'


def test_a_loop_costs_its_body_once_per_iteration_with_its_collectives_in_the_body_schedule():
    """A `while` with XLA's known trip count: its body's kernels run 3 times, in the body's own
    schedule (each all-reduce hides under the kernel the body schedules before its done, and
    nothing else); the runtime does not evaluate the condition (XLA's WhileThunk runs a known
    trip count as a for loop)."""
    text = LOOP.replace("{TRIP}", KNOWN).replace("{LIMIT}", "3")
    schedule = backends.GPU.read_kernels(text)
    [loop] = schedule.control_flow
    assert (loop.name, loop.trip_count, loop.trip_count_from, loop.parts) == (
        "loop",
        3,
        "known_trip_count",
        ("loop/body",),
    )
    assert {k.name: (k.scope, k.repeat) for k in schedule} == {
        "before": ("", 1),
        "b1": ("loop/body", 3),
        "bar": ("loop/body", 3),
        "b2": ("loop/body", 3),
        "inc": ("loop/body", 3),
        "after": ("", 1),
    }
    assert schedule.executed() == 2 + 4 * 3
    costed = cost.compiled_cost(text, backends.GPU, _Fixed(), _Fixed())
    runs = [(k.name, k.iteration, k.start_us, k.end_us) for k in costed.kernels]
    assert runs == [
        ("before", (), 0.0, 10.0),
        *[
            run
            for i in range(3)
            for run in (
                ("b1", (i,), 10.0 + 120 * i, 20.0 + 120 * i),
                ("bar", (i,), 20.0 + 120 * i, 120.0 + 120 * i),  # on the communication stream
                ("b2", (i,), 20.0 + 120 * i, 30.0 + 120 * i),  # hides 10 us of it
                ("inc", (i,), 120.0 + 120 * i, 130.0 + 120 * i),  # after the done: waits for it
            )
        ],
        ("after", (), 370.0, 380.0),
    ]
    assert (costed.iteration_us, costed.compute_us, costed.comm_us) == (380.0, 110.0, 300.0)
    record = costed.to_json()
    assert (record["num_kernels"], record["num_collectives"]) == (11, 3)
    assert record["control_flow"] == [
        {
            "name": "loop",
            "opcode": "while",
            "scope": "",
            "iteration": [],
            "trip_count": 3,
            "trip_count_from": "known_trip_count",
            "time_us": 360.0,
        }
    ]


def test_the_host_lane_issues_a_loop_body_s_kernels_once_per_iteration():
    """With a host lane the host issues every run of a body kernel (XLA:GPU's WhileThunk launches
    the body's thunks once per iteration): 20 us a launch against 10 us kernels, so the compute
    stream waits for the host, and the loop's 3 iterations of 4 runs cost 12 launches."""
    from disco_jax.cost.host import HostLane

    text = LOOP.replace("{TRIP}", KNOWN).replace("{LIMIT}", "3")
    host = HostLane(issue_us={"fusion": 20.0, "collective": 20.0})
    costed = cost.compiled_cost(text, backends.GPU, _Fixed(), _Fixed(), cost.SimulatorParams(host=host))
    assert costed.host_us == 20.0 * (2 + 4 * 3)
    assert costed.device_wait_us > 0 and costed.iteration_us >= costed.host_us
    assert all(k.start_us >= 20.0 for k in costed.kernels)


def test_a_loop_without_a_known_trip_count_is_read_from_its_induction_variable_and_evaluates_its_condition():
    """No `known_trip_count`: the trip count is the induction variable's bound (0 to 4 by 1), and
    the runtime evaluates the condition before every iteration and after the last (5 times)."""
    text = LOOP.replace("{TRIP}", "").replace("{LIMIT}", "4")
    schedule = backends.GPU.read_kernels(text)
    [loop] = schedule.control_flow
    assert (loop.trip_count, loop.trip_count_from, loop.parts) == (
        4,
        "induction variable",
        ("loop/condition", "loop/body"),
    )
    assert {k.name: k.repeat for k in schedule if k.scope == "loop/condition"} == {"more": 5}
    costed = cost.compiled_cost(text, backends.GPU, _Fixed(), _Fixed())
    assert [k.iteration for k in costed.kernels if k.name == "more"] == [(i,) for i in range(5)]
    assert costed.to_json()["num_kernels"] == 2 + 3 * 4 + 5


def test_a_loop_whose_trip_count_cannot_be_read_is_refused_by_name():
    """A bound that is not a constant, or a comparison the counter never ends (it counts up while
    greater than its bound): refused, the loop named, never costed as one kernel."""
    unknown = LOOP.replace("{TRIP}", "").replace(
        "%limit = s32[] constant({LIMIT})", "%limit = s32[] iota(), iota_dimension=0"
    )
    with pytest.raises(ValueError, match=r"^loop: a while loop whose trip count cannot be read"):
        backends.GPU.read_kernels(unknown)
    never = LOOP.replace("{TRIP}", "").replace("{LIMIT}", "4").replace("direction=LT", "direction=GT")
    with pytest.raises(ValueError, match="^loop: "):
        backends.GPU.read_kernels(never)


BRANCHES = """HloModule branches, is_scheduled=true

%fused_exp (p0: f32[1024]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  ROOT %exp = f32[1024]{0} exponential(%p0)
}

%cheap (c0: f32[1024]) -> f32[1024] {
  %c0 = f32[1024]{0} parameter(0)
  ROOT %c1 = f32[1024]{0} fusion(%c0), kind=kLoop, calls=%fused_exp
}

%costly (d0: f32[1024]) -> f32[1024] {
  %d0 = f32[1024]{0} parameter(0)
  %d1 = f32[1024]{0} fusion(%d0), kind=kLoop, calls=%fused_exp
  ROOT %d2 = f32[1024]{0} fusion(%d1), kind=kLoop, calls=%fused_exp
}

%helper (h0: f32[1024]) -> f32[1024] {
  %h0 = f32[1024]{0} parameter(0)
  ROOT %h1 = f32[1024]{0} fusion(%h0), kind=kLoop, calls=%fused_exp
}

ENTRY %main (a: f32[1024], k: s32[]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  %k = s32[] parameter(1)
  %called = f32[1024]{0} call(%a), to_apply=%helper
  %picked = f32[1024]{0} conditional(%k, %called, %called), branch_computations={%cheap, %costly}
  ROOT %last = f32[1024]{0} fusion(%picked), kind=kLoop, calls=%fused_exp
}
"""


def test_a_conditional_costs_its_most_expensive_branch_and_says_so_and_a_call_is_inlined():
    schedule = backends.GPU.read_kernels(BRANCHES)
    assert [(k.name, k.scope) for k in schedule] == [
        ("h1", ""),  # the call's kernel, inlined where the call is
        ("c1", "picked/branch0"),
        ("d1", "picked/branch1"),
        ("d2", "picked/branch1"),
        ("last", ""),
    ]
    costed = cost.compiled_cost(BRANCHES, backends.GPU, _Fixed(), _Fixed())
    assert [(k.name, k.start_us) for k in costed.kernels] == [("h1", 0.0), ("d1", 10.0), ("d2", 20.0), ("last", 30.0)]
    [branch] = costed.to_json()["control_flow"]
    assert (branch["name"], branch["branch"], branch["branch_us"], branch["time_us"]) == (
        "picked",
        1,
        [10.0, 20.0],
        20.0,
    )
    assert "most expensive branch" in branch["note"]


def test_a_scanned_decoder_is_costed_kernel_by_kernel_as_xla_gpu_runs_its_loops():
    """The tiny GPT in bfloat16 with its 3 blocks under `nn.scan` (a `while` for the forward and
    one for the backward, DESIGN.md point 22) and unrolled, compiled deviceless for 8 H100s and
    costed with the cluster's estimator (the dtype-true GNN) and host lane: the model runs
    exactly the kernels and collectives the module executes (each body's times its trip count,
    plus the rest, counted from the text here), the backward body's all-reduce once per layer on
    the communication stream, and the same gemms as the unrolled twin (same flops, same time)."""
    costs = {}
    for scan in (True, False):
        spec = zoo.resized("gpt", num_layers=3, scan_layers=scan, compute_dtype="bfloat16")
        text = zoo.lower_abstract(spec, optax.adam(1e-3), targets.mesh("h100-sxm", 8), "jit").compile().as_text()
        program = cost.compiled_program(text, backends.GPU)
        cluster = clusters.get_cluster("8xH100-NVLink")  # the GNN (dtype-true) and the host lane too
        costed = cost.cost_program(program, cluster.kernel_estimator(), H100_COLLECTIVES, cluster.simulator_params())
        record = costed.to_json()
        assert (record["num_kernels"], record["num_collectives"]) == executed_kernels(text)
        loops = record.get("control_flow", [])
        assert [(c["opcode"], c["trip_count"]) for c in loops] == ([("while", 3)] * 2 if scan else [])
        body_collectives = [k for k in costed.kernels if k.lane == "comm" and k.scope]
        assert [k.iteration for k in body_collectives] == ([(0,), (1,), (2,)] if scan else [])
        assert all(k.scope.endswith("/body") for k in costed.kernels if k.iteration)
        gemms = [k for k in costed.kernels if k.kind == "gemm"]
        flops = sum(cost.kernel_work(program.graph, program.ops[k.name]).dot for k in gemms)
        costs[scan] = (flops, sum(k.time_us for k in gemms), costed)
    (scanned_flops, scanned_gemm_us, _), (unrolled_flops, unrolled_gemm_us, _) = costs[True], costs[False]
    assert scanned_flops == pytest.approx(unrolled_flops, rel=1e-6) and scanned_flops > 0
    assert scanned_gemm_us == pytest.approx(unrolled_gemm_us, rel=0.05)


def test_16bit_dots_cost_at_the_tensor_cores_16bit_rate():
    """The same gemm in bfloat16 costs half the float32 one's work at the peak (989 against 494.7
    TFLOPS dense on an H100) plus the call's fitted overhead (`DeviceSpec.library_fit`), and its
    bytes at 2 per element."""
    mesh = targets.mesh("h100-sxm", 1)
    times = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jax.ShapeDtypeStruct((8192, 8192), dtype, sharding=NamedSharding(mesh, P()))
        text = jax.jit(jnp.dot).lower(x, x).compile().as_text()
        costed = cost.compiled_cost(text, backends.GPU, H100_ROOFLINE, H100_COLLECTIVES)
        [gemm] = [k for k in costed.kernels if k.kind == "gemm"]
        times[dtype] = gemm.time_us - gpus.H100_SXM.launch_us.value
    flops = 2.0 * 8192**3
    overhead, eff = gpus.H100_SXM.library_fit["gemm"]
    assert times[jnp.float32] == pytest.approx(overhead + 1e6 * flops / (eff * gpus.H100_SXM.dot_flops.value))
    assert times[jnp.bfloat16] == pytest.approx(overhead + 1e6 * flops / (eff * gpus.H100_SXM.dot16_flops.value))
    assert times[jnp.bfloat16] - overhead == pytest.approx((times[jnp.float32] - overhead) / 2, rel=1e-3)


def test_xla_cpu_program_costed_by_its_profiled_kernel_times():
    """On XLA:CPU the profile's names are the executable's instructions: every compute kernel of
    the profiled program is costed by its measured time, collectives block (CPU collectives are
    synchronous), and the table answers by kernel signature, so a name alone matches nothing."""
    spec = zoo.get_model("mlp", "tiny")
    step, state, batch = zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(), "jit")
    compiled = step.lower(state, batch).compile()
    text = compiled.as_text()
    compute, collectives = module_kernels(text)
    times = _device_timing.measure_kernel_times(compiled, (state, batch), steps=2, warmup=1)
    program = cost.compiled_program(text, backends.CPU)
    table = cost.measured_table(program, times)
    fallback = cost.AnalyticalEstimator()
    costed = cost.cost_program(program, cost.chain(table, fallback), cost.AllReduceCostModel(1e-4, 50.0))
    measured = [k for k in costed.kernels if k.method == "measured"]
    assert len(measured) == compute == costed.to_json()["num_kernels"]
    signature = {name: program.graph.kernel_signature(ops) for name, ops in program.ops.items()}
    for k in measured:  # its own traced time, averaged over the kernels of the same computation
        same = [times[n] for n in program.ops if signature[n] == signature[k.name]]
        assert k.time_us == pytest.approx(sum(same) / len(same))
    comm = [k for k in costed.kernels if k.lane == "comm"]
    assert [k.name for k in comm] == [name for name, _ in collectives]
    for k in comm:  # blocking: nothing computes while it runs
        assert not any(c.start_us < k.end_us and c.end_us > k.start_us for c in measured)
    assert costed.iteration_us == pytest.approx(costed.compute_us + costed.comm_us)
    renamed = {f"other.{name}": t for name, t in times.items()}
    assert cost.measured_table(program, renamed).times_us == {}


def test_h100_launch_and_bandwidth_are_fitted_to_its_kernel_samples():
    """The constants the H100 spec reads are the fit of the shipped samples, with their source;
    the dot efficiency is the one measured on the paper configs' library calls (docs/gpu.md)."""
    directory = gpus.SHIPPED_PROFILE_DIR / "nvidia-h100-80gb-hbm3"
    with (directory / "kernel_samples.jsonl").open() as f:
        samples = [json.loads(line) for line in f]
    assert not any(n["op"] in ("dot", "convolution") for s in samples for n in s["kernel"]["nodes"])
    fitted = gpus.fit_device_constants(samples, gpus.H100_SXM.memory_bandwidth.value)
    for name, q in fitted.items():
        spec = getattr(gpus.H100_SXM, name)
        assert spec.value == pytest.approx(q["value"]) and not spec.assumption
        assert spec.source.startswith("fitted to kernel_samples.jsonl")
    assert 0.5 < gpus.H100_SXM.launch_us.value < 3.0 and 0.7 < gpus.H100_SXM.memory_efficiency.value <= 1.0
    dot = gpus.H100_SXM.dot_efficiency
    assert not dot.assumption and dot.source.startswith("measured on an H100") and 0.2 < dot.value < 1.0
