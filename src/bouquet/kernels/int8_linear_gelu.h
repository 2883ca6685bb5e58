// GELU for the int8 linears' dequantizing pass (int8_linear.c's dequantize_row), in AVX-512, where the erf of
// `activate` (Abramowitz-Stegun with a division and an exp, ~40 vector operations) was most of the pass's time:
// GELU(x) = x Phi(x), Phi the normal CDF, by a table of polynomials: [-GELU_EDGE, GELU_EDGE] in 30 equal pieces,
// each a degree-4 polynomial in its own t in [0, 1), the coefficients of all 32 lanes (below, the pieces, above)
// held in two registers each and picked per element by one `vpermt2ps`: 17 vector operations an element group.
// Below the range Phi is 0 and above it 1, so GELU there is 0 x x and x exactly. The table is fitted by
// bench/gelu_table.py (near-minimax, weighted by |x|); against float64's GELU its error is under 5e-7 on a dense grid
// of float32 values (float32's own rounding of x at |x| ~ 4 is 2.4e-7; tests/test_int8.py). NaN stays NaN; +inf
// gives inf, -inf NaN.
//
// Only the int8 pass takes it: the float32 and bfloat16 kernels keep `activate`'s erf, and so do CPUs without AVX512F
// (int8_linear.c's PASSES_AVX512 and avx512_available).
// No include guard: included once, by int8_linear.c, after `activate` and PASSES_AVX512.

enum { GELU_DEGREE = 4, GELU_PIECES = 30 };
#define GELU_EDGE 5.4f

// C = 5.4, 30 pieces, degree 4: the fit's GELU error <= 1.08e-07 (float64)
static const float GELU_TABLE[GELU_DEGREE + 1][32] __attribute__((aligned(64))) = {
    {
        0.0f, 3.33478809e-08f, 2.32886194e-07f, 1.43482191e-06f, 7.802857e-06f, 3.74784904e-05f, 0.000159116084f,
        0.000597660313f, 0.00198838767f, 0.00586774247f, 0.0153863085f, 0.0359302647f, 0.0749336407f, 0.140071064f,
        0.235762537f, 0.359423667f, 0.500000119f, 0.640576482f, 0.764237463f, 0.859928846f, 0.925066233f, 0.964069664f,
        0.984613657f, 0.99413228f, 0.998011649f, 0.999402344f, 0.999840915f, 0.999962509f, 0.999992192f, 0.999998569f,
        0.999999762f, 1.0f,
    },
    {
        0.0f, 6.55444694e-08f, 4.32026724e-07f, 2.49685149e-06f, 1.26583964e-05f, 5.63148642e-05f, 0.000219910959f,
        0.00075395382f, 0.00226981146f, 0.00600117259f, 0.0139357578f, 0.0284248814f, 0.0509288274f, 0.0801568776f,
        0.110824324f, 0.134602502f, 0.143613786f, 0.134605423f, 0.110827923f, 0.0801591054f, 0.0509289429f,
        0.0284236278f, 0.0139345163f, 0.00600058865f, 0.00226976699f, 0.000754132983f, 0.000220084054f, 5.64155052e-05f,
        1.27020385e-05f, 2.51194206e-06f, 4.363188e-07f, 0.0f,
    },
    {
        0.0f, 7.50597309e-08f, 4.41880275e-07f, 2.28994941e-06f, 1.04293877e-05f, 4.16663861e-05f, 0.000145702026f,
        0.000444827892f, 0.00118199887f, 0.00272288662f, 0.00540767331f, 0.00918595586f, 0.0131729906f, 0.0155682042f,
        0.0143789053f, 0.00876449421f, 4.39658288e-05f, -0.00870228279f, -0.0143737895f, -0.0156115843f, -0.0132263973f,
        -0.0092215836f, -0.00541840028f, -0.0027171555f, -0.00117177668f, -0.000436689268f, -0.000141106357f,
        -3.96280957e-05f, -9.68969744e-06f, -2.06563368e-06f, -3.84317673e-07f, 0.0f,
    },
    {
        0.0f, 1.44829251e-08f, 1.13652632e-07f, 6.92122967e-07f, 3.43252941e-06f, 1.41431101e-05f, 4.88264704e-05f,
        0.000141524899f, 0.000343341875f, 0.000690561312f, 0.0011299171f, 0.00143851968f, 0.00125856628f,
        0.000330915296f, -0.00119229732f, -0.00264539965f, -0.00322690676f, -0.00259211776f, -0.0011271917f,
        0.000367162691f, 0.00125510781f, 0.00141268945f, 0.00110644766f, 0.000680095865f, 0.000343107647f,
        0.000145165031f, 5.21502043e-05f, 1.60332766e-05f, 4.24104246e-06f, 9.6884969e-07f, 1.91689068e-07f, 0.0f,
    },
    {
        0.0f, 4.43015189e-08f, 2.13799254e-07f, 8.87229874e-07f, 3.15018679e-06f, 9.50177309e-06f, 2.40846402e-05f,
        5.03956908e-05f, 8.41884903e-05f, 0.000103971586f, 7.0693095e-05f, -4.58529576e-05f, -0.000222850897f,
        -0.000364526757f, -0.000349955109f, -0.000145376762f, 0.000145376762f, 0.000349955109f, 0.000364526757f,
        0.000222850897f, 4.58529576e-05f, -7.0693095e-05f, -0.000103971586f, -8.41884903e-05f, -5.03956908e-05f,
        -2.40846402e-05f, -9.501774e-06f, -3.15018679e-06f, -8.87229874e-07f, -2.13799268e-07f, -4.43015509e-08f, 0.0f,
    },
};

