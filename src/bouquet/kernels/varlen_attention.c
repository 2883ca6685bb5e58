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
// x86-64 gets per-CPU clones and the AVX512-BF16 path; elsewhere (or with -DBOUQUET_GENERIC, to test that
// build here) the same vector code is compiled for the baseline only.
#if defined(__x86_64__) && !defined(BOUQUET_GENERIC)
#define BOUQUET_X86 1
#else
#define BOUQUET_X86 0
#endif
#if BOUQUET_X86
#include <immintrin.h>
// The hot loops compiled for AVX-512 and AVX2 besides the baseline, picked at load time (an ifunc).
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), noinline))
#else
#define VECTOR_CLONES __attribute__((noinline))
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64), aligned(64)));
typedef float v16f_u __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(64)));

#define INLINE static inline __attribute__((always_inline))
enum { ROWS = 8, LANES = 16 };

INLINE int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

INLINE uint16_t f32_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  // NaN stays NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest, ties to even
    return (uint16_t)(bits >> 16);
}

INLINE v16f vmax(v16f a, v16f b) {
    const v16i a_wins = a > b;
    return (v16f)(((v16i)a & a_wins) | ((v16i)b & ~a_wins));
}

typedef uint16_t v16h_u __attribute__((vector_size(32), aligned(2)));

// 16 consecutive values from `base` (float32, or bfloat16 widened: its bits are a float32's upper half).
INLINE v16f load16(const void* base, int64_t index, int bf16) {
    if (!bf16) return *(const v16f_u*)((const float*)base + index);
    const v16h_u half = *(const v16h_u*)((const uint16_t*)base + index);
    return (v16f)(__builtin_convertvector(half, v16i) << 16);
}

// exp(x) for x <= 0 (scores less their row's maximum): 2^n * p(r), Cephes' polynomial; x < -87 gives 0.
INLINE v16f exp_nonpositive(v16f x) {
    v16i dead = x < -87.0f;
    x = (v16f)((v16i)x & ~dead);
    v16i n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, v16i);  // ceil: |x log2(e) - n| <= 1/2
    v16f nf = __builtin_convertvector(n, v16f);
    v16f r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v16f p = (v16f){} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    v16f scale = (v16f)((n + 127) << 23);
    return (v16f)((v16i)(p * scale) & ~dead);
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
    float* block;             // LANES tokens' keys [LANES][D], on their way into K^T
    uint16_t* pb;             // bfloat16 path: the tile's probabilities [ROWS][Lp] in bfloat16
} Scratch;

// K^T and V in float32 for one (sequence, kv head). K goes through LANES tokens at a time: rows copied into
// `block`, then written out transposed. Writing K^T straight from K's rows, each value to a different cache
// line 4 * Lp bytes apart, made this pack a fifth of the kernel's time (those lines contend for few L1 sets).
INLINE void pack_kv(const Problem* p, const Scratch* w, int64_t start, int64_t len, int64_t lp, int kv_head) {
    const int d_count = p->head_dim;
    for (int64_t jb = 0; jb < lp; jb += LANES) {
        for (int jj = 0; jj < LANES; jj++) {
            const int64_t j = jb + jj, token = start + j;
            for (int c = 0; c < d_count; c += LANES) {
                v16f key = {}, value = {};  // zeros past the sequence's end pad K^T to Lp
                if (j < len) {
                    key = load16(p->k, token * p->k_stride + (int64_t)kv_head * d_count + c, p->bf16);
                    value = load16(p->v, token * p->v_stride + (int64_t)kv_head * d_count + c, p->bf16);
                }
                *(v16f*)(w->block + jj * d_count + c) = key;
                *(v16f*)(w->vv + j * d_count + c) = value;
            }
        }
        for (int d = 0; d < d_count; d++)
            for (int jj = 0; jj < LANES; jj++) w->kt[d * lp + jb + jj] = w->block[jj * d_count + d];
    }
}

INLINE void scores(const Problem* p, const Scratch* w, int64_t lp, int64_t first, int64_t keys_p) {
    const int d_count = p->head_dim;
    for (int64_t jb = first; jb < keys_p; jb += LANES) {
        v16f acc[ROWS] = {};
        for (int d = 0; d < d_count; d++) {
            const v16f kv = *(const v16f*)(w->kt + d * lp + jb);
            for (int r = 0; r < ROWS; r++) acc[r] += w->qt[r * d_count + d] * kv;
        }
        for (int r = 0; r < ROWS; r++) *(v16f*)(w->s + r * lp + jb) = acc[r];
    }
}

// Row r keeps keys [lo[r], hi[r]); the rest of [first, keys_p) become 0. Returns 1 / sum per row in inv.
INLINE void softmax(const Scratch* w, int64_t lp, int64_t first, int64_t keys_p, const int64_t* lo,
                    const int64_t* hi, float* inv) {
    for (int r = 0; r < ROWS; r++) {
        float* row = w->s + r * lp;
        for (int64_t j = first; j < lo[r]; j++) row[j] = -INFINITY;
        for (int64_t j = hi[r]; j < keys_p; j++) row[j] = -INFINITY;
        v16f top = (v16f){} - INFINITY;
        for (int64_t j = first; j < keys_p; j += LANES) {
            v16f x = *(v16f*)(row + j);
            top = vmax(x, top);
        }
        float m = top[0];
        for (int l = 1; l < LANES; l++) m = top[l] > m ? top[l] : m;
        v16f total = {};
        for (int64_t j = first; j < keys_p; j += LANES) {
            v16f e = exp_nonpositive(*(v16f*)(row + j) - m);
            *(v16f*)(row + j) = e;
            total += e;
        }
        float sum = 0.0f;
        for (int l = 0; l < LANES; l++) sum += total[l];
        inv[r] = 1.0f / sum;
    }
}

