// float32 linears for short steps (layers/f32_short.py): out = act(x W^T + b) and, for a post-norm block's end,
// LayerNorm(residual + x W^T + b), by register-blocked AVX-512 FMAs. At a query's few rows oneDNN's packed linear
// spends much of a call outside its arithmetic (primitive lookup, argument packing); this loop has no set-up beyond
// the call, and its bias, activation and norm run while the output is in cache. Included by int8_linear.c, whose
// activations and LayerNorm row pass it shares.
//
// The weight is packed once at load (bouquet_f32_pack) into column blocks of 32 output channels (two zmm), each
// block its k inputs in order, 32 floats an input: [ceil(n / 32)][k][32], zero-padded past n. A tile of MR rows by
// NB blocks keeps MR x 2 NB accumulators in registers; each input loads 2 NB weight vectors and broadcasts each row's
// x[m][k] once. Wide tiles (NB 2 or 4) at one to six rows, where two accumulators a row could not hide the FMA's
// latency. Row blocks of up to 14 run under each column group, so a group's weights are read from memory once per
// call; output channels are split between the OpenMP team's threads by column group.
//
// Requirements the caller checks: x's and out's rows contiguous; any k and n.
// No include guard: included once, by int8_linear.c.

#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 11)
#define BOUQUET_F32 1
#include <immintrin.h>
#define F32_TARGET __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,fma")))
#else
#define BOUQUET_F32 0
#define F32_TARGET
#endif

// F32_PREFETCH: how many inputs ahead a tile asks for its weights (4 KB a block): at a query's rows a tile spends ~14
// cycles an input, too few for the hardware prefetcher alone to hide L3's latency (the weights of a whole model stay
// in L3 at best). F32_SLICE: inputs per slice where several row blocks share a weight block (32 KB: L1 holds it).
enum { F32_BLOCK = 32, F32_MAX_ROWS = 14, F32_PREFETCH = 32, F32_SLICE = 256 };
// Below this many multiply-adds a call runs on the calling thread alone. Lower than the int8 kernels' bound: a lone
// query's lead holds a team whose other thread spins between parallel regions, so a short region run alone costs that
// thread's time as well as its own.
enum { F32_PARALLEL_WORK = 1 << 19 };

int bouquet_f32_available(void) {
#if BOUQUET_F32
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#else
    return 0;
#endif
}

int64_t bouquet_f32_packed_size(int64_t n, int64_t k) { return (n + F32_BLOCK - 1) / F32_BLOCK * F32_BLOCK * k; }

// weight: [n, k] float32, row-major -> packed: bouquet_f32_packed_size(n, k) floats in the block order (above).
void bouquet_f32_pack(const float* weight, int64_t n, int64_t k, float* packed) {
    for (int64_t nb = 0; nb < (n + F32_BLOCK - 1) / F32_BLOCK; nb++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t j = 0; j < F32_BLOCK; j++) {
                int64_t channel = nb * F32_BLOCK + j;
                packed[(nb * k + i) * F32_BLOCK + j] = channel < n ? weight[channel * k + i] : 0.0f;
            }
}

#if BOUQUET_F32
// Lanes of the 16-channel vector starting at `first` that hold one of n channels.
INLINE __mmask16 f32_lanes(int64_t first, int64_t n) {
    int64_t valid = n - first;
    return valid >= 16 ? (__mmask16)0xFFFF : valid <= 0 ? (__mmask16)0 : (__mmask16)((1u << valid) - 1);
}

