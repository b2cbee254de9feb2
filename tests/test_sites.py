"""Where the slots of a pytree are (`memox/_sites.py`): found through the layout of its
tree structure (one flatten, then each slot's path), they are the slots, owners and
fields a walk of every node finds, and replacing them gives the tree the walk gives."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from helpers import Checked, Counter, Foo, foo

import memox
from memox import _sites


class Tabled(eqx.Module):
    """A module whose static field cannot be compared (a NumPy array): no layout."""

    x: jax.Array
    table: np.ndarray = eqx.field(static=True)
    cache: memox.Memo[jax.Array] = memox.Memo()

    @memox.cached("cache")
    def lookup(self):
        return self.x * self.table.sum()


def _trees():
    c = Counter()
    shared = foo(c)
    filled = memox.call(foo(c), Foo.b)[1]
    with pytest.warns(UserWarning, match="being set as static"):  # Equinox's advice
        tabled = memox.call(Tabled(jnp.ones(2), np.zeros(3)), Tabled.lookup)[1]
    return {
        "module": foo(c),
        "filled module": filled,
        "containers": {"a": [foo(c), (filled, 1.0)], "b": None},
        "one module at two paths": (shared, shared),
        "a slot at the root": filled.b_cache,
        "a node that checks its leaves": (Checked(jnp.ones(2)), filled),
        "a static field that cannot be compared": tabled,
    }


@pytest.mark.parametrize("name", list(_trees()))
def test_the_layout_finds_what_a_walk_finds(name, monkeypatch):
    tree = _trees()[name]
    has_layout = _sites.layout(jtu.tree_structure(tree)) is not None
    walked_only = {"a node that checks its leaves", "a static field that cannot be compared"}
    assert has_layout == (name not in walked_only)
    found = [(s.path, s.slot, s.owner, s.field) for s in _sites.slot_sites(tree)]
    monkeypatch.setattr(_sites, "layout", lambda treedef: None)
    walked = [(s.path, s.slot, s.owner, s.field) for s in _sites.slot_sites(tree)]
    assert len(found) == len(walked) > 0
    for (p1, s1, o1, f1), (p2, s2, o2, f2) in zip(found, walked):
        assert p1 == p2 and s1 is s2 and o1 is o2 and f1 == f2


def _same(a, b):
    """The same tree structure with the very same leaves."""
    la, ta = jtu.tree_flatten(a)
    lb, tb = jtu.tree_flatten(b)
    return ta == tb and len(la) == len(lb) and all(x is y for x, y in zip(la, lb))


@pytest.mark.parametrize("name", list(_trees()))
@pytest.mark.parametrize("change", ["counted", "allocated or emptied"])
def test_replacing_slots_through_the_layout_gives_what_a_walk_gives(name, change, monkeypatch):
    tree = _trees()[name]
    sites = list(_sites.slot_sites(tree))
    full = memox.call(foo(Counter()), Foo.b)[1].b_cache
    if change == "counted":  # the structure of the slot replaced: spliced into the leaves
        new = {
            s.path: eqx.tree_at(lambda m: m.hits, s.slot, s.slot.hits + 1)
            for s in sites
            if s.slot.allocated
        }
        if not new:
            pytest.skip("no allocated slot")
    else:  # another structure: the tree rebuilt from a walk
        new = {s.path: memox.Memo() if s.slot.allocated else full for s in sites}
    replaced = _sites.replace_slots(tree, new)
    monkeypatch.setattr(_sites, "layout", lambda treedef: None)
    assert _same(replaced, _sites.replace_slots(tree, new))
    before = {s.path: s.slot for s in sites}
    for site in _sites.slot_sites(replaced):
        assert _same(site.slot, new.get(site.path, before[site.path]))
