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
from memox import _sites, _slot


class Tabled(eqx.Module):
    """A module whose static field cannot be compared (a NumPy array)."""

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


def _finds_what_a_walk_finds(tree, monkeypatch):
    found = [(s.path, s.slot, s.owner, s.field) for s in _sites.slot_sites(tree)]
    with monkeypatch.context() as patched:
        patched.setattr(_sites, "layout", lambda treedef: None)
        walked = [(s.path, s.slot, s.owner, s.field) for s in _sites.slot_sites(tree)]
    assert len(found) == len(walked) > 0
    for (p1, s1, o1, f1), (p2, s2, o2, f2) in zip(found, walked):
        assert p1 == p2 and s1 is s2 and o1 is o2 and f1 == f2


@pytest.mark.parametrize(
    "name", [n for n in _trees() if n != "a static field that cannot be compared"]
)
def test_the_layout_finds_what_a_walk_finds(name, monkeypatch):
    tree = _trees()[name]
    has_layout = _sites.layout(jtu.tree_structure(tree)) is not None
    assert has_layout == (name != "a node that checks its leaves")
    _finds_what_a_walk_finds(tree, monkeypatch)


def test_a_structure_that_cannot_be_compared_is_walked_once_it_must_be(monkeypatch):
    """A structure holding a NumPy array for a static field hashes, but comparing two
    such structures raises. The first one seen gets a layout; one of equal hash looked up
    after it is walked. Either way the slots found are the walk's."""
    first, second = (_trees()["a static field that cannot be compared"] for _ in range(2))
    _sites._layouts.clear()
    assert _sites.layout(jtu.tree_structure(first)) is not None
    assert _sites.layout(jtu.tree_structure(second)) is None
    for tree in (first, second):
        _finds_what_a_walk_finds(tree, monkeypatch)


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
            s.path: eqx.tree_at(lambda m: m.counts, s.slot, s.slot.counts + 1)
            for s in sites
            if s.slot.allocated
        }
        if not new:
            pytest.skip("no allocated slot")
    else:  # another structure: the tree rebuilt from a walk
        new = {s.path: memox.Memo() if s.slot.allocated else full for s in sites}
    replaced = _sites.replace_slots(tree, new)  # (copied down the paths)
    monkeypatch.setattr(_sites, "with_nodes", lambda tree, new: None)
    spliced = _sites.replace_slots(tree, new)  # (flattened, spliced, unflattened)
    monkeypatch.setattr(_sites, "layout", lambda treedef: None)
    walked = _sites.replace_slots(tree, new)
    assert _same(replaced, walked) and _same(spliced, walked)
    before = {s.path: s.slot for s in sites}
    for site in _sites.slot_sites(replaced):
        assert _same(site.slot, new.get(site.path, before[site.path]))


def _nodes(tree):
    """Every node of `tree` (leaves included), by path."""
    out = {}

    def visit(path, node):
        out[path] = node
        children = jtu.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
        if not (len(children) == 1 and children[0][1] is node):
            for key, child in children:
                visit((*path, *key), child)

    visit((), tree)
    return out


@pytest.mark.parametrize("name", list(_trees()))
def test_replacing_a_slot_copies_only_the_nodes_on_its_path(name):
    tree = _trees()[name]
    sites = list(_sites.slot_sites(tree))
    site = sites[-1]
    new_slot = memox.Memo()
    copied = _sites.with_nodes(tree, {site.path: new_slot})
    if copied is None:  # a node memox does not copy on the path: the caller rebuilds
        assert name == "a node that checks its leaves" and site.path[0] == jtu.SequenceKey(1)
        pytest.skip("rebuilt whole")
    assert _same(copied, _sites.replace_slots(tree, {site.path: new_slot}, rebuild=True))
    old, new = _nodes(tree), _nodes(copied)
    on_path = {site.path[:i] for i in range(len(site.path) + 1)}
    assert new[site.path] is new_slot
    for path, node in new.items():
        if path in on_path:
            assert node is not old[path], path  # a new node (the tree passed in is kept)
        elif not any(path[: len(p)] == p and len(p) == len(site.path) for p in on_path):
            assert node is old[path], path  # everything else: the very object
    # The tree passed in still holds its own slots.
    assert all(s.slot is t.slot for s, t in zip(sites, _sites.slot_sites(tree)))


def _with_or_without_empty_slots():
    """Trees, and whether each holds a slot still to allocate."""
    c = Counter()
    filled = memox.call(foo(c), Foo.b)[1]
    return {
        "an empty slot": (foo(c), True),
        "a filled slot": (filled, False),
        "one of each": ([filled, foo(c)], True),
        "an empty slot come back as an array": (jax.device_put(foo(c)), True),
        "a slot filtered out": (eqx.filter(filled, eqx.is_inexact_array), False),
        "a slot's marker in a container": (
            eqx.tree_at(lambda m: m.b_cache.value, foo(c), (memox.Memo().value,)),
            True,
        ),
    }


@pytest.mark.parametrize("name", list(_with_or_without_empty_slots()))
def test_whether_a_tree_holds_an_empty_slot_is_what_a_walk_finds(name):
    tree, expected = _with_or_without_empty_slots()[name]
    walked = any(_slot.is_empty(x) for x in jtu.tree_leaves(tree, is_leaf=_slot.is_memo))
    leaves, treedef = jtu.tree_flatten(tree)
    assert _sites.holds_empty(tree, leaves, treedef) == walked == expected
