// The vector code of varlen_attention.c for one vector width, included once per width: VL float32 lanes a
// vector (16 for AVX-512, 8 for AVX2, 4 for SSE and other baselines), each name suffixed by V(). Written with
// GCC vector extensions, so each width compiles to its own registers: a vector wider than the target's (16
// lanes on AVX2) has no machine mode, lives in memory and makes every operation a load and a store.
// No include guard: the includer defines VL and V before each inclusion and undefines them after.

// The AVX-512 instance's helpers carry the AVX-512 target themselves, so that they may use its intrinsics and still
// inline into both of their callers (attend_avx512 and the bfloat16 path's attend_pairs).
#if VL == 16 && BOUQUET_X86
#define TILE_INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#else
#define TILE_INLINE INLINE
#endif
#define VF V(vf)
#define VF_U V(vf_u)
#define VI V(vi)
#define VH_U V(vh_u)
typedef float VF __attribute__((vector_size(VL * 4), aligned(VL * 4)));
typedef float VF_U __attribute__((vector_size(VL * 4), aligned(4)));
typedef int32_t VI __attribute__((vector_size(VL * 4), aligned(VL * 4)));
typedef uint16_t VH_U __attribute__((vector_size(VL * 2), aligned(2)));

TILE_INLINE VF V(vmax)(VF a, VF b) {
    const VI a_wins = a > b;
    return (VF)(((VI)a & a_wins) | ((VI)b & ~a_wins));
}

// VL consecutive values from `base` (float32, or bfloat16 widened: its bits are a float32's upper half).
TILE_INLINE VF V(load_lanes)(const void* base, int64_t index, int bf16) {
    if (!bf16) return *(const VF_U*)((const float*)base + index);
    const VH_U half = *(const VH_U*)((const uint16_t*)base + index);
    return (VF)(__builtin_convertvector(half, VI) << 16);
}

// exp(x) for x <= 0 (scores less their row's maximum): e^r * 2^n with x = r + n ln 2, |r| <= ln 2 / 2, and a
// degree-6 polynomial for e^r (fitted to relative error 1.1e-7, float32's rounding). x is first raised to -87: below
// it e^x is a denormal, whose multiply-adds in P V would each take a microcode assist; 1.6e-38 in place of a
// smaller weight (or of a masked key's 0) changes no sum.
#if VL == 16 && BOUQUET_X86
TILE_INLINE VF V(exp_nonpositive)(VF x) {
    const __m512 t = _mm512_max_ps((__m512)x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), t);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.3836835325e-03f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3748157450e-03f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1668225760e-02f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666420171e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.9999992079e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0000000363e+00f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0000000006e+00f));
    return (VF)_mm512_scalef_ps(p, n);  // p * 2^n, without building 2^n's bits
}
#else
TILE_INLINE VF V(exp_nonpositive)(VF x) {
    x = V(vmax)(x, (VF){} - 87.0f);
    const VI n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, VI);  // |x log2(e) - n| <= 1/2
    const VF nf = __builtin_convertvector(n, VF);
    const VF r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    VF p = (VF){} + 1.3836835325e-03f;
    p = p * r + 8.3748157450e-03f;
    p = p * r + 4.1668225760e-02f;
    p = p * r + 1.6666420171e-01f;
    p = p * r + 4.9999992079e-01f;
    p = p * r + 1.0000000363e+00f;
    p = p * r + 1.0000000006e+00f;
    return p * (VF)((n + 127) << 23);
}
#endif

// The largest and the sum of a vector's lanes.
#if VL == 16 && BOUQUET_X86
TILE_INLINE float V(lanes_max)(VF v) {
    return _mm512_reduce_max_ps((__m512)v);
}
TILE_INLINE float V(lanes_sum)(VF v) {
    return _mm512_reduce_add_ps((__m512)v);
}
#else
TILE_INLINE float V(lanes_max)(VF v) {
    float m = v[0];
    for (int l = 1; l < VL; l++) m = v[l] > m ? v[l] : m;
    return m;
}
TILE_INLINE float V(lanes_sum)(VF v) {
    float sum = 0.0f;
    for (int l = 0; l < VL; l++) sum += v[l];
    return sum;
}
#endif

