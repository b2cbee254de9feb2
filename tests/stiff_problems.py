"""Stiff test problems and baselines for diffrax's implicit solvers, in one place.

Used by `tests/test_diffrax.py`, `examples/diffrax_stiff.py` and benchmark s9
(`benchmarks/s9_diffrax.py`), all as `import stiff_problems`: it lives in tests/, which
the sdist ships (examples/ and benchmarks/ are not shipped, and add tests/ to
`sys.path`):

- `CLASSICS`: Robertson (t in [0, 1e5]), Van der Pol with mu = 1000 (Hairer's scaling,
  eps = 1 / mu^2, t in [0, 2]) and HIRES (t in [0, 321.8122]), each with its
  tolerances and y(t1) by scipy's Radau at rtol 1e-12;
- `brusselator(n)`: the 2-D Brusselator reaction-diffusion problem (SciML's benchmark
  form: alpha = 10, periodic boundaries, forcing switched on at t = 1.1) on an n x n
  grid, 2 n^2 unknowns;
- `CountingLU`: `lineax.LU` counting its factorisations as they execute;
- `kvaerno(order, chord)`: `diffrax.Kvaerno{order}` with root finder `chord`, such as
  `memox.diffrax.FixedVeryChord`, the unwrapped baseline for what reuse saves.

Not a script; float64 is the caller's choice (`jax.config.update("jax_enable_x64",
True)` or `jax.enable_x64`): at rtol 1e-6 these problems need it.
"""

import collections
from typing import NamedTuple

import diffrax
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np


COUNTS = collections.Counter()  # executions, by `CountingLU`


class CountingLU(lx.LU):
    """`lineax.LU` (what diffrax's default `AutoLinearSolver` picks for these problems),
    counting its factorisations in `COUNTS["lu"]` as they execute."""

    def init(self, operator, options):
        jax.debug.callback(lambda: COUNTS.update(["lu"]))
        return super().init(operator, options)


def kvaerno(order: int = 5, chord=diffrax.VeryChord, counting: bool = True):
    """`diffrax.Kvaerno{order}` (3, 4 or 5) with root finder `chord` (tolerances from the
    step-size controller, as diffrax's default), counting its factorisations if
    `counting`."""
    tols = diffrax.with_stepsize_controller_tols(chord)
    root_finder = tols(linear_solver=CountingLU()) if counting else tols()
    return getattr(diffrax, f"Kvaerno{order}")(root_finder=root_finder)


def robertson(t, y, args):
    k1, k2, k3 = args
    y1, y2, y3 = y
    return jnp.stack([-k1 * y1 + k3 * y2 * y3, k1 * y1 - k3 * y2 * y3 - k2 * y2**2, k2 * y2**2])


def van_der_pol(t, y, args):
    (eps,) = args
    return jnp.stack([y[1], ((1 - y[0] ** 2) * y[1] - y[0]) / eps])


def hires(t, y, args):
    y1, y2, y3, y4, y5, y6, y7, y8 = y
    return jnp.stack(
        [
            -1.71 * y1 + 0.43 * y2 + 8.32 * y3 + 0.0007,
            1.71 * y1 - 8.75 * y2,
            -10.03 * y3 + 0.43 * y4 + 0.035 * y5,
            8.32 * y2 + 1.71 * y3 - 1.12 * y4,
            -1.745 * y5 + 0.43 * y6 + 0.43 * y7,
            -280.0 * y6 * y8 + 0.69 * y4 + 1.71 * y5 - 0.43 * y6 + 0.69 * y7,
            280.0 * y6 * y8 - 1.81 * y7,
            -280.0 * y6 * y8 + 1.81 * y7,
        ]
    )


class Problem(NamedTuple):
    vector_field: object
    args: tuple
    t1: float
    y0: list
    rtol: float
    atol: float
    reference: list  # y(t1), scipy Radau at rtol 1e-12


CLASSICS = {
    "robertson": Problem(
        robertson,
        (0.04, 3e7, 1e4),
        1e5,
        [1.0, 0.0, 0.0],
        1e-6,
        1e-10,
        [1.7865921142277624e-02, 7.2747514685101908e-08, 9.8213400611020429e-01],
    ),
    "van_der_pol": Problem(
        van_der_pol,
        (1e-6,),
        2.0,
        [2.0, 0.0],
        1e-6,
        1e-8,
        [1.7061677321704154, -0.8928097010248699],
    ),
    "hires": Problem(
        hires,
        (),
        321.8122,
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0057],
        1e-6,
        1e-10,
        # The IVP test set's reference (Hairer & Wanner) agrees to 10 digits.
        [
            7.3713125733253205e-04,
            1.4424857263161162e-04,
            5.8887297409669355e-05,
            1.1756513432830840e-03,
            2.3863561988303125e-03,
            6.2389682527396522e-03,
            2.8499983951850326e-03,
            2.8500016048149694e-03,
        ],
    ),
}


def brusselator(n: int):
    """The 2-D Brusselator on an n x n periodic grid: `(vector field, y0)`."""
    x = np.linspace(0.0, 1.0, n, endpoint=False)
    X, Y = np.meshgrid(x, x, indexing="ij")
    spot = jnp.asarray(((X - 0.3) ** 2 + (Y - 0.6) ** 2) <= 0.1**2)
    alpha = 10.0

    def laplacian(w):
        rolled = jnp.roll(w, 1, 0) + jnp.roll(w, -1, 0) + jnp.roll(w, 1, 1) + jnp.roll(w, -1, 1)
        return (rolled - 4 * w) * (n * n)

    def vector_field(t, y, args):
        u, v = y[: n * n].reshape(n, n), y[n * n :].reshape(n, n)
        forcing = jnp.where(spot & (t >= 1.1), 5.0, 0.0)
        du = 1 + u * u * v - 4.4 * u + alpha * laplacian(u) + forcing
        dv = 3.4 * u - u * u * v + alpha * laplacian(v)
        return jnp.concatenate([du.ravel(), dv.ravel()])

    y0 = np.concatenate([(22 * Y * (1 - Y) ** 1.5).ravel(), (27 * X * (1 - X) ** 1.5).ravel()])
    return vector_field, y0


def relative_error(y, reference, rtol: float, atol: float) -> float:
    """max over components of `|y - ref| / (|ref| + atol / rtol)`."""
    reference = np.asarray(reference)
    return float(np.max(np.abs(np.asarray(y) - reference) / (np.abs(reference) + atol / rtol)))
