"""A bounded soak of one server process: N mixed requests, then whether it is back where it started.

Starts ``python -m questkv.server MODEL`` (default ``smollm2-135m`` on the CPU, Quest budget 256 in pages of 16)
on a free port of 127.0.0.1 and sends ``--requests`` requests, ``--concurrency`` at a time, each drawn from a mix:
streamed and collected completions and chat completions with per-request Quest budgets (``{}``, ``{"dense":
true}``, ``{"token_budget": 64 | 128 | 256}``), clients that go away (before any answer, or after their first
chunk), and bad requests (wrong types, NaN, lone surrogates, deep nesting, unknown fields, oversized: the server
answers 413 and closes without reading the body, so that client may see the connection cut instead). Meanwhile
``/health`` is polled every ``--health-interval`` seconds and its latency recorded.

Reported (``<out>.json`` and ``<out>.md``, with the exact command, commit, machine and date): requests by the
client's outcome (HTTP status, ``disconnect``, transport error) and by the server's ``questkv_requests_total``
status, p50 / p99 / max ``/health`` latency during the run, the server's RSS and KV pages (free / total) at the
start and at the end (after it is idle again), and whether every request was counted exactly once. Outside CI:

    python benchmarks/soak_bench.py --requests 300 --out /tmp/soak-300
    python benchmarks/soak_bench.py --out benchmarks/results/soak-cpu            # 10000 requests, hours on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import httpx

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
    sys.path.insert(0, str(ROOT))

from benchmarks.serve_load import Server as ServeLoadServer, percentile  # noqa: E402
from questkv.eval.provenance import provenance  # noqa: E402

REQUEST_TIMEOUT_S = 600.0
WORDS = ("the river ran past old stone houses while people talked about weather markets music and small boats "
         "near a harbour in early spring light").split()
KINDS = {  # kind: weight
    "completion": 20, "completion-stream": 20, "chat": 15, "chat-stream": 15,
    "disconnect-before-answer": 5, "disconnect-after-first-chunk": 10, "bad": 15,
}


class Server(ServeLoadServer):
    """serve_load's server process (``python -m questkv.server ARGS`` on a free port, ready once ``/health``
    answers, stopped with SIGTERM), with its resident memory."""

    def rss_bytes(self) -> Optional[int]:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None


# ---------------------------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------------------------


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def good_body(rng: random.Random, model: str, args, chat: bool, stream: bool) -> dict:
    quest = rng.choice([None, {}, {"dense": True}, *({"token_budget": b} for b in args.budgets)])
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(1, args.max_tokens), "stream": stream,
                            "temperature": rng.choice([0, 0, 0.7, 1e-45]), "seed": rng.randrange(1 << 31)}
    if chat:
        body["messages"] = [{"role": "user", "content": text(rng, rng.randint(*args.prompt_words))}]
    else:
        body["prompt"] = text(rng, rng.randint(*args.prompt_words))
    if quest is not None:
        body["quest"] = quest
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return body


def bad_body(rng: random.Random, model: str, args) -> bytes:
    base = json.dumps({"model": model, "prompt": text(rng, 8), "max_tokens": 4})[:-1]
    choice = rng.randrange(8)
    if choice == 0:
        return (base + ', "temperature": NaN}').encode()
    if choice == 1:
        return (base + ', "max_tokens": 1000000000}').encode()
    if choice == 2:
        return b'{"model": "%s", "prompt": "x \\ud800 y", "max_tokens": 4}' % model.encode()
    if choice == 3:
        return (base + ', "metadata": ' + "[" * 5000 + "]" * 5000 + "}").encode()
    if choice == 4:
        return (base + ', "max_token": 4}').encode()
    if choice == 5:
        return (base + ', "quest": {"token_budget": 7}}').encode()
    if choice == 6:
        return b'{"model": "%s", "prompt": "%s"}' % (model.encode(), b"a " * (args.max_request_bytes // 2 + 1))
    return b'{"model": "' + model.encode() + b'", "prompt": [1, 2'


async def one(http: httpx.AsyncClient, url: str, kind: str, rng: random.Random, model: str, args) -> str:
    """Send one request of ``kind``; returns the client's outcome (the HTTP status, or what happened)."""
    chat = kind.startswith("chat")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        if kind == "bad":
            response = await http.post(url + "/v1/completions", content=bad_body(rng, model, args),
                                       headers={"content-type": "application/json"})
            return str(response.status_code)
        if kind == "disconnect-before-answer":
            body = json.dumps(good_body(rng, model, args, False, rng.random() < 0.5)).encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", httpx.URL(url).port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            writer.close()
            return "disconnect"
        stream = kind.endswith("stream") or kind == "disconnect-after-first-chunk"
        body = good_body(rng, model, args, chat, stream)
        if not stream:
            response = await http.post(url + path, json=body)
            return str(response.status_code)
        async with http.stream("POST", url + path, json=body) as response:
            async for line in response.aiter_lines():
                if kind == "disconnect-after-first-chunk" and line.startswith("data: {"):
                    return "disconnect"
            return str(response.status_code)
    except httpx.TransportError as error:
        return f"transport error ({type(error).__name__})"


