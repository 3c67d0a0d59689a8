"""The evaluation harness: DisCo's baselines, simulated GPU clusters and the benchmark report.

Not part of the library: `import disco_jax` does not import this package. It uses the library
through its public names (`disco_jax._compile`, the pipeline's `optimize_distributed`).
"""
