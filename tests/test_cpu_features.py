"""The CPU feature probe and what it decides: `--dtype auto`, bfloat16 on CPUs without packed bfloat16 (plain
linears and one warning, never a traceback), and the kernel's vector code. The probe is overridden here
($BOUQUET_CPU_FEATURES) so that the branches of CPUs this machine is not are exercised too; a subprocess runs
the AVX2 emulation itself (ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2), where torch refuses to pack
bfloat16 weights as on a real AVX2 CPU."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from conftest import embed_ids, row_cosines
from corpus import parity_texts

from bouquet.config import EngineConfig, resolve_dtype, widest_linear
from bouquet.cpu_features import CpuFeatures, cap_at_onednn_isa, cpu_features
from bouquet.engine import dtype_choice
from bouquet.engine.dtype_choice import MEASURED_ROWS, linear_timings, timings_path
from bouquet.engine.engine import Engine
from bouquet.layers.attention_backends import cpu_varlen
from bouquet.layers.linear import Linear
from bouquet.machine_cache import write_measurement

AVX2_ONLY = "sse4_1,avx,avx2,fma,f16c,bmi1,bmi2"
XEON_VNNI = AVX2_ONLY + ",avx512f,avx512bw,avx512vl,avx512dq,avx512cd,avx512_vnni"
ZEN4 = XEON_VNNI + ",avx512_bf16"
SAPPHIRE_RAPIDS = ZEN4 + ",amx_tile,amx_bf16,amx_int8"


@pytest.fixture
def probe(monkeypatch):
    """Sets the probe's answer for the test (and puts the real one back after)."""

    def set_flags(flags: str | None) -> CpuFeatures:
        if flags is None:
            monkeypatch.delenv("BOUQUET_CPU_FEATURES", raising=False)
        else:
            monkeypatch.setenv("BOUQUET_CPU_FEATURES", flags)
        cpu_features.cache_clear()
        return cpu_features()

    yield set_flags
    monkeypatch.delenv("BOUQUET_CPU_FEATURES", raising=False)
    cpu_features.cache_clear()


def test_the_probe_reads_this_machines_flags() -> None:
    features = cpu_features()
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo")
    assert features.has("sse2") or features.source != "/proc/cpuinfo"
    assert features.isa in ("avx512", "avx2", "baseline") and features.model_name


@pytest.mark.parametrize(
    ("flags", "isa", "packed", "fast", "vnni"),
    [
        (AVX2_ONLY, "avx2", False, False, False),
        (XEON_VNNI, "avx512", True, False, True),
        (ZEN4, "avx512", True, True, True),
        (SAPPHIRE_RAPIDS, "avx512", True, True, True),
        (AVX2_ONLY + ",avx_vnni,avx_ne_convert", "avx2", True, False, True),
        ("sse4_1", "baseline", False, False, False),
    ],
    ids=["avx2", "xeon-vnni", "zen4", "amx", "avx2-ne-convert", "baseline"],
)
def test_what_each_cpu_allows(probe, flags, isa, packed, fast, vnni) -> None:
    features = probe(flags)
    assert (features.isa, features.packed_bf16, features.fast_bf16, features.vnni) == (isa, packed, fast, vnni)
    assert features.source == "$BOUQUET_CPU_FEATURES"


def test_onednn_isa_cap_removes_what_onednn_will_not_use() -> None:
    zen4 = CpuFeatures(frozenset(ZEN4.split(",")), "test CPU")
    avx2 = cap_at_onednn_isa(zen4, "AVX2")
    assert avx2.isa == "avx2" and not avx2.packed_bf16 and not avx2.has("avx512_vnni")
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in avx2.source
    vnni = cap_at_onednn_isa(zen4, "avx512_core_vnni")
    assert vnni.vnni and vnni.packed_bf16 and not vnni.fast_bf16
    assert cap_at_onednn_isa(zen4, "ALL") == zen4
    assert cap_at_onednn_isa(zen4, "AVX512_CORE_AMX").flags == zen4.flags


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """Sets what the bfloat16 / float32 measurement (engine/dtype_choice.py) found on this machine for a linear shape,
    in a folder of the test's own: per dtype, the seconds of one call at each measured row count."""
    machines = dtype_choice.measurement_path
    monkeypatch.setattr(dtype_choice, "measurement_path", lambda kind, key: tmp_path / machines(kind, key).name)

    def store(shape: tuple[int, int], float32: float, bfloat16: float) -> None:
        seconds = {dtype: {rows: value * rows for rows in MEASURED_ROWS} for dtype, value in
                   (("float32", float32), ("bfloat16", bfloat16))}  # fmt: skip
        write_measurement(timings_path(*shape), {"seconds": seconds})

    return store


