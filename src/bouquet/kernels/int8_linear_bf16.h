// bfloat16 linears on AMX tiles (AMX-BF16): out = act(x W^T + b) for bfloat16 x and W, sums in float32, out in
// bfloat16 (layers/bf16_amx.py, where the engine measures it faster than oneDNN's bfloat16 linear). Included by
// int8_linear.c after int8_linear_amx.h, whose AMX set-up and block sizes it shares, as it shares the file's
// activations: the same GELU as int8's dequantizing pass, applied to the float32 sum before rounding.
//
// The weight is packed once at load (bouquet_amx_bf16_pack) into blocks of 16 output channels x 32 inputs, 1 KB
// each, in the order TDPBF16PS reads them: block (nb, kb) holds in its row r, for each channel of the block, the
// two inputs 32 kb + 2 r and + 1. A call multiplies row blocks of 16 by up to four channel blocks at a time (four
// float32 accumulator tiles; each loaded row tile meets four weight tiles); output channels are split between
// the OpenMP team's threads, each configuring its own tiles.
//
// Requirements the caller checks: in_features a multiple of 32, out_features a multiple of 16, x's rows contiguous.
// No include guard: included once, by int8_linear.c.

enum { BF16_BLOCK_INPUTS = 32, BF16_BLOCK_VALUES = 512 };

// Whether this CPU has AMX-BF16 (EDX bit 22) and AMX-TILE (bit 24) and this process may use the tiles.
int bouquet_amx_bf16_available(void) { return amx_permitted((1u << 22) | (1u << 24)); }

// weight: [n, k] bfloat16 bits, row-major -> packed: n * k values in the tiles' block order (above).
void bouquet_amx_bf16_pack(const uint16_t* weight, int64_t n, int64_t k, uint16_t* packed) {
    const int64_t input_blocks = k / BF16_BLOCK_INPUTS;
    for (int64_t nb = 0; nb < n / BLOCK_CHANNELS; nb++)
        for (int64_t kb = 0; kb < input_blocks; kb++) {
            uint16_t* block = packed + (nb * input_blocks + kb) * BF16_BLOCK_VALUES;
            for (int r = 0; r < BF16_BLOCK_INPUTS / 2; r++)
                for (int channel = 0; channel < BLOCK_CHANNELS; channel++)
                    for (int i = 0; i < 2; i++)
                        block[r * 32 + channel * 2 + i] = weight[(nb * BLOCK_CHANNELS + channel) * k + kb * 32 + r * 2 + i];
        }
}

#if BOUQUET_AMX
#define AMX_BF16_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t columns_bytes[16];
    uint8_t rows[16];
} Bf16TileConfig;

// Tiles 0-3: float32 sums, `rows` x 16; tile 4: `rows` x 32 inputs; tiles 6, 7: 16 x 32 weight pairs.
AMX_BF16_TARGET static void bf16_configure(int rows) {
    Bf16TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = t < 5 ? rows : 16;
        config.columns_bytes[t] = 64;
    }
    _tile_loadconfig(&config);
}

// A tile row block's float32 sums ([rows][64], the first 16 x `blocks` of each row used): plus the bias, through
// the activation, rounded to bfloat16 into out (rows ldo apart), or copied as float32 into out_f32. One loop per
// activation over the whole block, so that each vectorizes with its activation inlined.
AMX_BF16_TARGET static void bf16_finish(float* sums, int rows, int blocks, const float* bias, int activation,
                                        uint16_t* out, float* out_f32, int64_t ldo) {
    const int width = 16 * blocks, count = rows * 64;
    if (bias)
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < blocks; j++)
                _mm512_store_ps(sums + r * 64 + j * 16,
                                _mm512_add_ps(_mm512_load_ps(sums + r * 64 + j * 16), _mm512_loadu_ps(bias + j * 16)));
    switch (activation) {
        case ACT_GELU:
            for (int i = 0; i < count; i++) sums[i] = activate(sums[i], ACT_GELU);
            break;
        case ACT_GELU_TANH:
            for (int i = 0; i < count; i++) sums[i] = activate(sums[i], ACT_GELU_TANH);
            break;
        case ACT_RELU:
            for (int i = 0; i < count; i++) sums[i] = activate(sums[i], ACT_RELU);
            break;
        default:
            break;
    }
    for (int r = 0; r < rows; r++) {
        if (out_f32) {  // the fused add and LayerNorm's input (bouquet_amx_bf16_linear_add_norm)
            memcpy(out_f32 + r * ldo, sums + r * 64, sizeof(float) * width);
            continue;
        }
        for (int j = 0; j < blocks; j++)
            _mm256_storeu_si256((__m256i*)(out + r * ldo + j * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sums + r * 64 + j * 16)));
    }
}

