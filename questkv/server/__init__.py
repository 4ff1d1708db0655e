"""An OpenAI-compatible HTTP server over the engine, with per-request Quest budgets.

``python -m questkv.server --model MODEL [flags]`` (or ``questkv serve``); the pieces, top down: :mod:`.app` (routes),
:mod:`.serving` (requests to engine calls and back), :mod:`.protocol` (OpenAI shapes, the ``quest``
extension, errors), :mod:`.engine_loop` (the engine's thread), :mod:`.metrics` (``/metrics``), :mod:`.cli`
(flags and start-up). Importing this package imports neither FastAPI nor uvicorn.
"""

__all__ = ["DEFAULT_BODY_READ_TIMEOUT", "DEFAULT_MAX_REQUEST_BYTES", "add_serve_args", "run_server"]

from questkv.server.limits import DEFAULT_BODY_READ_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES


def add_serve_args(parser) -> None:
    """See :func:`questkv.server.launch.add_serve_args`."""
    from questkv.server.launch import add_serve_args as add

    add(parser)


def run_server(args) -> int:
    """See :func:`questkv.server.launch.run_server`."""
    from questkv.server.launch import run_server as run

    return run(args)
