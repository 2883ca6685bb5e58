// Attention over packed, variable-length sequences on the CPU: bouquet's `cpu_varlen` attention backend
// (layers/attention_backends/cpu_varlen.py), compiled on first use by kernels/build.py.
//
// Why a kernel of our own: ATen's CPU flash attention ran at about 30-40 GFLOP/s a core here at head_dim 32
// (small blocks, a GEMM call per block), and SDPA has no variable-length form, so sequences were padded into
// groups first. Here each (sequence, head) is one work item of OpenMP's dynamic schedule: K is packed once,
// transposed; the queries go through in tiles of ROWS rows whose scores for all keys ([ROWS, L], in L1/L2)
// get an exact softmax, with no online rescaling, since an encoder's sequences are short (512 tokens, 32k at
// most). Inputs may be float32 or bfloat16; every sum is float32; the output takes the input's dtype.
// bfloat16 is either widened while packing (`attend`) or, on CPUs with AVX512-BF16, goes through bfloat16
// dot products (`attend_pairs`). Strides are in elements between consecutive tokens; within a token, heads
// are contiguous and each head's head_dim values too. head_dim must be a multiple of 16 (the caller checks).
//
// OpenMP: the caller links it against the runtime torch already loaded (same soname, libgomp.so.1), so each
// engine thread's team size, set through torch, applies here too.
// x86-64 gets AVX2 and AVX-512 builds of the vector code and the AVX512-BF16 path, the caller choosing which
// (`isa`); elsewhere (or with -DBOUQUET_GENERIC, to test that build here) the vector code is compiled for the
// baseline only.
#if defined(__x86_64__) && !defined(BOUQUET_GENERIC)
#define BOUQUET_X86 1
#else
#define BOUQUET_X86 0
#endif
#if BOUQUET_X86
#include <immintrin.h>
// The hot loops compiled for AVX-512 and AVX2 besides the baseline; the caller names the widest it may use
// (`isa`: bouquet's CPU probe, so a test can force the AVX2 code on an AVX-512 machine), capped here at what
// the CPU has.
#define AVX2_TARGET __attribute__((target("avx2,fma,bmi,bmi2"), noinline))
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,bmi,bmi2"), noinline))
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
enum { ROWS = 8, LANES = 16 };  // a tile's query rows; LANES: the AVX-512 width the bfloat16 path works in

INLINE int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

INLINE uint16_t f32_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  // NaN stays NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest, ties to even
    return (uint16_t)(bits >> 16);
}

typedef struct {
    const void *q, *k, *v;
    void* out;
    int64_t q_stride, k_stride, v_stride, out_stride;  // elements between consecutive tokens
    int32_t head_dim;
    float scale;
    int32_t causal, bf16;
    int64_t window_left, window_right;  // a query at i sees keys [i - left, i + right]; -1: no bound that side
} Problem;

typedef struct {
    float *kt, *vv, *qt, *s;  // K^T [D][Lp], V [Lp][D], scaled Q tile [ROWS][D], scores [ROWS][Lp]
    float* block;             // a vector's worth of tokens' keys [LANES][D], on their way into K^T
    uint16_t* pb;             // bfloat16 path: the tile's probabilities [ROWS][Lp] in bfloat16
} Scratch;


// The vector code once per width (varlen_attention_tiles.h): names end in _16, _8 and _4.
#define VL 16
#define V(name) name##_16
#include "varlen_attention_tiles.h"
#undef VL
#undef V
#define VL 8
#define V(name) name##_8
#include "varlen_attention_tiles.h"
#undef VL
#undef V
#define VL 4
#define V(name) name##_4
#include "varlen_attention_tiles.h"
#undef VL
#undef V

typedef float v16f __attribute__((vector_size(64), aligned(64)));
typedef uint16_t v16h_u __attribute__((vector_size(32), aligned(2)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(64)));

// Each ISA's width, and its register blocks (rows a product keeps in registers, see `scores`): with one register
// a vector, scores hold `block` accumulators beside a key vector and a broadcast; weighted values twice that beside
// two value vectors. AVX-512 (32 registers) takes the whole tile in both; AVX2 and SSE (16) take 8 and 4.
typedef void (*AttendFn)(const Problem*, const Scratch*, int64_t, int64_t, int, int);

__attribute__((noinline)) static void attend_baseline(const Problem* p, const Scratch* w, int64_t start, int64_t len,
                                                      int head, int kv_head) {
    attend_tiles_4(p, w, start, len, head, kv_head, 4, 4);
}

#if BOUQUET_X86
AVX2_TARGET static void attend_avx2(const Problem* p, const Scratch* w, int64_t start, int64_t len, int head,
                                    int kv_head) {
    attend_tiles_8(p, w, start, len, head, kv_head, 4, 4);
}

AVX512_TARGET static void attend_avx512(const Problem* p, const Scratch* w, int64_t start, int64_t len, int head,
                                        int kv_head) {
    attend_tiles_16(p, w, start, len, head, kv_head, 8, 8);
}
#endif

