"""Request and response bodies of the OpenAI-compatible API (pydantic), plus verispec's extras.

Requests accept OpenAI's fields (model, max_tokens, temperature, top_p, n, stop, seed, stream,
stream_options) and verispec's extras: sampling (top_k, min_p, eta, epsilon, repetition_penalty)
and speculation (drafter, gamma, gamma_policy) for this one request.
Ranges are checked here so that a bad value is a 422 naming the field; fields OpenAI defines that
verispec does not use (presence_penalty, user, …) are accepted and ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from verispec.sampling.processors import MIN_REPETITION_PENALTY, MIN_TEMPERATURE

__all__ = [
    "CompletionRequest", "ChatCompletionRequest", "ChatMessage", "Usage", "CompletionResponse",
    "ChatCompletionResponse", "ModelList", "ErrorResponse",
]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationFields(BaseModel):
    model: str = Field(description="the served model's id (see /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="new tokens at most (default: the server's)")
    temperature: float = Field(1.0, ge=0, le=100, description=f"0 = greedy, else ≥ {MIN_TEMPERATURE}")
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=16, description="choices per request; this server generates one (n > 1 is refused)")
    stop: str | list[str] | None = Field(None, description="up to 4 stop strings")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int = Field(0, ge=0, description="0 = off")
    min_p: float = Field(0.0, ge=0, lt=1)
    eta: float = Field(0.0, ge=0, lt=1, description="η-sampling (0 = off; 0.0009 is usual)")
    epsilon: float = Field(0.0, ge=0, lt=1, description="ε-sampling (0 = off)")
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=100, description="1 = off")
    drafter: str | None = Field(None, min_length=1, max_length=200, description=(
        "drafter spec for this request (none, ngram[:max_n=3], stand, model, tree, hybrid, …; see `verispec "
        "generate --help`); those needing a draft model use the one the server loaded. Default: the server's"))
    gamma: int | None = Field(None, ge=1, le=64, description="(starting) draft length γ; default: the server's")
    gamma_policy: Literal["constant", "heuristic", "analytic"] | None = Field(None, description="default: the server's")

    @field_validator("temperature")
    @classmethod
    def _temperature_is_zero_or_usable(cls, value: float) -> float:
        # logits / 1e-300 overflow to inf and the distribution becomes NaN: refuse such values up front
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return value


class CompletionRequest(_GenerationFields):
    prompt: str | list[int] = Field(description="text, or token ids")
    max_tokens: int | None = Field(16, ge=1, description="new tokens at most")


class TextPart(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    steps: int = Field(description="target verification passes")
    mean_accepted_length: float = Field(description="τ: tokens emitted per step")
    acceptance_rate: float = Field(description="α: accepted / judged draft tokens")
    per_position_acceptance: list[float] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None
    origins: list[str] = Field(default_factory=list, description="per token: accepted / recovered / bonus / target")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None
    origins: list[str] = Field(default_factory=list)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "verispec"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
