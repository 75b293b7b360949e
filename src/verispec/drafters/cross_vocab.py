"""Drafting with a model of another tokenizer (another family): lossless in both decoding modes.

The draft reads the committed text, not the target's token ids: the target's sequence is decoded to
text and re-encoded with the draft's tokenizer (`DraftContext`, incrementally: only the ids past a known
prefix are decoded and only the tail after a stable anchor is re-encoded each step). How its guesses
become target tokens depends on the decoding:

- **Greedy: text re-tokenization.** The draft drafts γ tokens of its own; their text is appended to the
  text of the target's last few tokens and encoded with the target's tokenizer, and whatever follows
  those tokens is the proposal (when the first draft piece merges with the last committed token, the
  draft's text is encoded alone). A proposal is only a guess: greedy verification keeps exactly the
  target's own tokens, so the output is the target's whatever the draft says.
- **Sampling: the shared vocabulary.** The draft samples only among the tokens both tokenizers hold as
  the same string (`SharedVocabulary`), from its distribution restricted to them and renormalized;
  each drafted token is that string's target id, with its probability placed at that id in the
  target's vocabulary. The standard rejection rule then runs in the target's vocabulary. It is exact
  for any draft distribution, so the output is distributed as the target's: a token outside the
  intersection is never drafted, and the residual max(p − q, 0) gives it its full probability.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from verispec.drafters.base import Drafter, DraftSession, ModelSession, window_cut, windowed
from verispec.drafters.prefix import common_prefix_length
from verispec.models.runner import LoadedModel
from verispec.sampling.processors import SamplingParams, greedy_tokens, penalties, to_probs
from verispec.sampling.samplers import multinomial
from verispec.types import Draft

__all__ = ["CrossVocabDrafter", "DraftContext", "SharedVocabulary", "shared_vocabulary", "token_keys"]

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes → printable-characters table, which byte-level BPE vocabularies use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_keys(tokenizer) -> dict[int, tuple[str, bytes]]:
    """{token id: what the token stands for}, comparable across tokenizers: ("text", its bytes) for an
    ordinary token (byte-level BPE "Ġ…" and SentencePiece "▁…" / "<0x0A>" spellings both undone), or
    ("special", its content) for an added token such as "<|im_end|>"."""
    vocab = tokenizer.get_vocab()  # {token string: id}
    added = {token.content for token in tokenizer.added_tokens_decoder.values()}
    byte_level = any("Ġ" in token for token in vocab)
    decoder = _gpt2_byte_decoder()
    keys = {}
    for token, index in vocab.items():
        if token in added:
            keys[index] = ("special", token.encode())
        elif byte_level:
            if all(char in decoder for char in token):
                keys[index] = ("text", bytes(decoder[char] for char in token))
        elif match := _BYTE_TOKEN.fullmatch(token):
            keys[index] = ("text", bytes([int(match.group(1), 16)]))
        else:
            keys[index] = ("text", token.replace("▁", " ").encode())
    return keys


@dataclass(frozen=True)
class SharedVocabulary:
    """The tokens both tokenizers hold as the same string: target_ids[i] and draft_ids[i] are one string."""

    target_ids: torch.Tensor  # [shared]
    draft_ids: torch.Tensor  # [shared]

    def __len__(self) -> int:
        return len(self.target_ids)

    def restrict(self, draft_probs: torch.Tensor) -> torch.Tensor | None:
        """The draft's distribution [draft vocab] restricted to the shared tokens and renormalized
        [shared]; None when it puts (next to) no weight on any of them."""
        probs = draft_probs[self.draft_ids]  # [shared]
        mass = float(probs.sum())
        return probs / mass if mass > 1e-9 else None


def shared_vocabulary(target_tokenizer, draft_tokenizer, target_width: int, draft_width: int) -> SharedVocabulary:
    """The intersection of two vocabularies, limited to ids each model's logits cover."""
    by_key = {key: index for index, key in token_keys(target_tokenizer).items() if index < target_width}
    pairs = sorted(
        (by_key[key], index) for index, key in token_keys(draft_tokenizer).items() if key in by_key and index < draft_width
    )
    target_ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
    draft_ids = torch.tensor([d for _, d in pairs], dtype=torch.long)
    return SharedVocabulary(target_ids, draft_ids)


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


