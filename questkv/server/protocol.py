"""OpenAI's request and response shapes for the server, the ``quest`` extension, and the error object.

This module owns what a request may say without knowing the engine: types (strict: ``"16"`` is not an int),
ranges, ``n == 1``, the fields of ``quest`` and the no-op values of the OpenAI fields we do not implement.
Checks that need the engine (the model's name, the prompt's length, the budget against the engine's page size
and maximum) are :mod:`questkv.server.serving`'s. Every refusal is a :class:`RequestError` naming the field
(``param``), rendered by :func:`error_body` as ``{"error": {"message", "type", "param", "code"}}``. Before the
fields, :func:`parse_request` refuses a body nested deeper than :data:`MAX_JSON_DEPTH` levels and any string
(key or value) that is not valid Unicode (a lone surrogate such as ``"\\ud800"``), with the wording of
:func:`questkv.validation.check_text`, which the engine uses for its prompts and stop strings too.

Log-probabilities (OpenAI's): a completion's ``logprobs: N`` (an integer in ``[0, 20]``: each token's and the ``N``
most likely tokens', as ``{tokens, token_logprobs, top_logprobs, text_offset}``), a chat's ``logprobs: true`` with
``top_logprobs: N`` (``{content: [{token, logprob, bytes, top_logprobs}]}``), in responses and stream chunks alike;
the engine's :attr:`~questkv.engine.sequence.RequestOutput.logprobs` (a lossless request's are dense attention's).

OpenAI fields accepted but not implemented, each only at a value that changes nothing (else 400 naming it):
``echo`` (``false``), ``best_of``
(``null``/``1``), ``suffix`` (``null``/``""``), ``logit_bias`` (``null``/``{}``), ``presence_penalty`` and
``frequency_penalty`` (``null``/``0``), ``tools`` (``null``/``[]``), ``tool_choice`` (``null``/``"none"``/
``"auto"``), ``response_format`` (``null`` or ``{"type": "text"}``). Accepted and ignored, being harmless:
``user``, ``metadata``, ``store``, ``service_tier``, ``parallel_tool_calls``. Any other field is refused
(400 naming it), so that a typo such as ``max_token`` is not silently ignored. Extensions: ``quest`` (ours),
``ignore_eos`` and ``return_token_ids`` (vLLM's: each choice, and each stream chunk's choice, carries the
``token_ids`` it adds; a server without a tokenizer returns them always, its text being empty).
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from pydantic import field_validator, model_validator

from questkv.config import RequestQuest
from questkv.engine.sampling_params import MAX_LOGPROBS
from questkv.engine.sequence import Logprob, RequestMetrics
from questkv.validation import check_text

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "QuestOptions",
    "RequestError",
    "StreamOptions",
    "error_body",
    "parse_request",
]

Number = Union[StrictInt, StrictFloat]


class RequestError(ValueError):
    """A refused request: an HTTP ``status``, the OpenAI error ``type`` and ``code``, and the field (``param``)."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 type: str = "invalid_request_error", code: Optional[str] = "invalid_value",
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code
        self.headers = headers or {}


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class QuestOptions(_Strict):
    """Our extension: ``{"token_budget": 512}`` (a Quest budget, a multiple of the page size up to the engine's),
    ``{"selection_interval": 2}`` (decode steps per page selection, up to the engine's), ``{"speculative_tokens":
    4}`` (on a lossless engine, ``--speculative-config``: draft tokens per round in ``[0, 16]``, 0: lossy Quest),
    any of them together, ``{"dense": true}`` (attend every page), or ``{}`` (the engine's default). Only the types
    are checked here: the values are the engine's to judge (:meth:`questkv.config.RequestQuest.resolve`, with the
    same messages)."""

    token_budget: Optional[StrictInt] = None
    dense: StrictBool = False
    selection_interval: Optional[StrictInt] = None
    speculative_tokens: Optional[StrictInt] = None


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _Common(_Strict):
    """Fields shared by completions and chat completions."""

    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    seed: Optional[StrictInt] = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    n: Optional[StrictInt] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    quest: Optional[QuestOptions] = None
    ignore_eos: StrictBool = False  # vLLM's extension: generate max_tokens whatever the model's EOS (benchmarks)
    return_token_ids: StrictBool = False  # vLLM's extension: choices carry the generated token ids
    logprobs: Union[StrictBool, StrictInt, None] = None  # a completion's: an int; a chat's: a bool
    top_logprobs: Optional[StrictInt] = None  # a chat's
    # OpenAI fields accepted only at their no-op values (see the module docstring)
    logit_bias: Optional[dict[str, Any]] = None
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    # harmless, ignored
    user: Optional[StrictStr] = None
    metadata: Optional[dict[str, Any]] = None
    store: Optional[StrictBool] = None
    service_tier: Optional[StrictStr] = None

    @model_validator(mode="after")
    def _check_common(self) -> _Common:
        if self.max_tokens is not None and self.max_tokens < 1:
            _refuse("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            _refuse("temperature", f"temperature must be in [0, 2], got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            _refuse("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            _refuse("seed", f"seed must be in [0, 2**63), got {self.seed}")
        if self.n is not None and self.n != 1:
            _refuse("n", f"n={self.n} is not supported: this server returns one choice per request (n=1); "
                         "send the request several times (with different seeds) for several samples")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            _refuse("stop", f"stop must hold non-empty strings, got {self.stop!r}")
        if len(stops) > 4:
            _refuse("stop", f"stop takes at most 4 strings, got {len(stops)}")
        if self.stream_options is not None and not self.stream:
            _refuse("stream_options", "stream_options is only allowed with stream=true")
        if self.logit_bias:
            _refuse("logit_bias", "logit_bias is not supported (only null or {})")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                _refuse(name, f"{name} is not supported (only null or 0), got {getattr(self, name)!r}")
        return self

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids (one prompt per request)."""

    prompt: Union[StrictStr, list[StrictInt]]
    echo: StrictBool = False
    best_of: Optional[StrictInt] = None
    suffix: Optional[StrictStr] = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            _refuse("prompt", "prompt is an empty list: it must hold at least one token id")
        if isinstance(self.prompt, str) and not self.prompt:
            _refuse("prompt", "prompt is an empty string: it must hold at least one token")
        if self.echo:
            _refuse("echo", "echo is not supported (only false)")
        if self.best_of not in (None, 1):
            _refuse("best_of", f"best_of={self.best_of} is not supported (only 1)")
        if self.suffix:
            _refuse("suffix", "suffix is not supported (only null or \"\")")
        if self.logprobs is True or isinstance(self.logprobs, int) and not 0 <= self.logprobs <= MAX_LOGPROBS:
            _refuse("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (the most likely tokens "
                                f"returned per token) or null, got {self.logprobs!r}")
        if self.top_logprobs is not None:
            _refuse("top_logprobs", "top_logprobs is a chat completion's field: a completion takes logprobs=N")
        return self

    @property
    def num_logprobs(self) -> Optional[int]:
        """``SamplingParams.logprobs``: the most likely tokens returned per output token; ``None``: none."""
        return None if self.logprobs is False else self.logprobs


class ChatMessage(_Strict):
    """One message: ``content`` is a string or a list of text parts (``[{"type": "text", "text": ...}]``)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[StrictStr, list[dict[str, Any]]]
    name: Optional[StrictStr] = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content):
        if isinstance(content, list):
            texts = []
            for i, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
                    raise ValueError(f"content[{i}] must be a text part {{\"type\": \"text\", \"text\": str}}; "
                                     f"only text is supported, got {part!r}")
                texts.append(part["text"])
            return "".join(texts)
        return content


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``: ``messages`` rendered with the tokenizer's chat template.
    ``max_completion_tokens`` is OpenAI's newer name for ``max_tokens`` (give one of them)."""

    messages: list[ChatMessage]
    max_completion_tokens: Optional[StrictInt] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[StrictStr, dict[str, Any], None] = None
    response_format: Optional[dict[str, Any]] = None
    parallel_tool_calls: Optional[StrictBool] = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if not self.messages:
            _refuse("messages", "messages is empty: it must hold at least one message")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                _refuse("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
            if self.max_completion_tokens < 1:
                _refuse("max_completion_tokens", f"max_completion_tokens must be >= 1, got {self.max_completion_tokens}")
            self.max_tokens = self.max_completion_tokens
        if self.tools:
            _refuse("tools", "tools are not supported (only null or [])")
        if self.tool_choice not in (None, "none", "auto"):
            _refuse("tool_choice", f"tool_choice is not supported (only null, \"none\" or \"auto\"), got {self.tool_choice!r}")
        if self.response_format not in (None, {"type": "text"}):
            _refuse("response_format", "response_format is not supported (only null or {\"type\": \"text\"})")
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            _refuse("logprobs", f"logprobs must be a bool in a chat completion (top_logprobs=N asks for the N most "
                                f"likely tokens), got {self.logprobs!r}")
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                _refuse("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
            if self.top_logprobs and not self.logprobs:
                _refuse("top_logprobs", "top_logprobs needs logprobs=true")
        return self

    @property
    def num_logprobs(self) -> Optional[int]:
        """``SamplingParams.logprobs``: the most likely tokens returned per output token; ``None``: none."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them (``developer`` is rendered as ``system``)."""
        out = []
        for message in self.messages:
            role = "system" if message.role == "developer" else message.role
            out.append({"role": role, "content": message.content})
        return out


class _Refusal(ValueError):
    """Raised inside validators to name the field; :func:`parse_request` turns it into a :class:`RequestError`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _refuse(param: str, message: str):
    raise _Refusal(param, message)


# loc entries that pydantic adds for the members of a union or a tagged type, not field names
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|literal|function-.*|.*\[.*\]|.*\(.*\))$")


def _param(loc: tuple) -> Optional[str]:
    parts = ""
    for item in loc:
        if isinstance(item, int):
            parts += f"[{item}]"
        elif isinstance(item, str) and not _TYPE_TAG.match(item) and item != "body":
            parts += ("." if parts else "") + item
    return parts or None


def parse_request(model: type[BaseModel], body: bytes) -> Any:
    """Parse and validate a JSON ``body`` as ``model``.

    Raises:
        RequestError: malformed JSON, a body that is not an object, a missing, unknown or mistyped field, or
            a value out of range; ``param`` names the field (``"quest.token_budget"``, ``"messages[0].role"``).
    """
    import json

    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError(f"the body is not valid JSON: {error}", code="invalid_json") from None
    except RecursionError:  # Python's parser recurses once per level: [[[[...]]]] beyond its stack
        raise RequestError(f"the body nests JSON arrays and objects too deeply (at most {MAX_JSON_DEPTH} levels)",
                           code="invalid_json") from None
    if not isinstance(data, dict):
        raise RequestError(f"the body must be a JSON object, got {type(data).__name__}", code="invalid_type")
    _check_tree(data)
    try:
        return model.model_validate(data)
    except _Refusal as refusal:  # raised directly by a model validator of the top-level model
        raise RequestError(str(refusal), param=refusal.param) from None
    except ValidationError as error:
        raise _from_validation_error(error) from None


MAX_JSON_DEPTH = 32  # a request nests 5 levels (messages[0].content[0].text); metadata may take a few more


def _check_tree(data: dict) -> None:
    """Refuse a body nested deeper than :data:`MAX_JSON_DEPTH` or holding a string that is not valid Unicode
    (a lone surrogate, which JSON's ``\\ud800`` can spell); walked without recursion, keys included."""
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            try:
                check_text(path or "the body", value)
            except ValueError as error:
                raise RequestError(str(error), param=path or None) from None
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise RequestError(f"the body nests JSON arrays and objects too deeply at {path or 'its top'} "
                               f"(at most {MAX_JSON_DEPTH} levels)", param=path or None, code="invalid_json")
        if isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)
                         if isinstance(item, (str, dict, list)))  # not once per token id
        else:
            for key, item in value.items():
                name = f"{path}.{key}" if path else key
                try:
                    check_text("a key", key)
                except ValueError as error:
                    raise RequestError(f"{path or 'the body'}: {error}", param=path or None) from None
                stack.append((item, name, depth + 1))


def _from_validation_error(error: ValidationError) -> RequestError:
    first = error.errors(include_url=False)[0]
    context = first.get("ctx") or {}
    inner = context.get("error")
    if isinstance(inner, _Refusal):
        return RequestError(str(inner), param=inner.param)
    param = _param(tuple(first["loc"]))
    kind = first["type"]
    if kind == "missing":
        return RequestError(f"{param} is required", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        return RequestError(f"unknown field {param!r}: this server does not support it", param=param,
                            code="unknown_parameter")
    if kind == "value_error":
        message = first["msg"].removeprefix("Value error, ")
        return RequestError(f"{param}: {message}" if param else message, param=param)
    shown = repr(first.get("input"))
    if len(shown) > 80:
        shown = shown[:77] + "..."
    union = [e for e in error.errors(include_url=False) if _param(tuple(e["loc"])) == param]
    if param in _UNION_TYPES and len(union) > 1 or param in _UNION_TYPES and len(first["loc"]) > 1:
        return RequestError(f"{param} must be {_UNION_TYPES[param]} (got {shown})", param=param, code="invalid_type")
    return RequestError(f"{param}: {first['msg']} (got {shown})" if param else first["msg"], param=param,
                        code="invalid_type")


# the fields whose type is a union, and how to say what they take
_UNION_TYPES = {"prompt": "a string or a list of token ids (integers)", "stop": "a string or a list of strings",
                "logprobs": "a bool or an integer", "temperature": "a number", "top_p": "a number",
                "presence_penalty": "a number", "frequency_penalty": "a number"}


def from_validation_errors(errors: list[dict]) -> RequestError:
    """A :class:`RequestError` of FastAPI's ``RequestValidationError.errors()`` (its first error)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": "value_error"}
    param = _param(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return RequestError(f"the body is not valid JSON: {first.get('msg')}", code="invalid_json")
    return RequestError(f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param=param)


def now() -> int:
    """OpenAI's ``created``: Unix seconds."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens``: the prompt tokens whose prefill the prefix cache
    skipped (whole pages, :attr:`~questkv.engine.sequence.RequestMetrics.num_cached_tokens`)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def quest_echo(quest: RequestQuest, metrics: RequestMetrics) -> dict:
    """Our extension in each final response: the budget, the selection interval (``None`` when dense) and the draft
    tokens per lossless round (0: lossy Quest, or dense) the engine resolved for the request, the KV tokens one
    decode step attended, averaged over the request's decode steps (``0.0`` when it had none: one output token),
    the fraction of (decode step, sparse layer, head) that selected (``None`` when dense or without decode steps),
    and once a verify step ran (lossless) the share of draft tokens kept (``acceptance_rate``, and per draft position
    of a round, ``acceptance_by_position``) and the tokens each verify step output (``mean_tokens_per_verify``)."""
    echo = {"token_budget": quest.token_budget, "dense": quest.dense,
            "selection_interval": None if quest.dense else quest.selection_interval,
            "speculative_tokens": quest.speculative_tokens,
            "mean_tokens_attended": float(metrics.mean_tokens_attended or 0.0),
            "selection_rate": metrics.selection_rate}
    if metrics.mean_tokens_per_verify is not None:
        echo.update(acceptance_rate=metrics.acceptance_rate, mean_tokens_per_verify=metrics.mean_tokens_per_verify,
                    acceptance_by_position=list(metrics.acceptance_by_position))
    return echo


def _with_token_ids(choice: dict, token_ids: Optional[list[int]]) -> dict:
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def completion_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], token_text,
                        first_offset: int = 0) -> dict:
    """A completion choice's ``logprobs`` for output tokens ``token_ids`` and their engine ``entries``
    (:attr:`~questkv.engine.sequence.RequestOutput.logprobs`): ``tokens`` (``token_text(id)``: each token's text),
    ``token_logprobs``, ``top_logprobs`` (per token, the output token and the most likely ones, by text) and
    ``text_offset`` (where each token's text starts in the completion's: the first at ``first_offset``, the length of
    the tokens' texts before it in a stream)."""
    texts = [token_text(token) for token in token_ids]
    offsets = [first_offset]
    for text in texts[:-1]:
        offsets.append(offsets[-1] + len(text))
    return {"tokens": texts, "token_logprobs": [entry[token].logprob for entry, token in zip(entries, token_ids)],
            "top_logprobs": [{token_text(t): lp.logprob for t, lp in entry.items()} for entry in entries],
            "text_offset": offsets[:len(texts)]}


def chat_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], token_text, top: int) -> dict:
    """A chat choice's ``logprobs``: ``content``, per output token its ``token`` text, ``logprob``, UTF-8 ``bytes``
    and the ``top`` most likely tokens (``top_logprobs``, most likely first), as OpenAI's."""
    def item(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for entry, token in zip(entries, token_ids):
        best = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= top)[:top]
        content.append({**item(token, entry[token].logprob),
                        "top_logprobs": [item(t, entry[t].logprob) for _, t in best]})
    return {"content": content}


