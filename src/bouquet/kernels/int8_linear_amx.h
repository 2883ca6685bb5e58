// int8 x int8 -> int32 matrix products on AMX tiles (Intel Sapphire Rapids and later): the int8 linears' product
// where layers/int8_products.py measures it fastest (layers/amx_product.py). Included by int8_linear.c, whose
// quantizing and dequantizing passes run with it in one call (bouquet_amx_linear there).
//
// Why a kernel of our own: at a query's few rows `torch._int_mm` (oneDNN's GEMM) and oneDNN's prepacked matmul
// spend most of a call outside the arithmetic (MiniLM's 24 linears at 16 rows: 2.2 and 1.9 ms, one thread, where
// the tiles need ~0.1 ms and the weights stream from cache in ~0.5), and at a step's 1,024 rows oneDNN's matmul
// runs a third slower than this loop (docs/benchmarks.md, "int8 products on AMX tiles"). TDPBSSD multiplies a
// 16 x 64 tile of activation codes by a 64 x 16 block of weight codes into 16 x 16 int32 sums: exact, signed
// times signed, so the weights may use the full [-127, 127].
//
// The weight is packed once at load (bouquet_amx_pack) into blocks of 16 output channels x 64 inputs, 1 KB each,
// in the order the tiles read them: block (nb, kb) holds in its row r, for each channel of the block, the four
// inputs 64 kb + 4 r .. + 3. A call then multiplies row blocks of 16 by channel blocks: two row blocks by two
// channel blocks at a time where there are 32 rows or more (each tile loaded meets two others), one row block by
// four channel blocks otherwise. Output channels are split between the OpenMP team's threads; each thread
// configures its own tiles (tile state is per thread).
//
// Requirements the caller checks: in_features a multiple of 64, out_features a multiple of 16.
// No include guard: included once, by int8_linear.c, after its own includes.
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) || __GNUC__ >= 11)
#define BOUQUET_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_TARGET __attribute__((target("amx-tile,amx-int8")))
#else
#define BOUQUET_AMX 0
#endif

enum { BLOCK_ROWS = 16, BLOCK_CHANNELS = 16, BLOCK_INPUTS = 64, BLOCK_BYTES = 1024 };
// Below this many multiply-adds a call runs on the calling thread alone: waking a team costs more than it saves.
enum { PARALLEL_WORK = 1 << 22 };

// Whether CPUID.(7,0):EDX has every bit of `edx_bits` and the kernel lets this process use the tiles' state (Linux
// asks each process to request it once; oneDNN makes the same request when it uses AMX).
static int amx_permitted(unsigned edx_bits) {
#if BOUQUET_AMX
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || (d & edx_bits) != edx_bits) return 0;
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    (void)edx_bits;
    return 0;
#endif
}

// Whether this CPU has AMX-TILE (EDX bit 24) and AMX-INT8 (bit 25) and this process may use the tiles.
int bouquet_amx_available(void) { return amx_permitted((1u << 24) | (1u << 25)); }

// weight: [n, k] int8, row-major -> packed: n * k bytes in the tiles' block order (above).
void bouquet_amx_pack(const int8_t* weight, int64_t n, int64_t k, int8_t* packed) {
    const int64_t input_blocks = k / BLOCK_INPUTS;
    for (int64_t nb = 0; nb < n / BLOCK_CHANNELS; nb++)
        for (int64_t kb = 0; kb < input_blocks; kb++) {
            int8_t* block = packed + (nb * input_blocks + kb) * BLOCK_BYTES;
            for (int r = 0; r < BLOCK_INPUTS / 4; r++)
                for (int channel = 0; channel < BLOCK_CHANNELS; channel++)
                    memcpy(block + r * 64 + channel * 4,
                           weight + (nb * BLOCK_CHANNELS + channel) * k + kb * BLOCK_INPUTS + r * 4, 4);
        }
}

#if BOUQUET_AMX
typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

