"""The llama.cpp backend (precision gguf): the runner protocol over llama.cpp sequences, exactness of
greedy speculation against plain decoding of the same file, and losslessness of sampled speculation.

The model is the shipped SmolLM2-135M GGUF (a small llama-architecture file: the package installs
once, no conversion). The oracle for greedy is plain decoding on the same backend; for sampling, the
exact distribution of short continuations computed from the backend's own one-at-a-time logits.
"""

from __future__ import annotations


import pytest
import torch

from distribution import assert_rejected, assert_same_distribution, bonus_from_the_wrong_row, sample_sequences
from verispec import Engine, GenerationConfig, SamplingParams
from verispec.drafters import DraftModelDrafter, ExpansionDrafter, NgramDrafter, make_drafter
from verispec.models.loading import load_model
from verispec.sampling.processors import to_probs

pytestmark = pytest.mark.real

MODEL = "smollm2-135m-instruct"
PROMPT = "List three facts about the moon, one per line."


@pytest.fixture(scope="module")
def target():
    return load_model(MODEL, "gguf")


@pytest.fixture(scope="module")
def wide_target():
    return load_model(MODEL, "gguf-wide")


@pytest.fixture(scope="module")
def draft32():
    """The same model in verispec's own float32 runner: close to the GGUF's distributions, not equal."""
    return load_model(MODEL, "float32", pack_rows=1)


@pytest.fixture(scope="module")
def draft8():
    """The same model in verispec's own int8 runner: a cheaper draft, also close but not equal."""
    return load_model(MODEL, "int8", pack_rows=1)


def _tokens(model, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(10, model.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))  # [n]


def test_plain_decoding_gives_llama_cpps_own_tokens(target):
    """Greedy plain decoding on the gguf backend equals llama-cpp-python's own loop from an empty cache
    (`verispec bench`'s llama-cpp-fresh), prompt after prompt: the same prefill, the same argmax."""
    from verispec.tools.bench.compare import LlamaCppMethod

    own_loop = LlamaCppMethod.load("llama-cpp-fresh", target.runner.path, target.eos_ids, 0.0)
    engine = Engine(target, None)
    prompts = [PROMPT, "Name a prime number above 50.", "List three facts about the sun, one per line."]
    for prompt in prompts:  # the third shares a long prefix with the first: nothing of it may be reused
        ids = target.encode_prompt(prompt)
        ours = engine.generate(ids, GenerationConfig(max_new_tokens=24)).token_ids
        assert list(ours) == own_loop.generate(ids, 24, seed=0).token_ids


def test_exact_width_is_bit_identical_to_single_steps(target):
    """Within the measured exact width, n positions at once give the single-step logits bit for bit."""
    runner, width = target.runner, target.runner.exact_positions
    assert width is not None and width >= 1
    prompt, fed = target.encode_prompt(PROMPT), _tokens(target, width)
    single_cache, batch_cache = runner.prefilled_cache(prompt), runner.prefilled_cache(prompt)
    single = torch.cat([runner.forward(single_cache, fed[i : i + 1]) for i in range(width)])  # [width, vocab]
    assert torch.equal(runner.forward(batch_cache, fed), single)


def test_the_cost_curve_is_timed_no_wider_than_the_exact_width(target):
    """Past the exact width the runner never verifies, so its curve is not timed there."""
    from verispec.control.costs import CostModel

    width = target.runner.exact_positions
    costs = CostModel.calibrated(target, width + 3, long=False)  # asked for 3 positions past the exact width
    assert len(costs.target_seconds) == width and costs.long_target_seconds is None


def test_rollback_then_refeed_matches_a_fresh_sequence(wide_target):
    runner = wide_target.runner
    prompt, fed, other = wide_target.encode_prompt(PROMPT), _tokens(wide_target, 6, 1), _tokens(wide_target, 6, 2)
    cache = runner.prefilled_cache(prompt)
    start = cache.length
    runner.forward(cache, other)  # a rejected draft …
    cache.truncate(start)  # … rolled back
    fresh = runner.prefilled_cache(prompt)
    torch.testing.assert_close(runner.forward(cache, fed), runner.forward(fresh, fed), rtol=0, atol=1e-3)


