"""memox's benchmarks: `python -m benchmarks [--quick]`, or one scenario as a script,
`python benchmarks/s1_frozen_training.py [--quick]`. See benchmarks/README.md."""

import pathlib
import sys


# The scenarios import `_common` and each other by file name, as a script run from this
# folder does; appended, so that nothing here shadows an installed module.
sys.path.append(str(pathlib.Path(__file__).parent))
