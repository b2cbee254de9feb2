import jax
import pytest


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _no_tracer_leaks():
    # Every test runs with JAX's leak checker on: a tracer stored in a slot or any Python
    # object that outlives its trace fails the test.
    with jax.checking_leaks():
        yield
