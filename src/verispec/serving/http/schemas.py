"""Request and response bodies of the OpenAI-compatible API (pydantic), plus verispec's extras.

Requests accept OpenAI's fields (model, max_tokens / max_completion_tokens, temperature, top_p,
n (and on completions a list of prompts), presence_penalty, frequency_penalty, logit_bias, stop, seed, stream, stream_options, user) and verispec's
extras (vLLM's names where it has them): sampling (top_k, min_p, eta, epsilon, repetition_penalty), ending
(min_tokens, ignore_eos, stop_token_ids) and speculation (drafter, gamma, gamma_policy) for this one request.
`logprobs` (completions: how many alternatives; chat: `logprobs` + `top_logprobs`, at most
`MAX_TOP_LOGPROBS`), completions' `suffix` (fill in the middle: `verispec.models.infill`) and, on chat, `response_format` (text, json_object, json_schema) and `tools`
(`tool_choice` none, auto, required or a named function; `verispec.serving.tool_calls`) are implemented.
Ranges are checked here so that a bad value is a 422 naming the field. OpenAI fields this server
does not implement (`UNSUPPORTED`: best_of > 1, the deprecated functions) are
declared with the one neutral value they accept, so the OpenAPI schema says exactly what is accepted; any other value is a 400 naming the field, and an
unknown field is refused, never silently ignored. Text must be valid Unicode (no lone surrogates).
Types are strict: a number is not a string, an integer not `true` or 2.0 (`max_tokens: true` is not 1).
What the engine is asked (`logprob_count`, `grammar`, `token_budget`) is read by `verispec.serving.request`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from verispec.drafters.specs import MAX_GAMMA
from verispec.engine import MAX_STOP_TOKEN_IDS
from verispec.errors import InvalidParameterError
from verispec.sampling.grammar import MAX_FORMAT_CHARS
from verispec.sampling.processors import (
    MAX_BIASED_TOKENS, MAX_LOGIT_BIAS, MAX_PENALTY, MAX_TOP_LOGPROBS, MIN_REPETITION_PENALTY, MIN_TEMPERATURE,
)
from verispec.serving.tool_calls import call_grammar

MAX_CHOICES = 16  # the most choices (n) one request may ask for: each holds a batch slot
MAX_PROMPTS = 32  # the most prompts one completions request may give, and the most answers (prompts × n) it may ask for
MAX_TOOLS = 128  # the most tools one request may offer (OpenAI's bound)

__all__ = [
    "MAX_CHOICES", "MAX_PROMPTS", "template_tools", "TokenizeRequest", "TokenizeResponse", "DetokenizeRequest", "DetokenizeResponse", "CompletionRequest", "ChatCompletionRequest", "ChatMessage", "Usage", "CompletionResponse",
    "ChatCompletionResponse", "ModelList", "ErrorResponse", "UNSUPPORTED",
]

# field -> why only its neutral value is accepted (`{input}`: the value sent)
UNSUPPORTED = {
    "best_of": "this server generates one candidate per request (best_of must be 1 or absent)",
    "functions": "this server does not call functions (functions must be empty or absent)",
    "function_call": "this server does not call functions (function_call must be \"none\" or absent)",
}


def _encodable(value: str) -> str:
    """Refuse text that cannot be encoded (a lone surrogate such as "\\ud800", valid in JSON escapes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise PydanticCustomError(
            "unicode_invalid", "contains a lone surrogate {char} at character {at}: send valid Unicode text",
            {"char": ascii(value[error.start]), "at": error.start}) from None
    return value


def _not_boolean(value: Any) -> Any:
    """Refuse true/false where a number is expected (a Literal[1] takes True, which equals 1, even when strict)."""
    if isinstance(value, bool):
        raise PydanticCustomError("int_type", "Input should be a number, not {input}", {"input": str(value).lower()})
    return value


Text = Annotated[str, AfterValidator(_encodable)]
Empty = Annotated[list[dict[str, Any]], Field(max_length=0)]
One = Annotated[Literal[1], BeforeValidator(_not_boolean)]
TokenId = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]  # a JSON object's key: a token id as a string (OpenAI's)
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # a misspelt or unimplemented field is refused; no type coercion


MODEL_FIELD = ("the served model's id (see /v1/models); left out, the served model (as llama.cpp's and vLLM's servers "
               "take it; another id is refused)")


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="one last chunk with empty `choices` and the `usage`")


