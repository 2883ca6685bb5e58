// The two passes around an int8 linear's integer product (layers/int8_linear.py), compiled on first use by
// kernels/build.py:
//   bouquet_quantize_rows: float32 activations -> int8, one scale and zero point per row (per token), so one
//     outlier token costs no other token its precision; each row first rotated where the weight was (below);
//   bouquet_dequantize: the product (int32, or float32 holding integers where oneDNN's prepacked matmul gave it)
//     -> float32, in place: less the row's zero point, times the row's scale and the output channel's, plus the
//     bias, then the layer's activation (GELU, tanh GELU, ReLU) while the row is still in cache.
// Each is one pass over memory where torch's ops took three to five (abs, amax, divide, round, clamp, cast;
// cast, multiply, add, activation).
//
// OpenMP: linked against the runtime torch already loaded (same soname), so the calling engine thread's team
// size, set through torch, applies here too. The loops are plain C that GCC vectorizes, cloned for AVX-512,
// AVX2 and the baseline and dispatched by the CPU at load.
#include <math.h>
#include <omp.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONED __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONED
#endif
#define INLINE static inline __attribute__((always_inline))

enum { ACT_NONE = 0, ACT_GELU = 1, ACT_GELU_TANH = 2, ACT_RELU = 3 };
// Below this many elements a pass runs on the calling thread alone: waking a team costs more than it saves.
enum { PARALLEL_ELEMENTS = 32768 };

int bouquet_omp_max_threads(void) { return omp_get_max_threads(); }

INLINE float max_of(float a, float b) { return a > b ? a : b; }  // maxps; fmaxf's NaN rules keep it a call
INLINE float min_of(float a, float b) { return a < b ? a : b; }

// 2^x for x in float32's range, by 2^round(x) (exponent bits) times a degree-6 polynomial on [-0.5, 0.5]:
// relative error under 2e-7, branch-free so that GCC vectorizes the loops that call it.
INLINE float exp2_approx(float x) {
    x = min_of(max_of(x, -126.0f), 126.0f);
    float k = rintf(x);
    float r = (x - k) * 0.69314718f;  // 2^(x-k) = e^r, |r| <= ln2 / 2
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.6666667e-1f + r * (4.1666668e-2f + r * (8.3333338e-3f + r * 1.3888889e-3f)))));
    union { int32_t bits; float value; } scale = {.bits = ((int32_t)k + 127) << 23};
    return p * scale.value;
}

INLINE float exp_approx(float x) { return exp2_approx(x * 1.44269504f); }

// erf by Abramowitz and Stegun 7.1.26 (absolute error under 1.5e-7, float32's own resolution near 1).
INLINE float erf_approx(float x) {
    float a = fabsf(x);
    float t = 1.0f / (1.0f + 0.3275911f * a);
    float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
    float y = 1.0f - poly * exp_approx(-a * a);
    return copysignf(y, x);
}

INLINE float tanh_approx(float x) {
    float e = exp_approx(-2.0f * fabsf(x));  // in (0, 1]: no overflow
    return copysignf((1.0f - e) / (1.0f + e), x);
}

INLINE float activate(float v, int activation) {
    switch (activation) {
        case ACT_GELU: return 0.5f * v * (1.0f + erf_approx(v * 0.70710678f));
        case ACT_GELU_TANH: return 0.5f * v * (1.0f + tanh_approx(0.79788456f * (v + 0.044715f * v * v * v)));
        case ACT_RELU: return max_of(v, 0.0f);
        default: return v;
    }
}

// The passes' loops written for AVX-512 (int8_linear_gelu.h, int8_linear_codes.h), where GCC's vector code for the
// plain C was slow; they run where the CPU has AVX512F and bouquet's feature probe allows it (layers/int8_linear.py
// says so at load: a probe overridden to an AVX2 CPU gives the clones' plain C, as on that CPU).
#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 11)
#define PASSES_AVX512 1
#include <immintrin.h>
#define AVX512_TARGET __attribute__((target("avx512f")))
#else
#define PASSES_AVX512 0
#define AVX512_TARGET
#endif

static int passes_avx512_allowed = 1;

void bouquet_passes_allow_avx512(int32_t allowed) { passes_avx512_allowed = allowed != 0; }

INLINE int avx512_available(void) {
#if PASSES_AVX512
    static int available = -1;  // the same answer from every thread: a racing write stores the same value
    if (available < 0) {
        __builtin_cpu_init();
        available = __builtin_cpu_supports("avx512f");
    }
    return available && passes_avx512_allowed;
#else
    return 0;
#endif
}

