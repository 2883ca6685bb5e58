"""ONNX Runtime's side of bench/ort.py, run by the peers' Python (`make peers`), where onnxruntime and a torch
that can export live without bouquet: exports the model once, then times the batches it is given.

    .venv-peers/bin/python bench/ort_worker.py export MODEL_DIR OUT.onnx
    .venv-peers/bin/python bench/ort_worker.py run MODEL.onnx TOKENIZER.json WORKLOAD.json   # prints JSON

The export is transformers' BertModel traced by torch.onnx (opset 17), then fused by onnxruntime's own BERT
optimizer (EmbedLayerNormalization, Attention, BiasGelu, SkipLayerNormalization), as optimum's O2 does: the
fastest float32 graph ONNX Runtime offers for this model. Inputs are padded to each batch's longest text,
as every ONNX Runtime server pads; mean pooling over the real tokens, as the model's sentence-transformers
config says.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

INPUTS = ["input_ids", "attention_mask", "token_type_ids"]


def export(model_dir: str, out: str) -> None:
    import torch
    from onnxruntime.transformers import optimizer
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    ids = torch.ones(2, 16, dtype=torch.long)
    traced = Path(out).with_suffix(".traced.onnx")
    axes = {name: {0: "batch", 1: "sequence"} for name in [*INPUTS, "last_hidden_state"]}
    with torch.no_grad():
        torch.onnx.export(
            model, (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(traced), dynamo=False,
            input_names=INPUTS, output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=17,
        )  # fmt: skip
    fused = optimizer.optimize_model(
        str(traced), model_type="bert", num_heads=config.num_attention_heads, hidden_size=config.hidden_size
    )
    fused.save_model_to_file(out)
    traced.unlink()
    print(json.dumps(fused.get_fused_operator_statistics()))


def run(onnx_path: str, tokenizer_path: str, workload_path: str) -> None:
    """Workload: {"threads": n, "max_length": n, "batches": {name: [[text, ...], ...]}}; prints
    {name: {"seconds": [per batch], "tokens": real tokens}} and the first batch's embeddings for a check."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    workload = json.loads(Path(workload_path).read_text())
    tokenizer = Tokenizer.from_file(tokenizer_path)
    tokenizer.no_padding()  # the model's tokenizer.json pads to 128; a batch is padded to its longest below
    tokenizer.enable_truncation(workload["max_length"])
    options = ort.SessionOptions()
    options.intra_op_num_threads = workload["threads"]
    session = ort.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
    results, first = {}, None
    for name, batches in workload["batches"].items():
        embed(session, tokenizer, batches[0])  # warm-up
        seconds, tokens = [], 0
        for texts in batches:
            start = time.perf_counter()
            rows, real = embed(session, tokenizer, texts)
            seconds.append(time.perf_counter() - start)
            tokens += real
            first = rows.tolist() if first is None else first
        results[name] = {"seconds": seconds, "tokens": tokens}
    print(json.dumps({"results": results, "first": first}))


def embed(session, tokenizer, texts: list[str]) -> tuple[np.ndarray, int]:
    """Tokenize, pad to the longest, run, mean-pool: what an ONNX Runtime server does per batch."""
    encodings = tokenizer.encode_batch(texts)
    ids = np.zeros((len(encodings), max(len(e.ids) for e in encodings)), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, encoding in enumerate(encodings):
        ids[row, : len(encoding.ids)] = encoding.ids
        mask[row, : len(encoding.ids)] = 1
    hidden = session.run(None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)})[0]
    weights = mask[..., None].astype(np.float32)
    return (hidden * weights).sum(axis=1) / weights.sum(axis=1), int(mask.sum())


if __name__ == "__main__":
    {"export": export, "run": run}[sys.argv[1]](*sys.argv[2:])
