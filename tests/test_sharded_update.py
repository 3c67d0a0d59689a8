"""The sharded weight update (`weight_update="sharded"`): a Flax model trained with Adam on 8 CPU
devices keeps its optimizer state sharded 8 ways over the data axis, trains to the same losses as
the unmodified step, holds 1/8 of the state per device, and reaches its executable directly from
the second call on; `shard_map` steps fall back to the replicated update with a warning."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from disco_jax import _api, _capture, _compile, _plan, _program, _strategy, backends, optimize_distributed, zoo
from disco_jax.sharding import rules, update

from _steps import make_step

FAST = dict(budget_s=1.0, validation_pairs=4, measured_candidates=0, verbose=False)


class MLP(nn.Module):
    width: int = 64

    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(self.width)(x))
        x = nn.tanh(nn.Dense(self.width)(x))
        return nn.Dense(4)(x)


def flax_adam_step(model=None, features: int = 16, mesh=None, steps: int = 4):
    """(jitted step, params, opt_state, batches) for a Flax MLP (`model`, default `MLP`, taking
    `features` inputs) with optax.adam, data parallel over 8 devices (`mesh`, default
    `jax.make_mesh`'s, Explicit axes) with `jax.jit` and a `NamedSharding`-sharded batch."""
    mesh = jax.make_mesh((8,), ("data",)) if mesh is None else mesh
    model, opt = MLP() if model is None else model, optax.adam(1e-2)
    params = model.init(jax.random.PRNGKey(0), jnp.ones((1, features)))
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params, opt_state = jax.device_put((params, opt.init(params)), replicated)
    keys = jax.random.split(jax.random.PRNGKey(1), 2 * steps)
    batches = [
        jax.device_put(
            (jax.random.normal(keys[2 * i], (64, features)), jax.random.normal(keys[2 * i + 1], (64, 4))), batch
        )
        for i in range(steps)
    ]

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, params, opt_state, batches


def train(step, params, opt_state, batches):
    losses = []
    for x, y in batches:
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))
    return params, opt_state, losses


def test_flax_adam_state_is_sharded_8_ways_and_trains_to_the_same_losses(monkeypatch):
    step, params, opt_state, batches = flax_adam_step()
    _, _, reference = train(step, params, opt_state, batches)
    sharded = optimize_distributed(search=False, weight_update="sharded", **FAST)(step)
    with pytest.warns(_plan.PlanWarning, match="no plan"):
        new_params, new_state, losses = train(sharded, params, opt_state, batches)
    np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-7)

    adam = new_state[0]
    for leaf in jax.tree.leaves((adam.mu, adam.nu)):
        if leaf.shape[0] % 8 == 0:
            assert leaf.sharding.spec == P("data") and len(leaf.sharding.device_set) == 8
            assert leaf.addressable_shards[0].data.shape[0] == leaf.shape[0] // 8
        else:  # Dense_2's bias: 4 elements, no dimension 8 divides
            assert leaf.sharding.is_fully_replicated
    assert all(p.sharding.is_fully_replicated for p in jax.tree.leaves(new_params))
    assert adam.count.sharding.is_fully_replicated

    # One program was prepared; the calls after the first ran the sharded executable directly,
    # and replicated state given again is resharded without preparing anything.
    assert len(sharded.reports) == 1
    monkeypatch.setattr(_api, "prepare", lambda *a, **k: pytest.fail("prepared again"))
    steady = sharded.executable(new_params, new_state, *batches[0])
    assert steady is sharded._last.run and not isinstance(steady, update.Resharding)
    _, again, _ = sharded(params, opt_state, *batches[0])
    assert jax.tree.leaves(again[0].mu)[1].sharding.spec == P("data")
    assert isinstance(sharded.executable(params, opt_state, *batches[0]), update.Resharding)

    report = sharded.last_report.weight_update
    assert report["mode"] == "sharded" and report["axis"] == "data" and report["num_shards"] == 8
    assert len(report["leaves"]) == 10 and all("mu" in k or "nu" in k for k in report["leaves"])
    # The plan cites the z3-proven rules the sharded update rests on.
    assert set(report["rules"]) == set(update.JUSTIFYING_RULES)
    assert "reduce_scatter" in report["rules"]["sharded_weight_update"]