// Whether the passes take their AVX-512 loops now (the CPU has AVX512F and the probe allows it).
int bouquet_passes_avx512(void) { return avx512_available(); }

#if PASSES_AVX512
// The lanes of the 16-value group at column c of a row of `cols`: all of them but in the last, partial group.
AVX512_TARGET INLINE __mmask16 group_lanes(int64_t c, int64_t cols) {
    return cols - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cols - c)) - 1);
}
#endif

#include "int8_linear_codes.h"
#include "int8_linear_gelu.h"

// One row, asymmetric: [min(row, 0), max(row, 0)] maps onto [-128, 127], x ~ scale * (q - zero), `zero` an integer
// in [-128, 127]. Against a symmetric scale this doubles the resolution of skewed rows (a GELU's output, from
// -0.17 up) and halves the error of queries' rows, whose few tokens each carry outlier channels. An all-zero
// row gets scale 0 and zeros: its products are exactly 0, as in float32. Returns the codes' sum.
CLONED static int32_t quantize_row(const float* x, int64_t cols, int8_t* q, float* scale, int32_t* zero) {
    float lo = 0.0f, hi = 0.0f;
#pragma omp simd reduction(min : lo) reduction(max : hi)
    for (int64_t c = 0; c < cols; ++c) {
        lo = min_of(lo, x[c]);
        hi = max_of(hi, x[c]);
    }
    float inverse = hi > lo ? 255.0f / (hi - lo) : 0.0f;
    float offset = rintf(-lo * inverse) - 128.0f;
    *scale = (hi - lo) / 255.0f;
    *zero = (int32_t)offset;
    if (avx512_available()) return quantize_codes(x, cols, inverse, offset, q);
    int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < cols; ++c) {
        float v = rintf(x[c] * inverse) + offset;
        q[c] = (int8_t)(int32_t)min_of(max_of(v, -128.0f), 127.0f);
        sum += q[c];
    }
    return sum;
}