INLINE void store_row(const Problem* p, int64_t index, v16f value) {
    if (p->bf16) {
        uint16_t* dst = (uint16_t*)p->out + index;
        for (int l = 0; l < LANES; l++) dst[l] = f32_to_bf16(value[l]);
    } else {
        *(v16f_u*)((float*)p->out + index) = value;
    }
}

// out rows of the tile = P V / sum, in column blocks of 32 (two vectors) and a last block of 16.
INLINE void weighted_values(const Problem* p, const Scratch* w, int64_t lp, int64_t first, int64_t keys, int rows,
                            int64_t out_first, int head, const float* inv) {
    const int d_count = p->head_dim;
    int c = 0;
    for (; c + 2 * LANES <= d_count; c += 2 * LANES) {
        v16f lo[ROWS] = {}, hi[ROWS] = {};
        for (int64_t j = first; j < keys; j++) {
            const v16f v0 = *(const v16f*)(w->vv + j * d_count + c);
            const v16f v1 = *(const v16f*)(w->vv + j * d_count + c + LANES);
            for (int r = 0; r < ROWS; r++) {
                const float pr = w->s[r * lp + j];
                lo[r] += pr * v0;
                hi[r] += pr * v1;
            }
        }
        for (int r = 0; r < rows; r++) {
            const int64_t base = (out_first + r) * p->out_stride + (int64_t)head * d_count + c;
            store_row(p, base, lo[r] * inv[r]);
            store_row(p, base + LANES, hi[r] * inv[r]);
        }
    }
    for (; c < d_count; c += LANES) {
        v16f acc[ROWS] = {};
        for (int64_t j = first; j < keys; j++) {
            const v16f v0 = *(const v16f*)(w->vv + j * d_count + c);
            for (int r = 0; r < ROWS; r++) acc[r] += w->s[r * lp + j] * v0;
        }
        for (int r = 0; r < rows; r++)
            store_row(p, (out_first + r) * p->out_stride + (int64_t)head * d_count + c, acc[r] * inv[r]);
    }
}

// The keys a tile of `rows` queries from i0 sees: [*first, returned end), *first a multiple of LANES, so a
// sliding window costs window-sized work. Row r keeps [lo[r], hi[r]): up to itself when causal, within the
// window around it. Padding rows past `rows` take the last row's range; their output is never written.
INLINE int64_t tile_keys(const Problem* p, int64_t i0, int rows, int64_t len, int64_t* first, int64_t* lo,
                         int64_t* hi) {
    const int64_t left = p->window_left, right = p->causal ? 0 : p->window_right;
    for (int r = 0; r < ROWS; r++) {
        const int64_t i = i0 + (r < rows ? r : rows - 1);
        lo[r] = left >= 0 && i > left ? i - left : 0;
        hi[r] = right >= 0 && i + right + 1 < len ? i + right + 1 : len;
    }
    *first = lo[0] / LANES * LANES;
    return hi[ROWS - 1];
}

VECTOR_CLONES static void attend(const Problem* p, const Scratch* w, int64_t start, int64_t len, int head, int kv_head) {
    const int d_count = p->head_dim;
    const int64_t lp = round_up(len, LANES);
    pack_kv(p, w, start, len, lp, kv_head);
    for (int64_t i0 = 0; i0 < len; i0 += ROWS) {
        const int rows = len - i0 < ROWS ? (int)(len - i0) : ROWS;
        for (int r = 0; r < ROWS; r++) {
            const int64_t qrow = (start + i0 + r) * p->q_stride + (int64_t)head * d_count;
            for (int c = 0; c < d_count; c += LANES)
                *(v16f*)(w->qt + r * d_count + c) = r < rows ? load16(p->q, qrow + c, p->bf16) * p->scale : (v16f){};
        }
        int64_t first, lo[ROWS], hi[ROWS];
        const int64_t keys = tile_keys(p, i0, rows, len, &first, lo, hi);
        const int64_t keys_p = round_up(keys, LANES);
        float inv[ROWS];
        scores(p, w, lp, first, keys_p);
        softmax(w, lp, first, keys_p, lo, hi, inv);
        weighted_values(p, w, lp, first, keys, rows, start + i0, head, inv);
    }
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
        const int64_t keys = tile_keys(p, i0, rows, len, &first, lo, hi);
        const int64_t keys_p = round_up(keys, LANES);
        for (int64_t jb = first; jb < keys_p; jb += LANES) {
            __m512 acc[ROWS];
            pair_dots(acc, qt, words, kt + jb, lp, words);  // scores of keys jb.. for each row
            for (int r = 0; r < ROWS; r++) _mm512_store_ps(w->s + r * lp + jb, acc[r] * p->scale);
        }
        float inv[ROWS];
        softmax(w, lp, first, keys_p, lo, hi, inv);
        for (int r = 0; r < ROWS; r++)
            for (int64_t j = first; j < keys_p; j += LANES)
                _mm256_store_si256((__m256i*)(w->pb + r * lp + j), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(w->s + r * lp + j)));
        const int64_t pair0 = first / 2, pairs = (keys + 1) / 2 - pair0;
        for (int c = 0; c < d_count; c += LANES) {
            __m512 acc[ROWS];
            pair_dots(acc, pb + pair0, lp / 2, vv + pair0 * d_count + c, d_count, pairs);  // columns c.. of each row
            for (int r = 0; r < rows; r++)
                store_row(p, (start + i0 + r) * p->out_stride + (int64_t)head * d_count + c, (v16f)acc[r] * inv[r]);
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
                              int64_t window_right) {
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
    const int pairs = bf16 && bf16_dot && head_dim % 32 == 0 && word_aligned && bouquet_has_bf16_dot();
    (void)pairs;  // the generic build has only the widened path
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
