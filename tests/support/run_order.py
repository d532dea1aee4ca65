"""``--test-order reverse|shuffle`` (a pytest plugin, loaded by the root ``conftest.py``): run the tests in
reverse or shuffled order within each package (``tests/`` and each ``packages/<name>/``), so a test that only
passes after, or before, another shows up. ``--test-order-seed N`` picks the shuffle (printed in the header)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("loongforge")
    group.addoption("--test-order", choices=["default", "reverse", "shuffle"], default="default",
                    help="run the tests in reverse or shuffled order within each package")
    group.addoption("--test-order-seed", type=int, default=None, help="the shuffle's seed (default: random)")


def _package(item: pytest.Item, root: Path) -> str:
    parts = Path(str(item.path)).relative_to(root).parts
    return "/".join(parts[:2]) if parts and parts[0] == "packages" else parts[0] if parts else ""


def pytest_report_header(config: pytest.Config) -> str | None:
    order = config.getoption("--test-order")
    if order == "default":
        return None
    return f"test order: {order}" + (f" (seed {config._test_order_seed})" if order == "shuffle" else "")


def pytest_configure(config: pytest.Config) -> None:
    seed = config.getoption("--test-order-seed")
    config._test_order_seed = random.randrange(2**16) if seed is None else seed


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = config.getoption("--test-order")
    if order == "default":
        return
    root = Path(config.rootpath)
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:  # NOTE: packages keep their place; only the order inside each one changes
        groups.setdefault(_package(item, root), []).append(item)
    rng = random.Random(config._test_order_seed)
    for group in groups.values():
        if order == "reverse":
            group.reverse()
        else:
            rng.shuffle(group)
    items[:] = [item for group in groups.values() for item in group]