// Channel blocks [nb0, nb1) of rows [m_begin, m), one row block by up to four channel blocks at a time.
AMX_BF16_TARGET static void bf16_share(const uint16_t* x, int64_t m_begin, int64_t m, int64_t k, int64_t ldx,
                                       const uint16_t* packed, int64_t nb0, int64_t nb1, const float* bias,
                                       int activation, uint16_t* out, float* out_f32, int64_t ldo) {
    const int64_t input_blocks = k / BF16_BLOCK_INPUTS;
    float sums[16 * 64] __attribute__((aligned(64)));
    int configured = 0;
    // Channel groups outside, row blocks inside: a group's weights (4 x 16 channels x k, 48 KB at k = 384) stay in
    // cache while every row block meets them, where rows outside streamed the whole weight once per row block.
    for (int64_t nb = nb0; nb < nb1; nb += 4) {
        const int blocks = nb1 - nb < 4 ? (int)(nb1 - nb) : 4;
        const uint16_t* w = packed + nb * input_blocks * BF16_BLOCK_VALUES;
        const int64_t stride = input_blocks * BF16_BLOCK_VALUES;  // from one channel block to the next
        for (int64_t m0 = m_begin; m0 < m; m0 += BLOCK_ROWS) {
            const int rows = m - m0 < BLOCK_ROWS ? (int)(m - m0) : BLOCK_ROWS;
            if (rows != configured) {
                bf16_configure(rows);
                configured = rows;
            }
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < input_blocks; kb++) {
                _tile_loadd(4, x + m0 * ldx + kb * BF16_BLOCK_INPUTS, ldx * 2);
                const uint16_t* block = w + kb * BF16_BLOCK_VALUES;
                _tile_loadd(6, block, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (blocks > 1) {
                    _tile_loadd(7, block + stride, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (blocks > 2) {
                    _tile_loadd(6, block + 2 * stride, 64);
                    _tile_dpbf16ps(2, 4, 6);
                }
                if (blocks > 3) {
                    _tile_loadd(7, block + 3 * stride, 64);
                    _tile_dpbf16ps(3, 4, 7);
                }
            }
            _tile_stored(0, sums, 256);
            _tile_stored(1, sums + 16, 256);
            _tile_stored(2, sums + 32, 256);
            _tile_stored(3, sums + 48, 256);
            const int64_t at = m0 * ldo + nb * BLOCK_CHANNELS;
            bf16_finish(sums, rows, blocks, bias ? bias + nb * BLOCK_CHANNELS : NULL, activation, out ? out + at : NULL,
                        out_f32 ? out_f32 + at : NULL, ldo);
        }
    }
    _tile_release();
}

// Channel blocks [nb0, nb1) (an even count) of rows [0, m) (a multiple of 32), two row blocks by two channel blocks at
// a time: four tiles loaded a step for four products, where one row block by four channel blocks loads five.
AMX_BF16_TARGET static void bf16_pairs(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint16_t* packed,
                                       int64_t nb0, int64_t nb1, const float* bias, int activation, uint16_t* out,
                                       float* out_f32, int64_t ldo) {
    const int64_t input_blocks = k / BF16_BLOCK_INPUTS, stride = input_blocks * BF16_BLOCK_VALUES;
    float sums[16 * 64] __attribute__((aligned(64)));
    bf16_configure(BLOCK_ROWS);
    for (int64_t nb = nb0; nb < nb1; nb += 2) {
        const uint16_t* w = packed + nb * stride;
        const float* pair_bias = bias ? bias + nb * BLOCK_CHANNELS : NULL;
        for (int64_t m0 = 0; m0 < m; m0 += 2 * BLOCK_ROWS) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < input_blocks; kb++) {
                _tile_loadd(4, x + m0 * ldx + kb * BF16_BLOCK_INPUTS, ldx * 2);
                _tile_loadd(5, x + (m0 + BLOCK_ROWS) * ldx + kb * BF16_BLOCK_INPUTS, ldx * 2);
                _tile_loadd(6, w + kb * BF16_BLOCK_VALUES, 64);
                _tile_loadd(7, w + stride + kb * BF16_BLOCK_VALUES, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            for (int half = 0; half < 2; half++) {
                if (half == 0) {
                    _tile_stored(0, sums, 256);
                    _tile_stored(1, sums + 16, 256);
                } else {
                    _tile_stored(2, sums, 256);
                    _tile_stored(3, sums + 16, 256);
                }
                const int64_t at = (m0 + half * BLOCK_ROWS) * ldo + nb * BLOCK_CHANNELS;
                bf16_finish(sums, BLOCK_ROWS, 2, pair_bias, activation, out ? out + at : NULL,
                            out_f32 ? out_f32 + at : NULL, ldo);
            }
        }
    }
    _tile_release();
}
#endif

#if BOUQUET_AMX
// This thread's share of the channels, all rows: bfloat16 into out, or float32 into out_f32 where it is given.
AMX_BF16_TARGET static void bf16_product_share(const uint16_t* x, int64_t m, int64_t k, int64_t ldx,
                                               const uint16_t* packed, int64_t n, const float* bias, int activation,
                                               uint16_t* out, float* out_f32, int64_t ldo) {
    const int64_t groups = (n / BLOCK_CHANNELS + 3) / 4;
    const int team = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t nb0 = groups * me / team * 4, nb1_group = groups * (me + 1) / team * 4;
    const int64_t nb1 = nb1_group < n / BLOCK_CHANNELS ? nb1_group : n / BLOCK_CHANNELS;
    const int64_t paired_rows = m / (2 * BLOCK_ROWS) * (2 * BLOCK_ROWS), paired_end = nb0 + (nb1 - nb0) / 2 * 2;
    if (nb0 < nb1 && paired_rows) {
        bf16_pairs(x, paired_rows, k, ldx, packed, nb0, paired_end, bias, activation, out, out_f32, ldo);
        if (paired_end < nb1)
            bf16_share(x, 0, paired_rows, k, ldx, packed, paired_end, nb1, bias, activation, out, out_f32, ldo);
    }
    if (nb0 < nb1 && paired_rows < m)
        bf16_share(x, paired_rows, m, k, ldx, packed, nb0, nb1, bias, activation, out, out_f32, ldo);
}

// One row, in place: LayerNorm(v + residual) * gamma + beta, all float32.
AMX_BF16_TARGET static void bf16_add_norm_row(float* v, const float* residual, int64_t n, const float* gamma,
                                              const float* beta, float eps) {
    float mean = 0.0f, square = 0.0f;
    for (int64_t c = 0; c < n; c++) {
        v[c] += residual[c];
        mean += v[c];
    }
    mean /= (float)n;
    for (int64_t c = 0; c < n; c++) square += (v[c] - mean) * (v[c] - mean);
    const float scale = 1.0f / sqrtf(square / (float)n + eps);
    for (int64_t c = 0; c < n; c++) v[c] = (v[c] - mean) * scale * gamma[c] + beta[c];
}

// Rows of float32 x as bfloat16 (nearest even) into `rows`, k values a row: the tiles read bfloat16 from memory.
// Inside the caller's parallel region; its end is the team's barrier.
AMX_BF16_TARGET static void bf16_rows_from_f32(const float* x, int64_t m, int64_t k, int64_t ldx, uint16_t* rows) {
#pragma omp for
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < k; c += 16)  // k is a multiple of 32 (the caller's requirement)
            _mm256_storeu_si256((__m256i*)(rows + r * k + c), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + r * ldx + c)));
}
#endif

