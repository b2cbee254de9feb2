"""memox: caches for expensive derived values of Equinox modules that survive `jax.jit`,
`lax.scan` and `jax.grad` — never stale, never changing the pytree structure."""

import importlib.metadata

from . import _jax_internals, internal as internal, policies as policies
from ._cached import CachedMethod as CachedMethod, cached as cached
from ._caches import clear_caches as clear_caches
from ._call import (
    SlotStats as SlotStats,
    call as call,
    clear as clear,
    hoist as hoist,
    init as init,
    invalidate as invalidate,
    stats as stats,
    strip as strip,
)
from ._errors import UncachedWarning as UncachedWarning
from ._filter_jit import filter_jit as filter_jit
from ._flops import FlopCount as FlopCount, flops as flops
from ._jit import jit as jit
from ._scan import scan as scan
from ._slot import Memo as Memo


__version__ = importlib.metadata.version("memox")

_jax_internals.hide_from_tracebacks(__path__[0])
