"""JAX's own `lax.scan` tests, run with `memox.scan` as `lax.scan`: the specification of
`memox.scan` as a drop-in (README.md in this folder).

Each test module here is imported with an `__import__` of its own, under which `jax` and
`jax.lax` are namespaces that forward every name to JAX's but `scan`, which is
`memox.scan`. Only the module's own code sees the swap: JAX, and memox, which calls
`jax.lax.scan`, keep JAX's (patching `jax.lax.scan` would make `memox.scan` call itself).
"""

import builtins
import importlib.util
import pathlib
import sys
import types

import jax
import pytest

import memox


HERE = pathlib.Path(__file__).parent

# Marked `heavy` (`-m heavy` runs them; CI runs both): the slowest tests, and every test
# run again with `lax.scan` wrapped otherwise (`unroll=0`, `unroll=2`, under
# `jax.checkpoint`): three quarters of the time. The rest takes ~1 min on 2 cores.
HEAVY = ("testScanRnn", "testScanGrad", "test_scan_vjp_forwarding_correctness")
HEAVY_VARIANTS = ("unroll0", "unroll2", "new_checkpoint")

# The tests that cannot apply, each with its reason; every other test passes with
# `memox.scan` (on jax 0.10.0 and 0.12: all of them but one skipped by JAX itself).
CANNOT_APPLY = {
    "test_scan_typecheck_param": (
        jax.__version_info__[:2] != (0, 10),
        "JAX 0.10's test of its internal `_scan_typecheck`, which later JAX changed: it "
        "fails with `lax.scan` too",
    ),
}


class _Namespace(types.ModuleType):
    """`module`, but for the attributes given."""

    def __init__(self, module: types.ModuleType, **attributes):
        super().__init__(module.__name__, module.__doc__)
        self.__dict__.update(attributes, __wrapped__=module)

    def __getattr__(self, name):  # (only for names not set here)
        return getattr(self.__wrapped__, name)


_LAX = _Namespace(jax.lax, scan=memox.scan)
_JAX = _Namespace(jax, lax=_LAX)


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    """`__import__`, with `jax` and `jax.lax` the namespaces above."""
    module = builtins.__import__(name, globals, locals, fromlist, level)
    return {jax: _JAX, jax.lax: _LAX}.get(module, module)


class _WithMemoxScan(pytest.Module):
    """A test module whose imports of `jax` and `jax.lax` see `memox.scan` as `scan`."""

    def _getobj(self):
        spec = importlib.util.spec_from_file_location(self.path.stem, self.path)
        module = importlib.util.module_from_spec(spec)
        module.__builtins__ = {**vars(builtins), "__import__": _import}
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        assert module.lax.scan is memox.scan and module.jax.lax.scan is memox.scan
        return module


def pytest_pycollect_makemodule(module_path, parent):
    if module_path.parent == HERE and module_path.name.endswith("_test.py"):
        return _WithMemoxScan.from_parent(parent, path=module_path)
    return None


@pytest.hookimpl(tryfirst=True)  # (before `-m` deselects)
def pytest_collection_modifyitems(items):
    for item in (item for item in items if item.path.parent == HERE):
        if item.name.startswith(HEAVY) or any(v in item.name for v in HEAVY_VARIANTS):
            item.add_marker(pytest.mark.heavy)
        where, why = CANNOT_APPLY.get(item.name, (False, ""))
        if where:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(autouse=True)
def _jax_defaults():
    # The project's conftest makes JAX's promotion strict for the whole session; JAX's
    # tests set their own (`jtu.JaxTestCase.setUp`) over JAX's defaults.
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        yield


@pytest.fixture(autouse=True)
def _no_tracer_leaks():
    # Overrides the project's: JAX runs these tests without its leak checker, which
    # reports a leak for `lax.scan` itself in `test_scan_diff_of_print` (a debug print in
    # a scan under `grad`) and, disabling JAX's cache of compiled primitives, makes the
    # eager tests compile every op (3x slower).
    yield
