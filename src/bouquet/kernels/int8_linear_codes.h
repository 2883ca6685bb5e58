// The quantizing pass's codes (int8_linear.c's quantize_row), in AVX-512: each value times the row's inverse scale,
// rounded to the nearest integer (ties to even, as rintf), plus the zero point, clamped to [-128, 127], as int8, and
// the row's codes summed on the way (what the VNNI product's shifted weights need, int8_linear_vnni.h), the codes
// bit for bit the plain C's. GCC's vector code for that loop clamped after narrowing, byte blends under a dozen mask
// operations a vector (most of the pass's time); here it is seven vector operations, and the sum one more.
// No include guard: included once, by int8_linear.c, after PASSES_AVX512 and group_lanes.

#if PASSES_AVX512
// x: [cols] float32 -> q: [cols] int8; returns the codes' sum. min and max in this operand order are the plain C's
// max_of and min_of exactly, NaN included (to -128).
AVX512_TARGET static int32_t quantize_codes(const float* x, int64_t cols, float inverse, float offset, int8_t* q) {
    const __m512 scale = _mm512_set1_ps(inverse), zero = _mm512_set1_ps(offset);
    const __m512 low = _mm512_set1_ps(-128.0f), high = _mm512_set1_ps(127.0f);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t c = 0; c < cols; c += 16) {
        const __mmask16 lanes = group_lanes(c, cols);
        const __m512 scaled = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, x + c), scale);
        const __m512 shifted = _mm512_add_ps(_mm512_roundscale_ps(scaled, _MM_FROUND_CUR_DIRECTION), zero);
        const __m512i codes = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(shifted, low), high));
        sum = _mm512_mask_add_epi32(sum, lanes, sum, codes);
        _mm512_mask_cvtepi32_storeu_epi8(q + c, lanes, codes);
    }
    return _mm512_reduce_add_epi32(sum);
}
#else
static int32_t quantize_codes(const float* x, int64_t cols, float inverse, float offset, int8_t* q) {
    (void)x, (void)cols, (void)inverse, (void)offset, (void)q;
    return 0;
}
#endif
