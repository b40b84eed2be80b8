"""Every rank runs the same engine, the same schedule, step for step (SPMD); rank 0 decides what comes in.

    rank 0:   SpmdEngine(engine, group)   add_request / abort_request as usual, then step()
    others:   SpmdEngine(engine, group).run_worker()   until rank 0 stops

Each rank holds its shard of the model and of the KV cache; the scheduler, the block pool, the prefix
cache and the samplers are whole on every rank and stay identical because every rank applies the same
requests and aborts in the same order before the same steps, and draws from the same logits (the LM
head's shards are all-gathered) with the same seeds (rank 0 gives every unseeded sampling request
one). Before each step, rank 0 broadcasts what changed since the last one; a request's text is only
delivered on rank 0.

The broadcasts go through a control group whose deadline is long: the other ranks wait there while
a server sits idle for hours between requests. Rank 0 does not wait that long: its side of each
broadcast runs in a helper thread that it gives the group's short deadline (a rank that stopped
answering never takes its share, and gloo would hold rank 0 for days). The model's all-reduces keep
the short deadline too, so a rank that stops answering ends the job within its timeout.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import random

from kvlab.parallel.group import RankFailed, TPGroup

IDLE_TIMEOUT = datetime.timedelta(days=7)


class SpmdEngine:
    """An LLMEngine on every rank of a tensor-parallel job, driven by rank 0 (the same interface)."""

    def __init__(self, engine, group: TPGroup):
        self.engine, self.group = engine, group
        self._events: list[tuple] = []  # rank 0: what the other ranks must apply before the next step
        self._control = None
        self._sender = None  # rank 0: the thread its broadcasts run in, under the short deadline
        if group.world_size > 1:
            import torch.distributed as dist

            self._control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
            if group.is_leader:
                self._sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvlab-spmd")

    def __getattr__(self, name):  # everything else (stats, kv, ledger, max_model_len, ...) is the engine's
        return getattr(self.engine, name)

    # ---- rank 0: the requests ---------------------------------------------------------------------

    def add_request(self, prompt_token_ids, params, request_id=None, output=None, arrival_s=None, cache_salt=None,
                    client_id=None):
        if not params.is_greedy and params.seed is None:  # every rank must draw the same tokens
            params = dataclasses.replace(params, seed=random.SystemRandom().randrange(2**32))
        request_id = self.engine.add_request(prompt_token_ids, params, request_id=request_id, output=output,
                                             arrival_s=arrival_s, cache_salt=cache_salt, client_id=client_id)  # fmt: skip
        self._events.append(("add", list(prompt_token_ids), params, request_id, cache_salt, client_id))
        return request_id

    def abort_request(self, request_id: str):
        out = self.engine.abort_request(request_id)
        if out is not None:
            self._events.append(("abort", request_id))
        return out

    def step(self):
        self._publish(self._events)
        self._events = []
        return self.engine.step()

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop (their run_worker returns)."""
        if self.group.world_size > 1 and self.group.is_leader:
            self._publish([("stop",)])

    # ---- the other ranks ----------------------------------------------------------------------------

    def run_worker(self) -> None:
        """Apply rank 0's requests and step with it, until it stops."""
        while True:
            events = self._receive()
            if any(e[0] == "stop" for e in events):
                return
            for event in events:
                if event[0] == "add":
                    _, ids, params, rid, salt, client = event
                    self.engine.add_request(ids, params, request_id=rid, cache_salt=salt, client_id=client)
                else:
                    self.engine.abort_request(event[1])
            self.engine.step()

    # ---- the control channel -----------------------------------------------------------------------

    def _publish(self, events: list[tuple]) -> None:
        if self._control is None:
            return
        sent = self._sender.submit(self._broadcast, events)
        try:
            sent.result(timeout=self.group.timeout_s)
        except concurrent.futures.TimeoutError:
            raise RankFailed(
                f"rank 0: the broadcast of the step's requests did not complete: another rank of the "
                f"tensor-parallel job died or stopped answering within {self.group.timeout_s:g} s; the job ends"
            ) from None

    def _receive(self) -> list[tuple]:
        return self._broadcast(None)

    def _broadcast(self, events):
        import torch.distributed as dist

        box = [events]
        self.group._run("broadcast of the step's requests", lambda: dist.broadcast_object_list(box, src=0, group=self._control))
        return box[0]
