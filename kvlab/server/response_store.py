"""The Responses API's store: the last responses and the conversations that led to them, in memory, for
`previous_response_id` and GET / DELETE /v1/responses/{id}.

Bounded twice: at most MAX_STORED responses and MAX_STORED_CHARS of conversation text, the oldest forgotten
first. Each is visible only with the API key that made it. Workers read it while the event loop writes it:
one lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

MAX_STORED = 1024  # responses kept; the oldest is forgotten first
MAX_STORED_CHARS = 64 * 2**20  # and at most this much text in their conversations, all together


@dataclass
class Stored:
    response: dict
    messages: list[dict]  # the conversation, this response's output included (OpenAI chat messages)
    key: str | None  # the API key that made it

    @property
    def num_chars(self) -> int:
        """Its conversation's text (a conversation continued shares its messages with the earlier ones: counted
        again, so the bound errs on the safe side)."""
        return sum(len(m["content"]) + sum(len(c["function"]["arguments"]) for c in m.get("tool_calls", []))
                   for m in self.messages)  # fmt: skip


class ResponseStore:
    """The last MAX_STORED responses, by id (thread-safe: workers read it, the event loop writes it)."""

    def __init__(self, capacity: int = MAX_STORED, max_chars: int = MAX_STORED_CHARS):
        self.capacity, self.max_chars = capacity, max_chars
        self._items: OrderedDict[str, tuple[Stored, int]] = OrderedDict()  # id → (response, its characters)
        self._lock = threading.Lock()
        self.num_chars = 0

    def put(self, rid: str, stored: Stored) -> None:
        size = stored.num_chars
        with self._lock:
            self._items[rid] = (stored, size)
            self.num_chars += size
            while self._items and (len(self._items) > self.capacity or self.num_chars > self.max_chars):
                _, (_, gone) = self._items.popitem(last=False)
                self.num_chars -= gone

    def __len__(self) -> int:
        return len(self._items)

    def get(self, rid: str, key: str | None) -> Stored | None:
        with self._lock:
            stored, _ = self._items.get(rid, (None, 0))
        return stored if stored is not None and stored.key == key else None

    def delete(self, rid: str, key: str | None) -> bool:
        with self._lock:
            if rid in self._items and self._items[rid][0].key == key:
                _, size = self._items.pop(rid)
                self.num_chars -= size
                return True
        return False
