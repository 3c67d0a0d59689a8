"""The zoo models at the sizes the tests compile: the tiny size with fewer layers (time steps,
stages, convolutions, embedding tables) where that keeps what the tests check, each about half the
compile of its tiny size.

`SMALL` holds for both backends. Deviceless XLA:GPU (`conftest.xla_gpu_zoo`: a compile of the tiny
Transformer or RNNLM costs ~35 CPU seconds, these ~20 and ~8), checked on both sizes: the same
kinds of kernels (Triton gemms, cuDNN convolutions, loop and input fusions, gathers fused, ops
recomputed in later fusions, the same collectives); XLA's combining still several buckets
(Transformer: 4 for 46 gradients, tiny 5 for 88; ResNet-50 many); the RNNLM's sums over time steps
still reassociated by XLA (7 all-reduces for its 16 gradients with the pass on, tiny 10 for 52);
reading XLA's decisions runs the same lines of `gpu_schedule` and `gpu_buckets` (a cycle among
the groups as read included). BERT, GPT, DLRM and VGG-19 stay tiny there (a smaller size saves
1-3 CPU seconds each, or, for VGG-19, loses its unfused op kernel).

`CPU_SMALL` adds those four for XLA:CPU's end-to-end tests (test_bench's decorated steps: 210 ->
160 CPU seconds for the nine), which check every kind of layer a model has (batch norm's running
averages, the Reformer's reversible backward, the embedding tables' gathers) under both
data-parallel styles, at any depth.
"""

from disco_jax import zoo

SMALL = {
    "transformer": {"num_encoder_layers": 1, "num_decoder_layers": 1},
    "rnnlm": {"num_layers": 1, "seq_len": 4},
    "reformer": {"num_layers": 1},
    "resnet50": {"stage_sizes": (1, 1, 1), "stage_widths": (4, 8, 16)},
}
CPU_SMALL = {
    **SMALL,
    "bert": {"num_layers": 1},
    "gpt": {"num_layers": 1},
    "vgg19": {"convs_per_stage": (1, 1, 2, 2, 2)},
    "dlrm": {"table_sizes": (32, 32, 32, 32, 32, 24, 32, 3)},
}


def small(name: str, sizes: dict = SMALL) -> zoo.ModelSpec:
    """Zoo model `name` at its size in `sizes` (the tiny one for a model not listed)."""
    return zoo.resized(name, **sizes[name]) if name in sizes else zoo.get_model(name, "tiny")
