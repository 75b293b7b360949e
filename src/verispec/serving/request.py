"""What the HTTP server and the Ray batch job share about one request: its generation settings, its
prompt ids from a chat, and the OpenAI error shape for what is wrong with it."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from verispec.engine import Engine, GenerationConfig
from verispec.errors import InvalidParameterError, PromptError
from verispec.sampling.processors import SamplingParams
from verispec.serving.http.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest

__all__ = ["chat_prompt_ids", "describe_invalid", "error_response", "request_config"]


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = {429: "rate_limit_error", 500: "server_error", 503: "server_error", 504: "timeout_error"}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def describe_invalid(errors: list[dict]) -> tuple[int, str, str | None]:
    """(status, message, param) for pydantic validation errors of a request body: the first problem, named."""
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    if first["type"] == "json_invalid":
        return 400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    path = [str(part) for part in first["loc"] if part != "body"]
    if not path:
        return 422, f"the request body is invalid ({first['msg']}): send a JSON object", None
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return 422, f"invalid '{'.'.join(path)}': {first['msg']}{more}", path[0]


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


def request_config(body: CompletionRequest | ChatCompletionRequest, default_max_tokens: int) -> GenerationConfig:
    sampling = SamplingParams(
        temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p, eta=body.eta,
        epsilon=body.epsilon, repetition_penalty=body.repetition_penalty,
    )
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > 4:
        raise InvalidParameterError(f"stop: at most 4 stop strings, got {len(stop)}")
    if any(not s for s in stop):
        raise InvalidParameterError("stop: stop strings must be non-empty")
    return GenerationConfig(max_new_tokens=body.max_tokens or default_max_tokens, sampling=sampling, seed=body.seed,
                            stop=stop, drafter=body.drafter, gamma=body.gamma, gamma_policy=body.gamma_policy)