def test_an_unproven_rule_keeps_the_replicated_update(monkeypatch):
    def unproven(name, timeout_s=5.0):
        raise rules.RuleNotProven(f"rule {name}: proof unknown")

    monkeypatch.setattr(rules, "require", unproven)
    step, params, opt_state, batches = flax_adam_step()
    run = optimize_distributed(search=False, weight_update="sharded", verbose=False)(step)
    with pytest.warns(UserWarning, match="not proven"):
        run(params, opt_state, *batches[0])
    assert run.last_report.weight_update["mode"] == "replicated"


def test_compiled_module_all_gathers_the_parameters_and_holds_an_eighth_of_the_state():
    step, params, opt_state, batches = flax_adam_step()
    sharded = optimize_distributed(search=False, weight_update="sharded", **FAST)(step)
    with pytest.warns(_plan.PlanWarning, match="no plan"):
        text = sharded.executable(params, opt_state, *batches[0]).as_text()
    counts = update.collectives(text)
    # XLA:CPU partitions into an all-reduce that each device slices and one all-gather per split
    # parameter; the hook's rules make the five split gradients one reduce-scatter and the five
    # new parameters one all-gather (`sharding.apply`; tests/test_rule_rewrite.py).
    assert counts["reduce-scatter"] == 1 and counts["all-gather"] == 1
    assert counts["all-reduce"] == 1  # the loss and Dense_2's 4-wide bias, read whole
    report = sharded.last_report.weight_update
    assert report["collectives"]["replicated"]["all-gather"] == 0
    assert report["collectives"]["sharded"]["reduce-scatter"] == 1
    assert {a["rule"] for a in sharded.last_report.rules_applied} >= {"own_block_of_all_reduce", "grouped_all_gather"}

    state_bytes = sum(x.nbytes for x in jax.tree.leaves(opt_state))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    memory = report["memory"]
    assert memory["replicated"]["params_and_state_bytes_per_device"] == state_bytes + param_bytes
    unsplit = 2 * 4 * 4 + 4  # Dense_2's bias in mu and nu (float32[4]), the int32 count
    expected = param_bytes + (state_bytes - unsplit) // 8 + unsplit
    assert memory["sharded"]["params_and_state_bytes_per_device"] == expected
    saved = memory["replicated"]["argument_size_in_bytes"] - memory["sharded"]["argument_size_in_bytes"]
    assert saved == (state_bytes - unsplit) * 7 // 8  # XLA's own memory analysis agrees


def test_search_phase_on_the_sharded_program_stores_the_layout_and_enactment_reuses_it(tmp_path):
    step, params, opt_state, batches = flax_adam_step()
    reference = step(params, opt_state, *batches[0])
    searching = optimize_distributed(search=True, weight_update="sharded", plan_dir=tmp_path, **FAST)(step)
    out = searching(params, opt_state, *batches[0])
    report = searching.last_report
    check = report.weight_update["check"]
    # Judged against the float64 run of the step (Adam: no ulp tolerance tells right from wrong).
    assert check["within_tolerance"] and check["check"] == "float64-reference", check
    assert len(check["plan_deviation"]) == len(jax.tree.leaves(reference))
    plan = _plan.read_plan_file(report.plan_path)
    assert plan.weight_update["leaves"] == report.weight_update["leaves"]
    memory = {k: v["params_and_state_bytes_per_device"] for k, v in plan.weight_update["memory"].items()}
    assert memory["sharded"] < memory["replicated"]
    np.testing.assert_allclose(float(out[2]), float(reference[2]), rtol=1e-6)

    # The plan names the rules applied at the hook to the program it runs, and where.
    scattered = [a for a in plan.rules_applied if a["rule"] == "own_block_of_all_reduce"]
    assert scattered and all(a["result"].startswith("disco_reduce-scatter") for a in scattered)

    enacting = optimize_distributed(search=False, weight_update="sharded", plan_dir=tmp_path, **FAST)(step)
    enacting(params, opt_state, *batches[0])
    assert enacting.last_report.plan == plan.to_json() and enacting.last_report.fingerprint == plan.fingerprint
    assert [a["rule"] for a in enacting.last_report.rules_applied] == [a["rule"] for a in plan.rules_applied]


