"""Where a warm `verispec generate` start goes, part by part, the way it is done now and the way it was done before
(`benchmarks/probes/startup.sh` times the whole): the tokenizer (a new process: `load_tokenizer`'s kept state against
transformers' `from_pretrained`, imports included; torch's import alone), the GGUF header, kquant's tiles (read from the cache against
repacking every layer), and the chat prompt's prefill (after the disk prompt cache against from scratch).

    .venv/bin/python benchmarks/probes/startup_parts.py     # on warm caches: run `verispec generate Hi` once first
"""

from __future__ import annotations

import subprocess
import sys
import time

import torch

from verispec.models.gguf_weights import _LAYER_NAMES, _MODEL_NAMES, GGUFWeights, _header_index, tensor_index
from verispec.models.kquant import KQuantTiles, KQuantWeight
from verispec.models.loading import load_model
from verispec.models.registry import DEFAULT_TARGET, gguf_file, gguf_tokenizer_folder
from verispec.paths import cpu_summary


def seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def in_new_process(code: str) -> float:
    """Seconds a fresh interpreter takes to run `code` (its imports included), less an empty interpreter's."""
    def run(body: str) -> float:
        return seconds(lambda: subprocess.run([sys.executable, "-c", body], check=True, capture_output=True))
    return run(code) - run("pass")


def main() -> None:
    print(cpu_summary(), f"{torch.get_num_threads()} threads")
    gguf = gguf_file(DEFAULT_TARGET)
    folder = gguf_tokenizer_folder(gguf)
    load = "from pathlib import Path; from verispec.models.tokenizer import {0}; {0}(Path({1!r}))"
    fast, slow = (in_new_process(load.format(way, str(folder))) for way in ("load_tokenizer", "hf_tokenizer"))
    print(f"tokenizer, imports included: kept state {fast:.2f} s, transformers {slow:.2f} s; "
          f"importing torch alone {in_new_process('import torch'):.2f} s")
    _header_index.cache_clear()
    print(f"GGUF header: {seconds(lambda: tensor_index(gguf)):.2f} s")
    model = load_model(DEFAULT_TARGET, "kquant")  # the tiles come from the cache (written by a first load)
    _header_index.cache_clear()
    print(f"kquant target from cached tiles, header included: {seconds(lambda: load_model(DEFAULT_TARGET, 'kquant')):.2f} s")
    weights = GGUFWeights(gguf, model.runner.config.num_heads, model.runner.config.num_kv_heads)
    names = [*_MODEL_NAMES, *(f"model.layers.{i}.{rest}" for i in range(model.runner.config.num_layers) for rest in _LAYER_NAMES)]
    quantized = [name for name in names if name in weights and isinstance(weights[name], KQuantWeight)]
    print(f"repacking its {len(quantized)} k-quant tensors: "
          f"{seconds(lambda: [KQuantTiles.repack(weights[name]) for name in quantized]):.2f} s")
    prompt = model.encode_prompt("Hi")
    for label, store in (("from scratch", None), ("after the disk prompt cache", model)):
        from verispec.models.prefixes import prefix_store_for

        prefixes = prefix_store_for(store) if store is not None else None
        taken = prefixes.take(prompt, len(prompt) + 8) if prefixes is not None else None
        cache = taken if taken is not None else model.runner.new_cache(len(prompt) + 8)
        fed = torch.tensor(prompt[cache.length :])
        print(f"prefill of the chat prompt ({len(prompt)} tokens) {label}: "
              f"{seconds(lambda: model.runner.forward(cache, fed, logits='last')):.2f} s ({len(prompt) - len(fed)} cached)")


if __name__ == "__main__":
    main()
