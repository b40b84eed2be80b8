"""Stop strings: end generation when the text contains one, and never show it or anything after it."""

from __future__ import annotations


class StopStringMatcher:
    """Filters streamed text against a set of stop strings.

    `push` returns the text that is safe to show now. A suffix that could still grow into a stop string
    is held back until the next piece settles it. When a stop string appears, the text up to it is
    returned, the stop string and everything after it are dropped, and the matcher stays stopped.
    With no stop strings it passes text straight through. Empty strings in `stop` are ignored.
    """

    def __init__(self, stop: list[str] | tuple[str, ...] | None = None) -> None:
        self._stops = tuple(dict.fromkeys(s for s in (stop or ()) if s))
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        """Add streamed text; return `(text safe to emit now, whether a stop string was hit)`."""
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buffer = self._held + text
        hit = self._earliest_stop(buffer)
        if hit is not None:
            self._held, self.stopped = "", True
            return buffer[:hit], True
        keep = self._partial_stop_length(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """At the end of generation: release held text (nothing if a stop string was hit)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _earliest_stop(self, buffer: str) -> int | None:
        positions = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        return min(positions) if positions else None

    def _partial_stop_length(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        for length in range(min(len(buffer), self._longest - 1), 0, -1):
            tail = buffer[-length:]
            if any(s.startswith(tail) for s in self._stops):
                return length
        return 0