def test_plans_without_a_weight_update_record_still_load(tmp_path):
    machine = _plan.MachineKey("cpu", "cpu", 8)
    old = _plan.Plan("abc", "jit_step", machine, True, None, "made before the sharded update").to_json()
    del old["weight_update"]
    path = tmp_path / "old.json"
    path.write_text(__import__("json").dumps(old))
    assert _plan.read_plan_file(path).weight_update == {}


def test_shard_map_steps_warn_and_keep_the_replicated_update():
    step, args = make_step("shard_map", optimizer=optax.adam(1e-2))
    reference = step(*args)
    wrapped = optimize_distributed(search=False, weight_update="sharded", **FAST)(step)
    with (
        pytest.warns(UserWarning, match="sharded weight update not applicable .*shard_map"),
        pytest.warns(_plan.PlanWarning, match="no plan"),
    ):
        out = wrapped(*args)
    assert wrapped.last_report.weight_update["mode"] == "replicated"
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(out[1]))
    np.testing.assert_array_equal(np.asarray(out[2]), np.asarray(reference[2]))


def test_a_jit_with_its_own_shardings_keeps_them_but_for_the_state():
    """The zoo's steps fix in_shardings/out_shardings (state replicated, batch sharded): the
    sharded update replaces them for the optimizer state only."""
    step, state, batch = zoo.make_train_step(zoo.get_model("mlp", "tiny"), optax.adam(1e-3), zoo.data_mesh(), "jit")
    _, reference = step(state, batch)
    sharded = optimize_distributed(search=False, weight_update="sharded", **FAST)(step)
    with pytest.warns(_plan.PlanWarning, match="no plan"):
        new_state, loss = sharded(state, batch)
    np.testing.assert_allclose(float(loss), float(reference), rtol=1e-6)
    mu = jax.tree.leaves(new_state.opt_state[0].mu)
    assert all(x.sharding.spec[0] == "data" for x in mu)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(new_state.params))


def test_jit_step_of_the_core_tests_shards_its_adam_moments():
    step, args = make_step("jit", optimizer=optax.adam(1e-2))
    layout, reason = update.find_layout(step, args, {}, args, {}, [x.sharding for x in jax.tree.leaves(args)])
    assert layout is not None, reason
    paths = sorted(layout.paths.values())
    # sizes (16, 32, 32, 4): weights (16,32), (32,32), (32,4) and the two 32-wide biases, in mu and nu
    assert len(paths) == 10 and all(".mu" in p or ".nu" in p for p in paths)


def test_sgd_without_state_has_nothing_to_shard():
    step, args = make_step("jit")  # plain SGD: no optimizer state, parameters feed the dots
    layout, reason = update.find_layout(step, args, {}, args, {}, [x.sharding for x in jax.tree.leaves(args)])
    assert layout is None and "no replicated optimizer state" in reason


@pytest.mark.parametrize("value", ["shard", "ZeRO", None, 1])
def test_bad_weight_update_values_raise(value):
    with pytest.raises(ValueError, match="weight_update must be one of 'search', 'sharded', 'replicated'"):
        optimize_distributed(weight_update=value)