// The input rotation (layers/int8_linear.py, `InputRotation`): each row times random signs, then a Hadamard
// transform of every `block` consecutive values (block a power of two), unnormalised: the caller's scale takes the
// 1 / sqrt(block). Each 16 values go through the four narrow butterfly stages in one vector (a stage is a lane
// permutation plus a multiply-add: v[j ^ w] + sign * v[j]), since loops of widths 1 to 8 do not vectorize and a
// 16 x 16 product was a chain of dependent FMAs (2.7x slower); wider blocks then take butterflies of width 16 up,
// between vectors.
enum { HADAMARD_INNER = 16 };
typedef float v16sf __attribute__((vector_size(64)));
typedef int32_t v16si __attribute__((vector_size(64)));
static const v16si PARTNER[4] = {
    {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14},
    {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
    {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
    {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
};
static const v16sf LOWER_PLUS[4] = {  // +1 where lane j is the first of its pair (bit w of j clear), else -1
    {1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1},
    {1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1},
    {1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1},
    {1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1},
};

INLINE void butterflies(float* t, int64_t cols, int64_t width) {
    for (int64_t i = 0; i < cols; i += 2 * width)
#pragma omp simd
        for (int64_t j = i; j < i + width; ++j) {
            float a = t[j], b = t[j + width];
            t[j] = a + b;
            t[j + width] = a - b;
        }
}

INLINE v16sf hadamard_of_16(const float* x, const float* signs) {
    v16sf v, s;
    __builtin_memcpy(&v, x, sizeof v);
    __builtin_memcpy(&s, signs, sizeof s);
    v *= s;
    for (int stage = 0; stage < 4; ++stage) v = __builtin_shuffle(v, PARTNER[stage]) + LOWER_PLUS[stage] * v;
    return v;
}

// Blocks of 128 (every width that is a multiple of 128: the common case) stay in eight vector registers through
// all seven stages, so the row is read once and written once.
enum { WIDE_BLOCK = 128, VECTORS = WIDE_BLOCK / HADAMARD_INNER };

INLINE void rotate_blocks_of_128(const float* x, int64_t cols, const float* signs, float* t) {
    for (int64_t c = 0; c < cols; c += WIDE_BLOCK) {
        v16sf v[VECTORS];
        for (int k = 0; k < VECTORS; ++k)
            v[k] = hadamard_of_16(x + c + HADAMARD_INNER * k, signs + c + HADAMARD_INNER * k);
        for (int width = 1; width < VECTORS; width *= 2)
            for (int k = 0; k < VECTORS; ++k)
                if (!(k & width)) {
                    v16sf a = v[k], b = v[k + width];
                    v[k] = a + b;
                    v[k + width] = a - b;
                }
        __builtin_memcpy(t + c, v, sizeof v);
    }
}

CLONED static void rotate_row(const float* x, int64_t cols, const float* signs, int64_t block, float* t) {
    if (block == WIDE_BLOCK) {
        rotate_blocks_of_128(x, cols, signs, t);
        return;
    }
    int64_t width = 1;
    if (block >= HADAMARD_INNER) {
        for (int64_t c = 0; c < cols; c += HADAMARD_INNER) {
            v16sf v = hadamard_of_16(x + c, signs + c);
            __builtin_memcpy(t + c, &v, sizeof v);
        }
        width = HADAMARD_INNER;
    } else {
        for (int64_t c = 0; c < cols; ++c) t[c] = x[c] * signs[c];
    }
    for (; width < block; width *= 2) butterflies(t, cols, width);
}

// x: [rows, cols] float32, `stride` elements between rows; q: [rows, cols] int8, contiguous; scales, zeros: [rows].
// With `signs` (else NULL), each row is rotated first (above); `block` divides cols. Returns the row's codes summed.
INLINE int32_t quantize_one_row(const float* x, int64_t cols, const float* signs, int64_t block, int8_t* q,
                                float* scale, int32_t* zero) {
    if (!signs) return quantize_row(x, cols, q, scale, zero);
    float rotated[cols];
    rotate_row(x, cols, signs, block, rotated);
    const int32_t sum = quantize_row(rotated, cols, q, scale, zero);
    *scale /= sqrtf((float)block);
    return sum;
}

void bouquet_quantize_rows(const float* x, int64_t rows, int64_t cols, int64_t stride, int8_t* q, float* scales,
                           int32_t* zeros, const float* signs, int64_t block) {
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r)
        quantize_one_row(x + r * stride, cols, signs, block, q + r * cols, scales + r, zeros + r);
}

// `data` holds one row of products on entry and of float32 on return, element by element in place (through a
// may_alias type, so that the compiler knows the two views share memory). Inlined once per activation and
// product type, so that each loop has no branch in it.
typedef float aliased_float __attribute__((may_alias));
// The row's zero point comes off each channel's weight sum: q @ w - zero * sum(w). With int32 products that is
// exact; float32 products hold the same integers exactly below 2^24 (a 384-wide row of codes centred on their
// zero point stays far below it) and round as a float32 linear's own sum would above.
INLINE void dequantize_row_with(void* data, int64_t cols, float row_scale, int32_t row_zero, const float* col_scales,
                                const int32_t* col_sums, const float* bias, const int activation,
                                const int float_products) {
    const int32_t* integers = (const int32_t*)data;
    const aliased_float* floats = (const aliased_float*)data;
    aliased_float* out = (aliased_float*)data;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) {
        float product = float_products ? floats[c] - (float)(row_zero * col_sums[c])
                                       : (float)(integers[c] - row_zero * col_sums[c]);
        out[c] = activate(product * (row_scale * col_scales[c]) + bias[c], activation);
    }
}

#define DEQUANTIZE_ROW(act)                                                                                        \
    (float_products ? dequantize_row_with(data, cols, row_scale, row_zero, col_scales, col_sums, bias, act, 1)     \
                    : dequantize_row_with(data, cols, row_scale, row_zero, col_scales, col_sums, bias, act, 0))
CLONED static void dequantize_row(void* data, int64_t cols, float row_scale, int32_t row_zero,
                                  const float* col_scales, const int32_t* col_sums, const float* bias,
                                  int activation, int float_products) {
    switch (activation) {
        case ACT_GELU:
            if (avx512_available())
                dequantize_gelu_row(data, cols, row_scale, row_zero, col_scales, col_sums, bias, float_products);
            else
                DEQUANTIZE_ROW(ACT_GELU);
            break;
        case ACT_GELU_TANH: DEQUANTIZE_ROW(ACT_GELU_TANH); break;
        case ACT_RELU: DEQUANTIZE_ROW(ACT_RELU); break;
        default: DEQUANTIZE_ROW(ACT_NONE);
    }
}

// data: [rows, cols] int32 or (float_products) float32 in, float32 out (contiguous); row_scales, row_zeros:
// [rows]; col_scales, col_sums (each output channel's int8 weights summed), bias: [cols].
void bouquet_dequantize(void* data, int64_t rows, int64_t cols, const float* row_scales, const int32_t* row_zeros,
                        const float* col_scales, const int32_t* col_sums, const float* bias, int32_t activation,
                        int32_t float_products) {
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r)
        dequantize_row((char*)data + 4 * r * cols, cols, row_scales[r], row_zeros[r], col_scales, col_sums, bias,
                       activation, float_products);
}

