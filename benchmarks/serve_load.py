"""Load on the OpenAI-compatible server: N concurrent streaming clients with long prompts, dense vs Quest.

Each client sends ``--requests-per-client`` streaming ``/v1/completions`` requests one after the other, each a
fresh prompt of ``--prompt-tokens`` random token ids and ``--output-tokens`` greedy tokens (``ignore_eos``). Measured on the
client: requests/s and output tokens/s (completion tokens from ``usage``, over the wall time from the first
request sent to the last finished), time to first token (request sent -> first chunk carrying a choice) and
inter-token latency (the gap between successive chunks of one request) at p50 / p99, and the mean tokens
attended that the server echoes in ``quest``. A short warm-up request runs before timing.

Output tokens/s over the wall time includes every prompt's prefill, which is dense for both runs. The
steady-decode throughput isolates decoding: the tokens received in the window from the moment every request
has its first token to the moment the first request receives its last one, over that window's length (no
prefill runs inside it when all requests are admitted at once; ``None`` when the window is empty, e.g. when
the KV pool cannot hold every request at once and later ones are prefilled while earlier ones finish).

``--clients`` takes a comma list (``16,64``): each server runs the loads in that order.

Three ways to point it at a server:

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --quest '{"token_budget": 256}'
    python benchmarks/serve_load.py --start "smollm2-135m --device cpu --dtype float32 --budget 256 --page-size 8"
    python benchmarks/serve_load.py --compare "smollm2-135m --device cpu --dtype float32 --page-size 8" \\
        --budget 256 --clients 8 --prompt-tokens 1500 --output-tokens 32 --out benchmarks/results/serve-load-cpu

``--compare`` starts the server twice in turn on a free port of 127.0.0.1, dense (the arguments as given: no
``--budget``) then Quest (``--budget`` added), runs the same load against each and writes both side by side.
``--start`` / ``--compare`` servers run with ``OMP_NUM_THREADS`` (``--threads``, default 1) and are stopped with
SIGTERM. Results: ``<out>.json`` (with provenance) and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from questkv.eval.provenance import provenance  # noqa: E402

START_TIMEOUT_S = 600.0


# ---------------------------------------------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """``python -m questkv.server ARGS --host 127.0.0.1 --port <free>``, ready once ``/health`` answers."""

    def __init__(self, args: list[str], threads: int) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.command = [sys.executable, "-m", "questkv.server", *args, "--host", "127.0.0.1", "--port", str(port)]
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="serve-load-", suffix=".log", delete=False)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        began = time.monotonic()
        self.proc = subprocess.Popen(self.command, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = began + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server was not ready within {START_TIMEOUT_S:.0f} s:\n{self.tail()}")
            time.sleep(0.5)
        self.startup_s = time.monotonic() - began

    def tail(self, chars: int = 4000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def stop(self, timeout: float = 60.0) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            return None


def served_model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=30.0).json()["data"][0]["id"]


# ---------------------------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------------------------


async def one_request(http: httpx.AsyncClient, body: dict) -> dict:
    """One streaming completion; its send time, the time of each chunk carrying a choice, usage and quest."""
    sent = time.monotonic()
    times, usage, quest, error = [], None, None, None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"sent": sent, "error": f"{response.status_code}: {(await response.aread())[:300]!r}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("choices"):
                times.append(time.monotonic())
            usage = chunk.get("usage") or usage
            quest = chunk.get("quest") or quest
            if "error" in chunk:
                error = chunk["error"]
    return {"sent": sent, "times": times, "usage": usage, "quest": quest, "error": error,
            "finished": time.monotonic()}


def make_body(model: str, args, rng: random.Random, quest: Optional[dict], prompt_tokens: int,
              output_tokens: int) -> dict:
    low, high = args.token_range
    body = {"model": model, "prompt": [rng.randrange(low, high) for _ in range(prompt_tokens)],
            "max_tokens": output_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if quest is not None:
        body["quest"] = quest
    return body


async def run_load(url: str, args, quest: Optional[dict], clients: int) -> dict:
    model = served_model(url)
    rng = random.Random(args.seed)  # the same prompts for every run
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=clients + 1)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
        warm = await one_request(http, make_body(model, args, random.Random(-1), quest, 64, 4))
        if warm.get("error"):
            raise RuntimeError(f"the warm-up request failed: {warm['error']}")
        bodies = [[make_body(model, args, rng, quest, args.prompt_tokens, args.output_tokens)
                   for _ in range(args.requests_per_client)] for _ in range(clients)]

        async def client(mine: list[dict]) -> list[dict]:
            return [await one_request(http, body) for body in mine]

        began = time.monotonic()
        per_client = await asyncio.gather(*(client(mine) for mine in bodies))
        wall = time.monotonic() - began
    return summarise([r for results in per_client for r in results], wall)


def percentile(values: list[float], q: float) -> Optional[float]:
    """Linear interpolation between closest ranks (numpy's default); ``None`` for no values."""
    if not values:
        return None
    values = sorted(values)
    position = q / 100 * (len(values) - 1)
    low = int(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def stats(values: list[float]) -> dict:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99),
            "mean": sum(values) / len(values) if values else None, "count": len(values)}


