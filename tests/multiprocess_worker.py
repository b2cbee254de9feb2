"""One process of a 2-process run on localhost (`tests/test_multiprocess.py`).

    python tests/multiprocess_worker.py PORT PROCESS_ID OUT_DIR [--policy exact|drift]
        [--steps N]

Each process holds 2 CPU devices; the model's weights are sharded over a mesh of the 4
global devices. The run trains a model with a frozen cached part (`basis`, from weights
no optimizer touches) and a trained one (`gram`, from the trained weights) with a
`memox.jit` step and optax's adam, and the same steps unmemoized; then writes what it
saw to `OUT_DIR/<process id>.npz`: every array of both trained models and of the
memoized model's slots (gathered: the global values), the losses, and the slot
statistics. The test compares the files of both processes, and each run with the
unmemoized one.

With `--save-at K --checkpoint DIR` the run saves the memoized model and optimizer
state with orbax after K steps (both processes) and goes on; with `--restore` too, fresh
processes restore them and run the steps left (memoized only): the test compares their
result with the uninterrupted run's.
"""

import argparse
import os
import sys


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("process_id", type=int)
    parser.add_argument("out")
    parser.add_argument("--policy", default="exact", choices=["exact", "drift", "mixed"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=None, help="checkpoint after k steps")
    parser.add_argument("--restore", action="store_true", help="from the checkpoint")
    parser.add_argument("--checkpoint", default=None, help="the checkpoint's directory")
    return parser.parse_args()


ARGS = _parse()
os.environ["XLA_FLAGS"] = (  # before JAX starts
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import memox  # noqa: E402
from memox import Memo  # noqa: E402


try:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
except Exception:  # a JAX where gloo is the only (and default) implementation
    pass
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{ARGS.port}",
    num_processes=2,
    process_id=ARGS.process_id,
    initialization_timeout=60,
)
DRIFT, EXACT = memox.policies.Drift(rtol=1e-3), memox.policies.Exact()
FROZEN_POLICY = DRIFT if ARGS.policy in ("drift", "mixed") else EXACT
TRAINED_POLICY = DRIFT if ARGS.policy == "drift" else EXACT


def _scale(x):
    return x * 0.5  # a local function: encoded by its code (the same in every process)


class Net(eqx.Module):
    embed: jax.Array  # frozen
    w: jax.Array  # trained
    act: object = eqx.field(static=True)  # a lambda: encoded by its code
    rows: NamedSharding = eqx.field(static=True)  # by its pickle reduction
    frozen: Memo[jax.Array] = Memo()
    trained: Memo[jax.Array] = Memo()

    @memox.cached("frozen", policy=FROZEN_POLICY)
    def basis(self):
        return jax.lax.with_sharding_constraint(jnp.tanh(self.embed @ self.embed.T), self.rows)

    @memox.cached("trained", policy=TRAINED_POLICY)
    def gram(self):
        return self.w.T @ self.w

    def __call__(self, x):
        h = self.act(x @ self.basis() @ self.w)
        return h @ self.gram()


def _trained_only(model):
    spec = jax.tree.map(lambda _: False, model)
    return eqx.tree_at(lambda m: m.w, spec, True)


OPTIM = optax.adam(1e-2)


def _loss(diff, static, x, y):
    model = eqx.combine(diff, static)
    return jnp.mean((model(x) - y) ** 2)


def _step(model, opt_state, x, y):
    diff, static = eqx.partition(model, _trained_only(model))
    value, grads = eqx.filter_value_and_grad(_loss)(diff, static, x, y)
    updates, opt_state = OPTIM.update(grads, opt_state, diff)
    return eqx.apply_updates(diff, updates), opt_state, value


def build():
    """The model, sharded over the 4 global devices, its optimizer state and a batch."""
    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    rows, replicated = NamedSharding(mesh, P("x", None)), NamedSharding(mesh, P())
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    embed = jax.device_put(jax.random.normal(k1, (8, 8)) / 3, rows)
    w = jax.device_put(jax.random.normal(k2, (8, 4)) / 3, rows)
    x = jax.device_put(jax.random.normal(k3, (16, 8)), rows)
    y = jax.device_put(jnp.sin(jnp.arange(64.0)).reshape(16, 4), replicated)
    model = memox.init(Net(embed, w, lambda h: _scale(jnp.tanh(h)), rows))
    opt_state = OPTIM.init(eqx.filter(model, _trained_only(model)))
    return {"model": model, "opt_state": opt_state, "x": x, "y": y}


STEP = memox.jit(_step)


def train(state, steps, reference=True):
    """`steps` memoized steps (a `memox.jit` step) and the same steps unmemoized."""
    model, opt_state, losses = state["model"], state["opt_state"], []
    for _ in range(steps):
        (diff, opt_state, value), model = STEP(model, opt_state, state["x"], state["y"])
        model = eqx.combine(diff, model)
        losses.append(value)
    if not reference:
        return {**state, "model": model, "opt_state": opt_state, "losses": losses}
    plain = eqx.filter_jit(_plain_step)
    reference, ref_state, ref_losses = state["reference"], state["ref_opt_state"], []
    for _ in range(steps):
        reference, ref_state, value = plain(reference, ref_state, state["x"], state["y"])
        ref_losses.append(value)
    return {
        **state,
        "model": model,
        "opt_state": opt_state,
        "losses": state.get("losses", []) + losses,
        "reference": reference,
        "ref_opt_state": ref_state,
        "ref_losses": state.get("ref_losses", []) + ref_losses,
    }


def save(state, path):
    """The memoized model (its slots with it) and the optimizer state, by orbax."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, {"model": state["model"], "opt_state": state["opt_state"]})
    checkpointer.wait_until_finished()


def restore(state, path):
    """`state` with the model and optimizer state saved at `path` (in other processes)."""
    import orbax.checkpoint as ocp

    replicated = NamedSharding(state["y"].sharding.mesh, P())

    def abstract(x):  # (a single-device leaf, optax's step count, is restored replicated)
        sharding = x.sharding if len(x.sharding.device_set) > 1 else replicated
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    target = {"model": state["model"], "opt_state": state["opt_state"]}
    target = jax.tree.map(abstract, eqx.filter(target, eqx.is_array))
    restored = ocp.StandardCheckpointer().restore(path, target)
    return {**state, **eqx.combine(restored, {k: state[k] for k in ("model", "opt_state")})}


def _plain_step(model, opt_state, x, y):
    """`_step` on a model whose cached methods compute plainly (no `memox.call`)."""
    diff, opt_state, value = _step(model, opt_state, x, y)
    return eqx.combine(diff, model), opt_state, value


def _gathered(x):
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def dump(state, out):
    """Everything the test compares, gathered to global values, in one file."""
    arrays = {}
    for name in ("model", "reference"):  # the parameters (slot leaves are not inexact)
        if name not in state:
            continue
        for i, leaf in enumerate(jax.tree.leaves(eqx.filter(state[name], eqx.is_inexact_array))):
            arrays[f"{name}.{i}"] = _gathered(leaf)
    is_memo = memox.internal.is_memo
    slots = [x for x in jax.tree.leaves(state["model"], is_leaf=is_memo) if is_memo(x)]
    for i, leaf in enumerate(jax.tree.leaves(slots)):
        arrays[f"slots.{i}"] = _gathered(leaf)  # the keys among them
    for name in ("losses", "ref_losses"):
        if name not in state:
            continue
        arrays[name] = np.stack([_gathered(v) for v in state[name]])
    for slot, stats in memox.stats(state["model"]).items():
        arrays[f"stats.{slot}"] = np.array([int(stats.hits), int(stats.misses)])
    np.savez(os.path.join(out, f"{jax.process_index()}.npz"), **arrays)


def main():
    state = build()
    if ARGS.restore:  # fresh processes: restore, then the steps left
        state = restore(state, ARGS.checkpoint)
        state = train(state, ARGS.steps - ARGS.save_at, reference=False)
    elif ARGS.save_at is not None:  # checkpoint after `save_at` steps, and go on
        state["reference"], state["ref_opt_state"] = state["model"], state["opt_state"]
        state = train(state, ARGS.save_at)
        save(state, ARGS.checkpoint)
        state = train(state, ARGS.steps - ARGS.save_at)
    else:
        state["reference"], state["ref_opt_state"] = state["model"], state["opt_state"]
        state = train(state, ARGS.steps)
    dump(state, ARGS.out)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
    sys.exit(0)
