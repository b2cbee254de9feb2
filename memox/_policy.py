"""Reuse policies: when a stored value may be returned instead of recomputed.

Every policy decides inside the compiled program, from arrays in the slot, so it keeps
the tree structure fixed and works inside `jit` and `lax.scan`. Gradients stay exact
under every policy: when a dependency carries a tangent, the value is recomputed (see
`_memo.py`).

- `Exact()` (the default): reuse only while every dependency is bit-for-bit unchanged.
- `Drift(rtol, atol)`: reuse while every dependency stays within a tolerance of the
  values the stored value was computed from. The slot keeps a snapshot of those
  dependencies: memory equal to their size, per table entry.
- `Manual()`: never look at the dependencies; only `memox.clear` or
  `memox.invalidate` refresh the value.

Each takes `max_age=k`: additionally recompute after `k` hits, so a value is used at
most `k + 1` times (one computation, `k` hits). Arguments of the method are always part
of the key, exactly.

A policy applies to everything its method reads, including what the cached methods it
calls read: an outer `Drift` method checks the arrays its inner methods depend on, and
an inner `Manual` method does not shield them. To decouple two levels (CVODE's
Jacobian and its factorisation), pass the inner value as an argument to the outer
method: arguments are keyed exactly, and the outer policy then applies to the rest.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from ._slot import Memo


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
    """When a stored value may be reused: the base class of `Exact`, `Drift` and
    `Manual`. Pass one of those to `memox.cached(..., policy=...)`.

    !!! Example

        ```python
        policy = memox.policies.Drift(rtol=0.1)
        assert isinstance(policy, memox.policies.Policy)
        ```
    """

    max_age: int | None = None

    def __post_init__(self) -> None:
        if self.max_age is not None and (not isinstance(self.max_age, int) or self.max_age < 1):
            raise ValueError(
                f"`memox.policies.{type(self).__name__}(max_age=...)` must be a positive "
                f"int (the number of hits after which the value is recomputed); got "
                f"{self.max_age!r}."
            )

    #: Whether the dependencies are part of the exact key (else only the arguments are).
    keys_dependencies: bool = dataclasses.field(default=True, init=False, repr=False)
    #: Whether a snapshot of the dependencies is kept with each entry.
    snapshots: bool = dataclasses.field(default=False, init=False, repr=False)

    def close_enough(self, deps: Sequence[Array], snapshot: Sequence[Array]) -> Bool[Array, ""]:
        """Whether `deps` may reuse a value computed from `snapshot` (drift only)."""
        return jnp.ones((), jnp.bool_)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Exact(Policy):
    """Reuse while every dependency is bit-for-bit unchanged (the default).

    !!! Example

        ```python
        @memox.cached("chol_cache", policy=memox.policies.Exact(max_age=100))
        def chol(self): ...
        ```
    """


@dataclasses.dataclass(frozen=True, kw_only=True)
class Drift(Policy):
    """Reuse while every dependency `d` stays within `|d - s| <= atol + rtol * |s|` of
    the snapshot `s` it was computed from (elementwise; integer dependencies must match).

    The slot keeps that snapshot: memory equal to the dependencies' size per entry.

    !!! Example

        ```python
        @memox.cached("lu_cache", policy=memox.policies.Drift(rtol=0.3, max_age=20))
        def lu(self): ...
        ```
    """

    rtol: float = 0.0
    atol: float = 0.0
    snapshots: bool = dataclasses.field(default=True, init=False, repr=False)
    keys_dependencies: bool = dataclasses.field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.rtol >= 0 and self.atol >= 0):
            raise ValueError(
                "`memox.policies.Drift(rtol, atol)` takes non-negative tolerances; got "
                f"rtol={self.rtol!r}, atol={self.atol!r}."
            )

    def close_enough(self, deps: Sequence[Array], snapshot: Sequence[Array]) -> Bool[Array, ""]:
        ok = jnp.ones((), jnp.bool_)
        for d, s in zip(deps, snapshot):
            if jnp.issubdtype(d.dtype, jnp.inexact):
                bound = self.atol + self.rtol * jnp.abs(s)
                ok = ok & jnp.all(jnp.abs(d - s) <= bound.astype(jnp.abs(s).dtype))
            else:
                ok = ok & jnp.all(d == s)
        return ok


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manual(Policy):
    """Never look at the dependencies: only `memox.clear` and `memox.invalidate` (or
    `max_age`) refresh the value. A check costs O(1), whatever the dependencies' size.

    !!! Example

        ```python
        @memox.cached("basis_cache", policy=memox.policies.Manual())
        def basis(self): ...
        ```
    """

    keys_dependencies: bool = dataclasses.field(default=False, init=False, repr=False)


@functools.partial(jax.jit, static_argnums=0)
def fresh(policy: Policy, slot: Memo, deps: Sequence[Array], snapshots: Sequence[Array]) -> Array:
    """Per entry of `slot`: whether the policy allows reusing it (besides its key
    matching). The ages are read only where the policy has a `max_age` (eagerly, reading
    them is an operation of its own).

    `snapshots` holds, per dependency, the snapshots of all entries (leading axis K)."""
    ok = jnp.ones(slot.key.shape[:-1], jnp.bool_)
    if policy.max_age is not None:
        ok = ok & (slot.age < policy.max_age)
    if policy.snapshots:
        ok = ok & jax.vmap(lambda *s: policy.close_enough(deps, s))(*snapshots)
    return ok
