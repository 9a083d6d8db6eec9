"""Shared test settings: a fixed seed per test and hypothesis profiles sized for CI."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("FXPIPE_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _private_profile_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Unit timings go to a cache of this test session's, not the user's ~/.cache."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
