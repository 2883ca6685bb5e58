// float32 linears for short steps (layers/f32_short.py): out = act(x W^T + b) and, for a post-norm block's end,
// LayerNorm(residual + x W^T + b), by register-blocked FMAs, in AVX-512 (here) or AVX2 (int8_linear_f32_avx2.h). At a
// query's few rows oneDNN's packed linear spends much of a call outside its arithmetic (primitive lookup, argument
// packing); this loop has no set-up beyond the call, and its bias, activation and norm run while the output is in
// cache. Included by int8_linear.c, whose activations and LayerNorm row pass it shares.
//
// The weight is packed once at load (bouquet_f32_pack) into column blocks of `block` output channels (two vectors:
// 32 for AVX-512, 16 for AVX2), each block its k inputs in order, `block` floats an input: [ceil(n / block)][k]
// [block], zero-padded past n. The block width names the layout, so the caller passes it with the weight and the
// kernel that matches it runs. A tile of MR rows by NB blocks keeps MR x 2 NB accumulators in registers; each input
// loads 2 NB weight vectors and broadcasts each row's x[m][k] once. Wide tiles at the fewest rows, where two
// accumulators a row could not hide the FMA's latency. Row blocks of up to the ISA's tallest tile run under each
// column group, so a group's weights are read from memory once per call; output channels are split between the
// OpenMP team's threads by column group.
//
// Requirements the caller checks: x's and out's rows contiguous; any k and n.
// No include guard: included once, by int8_linear.c.

#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 11)
#define BOUQUET_F32 1
#include <immintrin.h>
#define F32_TARGET __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,fma")))
#define F32_AVX2_TARGET __attribute__((target("avx2,fma")))
#else
#define BOUQUET_F32 0
#define F32_TARGET
#define F32_AVX2_TARGET
#endif

// F32_PREFETCH: how many inputs ahead a tile asks for its weights (4 KB a block): at a query's rows a tile spends ~14
// cycles an input, too few for the hardware prefetcher alone to hide L3's latency (the weights of a whole model stay
// in L3 at best). F32_SLICE: inputs per slice where several row blocks share a weight block (32 KB: L1 holds it).
enum { F32_BLOCK = 32, F32_MAX_ROWS = 14, F32_PREFETCH = 32, F32_SLICE = 256 };
// The AVX2 tiles' (int8_linear_f32_avx2.h): F32_AVX2_PREFETCH is 4 KB a block too, one 64-byte line an input there.
enum { F32_AVX2_BLOCK = 16, F32_AVX2_MAX_ROWS = 6, F32_AVX2_PREFETCH = 64 };
// Below this many multiply-adds a call runs on the calling thread alone. Lower than the int8 kernels' bound: a lone
// query's lead holds a team whose other thread spins between parallel regions, so a short region run alone costs that
// thread's time as well as its own.
enum { F32_PARALLEL_WORK = 1 << 19 };

// Whether this build and CPU run the kernel of the layout `block` wide (32: AVX-512, 16: AVX2 and FMA).
int bouquet_f32_available(int32_t block) {
#if BOUQUET_F32
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                       __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    return block == F32_BLOCK ? avx512 : block == F32_AVX2_BLOCK ? avx2 : 0;
#else
    (void)block;
    return 0;
#endif
}

// weight: [n, k] float32, row-major -> packed: [ceil(n / block)][k][block] floats (above).
void bouquet_f32_pack(const float* weight, int64_t n, int64_t k, int32_t block, float* packed) {
    for (int64_t nb = 0; nb < (n + block - 1) / block; nb++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t j = 0; j < block; j++) {
                int64_t channel = nb * block + j;
                packed[(nb * k + i) * block + j] = channel < n ? weight[channel * k + i] : 0.0f;
            }
}

#if BOUQUET_F32
// A tile: out[0:mr, block first_block : + block nb] = x[0:mr, 0:k] W^T + b for the weight blocks at `w`
// (block_floats apart), or out += x W^T where `accumulate` (a later slice of the inputs).
typedef void (*F32Tile)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t, const float*,
                        int, float*, int64_t);
