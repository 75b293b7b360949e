"""Drafter options have ranges, checked when the spec is parsed: a spec cannot ask for unbounded work
per step (huge trees, n-grams, draft lengths) through the API, the CLI or a server request; and
`check_drafter_spec` refuses, without any model, every spec the factory refuses before loading one."""

from __future__ import annotations

import inspect

import pytest

from verispec.drafters import (
    ExpansionDrafter, HybridDrafter, MergeDrafter, NgramDrafter, StandDrafter, check_drafter_spec, make_drafter,
)
from verispec.drafters.online import OnlineDrafter
from verispec.drafters.specs import CASCADE_OPTIONS, MAX_TREE_NODES, OPTION_RANGES, VARIANT_OPTIONS, split_specs, tree_nodes
from verispec.drafters.specs import NOT_OPTIONS as _NOT_OPTIONS
from verispec.drafters.triforce import TriForceDrafter
from verispec.errors import InvalidParameterError


def test_every_option_has_a_documented_range():
    factories = [NgramDrafter, StandDrafter, ExpansionDrafter, MergeDrafter.model_and_ngram, MergeDrafter.lookup, HybridDrafter,
                 OnlineDrafter, TriForceDrafter]
    names = {name for factory in factories for name in inspect.signature(factory).parameters if name not in _NOT_OPTIONS}
    names |= {"self_layers", *VARIANT_OPTIONS, *(o for options in CASCADE_OPTIONS.values() for o in options)}
    names -= {"target", "target_vocab_size", "model", "draft", "kind"}  # positional, not integers
    assert names <= set(OPTION_RANGES), sorted(names - set(OPTION_RANGES))
    import verispec.drafters as drafters

    for name in ("max_n", "k", "depth", "nodes", "budget", "inner_gamma"):  # listed in the module docstring
        assert name in drafters.__doc__.split("Option ranges")[1]


REFUSED = [
    ("tree:k=1000,depth=1000", "k=1000 in 'tree:k=1000,depth=1000' is out of range: use 1…8"),
    ("tree:k=8,depth=12,wide=3", f"holds {tree_nodes(8, 12, 3)} nodes, more than {MAX_TREE_NODES}"),
    ("stand:k=4,depth=12,wide=4", "more than 256"),
    ("stand:nodes=257", "nodes=257"),
    ("lookup:nodes=250,table_nodes=16", "its trees hold 266 nodes, more than 256"),  # each within its range, not both
    ("ngram:max_n=17", "max_n=17 in 'ngram:max_n=17' is out of range: use 1…16"),
    ("ngram:max_n=99999999999999999999999999999", "out of range"),
    ("hybrid:min_rate=101", "min_rate=101"),
    ("online:rank=100000", "rank=100000"),
    ("online:self_layers=100000", "self_layers=100000"),
    ("triforce:budget=100000000", "budget=100000000"),
    ("cascade:kind=horizontal,strong=33", "strong=33"),
    ("cascade:inner_gamma=1000", "inner_gamma=1000"),
    ("cascade:max_n=40", "max_n=40"),
    ("self:layers=100000", "layers=100000"),
    ("model:vocab=99999999", "vocab=99999999"),
    ("tree:depth=2,wide=3", "wide must not exceed depth, got wide=3 and depth=2"),
    ("ngram:min_n=4,max_n=3", "min_n must not exceed max_n"),
    ("stand:max_n=1", "min_n must not exceed max_n, got min_n=2 and max_n=1"),  # min_n's default
    ("triforce:chunk=64,budget=32", "chunk must not exceed budget"),
    ("triforce:bugdet=4", "unknown triforce drafter option 'bugdet'"),
    ("cascade:kind=diagonal", "use kind=vertical or kind=horizontal"),
    ("self:layer=2", "unknown drafter option 'layer'"),
]


@pytest.mark.parametrize(("spec", "message"), REFUSED)
def test_out_of_range_options_are_refused_before_any_work(target, spec, message):
    """No draft model is needed to refuse these (the loader would fail otherwise: none is loaded)."""
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded for a refused spec")

    with pytest.raises(InvalidParameterError) as error:
        make_drafter(spec, target, load=no_loading)
    assert message in str(error.value)


@pytest.mark.parametrize(("spec", "message"), REFUSED)
def test_a_spec_is_checked_without_a_model_as_the_factory_checks_it(spec, message):
    """What a server runs in the request handler, before it queues the request."""
    with pytest.raises(InvalidParameterError) as error:
        check_drafter_spec(spec)
    assert message in str(error.value)


@pytest.mark.parametrize("spec", [None, "none", "ngram", "ngram:max_n=2,min_n=2", "tree:k=3,depth=4,wide=4", "stand:nodes=40",
                                  "lookup:nodes=32,table_nodes=16", "hybrid:min_match=3", "online:self_layers=2,rank=4", "triforce:budget=64,chunk=16",
                                  "cascade:kind=horizontal,strong=2", "self:layers=2", "model:some-name,layers=3", "gguf:x", "some-name"])
def test_a_valid_spec_passes_the_check(spec):
    check_drafter_spec(spec)


def test_bounded_trees_build(target, draft):
    load = lambda *args, **kwargs: draft  # noqa: E731
    assert make_drafter("tree:k=2,depth=8", target, load=load).shape == (2, 1, 1, 1, 1, 1, 1, 1)
    assert make_drafter("tree:k=3,depth=4,wide=4", target, load=load).name == "tree:k=3,depth=4,wide=4"  # 120 nodes
    assert len(make_drafter("stand:k=2,depth=7,wide=7", target).paths) == tree_nodes(2, 7, 7) == 254


def test_a_list_of_specs_splits_where_a_new_spec_begins():
    """A comma followed by `name=` continues the spec before it (its next option); any other comma starts a spec."""
    assert split_specs("none, lookup:nodes=16,table_nodes=8@12,ngram@12,stand:k=2, depth=5,cascade:kind=horizontal,strong=2,"
                       "model:some-name,layers=4,some/folder") == [
        "none", "lookup:nodes=16,table_nodes=8@12", "ngram@12", "stand:k=2, depth=5", "cascade:kind=horizontal,strong=2",
        "model:some-name,layers=4", "some/folder"]
    assert split_specs("") == split_specs(None) == []
