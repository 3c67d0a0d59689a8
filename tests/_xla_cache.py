"""One persistent XLA compilation cache for a whole test run: both pytest-xdist workers and every
process a test starts (the fault tests' and multi-host tests' workers) compile the same small steps,
measurement programs and estimator batches again and again; through one cache each is compiled once.

`share()` is called first thing by `conftest.py` and by the worker scripts. The first process of
the run (pytest's controller, or the only process under `-n 0`) makes the directory and names it
in the environment (`RUN_CACHE_ENV`, and JAX's own `JAX_COMPILATION_CACHE_DIR`, read when jax is
imported), so every process started afterwards inherits it; that process removes it at exit. A
test that needs a cache of its own (test_faults' shared-cache test) sets JAX's variable for its
workers itself.

JAX writes an entry in place (`lru_cache.LRUCache.put`: `Path.write_bytes`), so with several
processes compiling at once one could read an entry half written (JAX then warns and compiles
again) or two could interleave their writes of one key: `share()` makes the write go to a
temporary file renamed into place. Only XLA:CPU executables are served from the cache; deviceless
XLA:GPU compiles are not (their executables cannot be loaded without a GPU).

What deviceless XLA:GPU compiles share instead is XLA:GPU's own kernel cache
(`--xla_gpu_kernel_cache_file`, added to `XLA_FLAGS`; a file in the run's directory): each
kernel's machine code (LLVM's PTX through `ptxas`), keyed by a fingerprint of its fused
computation, so a kernel that an earlier compile of the run built is not built again. The tests
compile one model under many plans, and most of its kernels are the same in each: the tiny
Transformer's XLA plan compiled after its capture took 19 CPU seconds instead of 34, its compiled
module the same text (the cache holds code, not decisions: fusion, scheduling and autotuning run
as before). XLA writes the file through a temporary file renamed into place; two processes
appending at once can lose each other's new entries, never corrupt the file."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

RUN_CACHE_ENV = "DISCO_JAX_TEST_XLA_CACHE"
GPU_KERNEL_CACHE_FLAG = "--xla_gpu_kernel_cache_file"


def share() -> str:
    """Point this process (and the ones it starts) at the run's cache; returns its directory.
    Call before jax is imported."""
    path = os.environ.get(RUN_CACHE_ENV)
    # Every compile is worth keeping: the tests' programs are small and fast to compile.
    settings = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    if path is None or not os.path.isdir(path):  # the run's first process: a cache user settings do not reach
        path = tempfile.mkdtemp(prefix="disco-jax-test-xla-cache-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        os.environ.update({RUN_CACHE_ENV: path, "JAX_COMPILATION_CACHE_DIR": path, **settings})
    else:  # a process of the run: what it was started with (a test may give its workers their own cache)
        for name, value in {"JAX_COMPILATION_CACHE_DIR": path, **settings}.items():
            os.environ.setdefault(name, value)
    _share_gpu_kernels(os.path.join(path, "xla_gpu_kernels.bin"))
    _write_entries_atomically()
    return path


def _share_gpu_kernels(file: str) -> None:
    """XLA:GPU's kernel cache file for this process and the ones it starts, unless a kernel cache
    is named already (a process of the run inherits the flag)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not any(f.startswith(GPU_KERNEL_CACHE_FLAG + "=") for f in flags):
        os.environ["XLA_FLAGS"] = " ".join([*flags, f"{GPU_KERNEL_CACHE_FLAG}={file}"])


def _write_entries_atomically() -> None:
    from jax._src import lru_cache

    if getattr(lru_cache.LRUCache.put, "_atomic", False):
        return
    in_place = lru_cache.LRUCache.put

    def put(self, key: str, value: bytes) -> None:
        if self.eviction_enabled:  # JAX holds a file lock around the write then
            return in_place(self, key, value)
        target = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
        if target.exists():
            return
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".writing-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise

    put._atomic = True
    lru_cache.LRUCache.put = put
