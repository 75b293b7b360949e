"""What the HTTP server and the Ray batch job share about one request: its generation settings, its
prompt ids from a chat, which drafter specs a request may pick, and the OpenAI error shape for what is
wrong with it."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from verispec.drafters import check_drafter_spec
from verispec.engine import Engine, GenerationConfig
from verispec.errors import InvalidParameterError, PromptError
from verispec.sampling.processors import SamplingParams
from verispec.serving.http.schemas import UNSUPPORTED, ChatCompletionRequest, ChatMessage, CompletionRequest

__all__ = ["chat_prompt_ids", "check_request_drafter", "describe_invalid", "error_response", "invalid", "request_config"]

ERROR_TYPES = {401: "authentication_error", 408: "timeout_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error",
               504: "timeout_error"}
# A request's drafter is built on the serving engine's worker from models already in memory (the
# engine's frozen ModelCache refuses any other name or path). These would still touch the disk or
# copy a model per request: the online drafter saves and loads adapters, int8= re-reads and
# quantizes the weights, vocab= may read the output head from the model's files.
REQUEST_REFUSED_KINDS = {"online": "it trains the draft model and saves adapters to disk"}
REQUEST_REFUSED_OPTIONS = {"int8": "it reads and quantizes the weights again", "vocab": "it may read the output head from disk"}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status,
                        headers=headers)


def invalid(message: str, param: str | None) -> InvalidParameterError:
    """An InvalidParameterError that names the request field it is about (a server's 400 `param`)."""
    error = InvalidParameterError(message)
    error.param = param
    return error


def _field_path(loc: tuple) -> list[str]:
    """A pydantic error location as field names: without "body" and without union branch tags
    (`str`, `list[int]`, `function-after[…]`), which say which alternative failed, not where."""
    return [str(part) for part in loc if part not in ("body", "str", "int") and not (isinstance(part, str) and "[" in part)]


def describe_invalid(errors: list[dict]) -> tuple[int, str, str | None]:
    """(status, message, param) for pydantic validation errors of a request body: the first problem, named.
    A value an unimplemented OpenAI field cannot take, an unknown field and text that is not valid
    Unicode are 400s; a value out of range is a 422."""
    unicode = [error for error in errors if error["type"] == "unicode_invalid"]  # whichever union branch
    first = (unicode or errors or [{"type": "", "loc": (), "msg": "invalid request"}])[0]
    if first["type"] == "json_invalid":
        return 400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    path = _field_path(first["loc"])
    if not path:
        return 422, f"the request body is invalid ({first['msg']}): send a JSON object", None
    field = ".".join(path)
    if path[0] in UNSUPPORTED and len(path) <= 2:
        return 400, f"{path[0]}: {UNSUPPORTED[path[0]].format(input=first.get('input'))}", path[0]
    if first["type"] == "extra_forbidden":
        return 400, f"unknown field '{field}': this server does not implement it (see /openapi.json for every field)", path[0]
    if first["type"] == "unicode_invalid":
        return 400, f"invalid '{field}': {first['msg']}", path[0]
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return 422, f"invalid '{field}': {first['msg']}{more}", path[0]


def check_request_drafter(spec: str | None, served_spec: str | None) -> None:
    """Refuse a request's drafter spec that would read files or build a new model copy (see
    REQUEST_REFUSED_KINDS/OPTIONS) or that the factory would refuse (`check_drafter_spec`: unknown
    options, ranges, tree sizes), here and not once it reaches the worker; names of models not loaded
    are refused by the engine's ModelCache when the drafter is built."""
    if spec is None or spec.strip() == (served_spec or "").strip():
        return
    kind, _, rest = spec.strip().partition(":")
    if kind in REQUEST_REFUSED_KINDS:
        raise invalid(f"drafter: {kind!r} cannot be picked per request ({REQUEST_REFUSED_KINDS[kind]}): "
                      "start the server with --draft naming it", "drafter")
    for item in rest.split(","):
        option = item.partition("=")[0].strip()
        if "=" in item and option in REQUEST_REFUSED_OPTIONS:
            raise invalid(f"drafter: option {option}= cannot be used per request ({REQUEST_REFUSED_OPTIONS[option]}): "
                          "start the server with --draft naming it", "drafter")
    try:
        check_drafter_spec(spec)
    except InvalidParameterError as error:
        raise invalid(f"drafter: {error}", "drafter") from None


def chat_prompt_ids(engine: Engine, messages: list[ChatMessage]) -> list[int]:
    """Token ids of a whole conversation through the target's chat template (runs on the worker)."""
    tokenizer = engine.target.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError(f"model {engine.target.name!r} has no chat template: use /v1/completions with a plain prompt")
    if not any(m.text().strip() for m in messages):
        raise PromptError("every message is empty: give some text to answer")
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return engine.prompt_ids(tokenizer(text, add_special_tokens=False)["input_ids"])


def _max_new_tokens(body: CompletionRequest | ChatCompletionRequest, default: int, limit: int | None) -> int:
    field, requested = body.token_budget()
    if field != "max_tokens" and body.max_tokens is not None and body.max_tokens != requested:
        raise invalid(f"{field}: {requested} differs from max_tokens {body.max_tokens}: send one of them", field)
    if limit is not None and requested is not None and requested > limit:
        raise invalid(f"{field}: {requested} is more than this server's limit of {limit} new tokens per request", field)
    return requested or (default if limit is None else min(default, limit))


def _logprobs(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """None: no log-probabilities; k: each token's and its k most likely alternatives."""
    if not isinstance(body, ChatCompletionRequest):
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs: needs logprobs: true", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def _response_format(body: CompletionRequest | ChatCompletionRequest) -> dict | None:
    """The grammar constraint for the engine (`GenerationConfig.response_format`); None: free text."""
    fmt = getattr(body, "response_format", None)
    if fmt is None:
        return None
    if (fmt.type == "json_schema") != (fmt.json_schema is not None):
        raise invalid("response_format: json_schema goes with type json_schema, and type json_schema needs it", "response_format")
    return None if fmt.type == "text" else fmt.model_dump(by_alias=True, exclude_none=True)


def request_config(body: CompletionRequest | ChatCompletionRequest, default_max_tokens: int,
                   max_tokens_limit: int | None = None) -> GenerationConfig:
    sampling = SamplingParams(
        temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p, eta=body.eta,
        epsilon=body.epsilon, repetition_penalty=body.repetition_penalty,
    )
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > 4:
        raise invalid(f"stop: at most 4 stop strings, got {len(stop)}", "stop")
    if any(not s for s in stop):
        raise invalid("stop: stop strings must be non-empty", "stop")
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options: only allowed with stream: true", "stream_options")
    return GenerationConfig(max_new_tokens=_max_new_tokens(body, default_max_tokens, max_tokens_limit), sampling=sampling,
                            seed=body.seed, stop=stop, drafter=body.drafter, gamma=body.gamma, gamma_policy=body.gamma_policy,
                            logprobs=_logprobs(body), response_format=_response_format(body))