def steady_decode(ok: list[dict]) -> dict:
    """Tokens/s received while every request was decoding: from the last first token to the first last token."""
    if not ok:
        return {"window_s": None, "tokens": 0, "tokens_per_s": None}
    start = max(r["times"][0] for r in ok)
    end = min(r["times"][-1] for r in ok)
    if end <= start:
        return {"window_s": None, "tokens": 0, "tokens_per_s": None}
    tokens = sum(1 for r in ok for t in r["times"] if start < t <= end)
    return {"window_s": end - start, "tokens": tokens, "tokens_per_s": tokens / (end - start)}


def summarise(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if not r.get("error") and r.get("times")]
    ttft = [r["times"][0] - r["sent"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    output_tokens = sum(r["usage"]["completion_tokens"] for r in ok if r.get("usage"))
    attended = [r["quest"]["mean_tokens_attended"] for r in ok
                if r.get("quest") and r["quest"].get("mean_tokens_attended") is not None]
    return {
        "requests": len(results), "failed": len(results) - len(ok),
        "errors": sorted({str(r["error"]) for r in results if r.get("error")})[:5],
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall,
        "ttft_s": stats(ttft),
        "itl_s": stats(itl),
        "decode_s": stats([r["times"][-1] - r["times"][0] for r in ok]),
        "steady_decode": steady_decode(ok),
        "mean_tokens_attended": sum(attended) / len(attended) if attended else None,
        "quest_echo": ok[0]["quest"] if ok else None,
    }


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def rate(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def times(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(result: dict) -> str:
    p, s = result["provenance"], result["settings"]
    clients = ", ".join(str(c) for c in s["clients"])
    lines = [
        "# Server load: concurrent streaming clients, dense vs Quest",
        "",
        f"- command: `{p['command']}`",
        f"- commit: `{p['commit']}`",
        f"- machine: {p['machine']}; date: {p['date']}",
        f"- torch {p['torch']}, transformers {p['transformers']}, python {p['python']}",
        "",
        "## Settings",
        "",
        f"- {clients} concurrent streaming clients x {s['requests_per_client']} request(s) each, prompts of "
        f"{s['prompt_tokens']} random token ids in [{s['token_range'][0]}, {s['token_range'][1]}), "
        f"max_tokens {s['output_tokens']}, greedy, `/v1/completions` with `stream_options.include_usage`",
        f"- server threads (OMP_NUM_THREADS): {s['threads']}; one warm-up request before timing",
        "- TTFT: request sent -> first chunk with a choice (queueing and prefill of all concurrent prompts "
        "included); inter-token latency (ITL): gap between successive chunks of one request",
        "- output tok/s: completion tokens over the wall time (every prompt's prefill included); steady decode "
        "tok/s: tokens received between the last request's first token and the first request's last token, "
        "over that window (`-`: the window is empty, some requests were prefilled while others finished)",
        "",
        "## Results",
        "",
        "| run | clients | server arguments | requests/s | output tok/s | steady decode tok/s | TTFT p50 ms "
        "| TTFT p99 ms | ITL p50 ms | ITL p99 ms | mean tokens attended | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        r = run["load"]
        attended = "-" if r["mean_tokens_attended"] is None else f"{r['mean_tokens_attended']:.0f}"
        lines.append(
            f"| {run['name']} | {run['clients']} | `{run['server']}` | {r['requests_per_s']:.3f} "
            f"| {r['output_tokens_per_s']:.2f} | {rate(r['steady_decode']['tokens_per_s'])} "
            f"| {ms(r['ttft_s']['p50'])} | {ms(r['ttft_s']['p99'])} | {ms(r['itl_s']['p50'])} "
            f"| {ms(r['itl_s']['p99'])} | {attended} | {r['failed']} of {r['requests']} |")
    for c in result.get("quest_vs_dense", []):
        lines += ["", f"## Quest vs dense, {c['clients']} clients", "",
                  f"- output tokens/s: Quest / dense = {times(c['output_tokens_per_s_ratio'])}",
                  f"- steady decode tokens/s: Quest / dense = {times(c['steady_decode_ratio'])}",
                  f"- inter-token latency p50: dense / Quest = {times(c['itl_p50_speedup'])}; "
                  f"Quest p99 {ms(c['quest_itl_p99_s'])} ms vs dense p50 {ms(c['dense_itl_p50_s'])} ms "
                  f"({ {True: 'at or under', False: 'over', None: '-'}[c['quest_itl_p99_under_dense_p50']] })",
                  f"- TTFT p50: dense / Quest = {times(c['ttft_p50_speedup'])} (prefill is dense either way)"]
    if result.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {note}" for note in result["notes"]]
    return "\n".join(lines) + "\n"


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    return None if not (numerator and denominator) else numerator / denominator


def compare(dense_run: dict, quest_run: dict) -> dict:
    dense, quest = dense_run["load"], quest_run["load"]
    quest_p99, dense_p50 = quest["itl_s"]["p99"], dense["itl_s"]["p50"]
    return {
        "clients": dense_run["clients"],
        "output_tokens_per_s_ratio": ratio(quest["output_tokens_per_s"], dense["output_tokens_per_s"]),
        "steady_decode_ratio": ratio(quest["steady_decode"]["tokens_per_s"], dense["steady_decode"]["tokens_per_s"]),
        "itl_p50_speedup": ratio(dense_p50, quest["itl_s"]["p50"]),
        "ttft_p50_speedup": ratio(dense["ttft_s"]["p50"], quest["ttft_s"]["p50"]),
        "quest_itl_p99_s": quest_p99,
        "dense_itl_p50_s": dense_p50,
        "quest_itl_p99_under_dense_p50": None if None in (quest_p99, dense_p50) else quest_p99 <= dense_p50,
    }


def client_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of positive client counts (e.g. 16,64)")
    return counts


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server's base URL")
    where.add_argument("--start", metavar="'MODEL ARGS'", help="start `python -m questkv.server MODEL ARGS` here")
    where.add_argument("--compare", metavar="'MODEL ARGS'",
                       help="start the server dense (these arguments), then with --budget added, in turn")
    parser.add_argument("--budget", type=int, default=256, help="the Quest server's --budget with --compare")
    parser.add_argument("--quest", type=json.loads, default=None,
                        help='the requests\' quest field as JSON (e.g. \'{"token_budget": 256}\'); default none')
    parser.add_argument("--clients", type=client_counts, default=[8],
                        help="concurrent clients; a comma list runs each load in turn on the same server (default 8)")
    parser.add_argument("--requests-per-client", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--token-range", type=lambda text: tuple(int(x) for x in text.split(",")),
                        default=(1000, 40000), help="prompt token ids are drawn from [LOW, HIGH) (default 1000,40000)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of servers started here")
    parser.add_argument("--request-timeout", type=float, default=900.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="for the provenance's machine line")
    parser.add_argument("--note", action="append", default=[], help="a line for the report's notes")
    parser.add_argument("--out", type=Path, help="write <out>.json and <out>.md")
    args = parser.parse_args(argv)

    if args.url:
        plans = [("url", None, args.quest)]
    elif args.start:
        plans = [("start", shlex.split(args.start), args.quest)]
    else:
        base = shlex.split(args.compare)
        plans = [("dense", base, args.quest), ("quest", base + ["--budget", str(args.budget)], args.quest)]
    runs = []
    for name, server_args, quest in plans:
        server = None if server_args is None else Server(server_args, args.threads)
        url = args.url if server is None else server.url
        loads = []
        try:
            for clients in args.clients:
                print(f"[{name}] {clients} clients on {url} ...", flush=True)
                loads.append((clients, asyncio.run(run_load(url, args, quest, clients))))
        finally:
            code = None if server is None else server.stop()
        for clients, load in loads:
            run: dict[str, Any] = {"name": name, "clients": clients, "quest_field": quest, "load": load,
                                   "server": args.url if server is None else " ".join(server_args)}
            if server is not None:
                run["startup_s"], run["exit_code"] = server.startup_s, code
            runs.append(run)
            print(f"[{name}, {clients} clients] {load['requests_per_s']:.3f} req/s, "
                  f"{load['output_tokens_per_s']:.2f} output tok/s, steady decode "
                  f"{rate(load['steady_decode']['tokens_per_s'])} tok/s, TTFT p50 {ms(load['ttft_s']['p50'])} ms, "
                  f"ITL p50 {ms(load['itl_s']['p50'])} ms p99 {ms(load['itl_s']['p99'])} ms, "
                  f"failed {load['failed']}", flush=True)
    result: dict[str, Any] = {
        "provenance": provenance(args.device),
        "settings": {k: getattr(args, k) for k in ("clients", "requests_per_client", "prompt_tokens", "output_tokens",
                                                    "token_range", "threads", "seed", "budget")},
        "runs": runs,
        "notes": args.note,
    }
    if len(plans) == 2:
        by_name = {(run["name"], run["clients"]): run for run in runs}
        result["quest_vs_dense"] = [compare(by_name["dense", c], by_name["quest", c]) for c in args.clients]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
        Path(f"{args.out}.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
