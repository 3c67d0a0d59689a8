"""DisCo's Fused Op Estimator (section 4.3): a graph attention network that predicts the time of a
fused kernel the search invented and never profiled, from the kernel's ops and their data flow.

Data flow:

  collect   scripts/collect_kernel_samples.py: training steps -> graph IR -> random kernels
            (`_kernels.random_kernel`) -> each compiled alone and timed (`_measure`) -> JSON lines
            {kernel description, measured us, device kind}
  train     scripts/train_estimator.py: descriptions -> features (`_features`) -> `FusedOpEstimator`
            (`_model`, Flax) fitted with optax Adam on squared log error (`_train`) ->
            disco_jax/profiles/<device kind>/gnn_estimator.{msgpack,json} (`_weights`)
  serve     `load_estimator(device_kind)` -> `GnnEstimator`, an `Estimator` of the core:
            `estimate(graph, kernels)` batches every kernel of a call into padded, jitted forward
            passes and caches predictions by kernel signature.

Features (`FEATURE_VERSION` 1; weights of another version are refused):

* one node per op of the kernel, edges along data dependencies inside the kernel (both
  directions) plus a self loop; per node (`NODE_FEATURES`):
  - opcode one-hot over `OPCODE_VOCABULARY` (the loop-fusible opcodes) plus an "other" slot;
  - log1p of output elements and bytes, and of the elements and bytes of all its operands;
  - log1p of the bytes it reads from outside the kernel (cloned small constants excluded);
  - exported flag and log1p of the bytes it writes out when exported;
  - log1p of its flops estimate (`cost.work.flops_per_op`), transcendental flag;
  - output rank, dtype group one-hot (f32, 16-bit/8-bit float, integer, pred, 64-bit);
  - whether it moves the minor-most (contiguous) dimension (transpose, reduce, broadcast), and
    log1p of a reduce's input/output element ratio;
  - number of operands, log1p of its number of users inside the kernel;
  - log of its own profiled time in us and a known flag (0 and 0 where unknown);
  - log1p of the elements the fused loop evaluates for it (values read through a broadcast or a
    reduce are recomputed per reading element) and of that over its output elements;
  - log1p of the size of its output's minor-most (contiguous) dimension and of its first
    operand's.
* per kernel (`KERNEL_FEATURES`): log1p of bytes read (each input once) and written, of the
  number of ops, of total flops, of the largest output; number of exports; log of the sum of
  the known own times and the fraction of ops with a known time; log1p of the number of inputs;
  log1p of the total evaluated elements and of the evaluated work (transcendentals weigh 8).

Public surface: `GnnEstimator`, `load_estimator` (the ``gnn`` plugin of the core's estimator
registry: entry-point group ``disco_jax.estimators``), `estimator_for_device`, `kernel_features`,
plus the pieces the scripts use: kernels (`default_exports`, `random_kernel`, `is_convex`,
`measurable`), measurement (`compile_kernel`, `time_kernels`), features (`describe_kernel`,
`featurize`), training and evaluation (`train`, `split_samples`, `evaluate`, `fit_analytical`, ...)
and weight files (`read_weights`, `write_weights`, `ModelConfig`).
"""

from gnn_estimator._estimator import (
    GnnEstimator,
    GnnWeightsWarning,
    estimator_for_device,
    load_estimator,
    weights_dir,
)
from gnn_estimator._features import (
    FEATURE_VERSION,
    KERNEL_FEATURES,
    NODE_FEATURES,
    OPCODE_VOCABULARY,
    KernelFeatures,
    KernelFeaturizer,
    describe_kernel,
    featurize,
    kernel_features,
    without_times,
)
from gnn_estimator._kernels import default_exports, is_convex, measurable, random_kernel
from gnn_estimator._measure import CompiledKernel, KernelTiming, compile_kernel, time_kernels
from gnn_estimator._model import FusedOpEstimator, ModelConfig
from gnn_estimator._train import (
    Normalization,
    TrainedEstimator,
    analytical_features,
    analytical_predict_us,
    error_summary,
    evaluate,
    fit_analytical,
    load_samples,
    relative_errors,
    sample_features,
    sample_work,
    split_samples,
    train,
)
from gnn_estimator._weights import METADATA_FILE, WEIGHTS_FILE, WeightsError, read_weights, write_weights

__all__ = [
    "FEATURE_VERSION",
    "KERNEL_FEATURES",
    "METADATA_FILE",
    "NODE_FEATURES",
    "OPCODE_VOCABULARY",
    "WEIGHTS_FILE",
    "CompiledKernel",
    "FusedOpEstimator",
    "GnnEstimator",
    "GnnWeightsWarning",
    "KernelFeaturizer",
    "KernelFeatures",
    "KernelTiming",
    "ModelConfig",
    "Normalization",
    "TrainedEstimator",
    "WeightsError",
    "analytical_features",
    "analytical_predict_us",
    "compile_kernel",
    "default_exports",
    "describe_kernel",
    "error_summary",
    "estimator_for_device",
    "evaluate",
    "featurize",
    "fit_analytical",
    "is_convex",
    "kernel_features",
    "load_estimator",
    "load_samples",
    "measurable",
    "random_kernel",
    "read_weights",
    "relative_errors",
    "sample_features",
    "sample_work",
    "split_samples",
    "time_kernels",
    "train",
    "weights_dir",
    "without_times",
    "write_weights",
]
