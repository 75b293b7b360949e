"""Short side-by-side measurement of cascade and derived drafts on the real Qwen pair (fp32, greedy, 64 tokens).

    PYTHONPATH=src python scripts/measure_cascade.py "none;model;cascade;cascade:kind=horizontal,strong=2;model:vocab=32768;self:layers=8"
"""
import sys
from verispec import Engine, GenerationConfig
from verispec.bench.prompts import PROMPTS
from verispec.drafters import DraftModelDrafter, NgramDrafter
from verispec.drafters.cascade import HorizontalCascadeDrafter, VerticalCascadeDrafter
from verispec.models.loading import load_model
from verispec.models.variants import derive_model

names = sys.argv[1].split(";") if len(sys.argv) > 1 else None
target = load_model("qwen2.5-coder-1.5b-instruct")
draft = load_model("qwen2.5-coder-0.5b-instruct")
V = target.vocab_size
builders = {
    "none": lambda: None,
    "model": lambda: DraftModelDrafter(draft, V),
    "cascade": lambda: VerticalCascadeDrafter(draft, NgramDrafter(max_n=3), V),
    "cascade:kind=horizontal,strong=2": lambda: HorizontalCascadeDrafter(DraftModelDrafter(draft, V), NgramDrafter(max_n=3), 2, V),
    "model:vocab=32768": lambda: DraftModelDrafter(derive_model(draft, vocab=32768), V),
    "self:layers=8": lambda: DraftModelDrafter(derive_model(target, layers=8), V),
    "model:int8=1": lambda: DraftModelDrafter(derive_model(draft, int8=True), V),
}
methods = {n: builders[n]() for n in (names or builders)}
prompts = [p for p in PROMPTS if p.category in ("code", "summarization")]
seen, chosen = set(), []
for p in prompts:
    if p.category not in seen:
        seen.add(p.category); chosen.append(p)
rows = {n: [] for n in methods}
ref = {}
for i, prompt in enumerate(chosen):
    ids = target.encode_prompt(prompt.text)
    order = list(methods)[i % len(methods):] + list(methods)[: i % len(methods)]
    for name in order:
        engine = Engine(target, methods[name], gamma=4, gamma_policy="analytic")
        r = engine.generate(ids, GenerationConfig(max_new_tokens=64))
        s = r.stats
        rows[name].append(dict(prompt=prompt.name, tau=s.mean_accepted_length, c=s.cost_ratio, tps=s.tokens_per_second,
                               alpha=s.acceptance_rate, steps=s.steps, new=s.new_tokens, ids=r.token_ids))
        ref.setdefault(prompt.name, r.token_ids)
        print(f"{prompt.name:20s} {name:36s} τ {s.mean_accepted_length:.2f} α {s.acceptance_rate:.2f} c {s.cost_ratio:.3f} "
              f"{s.tokens_per_second:.2f} tok/s same-as-first {r.token_ids == ref[prompt.name]}", flush=True)
print("\n| method | τ | α | c | tok/s (mean) |\n|---|---|---|---|---|")
for name, rs in rows.items():
    m = lambda k: sum(r[k] for r in rs) / len(rs)
    print(f"| {name} | {m('tau'):.2f} | {m('alpha'):.2f} | {m('c'):.3f} | {m('tps'):.2f} |")
