"""Equinox 0.13.8's own tests of `eqx.filter_jit`, run against `memox.filter_jit`: the
specification of the drop-in (`tests/peers/equinox/test_*.py`, vendored unchanged from
https://github.com/patrick-kidger/equinox at v0.13.8, Apache-2.0: `LICENSE`).

Inside each of those test modules, `eqx` is Equinox with one name swapped:
`eqx.filter_jit` is `memox.filter_jit` (a namespace that reads every other name from
`equinox`). Equinox itself is left alone: memox calls the real `eqx.filter_jit`. A test
that cannot apply to memox is listed, with the reason, in `NOT_APPLICABLE`."""

import pathlib
import types

import equinox
import pytest

import memox


class _Equinox(types.ModuleType):
    """`equinox`, with `filter_jit` memox's."""

    def __getattr__(self, name: str):
        return getattr(equinox, name)


EQX = _Equinox("equinox", "Equinox, with `memox.filter_jit` as `filter_jit`.")
EQX.filter_jit = memox.filter_jit


def _not_applicable() -> dict[str, str]:
    """The test ids listed in `NOT_APPLICABLE`, with their reasons (`id: reason` lines)."""
    listed = {}
    for line in (pathlib.Path(__file__).parent / "NOT_APPLICABLE").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, reason = line.split(":", 1)
            listed[name.strip()] = reason.strip()
    return listed


def pytest_collection_modifyitems(items):
    listed = _not_applicable()
    for item in items:
        reason = listed.get(f"{pathlib.Path(item.path).name}::{item.name}")
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"not applicable to memox: {reason}"))


@pytest.fixture(autouse=True)
def _memox_filter_jit(request, monkeypatch):
    """`eqx.filter_jit` in the test's module is `memox.filter_jit`."""
    assert request.module.eqx is equinox or request.module.eqx is EQX
    monkeypatch.setattr(request.module, "eqx", EQX)


@pytest.fixture
def getkey():
    # Equinox's own fixture (its tests/conftest.py).
    import equinox.internal as eqxi

    return eqxi.GetKey()
