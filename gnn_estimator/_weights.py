"""Trained estimator files: `disco_jax/profiles/<device kind>/gnn_estimator.msgpack` (the parameters, by
`flax.serialization`) and `gnn_estimator.json` (metadata: feature version and lists, opcode
vocabulary, model config, normalization, training summary, accuracy, and the weights' sha256).

`read_weights` refuses (raises `WeightsError`) a file pair written for another feature version or
feature list, whose parameters do not have the shapes the config implies, or that is corrupt.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import jax
import numpy as np
from flax import serialization

from disco_jax._files import write_bytes_atomic, write_json_atomic
from gnn_estimator._features import FEATURE_VERSION, KERNEL_FEATURES, NODE_FEATURES, OPCODE_VOCABULARY
from gnn_estimator._model import ModelConfig, init_ensemble
from gnn_estimator._train import Normalization, TrainedEstimator

WEIGHTS_FILE = "gnn_estimator.msgpack"
METADATA_FILE = "gnn_estimator.json"
FORMAT = "disco-jax gnn fused-op estimator"


class WeightsError(ValueError):
    """A weights file pair that cannot be used with this version of the features or model."""


def write_weights(directory: str | os.PathLike, trained: TrainedEstimator) -> Path:
    """Write the parameters and metadata of `trained` into `directory` (atomically per file).
    Returns the metadata file's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = jax.tree.map(np.asarray, serialization.to_state_dict(trained.params))
    blob = serialization.msgpack_serialize(state)
    metadata = {
        **trained.metadata,
        "format": FORMAT,
        "feature_version": FEATURE_VERSION,
        "node_features": list(NODE_FEATURES),
        "kernel_features": list(KERNEL_FEATURES),
        "opcode_vocabulary": list(OPCODE_VOCABULARY),
        "model_config": trained.config.to_json(),
        "normalization": trained.normalization.to_json(),
        "weights_sha256": hashlib.sha256(blob).hexdigest(),
    }
    write_bytes_atomic(directory / WEIGHTS_FILE, blob)
    write_json_atomic(directory / METADATA_FILE, metadata)
    return directory / METADATA_FILE


@functools.cache
def _parameter_shapes(config: ModelConfig):
    """The parameter tree of `config`, shapes only (no initialization work; traced once per config)."""
    return jax.eval_shape(lambda: init_ensemble(config))


def read_weights(directory: str | os.PathLike) -> TrainedEstimator:
    """The estimator stored in `directory`; `FileNotFoundError` when a file is missing,
    `WeightsError` when the pair is for another feature version or is corrupt."""
    directory = Path(directory)
    meta_text = (directory / METADATA_FILE).read_text()
    blob = (directory / WEIGHTS_FILE).read_bytes()
    try:
        metadata = json.loads(meta_text)
    except json.JSONDecodeError as err:
        raise WeightsError(f"{directory / METADATA_FILE} is not valid JSON: {err}") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise WeightsError(f"{directory / METADATA_FILE} is not a {FORMAT} metadata file")
    version = metadata.get("feature_version")
    if version != FEATURE_VERSION:
        raise WeightsError(
            f"weights in {directory} were trained on feature version {version!r}; this "
            f"gnn_estimator computes version {FEATURE_VERSION} "
            "(retrain with scripts/train_estimator.py)"
        )
    for key, expected in (
        ("node_features", NODE_FEATURES),
        ("kernel_features", KERNEL_FEATURES),
        ("opcode_vocabulary", OPCODE_VOCABULARY),
    ):
        if metadata.get(key) != list(expected):
            raise WeightsError(
                f"weights in {directory} use another {key.replace('_', ' ')} list "
                f"(same feature version {version}); retrain them"
            )
    if metadata.get("weights_sha256") != hashlib.sha256(blob).hexdigest():
        raise WeightsError(f"{directory / WEIGHTS_FILE} does not match the checksum in its metadata")
    try:
        config = ModelConfig.from_json(metadata["model_config"])
        normalization = Normalization.from_json(metadata["normalization"])
        state = serialization.msgpack_restore(blob)
        template = _parameter_shapes(config)
        params = serialization.from_state_dict(template, state)
    except (KeyError, TypeError, ValueError) as err:
        raise WeightsError(f"weights in {directory} are unreadable: {err}") from None
    expected = jax.tree.map(lambda x: tuple(x.shape), template)
    found = jax.tree.map(lambda x: tuple(np.shape(x)), params)
    if expected != found:
        raise WeightsError(f"weights in {directory} do not have the shapes of their model config")
    params = [jax.tree.map(lambda x: np.asarray(x, np.float32), member) for member in params]
    return TrainedEstimator(config, params, normalization, metadata)
