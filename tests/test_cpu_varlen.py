"""The cpu_varlen attention backend: its C kernel against per-sequence SDPA, how it is built and loaded, and
`auto` falling back to SDPA where it cannot run."""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import embed_ids, packed_context, per_sequence_attention, row_cosines
from corpus import parity_texts

from bouquet.config import EngineConfig
from bouquet.cpu_features import cpu_features
from bouquet.engine.engine import Engine
from bouquet.kernels import build
from bouquet.kernels.openmp import find_thread_setter, on_passing_thread
from bouquet.layers.attention_backends import AttentionShape, BackendUnavailableError, cpu_varlen
from bouquet.layers.attention_backends.cpu_varlen import CpuVarlenBackend
from bouquet.layers.attention_backends.sdpa import SdpaBackend
from bouquet.layers.attention_backends.selection import create_auto_backend
from bouquet.layers.context import ForwardContext

# Lengths around the kernel's tiles (8 query rows, 16 keys a vector), one token, and a long one.
SEQ_LENS = {
    "tile_edges": [1, 7, 8, 9, 15, 16, 17, 33],
    "single_long": [300],
    "mixed": [5, 64, 2, 129, 31],
}


def _run(backend, q, k, v, seq_lens, causal, scale=None):
    return backend.forward(q, k, v, packed_context(backend, seq_lens), causal, scale or q.shape[-1] ** -0.5)


# Every vector code this CPU runs (an AVX-512 machine runs all three): each is checked as the CPUs that have
# only it would run it.
ISAS = [isa for isa in cpu_varlen.ISA_LEVELS if cpu_varlen.kernel_isa(isa) == isa]


@pytest.fixture(scope="module", params=ISAS)
def backend(request) -> CpuVarlenBackend:
    return CpuVarlenBackend(isa=request.param)


def test_the_kernel_runs_the_isa_it_is_told_capped_at_the_cpus() -> None:
    assert "baseline" in ISAS
    assert cpu_varlen.kernel_isa() == cpu_varlen.kernel_isa(cpu_features().isa)
    for isa in cpu_varlen.ISA_LEVELS:
        assert CpuVarlenBackend(isa=isa).isa == cpu_varlen.kernel_isa(isa)
    assert not CpuVarlenBackend(bf16_dot=True, isa="avx2").bf16_dot  # the dot products are AVX-512 code


@pytest.mark.parametrize("seq_lens", SEQ_LENS.values(), ids=SEQ_LENS.keys())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 12, 32), (4, 2, 16), (2, 1, 48), (4, 2, 128)])
def test_float32_matches_per_sequence_sdpa(backend, seq_lens, causal, heads, kv_heads, head_dim) -> None:
    torch.manual_seed(0)
    total = sum(seq_lens)
    q = torch.randn(total, heads, head_dim)
    k, v = torch.randn(total, kv_heads, head_dim), torch.randn(total, kv_heads, head_dim)
    out = _run(backend, q, k, v, seq_lens, causal)
    assert out.shape == q.shape and out.dtype == torch.float32
    expected = per_sequence_attention(q, k, v, seq_lens, causal, head_dim**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_widened_is_float32_math_rounded_once(causal, isa) -> None:
    torch.manual_seed(1)
    seq_lens = SEQ_LENS["mixed"]
    q, k, v = (torch.randn(sum(seq_lens), 12, 32).bfloat16() for _ in range(3))
    out = _run(CpuVarlenBackend(bf16_dot=False, isa=isa), q, k, v, seq_lens, causal)
    assert out.dtype == torch.bfloat16
    expected = per_sequence_attention(q, k, v, seq_lens, causal, 32**-0.5)
    # Only the output's rounding to bfloat16 differs from float32 math on the same inputs: half an ulp, plus
    # float32 noise on values near zero.
    torch.testing.assert_close(out.float(), expected, atol=1e-5, rtol=2**-8)


@pytest.mark.skipif(not cpu_varlen.has_bf16_dot(), reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 12, 32), (4, 2, 128), (2, 1, 48)])  # 48: widened
def test_bfloat16_dot_products_are_as_close_as_torchs_bfloat16_attention(causal, heads, kv_heads, head_dim) -> None:
    torch.manual_seed(1)
    seq_lens = SEQ_LENS["mixed"]
    q = torch.randn(sum(seq_lens), heads, head_dim).bfloat16()
    k, v = (torch.randn(sum(seq_lens), kv_heads, head_dim).bfloat16() for _ in range(2))
    out = _run(CpuVarlenBackend(bf16_dot=True), q, k, v, seq_lens, causal).float()
    exact = per_sequence_attention(q, k, v, seq_lens, causal, head_dim**-0.5)
    ours, theirs = (out - exact).abs(), (per_sequence_attention(q, k, v, seq_lens, causal, dtype=q.dtype) - exact).abs()
    assert ours.mean() <= 1.1 * theirs.mean(), (ours.mean(), theirs.mean())
    assert ours.max() <= 1.25 * theirs.max(), (ours.max(), theirs.max())
    widened = _run(CpuVarlenBackend(bf16_dot=False), q, k, v, seq_lens, causal).float()
    assert torch.equal(out, widened) == (head_dim % 32 != 0), "the dot path runs where head_dim allows, only there"


