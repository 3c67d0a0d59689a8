"""Test setup: 8 virtual CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    + ["--xla_force_host_platform_device_count=8"]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.pop("ENABLE_SEARCH", None)
os.environ.pop("DISCO_JAX_PLAN_DIR", None)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path, monkeypatch):
    """Every test gets its own plan and profile directories and ENABLE_SEARCH unset."""
    monkeypatch.setenv("DISCO_JAX_PLAN_DIR", str(tmp_path / "plans"))
    monkeypatch.setenv("DISCO_JAX_PROFILE_DIR", str(tmp_path / "profiles"))
    monkeypatch.delenv("ENABLE_SEARCH", raising=False)
    yield