class _GenerationFields(_Body):
    model: Text | None = Field(None, description=MODEL_FIELD)
    max_tokens: int | None = Field(None, ge=1, description="new tokens at most (default: the server's; at most its limit)")
    temperature: float = Field(1.0, ge=0, le=100, description=f"0 = greedy, else ≥ {MIN_TEMPERATURE}")
    top_p: float = Field(1.0, gt=0, le=1)
    n: Annotated[int, BeforeValidator(_not_boolean)] = Field(1, ge=1, le=MAX_CHOICES, description=(
        "choices to generate for the prompt (each batched as a request of its own; with a seed, choice i uses seed + i)"))
    stop: Text | list[Text] | None = Field(None, description="up to 4 stop strings")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    user: Text | None = Field(None, max_length=256, description="a label for the caller (not used)")
    presence_penalty: Penalty = Field(0.0, description="subtracted from a token's logit if it came in the output so far")
    frequency_penalty: Penalty = Field(0.0, description="subtracted from a token's logit once per time it came in the output")
    logit_bias: dict[TokenId, Bias] | None = Field(None, max_length=MAX_BIASED_TOKENS, description=(
        "token id → bias added to its logit before sampling (±100 bans or forces a token)"))
    top_k: int = Field(0, ge=0, description="0 = off")
    min_p: float = Field(0.0, ge=0, lt=1)
    eta: float = Field(0.0, ge=0, lt=1, description="η-sampling (0 = off; 0.0009 is usual)")
    epsilon: float = Field(0.0, ge=0, lt=1, description="ε-sampling (0 = off)")
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=100, description="1 = off")
    drafter: Text | None = Field(None, min_length=1, max_length=200, description=(
        "drafter spec for this request (none, ngram[:max_n=3], stand, self:layers=L, tree, hybrid, …; see "
        "`verispec.drafters`) over the models the server loaded; no file paths, no online, no int8= or vocab=. "
        "Default: the server's"))
    gamma: int | None = Field(None, ge=1, le=MAX_GAMMA, description="(starting) draft length γ; default: the server's")
    min_tokens: int = Field(0, ge=0, description="no end of the answer (EOS, a stop token id) before this many new tokens")
    ignore_eos: bool = Field(False, description="generate past EOS (fixed-length benchmarks)")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS, description=(
        "token ids that end the answer as EOS does"))
    gamma_policy: Literal["constant", "heuristic", "analytic"] | None = Field(None, description="default: the server's")

    @field_validator("temperature")
    @classmethod
    def _temperature_is_zero_or_usable(cls, value: float) -> float:
        # logits / 1e-300 overflow to inf and the distribution becomes NaN: refuse such values up front
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return value

    def token_budget(self) -> tuple[str, int | None]:
        """(the field that sets the most new tokens, its value or None for the server's default)."""
        return "max_tokens", self.max_tokens

    def prompt_logprob_count(self) -> int | None:
        """None: no log-probabilities of the prompt's tokens; k: each one's and its k most likely alternatives."""
        return None

    def grammar(self) -> dict | None:
        """The grammar constraint for the engine (`GenerationConfig.response_format`); None: free text."""
        return None

    def infill(self) -> str | None:
        """The text after the gap for a fill-in-the-middle request (`GenerationConfig.suffix`), else None."""
        return None


class CompletionRequest(_GenerationFields):
    prompt: Text | list[int] | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)] \
        | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_PROMPTS)] = Field(description=(
            f"text, or token ids; or a list of up to {MAX_PROMPTS} of either: each answered in turn as its own request "
            "(choice index = prompt index × n + choice)"))
    max_tokens: int | None = Field(16, ge=1, description="new tokens at most")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "return the target's log-probability of each token and of its `logprobs` most likely alternatives"))
    echo: bool = Field(False, description=(
        "return the prompt before the answer (with `logprobs`: each prompt token's log-probability given the tokens "
        "before it, the first null, as for scoring); not with stream"))
    suffix: Text | None = Field(None, description=(
        "the text after the gap: the answer is what goes between the prompt and it (fill in the middle, for models "
        "with such tokens; a text prompt; not with echo); empty or absent: the prompt is continued"))
    best_of: One | None = Field(None, description="not implemented: 1 only")

    def logprob_count(self) -> int | None:
        """None: no log-probabilities; k: each token's and its k most likely alternatives."""
        return self.logprobs

    def prompt_logprob_count(self) -> int | None:
        if self.echo and self.stream:
            raise InvalidParameterError("echo: not with stream (send stream: false to get the prompt back)", param="echo")
        if self.echo and self.infill() is not None:
            raise InvalidParameterError("echo: not with suffix (the prompt is two texts around the answer)", param="echo")
        return self.logprobs if self.echo else None

    def infill(self) -> str | None:
        """The suffix, unless empty (then the prompt is continued as without one)."""
        return self.suffix or None

    def prompts(self) -> list[str | list[int]]:
        """Every prompt of the request (one, or each of a list), checked: at most MAX_PROMPTS answers in all."""
        batch = self.prompt if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int) else [self.prompt]
        if len(batch) * self.n > MAX_PROMPTS:
            raise InvalidParameterError(f"n: {len(batch)} prompts × n = {self.n} asks for {len(batch) * self.n} answers; "
                                        f"at most {MAX_PROMPTS} per request", param="n")
        return batch


class TextPart(_Body):
    type: Literal["text"] = "text"
    text: Text


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionCall(_Body):
    name: FunctionName
    arguments: Text = Field(description="the arguments as JSON text")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            if isinstance(json.loads(value), dict):
                return value
        except ValueError:
            pass
        raise ValueError("must be a JSON object, as text")


