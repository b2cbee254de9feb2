"""A host callback inside a cached method: where it lies in the compiled program.

A hit does not run it: the callback's custom call is in the miss branch of the `cond`
only, and no token is threaded through the program (`jax.debug.callback` is unordered).
What a hit still pays is JAX's dispatch of a program with an effect (its Python path,
no C++ fast path; docs/performance.md), not anything memox stages; these tests pin the
structure that the documentation states.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
from helpers import Counter

import memox


class Counted(eqx.Module):
    w: jax.Array
    counter: Counter = eqx.field(static=True)
    c: memox.Memo = memox.Memo()

    @memox.cached("c")
    def f(self) -> jax.Array:
        self.counter.tick()
        return jnp.tanh(self.w) @ self.w


def _step(m: Counted) -> jax.Array:
    return m.f().sum()


def _computations(hlo: str) -> dict[str, str]:
    """The computations of an HLO module's text, by name (the entry as `ENTRY`)."""
    out, name, lines = {}, None, []
    for line in hlo.splitlines():
        head = re.match(r"(ENTRY )?%([\w.\-]+) .*\{$", line)
        if head:
            name, lines = ("ENTRY" if head.group(1) else head.group(2)), []
        elif line == "}" and name is not None:
            out[name] = "\n".join(lines)
            name = None
        elif name is not None:
            lines.append(line)
    return out


def test_callback_is_in_the_miss_branch_only():
    m = memox.init(Counted(jnp.ones((8, 8)), Counter()), _step)
    hlo = jax.jit(lambda m: memox.call(m, _step)).lower(m).compile().as_text()
    computations = _computations(hlo)
    callback = re.compile(r'custom_call_target="xla_ffi_python_\w+_callback"')
    with_callback = [name for name, body in computations.items() if callback.search(body)]
    assert len(with_callback) == 1 and len(callback.findall(hlo)) == 1, with_callback
    entry = computations["ENTRY"]
    assert with_callback != ["ENTRY"]
    (branches,) = re.findall(r"conditional\(.*branch_computations=\{([^}]*)\}", entry)
    assert with_callback[0] in [b.strip().lstrip("%") for b in branches.split(",")]
    # No ordering token: nothing on the host is waited for inside the program.
    assert "token[]" not in hlo and "after-all" not in hlo


def test_hits_do_not_run_the_callback():
    counter = Counter()
    m = memox.init(Counted(jnp.ones((8, 8)), counter), _step)
    step = memox.jit(_step)
    for _ in range(4):
        _, m = step(m)
    jax.effects_barrier()
    assert counter.n == 1
    stats = memox.stats(m)["c"]
    assert (stats.hits, stats.misses) == (3, 1)
