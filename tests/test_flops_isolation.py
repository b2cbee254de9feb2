"""Counting FLOPs has no global side effect on JAX.

Regression test for issue 11: memox registered rules into `jax.experimental.roofline`'s
global table at import, which changed roofline's numbers for every other user in the
process (569 343 -> 660 820 FLOPs in one test), and an import of a primitive missing
from the installed JAX made `import memox` fail. Each check runs in a fresh subprocess,
so that it does not depend on what this test session imported before.
"""

import json
import subprocess
import sys
import textwrap


_MEASURE = textwrap.dedent(
    """
    import importlib, json, sys

    import jax
    import jax.numpy as jnp


    def f(a):
        k = a @ a.T + 8.0 * jnp.eye(a.shape[0], dtype=a.dtype)
        return jnp.tanh(jax.lax.linalg.cholesky(k)).sum()


    x = jax.ShapeDtypeStruct((8, 8), jnp.float32)


    def roofline_numbers():
        from jax.experimental import roofline

        _, result = roofline.roofline(f)(x)
        return {"flops": int(result.flops), "unfused_flops": int(result.unfused_flops)}


    def roofline_table():
        # The submodule, not the function `jax.experimental.roofline.roofline` it shadows.
        module = importlib.import_module("jax.experimental.roofline.roofline")
        return dict(getattr(module, "_rooflines", {}))


    def use_memox():
        import memox
        import memox._flops

        return memox._flops.flops(f, x).flops
    """
)

_ROOFLINE_THEN_MEMOX = _MEASURE + textwrap.dedent(
    """
    before = roofline_numbers()
    table = roofline_table()
    memox_flops = use_memox()
    after = roofline_numbers()
    table_after = roofline_table()
    print(json.dumps({
        "before": before,
        "after": after,
        "memox_flops": memox_flops,
        "rules": len(table),
        "same_keys": table.keys() == table_after.keys(),
        "same_rules": all(table_after[p] is rule for p, rule in table.items()),
    }))
    """
)

_MEMOX_THEN_ROOFLINE = _MEASURE + textwrap.dedent(
    """
    memox_flops = use_memox()
    roofline_imported = "jax.experimental.roofline" in sys.modules
    print(json.dumps({
        "roofline_imported_by_memox": roofline_imported,
        "memox_flops": memox_flops,
        "numbers": roofline_numbers(),
    }))
    """
)


def _run(script: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_roofline_is_untouched_by_memox():
    first = _run(_ROOFLINE_THEN_MEMOX)
    assert first["before"] == first["after"]
    assert first["rules"] > 0
    assert first["same_keys"] and first["same_rules"]
    # Importing memox first gives roofline the same numbers too.
    second = _run(_MEMOX_THEN_ROOFLINE)
    assert second["numbers"] == first["before"]
    assert second["memox_flops"] == first["memox_flops"]
    # memox prices primitives itself: importing and counting leave
    # `jax.experimental.roofline` (and the absl-py it needs on jax 0.10) unimported.
    assert second["roofline_imported_by_memox"] is False
