"""Sharded parameters: 8 CPU devices, in a subprocess (the device count is fixed when JAX
starts, so the child gets `XLA_FLAGS=--xla_force_host_platform_device_count=8` before it
imports JAX). The child runs every check once and reports JSON; the tests read it."""

import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same, call_in, run_on_devices, type_of
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import memox
from memox import Memo


CHILD = textwrap.dedent(
    r"""
    import json
    import re

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    from helpers import Traces  # (the child runs in tests/)
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import memox
    from memox import Memo

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")

    COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "reduce-scatter",
                   "all-to-all")


    def collectives(fn, *args):
        # Instructions `%name = type op(...)`, or `op-start(...)` where XLA made it async.
        text = jax.jit(fn).lower(*args).compile().as_text()
        counts, lines = {}, []
        for line in text.splitlines():
            for op in COLLECTIVES:
                if re.search(rf"\s{op}(-start)?\(", line):
                    counts[op] = counts.get(op, 0) + 1
                    lines.append(line.strip()[:200])
        return counts, lines


    class Layer(eqx.Module):
        w: jax.Array
        cache: Memo[jax.Array] = Memo()

        @memox.cached("cache")
        def normalised(self):
            return _normalised(self.w)


    class Scaled(eqx.Module):
        w: jax.Array
        cache: Memo[jax.Array] = Memo(size=2)

        @memox.cached("cache")
        def scaled(self, s):
            return self.w * s


    def _normalised(w):
        return w / jnp.linalg.norm(w, axis=1, keepdims=True)


    def apply(m, x):
        return memox.call(m, lambda m: m.normalised() @ x)


    W = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
    X = np.random.default_rng(1).normal(size=64).astype(np.float32)
    one = jax.devices()[0]
    REF_Y = np.asarray(jax.jit(lambda w, x: _normalised(w) @ x)(
        jax.device_put(W, one), jax.device_put(X, one)))
    REF_VALUE = np.asarray(jax.jit(_normalised)(jax.device_put(W, one)))


    def mesh_of(axis_type):
        return jax.make_mesh((8,), ("x",), axis_types=(getattr(AxisType, axis_type),))


    def jit_part(axis_type):
        mesh = mesh_of(axis_type)
        w = jax.device_put(W, NamedSharding(mesh, P("x", None)))  # rows over 8 devices
        x = jax.device_put(X, NamedSharding(mesh, P()))
        m = memox.init(Layer(w))
        step = jax.jit(apply)
        ys = []
        for _ in range(3):
            y, m = step(m, x)
            ys.append(np.asarray(y))
        value, m = jax.jit(lambda m: memox.call(m, Layer.normalised))(m)
        stats = memox.stats(m)["cache"]
        leaves = jax.tree.leaves(m)
        out = {
            "y_err": max(float(np.abs(y - REF_Y).max()) for y in ys),
            "value_err": float(np.abs(np.asarray(value) - REF_VALUE).max()),
            "counts": [int(stats.hits), int(stats.misses)],
            "value_sharding": repr(value.sharding.spec),
            "value_sharded_like_w": value.sharding.is_equivalent_to(w.sharding, 2),
            "leaves": [(list(l.shape), str(l.dtype), repr(l.sharding.spec)) for l in leaves],
            "module_bytes_per_device": sum(l.addressable_shards[0].data.nbytes for l in leaves),
        }
        out["hit"], out["hit_lines"] = collectives(apply, m, x)
        out["plain"], out["plain_lines"] = collectives(lambda w, x: _normalised(w) @ x, w, x)
        return out


    def shard_map_part(check_vma):
        mesh = mesh_of("Explicit")
        w = jax.device_put(W, NamedSharding(mesh, P("x", None)))
        x = jax.device_put(X, NamedSharding(mesh, P()))

        def body(w_local, x):
            layer = Layer(w_local)  # a module per shard, over its 8 rows
            y1, layer = apply(layer, x)
            y2, layer = apply(layer, x)
            stats = memox.stats(layer)["cache"]
            return y1, y2, jnp.stack([stats.hits, stats.misses])[None]

        run = jax.jit(jax.shard_map(
            body, mesh=mesh, in_specs=(P("x", None), P()), out_specs=P("x"),
            check_vma=check_vma))
        y1, y2, counts = run(w, x)
        return {
            "y_err": max(float(np.abs(np.asarray(y) - REF_Y).max()) for y in (y1, y2)),
            "counts": np.asarray(counts).tolist(),
        }


    def explicit_reshard(placement):
        # The same data resharded P('x', None) -> P(): sharding is part of the type on
        # an Explicit mesh, so the key changes (a miss) and the value has the new type.
        mesh = mesh_of("Explicit")
        run = {
            "eager": lambda m: memox.call(m, Layer.normalised),
            "memox.jit": memox.jit(Layer.normalised),
            "filter_jit": eqx.filter_jit(lambda m: memox.call(m, Layer.normalised)),
        }[placement]
        m = memox.init(Layer(jax.device_put(W, NamedSharding(mesh, P("x", None)))))
        specs = []
        for spec in (P("x", None), P(), P(), P("x", None)):
            m = eqx.tree_at(lambda m: m.w, m, jax.sharding.reshard(m.w, NamedSharding(mesh, spec)))
            value, m = run(m)
            want = jax.typeof(jax.jit(_normalised)(m.w))
            specs.append([str(jax.typeof(value)), str(want)])
        stats = memox.stats(m)["cache"]
        return {"types": specs, "counts": [int(stats.hits), int(stats.misses)],
                "value_err": float(np.abs(np.asarray(value) - REF_VALUE).max())}

    def first_call_keeps_types(axis_type):
        # `memox.init` allocates every table with the type and placement the first call
        # gives it: no retrace, no unusable donated buffer, the same `lax.scan` carry type.
        import contextlib
        import warnings

        mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(getattr(AxisType, axis_type),) * 2)
        out = {}
        # Explicit axes in `jax.set_mesh`, as a user of them writes; Auto axes without.
        context = jax.set_mesh(mesh) if axis_type == "Explicit" else contextlib.nullcontext()
        with context, warnings.catch_warnings():
            warnings.simplefilter("error")  # "Some donated buffers were not usable"
            w = jax.device_put(W[:16, :16], NamedSharding(mesh, P("x", None)))
            x = jax.device_put(X[:16], NamedSharding(mesh, P()))
            m = memox.init(Layer(w))
            types = lambda m: [str(jax.typeof(l)) for l in jax.tree.leaves(m.cache)]
            meshes = lambda m: [len(l.sharding.device_set) for l in jax.tree.leaves(m.cache)]
            out["types_init"], out["meshes_init"] = types(m), meshes(m)
            traces = Traces()

            def f(m, x):
                traces.tick()
                return m.normalised() @ x

            step, mm = memox.jit(f), m
            for _ in range(3):
                y, mm = step(mm, x)
            # A new dependency object: the first call's program again, on the slot as
            # filled (a type the fill changed would retrace it).
            y, mm = step(eqx.tree_at(lambda m: m.w, mm, mm.w * 1), x)
            out["memox_jit_traces"], out["types_after"] = traces.n, types(mm)
            jitted, mm = jax.jit(lambda m, x: memox.call(m, lambda m: f(m, x))), m
            traces.seen.clear()
            for _ in range(3):
                y, mm = jitted(mm, x)
            out["jax_jit_traces"] = traces.n

            def body(m, x):
                y, m = memox.call(m, lambda m: m.normalised() @ x)
                return m, y

            # A method with an argument: `memox.init(module, fn, *args)` allocates it.
            traces.seen.clear()
            scaled = memox.jit(lambda m, s: (traces.tick(), m.scaled(s))[1])
            keyed = memox.init(Scaled(w), Scaled.scaled, 2.0)
            out["keyed_types_init"] = [str(jax.typeof(l)) for l in jax.tree.leaves(keyed)]
            for _ in range(3):
                _, keyed = scaled(keyed, 2.0)
            _, keyed = scaled(eqx.tree_at(lambda m: m.w, keyed, keyed.w * 1), 2.0)
            out["keyed_types_after"] = [str(jax.typeof(l)) for l in jax.tree.leaves(keyed)]
            out["keyed_traces"] = traces.n
            mm, ys = jax.lax.scan(body, memox.init(Layer(w)), jnp.stack([x, x, x]))
            counts = memox.stats(mm)["cache"]
            out["scan_counts"] = [int(counts.hits), int(counts.misses)]
            out["y_err"] = float(np.abs(np.asarray(ys[-1]) - np.asarray(
                jax.jit(lambda w, x: _normalised(w) @ x)(W[:16, :16], X[:16]))).max())
        return out


    def checkpoint_part():
        # A model with sharded weights and a filled slot restores with the shardings the
        # target carries; the next call neither fails nor retraces (issue 19).
        import tempfile
        try:
            import orbax.checkpoint as ocp
        except ImportError:
            return {"skipped": "orbax-checkpoint is not installed"}
        mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
        out = {}
        with jax.set_mesh(mesh):
            w = jax.device_put(W[:16, :16], NamedSharding(mesh, P("x", None)))
            x = jax.device_put(X[:16], NamedSharding(mesh, P()))
            traces = Traces()

            def f(m, x):
                traces.tick()
                return m.normalised() @ x

            step = memox.jit(f)
            y, m = step(memox.init(Layer(w)), x)
            def same_shardings(a, b):
                pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
                return all(x.sharding.is_equivalent_to(y.sharding, x.ndim) for x, y in pairs)

            path = tempfile.mkdtemp()
            with ocp.StandardCheckpointer() as ck:
                ck.save(path + "/ckpt", m)
                ck.wait_until_finished()
                # On an Explicit mesh `jax.eval_shape` gives abstract meshes, which orbax
                # cannot place: the target's shardings come from the model's arrays.
                target = jax.tree.map(ocp.utils.to_shape_dtype_struct, m)
                restored = ck.restore(path + "/ckpt", target)
            out["orbax_shardings_kept"] = same_shardings(restored, m)
            y2, restored = step(restored, x)
            out["orbax_traces"] = traces.n
            out["orbax_counts"] = [int(memox.stats(restored)["cache"].hits),
                                   int(memox.stats(restored)["cache"].misses)]
            out["orbax_same"] = bool(np.array_equal(np.asarray(y2), np.asarray(y)))
            eqx.tree_serialise_leaves(path + "/m.eqx", m)
            like = memox.init(Layer(w))
            plain = eqx.tree_deserialise_leaves(path + "/m.eqx", like)
            out["eqx_default_shardings_kept"] = same_shardings(plain, m)

            def keep_sharding(f, x):  # as docs/howto/checkpoints.md shows
                y = eqx.default_deserialise_filter_spec(f, x)
                return jax.device_put(y, x.sharding) if isinstance(x, jax.Array) else y

            kept = eqx.tree_deserialise_leaves(path + "/m.eqx", like, filter_spec=keep_sharding)
            out["eqx_shardings_kept"] = same_shardings(kept, m)
            y3, kept = step(kept, x)
            out["eqx_traces"] = traces.n
            out["eqx_counts"] = [int(memox.stats(kept)["cache"].hits),
                                 int(memox.stats(kept)["cache"].misses)]
        return out

    results = {}
    parts = {
        "first_call_explicit": lambda: first_call_keeps_types("Explicit"),
        "first_call_auto": lambda: first_call_keeps_types("Auto"),
        "checkpoint": checkpoint_part,
        "reshard_eager": lambda: explicit_reshard("eager"),
        "reshard_memox_jit": lambda: explicit_reshard("memox.jit"),
        "reshard_filter_jit": lambda: explicit_reshard("filter_jit"),
        "jit_auto": lambda: jit_part("Auto"),
        "jit_explicit": lambda: jit_part("Explicit"),
        "shard_map": lambda: shard_map_part(True),
        "shard_map_unchecked": lambda: shard_map_part(False),
    }
    assert jax.device_count() == 8
    with jax.checking_leaks():
        for name, part in parts.items():
            try:
                results[name] = part()
            except Exception as e:
                results[name] = {"error": f"{type(e).__name__}: {e}"[:1000]}
    print("RESULT " + json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def child():
    return run_on_devices(CHILD, 8)


def _ok(part):
    assert "error" not in part, part["error"]
    return part


TOL = 1e-6  # sharded vs single-device float rounding


def test_results_equal_single_device(child):
    part = _ok(child["jit_auto"])
    assert part["y_err"] <= TOL and part["value_err"] <= TOL
    assert part["counts"] == [3, 1]  # 3 calls + 1 read: one miss


def test_cached_value_keeps_the_parameter_sharding(child):
    part = _ok(child["jit_auto"])
    # The hit value comes back sharded like `w` (rows over "x"): P('x', None).
    assert part["value_sharded_like_w"], part["value_sharding"]
    # Nothing is replicated: per device, the whole module (w, the slot's storage and its
    # small bookkeeping arrays) holds less than one full copy of the 64x64 value. (The
    # slot's storage is measured as a uint32[1, 64, 64] table sharded P(None, 'x').)
    assert part["module_bytes_per_device"] < 64 * 64 * 4, part["leaves"]


def test_collectives_of_the_hit_path(child):
    part = _ok(child["jit_auto"])
    # Row-wise normalisation of a row-sharded matrix needs no communication.
    assert part["plain"] == {}, part["plain_lines"]
    # The hit path adds exactly one collective: the fingerprint check sums each shard's
    # hashed words and combines them, an all-reduce of the two uint32 lanes (8 bytes).
    # Everything else (the stored value, the branch) stays on its shard. (At commit
    # 2e2ed1b the miss branch fingerprinted the dependency again when storing: two.)
    assert part["hit"] == {"all-reduce": 1}, part["hit_lines"]
    assert "(u32[], u32[]) all-reduce(" in part["hit_lines"][0]


# Regression guard: on a mesh with Explicit axes, the table allocated off the mesh must be
# resharded like the value before an entry is written (a ShardingTypeError before).
def test_explicit_mesh(child):
    part = _ok(child["jit_explicit"])
    assert part["y_err"] <= TOL and part["counts"] == [3, 1]


# Regression guard: resharding a dependency on an Explicit mesh (same data) raised "cond
# branches must have equal output types" under `memox.jit` and `eqx.filter_jit`, and
# eagerly a hit returned the old sharding, which is part of the type there.
@pytest.mark.parametrize("placement", ["eager", "memox_jit", "filter_jit"])
def test_explicit_mesh_reshard(child, placement):
    part = _ok(child[f"reshard_{placement}"])
    for got, want in part["types"]:
        assert got == want
    assert part["value_err"] <= TOL
    assert part["counts"] == [1, 3]  # P('x') fill, P() miss, P() hit, P('x') miss


# Regression guard: inside `jax.shard_map` with `check_vma`, a hit passes the slot through
# unvarying while a miss writes varying values; the slot is cast to vary first (a
# `lax.cond` type error before).
def test_shard_map_per_shard_module(child):
    part = _ok(child["shard_map"])
    assert part["y_err"] <= TOL and part["counts"] == [[1, 1]] * 8


def test_shard_map_per_shard_module_without_vma_checks(child):
    part = _ok(child["shard_map_unchecked"])
    assert part["y_err"] <= TOL
    assert part["counts"] == [[1, 1]] * 8  # each shard: one miss, then one hit


# Regression guard (issue 19): on an Explicit mesh `memox.init` allocated an unsharded
# table that the first call resharded, so the slot's type changed: `memox.jit` traced
# twice and warned "Some donated buffers were not usable", and a `lax.scan` whose carry
# came from `memox.init` failed. Tables are now global arrays over the module's mesh.
@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_first_call_keeps_the_slot_types_memox_init_gives(child, axis_type):
    part = _ok(child[f"first_call_{axis_type}"])
    assert part["types_after"] == part["types_init"]
    assert set(part["meshes_init"]) == {8}  # every leaf a global array over the mesh
    if axis_type == "explicit":  # the table is sharded like the value: rows over "x"
        assert part["types_init"][0] == "uint32[1,16@x,16]", part["types_init"]
    # `memox.jit`: the first call's program, and the one for the hits decided on the
    # host (a type changed by the first fill would add a third).
    assert part["memox_jit_traces"] == 2 and part["jax_jit_traces"] == 1
    assert part["keyed_types_after"] == part["keyed_types_init"]
    assert part["keyed_traces"] == 2
    assert part["scan_counts"] == [2, 1] and part["y_err"] <= TOL


# Regression guard (issue 19): a restored model must keep its weights' and slots'
# shardings, hit, and not retrace the step compiled before the checkpoint.
def test_checkpoint_restores_shardings_and_hits(child):
    part = _ok(child["checkpoint"])
    if "skipped" in part:
        pytest.skip(part["skipped"])
    assert part["orbax_shardings_kept"]
    assert part["orbax_same"] and part["orbax_traces"] == 1
    assert part["orbax_counts"] == [1, 1]
    # `eqx.tree_deserialise_leaves` loads single-device arrays (its default `jnp.load`);
    # a filter spec that puts each leaf where `like`'s is keeps them.
    assert not part["eqx_default_shardings_kept"]
    assert part["eqx_shardings_kept"] and part["eqx_traces"] == 1
    assert part["eqx_counts"] == [1, 1]


# -- one device, in this process: a slot's table takes the type its value gives it ------


class _Doubled(eqx.Module):
    x: jax.Array
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def out(self):
        return self.x * 2.0


def _one_device_mesh():
    return jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,))


def test_init_reallocates_a_slot_whose_value_is_resharded():
    # Issue 31: `memox.init` kept a replicated table when the value became sharded, and
    # a scan over the module then failed on its carry's type.
    mesh = _one_device_mesh()
    with jax.set_mesh(mesh):
        replicated = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P()))
        split = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("x")))
        _, module = memox.call(memox.init(_Doubled(replicated)), _Doubled.out)
        module = memox.init(eqx.tree_at(lambda m: m.x, module, split), _Doubled.out)
        assert jax.typeof(module.cache.value).sharding.spec == P(None, "x")

        def step(module, _):
            value, module = memox.call(module, _Doubled.out)
            return module, value

        module, values = jax.lax.scan(step, module, length=2)
        assert type_of(values[0]) == type_of(split * 2.0)
        np.testing.assert_array_equal(values, np.stack([np.arange(4.0) * 2] * 2))
        assert int(module.cache.misses) == 2  # the resharded value: one miss in the loop


@pytest.mark.parametrize("placement", ["eager", "memox.jit", "jax.jit"])
def test_a_slot_filled_on_a_mesh_returns_an_unsharded_value_off_it(placement):
    # Issue 31: called off the mesh, the miss returned the value with the table's
    # sharding (`float32[4@x]`) where the method returns `float32[4]`.
    mesh = _one_device_mesh()
    with jax.set_mesh(mesh):
        split = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("x")))
        _, module = memox.call(memox.init(_Doubled(split)), _Doubled.out)
    module = eqx.tree_at(lambda m: m.x, module, jnp.arange(4.0) + 1)
    value, module = call_in(placement, module, _Doubled.out)
    expected = (jnp.arange(4.0) + 1) * 2.0
    assert_same(value, expected)  # (replicated on the mesh, as JAX joins the two)
    again, _ = call_in(placement, module, _Doubled.out)
    assert_same(again, expected)
    assert int(memox.stats(module)["cache"].misses) == 2
