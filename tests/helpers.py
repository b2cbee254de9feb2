"""Shared test models, counters of real executions and of traces, readers of slot
statistics and jaxprs, and the placements a cached call is tested in."""

import contextlib
import json
import os
import subprocess
import sys
import threading
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import memox
from memox import Memo


class Counter:
    """Counts real executions of the code that calls `tick()` (a `jax.debug.callback`)."""

    def __init__(self):
        self.n = 0

    def _bump(self):
        self.n += 1

    def tick(self):
        jax.debug.callback(self._bump)

    @contextlib.contextmanager
    def paused(self):
        """Executions inside (a reference computation, `reference()`) are not counted."""
        n = self.n
        try:
            with reference():
                yield
        finally:
            jax.effects_barrier()
            self.n = n


@contextlib.contextmanager
def reference():
    """A reference computation: cached methods run under a transformation outside
    `memox.call` on purpose, computing every time, so memox's `UncachedWarning` saying
    so is expected (no other warning is)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", ".* but outside `memox.call`", category=memox.UncachedWarning
        )
        yield


class Traces:
    """Counts traces: how often JAX runs a traced function's Python body (the body calls
    `tick()`; `tick(x)` also records what that trace saw, in `seen`)."""

    def __init__(self):
        self.seen = []

    def tick(self, what=None):
        self.seen.append(what)

    @property
    def n(self):
        return len(self.seen)


class Foo(eqx.Module):
    """Seed 1's example (test_seeds.py): `b` is an expensive function of `a`."""

    a: jax.Array
    counter: Counter = eqx.field(static=True)
    b_cache: Memo[jax.Array] = Memo()

    @memox.cached("b_cache")
    def b(self) -> jax.Array:
        self.counter.tick()
        return jnp.sum(self.a)


def foo(counter, n=3):
    return Foo(jnp.arange(n * n, dtype=jnp.float32).reshape(n, n), counter)


class Kernel(eqx.Module):
    """A Gaussian-process kernel matrix with a cached Cholesky factor."""

    x: jax.Array  # (n, d) inputs
    log_scale: jax.Array
    counter: Counter = eqx.field(static=True)
    chol_cache: Memo[jax.Array] = Memo()

    @memox.cached("chol_cache")
    def chol(self):
        self.counter.tick()
        return jnp.linalg.cholesky(gram(self.x, self.log_scale))


def gram(x, log_scale):
    d2 = jnp.sum((x[:, None, :] - x[None, :, :]) ** 2, axis=-1)
    return jnp.exp(-d2 * jnp.exp(log_scale)) + 0.5 * jnp.eye(x.shape[0])


def gp_loss(L, y):
    """A negative log marginal likelihood (up to constants) from a Cholesky factor."""
    return y @ jax.scipy.linalg.cho_solve((L, True), y) + 2 * jnp.sum(jnp.log(jnp.diag(L)))


class Inner(eqx.Module):
    x: jax.Array
    counter: Counter = eqx.field(static=True)
    gram_cache: Memo[jax.Array] = Memo()

    @memox.cached("gram_cache")
    def gram(self):
        self.counter.tick()
        return self.x @ self.x.T


class Outer(eqx.Module):
    """A cached method (`chol`) calling another (`inner.gram`)."""

    inner: Inner
    y: jax.Array
    counter: Counter = eqx.field(static=True)
    chol_cache: Memo[jax.Array] = Memo()

    @memox.cached("chol_cache")
    def chol(self):
        self.counter.tick()
        return jnp.linalg.cholesky(self.inner.gram() + jnp.diag(self.y))


def outer():
    """An `Outer` with counters for both methods: `(model, inner_counter, outer_counter)`."""
    ci, co = Counter(), Counter()
    x = jnp.arange(9.0).reshape(3, 3) / 10
    return Outer(Inner(x, ci), jnp.ones(3), co), ci, co


def call_b_times(module, x):
    """`memox.call(module, lambda m: m.b() * x)`: a `Foo`'s cached `b`, scaled by an
    argument that may be traced, batched or a loop's element."""
    return memox.call(module, lambda m: m.b() * x)


