"""Grammar-constrained decoding (`response_format`) stays lossless w.r.t. the constrained target.

The grammar used on the tiny models ("t0" … "t47" word tokens) alternates two token classes,
`(("t2" | "t3" | "t5") ("t4" | "t6" | "t7" | "t9"))+`, so the allowed set depends on the position and
an unconstrained draft often proposes forbidden tokens, which must be rejected. The oracle is a plain
Python rule (`allowed`), independent of xgrammar and of the engine's masks.

Greedy: constrained speculative decoding (n-gram, draft model, the target as its own draft, a SpecInfer
token tree, and an "oracle" drafter that proposes the right constrained continuation with every third
token wrong, as a chain or as a tree with a wrong sibling at each level, so that long drafts are
accepted, bonus tokens drawn and rejections happen mid-draft) is token-identical to the reference
decoder masked by the oracle. Sampled: chi-square test (tests/stats.py,
significance 1e-3) of N = 1 200 sequences of 3 tokens (γ = 2: a draft-model chain, or a full binary
token tree of depth 2; 12-token vocabulary, 12 outcomes) against
the exact constrained distribution the reference enumerates; each test prints the smallest total-
variation bias it detects with 90 % power (≈ 0.09). Positive control: the same test rejects an engine
whose masks constrain only the first row of a verification pass (a draft token the grammar forbids can
then be accepted or a forbidden token sampled), on 400 samples.
"""

import json

import pytest
import torch
from distribution import assert_rejected, assert_same_distribution

from verispec import Engine, GenerationConfig, SamplingParams
from verispec.drafters import DraftModelDrafter, ExpansionDrafter, NgramDrafter
from verispec.drafters.base import Drafter, DraftSession
from verispec.errors import InvalidParameterError
from verispec.models.loading import load_model
from verispec.sampling.grammar import Constraint
from verispec.testing.reference import reference_generate, sequence_distribution
from verispec.types import Draft

FIRST, SECOND = (2, 3, 5), (4, 6, 7, 9)
GRAMMAR = {"type": "grammar", "grammar": 'root ::= (("t2" | "t3" | "t5") ("t4" | "t6" | "t7" | "t9"))+'}
PROMPTS = [[5, 9, 2, 7], [11, 3, 3, 3, 8, 1, 30, 12, 5], [40]]


def allowed(vocab: int, eos: frozenset[int]):
    """The oracle: bool [vocab] of the tokens the alternating grammar allows after `prefix`."""
    def rule(prefix: tuple[int, ...]) -> torch.Tensor:
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[list(FIRST if len(prefix) % 2 == 0 else SECOND)] = True
        if prefix and len(prefix) % 2 == 0:  # a whole pair: the grammar may end here
            mask[list(eos)] = True
        return mask
    return rule


class _OracleSession(DraftSession):
    def __init__(self, prompt: list[int], answer: list[int]):
        self.prompt, self.answer = prompt, answer

    def propose(self, ids, gamma, params, generator) -> Draft:
        done = len(ids) - len(self.prompt)
        tokens = self.answer[done : done + gamma]
        return Draft(torch.tensor([_wrong(t, done + i) if (done + i) % 3 == 2 else t for i, t in enumerate(tokens)], dtype=torch.long))


def _wrong(token: int, position: int) -> int:
    """A token the grammar forbids (t40) at every sixth position, an allowed but different one at the others."""
    if position % 6 == 2:
        return 40
    same = SECOND if token in SECOND else FIRST
    return next(t for t in same if t != token)


class _OracleTreeSession(_OracleSession):
    def propose(self, ids, gamma, params, generator) -> Draft:
        """Two children per level, [the chain's token, another allowed or forbidden one]; the first
        continues. Every third level the chain's token is wrong too, so the tree is rejected mid-way."""
        chain = super().propose(ids, gamma, params, generator).tokens.tolist()
        done = len(ids) - len(self.prompt)
        tokens, parents, on_chain = [], [], -1  # nodes 2L and 2L+1 at level L; the chain's one alternates
        for level, token in enumerate(chain):
            other = _wrong(token, done + level + 3)
            tokens += [token, other] if level % 2 == 0 else [other, token]
            parents += [on_chain, on_chain]
            on_chain = 2 * level + level % 2
        return Draft(torch.tensor(tokens, dtype=torch.long), None, torch.tensor(parents))