// A post-norm block's end on one row in place, while it is in cache: plus the residual row, then LayerNorm over the
// row (gamma, beta, eps), where torch took three passes (add; the row's moments; normalise).
INLINE void add_norm_row(float* out, int64_t cols, const float* residual, const float* gamma, const float* beta,
                         float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < cols; ++c) {
        out[c] += residual[c];
        sum += out[c];
    }
    const float mean = sum / (float)cols;
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t c = 0; c < cols; ++c) squares += (out[c] - mean) * (out[c] - mean);
    const float inverse = 1.0f / sqrtf(squares / (float)cols + eps);
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) out[c] = (out[c] - mean) * inverse * gamma[c] + beta[c];
}

// add_norm_row as the dispatched clone, for kernels whose dequantizing pass ran earlier (the VNNI linear's column
// groups): the same vector code as dequantize_add_norm_row's, so the same floats.
CLONED static void add_norm_row_cloned(float* out, int64_t cols, const float* residual, const float* gamma,
                                       const float* beta, float eps) {
    add_norm_row(out, cols, residual, gamma, beta, eps);
}

// BERT's `attention.output` and `output`: the dequantized row (above, no activation), then add_norm_row.
CLONED static void dequantize_add_norm_row(void* data, int64_t cols, float row_scale, int32_t row_zero,
                                           const float* col_scales, const int32_t* col_sums, const float* bias,
                                           int float_products, const float* residual, const float* gamma,
                                           const float* beta, float eps) {
    if (float_products)
        dequantize_row_with(data, cols, row_scale, row_zero, col_scales, col_sums, bias, ACT_NONE, 1);
    else
        dequantize_row_with(data, cols, row_scale, row_zero, col_scales, col_sums, bias, ACT_NONE, 0);
    add_norm_row((aliased_float*)data, cols, residual, gamma, beta, eps);
}

// bouquet_dequantize's arguments (no activation), then residual: [rows, cols] float32, `residual_stride` elements
// between rows; gamma, beta: [cols], the LayerNorm's weight and bias; eps its epsilon.
void bouquet_dequantize_add_norm(void* data, int64_t rows, int64_t cols, const float* row_scales,
                                 const int32_t* row_zeros, const float* col_scales, const int32_t* col_sums,
                                 const float* bias, int32_t float_products, const float* residual,
                                 int64_t residual_stride, const float* gamma, const float* beta, float eps) {
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r)
        dequantize_add_norm_row((char*)data + 4 * r * cols, cols, row_scales[r], row_zeros[r], col_scales, col_sums,
                                bias, float_products, residual + r * residual_stride, gamma, beta, eps);
}

// The product on AMX tiles (int8_linear_amx.h), and the whole linear around it in one call: a query's linear is
// a few microseconds of arithmetic each side of the product, less than three calls from Python and three OpenMP
// teams cost.
#include "int8_linear_amx.h"
#include "int8_linear_bf16.h"
#include "int8_linear_f32.h"
#include "int8_linear_vnni.h"

// x: [rows, k] float32 (`x_stride` elements between rows) -> out: [rows, n] float32, contiguous: the rows quantized
// (rotated first where `signs`; into codes [rows, k], row_scales, row_zeros: the caller's scratch), times the packed
// weight, then dequantized with the activation, or, given `residual` ([rows, n], `residual_stride`), plus the
// residual and the LayerNorm (gamma, beta, eps). One OpenMP team for the three passes where the work is large
// enough. Returns 1 where this build has no AMX (out untouched).
int bouquet_amx_linear(const float* x, int64_t rows, int64_t k, int64_t x_stride, const float* signs, int64_t block,
                       int8_t* codes, float* row_scales, int32_t* row_zeros, const int8_t* packed, int64_t n,
                       float* out, const float* col_scales, const int32_t* col_sums, const float* bias,
                       int32_t activation, const float* residual, int64_t residual_stride, const float* gamma,
                       const float* beta, float eps) {
    if (!BOUQUET_AMX) return 1;
#pragma omp parallel if (rows * n * k >= PARALLEL_WORK)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r)
            quantize_one_row(x + r * x_stride, k, signs, block, codes + r * k, row_scales + r, row_zeros + r);
        amx_product_share(codes, rows, k, k, packed, n, (int32_t*)out, n, omp_get_num_threads(), omp_get_thread_num());
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            void* row = out + r * n;
            if (residual)
                dequantize_add_norm_row(row, n, row_scales[r], row_zeros[r], col_scales, col_sums, bias, 0,
                                        residual + r * residual_stride, gamma, beta, eps);
            else
                dequantize_row(row, n, row_scales[r], row_zeros[r], col_scales, col_sums, bias, activation, 0);
        }
    }
    return 0;
}

