"""A request in, engine calls, a response or SSE chunks out: OpenAI's completions and chat completions.

:class:`OpenAIServing` validates what needs the engine's configuration (the served model's name, the prompt's
tokens and length, ``max_tokens`` against ``max_model_len`` — refused, never clamped —, the Quest budget), on
the event loop with its own copy of the tokenizer and without touching the engine's state; the engine thread
then runs ``LLMEngine.add_request`` (which checks again, the KV pool included) and its ``ValueError`` comes back
as a 400 too. Errors become HTTP answers in one place, :func:`to_request_error`:
:class:`~questkv.server.protocol.RequestError` as it says, any other ``ValueError`` (the engine's, naming the
field) -> 400, :class:`~questkv.server.engine_loop.QueueFull` -> 503 with ``Retry-After``, a failed step and
any other exception -> 500 (logged; that request only, the connection kept), the request timeout -> 504;
each with OpenAI's error object, and each request counted once in ``questkv_requests_total``.

The event loop only moves bytes: the body is read within ``max_request_bytes`` (else 413) and
``body_read_timeout`` seconds (else 408; both close the connection), then parsed, validated and tokenised off the
event loop, so a multi-megabyte prompt never stalls ``/health`` or the other streams. Two preparing threads share
the server's tokenizer copy (never the engine thread's): bodies of ``large_body_bytes`` or more are prepared on
one, the others on the other, each in arrival order, so a small request never waits behind a large prompt's
tokenisation.

Streams are server-sent events as OpenAI sends them: ``data: {chunk}\\n\\n`` ... ``data: [DONE]\\n\\n``. The
streamed text is always a prefix of the final text: while a request runs, the last ``len(longest stop) - 1``
characters (a stop string may be forming) and a trailing incomplete character are held back. A client that
goes away aborts its request (streaming: the response is cancelled; otherwise ``is_disconnected`` is polled).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import logging
import time
import uuid
from typing import AsyncIterator, Optional, Union

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from questkv.engine.sampling_params import check_length
from questkv.engine.sampling_params import SamplingParams
from questkv.engine.sequence import RequestOutput
from questkv.server import protocol
from questkv.server.limits import DEFAULT_BODY_READ_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES
from questkv.server.engine_loop import ACCEPTED, EngineFailure, EngineLoop, QueueFull, RequestStream, ShuttingDown
from questkv.server.protocol import ChatCompletionRequest, CompletionRequest, QuestOptions, RequestError
from questkv.validation import check_float, check_int, check_text

__all__ = ["DEFAULT_BODY_READ_TIMEOUT", "DEFAULT_MAX_REQUEST_BYTES", "OpenAIServing", "error_response",
           "to_request_error"]

logger = logging.getLogger("questkv.server")
_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
_DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
_LARGE_BODY_BYTES = 256 << 10  # a body of this size or more is prepared on the large bodies' thread


def error_response(error: RequestError) -> JSONResponse:
    return JSONResponse(protocol.error_body(error.message, error.type, error.param, error.code),
                        status_code=error.status, headers=error.headers)


def _internal(message: str) -> RequestError:
    return RequestError(message, status=500, type="internal_error", code="internal_error")


def _timeout(seconds: float) -> RequestError:
    return RequestError(f"the request did not finish within --request-timeout {seconds:g} s and was aborted",
                        status=504, type="request_timeout", code="request_timeout")


def _unavailable(message: str) -> RequestError:
    return RequestError(message, status=503, type="overloaded_error", code="server_overloaded",
                        headers={"Retry-After": "1"})


def to_request_error(error: BaseException, prompt_param: Optional[str] = "prompt") -> RequestError:
    """The one translation of an exception into an HTTP error (anything unexpected is logged, and a 500)."""
    if isinstance(error, RequestError):
        return error
    if isinstance(error, (QueueFull, ShuttingDown)):
        return _unavailable(str(error))
    if isinstance(error, ValueError):  # the engine's or SamplingParams' refusal, naming the field
        param = getattr(error, "param", None) or _engine_param(str(error), prompt_param)
        return RequestError(str(error), param=param)
    if isinstance(error, EngineFailure):
        return _internal(str(error))
    logger.error("internal error serving a request: %r", error, exc_info=error)
    return _internal(f"internal error: {error!r}")


def request_status(error: RequestError) -> str:
    """The ``questkv_requests_total`` status of a request answered with ``error``."""
    if error.status == 499:
        return "abort"
    if error.status == 503:
        return "rejected"
    if error.status == 504:
        return "timeout"
    return "invalid" if error.status < 500 else "error"


class _Outcome:
    """Counts a request in ``questkv_requests_total`` exactly once."""

    def __init__(self, metrics) -> None:
        self.metrics, self.status = metrics, None

    def finish(self, status: str) -> None:
        if self.status is None:
            self.status = status
            self.metrics.count_request(status)


class _EngineStreamingResponse(StreamingResponse):
    """A stream that aborts its request however the response ends (a cancelled send included)."""

    def __init__(self, content, stream: RequestStream, outcome: _Outcome, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._stream, self._outcome = stream, outcome

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._stream.finished:
                self._stream.close()
                self._outcome.finish("abort")


class OpenAIServing:
    """The OpenAI endpoints over one :class:`EngineLoop`.

    Args:
        engine_loop: the loop owning the engine (started by the app's lifespan).
        served_model_name: the name requests must give in ``model`` (``model`` may also be omitted, or be the
            name the engine was loaded by).
        request_timeout: seconds from arrival after which an unfinished request is aborted (504).
    """

    def __init__(self, engine_loop: EngineLoop, served_model_name: str, request_timeout: float = 600.0,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 body_read_timeout: float = DEFAULT_BODY_READ_TIMEOUT) -> None:
        if not isinstance(served_model_name, str) or not served_model_name:
            raise ValueError(f"OpenAIServing.served_model_name must be a non-empty str, got {served_model_name!r}")
        check_float("OpenAIServing.request_timeout", request_timeout, low=0.0, low_open=True)
        check_int("OpenAIServing.max_request_bytes", max_request_bytes, minimum=1)
        check_float("OpenAIServing.body_read_timeout", body_read_timeout, low=0.0, low_open=True)
        self.max_request_bytes = max_request_bytes
        self.body_read_timeout = float(body_read_timeout)
        self.loop = engine_loop
        self.metrics = engine_loop.metrics
        engine = engine_loop.engine
        self.served_model_name = served_model_name
        self.model_names = {served_model_name, str(engine.model_name)}
        self.request_timeout = float(request_timeout)
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.spec.vocab_size
        self._resolve_quest = engine.resolve_quest  # reads the engine's configuration only
        # Tokens one request may cache (the pool as built, before any request; capped by a page-table row): a
        # request that leaves max_tokens out gets the rest of the context, within this.
        cache = engine.cache
        self.max_cached_tokens = min(cache.num_free_pages, cache.max_pages_per_seq) * cache.page_size
        # The engine thread detokenises with the engine's tokenizer; the preparing threads encode with this copy.
        self.tokenizer = None if engine.tokenizer is None else copy.deepcopy(engine.tokenizer)
        if self.tokenizer is not None:
            # A call settles a fast tokenizer's truncation and padding to what every later call asks (none), so
            # the two preparing threads' calls only read it (they run in Rust, without the GIL, side by side).
            self.tokenizer("", add_special_tokens=True)
        self.created = protocol.now()
        # Parsing, validation and tokenisation run off the event loop, bodies of large_body_bytes or more on a
        # thread of their own: [0] the small bodies', [1] the large bodies'.
        self.large_body_bytes = _LARGE_BODY_BYTES
        self._prepare_pools = tuple(
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"questkv-prepare-{size}")
            for size in ("small", "large"))

    def close(self) -> None:
        """Stop the preparing threads (requests being prepared finish; none is started after)."""
        for pool in self._prepare_pools:
            pool.shutdown(wait=False, cancel_futures=True)

    # ---- endpoints ---------------------------------------------------------------------------------------------

    async def create_completion(self, request: Request) -> Response:
        return await self._handle(request, self._prepare_completion, "cmpl", "prompt")

    async def create_chat_completion(self, request: Request) -> Response:
        return await self._handle(request, self._prepare_chat, "chatcmpl", "messages")

    async def _handle(self, request: Request, prepare, prefix: str, prompt_param: str) -> Response:
        """Read, prepare (on the preparing thread of its body's size) and serve one request; every exception ends
        here."""
        outcome = _Outcome(self.metrics)
        try:
            raw = await self._read_body(request)
            body, token_ids, params = await asyncio.get_running_loop().run_in_executor(
                self._prepare_pools[len(raw) >= self.large_body_bytes], prepare, raw)
            return await self._serve(request, body, token_ids, params, prefix, prompt_param, outcome)
        except Exception as error:  # the one place an exception becomes an HTTP answer
            answer = to_request_error(error, prompt_param)
            outcome.finish(request_status(answer))
            return error_response(answer)

    def _prepare_completion(self, raw: bytes):
        body = protocol.parse_request(CompletionRequest, raw)
        self._check_model(body.model)
        token_ids = self._prompt_ids(body.prompt)
        return body, token_ids, self._sampling_params(body, len(token_ids), _DEFAULT_COMPLETION_MAX_TOKENS, "prompt")

    def _prepare_chat(self, raw: bytes):
        body = protocol.parse_request(ChatCompletionRequest, raw)
        self._check_model(body.model)
        token_ids = self._chat_ids(body)
        return body, token_ids, self._sampling_params(body, len(token_ids), None, "messages")

    async def _read_body(self, request: Request) -> bytes:
        """The body, within ``max_request_bytes`` (413) and ``body_read_timeout`` seconds (408)."""
        limit = self.max_request_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise _too_large(f"{int(length)} bytes", limit)

        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(f"more than {limit} bytes", limit)
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            return await asyncio.wait_for(read(), self.body_read_timeout)
        except asyncio.TimeoutError:
            raise RequestError(f"the body did not arrive within --body-read-timeout {self.body_read_timeout:g} s",
                               status=408, code="request_timeout", headers={"Connection": "close"}) from None
        except ClientDisconnect:
            raise RequestError("the client went away while sending the body", status=499,
                               code="client_disconnected") from None

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.served_model_name, "object": "model", "created": self.created,
                                            "owned_by": "questkv", "max_model_len": self.max_model_len}]}

    def health(self) -> Response:
        if not self.loop.is_running:
            return JSONResponse({"status": "unavailable", **self.loop.stats}, status_code=503)
        return JSONResponse({"status": "ok", **self.loop.stats})

    # ---- validation against the engine's configuration ---------------------------------------------------------

    def _check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in self.model_names:
            raise RequestError(f"the model {model!r} does not exist: this server serves {self.served_model_name!r}",
                               param="model", status=404, code="model_not_found")

    def token_text(self, token_id: int) -> str:
        """One token's text in a ``logprobs`` object: the tokenizer's decoding of it alone, or ``token_id:N`` (vLLM's
        spelling) for a model without a tokenizer."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("a text prompt needs a tokenizer, and this model (dummy weights) has none: send token ids",
                               param="prompt")
        check_text("prompt", text)  # as LLMEngine._tokenize checks and tokenises
        try:
            return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
        except (TypeError, ValueError, UnicodeError) as error:
            raise RequestError(f"prompt: the tokenizer cannot encode this text: {error}", param="prompt") from None

    def _prompt_ids(self, prompt: Union[str, list[int]]) -> list[int]:
        token_ids = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}", param="prompt")
        if not token_ids:
            raise RequestError("prompt is empty: it must hold at least one token", param="prompt")
        return token_ids

    def _chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        tokenizer = self.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise RequestError("this model's tokenizer has no chat template: use /v1/completions", param="messages")
        try:
            text = tokenizer.apply_chat_template(body.message_dicts(), add_generation_prompt=True, tokenize=False)
        except Exception as error:  # a template that refuses these messages (roles, order)
            raise RequestError(f"the chat template refused these messages: {error}", param="messages") from None
        token_ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is not None and len(token_ids) > 1 and token_ids[0] == token_ids[1] == bos:
            token_ids = token_ids[1:]  # the template wrote the BOS the tokenizer adds again
        return token_ids

    def _sampling_params(self, body, num_prompt_tokens: int, default_max_tokens: Optional[int],
                         prompt_param: str) -> SamplingParams:
        limit = self.max_model_len
        if body.max_tokens is None:
            room = max(min(limit, self.max_cached_tokens + 1) - num_prompt_tokens, 1)  # the engine refuses the rest
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        else:
            max_tokens = body.max_tokens
        try:  # the engine's own rule
            check_length(num_prompt_tokens, max_tokens, limit, prompt=prompt_param)
        except ValueError as error:
            raise RequestError(str(error), param="max_tokens" if "max_tokens" in str(error) else prompt_param) from None
        quest = body.quest or QuestOptions()
        try:  # the engine's own rule, its message naming the request's fields
            self._resolve_quest(quest.token_budget, quest.selection_interval, quest.dense, owner="quest",
                                speculative_tokens=quest.speculative_tokens)
        except ValueError as error:
            raise RequestError(str(error), param=_engine_param(str(error), prompt_param)) from None
        if body.stop_list and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer, and this model (dummy weights) has none", param="stop")
        return SamplingParams(  # its ValueError names the field (to_request_error maps it to a 400)
            temperature=1.0 if body.temperature is None else float(body.temperature),
            top_p=1.0 if body.top_p is None else float(body.top_p),
            seed=body.seed, max_tokens=max_tokens, stop=body.stop_list,
            token_budget=quest.token_budget, dense=quest.dense, ignore_eos=body.ignore_eos,
            selection_interval=quest.selection_interval, speculative_tokens=quest.speculative_tokens,
            logprobs=body.num_logprobs,
        )

    # ---- running a request -------------------------------------------------------------------------------------

    async def _serve(self, request: Request, body, token_ids: list[int], params: SamplingParams, prefix: str,
                     prompt_param: str, outcome: _Outcome) -> Response:
        deadline = time.monotonic() + self.request_timeout
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        stream = self.loop.submit(request_id, token_ids, params)  # QueueFull, ShuttingDown: 503
        try:
            first = await stream.get(max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            stream.close()
            outcome.finish("timeout")
            return error_response(_timeout(self.request_timeout))
        except BaseException:  # cancelled while queued
            stream.close()
            outcome.finish("abort")
            raise
        if first != ACCEPTED:
            error = self._event_error(first, prompt_param)
            outcome.finish(request_status(error))
            return error_response(error)
        run = _Run(self, body, request_id, stream, params, len(token_ids), deadline, outcome, prefix == "chatcmpl")
        if body.stream:
            return _EngineStreamingResponse(run.events(), stream, outcome, media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await run.collect(request)

    def _event_error(self, event, prompt_param: str) -> RequestError:
        if isinstance(event, BaseException):
            return to_request_error(event, prompt_param)
        return _internal(f"unexpected engine event {event!r}")


def _too_large(size: str, limit: int) -> RequestError:
    return RequestError(f"the body has {size}; this server takes at most --max-request-bytes {limit}", status=413,
                        code="request_too_large", headers={"Connection": "close"})


def _engine_param(message: str, prompt_param: str) -> Optional[str]:
    """The request field an engine ``ValueError`` is about."""
    for word, param in (("dense=", "quest.dense"), ("speculative_tokens", "quest.speculative_tokens"),
                        ("token_budget", "quest.token_budget"),
                        ("selection_interval", "quest.selection_interval"), ("max_tokens", "max_tokens"), ("top_p", "top_p"),
                        ("temperature", "temperature"), ("seed", "seed"), ("stop", "stop"), ("prompt", prompt_param)):
        if word in message:
            return param
    return None


class _Run:
    """One accepted request: collected into one response, or streamed as chunks."""

    def __init__(self, serving: OpenAIServing, body, request_id: str, stream: RequestStream, params: SamplingParams,
                 num_prompt_tokens: int, deadline: float, outcome: _Outcome, chat: bool) -> None:
        self.serving, self.body, self.request_id, self.stream = serving, body, request_id, stream
        self.params, self.num_prompt_tokens, self.deadline, self.outcome, self.chat = (
            params, num_prompt_tokens, deadline, outcome, chat)
        self.model = body.model or serving.served_model_name
        self.created = protocol.now()
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.returns_token_ids = body.return_token_ids or serving.tokenizer is None
        self.sent_logprobs = 0  # the output tokens whose log-probabilities a stream chunk carried
        self.sent_text_offset = 0  # and the length of their texts (a completion's text_offset goes on from it)

    def _remaining(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0)

    def _final(self, output: RequestOutput) -> tuple[dict, dict]:
        usage = protocol.usage(self.num_prompt_tokens, len(output.token_ids), output.metrics.num_cached_tokens)
        return usage, protocol.quest_echo(output.quest, output.metrics)

    def _fail(self, event) -> RequestError:
        error = self.serving._event_error(event, "prompt")
        self.outcome.finish(request_status(error) if error.status >= 500 else "error")
        return error

    async def collect(self, request: Request) -> Response:
        """Wait for the final output (aborting if the client goes away or the deadline passes)."""
        next_check = time.monotonic() + _POLL_S
        try:
            while True:
                try:
                    event = await self.stream.get(min(_POLL_S, self._remaining()))
                except asyncio.TimeoutError:
                    event = None
                if self._remaining() <= 0 and event is None:
                    self.stream.close()
                    self.outcome.finish("timeout")
                    return error_response(_timeout(self.serving.request_timeout))
                if time.monotonic() >= next_check:  # tokens may flow faster than the poll: check by the clock
                    next_check = time.monotonic() + _POLL_S
                    if await request.is_disconnected():
                        self.stream.close()
                        self.outcome.finish("abort")
                        return Response(status_code=499)
                if isinstance(event, Exception):
                    return error_response(self._fail(event))
                if isinstance(event, RequestOutput) and event.finished:
                    return self._response(event)
        except BaseException as error:  # cancelled (the client went away), or a bug: a 500 from _handle
            self.stream.close()
            self.outcome.finish("error" if isinstance(error, Exception) else "abort")
            raise

    def _response(self, output: RequestOutput) -> Response:
        if output.finish_reason == "abort":
            return error_response(self._fail(EngineFailure("the engine aborted the request")))
        usage, quest = self._final(output)
        build = protocol.chat_response if self.chat else protocol.completion_response
        self.outcome.finish(output.finish_reason)
        token_ids = list(output.token_ids) if self.returns_token_ids else None
        return JSONResponse(build(self.request_id, self.model, output.text, output.finish_reason, usage, quest,
                                  self.created, token_ids, self._logprobs(output, 0)))

    def _logprobs(self, output: RequestOutput, start: int) -> Optional[dict]:
        """The choice's ``logprobs`` for ``output``'s tokens from ``start`` on (``None`` when the request asked for
        none)."""
        if output.logprobs is None:
            return None
        entries, token_ids, text = output.logprobs[start:], list(output.token_ids[start:]), self.serving.token_text
        if self.chat:
            return protocol.chat_logprobs(entries, token_ids, text, self.params.logprobs)
        logprobs = protocol.completion_logprobs(entries, token_ids, text, self.sent_text_offset)
        self.sent_text_offset += sum(map(len, logprobs["tokens"]))
        return logprobs

    def _chunk(self, text: Optional[str] = None, finish_reason: Optional[str] = None, usage: Optional[dict] = None,
               quest: Optional[dict] = None, role: bool = False, token_ids: Optional[list[int]] = None,
               output: Optional[RequestOutput] = None) -> str:
        """One SSE line; ``output``: the request's output so far, whose tokens' log-probabilities not yet sent go
        with this chunk (when it asked for them)."""
        include = self.body.include_usage
        logprobs = None
        if output is not None and output.logprobs is not None:
            logprobs, self.sent_logprobs = self._logprobs(output, self.sent_logprobs), len(output.token_ids)
        if self.chat:
            delta = None
            if text is not None:
                delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            chunk = protocol.chat_chunk(self.request_id, self.model, self.created, delta, finish_reason, usage,
                                        include, quest, token_ids, logprobs)
        else:
            chunk = protocol.completion_chunk(self.request_id, self.model, self.created, text, finish_reason, usage,
                                              include, quest, token_ids, logprobs)
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    async def events(self) -> AsyncIterator[str]:
        """SSE lines: (chat: a role chunk,) text chunks, the finishing chunk, (the usage chunk,) ``[DONE]``.

        A text chunk goes out when the visible text grows, or, when token ids are returned, when tokens arrive."""
        sent, sent_ids = "", 0
        try:
            if self.chat:
                yield self._chunk("", role=True)
            while True:
                try:
                    event = await self.stream.get(self._remaining())
                except asyncio.TimeoutError:
                    self.stream.close()
                    self.outcome.finish("timeout")
                    yield self._error_event(_timeout(self.serving.request_timeout))
                    return
                if isinstance(event, Exception):
                    yield self._error_event(self._fail(event))
                    return
                if not isinstance(event, RequestOutput):
                    continue
                if event.finished and event.finish_reason == "abort":
                    yield self._error_event(self._fail(EngineFailure("the engine aborted the request")))
                    return
                text = self._visible(event, sent)
                delta = text[len(sent):] if text.startswith(sent) else ""
                new_ids = list(event.token_ids[sent_ids:]) if self.returns_token_ids else None
                sent_ids = len(event.token_ids)
                if not event.finished:
                    if delta or new_ids:
                        sent += delta
                        yield self._chunk(delta, token_ids=new_ids, output=event)
                    continue
                usage, quest = self._final(event)
                if self.chat:
                    if delta or new_ids or len(event.token_ids) > self.sent_logprobs and event.logprobs is not None:
                        yield self._chunk(delta, token_ids=new_ids, output=event)
                    yield self._chunk("", finish_reason=event.finish_reason, quest=quest,
                                      token_ids=[] if self.returns_token_ids else None)
                else:
                    yield self._chunk(delta, finish_reason=event.finish_reason, quest=quest, token_ids=new_ids,
                                      output=event)
                if self.body.include_usage:
                    yield self._chunk(None, usage=usage, quest=quest)
                self.outcome.finish(event.finish_reason)
                yield "data: [DONE]\n\n"
                return
        except Exception as error:  # a bug: this stream ends with a 500 error event, the connection kept
            self.stream.close()
            yield self._error_event(self._fail(error))
        finally:
            if not self.stream.finished:  # cancelled by a client that went away
                self.stream.close()
                self.outcome.finish("abort")

    def _visible(self, output: RequestOutput, sent: str) -> str:
        text = output.text
        if output.finished:
            return text
        if self.hold:
            text = text[: max(len(text) - self.hold, 0)]
        while text.endswith("\ufffd"):
            text = text[:-1]
        return text if len(text) >= len(sent) else sent

    def _error_event(self, error: RequestError) -> str:
        body = protocol.error_body(error.message, error.type, error.param, error.code)
        return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"