// The widest ISA at most `isa` (0 baseline, 2 AVX2, 4 AVX-512) that this CPU has.
int bouquet_attention_isa(int32_t isa) {
#if BOUQUET_X86
    __builtin_cpu_init();  // idempotent; needed before __builtin_cpu_supports outside the main program
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                     __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (isa >= 4 && avx512) return 4;
    if (isa >= 2 && avx2) return 2;
#endif
    (void)isa;
    return 0;
}

static AttendFn attend_for(int32_t isa) {
#if BOUQUET_X86
    switch (bouquet_attention_isa(isa)) {
        case 4: return attend_avx512;
        case 2: return attend_avx2;
    }
#endif
    (void)isa;
    return attend_baseline;
}

#if BOUQUET_X86
// bfloat16 inputs on CPUs with AVX512-BF16: QK^T and PV as bfloat16 dot products (vdpbf16ps: two products a
// lane, summed in float32), twice the multiply-adds an instruction of the float32 path. Operands are kept as
// pairs of bfloat16 in 32-bit words: K^T as [D/2][Lp] words (keys d, d+1 of one token), V as [Lp/2][D] words
// (tokens j, j+1 of one column), queries as they are. The probabilities are rounded to bfloat16 for PV, as
// ATen's bfloat16 attention does; the softmax and every sum stay float32.
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma"), noinline))
typedef uint32_t v16u __attribute__((vector_size(64), aligned(64)));
typedef uint32_t v16u_u __attribute__((vector_size(64), aligned(4)));

// acc[r] = sum over i < n of a[r * a_stride + i] (a pair, broadcast) dotted with b[i * b_stride ..] (16 pairs):
// both QK^T (i over head_dim pairs) and PV (i over key pairs).
__attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma"))) static inline void
pair_dots(__m512* acc, const uint32_t* a, int64_t a_stride, const uint32_t* b, int64_t b_stride, int64_t n) {
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
        const __m512bh pairs = (__m512bh)_mm512_load_si512(b + i * b_stride);
        for (int r = 0; r < ROWS; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)a[r * a_stride + i]), pairs);
    }
}

BF16_TARGET static void pack_kv_pairs(const Problem* p, const Scratch* w, int64_t start, int64_t len, int64_t lp,
                                      int kv_head) {
    const int d_count = p->head_dim, words = d_count / 2;
    uint32_t* kt = (uint32_t*)w->kt;  // [D/2][Lp]
    uint32_t* vv = (uint32_t*)w->vv;  // [Lp/2][D]
    uint32_t* block = (uint32_t*)w->block;  // [LANES][D/2]
    for (int64_t jb = 0; jb < lp; jb += LANES) {
        for (int jj = 0; jj < LANES; jj++) {
            const int64_t j = jb + jj;
            const uint32_t* key = (const uint32_t*)((const uint16_t*)p->k + (start + j) * p->k_stride) +
                                  (int64_t)kv_head * words;
            for (int c = 0; c < words; c += LANES)
                *(v16u*)(block + jj * words + c) = j < len ? *(const v16u_u*)(key + c) : (v16u){};
        }
        for (int d = 0; d < words; d++)
            for (int jj = 0; jj < LANES; jj++) kt[d * lp + jb + jj] = block[jj * words + d];
    }
    for (int64_t j = 0; j < lp; j += 2) {
        const uint16_t* even = (const uint16_t*)p->v + (start + j) * p->v_stride + (int64_t)kv_head * d_count;
        const uint16_t* odd = even + p->v_stride;
        for (int c = 0; c < d_count; c += LANES) {
            v16u lo = {}, hi = {};
            if (j < len) lo = __builtin_convertvector(*(const v16h_u*)(even + c), v16u);
            if (j + 1 < len) hi = __builtin_convertvector(*(const v16h_u*)(odd + c), v16u);
            *(v16u*)(vv + (j / 2) * d_count + c) = lo | (hi << 16);
        }
    }
}