// Rows [start, stop) of a VNNI linear of many rows, on the calling thread: quantized (codes, row_scales, row_zeros,
// code_sums: the call's, indexed by row), every column group's product then its dequantizing (vnni_columns, with
// `columns`' channel arguments), then the residual and LayerNorm where given, while the chunk is in cache.
static void vnni_linear_chunk(const float* x, int64_t start, int64_t stop, int64_t k, int64_t x_stride,
                              const float* signs, int64_t block, int8_t* codes, float* row_scales, int32_t* row_zeros,
                              int32_t* code_sums, const uint8_t* packed, int64_t n, float* out,
                              const VnniDequantize* columns, const float* residual, int64_t residual_stride,
                              const float* gamma, const float* beta, float eps) {
    for (int64_t r = start; r < stop; ++r) {
        code_sums[r] = quantize_one_row(x + r * x_stride, k, signs, block, codes + r * k, row_scales + r,
                                        row_zeros + r);
    }
    VnniDequantize dequantize = *columns;
    dequantize.row_scales = row_scales + start;
    dequantize.row_zeros = row_zeros + start;
    vnni_columns(codes + start * k, stop - start, k, k, code_sums + start, packed, n, (int32_t*)(out + start * n), n,
                 &dequantize, VNNI_CHUNK_GROUP, 1, 0);
    for (int64_t r = start; residual && r < stop; ++r)
        add_norm_row_cloned(out + r * n, n, residual + r * residual_stride, gamma, beta, eps);
}

// bouquet_amx_linear's arguments and contract, on the VNNI product (int8_linear_vnni.h, `packed` in its layout):
// quantizing, the product with each column group dequantized while it is in cache, then the residual and LayerNorm
// where given. Returns 1 where this build has no VNNI (out untouched).
int bouquet_vnni_linear(const float* x, int64_t rows, int64_t k, int64_t x_stride, const float* signs, int64_t block,
                        int8_t* codes, float* row_scales, int32_t* row_zeros, const uint8_t* packed, int64_t n,
                        float* out, const float* col_scales, const int32_t* col_sums, const float* bias,
                        int32_t activation, const float* residual, int64_t residual_stride, const float* gamma,
                        const float* beta, float eps) {
    if (!BOUQUET_VNNI) return 1;
    if (rows <= 0) return 0;
    int32_t code_sums[rows];
    const VnniDequantize dequantize = {row_scales, col_scales, bias, row_zeros, col_sums,
                                       residual ? ACT_NONE : activation};
#pragma omp parallel if (rows * n * k >= VNNI_PARALLEL_WORK)
    if (rows >= VNNI_SPLIT_ROWS) {
        int64_t first, end;
        vnni_row_share(rows, omp_get_num_threads(), omp_get_thread_num(), &first, &end);
        for (int64_t start = first, stop; start < end; start = stop) {
            stop = vnni_chunk_end(start, end);
            vnni_linear_chunk(x, start, stop, k, x_stride, signs, block, codes, row_scales, row_zeros, code_sums,
                              packed, n, out, &dequantize, residual, residual_stride, gamma, beta, eps);
        }
    } else {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            code_sums[r] = quantize_one_row(x + r * x_stride, k, signs, block, codes + r * k, row_scales + r,
                                            row_zeros + r);
        }
        vnni_columns(codes, rows, k, k, code_sums, packed, n, (int32_t*)out, n, &dequantize, vnni_column_group(rows),
                     omp_get_num_threads(), omp_get_thread_num());
        if (residual) {
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; ++r)
                add_norm_row_cloned(out + r * n, n, residual + r * residual_stride, gamma, beta, eps);
        }
    }
    return 0;
}