// out[0:mr, 32 first_block : + 32 nb] = x[0:mr, 0:k] W^T + b for the weight blocks at `w` (block_floats apart), or
// out += x W^T where `accumulate` (a later slice of the inputs); mr and nb are constants where this is inlined, so the
// accumulators live in registers.
F32_TARGET INLINE void f32_tile(const float* x, int64_t ldx, int64_t k, const float* w, int64_t block_floats,
                                 int64_t first_block, int64_t n, const float* bias, int accumulate, float* out,
                                 int64_t ldo, const int mr, const int nb) {
    out += first_block * F32_BLOCK;
    __m512 acc[F32_MAX_ROWS][8];
    __mmask16 lanes[8];
    for (int j = 0; j < 2 * nb; j++) {
        lanes[j] = f32_lanes(first_block * F32_BLOCK + 16 * j, n);
        __m512 start = bias ? _mm512_maskz_loadu_ps(lanes[j], bias + first_block * F32_BLOCK + 16 * j)
                            : _mm512_setzero_ps();
        for (int m = 0; m < mr; m++)
            acc[m][j] = accumulate ? _mm512_maskz_loadu_ps(lanes[j], out + m * ldo + 16 * j) : start;
    }
    for (int64_t i = 0; i < k; i++) {
        __m512 wv[8];
        for (int b = 0; b < nb; b++) {
            _mm_prefetch((const char*)(w + b * block_floats + (i + F32_PREFETCH) * F32_BLOCK), _MM_HINT_T0);
            _mm_prefetch((const char*)(w + b * block_floats + (i + F32_PREFETCH) * F32_BLOCK + 16), _MM_HINT_T0);
            wv[2 * b] = _mm512_loadu_ps(w + b * block_floats + i * F32_BLOCK);
            wv[2 * b + 1] = _mm512_loadu_ps(w + b * block_floats + i * F32_BLOCK + 16);
        }
        for (int m = 0; m < mr; m++) {
            __m512 xv = _mm512_set1_ps(x[m * ldx + i]);
            for (int j = 0; j < 2 * nb; j++) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < 2 * nb; j++)
            _mm512_mask_storeu_ps(out + m * ldo + 16 * j, lanes[j], acc[m][j]);
}

typedef void (*F32Tile)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t, const float*,
                        int, float*, int64_t);
#define F32_TILE(MR, NB)                                                                                        \
    F32_TARGET static void f32_tile_##MR##_##NB(const float* x, int64_t ldx, int64_t k, const float* w,         \
                                                int64_t block_floats, int64_t first_block, int64_t n,           \
                                                const float* bias, int accumulate, float* out, int64_t ldo) {   \
        f32_tile(x, ldx, k, w, block_floats, first_block, n, bias, accumulate, out, ldo, MR, NB);               \
    }
F32_TILE(1, 1) F32_TILE(2, 1) F32_TILE(3, 1) F32_TILE(4, 1) F32_TILE(5, 1) F32_TILE(6, 1) F32_TILE(7, 1)
F32_TILE(8, 1) F32_TILE(9, 1) F32_TILE(10, 1) F32_TILE(11, 1) F32_TILE(12, 1) F32_TILE(13, 1) F32_TILE(14, 1)
F32_TILE(1, 2) F32_TILE(2, 2) F32_TILE(3, 2) F32_TILE(4, 2) F32_TILE(5, 2) F32_TILE(6, 2)
F32_TILE(1, 4) F32_TILE(2, 4)
// By rows (1 to 14): the one-block tile, and the widest tile that fits the 32 vector registers with its weights.
static const F32Tile F32_NARROW[F32_MAX_ROWS + 1] = {
    0, f32_tile_1_1, f32_tile_2_1, f32_tile_3_1, f32_tile_4_1, f32_tile_5_1, f32_tile_6_1, f32_tile_7_1,
    f32_tile_8_1, f32_tile_9_1, f32_tile_10_1, f32_tile_11_1, f32_tile_12_1, f32_tile_13_1, f32_tile_14_1};
static const F32Tile F32_WIDE[F32_MAX_ROWS + 1] = {
    0, f32_tile_1_4, f32_tile_2_4, f32_tile_3_2, f32_tile_4_2, f32_tile_5_2, f32_tile_6_2};
static const int F32_WIDE_BLOCKS[F32_MAX_ROWS + 1] = {0, 4, 4, 2, 2, 2, 2};