@pytest.mark.parametrize(
    ("flags", "bfloat16_seconds", "expected"),
    [(AVX2_ONLY, None, "float32"), (XEON_VNNI, None, "float32"), (ZEN4, 0.5, "bfloat16"), (ZEN4, 1.6, "float32")],
    ids=["avx2", "xeon-vnni", "zen4-bf16-measured-faster", "zen4-bf16-measured-slower"],
)
def test_dtype_auto_on_the_cpu_is_bfloat16_only_where_native_and_measured_faster(
    probe, measured, caplog, tmp_path, minilm_path, flags, bfloat16_seconds, expected
) -> None:
    probe(flags)
    if bfloat16_seconds is not None:
        measured(widest_linear(json.loads((minilm_path / "config.json").read_text())), 1.0, bfloat16_seconds)
    with caplog.at_level(logging.INFO):
        assert resolve_dtype("auto", "cpu", minilm_path) == expected
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype auto")]
    assert len(said) == 1 and said[0].startswith(f"dtype auto: {expected}") and "avx512_bf16" in said[0]
    if bfloat16_seconds is None:  # not native: nothing measured
        assert "no avx512_bf16 or amx_bf16" in said[0] and not list(tmp_path.iterdir())
    else:
        assert ("measured faster" in said[0]) == (expected == "bfloat16") and "cached in" in said[0]
    assert resolve_dtype("auto", "cuda") == "bfloat16" and resolve_dtype("float32", "cpu") == "float32"


def test_the_bfloat16_measurement_runs_once_per_machine_and_shape(monkeypatch, tmp_path) -> None:
    """Real timings on this CPU (which dtype wins is this machine's business): measured, cached, read back."""
    monkeypatch.setenv("BOUQUET_CACHE_DIR", str(tmp_path))
    first = linear_timings(64, 256)
    assert first.source.startswith("measured") and timings_path(64, 256).exists()
    assert all(first.seconds[dtype][rows] > 0 for dtype in ("float32", "bfloat16") for rows in MEASURED_ROWS)
    again = linear_timings(64, 256)
    assert again.source.startswith("cached") and again.seconds == first.seconds
    assert linear_timings(64, 128).source.startswith("measured")  # another shape, its own measurement


def test_bfloat16_without_packed_bfloat16_runs_plain_linears_and_warns_once(
    probe, caplog, minilm_path, minilm_tokenizer, minilm_fp32
) -> None:
    probe(AVX2_ONLY)
    with caplog.at_level(logging.WARNING):
        engine = Engine(EngineConfig(minilm_path, "cpu", "bfloat16"))
    try:
        warnings = [r.getMessage() for r in caplog.records if "float32 is faster" in r.getMessage()]
        assert len(warnings) == 1 and "avx512bw" in warnings[0] and "unpacked" in warnings[0]
        linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
        assert linears and all(m.packed_weight is None and m.weight.dtype == torch.bfloat16 for m in linears)
        if isinstance(engine.attn_backend, cpu_varlen.CpuVarlenBackend):
            assert engine.attn_backend.isa == "avx2" and not engine.attn_backend.bf16_dot
        ids = minilm_tokenizer.encode(parity_texts()[:16])
        assert row_cosines(embed_ids(engine, ids), embed_ids(minilm_fp32, ids)).min() >= 0.999
    finally:
        engine.close()


