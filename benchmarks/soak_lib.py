"""What the soak benchmarks share (soak_serve.py, abuse_soak.py): a served engine in a child process, the
tally of outcomes (completed, refused in OpenAI's error shape, disconnected, lost), the server's RSS and
its /metrics."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

WORDS = ("the capital of france is paris and the river seine runs through it while tourists walk along quiet "
         "streets looking at old buildings bridges museums gardens cafes markets and shops").split()  # fmt: skip
OPENAI_FINISH = {"stop", "length"}


@dataclass
class Tally:
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("completed", "refused", "disconnected", "lost"), 0))
    refusals: dict[str, int] = field(default_factory=dict)  # by status and error code
    lost: list[str] = field(default_factory=list)  # why, for each lost request

    def add(self, outcome: str, detail: str | int | None = None) -> None:
        self.outcomes[outcome] += 1
        if outcome == "refused":
            self.refusals[detail] = self.refusals.get(detail, 0) + 1
        elif outcome == "lost":
            self.lost.append(str(detail))


def start_server(args, *extra: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "kvlab.cli", "serve", args.model, "--port", "0", "--max-num-seqs", str(args.max_num_seqs),
           "--kv-memory", args.kv_memory, "--max-model-len", str(args.max_model_len), "--threads", str(args.threads),
           "--max-concurrent-requests", str(args.max_concurrent_requests), *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    for line in proc.stderr:
        print("  server:", line.rstrip(), file=sys.stderr)
        found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        if found:  # keep reading its stderr: a full pipe would block the server
            threading.Thread(target=lambda: [print("  server:", x.rstrip(), file=sys.stderr) for x in proc.stderr],
                             daemon=True).start()  # fmt: skip
            return proc, found.group(1)
    raise SystemExit(f"kvlab serve exited ({proc.wait()}) before serving")


def rss(pid: int) -> dict[str, int]:
    """Resident and peak resident bytes of a process (Linux /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    kib = {k: int(v.split()[0]) for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(.+)$", status, re.M)}
    return {"rss": kib["VmRSS"] * 1024, "peak": kib["VmHWM"] * 1024}


def _refusal(r: httpx.Response, tally: Tally) -> None:
    try:
        error = r.json()["error"]
        clean = r.status_code < 500 and set(error) == {"message", "type", "param", "code"}
    except (ValueError, KeyError, TypeError):
        clean = False
    tally.add("refused" if clean else "lost", f"{r.status_code} {error['code']}" if clean else f"{r.status_code}: {r.text[:200]}")


def _check_stream(lines: list[str], tally: Tally) -> None:
    if not lines or lines[-1] != "data: [DONE]":
        return tally.add("lost", "stream without [DONE]")
    events = [json.loads(line[6:]) for line in lines[:-1]]
    reasons = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    ok = not any("error" in e for e in events) and len(reasons) == 1 and reasons[0] in OPENAI_FINISH
    tally.add("completed" if ok else "lost", f"stream finish reasons {reasons}")


def metric(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def wait_idle(client: httpx.AsyncClient, timeout: float) -> tuple[bool, str]:
    end = time.time() + timeout
    while True:
        text = (await client.get("/metrics")).text
        busy = sum(metric(text, n) for n in ("kvlab_requests_running", "kvlab_requests_waiting", "kvlab_kv_blocks_used"))
        if busy == 0 or time.time() > end:
            return busy == 0, text
        await asyncio.sleep(0.2)
