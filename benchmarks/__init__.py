"""memox's benchmarks: `python -m benchmarks [--quick]`. See benchmarks/README.md."""

import os
import pathlib
import sys


# jaxlib's CPU LAPACK kernels (eigh, cholesky, lu) run on scipy's OpenBLAS. Left to its
# default thread count it competes with XLA's own thread pool: on a 2-core machine the
# same eigh then takes 3 ms or 800 ms from one process to the next. One OpenBLAS thread
# is both stable and faster here (README.md, "Environment"). A value set by the caller
# wins; it only has an effect before NumPy/SciPy/JAX are first imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# s9's stiff problems are the tests' (`tests/stiff_problems.py`, `import stiff_problems`
# as the tests do); appended, so that nothing in tests/ shadows an installed module.
sys.path.append(str(pathlib.Path(__file__).parents[1] / "tests"))