def test_bfloat16_rows_off_word_boundaries_take_the_widened_path() -> None:
    torch.manual_seed(4)
    seq_lens = [9, 40]
    total = sum(seq_lens)
    q = torch.randn(total, 12 * 32 + 1).bfloat16()[:, 1:].unflatten(1, (12, 32))  # token stride 385, odd
    k, v = (torch.randn(total, 12, 32).bfloat16() for _ in range(2))
    out = _run(CpuVarlenBackend(bf16_dot=True), q, k, v, seq_lens, False)
    assert torch.equal(out, _run(CpuVarlenBackend(bf16_dot=False), q, k, v, seq_lens, False))
    expected = per_sequence_attention(q, k, v, seq_lens, False, 32**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=1e-5, rtol=2**-8)


def test_strided_views_of_a_fused_projection_need_no_copy(backend) -> None:
    torch.manual_seed(2)
    seq_lens = [9, 40]
    qkv = torch.randn(sum(seq_lens), 3 * 12, 32)
    q, k, v = qkv.chunk(3, dim=1)  # what the BERT layer passes: token stride 3 * 12 * 32
    expected = _run(backend, q.contiguous(), k.contiguous(), v.contiguous(), seq_lens, False)
    torch.testing.assert_close(_run(backend, q, k, v, seq_lens, False), expected, atol=0, rtol=0)
    transposed = q.transpose(1, 2).contiguous().transpose(1, 2)  # heads not contiguous: copied first
    torch.testing.assert_close(_run(backend, transposed, k, v, seq_lens, False), expected, atol=0, rtol=0)


def test_every_thread_count_gives_the_same_rows(backend) -> None:
    torch.manual_seed(3)
    seq_lens = SEQ_LENS["mixed"]
    q, k, v = (torch.randn(sum(seq_lens), 12, 32) for _ in range(3))
    setter = find_thread_setter()
    assert setter is not None

    def on(threads: int) -> torch.Tensor:
        setter(threads)
        return _run(backend, q, k, v, seq_lens, False)

    # Work is split by (sequence, head), each computed whole by one thread: the same sums in the same order.
    assert torch.equal(on_passing_thread(lambda: on(1)), on_passing_thread(lambda: on(2)))


