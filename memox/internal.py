"""Semi-public pieces of memox, for tools built on it. No stability promise."""

import warnings as _warnings

from ._cached import cached_methods as cached_methods
from ._fingerprint import fingerprint as fingerprint
from ._sites import SlotSite as SlotSite, slot_sites as slot_sites
from ._slot import is_memo as is_memo
from ._storage import LeafType as LeafType, Spec as Spec


# Public now (`memox.CachedMethod`, `memox.FlopCount`); the old names work for one release.
_MOVED = ("CachedMethod", "FlopCount")


def __getattr__(name: str) -> object:
    if name in _MOVED:
        _warnings.warn(
            f"`memox.internal.{name}` is now `memox.{name}`; the old name goes in the next "
            "release.",
            DeprecationWarning,
            stacklevel=2,
        )
        import memox

        return getattr(memox, name)
    raise AttributeError(f"module 'memox.internal' has no attribute {name!r}")