def completion_response(request_id: str, model: str, text: str, finish_reason: Optional[str], usage_: dict,
                        quest: dict, created: int, token_ids: Optional[list[int]] = None,
                        logprobs: Optional[dict] = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [_with_token_ids(choice, token_ids)], "usage": usage_, "quest": quest}


def chat_response(request_id: str, model: str, text: str, finish_reason: Optional[str], usage_: dict,
                  quest: dict, created: int, token_ids: Optional[list[int]] = None,
                  logprobs: Optional[dict] = None) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
              "finish_reason": finish_reason}
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [_with_token_ids(choice, token_ids)], "usage": usage_, "quest": quest}


def completion_chunk(request_id: str, model: str, created: int, text: Optional[str] = None,
                     finish_reason: Optional[str] = None, usage_: Optional[dict] = None,
                     include_usage: bool = False, quest: Optional[dict] = None,
                     token_ids: Optional[list[int]] = None, logprobs: Optional[dict] = None) -> dict:
    """A ``text_completion`` stream chunk; ``text=None`` makes the usage chunk (``choices: []``)."""
    choices = [] if text is None else [_with_token_ids(
        {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}, token_ids)]
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if include_usage:
        chunk["usage"] = usage_
    if quest is not None:
        chunk["quest"] = quest
    return chunk


def chat_chunk(request_id: str, model: str, created: int, delta: Optional[dict] = None,
               finish_reason: Optional[str] = None, usage_: Optional[dict] = None,
               include_usage: bool = False, quest: Optional[dict] = None,
               token_ids: Optional[list[int]] = None, logprobs: Optional[dict] = None) -> dict:
    """A ``chat.completion.chunk``; ``delta=None`` makes the usage chunk (``choices: []``)."""
    choices = [] if delta is None else [_with_token_ids(
        {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}, token_ids)]
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices}
    if include_usage:
        chunk["usage"] = usage_
    if quest is not None:
        chunk["quest"] = quest
    return chunk
