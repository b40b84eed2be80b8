"""One line per request on stderr, as vLLM and llama.cpp print them: client, route, status, tokens, TTFT.

    kvlab: 127.0.0.1:50312 "POST /v1/chat/completions" 200 stream, 42 prompt tokens (32 cached) → 8, TTFT 220 ms, 0.55 s, stop

Logged to the `kvlab.access` logger (`kvlab serve` shows it unless --log-level is error or critical).
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("kvlab.access")


def log_request(request, status: int, started: float | None = None, output=None, stream: bool = False) -> None:
    """`started`: time.perf_counter() when the request arrived; `output`: its RequestOutput once finished."""
    if not logger.isEnabledFor(logging.INFO):
        return
    client = f"{request.client.host}:{request.client.port}" if request.client else "-"
    line = f'{client} "{request.method} {request.url.path}" {status}'
    if output is not None:
        m = output.metrics
        generated = sum(o.metrics.generated_tokens for o in output.outputs)
        reasons = ",".join(dict.fromkeys(str(o.finish_reason) for o in output.outputs))
        cached = f" ({m.cached_prompt_tokens} cached)" if m.cached_prompt_tokens else ""
        took = f", {time.perf_counter() - started:.2f} s" if started is not None else ""
        line += (f"{' stream' if stream else ''}, {m.prompt_tokens} prompt tokens{cached} → {generated}, "
                 f"TTFT {m.ttft_s * 1e3:.0f} ms{took}, {reasons}")  # fmt: skip
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
