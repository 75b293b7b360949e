"""Tiny random models built from configs (with a word-level tokenizer) for fast CPU tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def make_tiny_model(
    folder: Path, vocab_size: int = 48, seed: int = 0, layers: int = 2, arch: str = "qwen2", hidden: int = 32,
    words: list[str] | None = None, context: int = 128,
) -> Path:
    """Save a random model + word-level tokenizer into `folder`: token i is `words[i]` (default "t{i}"),
    eos = token 0, unknown = token 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    config = config_cls(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context, eos_token_id=0,
        bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # larger logits than the default init, so distributions are not near-uniform
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(folder)
    words = words or [f"t{i}" for i in range(vocab_size)]
    assert len(words) == vocab_size
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token=words[1]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=words[0], unk_token=words[1]).save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def one_thread_for_tiny_models(request):
    """Tiny models run on one thread: their matmuls are too small to split, and two threads only add
    synchronisation (~50× slower on a loaded 2-core CPU). Tests marked `real` keep every core."""
    if request.node.get_closest_marker("real"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(items):
    """Tests on the shipped models use every core: they run in the serial run, after the parallel one.
    Files marked `first` (long, mostly waiting on other processes) start the parallel run, so the rest
    of the suite runs beside them instead of after them (xdist hands out files in collection order)."""
    for item in items:
        if item.get_closest_marker("real"):
            item.add_marker(pytest.mark.serial)
    items.sort(key=lambda item: item.get_closest_marker("first") is None)  # stable: order kept otherwise


@pytest.fixture(scope="session", autouse=True)
def compiled_kernels():
    """The C++ kernels load from the user's cache directory (built there once per machine and CPU
    kind), before any test points the cache elsewhere: otherwise the first test on a private cache
    would compile them again, every session."""
    from verispec.models.kernels import extension

    extension("int8")
    extension("kquant")


@pytest.fixture(autouse=True)
def private_cache(request, tmp_path_factory, monkeypatch):
    """Tests on tiny models keep their int8 values, kquant tiles, measured costs and online drafts out of the
    user's cache directory. Tests marked `real` use it: the shipped models' conversions live there."""
    if not request.node.get_closest_marker("real"):
        monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module", autouse=True)
def private_module_cache(request, tmp_path_factory):
    """`private_cache` for the module-scoped fixtures of a module without `real` tests (they run before any
    test's own fixtures): the costs they measure and the layers they prepare stay out of the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        if not any(item.module is request.module and item.get_closest_marker("real") for item in request.session.items):
            patch.setenv("VERISPEC_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        yield


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_target(tiny_dir) -> Path:
    return make_tiny_model(tiny_dir / "target", seed=1, layers=3)


@pytest.fixture(scope="session")
def tiny_draft(tiny_dir) -> Path:
    return make_tiny_model(tiny_dir / "draft", seed=2, layers=1)


@pytest.fixture(scope="module")
def target(tiny_target):
    """The tiny target loaded by verispec, one per test module (some tests adjust its eos ids)."""
    from verispec.models.loading import load_model

    return load_model(tiny_target)


@pytest.fixture(scope="module")
def draft(tiny_draft):
    from verispec.models.loading import load_model

    return load_model(tiny_draft)


@pytest.fixture(scope="session")
def small_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """A 12-token (target, draft) pair, small enough that the exact distribution of a few new tokens
    can be enumerated."""
    folder = tmp_path_factory.mktemp("small")
    return (make_tiny_model(folder / "t", vocab_size=12, seed=21, layers=2),
            make_tiny_model(folder / "d", vocab_size=12, seed=22, layers=1))


@pytest.fixture(scope="module")
def small_pair(small_dirs):
    """The 12-token pair loaded by verispec, one per test module, with no eos (fixed-length sequences,
    so the exact distribution is a simple product), and the target as a Hugging Face model."""
    from transformers import AutoModelForCausalLM

    from verispec.models.loading import load_model

    target_dir, draft_dir = small_dirs
    target, draft = load_model(target_dir), load_model(draft_dir)
    target.eos_ids = frozenset()
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return target, draft, hf


@pytest.fixture(scope="session")
def tiny_other_vocab(tiny_dir) -> Path:
    return make_tiny_model(tiny_dir / "other", vocab_size=40, seed=3, layers=1)


@pytest.fixture(scope="session")
def hf_target(tiny_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_text_pair(tiny_dir) -> tuple[Path, Path]:
    """A (target, draft) pair whose tokenizers encode text ("t3 t4 t5" → [3, 4, 5]): Llama configs, since
    AutoTokenizer maps a qwen2 config to Qwen2Tokenizer, which drops the word-level vocabulary."""
    return (make_tiny_model(tiny_dir / "text-target", seed=4, layers=2, arch="llama"),
            make_tiny_model(tiny_dir / "text-draft", seed=5, layers=1, arch="llama"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that failed on a timeout reports where every thread of its process stood then (a server's
    scheduler, its tokenizer thread): a hang in CI shows its place instead of only the client's wait."""
    report = yield
    if call.excinfo is not None and "timeout" in call.excinfo.typename.lower():
        import sys
        import threading
        import traceback

        names = {thread.ident: thread.name for thread in threading.enumerate()}
        stacks = [f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
                  for ident, frame in sys._current_frames().items()]
        report.sections.append(("threads at the timeout", "\n".join(stacks)))
    return report
