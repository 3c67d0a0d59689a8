"""The published nccl-tests tables the collective models are fitted to and checked against.

Each table is a CSV in ``data/`` (package data: a wheel carries it) with the columns
``bytes,time_us_out_of_place,algbw_GBps,busbw_GBps`` and a ``#`` header that says where it was
published and exactly what was measured (``data/README.md`` lists them). ``bytes`` is
nccl-tests' size column, which is also `disco_jax.cost.allreduce`'s byte convention: for an
all-reduce the buffer on each GPU; for a reduce-scatter or an all-gather the whole (unscattered /
gathered) buffer; for an all-to-all each GPU's buffer; for a send/recv (our collective-permute)
what each GPU sends.

`TABLES` says, per file, what it measured (collective, GPUs per node, nodes, the NCCL algorithm it
was told to use) and what the models do with it (`role`):

* ``fitted``: the fabric's model is fitted to it;
* ``held-out``: same fabric, another node count, never seen by the fit (the check that the
  structural extension to other node counts holds);
* ``check``: the fitted node count on another system, not fitted (one-node tables from another
  cluster, and the all-to-all and send/recv tables the derived collectives are checked against);
* ``excluded``: same fabric and node count, left out of the fit for the reason in `note`; still
  reported against the model.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources

import numpy as np

ROLES = ("fitted", "held-out", "check", "excluded")


@dataclasses.dataclass(frozen=True)
class Table:
    file: str
    collective: str  # a `cost.allreduce.COLLECTIVES` name
    fabric: str  # "nvlink" (one node), "ib", "efa", "tcpxo", "unstated"
    gpus_per_node: int
    nodes: int
    algorithm: str  # what NCCL was told: "default", "ring" (NCCL_ALGO=Ring), "nvls" (NVLS on)
    role: str
    note: str = ""

    @property
    def num_devices(self) -> int:
        return self.gpus_per_node * self.nodes

    def header(self) -> list[str]:
        """The CSV's ``#`` lines, without the ``# ``."""
        return [line[2:].rstrip("\n") for line in _text(self.file).splitlines() if line.startswith("#")]

    def source(self) -> str:
        """The header's first line: where the table was published."""
        return self.header()[0].removeprefix("source: ")

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(bytes, out-of-place microseconds), in the table's order."""
        return _rows(self.file)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "source": self.source()}


def _t(file, collective, fabric, gpus_per_node, nodes, algorithm, role, note=""):
    return Table(file, collective, fabric, gpus_per_node, nodes, algorithm, role, note)


