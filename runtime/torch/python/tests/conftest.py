"""The package on the simulated device: one runtime per test process, initialised once."""

import pytest

import steppool.torch as sp


@pytest.fixture(scope="session", autouse=True)
def simulated_runtime() -> None:
    sp.init(strategy="planned", device="sim", checked=True)
