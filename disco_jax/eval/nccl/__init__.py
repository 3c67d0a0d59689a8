"""Collective costs fitted to published nccl-tests tables for H100 (docs/collectives.md).

`tables` holds the tables (CSV package data, each with its source) and what each is for; `fit`
finds the few lines (NCCL regimes) whose lower envelope matches a table in relative error;
`model.collective_model(gpus_per_node, nodes, fabric)` is the `disco_jax.cost.AllReduceCost` the
simulated H100 clusters use (`disco_jax.eval.clusters`), for every collective of
`cost.allreduce.COLLECTIVES`; `report` prints the fit per table (``python -m disco_jax.eval.nccl``).
"""

from disco_jax.eval.nccl.model import FABRICS, FittedCollectives, Regime, collective_model, model_for, table_fit
from disco_jax.eval.nccl.tables import TABLES, Table, tables_of

__all__ = [
    "FABRICS",
    "TABLES",
    "FittedCollectives",
    "Regime",
    "Table",
    "collective_model",
    "model_for",
    "table_fit",
    "tables_of",
]
