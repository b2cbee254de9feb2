import os

import jax
import pytest


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _no_tracer_leaks():
    # Every test runs with JAX's leak checker on: a tracer stored in a slot or any Python
    # object that outlives its trace fails the test. The checker also disables JAX's
    # cache of compiled primitives, so eager code compiles every op: MEMOX_CHECK_LEAKS=0
    # turns it off, for a nightly-size fuzzing run and CI's newest JAX (the oldest JAX
    # runs every suite with it).
    with jax.check_tracer_leaks(os.environ.get("MEMOX_CHECK_LEAKS", "1") != "0"):
        yield