def hits_and_misses(module, path="b_cache"):
    """`(hits, misses)` of the slot at `path` in `module`, as `memox.stats` reports them
    (arrays, one count per element, for a batched module)."""
    stats = memox.stats(module)[path]
    return stats.hits, stats.misses


def hits_and_misses_by_slot(module):
    """`{path: (hits, misses)}` for every slot of `module`."""
    return {path: (s.hits, s.misses) for path, s in memox.stats(module).items()}


def primitives(jaxpr, in_cond=False):
    """`(primitive name, inside a cond branch?)` for every equation of `jaxpr`, recursing
    into the sub-jaxprs of its equations' parameters (branches, loop bodies, calls)."""
    found = []
    for eqn in jaxpr.eqns:
        found.append((eqn.primitive.name, in_cond))
        inner_in_cond = in_cond or eqn.primitive.name == "cond"
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found += primitives(sub, inner_in_cond)
    return found


class Spectral(eqx.Module):
    """A graph Laplacian whose eigenbasis is cached, and a head."""

    laplacian: jax.Array
    head: jax.Array
    counter: Counter = eqx.field(static=True)
    eig_cache: Memo[tuple[jax.Array, jax.Array]] = Memo()

    @memox.cached("eig_cache")
    def basis(self):
        self.counter.tick()
        return jnp.linalg.eigh(self.laplacian)

    def __call__(self, x):
        _, vecs = self.basis()
        return jnp.tanh(x @ vecs) @ self.head


def run_threads(target, n=2):
    """Run `target(i, barrier)` on `n` threads at once; re-raise the first error."""
    barrier = threading.Barrier(n, timeout=120)
    errors = []

    def guarded(i):
        try:
            target(i, barrier)
        except BaseException as e:  # reported on the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


PLACEMENTS = ["eager", "memox.jit", "jax.jit"]


def call_in(placement, module, method):
    """`memox.call(module, method)` in one of `PLACEMENTS` (compiled afresh: a
    configuration change must reach memox's key, not just jax.jit's)."""
    if placement == "eager":
        return memox.call(module, method)
    if placement == "memox.jit":
        return memox.jit(method)(module)
    return jax.jit(lambda m: memox.call(m, method))(memox.init(module))


def type_of(x):
    """`x`'s type as JAX joins types: shape, dtype, weak type, the sharding where it is
    part of the type (`Explicit` mesh axes), varying manual axes. Replicated is no
    sharding: JAX joins a replicated array of a mesh with an array of none (`a + b`, a
    `cond`'s branches)."""
    aval = jax.typeof(x)
    spec = getattr(getattr(aval, "sharding", None), "spec", ())
    sharded = tuple(spec) if any(axis is not None for axis in spec) else None
    return aval.shape, aval.dtype, aval.weak_type, sharded, getattr(aval, "vma", None)


def assert_same(value, expected):
    """Equal bits and equal types (`type_of`)."""
    for x, y in zip(jax.tree.leaves(value), jax.tree.leaves(expected)):
        assert type_of(x) == type_of(y), (jax.typeof(x), jax.typeof(y))
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@jax.tree_util.register_pytree_node_class
class Checked:
    """A pytree node that checks its leaves: memox cannot rebuild a module holding it
    from placeholders (`_sites.layout`), and finds its slots node by node."""

    def __init__(self, x):
        if not isinstance(x, jax.Array):
            raise TypeError("an array, please")
        self.x = x

    def tree_flatten(self):
        return (self.x,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def run_on_devices(code, n):
    """Run `code` in a fresh Python with `n` CPU devices (XLA's flag must be set before
    JAX is imported); return what it printed as `RESULT <json>`, parsed."""
    flags = " ".join(
        f
        for f in (os.environ.get("XLA_FLAGS"), f"--xla_force_host_platform_device_count={n}")
        if f
    )
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=os.path.dirname(__file__),  # import the memox this process imported, not ./memox
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))
