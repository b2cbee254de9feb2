"""Semi-public pieces of memox, for tools built on it. No stability promise."""

from ._cached import CachedMethod as CachedMethod, cached_methods as cached_methods
from ._fingerprint import fingerprint as fingerprint
from ._flops import FlopCount as FlopCount
from ._slot import is_memo as is_memo, slot_sites as slot_sites
from ._storage import Spec as Spec