// One ISA's kernel: its layout's block width, its tiles by rows (the one-block tile, and the widest that fits the
// vector registers with its weights, `wide_blocks` blocks, 0 where none), and the epilogues compiled for it.
typedef struct {
    int block, max_rows;
    const F32Tile* narrow;
    const F32Tile* wide;
    const int* wide_blocks;
    void (*activate)(float* out, int64_t rows, int64_t ldo, int64_t first, int64_t width, int activation);
    void (*add_norm)(float* out, int64_t cols, const float* residual, const float* gamma, const float* beta,
                     float eps);
} F32Kernel;

// The activation over out[0:rows, first:first + width], in place: one branch-free loop per activation. Inlined into
// each ISA's epilogue (below), whose target its loops are vectorized for, as add_norm_row is.
INLINE void f32_activate_rows(float* out, int64_t rows, int64_t ldo, int64_t first, int64_t width, int activation) {
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

// Lanes of the 16-channel vector starting at `first` that hold one of n channels.
INLINE __mmask16 f32_lanes(int64_t first, int64_t n) {
    int64_t valid = n - first;
    return valid >= 16 ? (__mmask16)0xFFFF : valid <= 0 ? (__mmask16)0 : (__mmask16)((1u << valid) - 1);
}

// The AVX-512 tile (F32Tile's contract); mr and nb are constants where this is inlined, so the accumulators live in
// registers.
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

#define F32_TILE(MR, NB)                                                                                        \
    F32_TARGET static void f32_tile_##MR##_##NB(const float* x, int64_t ldx, int64_t k, const float* w,         \
                                                int64_t block_floats, int64_t first_block, int64_t n,           \
                                                const float* bias, int accumulate, float* out, int64_t ldo) {   \
        f32_tile(x, ldx, k, w, block_floats, first_block, n, bias, accumulate, out, ldo, MR, NB);               \
    }
F32_TILE(1, 1) F32_TILE(2, 1) F32_TILE(3, 1) F32_TILE(4, 1) F32_TILE(5, 1) F32_TILE(6, 1) F32_TILE(7, 1)
F32_TILE(8, 1) F32_TILE(9, 1) F32_TILE(10, 1) F32_TILE(11, 1) F32_TILE(12, 1) F32_TILE(13, 1) F32_TILE(14, 1)
F32_TILE(3, 2) F32_TILE(4, 2) F32_TILE(5, 2) F32_TILE(6, 2)
F32_TILE(1, 4) F32_TILE(2, 4)
static const F32Tile F32_NARROW[F32_MAX_ROWS + 1] = {
    0, f32_tile_1_1, f32_tile_2_1, f32_tile_3_1, f32_tile_4_1, f32_tile_5_1, f32_tile_6_1, f32_tile_7_1,
    f32_tile_8_1, f32_tile_9_1, f32_tile_10_1, f32_tile_11_1, f32_tile_12_1, f32_tile_13_1, f32_tile_14_1};
static const F32Tile F32_WIDE[F32_MAX_ROWS + 1] = {
    0, f32_tile_1_4, f32_tile_2_4, f32_tile_3_2, f32_tile_4_2, f32_tile_5_2, f32_tile_6_2};
static const int F32_WIDE_BLOCKS[F32_MAX_ROWS + 1] = {0, 4, 4, 2, 2, 2, 2};
F32_TARGET static void f32_activate_avx512(float* out, int64_t rows, int64_t ldo, int64_t first, int64_t width,
                                           int activation) {
    f32_activate_rows(out, rows, ldo, first, width, activation);
}
F32_TARGET static void f32_add_norm_avx512(float* out, int64_t cols, const float* residual, const float* gamma,
                                           const float* beta, float eps) {
    add_norm_row(out, cols, residual, gamma, beta, eps);
}
static const F32Kernel F32_AVX512 = {F32_BLOCK, F32_MAX_ROWS, F32_NARROW, F32_WIDE, F32_WIDE_BLOCKS,
                                     f32_activate_avx512, f32_add_norm_avx512};
#endif  // BOUQUET_F32

#include "int8_linear_f32_avx2.h"

