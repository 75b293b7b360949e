"""What the HTTP server and the Ray batch job share about one request: its generation settings, its
prompt ids from a chat, and which drafter specs a request may pick.

Free of the web layer: a body is anything with the fields of the API's request bodies (`RequestBody`:
`verispec.serving.http.schemas`' requests, the batch job's records), and what is wrong with it is an
InvalidParameterError naming the field (`param`), which the server turns into its 400.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from verispec.drafters import DrafterSpec
from verispec.engine import Engine, GenerationConfig
from verispec.errors import InvalidParameterError, PromptError
from verispec.sampling.processors import SamplingParams
from verispec.serving.tool_calls import OPEN, offers_tools

__all__ = ["ChatTurn", "RequestBody", "chat_prompt_ids", "check_request_drafter", "request_config"]

# A request's drafter is built on the serving engine's worker from models already in memory (the
# engine's frozen ModelCache refuses any other name or path). These would still touch the disk or
# copy a model per request: the online drafter saves and loads adapters, int8= re-reads and
# quantizes the weights, vocab= may read the output head from the model's files.
REQUEST_REFUSED_KINDS = {"online": "it trains the draft model and saves adapters to disk"}
REQUEST_REFUSED_OPTIONS = {"int8": "it reads and quantizes the weights again", "vocab": "it may read the output head from disk"}
MAX_STOP_STRINGS = 4


class RequestBody(Protocol):
    """The settings of one request, as the API's request bodies hold them."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    eta: float
    epsilon: float
    repetition_penalty: float
    max_tokens: int | None
    stop: str | list[str] | None
    seed: int | None
    stream: bool
    stream_options: object | None
    drafter: str | None
    gamma: int | None
    gamma_policy: str | None
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: list[int] | None

    def token_budget(self) -> tuple[str, int | None]:
        """(the field that sets the most new tokens, its value or None)."""

    def logprob_count(self) -> int | None:
        """None: no log-probabilities; k: each token's and its k most likely alternatives."""

    def prompt_logprob_count(self) -> int | None:
        """None: no log-probabilities of the prompt's tokens; k: each one's and its k most likely alternatives."""

    def grammar(self) -> dict | None:
        """The grammar constraint (`GenerationConfig.response_format`); None: free text."""

    def infill(self) -> str | None:
        """The text after the gap of a fill-in-the-middle request (`GenerationConfig.suffix`); None: a plain prompt."""


class ChatTurn(Protocol):
    """One message of a chat request."""

    role: str

    def text(self) -> str:
        """The message's text."""

    def turn(self) -> dict:
        """The message as the chat template takes it ({role, content}, and an assistant's calls or a tool's answer)."""


def check_request_drafter(spec: str | None, served_spec: str | None) -> None:
    """Refuse a request's drafter spec that the factory would refuse (`DrafterSpec.parse`: unknown options,
    ranges, tree sizes) or that would read files or build a new model copy (REQUEST_REFUSED_KINDS/OPTIONS),
    here and not once it reaches the worker; names of models not loaded are refused by the engine's
    ModelCache when the drafter is built."""
    if spec is None or spec.strip() == (served_spec or "").strip():
        return
    try:
        parsed = DrafterSpec.parse(spec)
    except InvalidParameterError as error:
        raise InvalidParameterError(f"drafter: {error}", param="drafter") from None
    if parsed.kind in REQUEST_REFUSED_KINDS:
        raise InvalidParameterError(f"drafter: {parsed.kind!r} cannot be picked per request "
                                    f"({REQUEST_REFUSED_KINDS[parsed.kind]}): start the server with --draft naming it",
                                    param="drafter")
    if refused := [option for option in parsed.options if option in REQUEST_REFUSED_OPTIONS]:
        option = refused[0]
        raise InvalidParameterError(f"drafter: option {option}= cannot be used per request ({REQUEST_REFUSED_OPTIONS[option]}): "
                                    "start the server with --draft naming it", param="drafter")


def chat_prompt_ids(engine: Engine, messages: Sequence[ChatTurn], tools: list[dict] | None = None) -> list[int]:
    """Token ids of a whole conversation, with the `tools` offered (OpenAI's {"type": "function", "function": …}
    each; None: none), through the target's chat template (runs on the tokenizer thread)."""
    target = engine.target
    if not target.wraps_in_chat_template():
        raise PromptError(f"model {target.name!r} has no chat template: use /v1/completions with a plain prompt")
    if tools and not offers_tools(target.tokenizer.chat_template):
        raise InvalidParameterError(f"tools: {target.name}'s chat template does not offer tools in the Hermes format "
                                    f"({OPEN} blocks) that this server reads calls in", param="tools")
    if not any(m.text().strip() for m in messages):
        raise PromptError("every message is empty: give some text to answer")
    return engine.prompt_ids(target.encode_chat([m.turn() for m in messages], tools))


def _max_new_tokens(body: RequestBody, default: int, limit: int | None) -> int:
    field, requested = body.token_budget()
    if field != "max_tokens" and body.max_tokens is not None and body.max_tokens != requested:
        raise InvalidParameterError(f"{field}: {requested} differs from max_tokens {body.max_tokens}: send one of them",
                                    param=field)
    if limit is not None and requested is not None and requested > limit:
        raise InvalidParameterError(f"{field}: {requested} is more than this server's limit of {limit} new tokens per request",
                                    param=field)
    return requested or (default if limit is None else min(default, limit))


def _stop_strings(body: RequestBody) -> tuple[str, ...]:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidParameterError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
    if any(not s for s in stop):
        raise InvalidParameterError("stop: stop strings must be non-empty", param="stop")
    return stop


def request_config(body: RequestBody, default_max_tokens: int, max_tokens_limit: int | None = None) -> GenerationConfig:
    """The engine's settings for `body`; an InvalidParameterError names the field a setting is wrong in."""
    sampling = SamplingParams(
        temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p, eta=body.eta,
        epsilon=body.epsilon, repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, logit_bias={int(token): bias for token, bias in (body.logit_bias or {}).items()},
    )
    stop = _stop_strings(body)
    if body.stream_options is not None and not body.stream:
        raise InvalidParameterError("stream_options: only allowed with stream: true", param="stream_options")
    return GenerationConfig(max_new_tokens=_max_new_tokens(body, default_max_tokens, max_tokens_limit), sampling=sampling,
                            seed=body.seed, stop=stop, drafter=body.drafter, gamma=body.gamma,
                            gamma_policy=body.gamma_policy, logprobs=body.logprob_count(), response_format=body.grammar(),
                            min_tokens=body.min_tokens, ignore_eos=body.ignore_eos, stop_token_ids=tuple(body.stop_token_ids or ()),
                            prompt_logprobs=body.prompt_logprob_count(), suffix=body.infill())