// Tiles 0-3 the sums, 4-5 activations (`rows` rows each), 6-7 weight blocks (16 rows of 64 bytes).
AMX_TARGET static void configure_tiles(int rows) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int tile = 0; tile < 8; tile++) {
        config.rows[tile] = tile < 6 ? rows : BLOCK_INPUTS / 4;
        config.bytes_per_row[tile] = 64;
    }
    _tile_loadconfig(&config);
}

// Rows [0, 32 * row_pairs) times channel blocks [nb0, nb1) (an even count), two by two. Row pairs outside:
// a pair's activations (32 rows of k bytes) stay in L1 while the channels' weights stream past them.
AMX_TARGET static void row_pairs_by_channel_pairs(const int8_t* a, int64_t lda, int64_t k, int64_t row_pairs,
                                                  const int8_t* packed, int32_t* c, int64_t ldc, int64_t nb0,
                                                  int64_t nb1) {
    const int64_t kbs = k / BLOCK_INPUTS;
    for (int64_t pair = 0; pair < row_pairs; pair++) {
        const int8_t* top = a + pair * 2 * BLOCK_ROWS * lda;
        const int8_t* bottom = top + BLOCK_ROWS * lda;
        for (int64_t nb = nb0; nb < nb1; nb += 2) {
            const int8_t* left = packed + nb * kbs * BLOCK_BYTES;
            const int8_t* right = left + kbs * BLOCK_BYTES;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < kbs; kb++) {
                _tile_loadd(4, top + kb * BLOCK_INPUTS, lda);
                _tile_loadd(5, bottom + kb * BLOCK_INPUTS, lda);
                _tile_loadd(6, left + kb * BLOCK_BYTES, 64);
                _tile_loadd(7, right + kb * BLOCK_BYTES, 64);
                _tile_dpbssd(0, 4, 6);
                _tile_dpbssd(1, 4, 7);
                _tile_dpbssd(2, 5, 6);
                _tile_dpbssd(3, 5, 7);
            }
            int32_t* out = c + pair * 2 * BLOCK_ROWS * ldc + nb * BLOCK_CHANNELS;
            _tile_stored(0, out, ldc * 4);
            _tile_stored(1, out + BLOCK_CHANNELS, ldc * 4);
            _tile_stored(2, out + BLOCK_ROWS * ldc, ldc * 4);
            _tile_stored(3, out + BLOCK_ROWS * ldc + BLOCK_CHANNELS, ldc * 4);
        }
    }
}

// One block of up to 16 rows (the tiles' configured rows) times channel blocks [nb0, nb1), four at a time, then
// one at a time.
AMX_TARGET static void row_block_by_channels(const int8_t* a, int64_t lda, int64_t k, const int8_t* packed,
                                             int32_t* c, int64_t ldc, int64_t nb0, int64_t nb1) {
    const int64_t kbs = k / BLOCK_INPUTS;
    int64_t nb = nb0;
    for (; nb + 4 <= nb1; nb += 4) {
        const int8_t* weights = packed + nb * kbs * BLOCK_BYTES;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < kbs; kb++) {
            _tile_loadd(4, a + kb * BLOCK_INPUTS, lda);
            _tile_loadd(6, weights + kb * BLOCK_BYTES, 64);
            _tile_dpbssd(0, 4, 6);
            _tile_loadd(7, weights + (kbs + kb) * BLOCK_BYTES, 64);
            _tile_dpbssd(1, 4, 7);
            _tile_loadd(6, weights + (2 * kbs + kb) * BLOCK_BYTES, 64);
            _tile_dpbssd(2, 4, 6);
            _tile_loadd(7, weights + (3 * kbs + kb) * BLOCK_BYTES, 64);
            _tile_dpbssd(3, 4, 7);
        }
        _tile_stored(0, c + nb * BLOCK_CHANNELS, ldc * 4);
        _tile_stored(1, c + (nb + 1) * BLOCK_CHANNELS, ldc * 4);
        _tile_stored(2, c + (nb + 2) * BLOCK_CHANNELS, ldc * 4);
        _tile_stored(3, c + (nb + 3) * BLOCK_CHANNELS, ldc * 4);
    }
    for (; nb < nb1; nb++) {
        const int8_t* weights = packed + nb * kbs * BLOCK_BYTES;
        _tile_zero(0);
        for (int64_t kb = 0; kb < kbs; kb++) {
            _tile_loadd(4, a + kb * BLOCK_INPUTS, lda);
            _tile_loadd(6, weights + kb * BLOCK_BYTES, 64);
            _tile_dpbssd(0, 4, 6);
        }
        _tile_stored(0, c + nb * BLOCK_CHANNELS, ldc * 4);
    }
}

