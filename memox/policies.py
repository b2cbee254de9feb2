"""Reuse policies for `memox.cached(..., policy=...)`: see `memox/_policy.py`."""

from ._policy import Drift as Drift, Exact as Exact, Manual as Manual, Policy as Policy
