"""Ways of running attention over packed variable-length sequences on the CPU, measured on the whole model.

cpu_varlen is bouquet's own kernel, which takes the packed batch as it is. The SDPA backend groups sequences
into padded batches whose attention efficiency (real work over padded work) stays above `min_efficiency`.
Its two ends are the other designs: 0 puts the whole batch in one padded call (a block-diagonal mask in
effect, with padding), above 1 gives every sequence its own call.
Batches are cut from real documents two ways: length-sorted (what `bouquet embed` does) and in arrival
order (what the replica's first come, first served queue gives). Runs are interleaved; medians reported,
and cpu_varlen's ratio to the best SDPA strategy, for each vector code the kernel has that this CPU runs
(`--isas`: an AVX-512 machine runs the AVX2 code too; run under ATEN_CPU_CAPABILITY=avx2 to give SDPA AVX2's).

    .venv/bin/python bench/attention.py [--dtype bfloat16] [--batch-tokens 4096] [--repeats 5] [--isas avx512,avx2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import corpus
import numpy as np

from bouquet.batch import Batch, token_budget_runs
from bouquet.config import EngineConfig, default_model_path
from bouquet.engine.engine import Engine
from bouquet.layers.attention_backends import AttentionBackend
from bouquet.layers.attention_backends.cpu_varlen import CpuVarlenBackend, kernel_isa
from bouquet.layers.attention_backends.sdpa import SdpaBackend
from bouquet.tokenizer import TextTokenizer

SDPA_STRATEGIES = {"one padded call": 0.0, "grouped (0.5)": 0.5, "grouped (0.8)": 0.8, "per sequence": 1.01}


def backends(isas: list[str]) -> dict[str, Callable[[], AttentionBackend]]:
    made: dict[str, Callable[[], AttentionBackend]] = {}
    for isa in isas:
        made[f"cpu_varlen {isa}"] = lambda isa=isa: CpuVarlenBackend(isa=isa)
    for name, min_efficiency in SDPA_STRATEGIES.items():
        made[f"sdpa {name}"] = lambda m=min_efficiency: SdpaBackend(m)
    return made


def batches_of(ids: list[list[int]], batch_tokens: int) -> list[Batch]:
    packed = Batch.pack(ids)
    return [packed.slice(start, stop) for start, stop in token_budget_runs(packed.cu_seqlens, batch_tokens)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    runnable = [isa for isa in ("avx512", "avx2") if kernel_isa(isa) == isa] or ["baseline"]
    parser.add_argument("--isas", default=",".join(runnable), help="the kernel's vector codes to measure")
    args = parser.parse_args()
    isas = args.isas.split(",")
    engine = Engine(EngineConfig(default_model_path(), "cpu", args.dtype))
    shape = engine.attn_backend.shape
    ids = TextTokenizer(engine.spec.tokenizer_file, engine.max_seq_length).encode(corpus.documents())
    tokens = sum(map(len, ids))
    orders = {"length-sorted": sorted(ids, key=len), "arrival order": ids}
    print(f"{len(ids)} documents, {tokens} tokens, {args.dtype}, batches of {args.batch_tokens} tokens")
    for order, sequences in orders.items():
        batches = batches_of(sequences, args.batch_tokens)
        samples: dict[str, list[float]] = {name: [] for name in backends(isas)}
        for _ in range(args.repeats + 1):  # the first round warms up
            for name, make in backends(isas).items():
                engine.attn_backend = make()
                engine.attn_backend.bind(shape)
                start = time.perf_counter()
                for lazy in [engine.step(batch) for batch in batches]:  # every engine worker busy
                    lazy.result()
                samples[name].append(time.perf_counter() - start)
        rates = {name: tokens / statistics.median(times[1:]) for name, times in samples.items()}
        for name, times in samples.items():
            runs = np.round(tokens / np.array(times[1:]))
            print(f"{order:<15}{name:<26}{rates[name]:>8.0f} tokens/s   runs {runs}")
        best_sdpa = max(rate for name, rate in rates.items() if name.startswith("sdpa"))
        for isa in isas:
            print(f"{order:<15}cpu_varlen {isa} / best sdpa: {rates[f'cpu_varlen {isa}'] / best_sdpa:.2f}x")
    engine.close()


if __name__ == "__main__":
    main()
