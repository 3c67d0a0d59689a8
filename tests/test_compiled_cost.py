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
from _hlo_text import COLLECTIVES, module_kernels
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


SCHEDULE = """HloModule schedule, is_scheduled=true

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


def test_control_flow_and_unscheduled_modules_are_refused():
    with pytest.raises(ValueError, match="is_scheduled"):
        backends.GPU.read_kernels(SCHEDULE.replace(", is_scheduled=true", ""))
    called = SCHEDULE.replace("kind=kLoop, calls=%fused_neg", "to_apply=%fused_neg").replace(
        "fusion(%a), to", "call(%a), to"
    )
    with pytest.raises(ValueError, match="control flow"):
        backends.GPU.read_kernels(called)


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
