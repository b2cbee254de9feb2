"""`memox.hoist`: cached values read ahead, in place of their slots.

`memox.hoist(module)` reads each cached method's value once, through the running call,
and returns the module with a `Hoisted` node (`_hoisted.py`) in place of each slot.
Inside a computation memox cannot see into (`eqx.filter_jit`, a solver loop, a diffrax
solve), the method then returns that value with no check and no branch.
"""

from __future__ import annotations

from . import _cached, _context, _errors
from ._cached import method_for
from ._call import check_module
from ._hoisted import Hoisted
from ._sites import replace_slots, slot_sites
from ._typing import CachedMethod, M


def hoist(module: M, /, *methods: CachedMethod) -> M:
    """Read cached values now, for a computation that `memox.call` cannot see into.

    Inside `memox.call` or `memox.jit`, a cached method called inside a transformation
    that rebuilds the module (`eqx.filter_jit`, `jax.jit`, a loop body, a diffrax solve)
    cannot reach its slot, and computes at every evaluation (memox warns). `hoist` reads
    the value of each cached method without arguments once, through the running call (a
    hit, or one computation that fills the slot), and returns the module with those
    values in place of their slots: inside the transformation the method returns its
    value with no check and no branch, as if you had hoisted it by hand.

    Gradients are exact: each value is the method's value at the view's arrays, and is
    differentiated as such. A gradient taken outside the call, or inside `fn` around
    `hoist` itself, reaches the value where it was read (no recomputation, diffrax's
    adjoints included). A gradient taken inside `fn` *with respect to the view* or its
    arrays (`jax.grad`, `eqx.filter_grad`, `jax.jvp`, `jax.vjp` of a function of the
    view) differentiates the method on the view where it is read, so it computes at each
    such read, as the unmemoized code does (the view's value leaves get no gradient of
    their own). To read once, call `hoist` inside the differentiated function.

    The returned module is a view for that one computation: use the module `memox.call`
    returns afterwards, not the view (its values do not follow changes made to it).

    **Arguments:**

    - `module`: the module (or a part of it) that `fn` received.
    - `*methods`: cached methods to read, unbound (`VectorField.weight`); none: every
      cached method without arguments in `module`.

    **Returns:**

    `module` with those methods' slots replaced by their values.

    !!! Example

        ```python
        def fn(foo, x):
            view = memox.hoist(foo)   # foo.b(): read here, once
            return jax.lax.fori_loop(0, 3, lambda i, y: y + view.b() * x, 0.0)

        y, foo = memox.call(foo, fn, jnp.float32(2.0))
        ```
    """
    if not isinstance(_context.top(), _context.Frame):
        raise ValueError(_errors.HOIST_OUTSIDE_CALL)
    check_module("hoist", module)
    for method in methods:
        if not isinstance(method, _cached.CachedMethod):
            raise TypeError(_errors.NOT_CACHED.format(api="hoist", got=repr(method)))
    new = {}
    for site in slot_sites(module):
        method = method_for(site.owner, site.field) if site.field else None
        if method is None or method.takes_arguments or (methods and method not in methods):
            continue
        new[site.path] = Hoisted(method(site.owner))
    return replace_slots(module, new)