BF16_TARGET static void attend_pairs(const Problem* p, const Scratch* w, int64_t start, int64_t len, int head,
                                     int kv_head) {
    const int d_count = p->head_dim, words = d_count / 2;
    const int64_t lp = round_up(len, LANES);
    const uint32_t* kt = (const uint32_t*)w->kt;
    const uint32_t* vv = (const uint32_t*)w->vv;
    uint32_t* qt = (uint32_t*)w->qt;  // [ROWS][D/2]
    const uint32_t* pb = (const uint32_t*)w->pb;  // [ROWS][Lp/2]
    pack_kv_pairs(p, w, start, len, lp, kv_head);
    for (int64_t i0 = 0; i0 < len; i0 += ROWS) {
        const int rows = len - i0 < ROWS ? (int)(len - i0) : ROWS;
        for (int r = 0; r < ROWS; r++) {
            const uint32_t* query = (const uint32_t*)((const uint16_t*)p->q + (start + i0 + r) * p->q_stride) +
                                    (int64_t)head * words;
            for (int c = 0; c < words; c += LANES)
                *(v16u*)(qt + r * words + c) = r < rows ? *(const v16u_u*)(query + c) : (v16u){};
        }
        int64_t first, lo[ROWS], hi[ROWS];
        const int64_t keys = tile_keys_16(p, i0, rows, len, &first, lo, hi);
        const int64_t keys_p = round_up(keys, LANES);
        for (int64_t jb = first; jb < keys_p; jb += LANES) {
            __m512 acc[ROWS];
            pair_dots(acc, qt, words, kt + jb, lp, words);  // scores of keys jb.. for each row
            for (int r = 0; r < ROWS; r++) _mm512_store_ps(w->s + r * lp + jb, acc[r] * p->scale);
        }
        float inv[ROWS];
        softmax_16(w, lp, first, keys_p, lo, hi, inv);
        for (int r = 0; r < ROWS; r++)
            for (int64_t j = first; j < keys_p; j += LANES)
                _mm256_store_si256((__m256i*)(w->pb + r * lp + j), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(w->s + r * lp + j)));
        const int64_t pair0 = first / 2, pairs = (keys + 1) / 2 - pair0;
        for (int c = 0; c < d_count; c += LANES) {
            __m512 acc[ROWS];
            pair_dots(acc, pb + pair0, lp / 2, vv + pair0 * d_count + c, d_count, pairs);  // columns c.. of each row
            for (int r = 0; r < rows; r++)
                store_row_16(p, (start + i0 + r) * p->out_stride + (int64_t)head * d_count + c, (v16f)acc[r] * inv[r]);
        }
    }
}
#endif  // BOUQUET_X86

// Whether bfloat16 inputs can take the dot-product path here (the CPU has AVX512-BF16).
int bouquet_has_bf16_dot(void) {
#if BOUQUET_X86
    __builtin_cpu_init();  // idempotent; needed before __builtin_cpu_supports outside the main program
    return __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

int bouquet_varlen_attention(const void* q, const void* k, const void* v, void* out, const int32_t* cu_seqlens,
                              int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                              int64_t q_stride, int64_t k_stride, int64_t v_stride, int64_t out_stride,
                              float scale, int32_t causal, int32_t bf16, int32_t bf16_dot, int64_t window_left,
                              int64_t window_right, int32_t isa) {
    const Problem problem = {q,          k,     v,      out,  q_stride,    k_stride,    v_stride,
                             out_stride, head_dim, scale, causal, bf16, window_left, window_right};
    int64_t max_len = 0;
    for (int32_t i = 0; i < num_seqs; i++) {
        const int64_t len = cu_seqlens[i + 1] - cu_seqlens[i];
        max_len = len > max_len ? len : max_len;
    }
    const int64_t lp = round_up(max_len, LANES);
    const int64_t items = (int64_t)num_seqs * num_heads;
    const int group = num_heads / num_kv_heads;
    // The pairs path moves keys and queries 32 bfloat16 (one vector of 32-bit words) at a time, so their rows
    // must start on 4-byte boundaries.
    const int word_aligned = !(((uintptr_t)q | (uintptr_t)k) & 3) && !((q_stride | k_stride) & 1);
    const int pairs = bf16 && bf16_dot && head_dim % 32 == 0 && word_aligned && bouquet_has_bf16_dot() &&
                      bouquet_attention_isa(isa) == 4;
    (void)pairs;  // the generic build has only the widened path
    const AttendFn attend = attend_for(isa);
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        Scratch w;
        w.kt = aligned_alloc(64, round_up(head_dim * lp * 4, 64));
        w.vv = aligned_alloc(64, round_up(lp * head_dim * 4, 64));
        w.qt = aligned_alloc(64, round_up(ROWS * head_dim * 4, 64));
        w.s = aligned_alloc(64, round_up(ROWS * lp * 4, 64));
        w.block = aligned_alloc(64, round_up(LANES * head_dim * 4, 64));
        w.pb = aligned_alloc(64, round_up(ROWS * lp * 2, 64));
        failed = !w.kt || !w.vv || !w.qt || !w.s || !w.block || !w.pb;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (failed) continue;  // every thread must still reach the loop's barrier
            const int32_t seq = (int32_t)(item / num_heads), head = (int32_t)(item % num_heads);
            const int64_t start = cu_seqlens[seq], len = cu_seqlens[seq + 1] - start;
            if (len <= 0) continue;
#if BOUQUET_X86
            if (pairs) {
                attend_pairs(&problem, &w, start, len, head, head / group);
                continue;
            }
#endif
            attend(&problem, &w, start, len, head, head / group);
        }
        free(w.kt);
        free(w.vv);
        free(w.qt);
        free(w.s);
        free(w.block);
        free(w.pb);
    }
    return failed;  // 1: out of memory, the output is incomplete
}

// The calling thread's OpenMP team size as this library's runtime sees it: the loader checks that it follows
// torch's per-thread setting, i.e. that this library and torch share one runtime.
int bouquet_omp_max_threads(void) { return omp_get_max_threads(); }
