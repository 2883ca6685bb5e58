"""The engine: a loaded model that turns packed batches into embeddings, one `step()` at a time."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch
from torch import nn

from bouquet.batch import Batch
from bouquet.config import CudaGraphConfig, EngineConfig, widest_linear
from bouquet.cpu_features import AVX512, cpu_features
from bouquet.engine.borrow_choice import size_class
from bouquet.engine.cpu_graphs import SHORT_QUERY_TOKENS, CpuLayerGraphs
from bouquet.engine.cpu_threads import StepThreads
from bouquet.engine.cuda_graphs import CudaCapturer, CudaGraphRunner
from bouquet.engine.dtype_choice import linear_timings
from bouquet.engine.lazy_tensor import EventWaiter, LazyTensor, start_cuda_readback
from bouquet.engine.memory import (
    bucket_counts,
    bucket_tokens,
    build_primitives,
    distinct_linears,
    image_warmup,
    reserve_primitive_cache,
)
from bouquet.engine.model_runner import ModelRunner
from bouquet.engine.step_workers import StepWorkers
from bouquet.engine.weights import load_checked, read_checkpoint
from bouquet.kernels.openmp import find_thread_setter, on_passing_thread
from bouquet.layers.attention import Attention, attention_shape
from bouquet.layers.attention_backends import AttentionBackend, create_attention_backend
from bouquet.layers.attention_backends.selection import create_auto_backend
from bouquet.layers.linear import (
    Linear,
    drop_plain_weights,
    prepack_cpu_linears,
    quantize_cpu_linears,
    use_amx_bf16_linears,
    use_f32_short_linears,
)
from bouquet.layers.pooling import Pooler
from bouquet.layers.sparse import SpladeHead, TokenWeightHead
from bouquet.model_dir import ModelSpec, MultiVectorSpec, PoolingSpec, SpladeSpec, TokenWeightSpec, read_model_dir
from bouquet.models import create_model
from bouquet.st_model_pools import warn_if_st_pads_short
from bouquet.text_padding import processor_text_length, read_text_padding, text_limit

logger = logging.getLogger(__name__)


_TRIAL_TURNS = (True, False, True, False)  # a lone step's start-up timing: borrowed, own, alternated
_IN_MODEL_PROJECTION = "linear."  # HF_ColBERT's projection's tensors in the model's own checkpoint


def load_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Builds the model for `spec` and loads its checkpoint; matrix weights take `dtype`, the rest float32."""
    try:
        model = create_model(spec.architecture, spec.hf_config, spec.task)
    except ValueError as exc:  # an architecture or an option of its config that no family file runs
        raise ValueError(f"{spec.weight_files[0].parent / 'config.json'}: {exc}") from exc
    state = read_checkpoint(spec.weight_files)
    if spec.multi_vector is not None and spec.multi_vector.source == "model":  # HF_ColBERT: its projection's
        state = {name: tensor for name, tensor in state.items() if not name.startswith(_IN_MODEL_PROJECTION)}
    load_checked(model, model.convert_checkpoint(state))
    if getattr(model, "pads_texts", False):  # its texts padded as its processor pads them (SigLIP, SigLIP 2)
        model.text_padding = read_text_padding(spec.tokenizer_file.parent, processor_text_length(model))
        warn_if_st_pads_short(spec.path, spec.architecture, spec.st_text_padding)
    # Only the matrix products run in the compute dtype: embeddings, norms and the residual stream stay
    # float32, which is what keeps bfloat16 within the parity bound at almost no cost.
    for module in model.modules():
        if isinstance(module, Linear):
            module.to(dtype)
    model = model.to(device).eval().requires_grad_(False)  # an inference engine: no tensor it makes needs grad
    if device.type == "cpu":
        warn_if_slow_bf16(dtype, widest_linear(spec.hf_config))
        prepack_cpu_linears(model)
    return model


