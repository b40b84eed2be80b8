"""One HTTP generation: an engine request per prompt, waited for together or streamed as one.

    run = Generation.submit(engine, parsed, salt)     every prompt queued (all or none)
    outputs = await run.final_or_disconnect(request)  their final RequestOutputs; a client gone: all aborted
    run.events(stream, release, log_done)             server-sent events, the prompts' items merged

The first prompt's engine request carries the response's id; the others add `-1`, `-2`, ...
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from fastapi import Request

from kvlab.output.result import RequestOutput
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
                run.queues.append(engine.submit(rid, prompt.token_ids, parsed.params, output, salt))
                run.request_ids.append(rid)
                run.outputs.append(output)
        except BaseException:
            run.abort()
            raise
        return run

    def abort(self) -> None:
        for rid in self.request_ids:
            self.engine.abort(rid)

    async def final_or_disconnect(self, request: Request) -> list[RequestOutput]:
        result = asyncio.ensure_future(asyncio.gather(*(_until_finished(q) for q in self.queues)))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not result.done():  # the client went away, or the server is stopping
                self.abort()
            gone.cancel()
        if not result.done():
            result.cancel()
            raise APIError(499, "client closed the request")
        if result.exception() is not None:
            self.abort()  # one prompt failed: the others are not waited for
        return result.result()

    async def events(self, stream: EventStream, release, log_done):
        """Server-sent events; if the client disconnects Starlette cancels this generator: abort."""
        merged: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.ensure_future(_pump(i, q, merged)) for i, q in enumerate(self.queues)]
        finished = False
        try:
            for payload in stream.start():
                yield _sse(payload)
            pending = len(self.queues)
            while pending:
                prompt, item = await merged.get()
                error = item_error(item)
                if error is not None:
                    yield _sse(error.body())
                    break
                for payload in stream.item(prompt, item):
                    yield _sse(payload)
                pending -= item.finished
            else:
                finished = True
                log_done()
            yield "data: [DONE]\n\n"
        finally:
            release()
            for p in pumps:
                p.cancel()
            if not finished:
                self.abort()


async def _pump(prompt: int, source: asyncio.Queue, merged: asyncio.Queue) -> None:
    """Forward one prompt's items, tagged with the prompt, until its request ends."""
    while True:
        item = await source.get()
        await merged.put((prompt, item))
        if item_error(item) is not None or item.finished:
            return


def item_error(item) -> APIError | None:
    """What a queue item says went wrong: a failed step (500 step_failed), or a request that never ran."""
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
