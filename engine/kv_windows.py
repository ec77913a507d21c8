"""What a sliding-window layer holds (Gemma 3's local layers, Mistral's), as plain arithmetic: the
cache (engine/kvcache.py, kvcache_layers.py) keeps to it, and the instruments that count the
cache's bytes (F6's reads, F8's budget, the context sweep) and the UI read it without torch.
"""

from __future__ import annotations

CROP_ROOM = 16
"""Positions a sliding-window layer keeps before its window, so that a speculative round's
rejected drafts (at most 8, engine/speculative/drafters.py) can be cropped again."""
DROP_EVERY = 64
"""Positions a sliding-window layer may gather past its window and CROP_ROOM before the oldest are
dropped: dropping moves the window's K/V to the buffer's front, so it is done once per this many
tokens, not every token."""


def most_held(window: int) -> int:
    """The most positions a sliding-window layer holds between forwards: the window's last
    window - 1 and CROP_ROOM before them, and up to DROP_EVERY - 1 gathered before the oldest go."""
    return window - 1 + CROP_ROOM + DROP_EVERY - 1


def kv_read_bytes(per_token: int, layers: int, windows: tuple[int | None, ...], positions: int) -> int:
    """K/V bytes over `positions` cached ones (what one token's attention reads, what the cache
    needs at that length): `per_token` (all layers') for each, except that a layer with a sliding
    window (`windows`, () for none) counts only its last w."""
    if not windows:
        return per_token * positions
    return per_token // layers * sum(min(positions, w or positions) for w in windows)
