"""The evaluation harness: DisCo's baselines, simulated GPU clusters and the benchmark report.

* `baselines`: DisCo's six baselines, each a `Strategy` and how XLA:CPU enacts it;
* `clusters`: simulated GPU clusters, every number with its source;
* `rows`: the experiments, one row per model and platform (measured on CPU devices, simulated on
  clusters);
* `bench`: the driver of `disco-jax bench` (one worker process per model, resumable);
* `report` and `figures`: the report folder's README.md (prose in `report_template.md`) and PNGs.

Not part of the library: `import disco_jax` does not import this package. It uses the library
through its public names (`disco_jax._compile`, `disco_jax._profile_phase`, `optimize_distributed`).
"""