def test_a_token_tree_scores_each_node_as_its_own_chain(wide_target):
    """root → a → b and root → c: one tree pass gives each node the logits of its path fed as a chain,
    and keeping the path root, c leaves the cache as if only that chain had been fed."""
    runner = wide_target.runner
    prompt = wide_target.encode_prompt(PROMPT)
    root, a, b, c = _tokens(wide_target, 4, 3).tolist()
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)  # [4, 4]
    cache = runner.prefilled_cache(prompt)
    start = cache.length
    positions = start + torch.tensor([0, 1, 2, 1])
    tree = runner.forward(cache, torch.tensor([root, a, b, c]), positions=positions, tree_mask=mask)  # [4, vocab]
    chain_ab = runner.forward(runner.prefilled_cache(prompt), torch.tensor([root, a, b]))
    chain_c = runner.forward(runner.prefilled_cache(prompt), torch.tensor([root, c]))
    torch.testing.assert_close(tree[:3], chain_ab, rtol=0, atol=1e-2)
    torch.testing.assert_close(tree[3], chain_c[1], rtol=0, atol=1e-2)
    cache.keep(start, torch.tensor([0, 3]))  # the accepted path: root, c
    assert cache.length == start + 2
    after, reference = _tokens(wide_target, 2, 4), runner.prefilled_cache(prompt)
    runner.forward(reference, torch.tensor([root, c]))
    torch.testing.assert_close(runner.forward(cache, after), runner.forward(reference, after), rtol=0, atol=1e-2)


def test_steps_after_a_kept_tree_path_round_as_plain_decoding(target):
    """Keeping root, c of the tree root → a → b, root → c skips the cells of a and b. The following
    single-token steps give the logits of a cache that was fed root, c as a chain, bit for bit: the kept
    cells are laid out in position order again, not left for the next tokens to fill the gap before c."""
    runner = target.runner
    prompt = target.encode_prompt(PROMPT)
    root, a, b, c = _tokens(target, 4, 3).tolist()
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)  # [4, 4]
    cache, reference = runner.prefilled_cache(prompt), runner.prefilled_cache(prompt)
    start = cache.length
    runner.forward(cache, torch.tensor([root, a, b, c]), positions=start + torch.tensor([0, 1, 2, 1]), tree_mask=mask)
    cache.keep(start, torch.tensor([0, 3]))
    runner.forward(reference, torch.tensor([root, c]))
    for token in _tokens(target, 6, 5):
        assert torch.equal(runner.forward(cache, token[None]), runner.forward(reference, token[None]))
    cache.release(), reference.release()


def test_contexts_are_given_back_and_reused(target, monkeypatch):
    """More requests over time than the runner keeps contexts: each request ends and gives its context
    back (emptied) to a bounded pool, the next request reuses it, and a cache dropped without
    `release()` is given back too."""
    from verispec.models import llama_cpp
    from verispec.models.llama_cpp import IDLE_CONTEXTS

    runner = target.runner
    engine = Engine(target, NgramDrafter(), gamma=2, gamma_policy="constant")
    short = target.encode_prompt("Hi", chat=False)
    created = []
    make = llama_cpp._Context.__init__
    monkeypatch.setattr(llama_cpp._Context, "__init__", lambda self, *args, **kwargs: created.append(self) or make(self, *args, **kwargs))
    for _ in range(20):
        engine.start(short, GenerationConfig(max_new_tokens=2)).close()
    assert 1 <= len(runner._idle) <= IDLE_CONTEXTS
    assert len(created) <= 1  # reused, not created anew for each request
    dropped = runner.new_cache(8)
    context = dropped.context
    del dropped
    runner.new_cache(8).release()
    assert context in runner._idle


def _decode_alone(runner, prompt: list[int], fed: torch.Tensor) -> torch.Tensor:
    cache = runner.prefilled_cache(prompt)
    logits = torch.cat([runner.forward(cache, fed[i : i + 1]) for i in range(len(fed))])  # [n, vocab]
    cache.release()
    return logits


def test_a_request_s_logits_do_not_depend_on_the_others(target):
    """Batch invariance: the same prompt and tokens give bit-identical logits decoded alone or while
    other requests hold long caches, decode between its steps and end (a shared KV cache fails this:
    ggml's attention then depends on every sequence's cells)."""
    runner = target.runner
    prompt, fed = target.encode_prompt(PROMPT), _tokens(target, 12, 5)
    alone = _decode_alone(runner, prompt, fed)
    others = [runner.prefilled_cache(_tokens(target, 700, seed).tolist()) for seed in (6, 7)]
    cache = runner.prefilled_cache(prompt)
    rows = []
    for i in range(len(fed)):
        for other in others:
            runner.forward(other, _tokens(target, 3, i))
            other.truncate(other.length - 1)  # rolled back: its cells are handed out again
        rows.append(runner.forward(cache, fed[i : i + 1]))
        if i == 6:
            others.pop().release()
    for other in others:
        other.release()
    assert torch.equal(torch.cat(rows), alone)


