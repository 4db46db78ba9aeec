"""Values built once per key and kept for the process (plans, backend choices)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable

LIMIT = 4096  # distinct keys kept; a model meets a few per layer shape


def kept(cache: Dict[Hashable, Any], key: Hashable, make: Callable[[], Any], limit: int = LIMIT) -> Any:
    """``cache[key]``, made by ``make()`` on first use. A cache at ``limit``
    entries is emptied first, so a caller with ever-new keys cannot grow it
    without bound; a ``make`` that raises leaves nothing behind."""
    v = cache.get(key)
    if v is None:
        if len(cache) >= limit:
            cache.clear()
        v = cache[key] = make()
    return v