class OracleDrafter(Drafter):
    """Drafts the expected constrained output of each prompt, with every third position wrong (as a
    chain, or as a tree with a wrong sibling at every level)."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], tree: bool = False):
        self.answers, self.tree = answers, tree

    def start(self, prompt_ids):
        return (_OracleTreeSession if self.tree else _OracleSession)(list(prompt_ids), self.answers[tuple(prompt_ids)])


def _drafters(target, draft, answers):
    return {
        "ngram": NgramDrafter(max_n=3),
        "model": DraftModelDrafter(draft, target.vocab_size),
        "self": DraftModelDrafter(target, target.vocab_size),  # unconstrained: it proposes forbidden tokens
        "oracle": OracleDrafter(answers),
        "oracle-tree": OracleDrafter(answers, tree=True),
        "tree": ExpansionDrafter(draft, target.vocab_size, k=2, depth=3),
        "none": None,
    }


def test_masks_follow_the_grammar_through_a_draft(target):
    """Row i of `masks(draft)` is the oracle's set after draft[:i]; the matcher is rolled back after."""
    rule = allowed(target.vocab_size, target.eos_ids)
    constraint = Constraint.from_response_format(GRAMMAR, target.tokenizer, target.vocab_size, target.eos_ids)
    draft = [3, 9, 5, 4]
    masks = constraint.masks(draft)  # [5, vocab]
    assert [masks[i].nonzero().flatten().tolist() for i in range(5)] == [
        rule(tuple(draft[:i])).nonzero().flatten().tolist() for i in range(5)]
    assert torch.equal(constraint.masks([]), masks[:1])  # rolled back: the same state as before
    forbidden = constraint.masks([4, 2])  # t4 cannot come first: rows after it are never used
    assert torch.equal(forbidden[0], masks[0]) and forbidden[1:].all()
    constraint.advance([3, 9])
    assert torch.equal(constraint.masks([])[0], rule((3, 9)))


def test_tree_masks_follow_each_nodes_path(target):
    """Row i+1 is the oracle's set after the path to node i, whatever the node order (here the children
    of node 0 come after node 1's subtree began); a forbidden node's subtree is never scored."""
    rule = allowed(target.vocab_size, target.eos_ids)
    constraint = Constraint.from_response_format(GRAMMAR, target.tokenizer, target.vocab_size, target.eos_ids)
    tokens = [3, 5, 40, 9, 4, 2, 7, 6]
    parents = [-1, -1, -1, 1, 0, 3, 5, 2]  # node 2 (t40) is forbidden, node 7 lies under it
    masks = constraint.masks(tokens, parents)  # [9, vocab]

    def path(node):
        return path(parents[node]) + [tokens[node]] if node >= 0 else []
    for node in range(len(tokens)):
        if node in (2, 7):
            assert masks[node + 1].all()
        else:
            assert torch.equal(masks[node + 1], rule(tuple(path(node)))), node
    assert torch.equal(constraint.masks([])[0], masks[0])  # rolled back


@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize("kind", ["ngram", "model", "self", "oracle", "oracle-tree", "tree", "none"])
def test_greedy_constrained_is_token_identical_to_the_masked_reference(target, draft, hf_target, kind, gamma):
    """Fails if a forbidden draft token can be accepted or a mask row is off by one (e.g. rows after
    the first left unmasked: the oracle drafter's accepted runs then end in unconstrained bonus tokens)."""
    rule = allowed(target.vocab_size, target.eos_ids)
    answers = {tuple(p): reference_generate(hf_target, p, 20, eos_ids=target.eos_ids, allowed=rule) for p in PROMPTS}
    engine = Engine(target, _drafters(target, draft, answers)[kind], gamma=gamma, gamma_policy="constant")
    for prompt in PROMPTS:
        expected = answers[tuple(prompt)]
        result = engine.generate(prompt, GenerationConfig(max_new_tokens=20, response_format=GRAMMAR))
        assert result.token_ids == expected
        assert all(rule(tuple(result.token_ids[:i]))[token] for i, token in enumerate(result.token_ids))
        if kind.startswith("oracle") and len(expected) > 5:  # the oracle's drafts were accepted, and rejected, mid-draft
            assert 0 < result.stats.accepted_tokens < result.stats.proposed_tokens