#if BOUQUET_F32
// One column group (`blocks` blocks from `first_block`) for every row: row blocks of at most the kernel's tallest
// tile, as even as they can be (16 rows in AVX-512 run as 8 + 8, not 14 + 2), then the activation over the group
// while it is in cache. With more than one row block the inputs go in slices of F32_SLICE, so that each slice of the
// weight block, read from memory by the first row block, is still in L1 for the others.
static void f32_group(const F32Kernel* kernel, const float* x, int64_t rows, int64_t k, int64_t ldx,
                      const float* packed, int64_t first_block, int blocks, int64_t n, const float* bias,
                      int activation, float* out, int64_t ldo) {
    const int64_t row_blocks = (rows + kernel->max_rows - 1) / kernel->max_rows;
    const float* w = packed + first_block * k * kernel->block;
    const int64_t slice = row_blocks > 1 ? F32_SLICE : k;
    for (int64_t i = 0; i < k; i += slice) {
        const int64_t inputs = k - i < slice ? k - i : slice;
        for (int64_t rb = 0, start = 0; rb < row_blocks; rb++) {
            int64_t mr = (rows - start) / (row_blocks - rb) + ((rows - start) % (row_blocks - rb) != 0);
            F32Tile tile = blocks == 1 ? kernel->narrow[mr] : kernel->wide[mr];
            tile(x + start * ldx + i, ldx, inputs, w + i * kernel->block, k * kernel->block, first_block, n, bias,
                 i > 0, out + start * ldo, ldo);
            start += mr;
        }
    }
    int64_t first = first_block * kernel->block, width = blocks * kernel->block;
    if (first + width > n) width = n - first;
    kernel->activate(out, rows, ldo, first, width, activation);
}

// The kernel for the layout `block` wide, or NULL where this build or CPU has none (a weight packed under another
// probe fails its call rather than running instructions the CPU lacks).
static const F32Kernel* f32_kernel(int32_t block) {
    if (!bouquet_f32_available(block)) return 0;
    if (block == F32_AVX512.block) return &F32_AVX512;
    if (block == F32_AVX2.block) return &F32_AVX2;
    return 0;
}
#endif  // BOUQUET_F32

// x: [rows, k] float32 (`ldx` elements between rows), packed (above, `block` wide) -> out: [rows, n] float32 (`ldo`
// apart): act(x W^T + b), `bias` [n] or NULL; or, given `residual` ([rows, n], `residual_stride` apart),
// LayerNorm(residual + x W^T + b) with gamma, beta [n] and eps (no activation then). Returns 1 where this build or CPU
// has no kernel for the layout (out untouched).
int bouquet_f32_linear(const float* x, int64_t rows, int64_t k, int64_t ldx, const float* packed, int32_t block,
                       int64_t n, const float* bias, int32_t activation, float* out, int64_t ldo,
                       const float* residual, int64_t residual_stride, const float* gamma, const float* beta,
                       float eps) {
#if BOUQUET_F32
    const F32Kernel* kernel = f32_kernel(block);
    if (!kernel) return 1;
    const int64_t blocks = (n + block - 1) / block;
    const int wide = rows <= kernel->max_rows ? kernel->wide_blocks[rows] : 0;
    const int group = wide > 1 ? wide : 1;
    const int64_t groups = (blocks + group - 1) / group;
#pragma omp parallel if (rows * n * k >= F32_PARALLEL_WORK)
    {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            int64_t first_block = g * group;
            if (first_block + group <= blocks)
                f32_group(kernel, x, rows, k, ldx, packed, first_block, group, n, bias, activation, out, ldo);
            else  // the last, partial group, one block at a time
                for (int64_t b = first_block; b < blocks; b++)
                    f32_group(kernel, x, rows, k, ldx, packed, b, 1, n, bias, activation, out, ldo);
        }
        if (residual) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                kernel->add_norm(out + r * ldo, n, residual + r * residual_stride, gamma, beta, eps);
        }
    }
    return 0;
#else
    (void)x, (void)rows, (void)k, (void)ldx, (void)packed, (void)block, (void)n, (void)bias, (void)activation;
    (void)out, (void)ldo, (void)residual, (void)residual_stride, (void)gamma, (void)beta, (void)eps;
    return 1;
#endif
}