def test_a_cache_that_outgrows_its_context_moves_without_changing_its_logits(target):
    """A cache started small grows past its context (moved into a larger one): the logits after the
    move equal those of a cache that had room from the start, bit for bit."""
    runner = target.runner
    prompt, fed = _tokens(target, 300, 8).tolist(), _tokens(target, 4, 9)
    small = runner.new_cache(1)
    start = small.context.size
    runner.forward(small, torch.tensor(prompt), logits="none")
    assert small.context.size > start
    roomy = runner.new_cache(1024)
    runner.forward(roomy, torch.tensor(prompt), logits="none")
    assert torch.equal(runner.forward(small, fed), runner.forward(roomy, fed))
    small.release(), roomy.release()


@pytest.mark.parametrize("drafter", ["ngram", "model32", "tree", "gguf"])
def test_greedy_speculation_is_token_identical_to_plain_decoding(target, draft32, drafter):
    if drafter == "model32":
        built = DraftModelDrafter(draft32, target.vocab_size)
    elif drafter == "tree":
        built = ExpansionDrafter(draft32, target.vocab_size, k=2, depth=2)
    else:
        built = make_drafter(drafter if drafter == "ngram" else f"gguf:{MODEL}", target)
    config = GenerationConfig(max_new_tokens=40)
    plain = Engine(target, None).generate(PROMPT, config)
    result = Engine(target, built, gamma=4, gamma_policy="constant").generate(PROMPT, config)
    assert result.token_ids == plain.token_ids
    assert result.stats.steps < len(result.token_ids) or drafter == "ngram"  # it really drafted


PARAMS = SamplingParams(temperature=1.0, top_k=3)
LENGTH = 3  # longer than γ: the bonus token is inside the tested event
GAMMA = 2


def _exact_distribution(target, prompt_ids: list[int]) -> dict[tuple[int, ...], float]:
    """P(continuation) for every continuation of LENGTH tokens (or ending at a stop id) under top-3
    sampling, from the backend's logits computed as plain decoding computes them: the prompt
    prefilled, then one token per pass."""
    runner, prefilled = target.runner, target.runner.prefilled_cache(prompt_ids)
    frontier = [((), 1.0)]
    for _ in range(LENGTH):
        grown = []
        for prefix, prob in frontier:
            if prefix and prefix[-1] in target.eos_ids:  # generation stopped there
                grown.append((prefix, prob))
                continue
            fed = [prompt_ids[-1], *prefix]
            for token in fed:
                logits = runner.forward(prefilled, torch.tensor([token]))  # [1, vocab]
            prefilled.truncate(len(prompt_ids) - 1)
            probs = to_probs(logits, PARAMS)[0]  # [vocab]
            for token in probs.nonzero()[:, 0].tolist():
                grown.append((prefix + (token,), prob * float(probs[token])))
        frontier = grown
    prefilled.release()
    return dict(frontier)


SAMPLES = 500  # ≤ 27 sequences: detects a total-variation bias of ≈ 0.18 with 90 % power (printed by the test)
CONTROL_SAMPLES = 100  # the mutant's bias is far larger: fewer samples reject it


@pytest.fixture(scope="module")
def sampling_case(target):
    prompt_ids = target.encode_prompt("My favourite colour is", chat=False)
    return prompt_ids, _exact_distribution(target, prompt_ids)


def test_sampled_speculation_is_lossless_on_the_backend(target, draft8, sampling_case):
    """An int8 draft of the same model (close, not equal) under the rejection rule: the sequences
    follow the backend's own distribution (the test's power is printed)."""
    prompt_ids, exact = sampling_case
    engine = Engine(target, DraftModelDrafter(draft8, target.vocab_size), gamma=GAMMA, gamma_policy="constant")
    assert_same_distribution(sample_sequences(engine, prompt_ids, PARAMS, SAMPLES, LENGTH), exact)


def test_the_backend_test_rejects_a_bonus_from_the_wrong_row(target, draft8, sampling_case, monkeypatch):
    """Positive control: the bonus token drawn from the wrong row is caught by the same test."""
    import verispec.engine.shapes as loop

    monkeypatch.setattr(loop, "verify_sampled", bonus_from_the_wrong_row)
    prompt_ids, exact = sampling_case
    engine = Engine(target, DraftModelDrafter(draft8, target.vocab_size), gamma=GAMMA, gamma_policy="constant")
    assert_rejected(sample_sequences(engine, prompt_ids, PARAMS, CONTROL_SAMPLES, LENGTH), exact)


@pytest.mark.parametrize("spec", ["self:layers=4", "online", "triforce"])
def test_drafters_that_need_the_torch_runner_say_so(target, spec):
    from verispec.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="needs verispec's own runner"):
        make_drafter(spec, target, load=lambda name, dtype, pack_rows=1: target)  # the draft model: the target itself