class DraftContext:
    """The draft's token ids for the target's committed text, decoded and re-encoded incrementally.

    Decoding: the text of a prefix of the target's ids is kept (`known_ids`, `known_text`, ending on a whole
    character); each call decodes only the ids after it, with a few before them (`LEAD`: a SentencePiece word's space,
    a character's first bytes), and the prefix moves forward once KEEP × 2 ids follow it. Encoding: the text before
    `anchor` keeps its draft ids; each call re-encodes only the text after it, and the anchor moves forward (to a
    space, where tokenizations agree) once that tail grows past 2 × TAIL characters. Any tokenization of the text is
    a valid context for the draft; this one stays close to the canonical one and costs O(tail) per step, not
    O(context).
    """

    TAIL = 256  # characters kept re-encodable behind the end of the text
    KEEP, LEAD = 32, 4  # target ids kept decodable behind the end; ids before the new ones decoded with them

    def __init__(self, target_tokenizer, draft_tokenizer):
        self.target_tokenizer, self.draft_tokenizer = target_tokenizer, draft_tokenizer
        bos = draft_tokenizer.bos_token_id
        self.prefix = [bos] if bos is not None and _encode_with_specials(draft_tokenizer) == [bos] else []
        self.skip = {target_tokenizer.bos_token_id} - {None}  # the target's BOS is not text
        self.anchor_text, self.anchor_ids = "", []
        self.known_ids: list[int] = []  # a prefix of the target's ids (past a BOS) whose text is known_text
        self.known_text = ""

    def text(self, target_ids: list[int]) -> str:
        """The committed text, an unfinished character left out (it waits for its next bytes)."""
        ids = list(target_ids[1:] if target_ids and target_ids[0] in self.skip else target_ids)
        known = len(self.known_ids)
        if ids[:known] != self.known_ids:  # not an extension (a new request): start over
            self.known_ids, self.known_text, known = [], "", 0
        text = self._after_known(ids)
        cut = len(ids) - self.KEEP
        if cut - known > self.KEEP:  # move the known prefix forward where its text ends on a whole character
            prefix = self._after_known(ids[:cut])
            if not prefix.endswith("\ufffd") and text.startswith(prefix):
                self.known_ids, self.known_text = ids[:cut], prefix
        return text.rstrip("\ufffd")

    def _after_known(self, ids: list[int]) -> str:
        """The text of `ids` (which extend `known_ids`): the known text, then what the ids after it add to the LEAD ids
        before them (decoded alone, a piece's leading space or first bytes would come out otherwise)."""
        known = len(self.known_ids)
        if not known:
            return _decode(self.target_tokenizer, ids)
        lead = self.known_ids[-self.LEAD :]
        head, tail = _decode(self.target_tokenizer, lead), _decode(self.target_tokenizer, lead + ids[known:])
        return self.known_text + tail[len(head) :] if tail.startswith(head) else _decode(self.target_tokenizer, ids)

    def ids(self, target_ids: list[int]) -> list[int]:
        """The draft's context for the committed `target_ids`."""
        text = self.text(target_ids)
        if not text.startswith(self.anchor_text):  # the text is not an extension (a new request): start over
            self.anchor_text, self.anchor_ids = "", []
        if len(text) - len(self.anchor_text) > 2 * self.TAIL:
            limit = len(text) - self.TAIL
            cut = text.rfind(" ", len(self.anchor_text) + 1, limit)
            cut = cut if cut > 0 else limit
            self.anchor_ids = self.anchor_ids + _encode(self.draft_tokenizer, text[len(self.anchor_text) : cut])
            self.anchor_text = text[:cut]
        return self.prefix + self.anchor_ids + _encode(self.draft_tokenizer, text[len(self.anchor_text) :])


def _encode_with_specials(tokenizer) -> list[int]:
    """What the tokenizer adds around any text on its own (a BOS for Gemma or Llama, nothing for Qwen)."""
    return tokenizer.encode("", add_special_tokens=True)


def retokenize(target_tokenizer, draft_tokenizer, target_ids: list[int], context: list[int], drafted: list[int]) -> list[int]:
    """The target's tokens for the text of `drafted` (draft ids following `context`), read as the
    continuation of the committed `target_ids`."""
    tail = context[-8:]  # decoded with a little context, so a leading space or a byte sequence survives
    base, full = _decode(draft_tokenizer, tail), _decode(draft_tokenizer, tail + drafted)
    text = (full[len(base) :] if full.startswith(base) else _decode(draft_tokenizer, drafted)).rstrip("\ufffd")
    if not text:
        return []
    committed = target_ids[-4:]
    encoded = _encode(target_tokenizer, _decode(target_tokenizer, committed) + text)
    if encoded[: len(committed)] == committed:
        return encoded[len(committed) :]
    return _encode(target_tokenizer, text)  # the first piece merged with a committed token