def test_mismatched_inputs_are_refused_before_the_kernel(backend) -> None:
    q = torch.randn(10, 4, 32)
    with pytest.raises(ValueError, match="do not fit"):
        _run(backend, q, torch.randn(9, 4, 32), torch.randn(9, 4, 32), [10], False)
    with pytest.raises(ValueError, match="one dtype"):
        _run(backend, q, q.bfloat16(), q, [10], False)
    with pytest.raises(ValueError, match="multiple of 16"):
        _run(backend, torch.randn(10, 4, 24), torch.randn(10, 4, 24), torch.randn(10, 4, 24), [10], False)
    with pytest.raises(ValueError, match="do not fit"):  # k and v narrower than q: the kernel would read past them
        _run(backend, q, torch.randn(10, 4, 16), torch.randn(10, 4, 16), [10], False)
    with pytest.raises(ValueError, match="do not fit"):
        _run(backend, q, torch.randn(10, 0, 32), torch.randn(10, 0, 32), [10], False)
    ctx = ForwardContext(torch.tensor([0, 12], dtype=torch.int32), 10, [10])
    with pytest.raises(ValueError, match="do not match seq_lens"):
        backend.prepare(ctx)


def test_bind_accepts_only_shapes_the_kernel_has(backend) -> None:
    backend.bind(AttentionShape(12, 12, 32, False, torch.bfloat16))
    for dtype, head_dim in ((torch.float16, 32), (torch.float32, 24)):
        with pytest.raises(ValueError, match="use sdpa"):
            backend.bind(AttentionShape(12, 12, head_dim, False, dtype))


def test_kernel_shares_torchs_openmp_runtime(backend) -> None:
    library = build.load_kernel("varlen_attention")
    setter = find_thread_setter()
    assert setter is not None

    def seen(threads: int) -> int:
        setter(threads)
        return library.bouquet_omp_max_threads()

    assert [on_passing_thread(lambda n=n: seen(n)) for n in (1, 2, 3)] == [1, 2, 3]