// This thread's share: every row against channel blocks [nb0, nb1).
AMX_TARGET static void rows_by_channels(const int8_t* a, int64_t m, int64_t k, int64_t lda, const int8_t* packed,
                                        int32_t* c, int64_t ldc, int64_t nb0, int64_t nb1) {
    int64_t m0 = 0;
    const int64_t paired_end = nb0 + (nb1 - nb0) / 2 * 2;
    int configured = 0;
    if (m >= 2 * BLOCK_ROWS && paired_end > nb0) {
        configure_tiles(BLOCK_ROWS);
        configured = BLOCK_ROWS;
        m0 = m / (2 * BLOCK_ROWS) * 2 * BLOCK_ROWS;
        row_pairs_by_channel_pairs(a, lda, k, m0 / (2 * BLOCK_ROWS), packed, c, ldc, nb0, paired_end);
        for (int64_t r0 = 0; r0 < m0 && paired_end < nb1; r0 += BLOCK_ROWS)  // an odd channel block left
            row_block_by_channels(a + r0 * lda, lda, k, packed, c + r0 * ldc, ldc, paired_end, nb1);
    }
    for (; m0 < m; m0 += BLOCK_ROWS) {
        const int rows = m - m0 < BLOCK_ROWS ? (int)(m - m0) : BLOCK_ROWS;
        if (rows != configured) {
            configure_tiles(rows);
            configured = rows;
        }
        row_block_by_channels(a + m0 * lda, lda, k, packed, c + m0 * ldc, ldc, nb0, nb1);
    }
    _tile_release();
}
#endif  // BOUQUET_AMX

// Thread `me` of a team of `team`: its share of c [m, n] int32 (rows ldc elements apart) = a [m, k] int8 (rows lda
// bytes apart) times the packed [n, k] weight. Threads take runs of whole groups of four channel blocks, so that a
// thread's blocks pair up.
static void amx_product_share(const int8_t* a, int64_t m, int64_t k, int64_t lda, const int8_t* packed, int64_t n,
                              int32_t* c, int64_t ldc, int team, int me) {
#if BOUQUET_AMX
    const int64_t channel_blocks = n / BLOCK_CHANNELS, groups = (channel_blocks + 3) / 4;
    const int64_t nb0 = groups * me / team * 4, end = groups * (me + 1) / team * 4;
    const int64_t nb1 = end < channel_blocks ? end : channel_blocks;
    if (nb0 < nb1) rows_by_channels(a, m, k, lda, packed, c, ldc, nb0, nb1);
#else
    (void)a, (void)m, (void)k, (void)lda, (void)packed, (void)n, (void)c, (void)ldc, (void)team, (void)me;
#endif
}

// The product alone (what start-up measures it by, and what tests check): 1 where this build has no AMX.
int bouquet_amx_product(const int8_t* a, int64_t m, int64_t k, int64_t lda, const int8_t* packed, int64_t n,
                        int32_t* c, int64_t ldc) {
#pragma omp parallel if (BOUQUET_AMX && m * n * k >= PARALLEL_WORK)
    amx_product_share(a, m, k, lda, packed, n, c, ldc, omp_get_num_threads(), omp_get_thread_num());
    return !BOUQUET_AMX;
}
