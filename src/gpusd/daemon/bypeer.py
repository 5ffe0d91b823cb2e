"""Members grouped by the peer they came from, oldest first: the unsigned readers of an event hub and
the unsigned connections of the connection guard, whose per-peer shares and evictions read them."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class ByPeer(Generic[T]):
    """peer -> its members in arrival order; a peer with none is not kept."""

    def __init__(self) -> None:
        self._by: dict[str, dict[T, None]] = {}

    def add(self, peer: str, member: T) -> None:
        self._by.setdefault(peer, {})[member] = None

    def discard(self, peer: str, member: T) -> None:
        mine = self._by.get(peer)
        if mine is not None:
            mine.pop(member, None)
            if not mine:
                del self._by[peer]

    def of(self, peer: str) -> dict[T, None]:
        """``peer``'s members, oldest first (empty when it has none)."""
        return self._by.get(peer, {})

    def heaviest_first(self) -> list[str]:
        """The peers, the one with the most members first."""
        return sorted(self._by, key=lambda p: len(self._by[p]), reverse=True)

    def clear(self) -> None:
        self._by.clear()

    def __len__(self) -> int:
        """Members of every peer."""
        return sum(len(v) for v in self._by.values())

    def __bool__(self) -> bool:
        return bool(self._by)