class CrossVocabDrafter(Drafter):
    """A draft model whose tokenizer differs from the target's (see the module docstring)."""

    batches_drafts = True  # its session drafts through `_feed`

    def __init__(self, draft: LoadedModel, target: LoadedModel, window: int | None = None):
        self.model, self.target, self.window = draft, target, window  # window: as DraftModelDrafter's, in draft ids
        self.name = f"model:{draft.name}"

    @cached_property
    def shared(self) -> SharedVocabulary:
        """The tokens both tokenizers hold as the same string, built on the first sampled proposal or by
        `prepare_sampling` (a server's start): half a second of reading both vocabularies, which greedy drafting,
        going through the text, never needs."""
        return shared_vocabulary(self.target.tokenizer, self.model.tokenizer, self.target.vocab_size, self.model.vocab_size)

    def prepare_sampling(self) -> None:
        self.shared  # noqa: B018 - built once, kept

    def start(self, prompt_ids: list[int]) -> DraftSession:
        return _CrossVocabSession(self, prompt_ids)

    def start_chunked(self, prompt_ids: list[int]) -> DraftSession:
        return _CrossVocabSession(self, prompt_ids, prefill=False)


class _CrossVocabSession(ModelSession):
    """The draft's cache holds draft ids of the committed text, brought up to date at each proposal
    (kept where it agrees with the re-encoded text, the rest fed); a commit has nothing to cut, since
    the cache's ids are not the target's."""

    def __init__(self, drafter: CrossVocabDrafter, prompt_ids: list[int], prefill: bool = True):
        self.drafter = drafter
        self.context = DraftContext(drafter.target.tokenizer, drafter.model.tokenizer)
        context = self.context.ids(prompt_ids)
        read = windowed(context, window_cut(len(context), drafter.window))  # what the draft's cache will hold
        if not context or len(read) >= drafter.model.context_length:  # no text yet, or too long to draft for
            context = [0]  # an empty cache: a prefilled cache holds all but the last id
        super().__init__(drafter.model, context, prefill, drafter.window)
        self.synced, self.fed = len(prompt_ids) - 1, False  # the target's tokens whose text the cache holds; fed this step

    def lag(self, ids):
        """As a draft model's (`DraftSession.lag`), counted in the target's tokens committed since the cache last fed:
        the draft's for that text are about as many, and counting them exactly would re-encode the text each step."""
        return max(0, len(ids) - self.synced - 1)

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Cut the cache back to what it shares with `context`, feed the rest; logits [1, vocab] after it."""
        self._rollback(min(common_prefix_length(self.cached, context), len(context) - 1))  # feed ≥ 1 token
        return self._feed(context[len(self.cached) :])

    def commit(self, ids):
        if self.fed:  # the cache holds the text up to the step's own token (what it accepted of the draft, at least)
            self.synced, self.fed = len(ids) - 1, False

    def propose(self, ids, gamma, params, generator):
        context = self.view(self.context.ids(ids))
        model = self.drafter.model
        if gamma <= 0 or not context or len(context) + gamma >= model.context_length:
            return Draft.empty()
        logits = self._sync(context)  # [1, draft vocab]
        self.fed = True
        params = params.in_draft_vocabulary()
        if params.greedy:
            return self._greedy(ids, context, logits, gamma, params)
        return self._sampled(context, logits, gamma, params, generator)

    def _greedy(self, ids: list[int], context: list[int], logits: torch.Tensor, gamma: int, params: SamplingParams) -> Draft:
        """γ draft tokens by the draft's own argmax, turned into the target's tokens through their text."""
        seen = penalties(params, logits.shape[-1], context, device=logits.device, output_start=self.output_start)  # one row, or None
        drafted: list[int] = []
        for _ in range(gamma):
            token = int(greedy_tokens(logits, params, seen))
            drafted.append(token)
            if token in self.drafter.model.eos_ids or len(drafted) == gamma:
                break
            if seen is not None:
                seen.add(token)
            logits = self._feed([token])
        target = self.drafter.target
        tokens = retokenize(target.tokenizer, self.drafter.model.tokenizer, ids, context, drafted)[:gamma]
        return Draft(torch.tensor([t for t in tokens if t < target.vocab_size], dtype=torch.long))

    def _sampled(self, context: list[int], logits: torch.Tensor, gamma: int, params: SamplingParams,
                 generator: torch.Generator | None) -> Draft:
        """γ tokens drawn from the draft's distribution restricted to the shared vocabulary; their probs
        [γ, target vocab] sit at the target's ids."""
        shared = self.drafter.shared
        seen = penalties(params, logits.shape[-1], context, device=logits.device, output_start=self.output_start)  # one row, or None
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(gamma):
            probs = shared.restrict(to_probs(logits, params, seen)[0])  # [shared]
            if probs is None:  # the draft puts no weight on any shared token: nothing more to propose
                break
            pick = int(multinomial(probs[None], generator))
            row = torch.zeros(self.drafter.target.vocab_size, dtype=probs.dtype, device=probs.device)  # [target vocab]
            row[shared.target_ids] = probs
            tokens.append(int(shared.target_ids[pick]))
            rows.append(row)
            draft_token = int(shared.draft_ids[pick])
            if seen is not None:
                seen.add(draft_token)
            if i + 1 < gamma:
                logits = self._feed([draft_token])
        if not tokens:
            return Draft.empty()
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(rows))

