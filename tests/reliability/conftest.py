"""Reliability suite: shared options and helpers.

The default run is CI-sized (a few minutes on 2 cores).  Long variants (more kill points, the
200k-step soak, longer fuzzing) run with ``pytest tests/reliability --runslow`` or with the
environment variable ``STABILITY_LONG=1`` (the variable also works when the suite is collected
from the repository root, where this conftest is not an initial conftest and cannot add options).
"""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    try:
        parser.addoption("--runslow", action="store_true", default=False,
                         help="run the long reliability variants (also: STABILITY_LONG=1)")
    except ValueError:  # already added by another conftest
        pass


def long_enabled(config: pytest.Config | None = None) -> bool:
    """Whether the long variants are enabled (``--runslow`` or ``STABILITY_LONG=1``)."""
    if os.environ.get("STABILITY_LONG", "").strip() not in ("", "0", "false", "no"):
        return True
    if config is not None:
        try:
            return bool(config.getoption("--runslow", default=False))
        except ValueError:
            return False
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if long_enabled(config):
        return
    skip = pytest.mark.skip(reason="long variant: use --runslow or STABILITY_LONG=1")
    here = os.path.dirname(__file__)
    for item in items:
        if "slow" in item.keywords and str(item.fspath).startswith(here):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def long_run(pytestconfig: pytest.Config) -> bool:
    """``True`` when the long variants are enabled."""
    return long_enabled(pytestconfig)