def test_a_fusion_and_bucketing_plan_is_enacted_on_the_sharded_module(tmp_path):
    """The HLO pass rewrites the re-lowered module: a plan with one all-reduce per gradient, made
    for the sharded program, is applied (the hook's rules then reduce-scatter each split
    gradient alone) and the parameters are still all-gathered."""
    step, params, opt_state, batches = flax_adam_step()
    args = (params, opt_state, *batches[0])
    default = step.lower(*args).compile()
    layout, _ = update.find_layout(step, args, {}, args, {}, jax.tree.leaves(default.input_shardings))
    lowered, (sharded_args, _) = update.relower(step, layout, args, {}, (args, {}), default)
    program = _program.build_program(_capture.capture(lowered)[0], backends.CPU)
    graph = program.graph
    per_gradient = _strategy.with_buckets(_strategy.xla_default(graph), [(g.id,) for g in graph.gradients], "test")
    machine = _plan.MachineKey.current(_compile.step_devices(sharded_args, {}))
    plan = _plan.Plan(graph.fingerprint, graph.module.name, machine, False, per_gradient.to_json(graph), "by hand")
    _plan.save_plan(plan, tmp_path)

    enacting = optimize_distributed(search=False, weight_update="sharded", plan_dir=tmp_path, **FAST)(step)
    reference = step(*args)
    out = enacting(*args)
    report = enacting.last_report
    assert report.applied and report.fingerprint == graph.fingerprint
    # One bucket per gradient: the five split ones are five reduce-scatters, the others all-reduces.
    assert report.default_counts["all-reduce"] == 1 and report.default_counts["reduce-scatter"] == 1
    assert report.plan_counts["all-reduce"] + report.plan_counts["reduce-scatter"] == len(graph.gradients) > 1
    # Each new parameter waits for its own gradient's reduce-scatter: its all-gather stays alone.
    assert update.collectives(enacting.executable(*out[:2], *batches[0]).as_text())["all-gather"] == 5
    np.testing.assert_allclose(float(out[2]), float(reference[2]), rtol=1e-6)
    scattered = [a for a in report.rules_applied if a["rule"] == "own_block_of_all_reduce"]
    assert len(scattered) == report.plan_counts["reduce-scatter"] == 5
    assert report.rules_applied == _compile.rules_applied(program, per_gradient)


def test_static_and_donated_arguments_survive_the_relowering():
    step, args = make_step("jit", optimizer=optax.adam(1e-2))
    inner = step.__wrapped__

    def scaled(params, opt_state, x, y, shift, scale):
        params, opt_state, loss = inner(params, opt_state, x, y)
        return params, opt_state, loss * scale + shift

    # `shift` is a dynamic Python float, `scale` static, the optimizer state donated.
    jitted = jax.jit(scaled, static_argnames=("scale",), donate_argnums=(1,))
    copy = lambda tree: jax.tree.map(lambda a: a.copy(), tree)  # noqa: E731
    _, _, reference = jitted(args[0], copy(args[1]), *args[2:], 1.0, scale=2.0)
    sharded = optimize_distributed(search=False, weight_update="sharded", **FAST)(jitted)
    with pytest.warns(_plan.PlanWarning, match="no plan"):
        params, state, loss = sharded(args[0], copy(args[1]), *args[2:], 1.0, scale=2.0)
    np.testing.assert_allclose(float(loss), float(reference), rtol=1e-6)
    mu = jax.tree.leaves(state[0].mu)
    assert mu[1].sharding.spec == P("data")
    _, _, loss = sharded(params, state, *args[2:], 1.0, scale=2.0)
    assert all(x.is_deleted() for x in mu)  # the sharded state was donated to the second call
    assert len(sharded.reports) == 1


def test_only_state_updated_elementwise_and_read_by_nothing_else_is_chosen():
    def step(w, m, v, count, x):
        g = x.T @ jnp.tanh(x @ w)
        m = 0.9 * m + 0.1 * g
        v = 0.9 * v + 0.1 * g * g
        return w - m / (jnp.sqrt(v) + 1e-8), m, v, count + 1, jnp.sum(v)  # v is also reduced

    shapes = [(16, 16), (16, 16), (16, 16), (), (32, 16)]
    closed = jax.make_jaxpr(step)(*[jnp.zeros(s) for s in shapes])
    inputs, outputs = [v.aval for v in closed.jaxpr.invars], [v.aval for v in closed.jaxpr.outvars]
    state, updated = update.choose_layout(closed.jaxpr, inputs, outputs, [True, True, True, True, False], 8)
    assert (state, updated) == ([1], [1])  # m only: w feeds a dot, v a reduction, count is a scalar
    assert update.choose_layout(closed.jaxpr, inputs, outputs, [True, True, True, True, False], 3) == ([], [])
