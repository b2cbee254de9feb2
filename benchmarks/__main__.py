"""`python -m benchmarks`: every scenario, or those `--only` names (see `_runner.py`)."""

import _runner


_runner.main()