def warn_if_slow_bf16(dtype: torch.dtype, widest_linear: tuple[int, int]) -> None:
    """bfloat16 runs on every x86-64 CPU, but only AVX512-BF16 or AMX can make it faster than float32, and even
    there only a measurement tells (engine/dtype_choice.py): say so once where it is slower."""
    features = cpu_features()
    if dtype != torch.bfloat16:
        return
    if features.fast_bf16:
        timings = linear_timings(*widest_linear)
        if not timings.bfloat16_faster:
            logger.warning(
                "--dtype bfloat16 on %s: its native bfloat16 products measured slower than float32's here (%s); "
                "float32 is faster on this CPU", features.describe(), timings.describe(),
            )  # fmt: skip
        return
    if features.packed_bf16:
        how = f"oneDNN emulates bfloat16 products here (it lacks {', '.join(features.missing('avx512_bf16'))})"
    else:
        lacking = features.missing(*AVX512)
        needs = f"{', '.join(lacking)}, or avx_ne_convert"
        how = f"its matrix products run unpacked, through ATen (oneDNN's bfloat16 needs {needs})"
    logger.warning("--dtype bfloat16 on %s: %s; float32 is faster on this CPU", features.describe(), how)


def load_pooler(spec: ModelSpec, model: nn.Module, device: torch.device) -> Pooler:
    """The model's Pooling (its family's default where the directory has none), its Dense modules and its sparse
    head if it has one; for a score model (a cross-encoder), its classifier on the pooling its family declares;
    for a SPLADE model, its sparse head alone."""
    task = getattr(model, "task", "embed")
    if spec.task is not None and spec.task != task and not (spec.task == "multi_vector" and task == "embed"):
        raise ValueError(
            f"{spec.weight_files[0].parent / 'config.json'}: sentence-transformers' files give the task {spec.task!r}, "
            f"but {spec.architecture} computes {task!r}"
        )
    if task == "score":
        return Pooler(PoolingSpec((model.score_pooling,)), spec.hidden_size, score_head=model.score_head).to(device)
    sparse_head = load_sparse_head(spec, model)
    if task == "sparse":
        return Pooler(PoolingSpec(()), spec.hidden_size, sparse_head=sparse_head).to(device).eval()
    pooling = spec.pooling or PoolingSpec((model.default_pooling,))
    token_head = () if spec.multi_vector is None else spec.multi_vector.projection
    pooler = Pooler(pooling, spec.hidden_size, spec.dense, sparse_head=sparse_head, token_head=token_head,
                    task=spec.task)  # fmt: skip
    for layer, dense in zip(pooler.dense, spec.dense, strict=True):
        try:
            load_checked(layer, read_checkpoint(dense.weight_files))
        except ValueError as exc:
            raise ValueError(f"Dense module {dense.weight_files[0].parent}: {exc}") from exc
    if spec.multi_vector is not None:
        load_token_head(spec.multi_vector, pooler.token_head)
    return pooler.to(device).eval()


def load_token_head(spec: MultiVectorSpec, layers: nn.ModuleList) -> None:
    """The multi-vector projection's weights, under Dense's names (`linear.weight`) whichever layout holds them."""
    for layer, dense in zip(layers, spec.projection, strict=True):
        state = read_checkpoint(dense.weight_files)
        if spec.source == "model":  # HF_ColBERT: beside the encoder's
            state = {name: tensor for name, tensor in state.items() if name.startswith(_IN_MODEL_PROJECTION)}
        elif spec.source == "linear":  # bge-m3's colbert_linear.pt: a bare Linear's weight and bias
            state = {f"linear.{name}": tensor for name, tensor in state.items()}
        try:
            load_checked(layer, state)
        except ValueError as exc:
            raise ValueError(f"multi-vector projection {dense.weight_files[0]}: {exc}") from exc


def load_sparse_head(spec: ModelSpec, model: nn.Module) -> nn.Module | None:
    """SPLADE's pooling over the model's masked-LM head, or bge-m3's token weights read from sparse_linear.pt."""
    if spec.sparse is None:
        return None
    if isinstance(spec.sparse, SpladeSpec):
        return SpladeHead(model.lm_head, spec.sparse.pooling, spec.sparse.activation)
    head = TokenWeightHead(spec.hidden_size, spec.vocab_size, spec.sparse.skip_token_ids)
    try:
        load_checked(head.linear, torch.load(spec.sparse.weight_file, map_location="cpu", weights_only=True))
    except ValueError as exc:
        raise ValueError(f"{spec.sparse.weight_file}: {exc}") from exc
    return head


