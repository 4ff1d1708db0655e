"""The server's command line: :func:`add_serve_args` adds its flags to a parser and :func:`run_server` runs it,
so that ``python -m questkv.server`` and ``questkv serve`` are one command.

``run_server`` loads the engine, builds the app, listens, prints ``questkv server ready on http://HOST:PORT``
(flushed, on stdout) once the socket accepts connections, and returns 0 after a SIGTERM or SIGINT: uvicorn stops
accepting, open requests get ``--shutdown-grace`` seconds to finish, the rest are aborted, the engine thread
stops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import signal
import sys

from questkv.cli_args import add_quest_args, quest_config

__all__ = ["add_serve_args", "run_server"]

logger = logging.getLogger("questkv.server")

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _non_negative_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative number of seconds")
    return value


def _bytes(text: str) -> int:
    """``"4GiB"``, ``"512MiB"``, ``"2G"`` or a plain number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]i?)?[bB]?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (e.g. 4GiB, 512MiB, 1000000)")
    value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1]")
    return value


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add ``MODEL``, the engine flags, the Quest flags and the server flags to ``parser``."""
    parser.add_argument("model", metavar="MODEL",
                        help="what questkv.LLM takes: an alias (smollm2-135m), an HF folder or a .gguf file; with "
                        "--load-format dummy, a folder with config.json (random weights; its tokenizer if it has one)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="where the engine runs; auto: CUDA when available (default: auto)")
    engine.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="weights and KV cache; auto: bfloat16 on CUDA, float32 on CPU (default: auto)")
    engine.add_argument("--max-num-seqs", type=_positive_int, default=32,
                        help="the most requests decoded together (default: 32)")
    engine.add_argument("--max-model-len", type=_positive_int, default=None,
                        help="the most tokens per request, prompt and output (default: the model's)")
    engine.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                        help="the most prompt tokens per prefill step (default: max(max-model-len, 8192))")
    engine.add_argument("--kv-cache-memory", type=_bytes, default=None,
                        help="KV-cache size, e.g. 4GiB (default: --gpu-memory-utilization of the free GPU memory, "
                        "or 1 GiB on CPU)")
    engine.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9,
                        help="fraction of the free GPU memory the KV cache may take (default: 0.9)")
    engine.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    engine.add_argument("--seed", type=_non_negative_int, default=0,
                        help="seeds dummy weights and requests without a seed (default: 0)")
    engine.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="auto: the checkpoint's weights; dummy: random weights at the model's shapes (default: auto)")
    quest = parser.add_argument_group("quest (the engine's; a request may lower the budget or ask for dense)")
    add_quest_args(quest)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    server.add_argument("--port", type=_non_negative_int, default=8000,
                        help="port to listen on; 0 picks a free one (default: 8000)")
    server.add_argument("--max-waiting", type=_non_negative_int, default=256,
                        help="the most requests waiting for admission; beyond it 503 with Retry-After (default: 256)")
    server.add_argument("--request-timeout", type=_seconds, default=600.0,
                        help="seconds after which an unfinished request is aborted with 504 (default: 600)")
    server.add_argument("--served-model-name", default=None,
                        help="the model name requests give and /v1/models lists (default: MODEL as given)")
    server.add_argument("--shutdown-grace", type=_non_negative_seconds, default=30.0,
                        help="on SIGTERM, seconds open requests may take to finish before they are aborted (default: 30)")
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="server log level (default: info)")
    server.add_argument("--access-log", action="store_true", help="log every request")


def _engine_config(args: argparse.Namespace):
    import torch

    from questkv.engine.config import EngineConfig

    device = None if args.device == "auto" else args.device
    on_cuda = device == "cuda" or (device is None and torch.cuda.is_available())
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if on_cuda else "float32")
    return EngineConfig(
        model=args.model, quest=quest_config(args), dtype=dtype, device=device, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager, seed=args.seed, load_format=args.load_format,
    )


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; returns the exit status (0 after a clean shutdown, 2 for bad arguments)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        config = _engine_config(args)  # bad knobs fail here, before the model loads
    except ValueError as error:
        print(f"questkv serve: error: {error}", file=sys.stderr)
        return 2

    def _exit_while_loading(signum, frame):
        raise SystemExit(0)

    previous = {sig: signal.signal(sig, _exit_while_loading) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        from questkv.engine.llm_engine import LLMEngine

        try:
            engine = LLMEngine(config)
        except (ValueError, FileNotFoundError) as error:
            print(f"questkv serve: error: {error}", file=sys.stderr)
            return 2
        # uvicorn restores the handlers it found and re-raises the signal it caught once it has shut down: make
        # that a no-op, so that a graceful shutdown ends with exit status 0.
        for sig in previous:
            signal.signal(sig, lambda signum, frame: None)
        return _serve(engine, args)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(engine, args: argparse.Namespace) -> int:
    import uvicorn

    from questkv.server.app import build_app
    from questkv.server.engine_loop import EngineLoop

    engine_loop = EngineLoop(engine, max_waiting=args.max_waiting)
    app = build_app(engine_loop, args.served_model_name or args.model, request_timeout=args.request_timeout,
                    shutdown_grace=args.shutdown_grace)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log,
                            timeout_graceful_shutdown=args.shutdown_grace, lifespan="on")

    class _Server(uvicorn.Server):
        loop = None

        async def startup(self, sockets=None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)
            if self.started and not self.should_exit:
                port = self.servers[0].sockets[0].getsockname()[1] if self.servers else args.port
                host = f"[{args.host}]" if ":" in args.host else args.host
                print(f"questkv server ready on http://{host}:{port}", flush=True)

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                engine_loop.begin_shutdown()  # new requests get 503 from now on
                # Just before uvicorn's grace runs out, abort what is left, so that each client gets an error
                # (an SSE error event and [DONE], or a 503) rather than a cut connection.
                delay = max(args.shutdown_grace - 0.5, 0.0)
                if self.loop is not None:
                    with contextlib.suppress(RuntimeError):
                        self.loop.call_soon_threadsafe(self.loop.call_later, delay, engine_loop.abort_all)
            super().handle_exit(sig, frame)

    server = _Server(config)
    server.run()
    if engine_loop.started and engine_loop.is_alive():
        logger.error("the engine thread is still alive after shutdown")
    return 0 if server.started else 1
