"""Jacobian and LU reuse across the steps of diffrax's implicit solvers, as CVODE does.

diffrax's implicit solvers (`ImplicitEuler`, `Kvaerno3/4/5`) solve each step's stage
equations with a chord method whose `init` evaluates a Jacobian and LU-factorises the
Newton matrix: at least one Jacobian and one factorisation per step, none kept across
steps. `ReuseJacobian(solver)` keeps the factorisation in the solver state and reuses it
in later steps until CVODE's conditions ask for a fresh one.

How it plugs in (diffrax's public extension points only): the wrapper is an
`AbstractWrappedSolver` whose solver state carries the factorisation; its `step` runs the
wrapped solver with its `root_finder` replaced by `_chord.StoredChord`, an optimistix root
finder that iterates with the stored factors instead of linearising in `init`.

`import memox` does not import this package (nor diffrax): `import memox.diffrax`.
"""

try:  # an optional extra (diffrax needs lineax and optimistix): say how to install it
    import diffrax as _diffrax  # noqa: F401
except ImportError as _error:
    raise ImportError(
        "`memox.diffrax` needs diffrax (and its dependencies optimistix and lineax), which "
        'is not installed. Install it with `pip install "memox[diffrax]"`.'
    ) from _error

from ._chord import FixedVeryChord as FixedVeryChord
from ._reuse import ReuseJacobian as ReuseJacobian, ReuseState as ReuseState