// K^T and V in float32 for one (sequence, kv head). K goes through VL tokens at a time: rows copied into
// `block`, then written out transposed. Writing K^T straight from K's rows, each value to a different cache
// line 4 * Lp bytes apart, made this pack a fifth of the kernel's time (those lines contend for few L1 sets).
TILE_INLINE void V(pack_kv)(const Problem* p, const Scratch* w, int64_t start, int64_t len, int64_t lp, int kv_head) {
    const int d_count = p->head_dim;
    for (int64_t jb = 0; jb < lp; jb += VL) {
        for (int jj = 0; jj < VL; jj++) {
            const int64_t j = jb + jj, token = start + j;
            for (int c = 0; c < d_count; c += VL) {
                VF key = {}, value = {};  // zeros past the sequence's end pad K^T to Lp
                if (j < len) {
                    key = V(load_lanes)(p->k, token * p->k_stride + (int64_t)kv_head * d_count + c, p->bf16);
                    value = V(load_lanes)(p->v, token * p->v_stride + (int64_t)kv_head * d_count + c, p->bf16);
                }
                *(VF*)(w->block + jj * d_count + c) = key;
                *(VF*)(w->vv + j * d_count + c) = value;
            }
        }
        for (int d = 0; d < d_count; d++)
            for (int jj = 0; jj < VL; jj++) w->kt[d * lp + jb + jj] = w->block[jj * d_count + d];
    }
}

// Register blocking: a tile's rows go through the products `block` rows at a time, so that the accumulators stay
// in registers (AVX-512 has 32 vector registers, AVX2 and SSE 16; spilled accumulators cost a load and a store
// each multiply-add). `block` is a constant wherever this is inlined. Each query value, broadcast from memory,
// meets two vectors of keys: the loads per multiply-add fall from 9/8 to 10/16, and loads, not multiply-adds,
// bounded this loop (2 x block accumulators: AVX2 and SSE take 4 rows at a time).
TILE_INLINE void V(scores)(const Scratch* w, int d_count, int64_t lp, int64_t first, int64_t keys_p, const int block) {
    int64_t jb = first;
    for (; jb + 2 * VL <= keys_p; jb += 2 * VL) {  // two key vectors a row: fewer loads per multiply-add
        for (int r0 = 0; r0 < ROWS; r0 += block) {
            VF lo[ROWS] = {}, hi[ROWS] = {};
            for (int d = 0; d < d_count; d++) {
                const VF k0 = *(const VF*)(w->kt + d * lp + jb);
                const VF k1 = *(const VF*)(w->kt + d * lp + jb + VL);
                for (int r = 0; r < block; r++) {
                    const float q = w->qt[(r0 + r) * d_count + d];
                    lo[r] += q * k0;
                    hi[r] += q * k1;
                }
            }
            for (int r = 0; r < block; r++) {
                *(VF*)(w->s + (r0 + r) * lp + jb) = lo[r];
                *(VF*)(w->s + (r0 + r) * lp + jb + VL) = hi[r];
            }
        }
    }
    for (; jb < keys_p; jb += VL) {
        for (int r0 = 0; r0 < ROWS; r0 += block) {
            VF acc[ROWS] = {};
            for (int d = 0; d < d_count; d++) {
                const VF kv = *(const VF*)(w->kt + d * lp + jb);
                for (int r = 0; r < block; r++) acc[r] += w->qt[(r0 + r) * d_count + d] * kv;
            }
            for (int r = 0; r < block; r++) *(VF*)(w->s + (r0 + r) * lp + jb) = acc[r];
        }
    }
}

// Row r keeps keys [lo[r], hi[r]); the rest of [first, keys_p) get weight e^-87 (see exp_nonpositive), nothing
// beside a sum of at least 1. Returns 1 / sum per row in inv.
TILE_INLINE void V(softmax)(const Scratch* w, int64_t lp, int64_t first, int64_t keys_p, const int64_t* lo,
                    const int64_t* hi, float* inv) {
    for (int r = 0; r < ROWS; r++) {
        float* row = w->s + r * lp;
        for (int64_t j = first; j < lo[r]; j++) row[j] = -INFINITY;
        for (int64_t j = hi[r]; j < keys_p; j++) row[j] = -INFINITY;
        VF top = (VF){} - INFINITY;
        for (int64_t j = first; j < keys_p; j += VL) {
            VF x = *(VF*)(row + j);
            top = V(vmax)(x, top);
        }
        const float m = V(lanes_max)(top);
        VF total = {};
        for (int64_t j = first; j < keys_p; j += VL) {
            VF e = V(exp_nonpositive)(*(VF*)(row + j) - m);
            *(VF*)(row + j) = e;
            total += e;
        }
        inv[r] = 1.0f / V(lanes_sum)(total);
    }
}