class ToolCall(_Body):
    id: Text = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS, description="an assistant's calls (assistant only)")
    tool_call_id: Text | None = Field(None, max_length=256, description="the call a tool message answers (tool only)")

    @model_validator(mode="after")
    def _calls_and_answers_in_their_roles(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message makes calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id: only a tool message answers a call")
        return self

    def turn(self) -> dict:
        """This message as the chat template takes it (a call's arguments as an object, as templates render them)."""
        turn = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            turn["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": json.loads(call.function.arguments)}} for call in self.tool_calls]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        return turn

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: Text | None = Field(None, max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON Schema the answer must follow")
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = Field(None, description="with type json_schema only")


class FunctionDefinition(_Body):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments (an object)")
    strict: bool | None = Field(None, description="accepted; with tool_choice required or named the schema is enforced")


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """`tools` as the chat template takes them (None: none offered)."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


class NamedFunction(_Body):
    name: FunctionName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="the same as max_tokens (OpenAI's newer name)")
    logprobs: bool | None = Field(None, description="return the target's log-probability of each output token")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="alternatives per token (needs logprobs: true)")
    response_format: ResponseFormat | None = Field(None, description=(
        "json_object: any JSON value; json_schema: JSON following `json_schema.schema` (grammar-constrained, "
        "lossless w.r.t. the constrained target)"))
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description=(
        "functions the model may call (models whose chat template offers tools in the Hermes format, e.g. Qwen2.5)"))
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(None, description=(
        "auto (the default with tools): the model decides; required or a named function: the answer is calls only, "
        "grammar-constrained to the parameter schemas; none: the tools are not shown to the model"))
    parallel_tool_calls: bool | None = Field(None, description=(
        "false: one call at most in an answer constrained to calls (tool_choice required or named)"))
    functions: Empty | None = Field(None, description="not implemented: empty only")
    function_call: Literal["none"] | None = Field(None, description="not implemented: \"none\" only")

    def token_budget(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super().token_budget()

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs: needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (tools offered, tool_choice not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    def offered_tools(self) -> list[dict] | None:
        """The tools the chat template shows the model (None: none), after checking `tool_choice` against them."""
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise InvalidParameterError("tool_choice: needs tools", param="tool_choice")
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) < len(names):
            raise InvalidParameterError("tools: two tools have the same name", param="tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidParameterError(f"tool_choice: no tool is named {choice.function.name!r}", param="tool_choice")
        return None if choice == "none" else template_tools(self.tools)

    def _call_grammar(self) -> dict | None:
        """The grammar of an answer of calls only, when `tool_choice` asks for one (required, or a named tool)."""
        choice = self.tool_choice
        if choice != "required" and not isinstance(choice, NamedToolChoice):
            return None
        if self.response_format is not None and self.response_format.type != "text":
            raise InvalidParameterError("response_format: goes with free text, not with tool_choice required or named",
                                        param="response_format")
        functions = [tool["function"] for tool in self.offered_tools() or []]
        if isinstance(choice, NamedToolChoice):
            functions = [f for f in functions if f["name"] == choice.function.name]
        try:
            grammar = call_grammar(functions, parallel=self.parallel_tool_calls is not False)
        except Exception as error:  # noqa: BLE001 — whatever xgrammar says of a schema it cannot take
            raise InvalidParameterError(f"tools: a parameters schema cannot be enforced: {error}", param="tools") from None
        if len(grammar) > MAX_FORMAT_CHARS:
            raise InvalidParameterError(f"tools: their schemas make a grammar of over {MAX_FORMAT_CHARS} characters: "
                                        "offer fewer or smaller tools", param="tools")
        return {"type": "grammar", "grammar": grammar}

    def grammar(self) -> dict | None:
        calls = self._call_grammar()
        if calls is not None:
            return calls
        fmt = self.response_format
        if fmt is None:
            return None
        if (fmt.type == "json_schema") != (fmt.json_schema is not None):
            raise InvalidParameterError("response_format: json_schema goes with type json_schema, and type json_schema needs it",
                                        param="response_format")
        return None if fmt.type == "text" else fmt.model_dump(by_alias=True, exclude_none=True)


class TokenizeRequest(_Body):
    model: Text | None = Field(None, description=MODEL_FIELD)
    prompt: Text | None = Field(None, description="text, encoded as /v1/completions does (no chat template)")
    messages: list[ChatMessage] | None = Field(None, min_length=1, description="a chat, encoded as /v1/chat/completions does")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description="with messages: the tools the template shows")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' (text) and 'messages' (a chat)")
        return self


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int = Field(description="prompt + new tokens this server allows a request")


class DetokenizeRequest(_Body):
    model: Text | None = Field(None, description=MODEL_FIELD)
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=1 << 20, description="token ids")


class DetokenizeResponse(BaseModel):
    prompt: str


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
    logprobs: dict | None = Field(None, description="tokens, token_logprobs, top_logprobs, text_offset")
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
    content: str | None
    tool_calls: list[ToolCall] | None = Field(None, description="the calls the model made (finish_reason tool_calls)")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict | None = Field(None, description="content: [{token, logprob, bytes, top_logprobs}]")
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
