"""`kvlab mem --plot FILE.png`: KV cache (plus constant states) against context, one line per model.

matplotlib (a base dependency) is imported here only, and only when a plot is asked for.
"""

from __future__ import annotations

from pathlib import Path

from kvlab.deps import require
from kvlab.errors import KvlabError
from kvlab.memory.kv import kv_bytes, state_bytes
from kvlab.config import ModelConfig
from kvlab.memory.units import GIB, KIB, MIB, TIB, fmt_bytes

MIN_CONTEXT = 128


def context_points(top: int, count: int = 64) -> list[int]:
    """About `count` token counts spaced evenly on a log axis from 128 to `top`, both included."""
    top = max(top, MIN_CONTEXT * 2)
    ratio = (top / MIN_CONTEXT) ** (1 / (count - 1))
    points = sorted({min(top, round(MIN_CONTEXT * ratio**i)) for i in range(count)} | {top})
    return points


def plot_kv(specs: list[ModelConfig], path: str | Path, *, batch: int = 1, kv_dtypes: list[str],
            top_context: int, device_bytes: int | None = None) -> Path:
    """Write a log-log PNG of KV + state bytes for `batch` sequences against context length."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise KvlabError(f"--plot {path}: give a .png (or .svg, .pdf) file name")
    require("matplotlib", "kvlab mem --plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    xs = context_points(top_context)
    fig = Figure(figsize=(8, 5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    beyond = False
    for spec, dtype in zip(specs, kv_dtypes):
        state = state_bytes(spec, batch)
        ys = [(kv_bytes(spec, x, batch, dtype) + state) / GIB for x in xs]
        label = f"{spec.name} ({dtype})" + (f", incl. {fmt_bytes(state)} state" if state else "")
        limit = spec.max_position_embeddings or xs[-1]
        inside = [(x, y) for x, y in zip(xs, ys) if x <= limit]
        (line,) = ax.plot(*zip(*inside), label=label, linewidth=1.8)
        outside = [(x, y) for x, y in zip(xs, ys) if x >= inside[-1][0]]
        if len(outside) > 1:  # past the trained context: dotted, same colour
            ax.plot(*zip(*outside), linestyle=":", linewidth=1.5, color=line.get_color())
            beyond = True
    if device_bytes:
        ax.axhline(device_bytes / GIB, color="black", linestyle="--", linewidth=1,
                   label=f"device memory {fmt_bytes(device_bytes)}")
    _label_axes(ax, xs)
    ax.set_xlabel("context (tokens per sequence, log scale; k = 1,024)")
    ax.set_ylabel(f"KV cache + state for {batch:,} sequence{'s' if batch > 1 else ''} (log scale)")
    ax.set_title("KV-cache memory against context" + (" (dotted: past the trained context)" if beyond else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise KvlabError(f"--plot {path}: cannot write it ({e.strerror or e})") from None
    return path


def token_label(n: float) -> str:
    """A context on the axis as people say it: 512, 16k, 128k, 1M (k = 1,024)."""
    n = int(round(n))
    for unit, size in (("M", 2**20), ("k", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n:,}"


def _label_axes(ax, xs: list[int]) -> None:
    """Log axes labelled in words: powers of 4 tokens on x (512, 2k, 8k rather than 2^9), bytes on y
    (10 MiB, 1 GiB rather than 10^-2)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = [2**e for e in range(7, 31, 2) if xs[0] <= 2**e <= xs[-1]]
    if xs[-1] & (xs[-1] - 1) == 0 and xs[-1] not in ticks:  # the context asked for, when a power of 2: 256k
        ticks.append(xs[-1])
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: token_label(x)))
    ax.xaxis.set_minor_locator(NullLocator())
    # 1, 10, 100 of each binary unit: 100 MiB rather than 0.1 GiB = 102.4 MiB
    ax.yaxis.set_major_locator(FixedLocator([m * unit / GIB for unit in (KIB, MIB, GIB, TIB) for m in (1, 10, 100)]))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: fmt_bytes(int(round(y * GIB)))))
