"""The speculative decoding loop.

Per step: the drafter proposes γ tokens; the target scores the last committed token plus the γ
drafts in ONE forward pass ([γ+1, vocab] logits); the verifier keeps the accepted prefix and adds
one token of the target's own; the target's KV cache is cut back to the accepted path (a length
change, no recompute) and the drafter is told the new sequence. With no drafter (or γ = 0) the same
loop is plain autoregressive decoding of the target — the honest baseline.

`Engine` holds what is shared across requests (models, drafter, measured costs); `Generation` holds
one request's state (token ids, caches, RNG, γ policy, statistics) and advances one step at a time,
so requests stay independent.

Token trees: a drafter may return a tree (`Draft.parents`). The step then feeds the last committed
token plus every node in one forward, with positions prefix + depth and a tree attention mask (a
node sees the committed prefix, its ancestors and itself); after verification `KVCache.keep` packs
the accepted path's keys/values right after the prefix, so nothing is recomputed. γ caps the depth.

Devices: a step's tensors live where the target's logits are (`LoadedModel.device`: the CPU, or a GPU with
`load(device="cuda")`): the feed, the draft (moved there once per step), the processed scores, the
verification and the request's `torch.Generator` (per device, so a seed reproduces per device). What
comes back to the host is what Python needs: the accepted count, the emitted token ids (and a tree's
structure, which drafters build on the host). On the CPU nothing is copied.

On a row-invariant target (int8, llama.cpp) a verification pass is exact only up to the runner's
`exact_positions_after(cache length)` (longer feeds use other kernels or batched attention, whose
rounding changes with the number of queries; on llama.cpp the bound shrinks once a cache is long), so
there a step drafts at most that many − 1 tokens: γ is capped, and a tree keeps its first nodes.

Log-probabilities (`GenerationConfig.logprobs`): every emitted token was scored by the target in
the verification pass that emitted it, so its log-probability is exact under speculation: the
log-softmax of the target's logits row that predicted it. They are the target's raw distribution
(before temperature, top-k/p, penalties and any grammar mask; as OpenAI and vLLM report them), and
are computed only when asked for.

Constrained output (`GenerationConfig.response_format`, `verispec.sampling.grammar`): each row of a
verification pass is masked to what the grammar allows after the committed text plus the draft
before it (in a tree: plus the path to the node), before the verifier sees the logits; a forbidden draft
token has target probability 0 and is rejected, so the output is exactly the masked target's.

Stop strings: the text is cut before the first stop string, and an event's text is only what no stop
string can still claim, so streamed text joins to exactly the returned text (text that could begin a
stop string is held back until it cannot, or until the request ends by length or EOS).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from verispec.control import CostModel, make_gamma_policy
from verispec.control.batch import Outlook
from verispec.control.gamma import check_gamma_policy
from verispec.control.plan import Plan
from verispec.drafters.base import Drafter
from verispec.engine.device_steps import DeviceSteps
from verispec.engine.shapes import Chain, shape_of
from verispec.errors import InvalidParameterError, VerispecError
from verispec.models.loading import ModelCache
from verispec.models.openmp import release_thread_pool
from verispec.models.prefixes import prefix_store_for
from verispec.models.runner import Cache, LoadedModel
from verispec.sampling.grammar import Constraint, check_response_format
from verispec.sampling.processors import MAX_TOP_LOGPROBS, SamplingParams, Scores, score_rows, token_logprobs
from verispec.tokentree import depths
from verispec.types import Draft, GenerationResult, GenerationStats, Hint, Origin, StepRecord, TokenEvent, TokenLogprobs

__all__ = ["Engine", "Generation", "GenerationConfig", "PromptChunk", "Proposal", "StepPlan", "MAX_STOP_TOKEN_IDS"]


@dataclass(frozen=True)
class GenerationConfig:
    """How one request generates; every field has a default.

    max_new_tokens: the most tokens to generate (≥ 1); the engine also stops where the target's
      context is full, so a very large value means "until the model stops".
    sampling: temperature and truncation (`SamplingParams`); temperature 0, the default, is greedy.
    seed: seeds this request's own random generator, so a sampled output is reproducible; None draws
      a fresh seed (torch's global generator is never touched).
    stop: strings that end the generation; the text is cut before the first one found, and streamed
      text never shows any part of it.
    chat: wrap a text prompt in the target's chat template (when it has one); token ids are used as given.
    suffix: fill in the middle: the text prompt is what comes before the gap and `suffix` what comes after it,
      in the target's fill-in-the-middle tokens (`models/infill.py`; never chat-templated), and the tokens that
      end a middle end the answer as EOS does. None: a plain prompt.
    drafter: a drafter spec for this request only (`ngram`, `tree`, `model:NAME`, `none`, …), built
      over the engine's loaded models and kept for later requests; None: the engine's own.
    gamma: the (starting) number of tokens drafted per step; None: the engine's.
    gamma_policy: constant, heuristic or analytic; None: the engine's.
    stop_token_ids: token ids that end the generation as EOS does (at most `MAX_STOP_TOKEN_IDS`).
    ignore_eos: EOS does not end the generation (a fixed length for benchmarks; not with a response_format).
    prompt_logprobs: None, or k: each prompt token's log-probability given the tokens before it (the first has
      none) and its k most likely alternatives (`GenerationResult.prompt_logprobs`; the prompt is then
      prefilled whole, a chunk of PROMPT_LOGPROBS_ROWS at a time, without the prompt cache).
    min_tokens: no end (EOS unless ignored, a stop token id) before this many new tokens: those rows' end
      tokens are masked out of the target's distribution like a grammar's, so speculation stays exact for
      the masked distribution (not with a response_format; at most max_new_tokens).

    Raises InvalidParameterError when built with a bad value (max_new_tokens < 1, an empty stop string,
    γ < 1, an unknown γ policy, …); a bad drafter spec is refused when the request starts.
    """

    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    chat: bool = True  # wrap a text prompt in the model's chat template
    drafter: str | None = None  # a drafter spec for this request; None: the engine's own
    gamma: int | None = None  # (starting) draft length; None: the engine's
    gamma_policy: str | None = None  # constant | heuristic | analytic; None: the engine's
    logprobs: int | None = None  # None: none; k: each emitted token's log-probability and its k most likely alternatives
    response_format: dict | None = None  # {"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": …}}, …
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    suffix: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.suffix is not None and (not isinstance(self.suffix, str) or self.prompt_logprobs is not None):
            raise InvalidParameterError("suffix must be text, and not with prompt log-probabilities (echo)", param="suffix")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise InvalidParameterError(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids ≥ 0, "
                                        f"got {self.stop_token_ids!r}", param="stop_token_ids")
        if self.response_format is not None and (self.ignore_eos or self.min_tokens):
            raise InvalidParameterError("ignore_eos and min_tokens go with free text: a response_format ends where its "
                                        "grammar does", param="ignore_eos" if self.ignore_eos else "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS):
                raise InvalidParameterError(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, got {value!r}", param=name)
        check_response_format(self.response_format)
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidParameterError(f"max_new_tokens must be an integer ≥ 1, got {self.max_new_tokens!r}")
        if any(not s for s in self.stop):
            raise InvalidParameterError("stop strings must be non-empty")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidParameterError(f"min_tokens must be an integer in [0, max_new_tokens = {self.max_new_tokens}], "
                                        f"got {self.min_tokens!r}", param="min_tokens")
        check_gamma_policy(self.gamma_policy, self.gamma)


MAX_STOP_TOKEN_IDS = 16  # the most stop token ids one request may give
PROMPT_LOGPROBS_ROWS = 64  # prompt positions a prefill forward scores at once when their log-probabilities are asked for
DEFAULT_BATCH, MAX_BATCH = 8, 64  # `Engine.generate_batch`: requests stepped at once by default, and at most
MAX_BATCH_PROMPTS = 10_000  # the most prompts one `generate_batch` call takes (each one's token ids are made first)

_UNPREPARED = object()  # `Engine.prepare`'s lookup: no drafter built yet (None is plain decoding)


class Engine:
    """Target + optional drafter + γ policy. Load once, generate many times.

    A request may ask for another drafter by spec (`GenerationConfig.drafter`): it is built from the
    models in `models` (a frozen `ModelCache` never reads new weights) and kept for later requests.
    """

    MAX_EXTRA_DRAFTERS = 8  # per-request drafters kept built, oldest dropped first
    MAX_GAMMA = 12  # the default longest draft

    def __init__(
        self,
        target: LoadedModel,
        drafter: Drafter | None = None,
        gamma: int = 4,
        gamma_policy: str = "analytic",
        max_gamma: int = MAX_GAMMA,
        drafter_spec: str | None = None,
        models: ModelCache | None = None,
    ):
        if drafter is not None:
            drafter.check_target(target)  # a drafter the target cannot verify is refused now, not at its first step
        self.target, self.drafter, self.drafter_spec = target, drafter, drafter_spec
        self.gamma, self.gamma_policy, self.max_gamma = gamma, gamma_policy, max_gamma
        check_gamma_policy(gamma_policy, gamma)  # now, not mid-request
        self.models = models if models is not None else ModelCache(target, frozen=True)
        self.plan: Plan | None = None  # how `load(draft="auto")` chose the drafter and γ
        self._costs: dict[tuple[str, str] | None, CostModel] = {}
        self._drafters: dict[str, Drafter | None] = {}
        self._preparing = threading.Lock()  # a server prepares requests' drafters on worker threads
        self._prepared: dict[tuple[str | None, str], Drafter | None] = {}  # (drafter spec, γ policy) → built, measured
        # prompt caching where it is exact (`models/prefixes.py`): a request's output never depends on it
        self.prefixes = prefix_store_for(target)

    @property
    def costs(self) -> CostModel:
        """The cost model of the engine's own drafter and policy (measured once, then cached on disk)."""
        return self.costs_for(self.drafter, self.gamma_policy)

    def prepare(self, drafter: str | None = None, gamma_policy: str | None = None) -> Drafter | None:
        """Build the drafter a spec names (None: the engine's own) and measure what the γ policy reads
        (the target's T(n), the draft model's cost: measured once per CPU kind, then cached), with a
        progress display, so that a request over it only reads; returns that drafter. `start()`
        prepares its request; a server prepares the engine at start and each request's drafter on a
        worker thread before queueing it, never on the thread that steps every request. Where it built
        something, the calling thread keeps no OpenMP workers after it (`models/openmp.py`). Raises what
        `drafter_for` raises."""
        spec = None if drafter is None or drafter.strip() == self.drafter_spec else drafter.strip()
        key = (spec, gamma_policy or self.gamma_policy)
        if (found := self._prepared.get(key, _UNPREPARED)) is not _UNPREPARED:
            return found  # the request path: a lookup, never the lock a preparing thread holds
        with self._preparing:
            if key not in self._prepared:
                self.target.runner.prepare_decoding()
                built = self.drafter_for(drafter)
                self.costs_for(built, key[1])
                if len(self._prepared) > self.MAX_EXTRA_DRAFTERS:  # the oldest request's drafter first
                    self._prepared.pop(next((k for k in self._prepared if k[0] is not None), None), None)
                self._prepared[key] = built
                release_thread_pool()  # what building and measuring ran leaves this thread no OpenMP workers
            return self._prepared[key]

    def costs_for(self, drafter: Drafter | None, gamma_policy: str, long: bool = True) -> CostModel:
        """T(n) of the target and the draft model's cost, which only the analytic γ policy reads (`long`: the
        curve after a long context too, `CostModel.calibrated`)."""
        if drafter is None or gamma_policy not in ("analytic", "auto"):
            return CostModel()
        draft_model = drafter.model
        key = ((draft_model.name, draft_model.precision) if draft_model is not None else None, long)
        if key not in self._costs:
            self._costs[key] = CostModel.calibrated(self.target, self.max_gamma + 1, draft_model, long)
        return self._costs[key]

    def drafter_for(self, spec: str | None) -> Drafter | None:
        """The engine's drafter (spec None or its own), or the one `spec` names, built once (at most
        MAX_EXTRA_DRAFTERS kept). Raises InvalidParameterError (param "drafter") for a spec that is
        unknown or names a model this engine has not loaded."""
        if spec is None or spec.strip() == self.drafter_spec:
            return self.drafter
        spec = spec.strip()
        if spec not in self._drafters:
            from verispec.drafters import make_drafter

            try:
                drafter = make_drafter(spec, self.target, load=self.models)
                if drafter is not None:
                    drafter.check_target(self.target)
            except VerispecError as error:
                error.param = "drafter"  # the field a server names in its 400
                raise
            if len(self._drafters) >= self.MAX_EXTRA_DRAFTERS:
                self._drafters.pop(next(iter(self._drafters)))
            self._drafters[spec] = drafter
        return self._drafters[spec]

    def prompt_ids(self, prompt: str | Sequence[int], chat: bool = True, suffix: str | None = None) -> list[int]:
        """The target's checked token ids for `prompt` (`LoadedModel.prompt_ids`), or with a `suffix` for the text
        between a text prompt and it (`LoadedModel.infill_ids`; InvalidParameterError for token ids)."""
        if suffix is None:
            return self.target.prompt_ids(prompt, chat)
        if not isinstance(prompt, str):
            raise InvalidParameterError("suffix: fill-in-the-middle needs a text prompt (the text before the gap), "
                                        "not token ids", param="suffix")
        return self.target.infill_ids(prompt, suffix)

    def start(self, prompt: str | Sequence[int], config: GenerationConfig | None = None) -> Generation:
        """Open a request: prefill the target's cache (which gives the first token; a draft model reads the prompt
        in the step after it) and return its `Generation`, to advance with `step()` until `done` (then `result()`);
        `close()` one abandoned early.

        prompt: text (chat-templated unless `config.chat` is False) or token ids; config: defaults if
        None. Raises PromptError (an empty prompt, one that fills the context, token ids outside the
        vocabulary) and InvalidParameterError (a drafter spec that is unknown or names a model this
        engine has not loaded, its `param` "drafter"; a logit bias on ids outside the vocabulary).
        """
        config = config or GenerationConfig()
        self.prepare(config.drafter, config.gamma_policy)  # before the prompt's work: a bad drafter fails first
        return Generation(self, self.prompt_ids(prompt, config.chat, config.suffix), config)

    def stream(self, prompt: str | Sequence[int], config: GenerationConfig | None = None) -> Iterator[TokenEvent]:
        """Generate, yielding each token as a `TokenEvent` (its id, the text it made final, its origin)
        as soon as its step is verified; the events' texts join to the result's text.

        Arguments and errors as `start` (raised by the first `next()`: this is a generator). Closing
        the iterator early (`close()`, or a `for` loop left by break and the iterator dropped) ends the
        request and releases its caches.
        """
        generation = self.start(prompt, config)
        try:
            while not generation.done:
                yield from generation.step()
        finally:
            generation.close()
            release_thread_pool()  # no OpenMP workers left to this thread: whichever thread works next has the cores

    def generate(self, prompt: str | Sequence[int], config: GenerationConfig | None = None) -> GenerationResult:
        """Generate to the end (EOS, a stop string, `max_new_tokens` or a full context) and return the
        `GenerationResult`: text, token ids, finish reason ("stop" or "length") and statistics.
        Arguments and errors as `start`. The calling thread keeps no OpenMP workers after it (`models/openmp.py`),
        so that another thread may generate next at full speed."""
        generation = self.start(prompt, config)
        try:
            while not generation.done:
                generation.step()
            return generation.result()
        finally:
            release_thread_pool()

    def generate_batch(self, prompts: Sequence[str | Sequence[int]],
                       config: GenerationConfig | Sequence[GenerationConfig] | None = None,
                       max_batch: int = DEFAULT_BATCH,
                       on_result: Callable[[int, GenerationResult], None] | None = None) -> list[GenerationResult]:
        """Generate for every prompt, up to `max_batch` requests at a time stepped together (`engine/together.py`:
        their drafts side by side, one target pass for all; a waiting request starts as another finishes), and return
        the results in order. Several times the throughput of one `generate` after another on a CPU, and each result
        is what `generate` gives that prompt alone (greedy: the same tokens; a seeded sampled request: the same draws).

        config: one for every prompt, one per prompt, or None (defaults). on_result(i, result): called as prompt i
        finishes (a long batch can keep its results as they come). Every prompt and drafter is checked before any
        decoding (errors as `start`; what a request checks as it starts, such as logit-bias ids, when it starts);
        InvalidParameterError for no prompts, more than MAX_BATCH_PROMPTS, a list of configs of another length or a
        `max_batch` outside 1…MAX_BATCH."""
        from verispec.engine.together import generate_together

        if isinstance(prompts, str) or any(not isinstance(prompt, (str, Sequence)) for prompt in prompts):
            raise InvalidParameterError("generate_batch takes a list of prompts, each a text or a list of token ids")
        prompts = list(prompts)
        if not 1 <= len(prompts) <= MAX_BATCH_PROMPTS:
            raise InvalidParameterError(f"generate_batch takes 1 to {MAX_BATCH_PROMPTS} prompts, got {len(prompts)}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= MAX_BATCH:
            raise InvalidParameterError(f"max_batch (requests stepped at once) must be an integer in 1…{MAX_BATCH}, got {max_batch!r}")
        configs = [config or GenerationConfig()] * len(prompts) if not isinstance(config, Sequence) else list(config)
        if len(configs) != len(prompts):
            raise InvalidParameterError(f"generate_batch got {len(configs)} configs for {len(prompts)} prompts: give one, or one per prompt")
        for c in configs:
            self.prepare(c.drafter, c.gamma_policy)
        prompt_ids = [self.prompt_ids(prompt, c.chat, c.suffix) for prompt, c in zip(prompts, configs)]
        try:
            return generate_together(self, prompt_ids, configs, max_batch, on_result)
        finally:
            release_thread_pool()  # as `generate`


@dataclass
class StepPlan:
    """What one step asks of the target: score `feed` [n+1] (the last committed token + the draft).

    For a token tree, `positions` [n+1] and `tree_mask` [n+1, n+1] go to the same forward call;
    both are None for a chain.
    """

    shape: Chain  # the draft, as a chain or a tree
    feed: torch.Tensor
    draft_seconds: float
    positions: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None
    hint: Hint | None = None  # the session's class for this step (`DraftSession.hint`), told back to the γ policy

    @property
    def draft(self) -> Draft:
        return self.shape.draft


class PromptChunk(NamedTuple):
    """A piece of a request's prompt for the target (`Generation.prompt_chunk`), to feed beside other requests' rows."""

    tokens: torch.Tensor  # [n] prompt ids
    logits: str  # "last" when it ends the prompt (its logits give the first new token), else "none"


class Proposal(NamedTuple):
    """A request's next step before it drafts (`Generation.propose`): the session's class for it, its γ as the
    request's policy sizes it alone with what sizing it among others needs (`control/batch.py`), and the seconds
    finding them took (counted as drafting)."""

    hint: Hint | None
    outlook: Outlook
    seconds: float


class _Laps:
    """A step's seconds, phase by phase, into `GenerationStats.phases`: the draft and the target's forward
    as measured by their callers, then each `mark(phase)` adds the time since the previous mark."""

    def __init__(self, stats: GenerationStats, draft_seconds: float, target_seconds: float):
        self.stats, self.since_target = stats, 0.0
        stats.add_phase("draft", draft_seconds)
        stats.add_phase("target", target_seconds)
        self.last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.stats.add_phase(phase, now - self.last)
        self.since_target += now - self.last
        self.last = now


class _Detokenizer:
    """Incremental text for streamed ids; holds back bytes of an unfinished UTF-8 character."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        before = decode(self.ids[self.prefix_offset : self.read_offset])
        after = decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return after[len(before) :]
        return ""


class Generation:
    """One request's state; `step()` runs one draft + verify step and returns the emitted tokens."""

    INITIAL_SPARE = 256  # cache slots reserved past the prompt at the start (the cache doubles as needed)

    def __init__(self, engine: Engine, prompt_ids: list[int], config: GenerationConfig, prefill: bool = True):
        self.engine, self.config = engine, config
        self.target = engine.target
        self.params = config.sampling
        for param, tokens in (("logit_bias", [token for token, _ in self.params.logit_bias]), ("stop_token_ids", config.stop_token_ids)):
            outside = [token for token in tokens if token >= self.target.vocab_size]
            if outside:
                raise InvalidParameterError(
                    f"{param} names token ids outside {self.target.name}'s vocabulary [0, {self.target.vocab_size}): {outside[:5]}",
                    param=param)
        # the tokens that end the answer: EOS (unless ignored) and the request's stop token ids
        ends = self.target.eos_ids | (self.target.infill_ends if config.suffix is not None else frozenset())
        self.ends = frozenset(config.stop_token_ids) | (frozenset() if config.ignore_eos else ends)
        self.device = self.target.device  # where the step's tensors live: the target's logits are there
        self.generator = torch.Generator(self.device)  # torch's generators are per device (the CPU's: as before)
        # without a seed, a fresh one from the OS: torch's global generator is left as the caller set it
        self.generator.manual_seed(config.seed if config.seed is not None else secrets.randbits(63))
        self.ids = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.max_new = min(config.max_new_tokens, self.target.context_length - self.prompt_len)
        self.stats = GenerationStats(prompt_tokens=self.prompt_len)
        self.output_ids: list[int] = []
        self.origins: list[Origin] = []
        self.logprobs: list[TokenLogprobs] | None = [] if config.logprobs is not None else None  # one per output token
        # one per prompt token (the first has none), when asked for
        self.prompt_logprobs: list[TokenLogprobs | None] | None = [None] if config.prompt_logprobs is not None else None
        self.text = ""  # the output text, cut before a stop string
        self._emitted = 0  # characters of `text` already given out in events
        self.finish_reason: str | None = None
        self._closed = False
        self._detok = _Detokenizer(self.target.tokenizer)

        # building a drafter and measuring costs happen once per engine, in `Engine.prepare` (here a
        # lookup once prepared): not part of this request's time
        self.drafter = engine.prepare(config.drafter, config.gamma_policy)
        self.constraint = Constraint.from_response_format(
            config.response_format, self.target.tokenizer, self.target.vocab_size, self.target.eos_ids)
        policy = config.gamma_policy or engine.gamma_policy
        gamma = config.gamma if config.gamma is not None else engine.gamma
        self.policy = make_gamma_policy(policy, gamma, engine.costs_for(self.drafter, policy), engine.max_gamma)
        self._started = time.perf_counter()
        # room for the first tokens; a cache grows as the sequence does, never by the request's promise
        self.initial_capacity, self.max_capacity = self.capacities(engine, self.prompt_len, config)
        self.session, self.prefilled, self._session_opened = None, False, False
        self.device_steps: DeviceSteps | None = None  # where whole steps run on the device (set with the session)
        self._held: list[TokenEvent] = []  # the first token's events, from the prefill, until step() gives them
        self.cache = self.target.runner.new_cache(self.initial_capacity)
        self._cap_growth()
        if prefill:  # otherwise the caller feeds the prompt with prefill_step(), a chunk at a time
            self.prefill_step()

    @classmethod
    def capacities(cls, engine: Engine, prompt_len: int, config: GenerationConfig) -> tuple[int, int]:
        """(cache positions a request over `prompt_len` prompt tokens reserves at its start, the most
        its cache may grow to by doubling): prompt + up to INITIAL_SPARE new tokens + one step's
        draft, and prompt + every new token + one step's draft. A token tree's step may still need
        more than the second; the cache then grows to exactly what it needs."""
        max_new = min(config.max_new_tokens, engine.target.context_length - prompt_len)
        gamma = config.gamma if config.gamma is not None else engine.gamma
        step = max(engine.max_gamma, gamma) + 2
        return prompt_len + min(max_new, cls.INITIAL_SPARE) + step, prompt_len + max_new + step

    def _cap_growth(self) -> None:
        """A doubling cache (verispec's own runner) never doubles past what this request can use."""
        self.cache.ceiling = self.max_capacity

    def _open_session(self) -> None:
        """The prompt is in the target's cache: open the drafter's session on it. Its own prefill (a draft
        model's) is left to later prefill_step calls, so the first token goes out before it (`step`)."""
        self._session_opened = True
        self.session = None if self.drafter is None else self.drafter.start_chunked(self.ids)
        if self.session is not None:
            self.session.attach_target_cache(self.cache)
        self.prefilled = self.session is None or self.session.prefill_step(0)
        self.device_steps = DeviceSteps.of(self)

    def prefill_step(self, max_tokens: int | None = None, running: Iterable[tuple[Sequence[int], Cache]] = ()) -> bool:
        """Feed at most `max_tokens` more prompt tokens (None: all the rest) into the target's cache; the first
        call starts from the longest prefix the prompt cache or a `running` request's cache holds
        (`PrefixStore.take`).
        Once the last prompt token is in, open the drafter's session (whose own prefill, a draft
        model's, follows in calls of its own); that pass also gives the first new token, from the last
        prompt token's logits in the prefill pass as llama.cpp and Hugging Face `generate()` take it
        (its events wait for `step()` / `take_held()`). Returns whether the prefill is complete (or
        the request finished with its first token). Chunks give the same cache as one prefill, up to
        the rounding of a forward's width."""
        if self.prefilled or self.finish_reason is not None:
            return True
        if max_tokens is not None and max_tokens < 1:
            raise InvalidParameterError(f"a prefill chunk must hold at least 1 token, got {max_tokens}")
        start = time.perf_counter()
        if self._session_opened:
            self.prefilled = self.session.prefill_step(max_tokens)
        elif self.prompt_logprobs is not None:
            done = self.cache.length
            self._prompt_fed(self._score_prompt(done, self._chunk_end(done, max_tokens)))
        else:
            chunk = self.prompt_chunk(max_tokens, running)
            self._prompt_fed(self.target.runner.forward(self.cache, chunk.tokens, logits=chunk.logits))
        self.stats.prefill_seconds += time.perf_counter() - start
        return self.prefilled or self.finish_reason is not None  # a first token that ends it leaves no draft to prefill

    def prompt_chunk(self, max_tokens: int | None = None, running: Iterable[tuple[Sequence[int], Cache]] = ()) -> PromptChunk | None:
        """The target's next piece of the prompt (at most `max_tokens` ids; None: the rest), for a pass this request
        shares with others' verification rows (`engine/together.py`), the first piece after the longest cached prefix
        (as `prefill_step`); None where the request's next prefill work is not that (its prompt's log-probabilities
        to score, its drafter's own prefill, or none left). Feed `tokens` into `self.cache` with `logits`, then give
        what came back to `prompt_chunk_fed`."""
        if self._session_opened or self.finish_reason is not None or self.prompt_logprobs is not None:
            return None
        if max_tokens is not None and max_tokens < 1:
            raise InvalidParameterError(f"a prefill chunk must hold at least 1 token, got {max_tokens}")
        if self.cache.length == 0:
            self._reuse_prefix(running)
        done = self.cache.length
        end = self._chunk_end(done, max_tokens)
        return PromptChunk(torch.tensor(self.ids[done:end]), "last" if end == self.prompt_len else "none")

    def prompt_chunk_fed(self, logits: torch.Tensor | None, seconds: float) -> bool:
        """`prompt_chunk`'s tokens are in the cache, fed in a shared pass of `seconds` (counted as prefill): with the
        prompt's last token, its `logits` [1, vocab] give the first new token. Returns what `prefill_step` does."""
        self._prompt_fed(logits)
        self.stats.prefill_seconds += seconds
        return self.prefilled or self.finish_reason is not None

    def _chunk_end(self, done: int, max_tokens: int | None) -> int:
        return self.prompt_len if max_tokens is None else min(self.prompt_len, done + max_tokens)

    def _prompt_fed(self, logits: torch.Tensor | None) -> None:
        """After a piece of the prompt went in: once it holds the whole prompt, open the drafter's session and
        take the first token from the last prompt position's `logits` [1, vocab] (a step without a draft, its
        forward the prefill's)."""
        if self.cache.length < self.prompt_len:
            return
        self._open_session()
        first = StepPlan(Chain(Draft.empty()), torch.tensor(self.ids[-1:]), 0.0)
        self._held = self.commit(first, logits, 0.0)

    def _reuse_prefix(self, running: Iterable[tuple[Sequence[int], Cache]]) -> None:
        """Start from the longest prefix of this prompt that the prompt cache or a running request's cache
        holds, if one does (taken at the first prefill step, not at admission: what another request
        prefilled meanwhile counts)."""
        prefixes = self.engine.prefixes
        if prefixes is None or self.prompt_logprobs is not None:  # a cached prefix has no logits to score
            return
        reused = prefixes.take(self.ids, self.initial_capacity, running)
        if reused is not None:
            self.cache.release()
            self.cache = reused
            self._cap_growth()
            self.stats.cached_tokens = self.cache.length  # the prompt's first tokens, already in the cache

    def _score_prompt(self, done: int, end: int) -> torch.Tensor:
        """Feed prompt positions [done, end) a few rows at a time, recording each next prompt token's
        log-probability; the last row's logits [1, vocab] (after the prompt's last token: the first new one)."""
        k = self.config.prompt_logprobs
        for start in range(done, end, PROMPT_LOGPROBS_ROWS):
            stop = min(end, start + PROMPT_LOGPROBS_ROWS)
            logits = self.target.runner.forward(self.cache, torch.tensor(self.ids[start:stop]), logits="all")  # [rows, vocab]
            scored = min(stop, self.prompt_len - 1) - start  # rows whose next token is a prompt token
            self.prompt_logprobs += token_logprobs(logits[:scored], self.ids[start + 1 : start + 1 + scored], k) if scored > 0 else []
        return logits[-1:]

    def take_held(self) -> list[TokenEvent]:
        """The events of the first token once the prefill made it (then []): `step()` returns them."""
        held, self._held = self._held, []
        return held

    @property
    def done(self) -> bool:
        """Finished, and every event given out (the first token's included)."""
        return self.finish_reason is not None and not self._held

    def _draft(self, gamma: int) -> Chain:
        """Up to γ draft tokens (a tree: up to depth γ), capped to what one verification scores exactly."""
        exact = self.target.runner.exact_positions_after(self.cache.length)
        most = exact - 1 if exact is not None else None  # draft tokens one pass may hold beside the last committed one
        gamma = gamma if most is None else min(gamma, most)
        if self.session is None or gamma <= 0:
            return Chain(Draft.empty())
        draft = self.session.propose(self.ids, gamma, self.params, self.generator).to(self.device)
        return shape_of(draft).cut(gamma, most)

    @property
    def batches_drafts(self) -> bool:
        """Whether this request's `plan` may share its draft model's passes with other requests' (`drafters/batching.py`):
        a drafter that runs a model and declares `batches_drafts`; a model-free one has nothing to share."""
        return self.drafter is not None and self.drafter.model is not None and self.drafter.batches_drafts

    def propose(self) -> Proposal:
        """This step's class and γ alone (once the target's prompt is in; the rest of the drafter's prefill first).
        A seeded sampled request's γ is fixed: its draws depend on it, and it must draw alone what it draws among
        others. One without a seed promises no draws, only their distribution, which no γ changes: it is sized for
        the batch as a greedy one is (`control/batch.py`)."""
        if not self._session_opened:
            raise VerispecError("a step needs the whole prompt prefilled: call prefill_step() until it returns True")
        self.prefill_step()
        remaining = self.max_new - len(self.output_ids)
        gamma, hint = 0, None
        start = time.perf_counter()
        if self.session is not None:  # the policy's γ for this class of step, or what the session's free source may take
            hint = self.session.hint(self.ids)
            gamma = min(self.session.budget(self.ids, self.policy.next_gamma(hint), self.engine.max_gamma), remaining - 1)
        outlook = self.policy.outlook(gamma, hint, self.session.lag(self.ids) if self.session is not None else 0)
        outlook = replace(outlook, fixed=outlook.fixed or (not self.params.greedy and self.config.seed is not None))
        return Proposal(hint, outlook, time.perf_counter() - start)

    def plan(self, proposal: Proposal | None = None, gamma: int | None = None) -> StepPlan:
        """Draft this step's tokens and say what the target must score: `proposal` (default: `propose()` now) at
        `gamma` drafts (default: its own γ; `control/batch.size_together` may give fewer)."""
        proposal = proposal if proposal is not None else self.propose()
        gamma = proposal.outlook.gamma if gamma is None else gamma
        start = time.perf_counter()
        shape = self._draft(gamma)
        last = torch.tensor(self.ids[-1:], device=self.device)
        feed = torch.cat([last, shape.draft.tokens]) if len(shape.draft) else last  # [n+1] on the device
        draft_seconds = proposal.seconds + time.perf_counter() - start
        return StepPlan(shape, feed, draft_seconds, *shape.layout(len(self.ids) - 1), hint=proposal.hint)

    def step(self) -> list[TokenEvent]:
        """One draft + verify step: the drafter proposes, the target scores the proposal in one forward,
        the rejection rule keeps a prefix and adds one token of the target's (where steps run on the device,
        `device_steps.py`, a run of such steps). Returns the events of the tokens it emitted (one or more; an
        EOS token only when it releases held-back text); [] once `done`. The request finishes (and releases
        its caches) on EOS, a stop string or its length."""
        if not self._session_opened:  # a prompt left unfinished: the rest of it now, which gives the first token
            self.prefill_step()
        if self._held or self.done:  # the first token goes out before the drafter's own prefill (in `plan`)
            return self.take_held()
        if self.device_steps is not None and (events := self.device_steps.run()) is not None:
            return events
        plan = self.plan()  # draft
        start = time.perf_counter()
        logits = self.target.runner.forward(
            self.cache, plan.feed, positions=plan.positions, tree_mask=plan.tree_mask, logits="all"
        )  # score: [n+1, vocab]
        return self.commit(plan, logits, time.perf_counter() - start)  # verify, commit, emit

    def commit(self, plan: StepPlan, logits: torch.Tensor, target_seconds: float) -> list[TokenEvent]:
        """Verify `plan` against the target's logits [n+1, vocab]; keep the accepted path; emit tokens.
        Each phase's seconds go to `stats.phases` (the target's forward: `target_seconds`)."""
        laps = _Laps(self.stats, plan.draft_seconds, target_seconds)
        shape, draft = plan.shape, plan.draft
        allowed = self._allowed_rows(draft, shape)
        scores = score_rows(logits, self.params, self.ids, draft.tokens, draft.parents, allowed, output_start=self.prompt_len)  # [n+1, …]
        verdict = shape.verify(scores, self.generator)
        laps.mark("verify")
        path = list(verdict.path) if verdict.path is not None else list(range(verdict.accepted))
        rows = torch.tensor([0] + [node + 1 for node in path])  # [accepted+1] block rows on the committed path (host)
        new_tokens = (draft.tokens[path].tolist() if path else []) + [verdict.next_token]
        self._commit_tokens(shape, rows, new_tokens, scores)
        laps.mark("commit")
        self.stats.record(StepRecord(shape.depth, verdict.accepted, plan.draft_seconds, target_seconds + laps.since_target,
                                     len(draft), free=plan.hint is not None and plan.hint.free))
        self.policy.update(shape.depth, verdict.accepted, len(self.ids), plan.hint, len(draft) if draft.is_tree else None)
        laps.mark("policy")
        origins = [Origin.ACCEPTED] * verdict.accepted + [Origin.TARGET if len(draft) == 0 else verdict.next_origin]
        logprobs = None if self.config.logprobs is None else token_logprobs(logits[rows], new_tokens, self.config.logprobs)
        events = self.take_held() + self._emit(new_tokens, origins, logprobs)
        laps.mark("emit")
        return events

    def _allowed_rows(self, draft: Draft, shape: Chain) -> torch.Tensor | None:
        """bool [n+1, vocab]: what each verified row may be (None: anything): the grammar's tokens, and no end
        of the answer (`ends`) at an output position before `min_tokens`."""
        allowed = None if self.constraint is None else self.constraint.masks(draft.tokens.tolist(), shape.parent_list)
        short = self.config.min_tokens - len(self.output_ids)  # rows at a depth below this may not end the answer
        if short <= 0 or not self.ends:
            return allowed
        parents = shape.parent_list
        depth = torch.arange(len(draft) + 1) if parents is None else torch.cat([torch.zeros(1, dtype=torch.long),
                                                                                  depths(torch.tensor(parents))])  # [n+1]
        allowed = torch.ones(len(draft) + 1, self.target.vocab_size, dtype=torch.bool) if allowed is None else allowed
        allowed[(depth < short).nonzero()[:, :1], torch.tensor(sorted(self.ends))] = False
        return allowed

    def _commit_tokens(self, shape: Chain, rows: torch.Tensor, new_tokens: list[int], scores: Scores) -> None:
        """Append the accepted tokens; keep their keys/values (`rows` of the block); tell the drafter and
        the grammar. A drafter that learns from the target gets its distributions on those rows."""
        start = len(self.ids) - 1  # the last committed token's position: the block's row 0
        self.ids.extend(new_tokens)
        shape.keep(self.cache, start, rows)
        if self.session is not None:
            self.session.commit(self.ids)
            if self.session.observes_target:
                observed = scores.probs[rows] if scores.probs is not None else torch.softmax(scores.logits[rows], dim=-1)
                self.session.observe(self.ids, observed)  # [accepted+1, vocab]
        if self.constraint is not None:
            self.constraint.advance(new_tokens)

    def _emit(self, tokens: list[int], origins: list[Origin], logprobs: list[TokenLogprobs] | None = None) -> list[TokenEvent]:
        """Record accepted tokens; each event carries the text its token made final.

        Text that could still begin a stop string is held back and released by a later token, so the
        events' texts join to exactly `self.text`. An EOS token gets an event only when it releases
        held-back text (as does a stop token id).
        """
        events = []
        for i, (token, origin) in enumerate(zip(tokens, origins)):
            self.output_ids.append(token)
            self.origins.append(origin)
            if logprobs is not None:
                self.logprobs.append(logprobs[i])
            end = token in self.ends
            if end:
                self._finish("stop")
            else:
                self._add_text(self._detok.push(token))  # finishes at a stop string
                if not self.done and len(self.output_ids) >= self.max_new:
                    self._finish("length")
            released = self._release()
            if not end or released:
                events.append(TokenEvent(token, released, origin, None if logprobs is None else logprobs[i]))
            if self.done:
                break
        return events

    def _add_text(self, piece: str) -> None:
        """Append `piece` to the text and cut it before the first stop string, finishing the request."""
        self.text += piece
        if not self.config.stop or not piece:
            return
        # a stop string begins at or after the emitted text: what was emitted could begin none
        hits = [i for s in self.config.stop if (i := self.text.find(s, self._emitted)) != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self._finish("stop")

    def _release(self) -> str:
        """The text not yet emitted that no stop string can still claim (all of it once finished)."""
        end = len(self.text)
        if not self.done:
            end -= self._stop_prefix_length()
        released, self._emitted = self.text[self._emitted : end], end
        return released

    def _stop_prefix_length(self) -> int:
        """The length of the longest unemitted end of the text that begins a stop string (0 if none)."""
        longest = min(len(self.text) - self._emitted, max((len(s) for s in self.config.stop), default=1) - 1)
        for length in range(longest, 0, -1):
            tail = self.text[-length:]
            if any(s.startswith(tail) for s in self.config.stop):
                return length
        return 0

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.stats.new_tokens = len(self.output_ids)
        self.stats.wall_seconds = time.perf_counter() - self._started
        self.close()

    def cancel(self, reason: str = "cancelled") -> str:
        """Stop the request now (a user's Ctrl-C, a client gone): statistics cover the tokens produced so
        far, caches are freed, and the text held back for a possible stop string is returned, since no
        later token will release it. Nothing happens once the request is done ("")."""
        if self.finish_reason is not None:
            return ""
        self._finish(reason)
        return self._release()

    def close(self) -> None:
        """Tell the drafter's session the request is over (done or abandoned) and free the target's
        cache, once: a finished request has closed itself, an abandoned one needs this call; calling
        it again does nothing. Do not `step()` a closed request."""
        if self._closed:
            return
        self._closed = True
        if self.session is not None:
            self.session.finish()
        if self.engine.prefixes is not None and self.finish_reason in ("stop", "length"):  # the cache holds self.ids[:length]
            self.engine.prefixes.keep(self.ids, self.cache)
        self.cache.release()

    def result(self) -> GenerationResult:
        """What the request produced so far: text, token ids, statistics (and log-probabilities when
        asked for); finish_reason is "stop", "length" or the reason given to `cancel` once done ("length"
        also for a request read before it finished)."""
        return GenerationResult(self.text, list(self.output_ids), self.finish_reason or "length", self.stats, list(self.origins),
                                None if self.logprobs is None else list(self.logprobs),
                                None if self.prompt_logprobs is None else list(self.prompt_logprobs))
