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
import signal
import sys

from questkv.cli_args import add_engine_args, add_quest_args, engine_kwargs, int_at_least, quest_config, seconds
from questkv.server.limits import DEFAULT_BODY_READ_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES

__all__ = ["add_serve_args", "run_server", "serve_model"]

logger = logging.getLogger("questkv.server")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--model`` (or its positional alias ``MODEL``: :func:`serve_model` reads them), the engine flags, the
    Quest flags and the server flags to ``parser``."""
    parser.add_argument("--model", default=None,
                        help="what questkv.LLM takes: an alias (smollm2-135m), an HF folder or a .gguf file; with "
                        "--load-format dummy, a folder with config.json (random weights; its tokenizer if it has "
                        "one) (required: --model or MODEL)")
    parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                        help="the same as --model, positional (`questkv serve MODEL`, as vLLM's serve)")
    add_engine_args(parser, seed_help="seeds dummy weights and requests without a seed", serving=True)
    quest = parser.add_argument_group("quest (the engine's; a request may lower the budget or ask for dense)")
    add_quest_args(quest)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    server.add_argument("--port", type=int_at_least(0), default=8000,
                        help="port to listen on; 0 picks a free one (default: 8000)")
    server.add_argument("--max-waiting", type=int_at_least(0), default=256,
                        help="the most requests waiting for admission; beyond it 503 with Retry-After (default: 256)")
    server.add_argument("--request-timeout", type=seconds(), default=600.0,
                        help="seconds after which an unfinished request is aborted with 504 (default: 600)")
    server.add_argument("--max-request-bytes", type=int_at_least(1), default=DEFAULT_MAX_REQUEST_BYTES,
                        help="the largest request body in bytes; a larger one is answered 413 and its connection "
                        f"closed (default: {DEFAULT_MAX_REQUEST_BYTES}, {DEFAULT_MAX_REQUEST_BYTES >> 20} MiB)")
    server.add_argument("--body-read-timeout", type=seconds(), default=DEFAULT_BODY_READ_TIMEOUT,
                        help="seconds a client may take to send a request body once its headers are in; then 408 "
                        f"and the connection closed (default: {DEFAULT_BODY_READ_TIMEOUT:g})")
    server.add_argument("--served-model-name", default=None,
                        help="the model name requests give and /v1/models lists (default: MODEL as given)")
    server.add_argument("--shutdown-grace", type=seconds(allow_zero=True), default=30.0,
                        help="on SIGTERM, seconds open requests may take to finish before they are aborted "
                        "(default: 30)")
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="server log level (default: info)")
    server.add_argument("--access-log", action="store_true", help="log every request")


def serve_model(args: argparse.Namespace) -> str:
    """The model to serve: ``--model`` or the positional ``MODEL``.

    Raises:
        ValueError: neither is given, or both are and differ.
    """
    named, positional = args.model, args.model_positional
    if named is None and positional is None:
        raise ValueError("a model is required: --model MODEL (or MODEL, positional)")
    if named is not None and positional is not None and named != positional:
        raise ValueError(f"MODEL {positional!r} and --model {named!r} differ; give the model once")
    return named if named is not None else positional


def _engine_config(args: argparse.Namespace):
    from questkv.engine.engine_config import EngineConfig

    return EngineConfig(model=args.model, quest=quest_config(args), **engine_kwargs(args))


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; returns the exit status (0 after a clean shutdown, 2 for bad arguments, 1
    when the engine failed for good: a tensor-parallel rank died or hung)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        args = argparse.Namespace(**{**vars(args), "model": serve_model(args)})
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

    # A tensor-parallel rank that died ends the engine: stop serving, and exit non-zero (below).
    engine_loop = EngineLoop(engine, max_waiting=args.max_waiting,
                             on_fatal=lambda: setattr(server, "should_exit", True))
    app = build_app(engine_loop, args.served_model_name or args.model, request_timeout=args.request_timeout,
                    shutdown_grace=args.shutdown_grace, max_request_bytes=args.max_request_bytes,
                    body_read_timeout=args.body_read_timeout)
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
    if engine_loop.fatal_error is not None:
        print(f"questkv serve: error: {engine_loop.fatal_error}", file=sys.stderr)
        return 1
    return 0 if server.started else 1
