"""One HTTP generation: an engine request per prompt, waited for together or streamed as one.

    run = Generation.submit(engine, parsed, salt)     every prompt queued (all or none)
    outputs = await run.final_or_disconnect(request)  their final RequestOutputs; a client gone: all aborted
    run.events(stream, release, log)                  server-sent events, the prompts' items merged

The first prompt's engine request carries the response's id; the others add `-1`, `-2`, ...
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from fastapi import Request

from kvlab.output.result import RequestOutput
from kvlab.sampling.structured import GrammarFailed
from kvlab.server.async_engine import AsyncEngine, StepFailed
from kvlab.server.protocol import APIError, ParsedRequest
from kvlab.server.streaming import EventStream


@dataclass
class Generation:
    engine: AsyncEngine
    request_ids: list[str]
    queues: list[asyncio.Queue]
    outputs: list[RequestOutput]

    @classmethod
    def submit(cls, engine: AsyncEngine, parsed: ParsedRequest, salt: str | None) -> Generation:
        run = cls(engine, [], [], [])
        try:
            for i, prompt in enumerate(parsed.prompts):
                rid = parsed.request_id if i == 0 else f"{parsed.request_id}-{i}"
                output = RequestOutput(prompt=prompt.text, prompt_token_ids=prompt.token_ids)
                run.queues.append(engine.submit(rid, prompt.token_ids, parsed.params, output, salt,
                                                parsed.request_id))  # one client: every prompt of the request
                run.request_ids.append(rid)
                run.outputs.append(output)
        except BaseException:
            run.abort()
            raise
        finally:
            engine.arrived()  # every prompt queued (or none): the engine thread need not wait for this request
        return run

    def abort(self) -> None:
        for rid in self.request_ids:
            self.engine.abort(rid)

    async def final_or_disconnect(self, request: Request) -> list[RequestOutput]:
        """Every prompt's final output; a client gone (499) or a prompt that failed aborts the others.

        One task per prompt, each awaited or cancelled here and its exception read, so that nothing is
        left to log "exception was never retrieved" when a client leaves a multi-prompt request."""
        waits = [asyncio.ensure_future(_until_finished(q)) for q in self.queues]
        gone = asyncio.ensure_future(_disconnected(request))
        pending, failure, left = set(waits), None, False
        try:
            while pending and failure is None and not left:
                done, pending = await asyncio.wait(pending | {gone}, return_when=asyncio.FIRST_COMPLETED)
                left = gone in done
                pending.discard(gone)
                failure = next((t.exception() for t in done if t is not gone and t.exception() is not None), None)
        finally:
            gone.cancel()
            if pending or failure is not None or left:  # the client went away, a prompt failed, or we are cancelled
                self.abort()
            for t in waits:
                t.cancel()
            for t in [*waits, gone]:  # read every outcome: none is left unretrieved
                if t.done() and not t.cancelled():
                    t.exception()
        if failure is not None:
            raise failure
        if pending:
            raise APIError(499, "client closed the request")
        return [t.result() for t in waits]

    async def events(self, stream: EventStream, release, log):
        """Server-sent events; if the client disconnects Starlette cancels this generator: abort.

        `log(status, note)` writes the access line once: 200 (note None) when every prompt finished,
        500 after an error event, 499 when the client left mid-stream."""
        merged: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.ensure_future(_pump(i, q, merged)) for i, q in enumerate(self.queues)]
        finished, failed, num_tokens = False, False, 0
        try:
            for payload in stream.start():
                yield _sse(payload)
            pending = len(self.queues)
            while pending:
                prompt, item = await merged.get()
                error = item_error(item)
                if error is not None:
                    failed = True
                    log(error.status, f"ended with an error event ({error.code}) after {num_tokens} tokens")
                    yield _sse(error.body())
                    break
                num_tokens += len(item.new_token_ids)
                for payload in stream.item(prompt, item):
                    yield _sse(payload)
                pending -= item.finished
            else:
                finished = True
                log(200, None)
            yield "data: [DONE]\n\n"
        finally:
            release()
            for p in pumps:
                p.cancel()
            if not finished:
                self.abort()
            if not (finished or failed):
                log(499, f"the client disconnected after {num_tokens} tokens")


async def _pump(prompt: int, source: asyncio.Queue, merged: asyncio.Queue) -> None:
    """Forward one prompt's items, tagged with the prompt, until its request ends."""
    while True:
        item = await source.get()
        await merged.put((prompt, item))
        if item_error(item) is not None or item.finished:
            return


def item_error(item) -> APIError | None:
    """What a queue item says went wrong: its grammar failed mid-answer (500 structured_output_failed: the
    text so far would not parse), a failed step (500 step_failed), or a request that never ran."""
    if not isinstance(item, BaseException) and (item.error or "").startswith(GrammarFailed.__name__):
        message = f"{item.error.split(': ', 1)[-1]}; no answer rather than one that does not parse (others go on)"
        return APIError(500, message, type="server_error", code="structured_output_failed")
    if isinstance(item, StepFailed) or (not isinstance(item, BaseException) and item.error is not None):
        why = item if isinstance(item, StepFailed) else item.error
        return APIError(500, f"the engine step that carried this request failed ({why}); other requests go on",
                        type="server_error", code="step_failed")  # fmt: skip
    if isinstance(item, BaseException):
        return APIError(500, f"engine error: {item}", type="server_error", code="engine_error")
    return None


async def _until_finished(queue: asyncio.Queue) -> RequestOutput:
    while True:
        item = await queue.get()
        error = item_error(item)
        if error is not None:
            raise error
        if item.finished:
            return item.output


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
