"""The `auto` attention backend chosen from a table, and the GPU backends' calls into their libraries, on the
CPU: stand-ins for flash_attn.cute and flashinfer with the libraries' published signatures (argument names,
order, dtypes, the CUDA-graph wrapper's fixed batch size) that compute the attention with torch."""

from __future__ import annotations

import inspect
import itertools
import json
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from bouquet.layers.attention_backends import AttentionShape, BackendUnavailableError, create_attention_backend
from bouquet.layers.attention_backends.flash_attn import FlashAttnBackend, load_varlen_func
from bouquet.layers.attention_backends.flashinfer import FlashInferBackend
from bouquet.layers.attention_backends.sdpa import SdpaBackend
from bouquet.layers.attention_backends.selection import AutoBackend, BackendTable, load_backends
from bouquet.layers.attention_backends.timing import measure_timings
from bouquet.layers.context import ForwardContext

SHAPE = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, causal=False, dtype=torch.float32)


def test_table_from_timings_picks_the_fastest_per_length() -> None:
    timings = {64: {"flash_attn": 1.0, "flashinfer": 2.0}, 8192: {"flash_attn": 9.0, "flashinfer": 5.0}}
    table = BackendTable.from_timings(timings)
    assert table.rows == ((64, "flash_attn"), (8192, "flashinfer"))
    assert [table.choose(n) for n in (1, 64, 65, 8192, 100_000)] == [
        "flash_attn",
        "flash_attn",
        "flashinfer",
        "flashinfer",
        "flashinfer",
    ]


def test_table_round_trips_through_json(tmp_path) -> None:
    table = BackendTable(((512, "flash_attn"), (8192, "flashinfer")))
    path = tmp_path / "table.json"
    path.write_text(table.to_json())
    assert BackendTable.load(path) == table
    assert json.loads(path.read_text())["rows"][0] == {"max_seqlen": 512, "backend": "flash_attn"}


def test_table_falls_back_for_backends_that_did_not_load() -> None:
    table = BackendTable(((512, "flash_attn"), (8192, "flashinfer")))
    assert table.restricted_to({"flashinfer"}, "sdpa").rows == ((512, "sdpa"), (8192, "flashinfer"))


def test_table_rejects_unsorted_rows() -> None:
    with pytest.raises(ValueError, match="increasing"):
        BackendTable(((512, "a"), (64, "b")))


def test_missing_gpu_backends_name_their_package() -> None:
    for name, package in (("flash_attn", "flash-attn"), ("flashinfer", "flashinfer-python")):
        try:
            create_attention_backend(name)
        except BackendUnavailableError as error:
            assert package in str(error)
    _, missing = load_backends(("flash_attn", "flashinfer", "sdpa"))
    assert "sdpa" not in missing


class _Tagged(SdpaBackend):
    """SDPA that records which batch lengths it served."""

    def __init__(self, tag: str, served: list[str]):
        super().__init__()
        self.tag, self.served = tag, served

    def prepare(self, ctx: ForwardContext):
        self.served.append(self.tag)
        return super().prepare(ctx)


def test_auto_dispatches_each_batch_by_max_seqlen() -> None:
    served: list[str] = []
    backends = {"short": _Tagged("short", served), "long": _Tagged("long", served)}
    auto = AutoBackend(backends, BackendTable(((16, "short"), (64, "long"))))
    auto.bind(SHAPE)
    for seq_lens in ([5, 16], [40, 3]):
        total = sum(seq_lens)
        q, k = torch.randn(total, 4, 16), torch.randn(total, 2, 16)
        cu_seqlens = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
        ctx = ForwardContext(cu_seqlens, max(seq_lens), seq_lens)
        ctx.attn_metadata = auto.prepare(ctx)
        out = auto.forward(q, k, k, ctx, False, 0.25)
        reference = SdpaBackend()
        ctx.attn_metadata = reference.prepare(ctx)
        torch.testing.assert_close(out, reference.forward(q, k, k, ctx, False, 0.25))
    assert served == ["short", "long"]
    assert not auto.supports_cuda_graphs


