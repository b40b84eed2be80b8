"""Admission: what the server takes on, counted by what each request asks of the engine.

    body arrived ──enter()──► a request slot (max_concurrent_requests)       429 beyond
    tokenized    ──charge(cost)──► sequences and tokens (max_queued_seqs,    429 beyond, while others run;
                                   max_queued_tokens)                       400 when it could never fit
    finished, failed or gone ──release()──► all of it back

A request's cost is what the engine will hold for it: sequences = prompts × max(n, best_of) (each
choice is a sequence of its own) and tokens = per prompt, its tokens + choices × max_tokens (a prompt
is computed once; its choices fork from it). Only requests whose body has arrived count: a slow upload
holds no slot (wire.py and body.py bound how long it may take). Everything is counted on the event
loop (one thread: no lock).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.server.protocol import APIError, ParsedRequest

RETRY_AFTER_S = 1


@dataclass(frozen=True)
class Cost:
    num_seqs: int
    num_tokens: int

    @classmethod
    def of(cls, parsed: ParsedRequest) -> Cost:
        choices = parsed.params.num_sequences
        max_tokens = parsed.params.max_tokens or 0
        tokens = sum(len(p.token_ids) + choices * max_tokens for p in parsed.prompts)
        return cls(len(parsed.prompts) * choices, tokens)


class Admission:
    def __init__(self, max_requests: int, max_seqs: int, max_tokens: int):
        self.max_requests, self.max_seqs, self.max_tokens = max_requests, max_seqs, max_tokens
        self.num_requests = self.num_seqs = self.num_tokens = 0

    def enter(self) -> Ticket:
        """A request slot, or 429 when max_requests are in flight."""
        if self.num_requests >= self.max_requests:
            raise _overloaded(f"the server has {self.max_requests} requests in flight, its limit")
        self.num_requests += 1
        return Ticket(self)


class Ticket:
    """One request's share of the admission counts; calling it gives everything back (once)."""

    def __init__(self, admission: Admission):
        self.admission, self.cost, self.released = admission, Cost(0, 0), False

    def charge(self, cost: Cost) -> None:
        """Count the request's sequences and tokens: 429 when they do not fit beside the others in flight,
        400 when they exceed the limits on their own."""
        a = self.admission
        for asked, limit, what in ((cost.num_seqs, a.max_seqs, "sequences"), (cost.num_tokens, a.max_tokens, "tokens")):
            if asked > limit:
                raise APIError(400, f"this request asks for {asked:,} {what} (prompts × choices"
                               f"{'' if what == 'sequences' else ', with max_tokens'}); the server takes at most "
                               f"{limit:,} at once: split it", code=f"too_many_{what}")  # fmt: skip
        if a.num_seqs + cost.num_seqs > a.max_seqs:
            raise _overloaded(f"the server holds {a.num_seqs:,} sequences of {a.max_seqs:,}; this request asks "
                              f"for {cost.num_seqs:,}")  # fmt: skip
        if a.num_tokens + cost.num_tokens > a.max_tokens:
            raise _overloaded(f"the server has {a.num_tokens:,} tokens queued of {a.max_tokens:,}; this request "
                              f"asks for {cost.num_tokens:,}")  # fmt: skip
        a.num_seqs += cost.num_seqs
        a.num_tokens += cost.num_tokens
        self.cost = cost

    def __call__(self) -> None:
        if self.released:
            return
        a, self.released = self.admission, True
        a.num_requests -= 1
        a.num_seqs -= self.cost.num_seqs
        a.num_tokens -= self.cost.num_tokens


def _overloaded(why: str) -> APIError:
    return APIError(429, f"{why}: retry later", type="server_error", code="server_overloaded",
                    headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