// out [m, n] bfloat16 (row stride ldo) = act(x [m, k] W^T + bias); x bfloat16, or float32 where x_f32 (then
// converted into `converted`, [m, k] bfloat16 of the caller's), rows ldx apart; bias float32 or NULL. Returns
// non-zero where this build has no AMX.
int bouquet_amx_bf16_linear(const void* x, int x_f32, int64_t m, int64_t k, int64_t ldx, const uint16_t* packed,
                            int64_t n, const float* bias, int activation, uint16_t* out, int64_t ldo,
                            uint16_t* converted) {
#if BOUQUET_AMX
#pragma omp parallel if (m * n * k >= PARALLEL_WORK)
    {
        if (x_f32) bf16_rows_from_f32((const float*)x, m, k, ldx, converted);
        const uint16_t* rows = x_f32 ? converted : (const uint16_t*)x;
        bf16_product_share(rows, m, k, x_f32 ? k : ldx, packed, n, bias, activation, out, NULL, ldo);
    }
    return 0;
#else
    (void)x, (void)x_f32, (void)m, (void)k, (void)ldx, (void)packed, (void)n, (void)bias, (void)activation;
    (void)out, (void)ldo, (void)converted;
    return 1;
#endif
}

// out [m, n] float32 = LayerNorm(residual + x W^T + bias) with gamma, beta and eps: a post-norm block's end in one
// call, its float32 residual stream never rounded. x as in bouquet_amx_bf16_linear; residual float32, rows ldr
// apart; out contiguous.
int bouquet_amx_bf16_linear_add_norm(const void* x, int x_f32, int64_t m, int64_t k, int64_t ldx,
                                     const uint16_t* packed, int64_t n, const float* bias, const float* residual,
                                     int64_t ldr, const float* gamma, const float* beta, float eps, float* out,
                                     uint16_t* converted) {
#if BOUQUET_AMX
#pragma omp parallel if (m * n * k >= PARALLEL_WORK)
    {
        if (x_f32) bf16_rows_from_f32((const float*)x, m, k, ldx, converted);
        const uint16_t* rows = x_f32 ? converted : (const uint16_t*)x;
        bf16_product_share(rows, m, k, x_f32 ? k : ldx, packed, n, bias, ACT_NONE, NULL, out, n);
#pragma omp barrier
#pragma omp for
        for (int64_t r = 0; r < m; r++) bf16_add_norm_row(out + r * n, residual + r * ldr, n, gamma, beta, eps);
    }
    return 0;
#else
    (void)x, (void)x_f32, (void)m, (void)k, (void)ldx, (void)packed, (void)n, (void)bias, (void)residual, (void)ldr;
    (void)gamma, (void)beta, (void)eps, (void)out, (void)converted;
    return 1;
#endif
}