def test_build_is_cached_per_source_and_compiler(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("BOUQUET_CACHE_DIR", str(tmp_path))
    first = build.build_kernel("varlen_attention")
    assert first.parent == tmp_path / "kernels" and first.exists()
    stamp = first.stat().st_mtime_ns

    run = subprocess.run

    def no_compiling(command, **kwargs):
        if "--version" not in command:
            raise AssertionError(f"compiled again: {command}")
        return run(command, **kwargs)

    monkeypatch.setattr(subprocess, "run", no_compiling)
    assert build.build_kernel("varlen_attention") == first
    assert first.stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [first.name]  # no temporary left behind


def test_a_failed_compile_says_why(tmp_path, monkeypatch) -> None:
    fake = tmp_path / "fake-cc"
    fake.write_text("#!/bin/sh\necho 'fake-cc: no such luck' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("BOUQUET_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(fake))
    with pytest.raises(build.KernelBuildError, match="no such luck"):
        build.build_kernel("varlen_attention")
    monkeypatch.setenv("CC", str(tmp_path / "missing-cc"))
    with pytest.raises(build.KernelBuildError, match="not a command found on PATH"):
        build.find_compiler()
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(build.KernelBuildError, match="no C compiler found"):
        build.find_compiler()


def test_every_build_failure_is_a_kernel_build_error(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("BOUQUET_CACHE_DIR", str(blocker / "cache"))  # a directory under a regular file
    with pytest.raises(build.KernelBuildError, match="failed"):
        build.build_kernel("varlen_attention")
    slow = tmp_path / "slow-cc"
    slow.write_text('#!/bin/sh\ncase "$1" in --version) echo slow-cc 1.0 ;; *) exec sleep 5 ;; esac\n')
    slow.chmod(0o755)
    monkeypatch.setenv("BOUQUET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(slow))
    monkeypatch.setattr(build, "_COMPILE_SECONDS", 0.5)
    with pytest.raises(build.KernelBuildError, match="timed out"):
        build.build_kernel("varlen_attention")


def test_cc_may_carry_arguments(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("BOUQUET_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "env cc")
    assert build.find_compiler()[1:] == ["cc"]
    assert build.build_kernel("varlen_attention").exists()


def test_generic_build_matches_the_x86_one(tmp_path) -> None:
    """The build other architectures get (baseline vector code, no clones, no AVX512-BF16 path), compiled here
    with BOUQUET_GENERIC, gives the rows the default build gives on the widened path."""
    source = Path(build.__file__).with_name("varlen_attention.c")
    generic = tmp_path / "generic.so"
    command = [*build.find_compiler(), *build.CFLAGS, "-DBOUQUET_GENERIC", "-o", str(generic), str(source)]
    subprocess.run(command, check=True, capture_output=True)
    library = ctypes.CDLL(str(generic))
    assert library.bouquet_has_bf16_dot() == 0
    torch.manual_seed(5)
    seq_lens = SEQ_LENS["mixed"]
    cu_seqlens = torch.tensor([0, *np.cumsum(seq_lens)], dtype=torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(sum(seq_lens), 4, 64).to(dtype)
        k, v = (torch.randn(sum(seq_lens), 2, 64).to(dtype) for _ in range(2))
        out = torch.empty_like(q)
        library.bouquet_varlen_attention.argtypes = cpu_varlen._kernel().argtypes
        status = library.bouquet_varlen_attention(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), cu_seqlens.data_ptr(), len(seq_lens), 4, 2,
            64, q.stride(0), k.stride(0), v.stride(0), out.stride(0), 64**-0.5, 1, int(dtype == torch.bfloat16), 0,
            -1, -1, cpu_varlen.ISA_LEVELS["avx512"],
        )  # fmt: skip
        assert status == 0
        expected = _run(CpuVarlenBackend(bf16_dot=False), q, k, v, seq_lens, True)
        # Sums may contract into FMAs differently, so a bfloat16 output may round one ulp the other way.
        bf16 = dtype == torch.bfloat16
        torch.testing.assert_close(out, expected, atol=1e-5 if bf16 else 1e-6, rtol=2**-7 if bf16 else 1e-5)


def test_auto_on_the_cpu_falls_back_to_sdpa_where_cpu_varlen_cannot_run(monkeypatch, caplog, tmp_path) -> None:
    monkeypatch.setenv("BOUQUET_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    assert isinstance(create_auto_backend(cpu, AttentionShape(4, 2, 24, True, torch.float32)), SdpaBackend)

    def unavailable() -> None:
        raise BackendUnavailableError("cpu_varlen needs its C kernel: no C compiler found")

    monkeypatch.setattr("bouquet.layers.attention_backends.selection.CpuVarlenBackend", unavailable)
    with caplog.at_level(logging.WARNING):
        assert isinstance(create_auto_backend(cpu, AttentionShape(4, 2, 16, True, torch.float32)), SdpaBackend)
    assert "no C compiler found" in caplog.text


def test_unavailable_kernel_makes_the_backend_unavailable(monkeypatch) -> None:
    def failing_build(name: str) -> Path:
        raise build.KernelBuildError("no C compiler found (tried cc); install gcc or set CC")

    monkeypatch.setattr(cpu_varlen, "load_kernel", lambda name: failing_build(name))
    cpu_varlen._library.cache_clear()
    cpu_varlen._kernel.cache_clear()
    try:
        with pytest.raises(BackendUnavailableError, match="install gcc"):
            CpuVarlenBackend()
    finally:
        cpu_varlen._library.cache_clear()
        cpu_varlen._kernel.cache_clear()


def test_minilm_on_sdpa_and_cpu_varlen_agree(minilm_path, minilm_tokenizer) -> None:
    engines = [
        Engine(
            EngineConfig(
                model_path=minilm_path, device="cpu", dtype="float32", attention_backend=name, cpu_warmup_tokens=0
            )
        )
        for name in ("cpu_varlen", "sdpa")
    ]
    try:
        ids = minilm_tokenizer.encode(parity_texts()[::3])
        assert row_cosines(embed_ids(engines[0], ids), embed_ids(engines[1], ids)).min() >= 0.999999
    finally:
        for engine in engines:
            engine.close()
