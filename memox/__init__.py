"""memox: caches for expensive derived values of Equinox modules that survive `jax.jit`,
`lax.scan` and `jax.grad` — never stale, never changing the pytree structure."""

import importlib.metadata

from . import _jax_internals, internal as internal, policies as policies
from ._cached import CachedMethod as CachedMethod, cached as cached
from ._caches import clear_caches as clear_caches
from ._call import call as call
from ._errors import UncachedWarning as UncachedWarning
from ._filter_jit import filter_jit as filter_jit
from ._flops import FlopCount as FlopCount, flops as flops
from ._hoist import hoist as hoist
from ._jit import jit as jit
from ._lifecycle import clear as clear, init as init, invalidate as invalidate, strip as strip
from ._scan import scan as scan
from ._slot import Memo as Memo
from ._stats import SlotStats as SlotStats, stats as stats


__version__ = importlib.metadata.version("memox")

_jax_internals.hide_from_tracebacks(__path__[0])