def test_bad_formats_are_refused(target):
    for bad, message in [({"type": "xml"}, "type must be one of"), ({"type": "json_schema"}, "schema"),
                         ({"type": "grammar", "grammar": "root ::= ("}, "cannot compile the grammar: EBNF parser error"),
                         ({"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}, 'compile the json_schema: Unsupported type "foo"'),
                         ({"type": "grammar", "grammar": "x" * 70_000}, "larger than")]:
        with pytest.raises(InvalidParameterError, match=message) as error:
            Engine(target, None).generate(PROMPTS[0], GenerationConfig(max_new_tokens=4, response_format=bad))
        assert error.value.param == "response_format"


# ---- sampled: in distribution ---------------------------------------------------------------------

PROMPT, LENGTH, GAMMA, SAMPLES = [3, 7], 3, 2, 1_200
SMALL_GRAMMAR = {"type": "grammar", "grammar": 'root ::= (("t2" | "t3") ("t4" | "t5" | "t6"))+'}


def small_rule(prefix: tuple[int, ...]) -> torch.Tensor:
    mask = torch.zeros(12, dtype=torch.bool)
    mask[[2, 3] if len(prefix) % 2 == 0 else [4, 5, 6]] = True
    return mask


def _constrained_samples(engine, n: int) -> list[tuple[int, ...]]:
    from verispec import GenerationConfig as Config

    params = SamplingParams(temperature=1.0)
    return [tuple(engine.generate(PROMPT, Config(max_new_tokens=LENGTH, sampling=params, seed=seed,
                                                 response_format=SMALL_GRAMMAR)).token_ids) for seed in range(n)]


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_sampled_constrained_output_is_the_constrained_target(small_pair, kind):
    target, draft, hf = small_pair
    drafter = (DraftModelDrafter(draft, target.vocab_size) if kind == "chain"
               else ExpansionDrafter(draft, target.vocab_size, k=2, depth=GAMMA, wide=GAMMA))
    engine = Engine(target, drafter, gamma=GAMMA, gamma_policy="constant")
    exact = sequence_distribution(hf, PROMPT, LENGTH, SamplingParams(temperature=1.0), allowed=small_rule)
    assert len(exact) == 12
    result = assert_same_distribution(_constrained_samples(engine, SAMPLES), exact)
    assert result.detectable_tv < 0.1


def test_the_constrained_test_catches_a_mask_on_the_first_row_only(small_pair, monkeypatch):
    """Positive control: masks that constrain row 0 only (later rows unconstrained) must be rejected."""
    def first_row_only(self, draft_tokens, parents=None):
        masks = torch.ones(len(draft_tokens) + 1, self.width, dtype=torch.bool)
        masks[0] = self._allowed()
        return masks

    monkeypatch.setattr(Constraint, "masks", first_row_only)
    monkeypatch.setattr(Constraint, "advance", lambda self, tokens: None)  # the wrong rule emits forbidden tokens
    target, draft, hf = small_pair
    engine = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=GAMMA, gamma_policy="constant")
    exact = sequence_distribution(hf, PROMPT, LENGTH, SamplingParams(temperature=1.0), allowed=small_rule)
    assert_rejected(_constrained_samples(engine, 400), exact)


# ---- JSON on a character-level tiny model -----------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


def test_json_schema_output_parses_and_matches_plain_decoding(char_target):
    """On a character vocabulary a random model can spell JSON: the output parses and follows the
    schema, and speculative (n-gram, the model as its own draft) equals plain constrained decoding."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    config = GenerationConfig(max_new_tokens=60, response_format=fmt)
    texts = set()
    for drafter in [None, NgramDrafter(max_n=3), DraftModelDrafter(char_target, char_target.vocab_size)]:
        result = Engine(char_target, drafter, gamma=3, gamma_policy="constant").generate("ok? ", config)
        assert result.finish_reason == "stop" and set(json.loads(result.text)) == {"ok"}
        texts.add(result.text)
    assert len(texts) == 1
    any_json = Engine(char_target, None).generate("ok? ", GenerationConfig(max_new_tokens=60, response_format={"type": "json_object"}))
    assert any_json.text and any_json.finish_reason in ("stop", "length")


@pytest.fixture(scope="module")
def char_target(tmp_path_factory):
    from char_model import char_model

    return char_model(tmp_path_factory.mktemp("chars") / "model")


@pytest.mark.real
def test_a_real_model_answers_json_that_follows_the_schema():
    """SmolLM2-135M (float32): constrained speculative (n-gram) output equals constrained plain decoding
    and parses as JSON that follows the schema."""
    target = load_model("smollm2-135m-instruct", "float32")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "moons": {"type": "integer"}},
              "required": ["name", "moons"], "additionalProperties": False}
    config = GenerationConfig(max_new_tokens=48, response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    prompt = "Give the name of Mars and how many moons it has, as JSON."
    plain = Engine(target, None).generate(prompt, config)
    fast = Engine(target, NgramDrafter(max_n=3), gamma=4, gamma_policy="constant").generate(prompt, config)
    assert fast.token_ids == plain.token_ids and plain.finish_reason == "stop"
    answer = json.loads(plain.text)
    assert set(answer) == {"name", "moons"} and isinstance(answer["name"], str) and isinstance(answer["moons"], int)