def test_measure_timings_runs_on_the_cpu() -> None:
    timings = measure_timings({"sdpa": SdpaBackend()}, SHAPE, torch.device("cpu"), (16, 32))
    assert set(timings) == {16, 32} and all(t["sdpa"] > 0 for t in timings.values())


def test_table_leaves_out_lengths_where_every_backend_failed() -> None:
    table = BackendTable.from_timings({64: {"sdpa": 1.0}, 128: {}, 256: {"flashinfer": 2.0}})
    assert table.rows == ((64, "sdpa"), (256, "flashinfer"))


def test_a_backend_whose_import_breaks_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    from bouquet.layers.attention_backends import selection

    def create(name: str):
        if name == "flashinfer":
            raise RuntimeError("CUDA driver version is insufficient")
        return SdpaBackend()

    monkeypatch.setattr(selection, "create_attention_backend", create)
    loaded, missing = load_backends(("flashinfer", "sdpa"))
    assert list(loaded) == ["sdpa"] and "RuntimeError: CUDA driver version" in missing["flashinfer"]


def _reference(q, k, v, cu_seqlens: list[int], causal: bool, scale: float, window=None) -> torch.Tensor:
    """Attention per sequence of the packed q, k, v (GQA by repeating k, v), [T, H, D]; `window` (left, right),
    a side < 0 unbounded."""
    outs = []
    for start, end in itertools.pairwise(cu_seqlens):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        repeat = qs.shape[0] // ks.shape[0]
        ks, vs = ks.repeat_interleave(repeat, 0), vs.repeat_interleave(repeat, 0)
        offset = torch.arange(end - start)[None, :] - torch.arange(end - start)[:, None]  # key j - query i
        left, right = window or (-1, -1)
        allowed = (offset >= -left if left >= 0 else offset == offset) & (offset <= right if right >= 0 else True)
        allowed = allowed & (offset <= 0) if causal else allowed
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def _flash_attn_varlen_func_fa4(
    q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
    seqused_k=None, page_table=None, softmax_scale=None, causal=False, window_size=(None, None),
    learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, score_mod=None,
    mask_mod=None, block_sparse_tensors=None, cu_total_m_blocks=None, cu_total_n_blocks=None, aux_tensors=None,
    return_lse=False,
):  # fmt: skip
    """flash_attn.cute.flash_attn_varlen_func's signature (flash-attn-4), its checks on the metadata."""
    for cu_seqlens in (cu_seqlens_q, cu_seqlens_k):
        assert cu_seqlens.dtype == torch.int32 and cu_seqlens.stride(0) == 1, "cu_seqlens must be contiguous int32"
        assert cu_seqlens.shape == (cu_seqlens_q.shape[0],)
    assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int), "max_seqlen is a Python int"
    assert num_splits == 1, "num_splits < 1 reads cu_seqlens back to the host: not capturable"
    assert q.dtype in (torch.float16, torch.bfloat16) and q.stride(-1) == 1
    out = _reference(q.float(), k.float(), v.float(), cu_seqlens_q.tolist(), causal, softmax_scale)
    return out.to(q.dtype), None  # (out, lse); lse is None unless return_lse


@pytest.fixture
def fake_fa4(monkeypatch: pytest.MonkeyPatch) -> None:
    package, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = _flash_attn_varlen_func_fa4  # type: ignore[attr-defined]
    package.cute = cute  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)


