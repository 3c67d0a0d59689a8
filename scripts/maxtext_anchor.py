"""A published anchor for the compiled-program model at scale: MaxText's Llama2-7B on one A3 node
(8 H100 80 GB), as its A3 configuration runs it, against the model's prediction for the nearest
step the zoo builds, compiled deviceless for 8xH100-NVLink and costed by `cost.cost_program`
(collectives per replica group).

The published figure (MaxText, `MaxText/configs/a3/llama_2_7b/README.md`): 492 TFLOP/s per chip on
1x A3 (h100-80gb-8); the run (`MaxText/configs/a3/llama_2_7b/1vm.sh`): `ici_fsdp_parallelism=8
per_device_batch_size=4 max_target_length=4096 model_name=llama2-7b attention=cudnn_flash_te
remat_policy=minimal_flash scan_layers=false`, bf16 compute, AdamW.

TFLOP/s per chip is MaxText's count of a step's FLOPs (`maxtext_flops_per_device`, its
`calculate_tflops_training_per_device` of that time: attention counted non-causal) divided by the
step time, so the published step time is that count / 492e12 and the prediction's TFLOP/s is the
same count / the predicted step time.

The step compiled here (what differs from Llama2-7B, see docs/operator-parallelism.md): the zoo
GPT at 32 layers, width 4096, 32 heads, vocabulary 32000, sequence 4096, global batch 32 (4 per
GPU): GELU MLP of 4 x 4096 (two matrices, 134 M parameters per layer) for SwiGLU 11008 (three,
135 M), a tied embedding, learned positions, LayerNorm; XLA's attention (no cuDNN flash kernel:
deviceless compiles cannot call cuDNN); remat "dots" (`dots_with_no_batch_dims_saveable`,
MaxText's `minimal` without saving the flash kernel's output); the layers scanned (MaxText
unrolls: the compile would take far longer here); FSDP 8 as a user writes it following the Flax
guide (`eval.handwritten.guide_fsdp_lowered`: shardings on parameters and state and the guide's
activation constraints, the batch on "data"; MaxText's logical axes constrain its activations the
same way), or with `--unconstrained` the shardings on parameters and state only
(`eval.handwritten.fsdp_step`, the configuration of the first prediction).

    python scripts/maxtext_anchor.py [--remat dots] [--unconstrained] [--json report/large_model/maxtext_anchor.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

import optax  # noqa: E402

from disco_jax import backends, cost, targets, zoo  # noqa: E402
from disco_jax.eval import clusters, handwritten  # noqa: E402
from disco_jax.sharding import choice, update  # noqa: E402

PUBLISHED_TFLOPS_PER_CHIP = 492.0  # MaxText configs/a3/llama_2_7b/README.md, 1x A3 (h100-80gb-8)
LLAMA2_7B = {"layers": 32, "emb": 4096, "mlp": 11008, "heads": 32, "kv_heads": 32, "head_dim": 128, "vocab": 32000}


def maxtext_flops_per_device(batch: int, seq: int, m: dict = LLAMA2_7B, causal: bool = False) -> float:
    """MaxText's FLOPs of one training step per device (`calculate_tflops_training_per_device`):
    SwiGLU MLP (3 matrices), q/k/v and output projections, attention's two matmuls (4 B S^2 H D;
    halved where `causal`: later MaxText versions halve it, the 2024 one that published 492 did
    not), the embedding's output projection (2 B S E V), all times 3 (forward and backward)."""
    ffn = 2 * batch * seq * m["mlp"] * m["emb"] * 3
    qkv = 2 * batch * seq * m["emb"] * (m["heads"] + 2 * m["kv_heads"]) * m["head_dim"]
    attention = 4 * batch * seq**2 * m["heads"] * m["head_dim"] / (2 if causal else 1)
    projection = 2 * batch * seq * m["emb"] * m["heads"] * m["head_dim"]
    embedding = 2 * batch * seq * m["emb"] * m["vocab"]
    return 3 * ((ffn + qkv + attention + projection) * m["layers"] + embedding)


