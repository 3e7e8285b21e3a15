"""Shared fixtures of the Python tests. GPU tests carry the `gpu` marker and skip themselves
without PyTorch or a CUDA device; CTest runs `-m "not gpu"` (label cpu) and `-m gpu`
(label gpu) separately."""

import numpy as np
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs PyTorch with a CUDA device")
    config.addinivalue_line("markers", "torch: needs PyTorch (CPU tensors are enough)")


@pytest.fixture
def rng():
    return np.random.default_rng(20260)
