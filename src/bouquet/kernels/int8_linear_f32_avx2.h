// The float32 short-step kernel's AVX2 tiles (int8_linear_f32.h has the layout, the driver and the AVX-512 tiles), for
// CPUs with AVX2 and FMA but no AVX-512, chosen by the caller's packing (blocks of 16 channels: two ymm). Sixteen
// vector registers: a tile keeps at most 12 accumulators (6 rows x 2 ymm, the tallest; 1 row x 8 ymm and 2-3 rows
// x 4 ymm, the wide ones) beside its weight vectors and one broadcast. No mask registers: the last, partial vector
// of n goes through maskload and maskstore, every full one through plain loads and stores.
// No include guard: included once, by int8_linear_f32.h.

#if BOUQUET_F32
// The first `valid` lanes (0 to 8) of a vector, as maskload's and maskstore's mask.
F32_AVX2_TARGET INLINE __m256i f32_avx2_mask(int64_t valid) {
    const int lanes = valid >= 8 ? 8 : valid <= 0 ? 0 : (int)valid;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

F32_AVX2_TARGET INLINE __m256 f32_avx2_load(const float* p, int64_t valid) {
    return valid >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, f32_avx2_mask(valid));
}

F32_AVX2_TARGET INLINE void f32_avx2_store(float* p, int64_t valid, __m256 v) {
    if (valid >= 8)
        _mm256_storeu_ps(p, v);
    else
        _mm256_maskstore_ps(p, f32_avx2_mask(valid), v);
}

// The AVX2 tile (F32Tile's contract); mr and nb are constants where this is inlined, so the accumulators live in
// registers.
F32_AVX2_TARGET INLINE void f32_avx2_tile(const float* x, int64_t ldx, int64_t k, const float* w, int64_t block_floats,
                                          int64_t first_block, int64_t n, const float* bias, int accumulate,
                                          float* out, int64_t ldo, const int mr, const int nb) {
    const int64_t first = first_block * F32_AVX2_BLOCK;
    out += first;
    __m256 acc[F32_AVX2_MAX_ROWS][8];
    for (int j = 0; j < 2 * nb; j++) {
        const int64_t valid = n - first - 8 * j;
        __m256 start = bias ? f32_avx2_load(bias + first + 8 * j, valid) : _mm256_setzero_ps();
        for (int m = 0; m < mr; m++) acc[m][j] = accumulate ? f32_avx2_load(out + m * ldo + 8 * j, valid) : start;
    }
    for (int64_t i = 0; i < k; i++) {
        __m256 wv[8];
        for (int b = 0; b < nb; b++) {
            const float* wi = w + b * block_floats + i * F32_AVX2_BLOCK;
            _mm_prefetch((const char*)(wi + F32_AVX2_PREFETCH * F32_AVX2_BLOCK), _MM_HINT_T0);
            wv[2 * b] = _mm256_loadu_ps(wi);
            wv[2 * b + 1] = _mm256_loadu_ps(wi + 8);
        }
        for (int m = 0; m < mr; m++) {
            // set1, not broadcast_ss: the latter's pointer argument kept GCC storing every accumulator each input.
            __m256 xv = _mm256_set1_ps(x[m * ldx + i]);
            for (int j = 0; j < 2 * nb; j++) acc[m][j] = _mm256_fmadd_ps(xv, wv[j], acc[m][j]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < 2 * nb; j++) f32_avx2_store(out + m * ldo + 8 * j, n - first - 8 * j, acc[m][j]);
}

#define F32_AVX2_TILE(MR, NB)                                                                                      \
    F32_AVX2_TARGET static void f32_avx2_tile_##MR##_##NB(const float* x, int64_t ldx, int64_t k, const float* w,  \
                                                          int64_t block_floats, int64_t first_block, int64_t n,    \
                                                          const float* bias, int accumulate, float* out,           \
                                                          int64_t ldo) {                                           \
        f32_avx2_tile(x, ldx, k, w, block_floats, first_block, n, bias, accumulate, out, ldo, MR, NB);             \
    }
F32_AVX2_TILE(1, 1) F32_AVX2_TILE(2, 1) F32_AVX2_TILE(3, 1) F32_AVX2_TILE(4, 1) F32_AVX2_TILE(5, 1)
F32_AVX2_TILE(6, 1) F32_AVX2_TILE(1, 4) F32_AVX2_TILE(2, 2) F32_AVX2_TILE(3, 2)
static const F32Tile F32_AVX2_NARROW[F32_AVX2_MAX_ROWS + 1] = {
    0, f32_avx2_tile_1_1, f32_avx2_tile_2_1, f32_avx2_tile_3_1, f32_avx2_tile_4_1, f32_avx2_tile_5_1,
    f32_avx2_tile_6_1};
static const F32Tile F32_AVX2_WIDE[F32_AVX2_MAX_ROWS + 1] = {0, f32_avx2_tile_1_4, f32_avx2_tile_2_2,
                                                             f32_avx2_tile_3_2};
static const int F32_AVX2_WIDE_BLOCKS[F32_AVX2_MAX_ROWS + 1] = {0, 4, 2, 2};

F32_AVX2_TARGET static void f32_activate_avx2(float* out, int64_t rows, int64_t ldo, int64_t first, int64_t width,
                                              int activation) {
    f32_activate_rows(out, rows, ldo, first, width, activation);
}
F32_AVX2_TARGET static void f32_add_norm_avx2(float* out, int64_t cols, const float* residual, const float* gamma,
                                              const float* beta, float eps) {
    add_norm_row(out, cols, residual, gamma, beta, eps);
}
static const F32Kernel F32_AVX2 = {F32_AVX2_BLOCK,       F32_AVX2_MAX_ROWS, F32_AVX2_NARROW, F32_AVX2_WIDE,
                                   F32_AVX2_WIDE_BLOCKS, f32_activate_avx2, f32_add_norm_avx2};
#endif  // BOUQUET_F32