class Engine:
    """`step(batch)` returns a LazyTensor at once; forwards run on engine threads: one on CUDA (launches in
    order), `workers` on the CPU (steps computed at once)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.spec = read_model_dir(config.model_path)
        self.device = torch.device(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.num_threads = torch.get_num_threads()  # intra-op threads in all, shared out among the workers
        if self.device.type == "cpu" and config.cpu_token_buckets:
            reserve_primitive_cache()
        self.workers, self.threads_per_worker = self._split_threads()
        # On a thread of its own so that the caller's thread starts no OpenMP helpers (engine/cpu_threads.py).
        self.runner = on_passing_thread(self._load)
        self.model, self.pooler = self.runner.model, self.runner.pooler
        self._step_threads = self._create_step_threads()
        self._workers = self._start_workers()
        try:
            self._build_cpu_primitives()
            self._capture_short_steps()
            self._time_lone_steps()
        except BaseException:
            self._workers.shutdown()
            raise
        self._cuda = _CudaRuntime(self.runner, config.cuda_graphs) if self.device.type == "cuda" else None
        logger.info(
            "engine ready: %s (%s, %s pooling) on %s in %s, attention %s, %d worker(s) x %d thread(s)%s",
            self.spec.name, self.spec.architecture, self.pooler.name,
            config.device, config.dtype, self.attn_backend.name, self.workers, self.threads_per_worker,
            "" if self._step_threads is None
            else f", a lone step of <= {config.cpu_lone_step_tokens} tokens on all threads while measured faster",
        )  # fmt: skip

    @property
    def dimension(self) -> int:
        """The width of a row: pooled (and through the Dense modules), before any truncation."""
        return self.pooler.dimension

    @property
    def task(self) -> str:
        """ "embed" (rows are embeddings), "score" (a cross-encoder's raw logits) or "sparse" (a SPLADE model's
        vocabulary-wide rows, whatever a batch asks)."""
        return self.pooler.task

    @property
    def sparse_dimension(self) -> int:
        """The width of a sparse row (the vocabulary's size); 0 when the model gives none (Batch.sparse)."""
        return self.pooler.sparse_dimension

    @property
    def token_dimension(self) -> int:
        """The width of a token vector (the multi-vector projection's); 0 when the model gives none."""
        return self.pooler.token_dimension

    @property
    def unweighted_ids(self) -> tuple[int, ...] | None:
        """The ids a token-weight sparse head (bge-m3's) never weights; None: the model has no such head."""
        sparse = self.spec.sparse
        return sparse.skip_token_ids if isinstance(sparse, TokenWeightSpec) else None

    @property
    def family(self) -> str:
        """The model family: the name of the models/ file that serves this architecture."""
        return type(self.model).__module__.rsplit(".", 1)[-1]

    @property
    def pooling(self) -> PoolingSpec:
        return self.pooler.spec

    @property
    def max_seq_length(self) -> int:
        """sentence-transformers' limit within the model's positions, or its processor's own (text_padding.py)."""
        return text_limit(self.spec.max_seq_length, self.model)

    @property
    def image_shape(self) -> tuple[int, ...]:
        """(C, H, W) of the images the model takes (Batch.pixel_values); () when it takes none."""
        return tuple(getattr(self.model, "image_shape", ()))

    @property
    def zero_shot_logit(self) -> tuple[float | None, float | None]:
        """A text-and-image model's (logit_scale, logit_bias) as its checkpoint has them (logit = exp(logit_scale) x
        cosine + logit_bias); None where it has none."""
        return getattr(self.model, "logit_scale", None), getattr(self.model, "logit_bias", None)

    @property
    def image_tokens(self) -> int:
        """The tokens one image is laid out as; 0 when the model takes no images."""
        return int(getattr(self.model, "image_tokens", 0))

    @property
    def image_patches(self) -> tuple[int, int, int, bool, int] | tuple[()]:
        """(patch values, merge size, placeholder token id, whether each image is a sequence of its own, most
        patches an image) of a model that takes images of any size as patches (Batch.image_grid_thw), as the model
        declares them (replica/patch_images.PatchImageLimits); () when it takes none."""
        if not getattr(self.model, "variable_images", False):
            return ()
        return tuple(self.model.image_patches)

    def _load(self) -> ModelRunner:
        model = load_model(self.spec, getattr(torch, self.config.float_dtype), self.device)
        pooler = load_pooler(self.spec, model, self.device)
        if self.config.dtype == "int8":
            quantized, kept, plan = quantize_cpu_linears(model, pooler, self.threads_per_worker)
            logger.info(
                "int8: %d linears quantized (per-channel weights, per-token activations; products: %s)%s",
                quantized, plan.describe(),
                f", {kept} QKV projections kept in float32 (narrowed int8 weights on this CPU)" if kept else "",
            )  # fmt: skip
        elif self.device.type == "cpu" and self.config.dtype == "bfloat16":
            self._use_amx_bf16(model)
        elif self.device.type == "cpu" and self.config.dtype == "float32":
            self._use_f32_short(model)
        if self.device.type == "cpu":
            logger.info("%.0f MB of plain weights freed: their packed copies run", drop_plain_weights(model) / 2**20)
        backend = self._create_backend(model)
        runner = ModelRunner(model, pooler, backend, self.device)
        runner.token_buckets = self.config.cpu_token_buckets if self.device.type == "cpu" else 0
        if self.device.type == "cpu" and self.config.cpu_graphs:  # after quantizing: graphs address the weights
            runner.layer_graphs = CpuLayerGraphs()
        return runner

    def _use_amx_bf16(self, model: nn.Module) -> None:
        up_to_rows = use_amx_bf16_linears(model, self.threads_per_worker)
        if up_to_rows:
            rows = "every step" if up_to_rows == -1 else f"steps of up to {up_to_rows} tokens"
            logger.info("bfloat16: linears on AMX tiles by bouquet's kernel for %s (measured faster than oneDNN)", rows)

    def _use_f32_short(self, model: nn.Module) -> None:
        up_to_rows = use_f32_short_linears(model, self.threads_per_worker)
        if up_to_rows:
            logger.info(
                "float32: steps of up to %d tokens on bouquet's short-step kernel (measured no slower than oneDNN)",
                up_to_rows,
            )

    def _split_threads(self) -> tuple[int, int]:
        """(workers, intra-op threads each). CUDA: one launching thread. CPU: a forward's Python dispatch runs
        on one thread while OpenMP's others wait at its barriers, so two steps computed at once, each on half
        the threads, keep the cores busier: 1.05x float32 and 1.15x bfloat16 document tokens/s on 2 cores
        against one step on both (bench/engine_workers.py; docs/benchmarks.md, "OpenMP teams"). Each worker
        sets its own count: OpenMP's is per thread (see `_start_workers` for torch's process-wide default)."""
        if self.device.type == "cuda":
            return 1, self.num_threads
        workers = self.config.cpu_workers or (2 if self.num_threads >= 2 else 1)
        return workers, max(1, self.num_threads // workers)

    def _create_step_threads(self) -> StepThreads | None:
        """CPU workers of one thread each: the lead may take every thread for a lone short step, re-checked at
        every layer's attention. Workers of several threads never borrow: the lead's wider pool beside theirs
        would make OpenMP manage more threads than there are cores (engine/cpu_threads.py)."""
        if self.device.type != "cpu" or self.threads_per_worker != 1 or self.num_threads == 1:
            return None
        if not self.config.cpu_lone_step_tokens:
            return None
        setter = find_thread_setter()
        if setter is None:
            logger.info("no OpenMP runtime found to set per-thread counts: a lone step keeps its one thread")
            return None
        step_threads = StepThreads(1, self.num_threads, self.config.cpu_lone_step_tokens, setter)
        for module in self.model.modules():
            if isinstance(module, Attention):
                module.register_forward_pre_hook(lambda *_: step_threads.rebalance())
        return step_threads

    def _start_workers(self) -> StepWorkers:
        """Starts every worker now, then puts torch's process-wide thread count back.

        `torch.set_num_threads` in a worker sets that thread's OpenMP count but also torch's default for every
        thread that starts using torch later (a second engine built on a fresh thread would see one thread).
        The workers have all set their own count when `StepWorkers` returns, so the default is restored once."""
        workers = StepWorkers(self.workers, self._init_worker)
        torch.set_num_threads(self.num_threads)
        return workers

    def _init_worker(self, index: int) -> None:
        # torch sets a thread's OpenMP count lazily, from its process-wide default, at the thread's first use;
        # that use comes first here so that the default restored after start-up cannot override this count.
        torch.get_num_threads()
        torch.set_num_threads(self.threads_per_worker)
        if index == 0 and self._step_threads is not None:
            self._step_threads.make_lead()

    def _build_cpu_primitives(self) -> None:
        """oneDNN's primitive for every step count up to `cpu_warmup_tokens` a step can run each linear at, on each
        team size a step runs with: the workers' own share (all workers at once, the counts split among them), and
        every thread for a lone step (engine/memory.py). Text steps are padded to bucketed counts; a tower that only
        ever sees fixed-size images (`image_linears`) runs at whole images' counts instead."""
        if self.device.type != "cpu" or not self.runner.token_buckets or not self.config.cpu_warmup_tokens:
            return
        image_parts = self.model.image_linears() if hasattr(self.model, "image_linears") else []
        warmup = self.config.cpu_warmup_tokens
        # heads run on pooled rows or blocks
        work = [(distinct_linears([self.model], skip=[self.pooler, *(part[0] for part in image_parts)]),
                 bucket_counts(warmup, self.runner.token_buckets))]  # fmt: skip
        if image_parts:
            work += image_warmup(image_parts, warmup, self.image_tokens)
        jobs = [(linears, counts[i :: self.workers]) for linears, counts in work for i in range(self.workers)]
        for done in [self._workers.submit(_build_shares, jobs[i :: self.workers]) for i in range(self.workers)]:
            done.result()
        if self._step_threads is not None:  # idle workers: the lead takes it, alone, so it widens its team
            # a step borrows on its own count and runs at its bucket's
            lone_max = bucket_tokens(self.config.cpu_lone_step_tokens, self.runner.token_buckets)
            lone = [(linears, [count for count in counts if count <= lone_max]) for linears, counts in work]
            self._workers.submit(self._build_lone_primitives, lone).result()

    def _capture_short_steps(self) -> None:
        """CPU graphs for a lone query's shapes (1 to SHORT_QUERY_TOKENS tokens, as steps are padded: a length short of
        its bucket is one more sequence, its pad), captured now on
        the lead worker, which an idle engine gives every step, within the byte bound: no lone query pays a first
        sighting (an eager step, then a capture at about three eager steps' time). The other workers capture the
        shapes they meet (under load, mostly steps of several sequences). A model whose layers cannot be replayed
        stops at its first shape (said once)."""
        graphs = self.runner.layer_graphs
        if graphs is None or not self.config.cpu_warmup_tokens:
            return
        lengths = range(1, min(SHORT_QUERY_TOKENS, graphs.max_tokens, self.config.cpu_warmup_tokens) + 1)
        batches = [Batch.pack([[0] * length]) for length in lengths]  # the shapes matter, not the ids
        count, size = self._workers.submit(self._capture_on_this_worker, batches).result()  # the idle lead takes it
        if count:
            logger.info(
                "CPU graphs: %d of a lone query's shapes captured at start, keeping %.0f MB", count, size / 2**20
            )

    def _time_lone_steps(self) -> None:
        """A lone query's step of each borrowing size class up to SHORT_QUERY_TOKENS timed both ways at start,
        borrowing every thread and on the lead's own, alternated: the choice (borrow_choice.py) then starts with
        both estimates, and no request's step is the first own-thread one it would otherwise try (served, a
        43-token float32 query took 9.4 ms on that try against 6.0 borrowed: the second sighting of each class
        was a slow query, the p99 of a few hundred)."""
        threads = self._step_threads
        if threads is None or not self.config.cpu_warmup_tokens:
            return
        most = min(SHORT_QUERY_TOKENS, threads.max_tokens, self.config.cpu_warmup_tokens)
        bounds = sorted({size_class(tokens) for tokens in range(1, most + 1)})
        self._workers.submit(self._time_lone_steps_here, threads, [min(bound, most) for bound in bounds]).result()

    @torch.inference_mode()
    def _time_lone_steps_here(self, threads: StepThreads, lengths: list[int]) -> None:
        for tokens in lengths:
            batch = Batch.pack([[0] * tokens])  # the shape matters, not the ids
            for borrow in _TRIAL_TURNS:
                with threads.step(tokens, trial=borrow):
                    self.runner.execute(batch)

    def _capture_on_this_worker(self, batches: list[Batch]) -> tuple[int, int]:
        graphs = self.runner.layer_graphs
        assert graphs is not None
        try:
            with torch.inference_mode():
                for batch in batches:
                    for _ in range(2):  # eager, then captured
                        self.runner.execute(batch)
                    if not graphs.captured_here():  # the layers run torch's ops: no shape can be replayed
                        break
        except Exception as error:  # a warm-up: requests will meet the same error, and say it to their caller
            logger.warning("CPU graphs: capturing a lone query's shapes at start failed, left to requests: %r", error)
        return graphs.captured_here(), graphs.bytes_here()

    def _build_lone_primitives(self, work: list[tuple[list[Linear], list[int]]]) -> None:
        assert self._step_threads is not None
        with self._step_threads.step(self.config.cpu_lone_step_tokens, timed=False):
            _build_shares(work)

    def step(self, batch: Batch) -> LazyTensor:
        """Returns at once. On the CPU with several workers, steps may finish out of submission order: callers
        that need order wait on their LazyTensors in order (the scheduler and `bouquet embed` do)."""
        if self._cuda is None:
            return LazyTensor(self._workers.submit(self._run_on_cpu, batch))
        result: Future[np.ndarray] = Future()
        self._workers.submit(self._cuda.launch, batch, result)
        return LazyTensor(result)

    def embed(self, batch: Batch) -> np.ndarray:
        """Synchronous step, for callers with nothing to overlap."""
        return self.step(batch).result()

    def close(self) -> None:
        self._workers.shutdown()
        if self._cuda is not None:
            self._cuda.waiter.close()

    @property
    def attn_backend(self) -> AttentionBackend:
        return self.runner.backend

    @attn_backend.setter
    def attn_backend(self, backend: AttentionBackend) -> None:
        self.runner.set_backend(backend)

    def _create_backend(self, model: nn.Module) -> AttentionBackend:
        shape = attention_shape(model, getattr(torch, self.config.float_dtype))
        if self.config.attention_backend == "auto":
            table = self.config.attention_table
            limit = text_limit(self.spec.max_seq_length, model)
            backend = create_auto_backend(self.device, shape, table, limit, self.threads_per_worker)
        else:
            backend = create_attention_backend(self.config.attention_backend)
        backend.bind(shape)
        return backend

    @torch.inference_mode()
    def _run_on_cpu(self, batch: Batch) -> np.ndarray:  # [B, dim] float32, synchronous on this worker
        with self._threads_for(batch):
            return self.runner.execute(batch).numpy()

    def _threads_for(self, batch: Batch) -> AbstractContextManager[None]:
        return nullcontext() if self._step_threads is None else self._step_threads.step(batch.num_tokens)


class _CudaRuntime:
    """The engine's GPU side: its stream, CUDA graphs when the backend allows them, and the readback thread.

    Written for CUDA and tested only through its CPU-testable parts here; bench/gpu_check.py and
    tests/test_gpu.py are its checks on a GPU.
    """

    def __init__(self, runner: ModelRunner, config: CudaGraphConfig):
        self.runner = runner
        self.stream = torch.cuda.Stream(runner.device)
        self.waiter = EventWaiter()
        backend = runner.backend
        if runner.pooler.task == "sparse":  # every batch runs the sparse head, which is eager only
            logger.info("CUDA graphs off: a sparse model's rows are pooled eagerly")
        elif getattr(runner.model, "text_padding", None) is not None:
            logger.info("CUDA graphs off: the model pads each step's texts on the host (its processor's padding)")
        elif config.enabled and backend.supports_cuda_graphs:
            capturer = CudaCapturer(self.stream)
            runner.graphs = CudaGraphRunner(config, runner.device, backend, runner.forward, capturer)
        elif config.enabled:
            logger.info("CUDA graphs off: attention backend %s cannot be captured", backend.name)

    @torch.inference_mode()
    def launch(self, batch: Batch, result: Future[np.ndarray]) -> None:
        """Enqueues the forward and the readback, then returns: the next step launches while this one runs."""
        try:
            with torch.cuda.stream(self.stream):
                rows = self.runner.execute(batch)
            start_cuda_readback(rows, self.stream, self.waiter, result)
        except BaseException as error:
            result.set_exception(error)


def _build_shares(work: list[tuple[list[Linear], list[int]]]) -> None:
    for linears, counts in work:
        build_primitives(linears, counts)