def test_beam_search_on_the_backend_says_so(target):
    from verispec.engine import beam_search
    from verispec.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="beam search needs verispec's own runner"):
        beam_search(target, target.encode_prompt(PROMPT), num_beams=2, max_new_tokens=4)


@pytest.mark.parametrize("precision", ["gguf", "gguf-wide"])
def test_the_server_batches_requests_on_the_backend(precision, target, wide_target):
    """Concurrent requests through the OpenAI client: on gguf each answer is the engine's own answer
    alone (one request per pass keeps the kernels' widths); on gguf-wide requests share passes."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI
    from server_helpers import LocalServer, expected_text

    from verispec.serving.http import create_app

    model = target if precision == "gguf" else wide_target
    engine = Engine(model, NgramDrafter(max_n=3), gamma=2, gamma_policy="constant")
    prompts = ["The moon is", "Water boils at", "A list of fruits:", "def add(a, b):"]
    with LocalServer(create_app(engine, model_name="smol")) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")

        def ask(prompt):
            return client.completions.create(model="smol", prompt=prompt, max_tokens=16, temperature=0).choices[0]

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, prompts))
    assert all(a.finish_reason in ("stop", "length") and a.text for a in answers)
    if precision == "gguf":
        assert [a.text for a in answers] == [expected_text(engine, p, 16) for p in prompts]


def test_chunked_prefill_keeps_greedy_tokens(target):
    """A 660-token prompt prefilled in chunks (as the server does) gives the greedy tokens of one whole
    prefill. What does not hold: bit-identical logits. llama.cpp picks its kernels by how many rows a
    decode holds, so the prompt's keys/values round differently for most chunk sizes (on the AVX2 EPYC
    chunks of 1, 7, 64 and 300 differ from the whole prefill by up to 0.8 in a logit; chunks of 256
    and 512, which split the prompt where its own 512-token batches do, give the same bits), and a
    near-tie could flip; this prompt has none within 32 tokens. Fails on a chunking that loses or
    repeats prompt tokens: 64 (ten full chunks and a short last one) and 256 (the batch boundary)."""
    from verispec.engine import Generation

    engine = Engine(target, NgramDrafter(max_n=3), gamma=2, gamma_policy="constant")
    text = " ".join(f"Line {i}: the moon orbits the earth every month and reflects sunlight." for i in range(40))
    ids, config = engine.prompt_ids(text), GenerationConfig(max_new_tokens=32)
    whole = engine.generate(ids, config).token_ids
    for chunk in (64, 256):
        generation = Generation(engine, ids, config, prefill=False)
        while not generation.prefill_step(chunk):
            pass
        while not generation.done:
            generation.step()
        assert generation.result().token_ids == whole, chunk


def test_the_exact_width_holds_after_a_long_context_too(target):
    """Once single-token steps attend 512 cells or more, ggml splits their attention over threads
    (a different summation from any pass of several rows): the runner's bound there is measured after
    such a context, and passes within it give the single steps' logits bit for bit."""
    from verispec.models.llama_cpp import SPLIT_ATTENTION_CELLS

    runner = target.runner
    runner.prepare_decoding()  # what an engine's prepare() measures before its first request
    short, long = runner.exact_positions_after(0), runner.exact_positions_after(2 * SPLIT_ATTENTION_CELLS)
    assert short == runner.exact_positions and long == runner.exact_positions_long and 1 <= long <= short
    prompt, fed = _tokens(target, SPLIT_ATTENTION_CELLS + 40, 10).tolist(), _tokens(target, long, 11)
    single_cache, batch_cache = runner.prefilled_cache(prompt), runner.prefilled_cache(prompt)
    single = torch.cat([runner.forward(single_cache, fed[i : i + 1]) for i in range(long)])  # [long, vocab]
    assert torch.equal(runner.forward(batch_cache, fed), single)
    single_cache.release(), batch_cache.release()


def test_greedy_speculation_after_a_long_prompt_is_token_identical_to_plain_decoding(target):
    """A prompt past 512 cells (a summary or RAG request): speculation keeps plain decoding's tokens
    (it drafts only as far as the long-context bound allows)."""
    text = " ".join(f"Item {i % 7}: the moon orbits the earth and reflects sunlight." for i in range(60))
    config = GenerationConfig(max_new_tokens=40)
    ids = Engine(target, None).prompt_ids(text)
    assert len(ids) > 600
    plain = Engine(target, None).generate(ids, config)
    speculative = Engine(target, NgramDrafter(max_n=3), gamma=4, gamma_policy="constant").generate(ids, config)
    assert speculative.token_ids == plain.token_ids