def breakdown(text: str, costed, seq: int) -> dict[str, float]:
    """Milliseconds of compute per step charged to: attention's sequence x sequence work (kernels
    whose instruction line in the compiled text has a `seq,seq` shape: scores, softmax, their
    gradients), other GEMMs, other fusions; and the collectives' time not hidden under compute."""
    square = re.compile(rf"\b{seq},{seq}\]")
    attention = set()
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
        if m and square.search(line.split(", metadata=")[0]):
            attention.add(m.group(1))
    out = {"attention (seq x seq) ms": 0.0, "other gemm ms": 0.0, "other compute ms": 0.0}
    for k in costed.kernels:
        if k.lane != "compute":
            continue
        key = (
            "attention (seq x seq) ms"
            if k.name in attention
            else ("other gemm ms" if k.kind == "gemm" else "other compute ms")
        )
        out[key] += k.time_us / 1e3
    out["exposed collectives ms"] = (costed.iteration_us - costed.compute_us) / 1e3
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--remat", default="dots")
    parser.add_argument("--per-device-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--unconstrained", action="store_true", help="no activation constraint (the first run)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cluster = clusters.get_cluster("8xH100-NVLink")
    n = cluster.num_devices
    mesh = targets.mesh(cluster.target, n)
    spec = zoo.resized(
        "gpt",
        "paper",
        num_layers=32,
        d_model=4096,
        num_heads=32,
        seq_len=args.seq,
        vocab_size=32000,
        global_batch=args.per_device_batch * n,
        scan_layers=True,
        remat=args.remat,
    )
    print(f"{spec.description}; {spec.param_count() / 1e9:.2f}B parameters; FSDP {n} by hand", flush=True)
    start = time.perf_counter()
    if args.unconstrained:
        step, abstract = handwritten.fsdp_step(spec, optax.adamw(1e-4), mesh)
        compiled = step.lower(*abstract).compile()
    else:
        compiled = handwritten.guide_fsdp_lowered(spec, optax.adamw(1e-4), mesh).compile()
    compile_s = time.perf_counter() - start
    text = compiled.as_text()
    program = cost.compiled_program(text, backends.GPU)
    costed = cost.cost_program(
        program, cluster.kernel_estimator(), cluster.grouped_collectives(), cluster.simulator_params()
    )
    peak = choice.footprint(update.memory(compiled, {}))
    flops = maxtext_flops_per_device(args.per_device_batch, args.seq)
    flops_causal = maxtext_flops_per_device(args.per_device_batch, args.seq, causal=True)
    step_s = costed.iteration_us * 1e-6
    published_s = flops / (PUBLISHED_TFLOPS_PER_CHIP * 1e12)
    tokens = args.per_device_batch * args.seq
    record = {
        "model": spec.description,
        "parameters": spec.param_count(),
        "cluster": cluster.name,
        "remat": args.remat,
        "activation_constraints": not args.unconstrained,
        "compile_s": round(compile_s, 1),
        "predicted_step_ms": costed.iteration_us / 1e3,
        "predicted_compute_ms": costed.compute_us / 1e3,
        "predicted_comm_ms": costed.comm_us / 1e3,
        "peak_bytes": peak,
        "maxtext_tflops_per_device_step": flops / 1e12,
        "maxtext_tflops_per_device_step_causal": flops_causal / 1e12,
        "predicted_tflops_per_chip": flops / step_s / 1e12,
        "published_tflops_per_chip": PUBLISHED_TFLOPS_PER_CHIP,
        "published_step_ms": published_s * 1e3,
        "predicted_tokens_per_s_per_chip": tokens / step_s,
        "published_tokens_per_s_per_chip": tokens / published_s,
        "predicted_over_published_step": step_s / published_s,
        "breakdown": breakdown(text, costed, args.seq),
        "source": "github.com/AI-Hypercomputer/maxtext MaxText/configs/a3/llama_2_7b/README.md (commit 30cd40a) "
        "and 1vm.sh (commit 2d2c3c4)",
    }
    for key, value in {**record, **record["breakdown"]}.items():
        if key != "breakdown":
            print(f"{key:40s} {value:.4g}" if isinstance(value, float) else f"{key:40s} {value}", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as out:
            json.dump(record, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
