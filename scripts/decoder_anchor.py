"""A Llama2-7B-shaped decoder's layer on one GPU, as the compiled-program model predicts it against
what one H200 ran (issue 47, item 6), and against MaxText's published throughput.

The decoder is `gpu_programs.py decoder --set llama7b`'s: width 4096, 32 heads of 128, 4
sequences of 4096 tokens, bfloat16 compute, Adam, one and two layers (a layer is their
difference), XLA's attention or cuDNN's fused one. Each is compiled deviceless for one GPU of
`--target` and costed by the compiled-program model with that GPU's calibrated estimator and host
lane (`clusters.node_of(target, 1)`); the H200 records of 2026-11-28 hold what one H200 ran.

    python scripts/decoder_anchor.py [--target h200-sxm] [--records data/gpu/2026-11-28/decoder.jsonl.gz]

Prints per variant the step's predicted and measured time, the layer's, and the layer's model
TFLOP/s (6 x tokens x 12 x width^2 for the dense part, plus the attention's products with the
causal half counted: 3 x 2 x 2 x batch x length^2 x width / 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import optax  # noqa: E402

from disco_jax import backends, cost, targets, zoo  # noqa: E402
from disco_jax.eval import clusters, gpu_records  # noqa: E402
from disco_jax.zoo import _gpt  # noqa: E402

BASE = _gpt.GPTConfig(32000, 4096, 32, 1, 4096, 4, "bfloat16")
VARIANTS = {
    "llama7b_1layer": BASE,
    "llama7b_2layers": dataclasses.replace(BASE, num_layers=2),
    "llama7b_1layer_cudnn": dataclasses.replace(BASE, attention="cudnn"),
}


def layer_flops(cfg: _gpt.GPTConfig) -> float:
    tokens = cfg.global_batch * cfg.seq_len
    dense = 6.0 * tokens * 12 * cfg.d_model**2
    attention = 3 * 2 * 2.0 * cfg.global_batch * cfg.seq_len**2 * cfg.d_model / 2
    return dense + attention


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="h200-sxm", choices=sorted(clusters.TARGET_NODES))
    parser.add_argument("--records", default="data/gpu/2026-11-28/decoder.jsonl.gz")
    args = parser.parse_args(argv)
    cluster = clusters.node_of(args.target, 1)
    mesh = targets.mesh(args.target, 1)
    measured = {r["model"]: r["wall_median_us"] for r in gpu_records.load([args.records]) if gpu_records.is_step(r)}
    predicted = {}
    for label, cfg in VARIANTS.items():
        spec = _gpt.spec_of(cfg, label)
        try:
            text = zoo.lower_abstract(spec, optax.adam(1e-4), mesh).compile().as_text()
        except Exception as err:  # noqa: BLE001 - cuDNN's attention may not compile deviceless
            print(f"{label}: not compiled deviceless for {args.target}: {type(err).__name__}: {str(err)[:200]}")
            continue
        costed = cost.cost_program(
            cost.compiled_program(text, backends.GPU),
            cluster.kernel_estimator(),
            cluster.allreduce_model(),
            cluster.simulator_params(),
        )
        predicted[label] = costed.iteration_us
        got = measured.get(label)
        vs = f", measured on one H200 {got / 1e3:.1f} ms ({costed.iteration_us / got - 1:+.1%})" if got else ""
        print(f"{label}: predicted {costed.iteration_us / 1e3:.1f} ms on one {args.target}{vs}")
    flops = layer_flops(BASE)
    if {"llama7b_1layer", "llama7b_2layers"} <= predicted.keys():
        layer = predicted["llama7b_2layers"] - predicted["llama7b_1layer"]
        line = f"a layer (XLA attention): predicted {layer / 1e3:.1f} ms, {flops / layer / 1e6:.0f} TFLOP/s"
        if {"llama7b_1layer", "llama7b_2layers"} <= measured.keys():
            got = measured["llama7b_2layers"] - measured["llama7b_1layer"]
            line += f"; measured {got / 1e3:.1f} ms, {flops / got / 1e6:.0f} TFLOP/s"
        print(line)
        if "llama7b_1layer_cudnn" in predicted:
            rest = predicted["llama7b_1layer"] - layer
            cudnn = predicted["llama7b_1layer_cudnn"] - rest
            line = f"a layer (cuDNN attention): predicted {cudnn / 1e3:.1f} ms, {flops / cudnn / 1e6:.0f} TFLOP/s"
            if {"llama7b_1layer", "llama7b_2layers", "llama7b_1layer_cudnn"} <= measured.keys():
                got_rest = measured["llama7b_1layer"] - (measured["llama7b_2layers"] - measured["llama7b_1layer"])
                got = measured["llama7b_1layer_cudnn"] - got_rest
                line += f"; measured {got / 1e3:.1f} ms, {flops / got / 1e6:.0f} TFLOP/s"
            print(line)
    print(f"(a layer's model work: {flops / 1e12:.1f} TFLOP; MaxText publishes 492 TFLOP/s per H100 for Llama2-7B)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