// The activation over out[0:rows, first:first + width], in place.
F32_TARGET static void f32_activate(float* out, int64_t rows, int64_t ldo, int64_t first, int64_t width,
                                    int activation) {
    for (int64_t r = 0; r < rows; r++) {
        float* row = out + r * ldo + first;
        switch (activation) {
            case ACT_GELU:
#pragma omp simd
                for (int64_t c = 0; c < width; c++) row[c] = activate(row[c], ACT_GELU);
                break;
            case ACT_GELU_TANH:
#pragma omp simd
                for (int64_t c = 0; c < width; c++) row[c] = activate(row[c], ACT_GELU_TANH);
                break;
            case ACT_RELU:
#pragma omp simd
                for (int64_t c = 0; c < width; c++) row[c] = activate(row[c], ACT_RELU);
                break;
            default:
                return;
        }
    }
}

// One column group (`blocks` blocks from `first_block`) for every row: row blocks of at most 14, as even as
// they can be (16 rows run as 8 + 8, not 14 + 2), then the activation over the group while it is in cache. With
// more than one row block the inputs go in slices of F32_SLICE, so that each slice of the weight block, read from
// memory by the first row block, is still in L1 for the others.
F32_TARGET static void f32_group(const float* x, int64_t rows, int64_t k, int64_t ldx, const float* packed,
                                 int64_t first_block, int blocks, int64_t n, const float* bias, int activation,
                                 float* out, int64_t ldo) {
    const int64_t row_blocks = (rows + F32_MAX_ROWS - 1) / F32_MAX_ROWS;
    const float* w = packed + first_block * k * F32_BLOCK;
    const int64_t slice = row_blocks > 1 ? F32_SLICE : k;
    for (int64_t i = 0; i < k; i += slice) {
        const int64_t inputs = k - i < slice ? k - i : slice;
        for (int64_t rb = 0, start = 0; rb < row_blocks; rb++) {
            int64_t mr = (rows - start) / (row_blocks - rb) + ((rows - start) % (row_blocks - rb) != 0);
            F32Tile tile = blocks == 1 ? F32_NARROW[mr] : F32_WIDE[mr];
            tile(x + start * ldx + i, ldx, inputs, w + i * F32_BLOCK, k * F32_BLOCK, first_block, n, bias, i > 0,
                 out + start * ldo, ldo);
            start += mr;
        }
    }
    int64_t first = first_block * F32_BLOCK, width = blocks * F32_BLOCK;
    if (first + width > n) width = n - first;
    f32_activate(out, rows, ldo, first, width, activation);
}
#endif  // BOUQUET_F32

// x: [rows, k] float32 (`ldx` elements between rows), packed (above) -> out: [rows, n] float32 (`ldo` apart):
// act(x W^T + b), `bias` [n] or NULL; or, given `residual` ([rows, n], `residual_stride` apart), LayerNorm(residual
// + x W^T + b) with gamma, beta [n] and eps (no activation then). Returns 1 where this build or CPU has no AVX-512
// (out untouched).
int bouquet_f32_linear(const float* x, int64_t rows, int64_t k, int64_t ldx, const float* packed, int64_t n,
                       const float* bias, int32_t activation, float* out, int64_t ldo, const float* residual,
                       int64_t residual_stride, const float* gamma, const float* beta, float eps) {
#if BOUQUET_F32
    const int64_t blocks = (n + F32_BLOCK - 1) / F32_BLOCK;
    const int wide = rows <= F32_MAX_ROWS ? F32_WIDE_BLOCKS[rows] : 0;
    const int group = wide > 1 ? wide : 1;
    const int64_t groups = (blocks + group - 1) / group;
#pragma omp parallel if (rows * n * k >= F32_PARALLEL_WORK)
    {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            int64_t first_block = g * group;
            if (first_block + group <= blocks)
                f32_group(x, rows, k, ldx, packed, first_block, group, n, bias, activation, out, ldo);
            else  // the last, partial group, one block at a time
                for (int64_t b = first_block; b < blocks; b++)
                    f32_group(x, rows, k, ldx, packed, b, 1, n, bias, activation, out, ldo);
        }
        if (residual) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                add_norm_row(out + r * ldo, n, residual + r * residual_stride, gamma, beta, eps);
        }
    }
    return 0;
#else
    (void)x, (void)rows, (void)k, (void)ldx, (void)packed, (void)n, (void)bias, (void)activation, (void)out;
    (void)ldo, (void)residual, (void)residual_stride, (void)gamma, (void)beta, (void)eps;
    return 1;
#endif
}