TILE_INLINE void V(store_row)(const Problem* p, int64_t index, VF value) {
    if (p->bf16) {
        uint16_t* dst = (uint16_t*)p->out + index;
        for (int l = 0; l < VL; l++) dst[l] = f32_to_bf16(value[l]);
    } else {
        *(VF_U*)((float*)p->out + index) = value;
    }
}

// out rows of the tile = P V / sum, in column blocks of two vectors and a last one of one vector, `block` rows
// at a time (see `scores`).
TILE_INLINE void V(weighted_values)(const Problem* p, const Scratch* w, int64_t lp, int64_t first, int64_t keys, int rows,
                            int64_t out_first, int head, const float* inv, const int block) {
    const int d_count = p->head_dim;
    for (int r0 = 0; r0 < rows; r0 += block) {
        int c = 0;
        for (; c + 2 * VL <= d_count; c += 2 * VL) {
            VF lo[ROWS] = {}, hi[ROWS] = {};
            for (int64_t j = first; j < keys; j++) {
                const VF v0 = *(const VF*)(w->vv + j * d_count + c);
                const VF v1 = *(const VF*)(w->vv + j * d_count + c + VL);
                for (int r = 0; r < block; r++) {
                    const float pr = w->s[(r0 + r) * lp + j];
                    lo[r] += pr * v0;
                    hi[r] += pr * v1;
                }
            }
            for (int r = 0; r < block && r0 + r < rows; r++) {
                const int64_t base = (out_first + r0 + r) * p->out_stride + (int64_t)head * d_count + c;
                V(store_row)(p, base, lo[r] * inv[r0 + r]);
                V(store_row)(p, base + VL, hi[r] * inv[r0 + r]);
            }
        }
        for (; c < d_count; c += VL) {
            VF acc[ROWS] = {};
            for (int64_t j = first; j < keys; j++) {
                const VF v0 = *(const VF*)(w->vv + j * d_count + c);
                for (int r = 0; r < block; r++) acc[r] += w->s[(r0 + r) * lp + j] * v0;
            }
            for (int r = 0; r < block && r0 + r < rows; r++)
                V(store_row)(p, (out_first + r0 + r) * p->out_stride + (int64_t)head * d_count + c, acc[r] * inv[r0 + r]);
        }
    }
}

// The keys a tile of `rows` queries from i0 sees: [*first, returned end), *first a multiple of VL, so a
// sliding window costs window-sized work. Row r keeps [lo[r], hi[r]): up to itself when causal, within the
// window around it. Padding rows past `rows` take the last row's range; their output is never written.
TILE_INLINE int64_t V(tile_keys)(const Problem* p, int64_t i0, int rows, int64_t len, int64_t* first, int64_t* lo,
                         int64_t* hi) {
    const int64_t left = p->window_left, right = p->causal ? 0 : p->window_right;
    for (int r = 0; r < ROWS; r++) {
        const int64_t i = i0 + (r < rows ? r : rows - 1);
        lo[r] = left >= 0 && i > left ? i - left : 0;
        hi[r] = right >= 0 && i + right + 1 < len ? i + right + 1 : len;
    }
    *first = lo[0] / VL * VL;
    return hi[ROWS - 1];
}

TILE_INLINE void V(attend_tiles)(const Problem* p, const Scratch* w, int64_t start, int64_t len, int head, int kv_head,
                         const int score_block, const int value_block) {
    const int d_count = p->head_dim;
    const int64_t lp = round_up(len, VL);
    V(pack_kv)(p, w, start, len, lp, kv_head);
    for (int64_t i0 = 0; i0 < len; i0 += ROWS) {
        const int rows = len - i0 < ROWS ? (int)(len - i0) : ROWS;
        for (int r = 0; r < ROWS; r++) {
            const int64_t qrow = (start + i0 + r) * p->q_stride + (int64_t)head * d_count;
            for (int c = 0; c < d_count; c += VL)
                *(VF*)(w->qt + r * d_count + c) = r < rows ? V(load_lanes)(p->q, qrow + c, p->bf16) * p->scale : (VF){};
        }
        int64_t first, lo[ROWS], hi[ROWS];
        const int64_t keys = V(tile_keys)(p, i0, rows, len, &first, lo, hi);
        const int64_t keys_p = round_up(keys, VL);
        float inv[ROWS];
        V(scores)(w, p->head_dim, lp, first, keys_p, score_block);
        V(softmax)(w, lp, first, keys_p, lo, hi, inv);
        V(weighted_values)(p, w, lp, first, keys, rows, start + i0, head, inv, value_block);
    }
}

#undef VF
#undef VF_U
#undef VI
#undef VH_U
#undef TILE_INLINE
