"""Load on the OpenAI-compatible server: N concurrent streaming clients with long prompts, dense vs Quest.

Each client sends ``--requests-per-client`` streaming ``/v1/completions`` requests one after the other, each a
fresh prompt of ``--prompt-tokens`` random token ids and ``--output-tokens`` greedy tokens (``ignore_eos``). Measured on the
client: requests/s and output tokens/s (completion tokens from ``usage``, over the wall time from the first
request sent to the last finished), time to first token (request sent -> first chunk carrying a choice) and
inter-token latency (the gap between successive chunks of one request) at p50 / p99, and the mean tokens
attended that the server echoes in ``quest``. Short warm-up requests run before timing (:func:`warm_up`).

Output tokens/s over the wall time includes every prompt's prefill, which is dense for both runs. The
steady-decode throughput isolates decoding: the tokens received in the window from the moment every request
has its first token to the moment the first request receives its last one, over that window's length (no
prefill runs inside it when all requests are admitted at once; ``None`` when the window is empty, e.g. when
the KV pool cannot hold every request at once and later ones are prefilled while earlier ones finish).

``--clients`` takes a comma list (``16,64``): each server runs the loads in that order. The inter-token latency is
also reported over the gaps during which another request of the load was waiting for its first token (``ITL while
prompts arrive``: its prompt queued or prefilled), where a prefill can stall decodes (chunked prefill bounds that
stall to one chunk).

``--workload multi-turn`` (or ``both``: the single-turn loads, then this one, on each server): ``--multi-turn-clients``
clients (16) hold conversations over ``--documents`` distinct documents (8, client ``i`` reads document ``i %
documents``) of ``--doc-tokens`` random token ids (32768). Each of ``--turns`` turns (4) sends the document, the
conversation so far (earlier questions and answers, by token id) and a new question of ``--question-tokens`` (32),
for ``--output-tokens`` tokens; every client finishes a turn before the next begins, so that each turn's TTFT is its
own. Reported: TTFT p50 / p99 and prefix-cache hits (``usage.prompt_tokens_details.cached_tokens``) per turn, ITL
p50 / p99 (and while prompts arrive), output tokens/s overall and over turns >= 2 (their tokens over their wall
time), and the ratio of the TTFT p50 of turns >= 2 to turn 1's.

The H200 set of the issue (dummy Llama-3.1-8B; ``/tmp/llama8b`` holds ``dummy_config("llama3.1-8b")
.save_pretrained(...)``): dense and Quest (budget 2048) servers, each taking 16 then 64 single-turn 32k clients and
then the multi-turn load, about 8 minutes in all::

    python benchmarks/serve_load.py --compare "/tmp/llama8b --load-format dummy --device cuda --dtype bfloat16 \
        --max-model-len 34816 --max-num-seqs 64 --page-size 16" --budget 2048 --workload both --clients 16,64 \
        --prompt-tokens 32000 --output-tokens 256 --token-range 1000,120000 --threads 4 --device cuda \
        --request-timeout 500 --out benchmarks/results/serve-load-h200-chunked

(about 3.5 minutes per server: 30-50 s of startup with its graph captures, 30 s for 16 clients, 110 s for 64, 45 s
for the multi-turn load). To stay within a shorter limit per command, split it: ``--workload single --clients
16,64 --out ...-single`` and ``--workload multi-turn --out ...-multi-turn`` with the same other arguments. The chunk
size is the servers' ``--max-num-batched-tokens`` (default 8192): a smaller one (2048) trades prefill throughput
for a shorter inter-token stall while prompts arrive.

``--smoke`` runs the same set on the CPU in seconds: a tiny random Llama, short documents and prompts, chunks of 32
tokens (what ``tests/test_serve_load.py`` runs).

Three ways to point it at a server:

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --quest '{"token_budget": 256}'
    python benchmarks/serve_load.py --start "smollm2-135m --device cpu --dtype float32 --budget 256 --page-size 8"
    python benchmarks/serve_load.py --compare "smollm2-135m --device cpu --dtype float32 --page-size 8" \\
        --budget 256 --clients 8 --prompt-tokens 1500 --output-tokens 32 --out benchmarks/results/serve-load-cpu

``--compare`` starts the server twice in turn on a free port of 127.0.0.1, dense (the arguments as given: no
``--budget``) then Quest (``--budget`` and ``--quest-server-args`` added: ``--speculative-config ...`` for lossless
Quest), runs the same load against each and writes both side by side.
``--start`` / ``--compare`` servers run with ``OMP_NUM_THREADS`` (``--threads``, default 1) and a Triton cache of
their own (``TRITON_CACHE_DIR``, removed after; so that the second of two servers does not start with the first's
compiled kernels), and are stopped with SIGTERM. The report lists, per server and load, the Triton kernels it
compiled inside the timed load (first uses that a request waited for; the warm-up requests' excluded). Results: ``<out>.json`` (with provenance) and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import shlex
import shutil
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
if __name__ == "__main__":  # run as a file: the checkout importable (questkv, benchmarks.*)
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
        # A Triton cache of its own: a server compiles every kernel it uses, whatever ran before it (an earlier
        # server's compiles would otherwise move into this one's warm start, and the first of two servers compared
        # would pay for both).
        self.triton_cache = tempfile.mkdtemp(prefix="serve-load-triton-")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "TRITON_CACHE_DIR": self.triton_cache}
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

    def compiled_since(self, since: float) -> list[str]:
        """The Triton kernels this server compiled after ``since`` (a ``time.time()``), by name, sorted: one
        ``__grp__<kernel>.json`` per compile in a folder of its cache."""
        groups = Path(self.triton_cache).glob("*/__grp__*.json")
        return sorted(path.name[len("__grp__"):-len(".json")] for path in groups if path.stat().st_mtime > since)

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
        finally:
            shutil.rmtree(self.triton_cache, ignore_errors=True)


def served_model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=30.0).json()["data"][0]["id"]


# ---------------------------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------------------------


async def one_request(http: httpx.AsyncClient, body: dict) -> dict:
    """One streaming completion; its send time, the time of each chunk carrying a choice, the generated token ids
    (when the body asks for them), usage and quest."""
    sent = time.monotonic()
    times, token_ids, usage, quest, error = [], [], None, None, None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"sent": sent, "error": f"{response.status_code}: {(await response.aread())[:300]!r}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("choices"):
                times.append(time.monotonic())
                token_ids += chunk["choices"][0].get("token_ids") or []
            usage = chunk.get("usage") or usage
            quest = chunk.get("quest") or quest
            if "error" in chunk:
                error = chunk["error"]
    return {"sent": sent, "times": times, "token_ids": token_ids, "usage": usage, "quest": quest, "error": error,
            "finished": time.monotonic()}


def random_tokens(args, rng: random.Random, count: int) -> list[int]:
    low, high = args.token_range
    return [rng.randrange(low, high) for _ in range(count)]


def make_body(model: str, args, rng: random.Random, quest: Optional[dict], prompt_tokens: int,
              output_tokens: int, prompt: Optional[list[int]] = None) -> dict:
    """A streaming greedy completion of ``prompt``, or of ``prompt_tokens`` random ids; it returns its token ids."""
    prompt = random_tokens(args, rng, prompt_tokens) if prompt is None else prompt
    body = {"model": model, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if quest is not None:
        body["quest"] = quest
    return body


def http_client(url: str, args, clients: int) -> httpx.AsyncClient:
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=clients + 1)
    return httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits)


async def warm_up(http: httpx.AsyncClient, model: str, args, quest: Optional[dict]) -> None:
    """Requests that take the paths a load takes before it is timed, so that their first use (kernel compilation)
    is not timed: a short prompt, then that prompt grown by a page or two (a prefix-cache hit) beside a fresh one
    (a prefill beside a running decode, a mixed step with chunked prefill)."""
    rng = random.Random("warm-up")
    first = make_body(model, args, rng, quest, 64, 4)
    grown = make_body(model, args, rng, quest, 0, 8, first["prompt"] + random_tokens(args, rng, 40))
    warm = [await one_request(http, first)]
    fresh = make_body(model, args, rng, quest, 48, 4)
    warm += await asyncio.gather(one_request(http, grown), one_request(http, fresh))
    errors = [result["error"] for result in warm if result.get("error")]
    if errors:
        raise RuntimeError(f"a warm-up request failed: {errors[0]}")


async def run_load(url: str, args, quest: Optional[dict], clients: int) -> dict:
    model = served_model(url)
    rng = random.Random(args.seed)  # the same prompts for every run
    async with http_client(url, args, clients) as http:
        await warm_up(http, model, args, quest)
        bodies = [[make_body(model, args, rng, quest, args.prompt_tokens, args.output_tokens)
                   for _ in range(args.requests_per_client)] for _ in range(clients)]

        async def client(mine: list[dict]) -> list[dict]:
            return [await one_request(http, body) for body in mine]

        timed_from, began = time.time(), time.monotonic()
        per_client = await asyncio.gather(*(client(mine) for mine in bodies))
        wall = time.monotonic() - began
    return {**summarise([r for results in per_client for r in results], wall), "timed_from": timed_from}


async def run_multi_turn(url: str, args, quest: Optional[dict]) -> dict:
    """The multi-turn long-document load (see the module docstring): every client's turn ``t`` before any turn
    ``t + 1``."""
    model = served_model(url)
    rng = random.Random(f"multi-turn {args.seed}")  # the same documents and questions for every run
    clients = args.multi_turn_clients
    documents = [random_tokens(args, rng, args.doc_tokens) for _ in range(args.documents)]
    conversations: list[list[int]] = [[] for _ in range(clients)]
    turns = []
    async with http_client(url, args, clients) as http:
        await warm_up(http, model, args, quest)
        timed_from = time.time()
        for _ in range(args.turns):
            bodies = []
            for i in range(clients):
                question = random_tokens(args, rng, args.question_tokens)
                prompt = documents[i % args.documents] + conversations[i] + question
                conversations[i] += question
                bodies.append(make_body(model, args, rng, quest, 0, args.output_tokens, prompt))
            began = time.monotonic()
            results = await asyncio.gather(*(one_request(http, body) for body in bodies))
            wall = time.monotonic() - began
            for conversation, result in zip(conversations, results):
                conversation += result.get("token_ids") or []
            turns.append((results, wall))
    return {**summarise_turns(turns), "timed_from": timed_from}


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


def itl_while_prompts_arrive(ok: list[dict]) -> list[float]:
    """The inter-token gaps of each request during which another request of ``ok`` was waiting for its first
    token (sent, not yet answered: queued or being prefilled)."""
    waits = sorted((r["sent"], r["times"][0], i) for i, r in enumerate(ok))
    gaps = []
    for i, r in enumerate(ok):
        for a, b in zip(r["times"], r["times"][1:]):
            if any(j != i and sent < b and first > a for sent, first, j in waits):
                gaps.append(b - a)
    return gaps


def output_tokens(ok: list[dict]) -> int:
    return sum(r["usage"]["completion_tokens"] for r in ok if r.get("usage"))


def summarise(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if not r.get("error") and r.get("times")]
    ttft = [r["times"][0] - r["sent"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    output_tokens_ = output_tokens(ok)
    attended = [r["quest"]["mean_tokens_attended"] for r in ok
                if r.get("quest") and r["quest"].get("mean_tokens_attended") is not None]
    return {
        "requests": len(results), "failed": len(results) - len(ok),
        "errors": sorted({str(r["error"]) for r in results if r.get("error")})[:5],
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "output_tokens": output_tokens_,
        "output_tokens_per_s": output_tokens_ / wall,
        "ttft_s": stats(ttft),
        "itl_s": stats(itl),
        "itl_while_prompts_arrive_s": stats(itl_while_prompts_arrive(ok)),
        "itl_p99_over_p50": ratio(percentile(itl, 99), percentile(itl, 50)),
        "decode_s": stats([r["times"][-1] - r["times"][0] for r in ok]),
        "steady_decode": steady_decode(ok),
        "mean_tokens_attended": sum(attended) / len(attended) if attended else None,
        "quest_echo": ok[0]["quest"] if ok else None,
    }


def verified(ok: list[dict]) -> dict:
    """Of the lossless requests among ``ok`` that ran a verify step (the server's ``quest`` echo): how many, and the
    means of their acceptance rates and of their tokens per verify (``None`` where none verified)."""
    echoes = [r["quest"] for r in ok if r.get("quest") and r["quest"].get("mean_tokens_per_verify") is not None]

    def mean(key: str) -> Optional[float]:
        return sum(echo[key] for echo in echoes) / len(echoes) if echoes else None

    return {"verified_requests": len(echoes), "mean_acceptance_rate": mean("acceptance_rate"),
            "mean_tokens_per_verify": mean("mean_tokens_per_verify")}


def summarise_turns(turns: list[tuple[list[dict], float]]) -> dict:
    """Per turn: TTFT, ITL, prefix-cache hits, tokens, wall time and the lossless requests' verifies
    (:func:`verified`); over the load: ITL (and while prompts arrive), output tokens/s overall and over turns >= 2,
    and the TTFT p50 of turns >= 2 over turn 1's."""
    per_turn, all_ok, later_ttft = [], [], []
    later_tokens, later_wall = 0, 0.0
    for t, (results, wall) in enumerate(turns, start=1):
        ok = [r for r in results if not r.get("error") and r.get("times")]
        ttft = [r["times"][0] - r["sent"] for r in ok]
        cached = [r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in ok if r.get("usage")]
        prompts = [r["usage"]["prompt_tokens"] for r in ok if r.get("usage")]
        per_turn.append({
            "turn": t, "requests": len(results), "failed": len(results) - len(ok),
            "errors": sorted({str(r["error"]) for r in results if r.get("error")})[:5], "wall_s": wall,
            "ttft_s": stats(ttft), "itl_s": stats([b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]),
            "output_tokens": output_tokens(ok), "output_tokens_per_s": output_tokens(ok) / wall,
            "mean_prompt_tokens": sum(prompts) / len(prompts) if prompts else None,
            "mean_cached_tokens": sum(cached) / len(cached) if cached else None,
            **verified(ok),
        })
        all_ok += ok
        if t >= 2:
            later_ttft += ttft
            later_tokens += output_tokens(ok)
            later_wall += wall
    itl = [b - a for r in all_ok for a, b in zip(r["times"], r["times"][1:])]
    wall = sum(w for _, w in turns)
    attended = [r["quest"]["mean_tokens_attended"] for r in all_ok
                if r.get("quest") and r["quest"].get("mean_tokens_attended") is not None]
    first_ttft = per_turn[0]["ttft_s"]["p50"] if per_turn else None
    return {
        "turns": per_turn,
        "requests": sum(turn["requests"] for turn in per_turn), "failed": sum(turn["failed"] for turn in per_turn),
        "wall_s": wall,
        "output_tokens": output_tokens(all_ok),
        "output_tokens_per_s": output_tokens(all_ok) / wall if wall else None,
        "output_tokens_per_s_turns_2_on": later_tokens / later_wall if later_wall else None,
        "itl_s": stats(itl),
        "itl_while_prompts_arrive_s": stats(
            [gap for results, _ in turns for gap in itl_while_prompts_arrive(
                [r for r in results if not r.get("error") and r.get("times")])]),
        "itl_p99_over_p50": ratio(percentile(itl, 99), percentile(itl, 50)),
        "ttft_p50_turns_2_on_over_turn_1": ratio(percentile(later_ttft, 50), first_ttft),
        "mean_tokens_attended": sum(attended) / len(attended) if attended else None,
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
    ]
    if s["workload"] in ("single", "both"):
        clients = ", ".join(str(c) for c in s["clients"])
        lines.append(
            f"- single-turn: {clients} concurrent streaming clients x {s['requests_per_client']} request(s) each, "
            f"prompts of {s['prompt_tokens']} random token ids in [{s['token_range'][0]}, {s['token_range'][1]}), "
            f"max_tokens {s['output_tokens']}, greedy, `/v1/completions` with `stream_options.include_usage`")
    if s["workload"] in ("multi-turn", "both"):
        lines.append(
            f"- multi-turn: {s['multi_turn_clients']} clients over {s['documents']} documents of {s['doc_tokens']} "
            f"random token ids, {s['turns']} turns each (the document, the conversation so far and a new question of "
            f"{s['question_tokens']} tokens), max_tokens {s['output_tokens']}; every client finishes a turn before the "
            "next turn begins")
    lines += [
        f"- server threads (OMP_NUM_THREADS): {s['threads']}; three warm-up requests before each load (a prompt, then "
        "that prompt grown, a prefix hit, beside a fresh one); each started server compiles its Triton kernels "
        "afresh (a `TRITON_CACHE_DIR` of its own): a kernel's first use in a load costs its compile there",
        "- TTFT: request sent -> first chunk with a choice (queueing and prefill of all concurrent prompts "
        "included); inter-token latency (ITL): gap between successive chunks of one request; ITL while prompts "
        "arrive: the gaps during which another request of the load waited for its first token",
        "- output tok/s: completion tokens over the wall time (every prompt's prefill included); steady decode "
        "tok/s: tokens received between the last request's first token and the first request's last token, "
        "over that window (`-`: the window is empty, some requests were prefilled while others finished)",
    ]
    single = [run for run in result["runs"] if run.get("workload", "single") == "single"]
    if single:
        lines += [
            "", "## Single-turn results", "",
            "| run | clients | server arguments | requests/s | output tok/s | steady decode tok/s | TTFT p50 ms "
            "| TTFT p99 ms | ITL p50 ms | ITL p99 ms | ITL p99 / p50 | ITL while prompts arrive p50 / p99 ms "
            "| mean tokens attended | failed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for run in single:
            r = run["load"]
            arriving = r.get("itl_while_prompts_arrive_s", {})
            lines.append(
                f"| {run['name']} | {run['clients']} | `{run['server']}` | {r['requests_per_s']:.3f} "
                f"| {r['output_tokens_per_s']:.2f} | {rate(r['steady_decode']['tokens_per_s'])} "
                f"| {ms(r['ttft_s']['p50'])} | {ms(r['ttft_s']['p99'])} | {ms(r['itl_s']['p50'])} "
                f"| {ms(r['itl_s']['p99'])} | {times(r.get('itl_p99_over_p50'))} "
                f"| {ms(arriving.get('p50'))} / {ms(arriving.get('p99'))} | {attended(r)} "
                f"| {r['failed']} of {r['requests']} |")
    for run in result["runs"]:
        if run.get("workload") != "multi-turn":
            continue
        r = run["load"]
        arriving = r["itl_while_prompts_arrive_s"]
        lines += [
            "", f"## Multi-turn: {run['name']}", "", f"Server: `{run['server']}`", "",
            "| turn | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | mean prompt tokens | mean cached tokens "
            "| output tok/s | wall s | failed |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for turn in r["turns"]:
            lines.append(
                f"| {turn['turn']} | {ms(turn['ttft_s']['p50'])} | {ms(turn['ttft_s']['p99'])} "
                f"| {ms(turn['itl_s']['p50'])} | {ms(turn['itl_s']['p99'])} | {rate(turn['mean_prompt_tokens'], 0)} "
                f"| {rate(turn['mean_cached_tokens'], 0)} | {turn['output_tokens_per_s']:.2f} | {turn['wall_s']:.2f} "
                f"| {turn['failed']} of {turn['requests']} |")
        lines += [
            "",
            f"- output tok/s: {rate(r['output_tokens_per_s'])} overall, {rate(r['output_tokens_per_s_turns_2_on'])} "
            "over turns >= 2",
            f"- ITL p50 {ms(r['itl_s']['p50'])} ms, p99 {ms(r['itl_s']['p99'])} ms "
            f"(p99 / p50 = {times(r['itl_p99_over_p50'])}); while prompts arrive p50 {ms(arriving['p50'])} ms, "
            f"p99 {ms(arriving['p99'])} ms",
            f"- TTFT p50 of turns >= 2 / turn 1 = {rate(r['ttft_p50_turns_2_on_over_turn_1'], 3)}",
            f"- mean tokens attended: {attended(r)}",
        ]
        if any(turn.get("verified_requests") for turn in r["turns"]):
            def by_turn(key: str, digits: int = 2) -> str:
                return " / ".join(rate(turn[key], digits) for turn in r["turns"])

            lines.append(f"- lossless, turn by turn: requests that verified {by_turn('verified_requests', 0)}; their "
                         f"mean acceptance {by_turn('mean_acceptance_rate', 3)}; tokens a verify "
                         f"{by_turn('mean_tokens_per_verify')}")
    compiled = [run for run in result["runs"] if "kernels_compiled" in run["load"]]
    if compiled:
        lines += ["", "## Triton kernels compiled inside the timed loads", "",
                  "(each server on a Triton cache of its own; the warm-up requests' compiles excluded)", ""]
        for run in compiled:
            names = collections.Counter(run["load"]["kernels_compiled"])
            listed = ", ".join(f"{name} x{count}" if count > 1 else name for name, count in sorted(names.items()))
            lines.append(f"- {run['name']}, {run['workload']}, {run['clients']} clients: {sum(names.values())}"
                         + (f" ({listed})" if listed else ""))
    for c in result.get("quest_vs_dense", []):
        if c.get("workload") == "multi-turn":
            lines += ["", "## Quest vs dense, multi-turn", "",
                      f"- output tokens/s over turns >= 2: Quest / dense = {times(c['turns_2_on_output_ratio'])}",
                      f"- output tokens/s overall: Quest / dense = {times(c['output_tokens_per_s_ratio'])}",
                      f"- inter-token latency p50: dense / Quest = {times(c['itl_p50_speedup'])}"]
            continue
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


def attended(load: dict) -> str:
    return "-" if load["mean_tokens_attended"] is None else f"{load['mean_tokens_attended']:.0f}"


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    return None if not (numerator and denominator) else numerator / denominator


def compare_multi_turn(dense_run: dict, quest_run: dict) -> dict:
    dense, quest = dense_run["load"], quest_run["load"]
    return {
        "workload": "multi-turn",
        "turns_2_on_output_ratio": ratio(quest["output_tokens_per_s_turns_2_on"],
                                         dense["output_tokens_per_s_turns_2_on"]),
        "output_tokens_per_s_ratio": ratio(quest["output_tokens_per_s"], dense["output_tokens_per_s"]),
        "itl_p50_speedup": ratio(dense["itl_s"]["p50"], quest["itl_s"]["p50"]),
    }


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


# The --smoke run: a tiny random Llama on the CPU, chunks of 32 tokens (prompts of 100: several chunks each).
SMOKE_SERVER = ("--load-format dummy --device cpu --dtype float32 --page-size 4 --max-model-len 512 "
                "--kv-cache-memory 16MiB --max-num-seqs 8 --max-num-batched-tokens 32 --graph-capture lazy")
SMOKE_SETTINGS = {"budget": 16, "clients": [4], "prompt_tokens": 100, "output_tokens": 8, "token_range": (1, 500),
                  "workload": "both", "multi_turn_clients": 4, "documents": 2, "doc_tokens": 96, "turns": 3,
                  "question_tokens": 8, "request_timeout": 120.0}


def tiny_model(folder: Path) -> Path:
    """A tiny random Llama's ``config.json`` in ``folder`` (served with ``--load-format dummy``)."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024).save_pretrained(folder)
    return folder


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server's base URL")
    where.add_argument("--start", metavar="'MODEL ARGS'", help="start `python -m questkv.server MODEL ARGS` here")
    where.add_argument("--compare", metavar="'MODEL ARGS'",
                       help="start the server dense (these arguments), then with --budget added, in turn")
    where.add_argument("--smoke", action="store_true",
                       help="--compare on the CPU with a tiny random model and short prompts (seconds): a check")
    parser.add_argument("--budget", type=int, default=256, help="the Quest server's --budget with --compare")
    parser.add_argument("--quest-server-args", default="", metavar="'ARGS'",
                        help="more arguments of the Quest server with --compare, e.g. --speculative-config "
                        "'{\"method\": \"quest\", \"num_speculative_tokens\": 4}' (lossless Quest against dense)")
    parser.add_argument("--quest", type=json.loads, default=None,
                        help='the requests\' quest field as JSON (e.g. \'{"token_budget": 256}\'); default none')
    parser.add_argument("--workload", choices=["single", "multi-turn", "both"], default="single",
                        help="single-turn loads (--clients), the multi-turn long-document load, or both in turn on "
                        "each server (default single)")
    parser.add_argument("--clients", type=client_counts, default=[8],
                        help="concurrent clients; a comma list runs each load in turn on the same server (default 8)")
    parser.add_argument("--requests-per-client", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--output-tokens", "--max-tokens", dest="output_tokens", type=int, default=32,
                        help="max_tokens of every request (default 32)")
    parser.add_argument("--multi-turn-clients", type=int, default=16, help="clients of the multi-turn load (16)")
    parser.add_argument("--documents", type=int, default=8, help="distinct documents of the multi-turn load (8)")
    parser.add_argument("--doc-tokens", type=int, default=32768, help="tokens per document (32768)")
    parser.add_argument("--turns", type=int, default=4, help="turns per multi-turn client (4)")
    parser.add_argument("--question-tokens", type=int, default=32, help="tokens of each turn's new question (32)")
    parser.add_argument("--token-range", type=lambda text: tuple(int(x) for x in text.split(",")),
                        default=(1000, 40000), help="prompt token ids are drawn from [LOW, HIGH) (default 1000,40000)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of servers started here")
    parser.add_argument("--request-timeout", type=float, default=900.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="for the provenance's machine line")
    parser.add_argument("--note", action="append", default=[], help="a line for the report's notes")
    parser.add_argument("--out", type=Path, help="write <out>.json and <out>.md")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="serve-load-model-") as tmp:
        if args.smoke:
            for name, value in SMOKE_SETTINGS.items():
                setattr(args, name, value)
            args.compare = f"{tiny_model(Path(tmp))} {SMOKE_SERVER}"
        result = run_all(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
        Path(f"{args.out}.md").write_text(markdown(result))
    print(markdown(result))
    return result


def run_all(args) -> dict:
    """Every load of ``args`` on every server it names; the result with provenance."""
    if args.url:
        plans = [("url", None, args.quest)]
    elif args.start:
        plans = [("start", shlex.split(args.start), args.quest)]
    else:
        base = shlex.split(args.compare)
        quest_server = base + ["--budget", str(args.budget)] + shlex.split(args.quest_server_args)
        plans = [("dense", base, args.quest), ("quest", quest_server, args.quest)]
    loads = [("single", clients) for clients in args.clients] if args.workload in ("single", "both") else []
    if args.workload in ("multi-turn", "both"):
        loads.append(("multi-turn", args.multi_turn_clients))
    runs = []
    for name, server_args, quest in plans:
        server = None if server_args is None else Server(server_args, args.threads)
        url = args.url if server is None else server.url
        done = []
        try:
            for workload, clients in loads:
                print(f"[{name}] {workload}, {clients} clients on {url} ...", flush=True)
                load = asyncio.run(run_load(url, args, quest, clients) if workload == "single"
                                   else run_multi_turn(url, args, quest))
                timed_from = load.pop("timed_from")
                if server is not None:  # first uses inside the timed load (its warm-up excluded)
                    load["kernels_compiled"] = server.compiled_since(timed_from)
                done.append((workload, clients, load))
        finally:
            code = None if server is None else server.stop()
        for workload, clients, load in done:
            run: dict[str, Any] = {"name": name, "workload": workload, "clients": clients, "quest_field": quest,
                                   "load": load, "server": args.url if server is None else " ".join(server_args)}
            if server is not None:
                run["startup_s"], run["exit_code"] = server.startup_s, code
            runs.append(run)
            print(f"[{name}, {workload}, {clients} clients] {rate(load['output_tokens_per_s'])} output tok/s, "
                  f"ITL p50 {ms(load['itl_s']['p50'])} ms p99 {ms(load['itl_s']['p99'])} ms, "
                  f"failed {load['failed']}", flush=True)
    result: dict[str, Any] = {
        "provenance": provenance(args.device),
        "settings": {k: getattr(args, k) for k in (
            "workload", "clients", "requests_per_client", "prompt_tokens", "output_tokens", "multi_turn_clients",
            "documents", "doc_tokens", "turns", "question_tokens", "token_range", "threads", "seed", "budget")},
        "runs": runs,
        "notes": args.note,
    }
    if len(plans) == 2:
        by_name = {(run["name"], run["workload"], run["clients"]): run for run in runs}
        result["quest_vs_dense"] = [
            (compare if workload == "single" else compare_multi_turn)(
                by_name["dense", workload, clients], by_name["quest", workload, clients])
            for workload, clients in loads]
    return result


if __name__ == "__main__":
    main()