_AR, _RS, _AG = "all-reduce", "reduce-scatter", "all-gather"
_OTHER_CLUSTER = "one node of another cluster (NCCL 2.29.2, one process per GPU), 32 MiB-16 GiB"
TABLES: tuple[Table, ...] = (
    # One node, 8 x H100 SXM over NVLink/NVSwitch (togethercomputer, NCCL 2.26.2, -g 8).
    _t("h100-8gpu-nvlink-allreduce-ring-together.csv", _AR, "nvlink", 8, 1, "ring", "fitted"),
    _t("h100-8gpu-nvlink-allreduce-nvls-together.csv", _AR, "nvlink", 8, 1, "nvls", "fitted"),
    _t("h100-8gpu-nvlink-reducescatter-ring-together.csv", _RS, "nvlink", 8, 1, "ring", "fitted"),
    _t("h100-8gpu-nvlink-allgather-ring-together.csv", _AG, "nvlink", 8, 1, "ring", "fitted"),
    _t("h100-8gpu-nvlink-allreduce-xxrjun.csv", _AR, "nvlink", 8, 1, "default", "check", _OTHER_CLUSTER),
    _t("h100-8gpu-nvlink-reducescatter-xxrjun.csv", _RS, "nvlink", 8, 1, "default", "check", _OTHER_CLUSTER),
    _t("h100-8gpu-nvlink-allgather-xxrjun.csv", _AG, "nvlink", 8, 1, "default", "check", _OTHER_CLUSTER),
    _t(
        "h100-8gpu-nvlink-alltoall-xxrjun.csv",
        "all-to-all",
        "nvlink",
        8,
        1,
        "default",
        "check",
        "derived collective (from the all-gather fit), " + _OTHER_CLUSTER,
    ),
    _t(
        "h100-8gpu-nvlink-sendrecv-xxrjun.csv",
        "collective-permute",
        "nvlink",
        8,
        1,
        "default",
        "check",
        "derived collective (from the all-gather fit), " + _OTHER_CLUSTER,
    ),
    # Two nodes over InfiniBand 400 Gb/s (one NIC per GPU).
    _t("h100-16gpu-2node-ib-allreduce-xe9680-nccltests309.csv", _AR, "ib", 8, 2, "default", "fitted"),
    _t("h100-16gpu-2node-ib-allreduce-gjaion-nccltests309.csv", _AR, "ib", 8, 2, "default", "fitted"),
    _t("h100-16gpu-2node-ib-allreduce-ring-nccltests309.csv", _AR, "ib", 8, 2, "ring", "fitted"),
    _t(
        "h100-16gpu-2node-ib-allreduce-dgxh100-mitorcd.csv",
        _AR,
        "ib",
        8,
        2,
        "default",
        "excluded",
        "8 KiB-1 GiB run 2-20x slower than the other two-node IB tables and not monotone (NCCL 2.18.3; fabric "
        "not stated); agrees with them only from 2 GiB",
    ),
    # Held out: InfiniBand at other node counts.
    _t("h100-32gpu-4node-ib-allreduce-vm-nccltests309.csv", _AR, "ib", 8, 4, "default", "held-out", "VMs"),
    _t("h100-32gpu-4node-ib-allreduce-gjaion-nccltests309.csv", _AR, "ib", 8, 4, "default", "held-out"),
    _t("h100-64gpu-8node-ib-allreduce-gjaion-nccltests309.csv", _AR, "ib", 8, 8, "default", "held-out"),
    _t(
        "h100-64gpu-8node-ib-allreduce-tuned-gjaion-nccltests309.csv",
        _AR,
        "ib",
        8,
        8,
        "default",
        "held-out",
        "tuned: NCCL_MIN_CTAS=24, NCCL_IB_QPS_PER_CONNECTION=2",
    ),
    *(
        _t(f"h100-80gpu-10node-{name}-xxrjun.csv", coll, "ib", 8, 10, "default", "held-out", "fabric not stated")
        for name, coll in (("allreduce", _AR), ("reducescatter", _RS), ("allgather", _AG))
    ),
    # Other fabrics, two nodes.
    _t("h100-16gpu-2node-efa-allreduce-awsp5-keitaw.csv", _AR, "efa", 8, 2, "default", "fitted"),
    _t("h100-16gpu-2node-tcpxo-allreduce-a3mega-lessizzmore.csv", _AR, "tcpxo", 8, 2, "default", "fitted"),
    _t(
        "h100-16gpu-2node-allreduce-lambda1cc-mitorcd.csv",
        _AR,
        "unstated",
        8,
        2,
        "default",
        "check",
        "fabric not stated; peak bus bandwidth half the IB tables'",
    ),
)

BY_FILE: dict[str, Table] = {t.file: t for t in TABLES}


def tables_of(*, fabric: str | None = None, role: str | None = None) -> tuple[Table, ...]:
    return tuple(t for t in TABLES if (fabric is None or t.fabric == fabric) and (role is None or t.role == role))


@functools.cache
def _text(file: str) -> str:
    return importlib.resources.files(__package__).joinpath("data", file).read_text(encoding="utf-8")


@functools.cache
def _rows(file: str) -> tuple[np.ndarray, np.ndarray]:
    lines = [line for line in _text(file).splitlines() if line and not line.startswith("#")]
    if lines[0] != "bytes,time_us_out_of_place,algbw_GBps,busbw_GBps":
        raise ValueError(f"{file}: unexpected columns {lines[0]!r}")
    values = np.array([[float(v) for v in line.split(",")[:2]] for line in lines[1:]])
    values.setflags(write=False)  # cached: shared by every caller
    return values[:, 0], values[:, 1]
