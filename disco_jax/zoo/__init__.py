"""The model zoo: the DNNs of the DisCo and Unity evaluations, each at a `tiny` size (compiles and
trains in seconds on CPU, for tests) and at its `paper` size (lowered from shapes only), with
data-parallel training steps in two styles (``"jit"`` and ``"shard_map"``).

    from disco_jax import zoo
    spec = zoo.get_model("resnet50", "tiny")
    step, state, batch = zoo.make_train_step(spec, optax.sgd(0.1), zoo.data_mesh(), "jit")
    state, loss = step(state, batch)

    lowered = zoo.lower_abstract(zoo.get_model("bert", "paper"), optax.adam(1e-4), zoo.data_mesh())

    spec = zoo.resized("transformer", num_encoder_layers=1, num_decoder_layers=1)  # tiny, 1+1 layers
    spec = zoo.get_model("transformer:scan_layers=True", "paper")  # a variant, by name
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from collections.abc import Callable
from types import ModuleType

from . import _bert, _dlrm, _gpt, _mlp, _reformer, _resnet, _rnnlm, _transformer, _vgg
from ._common import (
    STYLES,
    ModelSpec,
    Style,
    TrainState,
    abstract_state_and_batch,
    build_train_step,
    data_mesh,
    lower_abstract,
    make_train_step,
)

CONFIGS: tuple[str, ...] = ("tiny", "paper")


# name -> its module: `CONFIGS` (size -> config dataclass) and `spec_of(config dataclass, size name)`
_MODULES: dict[str, ModuleType] = {
    "vgg19": _vgg,
    "resnet50": _resnet,
    "transformer": _transformer,
    "rnnlm": _rnnlm,
    "bert": _bert,
    "reformer": _reformer,
    "mlp": _mlp,
    "dlrm": _dlrm,
    "gpt": _gpt,
}
# name -> builder(config) -> ModelSpec
MODELS: dict[str, Callable[[str], ModelSpec]] = {name: module.make_spec for name, module in _MODULES.items()}


def get_model(name: str, config: str = "tiny") -> ModelSpec:
    """The spec of model ``name`` (a key of `MODELS`) at size ``config`` (``'tiny'`` or ``'paper'``).
    A variant is named ``model:field=value,...``, its config's fields changed as `resized` changes
    them (values read as Python literals): ``transformer:scan_layers=True``, which the benchmark
    and its report carry as a model of its own.

    Cached: the same arguments give the same spec object, so JAX's caches see the same functions.
    """
    if ":" in name:
        return _variant_spec(name, config)
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    if config not in CONFIGS:
        raise KeyError(f"unknown config {config!r}; known: {CONFIGS}")
    return _build_spec(name, config)


@functools.cache
def _build_spec(name: str, config: str) -> ModelSpec:
    return MODELS[name](config)


@functools.cache
def _variant_spec(name: str, config: str) -> ModelSpec:
    base, _, changes = name.partition(":")
    fields = dict(item.split("=", 1) for item in changes.split(","))
    return resized(base, config, **{k: ast.literal_eval(v) for k, v in fields.items()})


def base_model(name: str) -> str:
    """The zoo model a name (`get_model`'s, a variant's too) is made from."""
    return name.partition(":")[0]


def resized(name: str, config: str = "tiny", **changes) -> ModelSpec:
    """Model ``name`` at size ``config`` with fields of its config dataclass changed, e.g.
    ``resized("transformer", num_encoder_layers=1, num_decoder_layers=1)``; the spec's `config`
    names the changes (``'tiny:num_encoder_layers=1,num_decoder_layers=1'``). Not cached."""
    get_model(name, config)  # the same errors for an unknown name or size
    module = _MODULES[name]
    cfg = dataclasses.replace(module.CONFIGS[config], **changes)
    return module.spec_of(cfg, f"{config}:" + ",".join(f"{k}={v}" for k, v in changes.items()))


__all__ = [
    "CONFIGS",
    "MODELS",
    "STYLES",
    "ModelSpec",
    "Style",
    "TrainState",
    "abstract_state_and_batch",
    "base_model",
    "build_train_step",
    "data_mesh",
    "get_model",
    "lower_abstract",
    "make_train_step",
    "resized",
]