async def poll_health(url: str, interval: float, stop: asyncio.Event, latencies: list[float], failures: list[str]):
    async with httpx.AsyncClient(timeout=30.0) as http:
        while not stop.is_set():
            began = time.perf_counter()
            try:
                response = await http.get(url + "/health")
                latencies.append(time.perf_counter() - began)
                if response.status_code != 200:
                    failures.append(str(response.status_code))
            except httpx.TransportError as error:
                failures.append(type(error).__name__)
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass


async def run(url: str, model: str, args) -> dict:
    rng = random.Random(args.seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=args.requests)
    outcomes: list[tuple[str, str]] = []
    latencies: list[float] = []
    failures: list[str] = []
    stop = asyncio.Event()
    health = asyncio.create_task(poll_health(url, args.health_interval, stop, latencies, failures))
    queue = iter(enumerate(kinds))
    began = time.monotonic()
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as http:

        async def worker() -> None:
            for i, kind in queue:
                outcomes.append((kind, await one(http, url, kind, random.Random(args.seed * 1_000_003 + i), model,
                                                 args)))
                if len(outcomes) % max(args.requests // 20, 1) == 0:
                    print(f"{len(outcomes)}/{args.requests} requests, {time.monotonic() - began:.0f} s", flush=True)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    stop.set()
    await health
    return {"wall_s": time.monotonic() - began, "outcomes": outcomes, "health_latencies": latencies,
            "health_failures": failures}


# ---------------------------------------------------------------------------------------------------------------
# Server state and report
# ---------------------------------------------------------------------------------------------------------------


def server_counts(url: str) -> dict[str, float]:
    counts = {}
    for line in httpx.get(url + "/metrics", timeout=30.0).text.splitlines():
        if line.startswith("questkv_requests_total{"):
            key, _, value = line.rpartition(" ")
            counts[key.split('"')[1]] = float(value)
    return counts


def idle_state(server: Server, timeout: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(server.url + "/health", timeout=30.0).json()
        if health["requests_running"] == 0 and health["requests_waiting"] == 0 or time.monotonic() > deadline:
            return {"rss_bytes": server.rss_bytes(), "kv_pages_free": health["kv_pages_free"],
                    "kv_pages_total": health["kv_pages_total"], "idle": health["requests_running"] == 0}
        time.sleep(0.5)


def markdown(document: dict) -> str:
    p, s, r = document["provenance"], document["settings"], document["result"]
    mib = lambda b: "n/a" if b is None else f"{b / 2**20:.0f} MiB"  # noqa: E731
    ms = lambda v: "n/a" if v is None else f"{v * 1000:.1f} ms"  # noqa: E731
    lines = [
        f"# Soak: {s['requests']} mixed requests against one server", "",
        f"`{p['command']}`", "",
        f"Commit `{p['commit']}`, {p['machine']}, {p['date']}; server: `{' '.join(s['server_command'])}`.", "",
        f"Wall time {r['wall_s']:.0f} s, {s['concurrency']} at a time.", "",
        "| client outcome | requests |", "|---|---:|",
        *[f"| {k} | {v} |" for k, v in sorted(r["client_outcomes"].items())], "",
        "| server status (questkv_requests_total) | requests |", "|---|---:|",
        *[f"| {k} | {v:.0f} |" for k, v in sorted(r["server_statuses"].items())], "",
        f"Counted once each: **{r['counted_once']}** ({r['server_counted']:.0f} counted, "
        f"{r['expected_counted']} sent to a completion route).", "",
        f"`/health` during the run: {r['health']['samples']} samples, p50 {ms(r['health']['p50_s'])}, "
        f"p99 {ms(r['health']['p99_s'])}, max {ms(r['health']['max_s'])}, failures {r['health']['failures']}.", "",
        "| | RSS | KV pages free / total |", "|---|---:|---:|",
        f"| start | {mib(r['start']['rss_bytes'])} | {r['start']['kv_pages_free']} / {r['start']['kv_pages_total']} |",
        f"| end | {mib(r['end']['rss_bytes'])} | {r['end']['kv_pages_free']} / {r['end']['kv_pages_total']} |",
        "", f"Server exit code after SIGTERM: {r['exit_code']}.", "",
    ]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10000, help="requests in all (default: 10000)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default: 8)")
    parser.add_argument("--model", default="smollm2-135m", help="what the server serves (default: smollm2-135m)")
    parser.add_argument("--server-args", default="--device cpu --dtype float32 --max-model-len 1024 --budget 256 "
                        "--page-size 16", help="the server's flags after MODEL")
    parser.add_argument("--budgets", type=lambda t: [int(x) for x in t.split(",")], default=[64, 128, 256],
                        help="per-request Quest budgets drawn from (default: 64,128,256)")
    parser.add_argument("--max-tokens", type=int, default=16, help="the most tokens a request asks for (default: 16)")
    parser.add_argument("--prompt-words", type=lambda t: tuple(int(x) for x in t.split(",")), default=(20, 400),
                        help="prompt length range in words (default: 20,400)")
    parser.add_argument("--max-request-bytes", type=int, default=1 << 20,
                        help="the server's --max-request-bytes; one bad request exceeds it (default: 1 MiB)")
    parser.add_argument("--health-interval", type=float, default=0.1, help="seconds between /health polls")
    parser.add_argument("--threads", type=int, default=1, help="the server's OMP_NUM_THREADS (default: 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="output prefix: writes <out>.json and <out>.md")
    args = parser.parse_args(argv)

    # Taken before the server starts: the commit and date of the code it runs, not of the checkout at the end.
    command = "python benchmarks/soak_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    origin = provenance("cpu", command=command)
    server_args = [args.model, *args.server_args.split(), "--max-request-bytes", str(args.max_request_bytes)]
    server = Server(server_args, args.threads)
    try:
        model = httpx.get(server.url + "/v1/models", timeout=30.0).json()["data"][0]["id"]
        start, before = idle_state(server), server_counts(server.url)
        result = asyncio.run(run(server.url, model, args))
        expected = sum(1 for _ in result["outcomes"])  # every request reaches a completion route
        deadline = time.monotonic() + 300.0
        while sum(server_counts(server.url).values()) - sum(before.values()) < expected and time.monotonic() < deadline:
            time.sleep(0.5)
        after = server_counts(server.url)
        end = idle_state(server)
    finally:
        code = server.stop()
    statuses = {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0)}
    counted = sum(statuses.values())
    latencies = result["health_latencies"]
    document = {
        "provenance": origin,
        "settings": {**{k: v for k, v in vars(args).items() if k != "out"}, "server_command": server.command,
                     "mix": KINDS},
        "result": {
            "wall_s": result["wall_s"],
            "client_outcomes": dict(Counter(f"{kind}: {outcome}" for kind, outcome in result["outcomes"])),
            "server_statuses": statuses, "server_counted": counted, "expected_counted": expected,
            "counted_once": counted == expected,
            "health": {"samples": len(latencies), "p50_s": percentile(latencies, 50),
                       "p99_s": percentile(latencies, 99), "max_s": max(latencies, default=None),
                       "failures": dict(Counter(result["health_failures"]))},
            "start": start, "end": end, "exit_code": code,
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(document, indent=2))
    Path(args.out + ".md").write_text(markdown(document))
    print(markdown(document))
    return document


if __name__ == "__main__":
    main()