def test_bfloat16_with_emulated_bfloat16_warns_that_float32_is_faster(probe, caplog, minilm_path) -> None:
    if not cpu_features().packed_bf16:  # the probe is only told VNNI: oneDNN itself must still pack bfloat16
        pytest.skip(f"oneDNN packs no bfloat16 here (needs avx512bw, avx512vl, avx512dq): {cpu_features().describe()}")
    probe(XEON_VNNI)
    with caplog.at_level(logging.WARNING):
        engine = Engine(EngineConfig(minilm_path, "cpu", "bfloat16", cpu_warmup_tokens=0))
    try:
        assert "oneDNN emulates bfloat16" in caplog.text and "avx512_bf16" in caplog.text
        assert all(m.packed_weight is not None for m in engine.model.modules() if isinstance(m, Linear))
    finally:
        engine.close()


@pytest.mark.parametrize(("bfloat16_seconds", "warns"), [(0.5, False), (1.6, True)], ids=["faster", "slower"])
def test_native_bfloat16_packs_and_warns_only_where_measured_slower(
    probe, measured, caplog, minilm_path, bfloat16_seconds, warns
) -> None:
    if not cpu_features().fast_bf16:
        pytest.skip(f"this CPU lacks avx512_bf16 and amx_bf16: {cpu_features().describe()}")
    probe(None)
    measured(widest_linear(json.loads((minilm_path / "config.json").read_text())), 1.0, bfloat16_seconds)
    with caplog.at_level(logging.WARNING):
        engine = Engine(EngineConfig(minilm_path, "cpu", "bfloat16", cpu_warmup_tokens=0))
    try:
        assert ("measured slower than float32's" in caplog.text) == warns
        assert "oneDNN emulates" not in caplog.text and "unpacked" not in caplog.text
    finally:
        engine.close()


EMULATED = """
import sys, numpy as np
from bouquet.config import create_engine_config
from bouquet.cpu_features import cpu_features
from bouquet.engine.engine import Engine
from bouquet.batch import Batch
print(cpu_features().isa, cpu_features().packed_bf16)
rows = {}
for dtype in ("bfloat16", "float32"):
    engine = Engine(create_engine_config(device="cpu", dtype=dtype, cpu_warmup_tokens=64))
    rows[dtype] = engine.embed(Batch.pack([[101, 7592, 2088, 102], [101, 2023, 2003, 1037, 3231, 102]]))
    print(dtype, engine.attn_backend.name, getattr(engine.attn_backend, "isa", "-"))
    engine.close()
a, b = rows["bfloat16"], rows["float32"]
print("cosine", float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min()))
print("auto", create_engine_config(device="cpu").dtype)
"""


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
@pytest.mark.process
def test_an_emulated_avx2_cpu_runs_bfloat16_and_picks_float32_for_auto(tmp_path) -> None:
    """ONEDNN_MAX_CPU_ISA=AVX2 makes torch refuse to pack bfloat16 weights ("bf16 path needs the cpu support
    avx_ne_convert or avx512bw, avx512vl and avx512dq"), as an AVX2 CPU does: the engine still runs."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    env["BOUQUET_CACHE_DIR"] = str(tmp_path)
    env.pop("BOUQUET_CPU_FEATURES", None)
    result = subprocess.run([sys.executable, "-c", EMULATED], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "avx2 False"
    assert "float32 is faster on this CPU" in result.stderr and "Traceback" not in result.stderr
    for line in lines[1:3]:
        isa = line.split()[2]
        assert isa in ("avx2", "-"), line  # cpu_varlen runs its AVX2 code, or SDPA was measured faster
    assert float(lines[3].split()[1]) >= 0.999
    assert lines[4] == "auto float32"


@pytest.mark.parametrize("flags", [ZEN4, SAPPHIRE_RAPIDS.replace(",amx_bf16", "")])
def test_bfloat16_tiles_only_where_the_probe_grants_amx_bf16(probe, flags: str) -> None:
    from bouquet.layers import bf16_amx
    from bouquet.layers.linear import Linear, use_amx_bf16_linears

    probe(flags)
    model = torch.nn.Sequential(Linear(64, 32).to(torch.bfloat16))
    assert not bf16_amx.available()
    assert use_amx_bf16_linears(model) == 0 and model[0].amx_bf16 is None
