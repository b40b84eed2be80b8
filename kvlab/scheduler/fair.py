"""Fair shares: how the scheduler splits seats and prompt tokens between clients (pure Python).

A client is what the caller names in `Request.client_id` (the server names one per HTTP request:
all its prompts and choices are one client). Requests that name none are one anonymous client
together, so a caller that names none (`LLM.generate`, `kvlab run`) gets the first-come-first-served
scheduler exactly. With several clients:

- **seats** (`max_num_seqs`): when every seat is taken and a waiting client holds fewer than its
  share (`max_num_seqs // clients with work`, at least 1) while another holds more, that other one
  gives back its most recently admitted request — preempted, so recomputed later, mostly from the
  prefix cache (its full blocks, and its last partial one, stay findable);
- **admission order**: the next request admitted is the first waiting one of the client holding the
  fewest seats (first come, first served among equals, so a preempted request keeps its place);
- **prompt tokens**: when several clients have prompt tokens to compute, the step's budget left after
  the decodes is split by max-min fairness (`water_fill`): a client asking for less than an equal share
  gets all it asks, the rest is split evenly among the others. A giant request's prompts therefore
  take half a step's budget, not all of it, while a small request's prompt is computed. At most
  budget // MIN_SHARE clients share a step (those asking least; equal asks in arrival order), so that
  many equal prompts go through in chunks of MIN_SHARE or more, a few at a time, not in crumbs all together.

Decodes are not shared out: every running request decodes every step, so sharing seats shares them.
"""

from __future__ import annotations

from collections import Counter

from kvlab.request import Request


def water_fill(demands: dict, budget: int, max_clients: int | None = None) -> dict:
    """Max-min fair split of `budget` tokens among clients asking `demands` (client → tokens).

    Clients are served from the smallest demand up, each taking at most an equal share of what is
    left; every client gets at least one token while any is left. The shares never sum past `budget`.
    With `max_clients`, only the first that many in that order share the budget (more only while
    those few ask for less than all of it); the others get 0 and wait for a later step.
    """
    order = sorted(demands, key=lambda c: demands[c])  # stable: equal demands keep their order
    if max_clients:
        asked = 0
        for n, client in enumerate(order):
            if n >= max_clients and asked >= budget:
                order = order[:n]
                break
            asked += demands[client]
    shares, left = dict.fromkeys(demands, 0), budget
    for i, client in enumerate(order):
        share = min(demands[client], max(left // (len(order) - i), min(left, 1)))
        shares[client] = share
        left -= share
    return shares


# A step's prompt budget goes to at most budget // MIN_SHARE clients (2 at least), those asking least: 64
# requests arriving together are 64 clients to the server, and an even split of 512 tokens gave each
# prompt 8 tokens a step, so that every prompt finished in the same last step (all first tokens at
# the end: vLLM bench serve's 64 × 256-token prompts, TTFT p50 = p99) and no decode could begin early.
MIN_SHARE = 64


class PrefillShares:
    """Each client's prompt tokens still allowed this step (no limit with fewer than two clients)."""

    def __init__(self, demands: dict, budget: int):
        sharers = max(2, budget // MIN_SHARE)
        self.left = water_fill(demands, budget, sharers) if len(demands) > 1 else None

    def grant(self, client, n: int) -> int:
        """Up to `n` tokens for `client`, taken from its share."""
        if self.left is None:
            return n
        n = min(n, self.left.get(client, 0))
        if client in self.left:
            self.left[client] -= n
        return n


def seat_victims(running: list[Request], waiting: list[Request], max_num_seqs: int) -> list[Request]:
    """Running requests to preempt so that waiting clients below their seat share get a seat.

    Only when every seat is taken; each victim is the latest-admitted request of the client holding
    the most seats, and only while that client holds more than its share (so a share is never
    taken below itself: no request is preempted back and forth)."""
    if len(running) < max_num_seqs or not waiting:
        return []
    seats = Counter(r.client_id for r in running)
    num_waiting = Counter(r.client_id for r in waiting)  # in queue order of each client's first request
    if len(set(seats) | set(num_waiting)) < 2:
        return []
    share = max(max_num_seqs // len(set(seats) | set(num_waiting)), 1)
    victims: list[Request] = []
    for client, wanting in num_waiting.items():
        for _ in range(min(wanting, share - seats[client])):
            richest = max(seats, key=lambda c: seats[c])
            if seats[richest] <= share:
                return victims
            taken = {id(v) for v in victims}
            victims.append(next(r for r in reversed(running) if r.client_id == richest and id(r) not in taken))
            seats[richest] -= 1
            seats[client] += 1  # the seat it frees goes to this client's first waiting request
    return victims


def admission_order(waiting, running: list[Request], num_seats: int) -> list[Request]:
    """The next `num_seats` waiting requests to admit: each the first waiting request of the client
    holding the fewest seats at that point (ties: the earliest in the queue)."""
    seats = Counter(r.client_id for r in running)
    queues: dict = {}
    for position, r in enumerate(waiting):
        queues.setdefault(r.client_id, []).append((position, r))
    heads = {c: 0 for c in queues}
    picked: list[Request] = []
    while len(picked) < num_seats and heads:
        client = min(heads, key=lambda c: (seats[c], queues[c][heads[c]][0]))
        picked.append(queues[client][heads[client]][1])
        seats[client] += 1
        heads[client] += 1
        if heads[client] == len(queues[client]):
            del heads[client]
    return picked
