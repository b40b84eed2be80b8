"""One line per request on stderr, as vLLM and llama.cpp print them: client, route, status, tokens, TTFT.

    kvlab: 127.0.0.1:50312 "POST /v1/chat/completions" 200 stream, 42 prompt tokens (32 cached) → 8, TTFT 220 ms, 0.55 s, stop
    kvlab: 127.0.0.1:50318 "POST /v1/chat/completions" 499 stream, 0.31 s, the client disconnected after 5 tokens

A stream the client leaves, or that ends with an error event, gets its line too (499 as nginx logs a
client that closed the request; the 500's code), with what was sent: its output is still the engine's.

Logged to the `kvlab.access` logger (`kvlab serve` shows it unless --log-level is error or critical).
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("kvlab.access")


def log_request(request, status: int, started: float | None = None, output=None, stream: bool = False,
                note: str | None = None) -> None:  # fmt: skip
    """`started`: time.perf_counter() when the request arrived; `output`: its RequestOutput once finished;
    `note`: how a request without one ended (a stream the client left)."""
    if not logger.isEnabledFor(logging.INFO):
        return
    client = f"{request.client.host}:{request.client.port}" if request.client else "-"
    line = f'{client} "{request.method} {request.url.path}" {status}'
    took = f", {time.perf_counter() - started:.2f} s" if started is not None else ""
    if output is not None:
        m = output.metrics
        cached_tokens = m.cached_prompt_tokens if output.cached_prompt_tokens is None else output.cached_prompt_tokens
        generated = sum(o.metrics.generated_tokens for o in output.outputs)
        reasons = ",".join(dict.fromkeys(str(o.finish_reason) for o in output.outputs))
        cached = f" ({cached_tokens} cached)" if cached_tokens else ""
        line += (f"{' stream' if stream else ''}, {m.prompt_tokens} prompt tokens{cached} → {generated}, "
                 f"TTFT {m.ttft_s * 1e3:.0f} ms{took}, {reasons}")  # fmt: skip
    elif note is not None:
        line += f"{' stream' if stream else ''}{took}, {note}"
    logger.info(line)


def configure(log_level: str) -> None:
    """Access lines on stderr at INFO, unless the server's --log-level hides even warnings."""
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("kvlab: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False  # uvicorn's root configuration would print it a second time
    logger.setLevel(logging.WARNING if log_level in ("error", "critical") else logging.INFO)
