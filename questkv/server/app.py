"""The FastAPI app: routes of a few lines each over :class:`~questkv.server.serving.OpenAIServing`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health`` (200 with
the pool and queue counts while serving, 503 once stopping), ``GET /metrics`` (Prometheus text). The lifespan
starts the engine loop's thread and, on shutdown, stops it (``shutdown_grace`` seconds for open requests,
then they are aborted). FastAPI's own validation errors and unknown routes come out as OpenAI error objects.
The completion routes answer every exception themselves (:func:`~questkv.server.serving.to_request_error`),
so that a 500 keeps the client's connection; the app's last-resort handler serves the other routes.
"""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from questkv.server import protocol
from questkv.server.engine_loop import EngineLoop
from questkv.server.serving import (
    DEFAULT_BODY_READ_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES, OpenAIServing, error_response, to_request_error,
)

__all__ = ["build_app"]

logger = logging.getLogger("questkv.server")


def build_app(engine_loop: EngineLoop, served_model_name: str, request_timeout: float = 600.0,
              shutdown_grace: float = 30.0, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              body_read_timeout: float = DEFAULT_BODY_READ_TIMEOUT) -> FastAPI:
    """The server's app over ``engine_loop`` (started by the app's lifespan if it is not yet).

    Args:
        engine_loop: owns the engine.
        served_model_name: the ``model`` requests give, and ``/v1/models`` lists.
        request_timeout: seconds after which an unfinished request is aborted (504).
        shutdown_grace: seconds the lifespan's shutdown lets open requests finish before aborting them.
        max_request_bytes: the largest request body (413 beyond it).
        body_read_timeout: seconds a client may take to send a body once its headers are in (408 beyond them).
    """
    serving = OpenAIServing(engine_loop, served_model_name, request_timeout, max_request_bytes, body_read_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine_loop.started:
            engine_loop.start()
        yield
        await engine_loop.shutdown(shutdown_grace)
        serving.close()

    app = FastAPI(title="questkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    app.state.engine_loop = engine_loop

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> Response:
        return error_response(protocol.from_validation_errors(list(error.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if error.status_code < 500 else "internal_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return JSONResponse(protocol.error_body(f"{request.method} {request.url.path}: {error.detail}", kind, None, code),
                            status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, error: Exception) -> Response:
        logger.error("internal error serving %s %s", request.method, request.url.path)
        return error_response(to_request_error(error, None))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.create_completion(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.create_chat_completion(request)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(serving.models())

    @app.get("/health")
    async def health() -> Response:
        return serving.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = engine_loop.metrics.render()
        return Response(body, media_type=content_type)

    return app
