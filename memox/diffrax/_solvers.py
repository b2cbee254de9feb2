"""The diffrax solvers `ReuseJacobian` wraps, and the Newton matrix of their stage
equations."""

import diffrax
import lineax as lx
import numpy as np
import optimistix as optx


_UNSUPPORTED_SOLVER = (
    "`memox.diffrax.ReuseJacobian` supports `diffrax.ImplicitEuler` and the diagonally "
    "implicit Runge--Kutta solvers with one tableau and one nonzero diagonal "
    "coefficient (`diffrax.Kvaerno3`, `Kvaerno4`, `Kvaerno5`); got `{name}`. {why}"
)
_UNSUPPORTED_ROOT_FINDER = (
    "`memox.diffrax.ReuseJacobian`: the wrapped solver's `root_finder` must be a chord "
    "method (`diffrax.VeryChord` or `optimistix.Chord`, the defaults), whose Newton "
    "matrix is fixed during a root find; got `{name}`. Keep the solver's default "
    "`root_finder`."
)
_UNSUPPORTED_LINEAR_SOLVER = (
    "`memox.diffrax.ReuseJacobian`: the root finder's `linear_solver` must factorise "
    "the Newton matrix once and solve with the factors later (`lineax.AutoLinearSolver`, "
    "`LU`, `QR` or `SVD`); got `{name}`."
)
_FACTORISING = (lx.AutoLinearSolver, lx.LU, lx.QR, lx.SVD)


def check_supported(solver) -> None:
    """Raises, saying what to do, unless `ReuseJacobian` can wrap `solver`."""
    newton_form(solver)
    rf = solver.root_finder
    if not isinstance(rf, (optx.Chord, diffrax.VeryChord)):
        raise TypeError(_UNSUPPORTED_ROOT_FINDER.format(name=type(rf).__name__))
    if not isinstance(rf.linear_solver, _FACTORISING):
        name = type(rf.linear_solver).__name__
        raise TypeError(_UNSUPPORTED_LINEAR_SOLVER.format(name=name))


def chord(solver) -> optx.Chord | diffrax.VeryChord:
    return solver.root_finder  # checked by `check_supported`


def newton_form(solver) -> tuple[float, float, tuple[int, ...]]:
    """`(γ, sign, explicit stages)`: the stage equations of `solver` have Newton matrix
    `sign * (I - γh J)`, except at its explicit stages (the identity)."""
    name = type(solver).__name__
    if isinstance(solver, diffrax.AbstractWrappedSolver):  # `isinstance` sees through it
        why = "Wrap the implicit solver itself, not a wrapper around it."
        raise TypeError(_UNSUPPORTED_SOLVER.format(name=name, why=why))
    if isinstance(solver, diffrax.ImplicitEuler):
        return 1.0, -1.0, ()  # the root of `f(t1, y0 + z) h - z`: Jacobian `-(I - hJ)`
    if not isinstance(solver, diffrax.AbstractRungeKutta):
        raise TypeError(_UNSUPPORTED_SOLVER.format(name=name, why="It is not one of them."))
    tableau = solver.tableau
    if not isinstance(tableau, diffrax.ButcherTableau):
        why = "It has several tableaus (an IMEX method)."
        raise TypeError(_UNSUPPORTED_SOLVER.format(name=name, why=why))
    if tableau.a_diagonal is None:
        why = "It is explicit: it factorises nothing."
        raise TypeError(_UNSUPPORTED_SOLVER.format(name=name, why=why))
    diagonal = np.asarray(tableau.a_diagonal)
    values = set(diagonal[diagonal != 0].tolist())
    if len(values) != 1:
        why = f"Its diagonal coefficients {diagonal.tolist()} differ between stages."
        raise TypeError(_UNSUPPORTED_SOLVER.format(name=name, why=why))
    explicit = tuple(int(i) for i in np.flatnonzero(diagonal == 0))
    return float(values.pop()), 1.0, explicit  # `k - f(yp + γ k) h`: `I - γhJ`