#if PASSES_AVX512
// GELU of 16 values: u = x scaled so that the pieces are [1, 31), clamped into [0, 32) (NaN to 0, whose lane is 0);
// its integer part picks each coefficient's lane, its fraction is t.
AVX512_TARGET INLINE __m512 gelu16(__m512 x) {
    const __m512 u = _mm512_min_ps(_mm512_max_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(GELU_PIECES / (2 * GELU_EDGE)),
                                                                 _mm512_set1_ps(1 + GELU_PIECES / 2)),
                                                 _mm512_setzero_ps()),
                                   _mm512_set1_ps(31.999998f));
    const __m512i lane = _mm512_cvttps_epi32(u);
    const __m512 t = _mm512_sub_ps(u, _mm512_roundscale_ps(u, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
    __m512 phi = _mm512_permutex2var_ps(_mm512_load_ps(GELU_TABLE[GELU_DEGREE]), lane,
                                        _mm512_load_ps(GELU_TABLE[GELU_DEGREE] + 16));
    for (int j = GELU_DEGREE - 1; j >= 0; j--) {
        const __m512 coefficient =
            _mm512_permutex2var_ps(_mm512_load_ps(GELU_TABLE[j]), lane, _mm512_load_ps(GELU_TABLE[j] + 16));
        phi = _mm512_fmadd_ps(phi, t, coefficient);
    }
    return _mm512_mul_ps(x, phi);
}

// dequantize_row_with's row (`float_products` or int32 products, in place) with GELU, 16 channels at a time, the
// last group masked.
AVX512_TARGET static void dequantize_gelu_row(void* data, int64_t cols, float row_scale, int32_t row_zero,
                                              const float* col_scales, const int32_t* col_sums, const float* bias,
                                              int float_products) {
    const __m512 scale = _mm512_set1_ps(row_scale);
    const __m512i zero = _mm512_set1_epi32(row_zero);
    float* out = (float*)data;
    for (int64_t c = 0; c < cols; c += 16) {
        const __mmask16 lanes = group_lanes(c, cols);
        const __m512i offset = _mm512_mullo_epi32(zero, _mm512_maskz_loadu_epi32(lanes, col_sums + c));
        const __m512 product =
            float_products ? _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, out + c), _mm512_cvtepi32_ps(offset))
                           : _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_maskz_loadu_epi32(lanes, out + c), offset));
        const __m512 x = _mm512_fmadd_ps(product, _mm512_mul_ps(scale, _mm512_maskz_loadu_ps(lanes, col_scales + c)),
                                         _mm512_maskz_loadu_ps(lanes, bias + c));
        _mm512_mask_storeu_ps(out + c, lanes, gelu16(x));
    }
}
#else
static void dequantize_gelu_row(void* data, int64_t cols, float row_scale, int32_t row_zero, const float* col_scales,
                                const int32_t* col_sums, const float* bias, int float_products) {
    (void)data, (void)cols, (void)row_scale, (void)row_zero, (void)col_scales, (void)col_sums, (void)bias;
    (void)float_products;
}
#endif
