"""Checkpoints as users write them (issue 19): a memox model saves and restores with
orbax's `StandardCheckpointer` and `CheckpointManager` and with `eqx.tree_serialise_leaves`,
slots filled, allocated or empty, with no filter of the user's own. Saving `model` keeps
the caches (restored, they hit); saving `memox.strip(model)` drops them (recomputed on
first use). Shardings: tests/test_sharding.py."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter

import memox
from memox import Memo
from memox.policies import Drift


ocp = pytest.importorskip(
    "orbax.checkpoint",
    reason="orbax-checkpoint is not installed (`pip install memox[checkpoint]`)",
)


class Model(eqx.Module):
    w: jax.Array
    counter: Counter = eqx.field(static=True)
    gram_cache: Memo[jax.Array] = Memo()  # Exact: no snapshot table
    scaled_cache: Memo[jax.Array] = Memo(size=2)  # a keyed table, for an argument
    drift_cache: Memo[jax.Array] = Memo()  # Drift: keeps a snapshot of `w`

    @memox.cached("gram_cache")
    def gram(self):
        self.counter.tick()
        return self.w @ self.w.T

    @memox.cached("scaled_cache")
    def scaled(self, s):
        self.counter.tick()
        return self.w * s

    @memox.cached("drift_cache", policy=Drift(rtol=0.1))
    def norm(self):
        self.counter.tick()
        return jnp.linalg.norm(self.w)


def _use(m):
    return m.gram().sum() + m.scaled(2.0).sum() + m.norm()


def _model(counter):
    return Model(jnp.arange(12.0).reshape(3, 4) / 10, counter)


def _filled(counter):
    y, m = memox.call(_model(counter), _use)
    return y, m


def _slots(tree):
    is_slot = lambda x: isinstance(x, Memo)  # noqa: E731
    return [x for x in jax.tree.leaves(tree, is_leaf=is_slot) if is_slot(x)]


def _checkpointer():
    return ocp.StandardCheckpointer()


def _save(path, tree):
    with _checkpointer() as ck:
        ck.save(path, tree)
        ck.wait_until_finished()


def _restore(path, target):
    with _checkpointer() as ck:
        return ck.restore(path, target)


# Regression guard: orbax refused every memox model ("Cannot save arrays with zero size"
# for the `(K, 0)` snapshot table; "Unsupported type: EmptySlot" for an empty slot).
@pytest.mark.parametrize("target", ["eval_shape", "model"])
def test_saved_model_restores_its_caches_and_hits(tmp_path, target):
    c = Counter()
    y, m = _filled(c)
    assert c.n == 3
    _save(tmp_path / "ckpt", m)
    like = jax.eval_shape(lambda: m) if target == "eval_shape" else m
    restored = _restore(tmp_path / "ckpt", like)
    assert memox.stats(restored) == memox.stats(m)  # counters restored
    y2, restored = memox.call(restored, _use)
    jax.effects_barrier()
    assert c.n == 3  # every cached method hits: nothing recomputed
    np.testing.assert_array_equal(y2, y)
    assert memox.stats(restored)["gram_cache"] == memox.SlotStats(hits=1, misses=1)


def test_stripped_model_restores_without_caches_and_recomputes(tmp_path):
    c = Counter()
    y, m = _filled(c)
    _save(tmp_path / "full", m)
    _save(tmp_path / "bare", memox.strip(m))
    size = lambda p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file())  # noqa: E731
    assert size(tmp_path / "bare") < size(tmp_path / "full")
    restored = _restore(tmp_path / "bare", memox.strip(_model(c)))
    assert not any(slot.allocated for slot in _slots(restored))
    # `w`: a stripped model has no slot arrays (its slots hold the empty marker).
    assert len([x for x in jax.tree.leaves(restored) if eqx.is_array(x)]) == 1
    np.testing.assert_array_equal(restored.w, m.w)
    y2, restored = memox.call(restored, _use)
    jax.effects_barrier()
    assert c.n == 6  # recomputed on first use
    np.testing.assert_array_equal(y2, y)


@pytest.mark.parametrize("state", ["empty", "allocated"])
def test_model_with_unfilled_slots_saves_and_restores(tmp_path, state):
    c = Counter()
    m = _model(c) if state == "empty" else memox.init(_model(c), _use)
    _save(tmp_path / "ckpt", m)
    restored = _restore(tmp_path / "ckpt", jax.eval_shape(lambda: m))
    assert jax.tree.structure(restored) == jax.tree.structure(m)
    y, restored = memox.call(restored, _use)
    jax.effects_barrier()
    assert c.n == 3
    np.testing.assert_array_equal(y, _use(_model(Counter())))


def test_checkpoint_manager_loop(tmp_path):
    # The loop users write: save every step, restore the latest into an abstract target.
    c = Counter()
    m = memox.init(_model(c), _use)
    step = memox.jit(_use)
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(tmp_path / "run", options=options) as mngr:
        for i in range(3):
            _, m = step(m)
            m = eqx.tree_at(lambda m: m.w, m, m.w + 1.0)  # a "training" update
            mngr.save(i, args=ocp.args.StandardSave(m))
        mngr.wait_until_finished()
        target = jax.eval_shape(lambda: m)
        restored = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(target))
    assert memox.stats(restored) == memox.stats(m)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(m)):
        np.testing.assert_array_equal(a, b)
    # The slots hold the values for the weights before the last update: a miss each.
    _, restored = step(restored)
    assert memox.stats(restored)["gram_cache"] == memox.SlotStats(hits=0, misses=4)


def test_tree_serialise_leaves_round_trips(tmp_path):
    c = Counter()
    y, m = _filled(c)
    eqx.tree_serialise_leaves(tmp_path / "full.eqx", m)
    eqx.tree_serialise_leaves(tmp_path / "bare.eqx", memox.strip(m))
    restored = eqx.tree_deserialise_leaves(tmp_path / "full.eqx", m)
    y2, _ = memox.call(restored, _use)
    jax.effects_barrier()
    assert c.n == 3
    bare = eqx.tree_deserialise_leaves(tmp_path / "bare.eqx", memox.strip(_model(c)))
    y3, _ = memox.call(bare, _use)
    jax.effects_barrier()
    assert c.n == 6
    np.testing.assert_array_equal(y2, y)
    np.testing.assert_array_equal(y3, y)