def _packed(seq_lens: list[int], heads: int = 4, kv_heads: int = 2, head_dim: int = 16, dtype=torch.bfloat16):
    torch.manual_seed(0)
    total = sum(seq_lens)
    # v as the models pass it: a strided view of a fused projection, not a contiguous tensor.
    qkv = torch.randn(total, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q, k, v = (t.unflatten(1, (-1, head_dim)) for t in (q, k, v))
    cu_seqlens = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_seqlens


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_calls_flash_attn_4_by_its_published_signature(fake_fa4: None, causal: bool) -> None:
    backend = FlashAttnBackend()
    assert backend.version.startswith("flash-attn-4")
    seq_lens = [5, 17, 0, 9]  # a zero-length slot, as in a CUDA-graph bucket
    q, k, v, cu_seqlens = _packed(seq_lens)
    ctx = ForwardContext(cu_seqlens, 32, seq_lens)  # max_seqlen: a bucket's upper bound
    ctx.attn_metadata = backend.prepare(ctx)
    out = backend.forward(q, k, v, ctx, causal, 0.25)
    expected = _reference(q.float(), k.float(), v.float(), cu_seqlens.tolist(), causal, 0.25)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def _flash_attn_varlen_func_fa2(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None,
):  # fmt: skip
    """flash_attn.flash_attn_varlen_func's signature (FlashAttention 2): no num_splits, out alone."""
    assert cu_seqlens_q.dtype == torch.int32 and isinstance(max_seqlen_q, int) and dropout_p == 0.0
    return _reference(q.float(), k.float(), v.float(), cu_seqlens_q.tolist(), causal, softmax_scale).to(q.dtype)


def test_flash_attn_falls_back_to_flash_attn_2(monkeypatch: pytest.MonkeyPatch) -> None:
    package = types.ModuleType("flash_attn")
    package.flash_attn_varlen_func = _flash_attn_varlen_func_fa2  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import flash_attn.cute raises ImportError
    backend = FlashAttnBackend()
    assert backend.version == "flash-attn 2"
    seq_lens = [7, 12]
    q, k, v, cu_seqlens = _packed(seq_lens)
    ctx = ForwardContext(cu_seqlens, 12, seq_lens)
    out = backend.forward(q, k, v, ctx, True, 0.25)
    expected = _reference(q.float(), k.float(), v.float(), cu_seqlens.tolist(), True, 0.25)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_flash_attn_import_errors_of_any_kind_name_both_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    class BrokenCute(types.ModuleType):
        def __getattr__(self, name: str):
            raise RuntimeError("cutlass DSL: no CUDA driver")

    package = types.ModuleType("flash_attn")
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", BrokenCute("flash_attn.cute"))
    with pytest.raises(BackendUnavailableError, match="flash-attn-4") as error:
        load_varlen_func()
    assert "cutlass DSL: no CUDA driver" in str(error.value) and "flash_attn:" in str(error.value)


class _FakeEvent:
    """torch.cuda.Event's surface that FlashInferBackend uses."""

    synchronized = 0

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        assert blocking, "the engine thread should sleep, not spin, waiting for a plan's upload"

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        type(self).synchronized += 1


class _RaggedWrapper:
    """flashinfer.BatchPrefillWithRaggedKVCacheWrapper: its constructor's and plan()'s published signatures,
    the CUDA-graph mode's rules (fixed batch size, rows no more than at the first plan), run() by torch."""

    def __init__(
        self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
        kv_indptr_buf=None, custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None,
        jit_kwargs=None,
    ):  # fmt: skip
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        if use_cuda_graph:
            assert torch.is_tensor(qo_indptr_buf) and torch.is_tensor(kv_indptr_buf)
            assert qo_indptr_buf.dtype == kv_indptr_buf.dtype == torch.int32
            assert len(qo_indptr_buf) == len(kv_indptr_buf)
        self.use_cuda_graph, self.qo_indptr_buf, self.max_rows = use_cuda_graph, qo_indptr_buf, None
        self.plans = 0

    def plan(
        self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None, custom_mask=None,
        packed_custom_mask=None, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
        window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None,
        q_data_type="float16", kv_data_type=None, o_data_type=None, non_blocking=True,
    ):  # fmt: skip
        # Host indptr: plan() reads it on the host, so a device tensor would cost a device-to-host sync.
        assert qo_indptr.device.type == "cpu" and qo_indptr.dtype == kv_indptr.dtype == torch.int32
        rows = int(qo_indptr[-1])
        if self.use_cuda_graph:
            assert len(qo_indptr) == len(self.qo_indptr_buf), "the batch size is fixed in CUDA-graph mode"
            self.max_rows = rows if self.max_rows is None else self.max_rows
            assert rows <= self.max_rows, "rows may not exceed the first plan's in CUDA-graph mode"
            self.qo_indptr_buf.copy_(qo_indptr)
        self.indptr, self.causal, self.sm_scale, self.window_left = qo_indptr.tolist(), causal, sm_scale, window_left
        self.heads, self.head_dim, self.dtype = (num_qo_heads, num_kv_heads), head_dim_qk, q_data_type
        self.plans += 1

    def run(self, q, k, v, *args, out=None, lse=None, return_lse=False, enable_pdl=None, kv_cache_sf=None):
        assert q.dtype == self.dtype and (q.shape[1], k.shape[1]) == self.heads and q.shape[2] == self.head_dim
        assert q.shape[0] == self.indptr[-1], "q's rows must equal qo_indptr[-1]"
        window = (self.window_left, -1)  # FlashInfer's window bounds the left side only
        return _reference(q.float(), k.float(), v.float(), self.indptr, self.causal, self.sm_scale, window).to(q.dtype)


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithRaggedKVCacheWrapper = _RaggedWrapper  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr("bouquet.layers.attention_backends.flashinfer.WORKSPACE_BYTES", 1024)
    _FakeEvent.synchronized = 0


def test_stand_ins_keep_the_libraries_argument_order() -> None:
    assert list(inspect.signature(_RaggedWrapper.plan).parameters)[1:6] == [
        "qo_indptr", "kv_indptr", "num_qo_heads", "num_kv_heads", "head_dim_qk",
    ]  # fmt: skip
    assert list(inspect.signature(_flash_attn_varlen_func_fa4).parameters)[:7] == [
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
    ]  # fmt: skip


@pytest.mark.parametrize("causal", [False, True])
def test_flashinfer_eager_plan_and_run(fake_flashinfer: None, causal: bool) -> None:
    backend = FlashInferBackend()
    backend.bind(AttentionShape(4, 2, 16, causal, torch.bfloat16))
    for seq_lens in ([5, 17, 9], [3, 30]):  # the eager wrapper replans for each batch
        q, k, v, cu_seqlens = _packed(seq_lens)
        ctx = ForwardContext(cu_seqlens, max(seq_lens), seq_lens)
        ctx.attn_metadata = backend.prepare(ctx)
        out = backend.forward(q, k, v, ctx, causal, 0.25)
        expected = _reference(q.float(), k.float(), v.float(), cu_seqlens.tolist(), causal, 0.25)
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    assert _FakeEvent.synchronized == 1  # the second plan waited for the first one's upload


def test_flashinfer_graph_wrapper_per_bucket_replans_new_lengths(fake_flashinfer: None) -> None:
    backend = FlashInferBackend()
    backend.bind(AttentionShape(4, 2, 16, False, torch.bfloat16))
    # A bucket of 32 tokens x 4 sequence slots: real sequences, the pad sequence, an empty slot.
    captured = [5, 17, 10, 0]
    q, k, v, cu_seqlens = _packed(captured)
    wrappers = backend.prepare_capture(ForwardContext(cu_seqlens, 32, captured), key=(32, 4))
    wrapper = wrappers[-1]  # the only one: no layer slides a window
    assert list(wrappers) == [-1] and wrapper.use_cuda_graph and len(wrapper.qo_indptr_buf) == 5
    for seq_lens in ([20, 2, 10, 0], [1, 1, 30, 0]):
        q, k, v, cu_seqlens = _packed(seq_lens)
        ctx = ForwardContext(cu_seqlens, 32, seq_lens)
        backend.prepare_replay(ctx, key=(32, 4))
        ctx.attn_metadata = wrappers
        out = backend.forward(q, k, v, ctx, False, 0.25)
        assert wrapper.qo_indptr_buf.tolist() == cu_seqlens.tolist()
        expected = _reference(q.float(), k.float(), v.float(), cu_seqlens.tolist(), False, 0.25)
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    assert wrapper.plans == 3 and _FakeEvent.synchronized == 2


def _aten_flash_attention_forward(
    query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
    scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
    block_table=None, num_splits=None,
):  # fmt: skip
    """aten::_flash_attention_forward's schema (PyTorch's FlashAttention 2, CUDA only in a real build)."""
    assert cum_seq_q.dtype == torch.int32 and isinstance(max_q, int) and isinstance(max_k, int)
    assert dropout_p == 0.0 and not return_debug_mask
    assert query.stride(-1) == 1 and value.stride(-1) == 1
    window = (
        -1 if window_size_left is None else window_size_left,
        -1 if window_size_right is None else window_size_right,
    )
    out = _reference(query.float(), key.float(), value.float(), cum_seq_q.tolist(), is_causal, scale, window)
    empty = torch.empty(0)
    return out.to(query.dtype), empty, empty, empty, empty


def test_flash_attn_falls_back_to_pytorchs_own_kernel_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from bouquet.layers.attention_backends import flash_attn

    monkeypatch.setitem(sys.modules, "flash_attn", None)  # neither flash-attn-4 nor FlashAttention 2
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    with pytest.raises(BackendUnavailableError, match="CUDA only"):
        load_varlen_func()  # on the CPU there is no fallback: the error says what to install
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(flash_attn, "_torch_flash_forward", _aten_flash_attention_forward)
    backend = FlashAttnBackend()
    assert backend.version == "PyTorch's built-in FlashAttention 2"
    seq_lens = [6, 0, 11]
    q, k, v, cu_seqlens = _packed(seq_lens)
    ctx = ForwardContext(cu_seqlens, 16, seq_lens)
    for causal in (False, True):
        out = backend.forward(q, k, v, ctx, causal, 0.25)
        expected = _reference(q.float(), k.float(), v.float(), cu_seqlens.tolist(), causal, 0.25)
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_flashinfer_plans_a_wrapper_a_window(fake_flashinfer: None) -> None:
    """A causal model whose layers slide a 4-token window or attend fully: each layer runs on its own plan."""
    backend = FlashInferBackend()
    backend.bind(AttentionShape(4, 2, 16, True, torch.bfloat16, windows=((4, 0),)))
    seq_lens = [5, 17, 9]
    q, k, v, cu_seqlens = _packed(seq_lens)
    ctx = ForwardContext(cu_seqlens, max(seq_lens), seq_lens)
    ctx.attn_metadata = backend.prepare(ctx)
    assert sorted(ctx.attn_metadata) == [-1, 4]
    for window in (None, (4, 0)):
        out = backend.forward(q, k, v, ctx, True, 0.25, window)
        expected = _reference(q.float(), k.float(), v.float(), cu_seqlens.tolist(), True, 0.25, window)
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="cannot run attention with a sliding window"):
        FlashInferBackend().bind(AttentionShape(4, 2, 16, False, torch.bfloat16, windows=((4, 4),)))


def test_pytorch_flash_fallback_passes_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    from bouquet.layers.attention_backends import flash_attn

    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(flash_attn, "_torch_flash_forward", _aten_flash_attention_forward)
    backend = FlashAttnBackend()
    seq_lens = [6, 20, 11]
    q, k, v, cu_seqlens = _packed(seq_lens)
    ctx = ForwardContext(cu_seqlens, 20, seq_lens)
    out = backend.forward(q, k, v, ctx, False, 0.25, (3, 2))
    expected = _reference(q.float(), k.float(), v.float(), cu_seqlens.tolist(), False, 0.25, (3, 2))
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    assert (
        out.float() - _reference(q.float(), k.float(), v.float(), cu_seqlens.tolist(), False, 0.25)
    ).abs().max() > 0.05
