// int8 x int8 -> int32 products by AVX-512 VNNI (`vpdpbusd`): the int8 linears' product where
// layers/int8_products.py measures it fastest (layers/vnni_product.py), on CPUs with AVX512-VNNI.
// Included by int8_linear.c, whose quantizing and dequantizing passes run with it in one call (bouquet_vnni_linear).
//
// vpdpbusd multiplies unsigned by signed bytes, four adjacent inputs summed into each of 16 int32 lanes, exactly (no
// saturation). The weight takes the unsigned side: packed once at load as w + 128 (1 to 255 for |w| <= 127), so the
// activation codes, signed, are read as they are and each row's four-byte groups are broadcast from memory. The
// shift adds 128 x (the row's codes summed) to every sum of the row, which the tile starts from the negative of:
// the kernel's int32 sums are q @ w, the same integers as the other products.
//
// The weight is packed (bouquet_vnni_pack) into column blocks of 32 output channels (two zmm), each block its input
// groups in order, 32 channels x 4 inputs (128 bytes) a group: [ceil(n / 32)][ceil(k / 4)][32][4], zero past n and
// past k (a row's last, partial group is read from a zero-padded copy of its codes). A tile of MR rows by NB
// blocks keeps MR x 2 NB accumulators in registers: each input group loads 2 NB weight vectors and broadcasts each
// row's four codes once. Wide tiles (NB 2 or 4) at one to six rows, row blocks of up to 14, input slices where
// several row blocks share a weight block, weights prefetched ahead and output channels split between threads by
// column group: layers/f32_short.py's kernel (int8_linear_f32.h), in bytes. From 64 rows (documents) threads split
// the rows instead, in chunks whose epilogue runs while they are in cache (VNNI_SPLIT_ROWS, below).
//
// Requirements the caller checks: each row of codes contiguous; any k and n.
// No include guard: included once, by int8_linear.c, after int8_linear_f32.h.

#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 11)
#define BOUQUET_VNNI 1
#define VNNI_TARGET __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512vnni")))
#else
#define BOUQUET_VNNI 0
#define VNNI_TARGET
#endif

// VNNI_PREFETCH: input groups ahead a tile asks for its weights (4 KB a block), for the reason int8_linear_f32.h's
// tiles do. VNNI_SLICE: input groups per slice where several row blocks share a weight block (16 KB: L1 holds it).
enum { VNNI_BLOCK = 32, VNNI_GROUP = 4, VNNI_GROUP_BYTES = 128, VNNI_MAX_ROWS = 14, VNNI_PAIR_ROWS = 6,
       VNNI_FOUR_ROWS = 2, VNNI_PREFETCH = 32, VNNI_SLICE = 128 };
// Below this many multiply-adds a call runs on the calling thread alone (int8_linear_f32.h's bound: see there).
enum { VNNI_PARALLEL_WORK = 1 << 19 };

int bouquet_vnni_available(void) {
#if BOUQUET_VNNI
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

INLINE int64_t vnni_groups(int64_t k) { return (k + VNNI_GROUP - 1) / VNNI_GROUP; }

int64_t bouquet_vnni_packed_size(int64_t n, int64_t k) {
    return (n + VNNI_BLOCK - 1) / VNNI_BLOCK * vnni_groups(k) * VNNI_GROUP_BYTES;
}

// weight: [n, k] int8 (|w| <= 127), row-major -> packed: bouquet_vnni_packed_size(n, k) bytes of w + 128 in the
// block order (above), zero past n and k.
void bouquet_vnni_pack(const int8_t* weight, int64_t n, int64_t k, uint8_t* packed) {
    const int64_t groups = vnni_groups(k);
    for (int64_t nb = 0; nb < (n + VNNI_BLOCK - 1) / VNNI_BLOCK; nb++)
        for (int64_t g = 0; g < groups; g++)
            for (int64_t j = 0; j < VNNI_BLOCK; j++)
                for (int64_t i = 0; i < VNNI_GROUP; i++) {
                    int64_t channel = nb * VNNI_BLOCK + j, input = g * VNNI_GROUP + i;
                    uint8_t* to = packed + ((nb * groups + g) * VNNI_BLOCK + j) * VNNI_GROUP + i;
                    *to = channel < n && input < k ? (uint8_t)(weight[channel * k + input] + 128) : 0;
                }
}

// The row's codes summed: what the weight's shift by 128 adds to each of its sums, over 128.
static int32_t code_sum(const int8_t* codes, int64_t k) {
    int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < k; i++) sum += codes[i];
    return sum;
}

// What the epilogue of a column group needs to turn its int32 sums into float32 in place (bouquet_dequantize's
// arguments), or NULL for the sums alone.
typedef struct {
    const float *row_scales, *col_scales, *bias;
    const int32_t *row_zeros, *col_sums;
    int activation;
} VnniDequantize;

#if BOUQUET_VNNI
// acc + the four-input dot products of unsigned `weights` and signed `codes`, lane by lane. In assembly, with the
// accumulator tied to the output: GCC 12's builtin let the register allocator copy each accumulator out and back
// around the instruction, which spilled a 28-accumulator tile to the stack.
VNNI_TARGET INLINE __m512i dot_accumulate(__m512i acc, __m512i weights, __m512i codes) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(weights), "v"(codes));
    return acc;
}

// c[0:mr, 32 first_block : + 32 nb] = a[0:mr] (`groups` groups of four codes) times the weight blocks at `w`
// (block_bytes apart), less 128 x each row's code sum (`code_sums`); or c += that product alone where `accumulate`
// (a later slice of the inputs). mr and nb are constants where this is inlined, so the accumulators live in
// registers (the loop's body stays in this function: passed to a helper, GCC keeps them in memory).
VNNI_TARGET INLINE void vnni_tile(const int8_t* a, int64_t lda, int64_t groups, const uint8_t* w,
                                  int64_t block_bytes, int64_t first_block, int64_t n, const int32_t* code_sums,
                                  int accumulate, int32_t* c, int64_t ldc, const int mr, const int nb) {
    c += first_block * VNNI_BLOCK;
    __m512i acc[VNNI_MAX_ROWS][8];
    __mmask16 lanes[8];
    for (int j = 0; j < 2 * nb; j++) lanes[j] = f32_lanes(first_block * VNNI_BLOCK + 16 * j, n);
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < 2 * nb; j++)
            acc[m][j] = accumulate ? _mm512_maskz_loadu_epi32(lanes[j], c + m * ldc + 16 * j)
                                   : _mm512_set1_epi32(-128 * code_sums[m]);
    for (int64_t g = 0; g < groups; g++) {
        __m512i wv[8];
        for (int b = 0; b < nb; b++) {
            const uint8_t* block = w + b * block_bytes + g * VNNI_GROUP_BYTES;
            _mm_prefetch((const char*)(block + VNNI_PREFETCH * VNNI_GROUP_BYTES), _MM_HINT_T0);
            _mm_prefetch((const char*)(block + VNNI_PREFETCH * VNNI_GROUP_BYTES + 64), _MM_HINT_T0);
            wv[2 * b] = _mm512_loadu_si512(block);
            wv[2 * b + 1] = _mm512_loadu_si512(block + 64);
        }
        for (int m = 0; m < mr; m++) {
            int32_t four;
            memcpy(&four, a + m * lda + g * VNNI_GROUP, sizeof four);
            __m512i codes = _mm512_set1_epi32(four);
            for (int j = 0; j < 2 * nb; j++) acc[m][j] = dot_accumulate(acc[m][j], wv[j], codes);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < 2 * nb; j++) _mm512_mask_storeu_epi32(c + m * ldc + 16 * j, lanes[j], acc[m][j]);
}

typedef void (*VnniTile)(const int8_t*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, const int32_t*,
                         int, int32_t*, int64_t);
#define VNNI_TILE(MR, NB)                                                                                          \
    VNNI_TARGET static void vnni_tile_##MR##_##NB(const int8_t* a, int64_t lda, int64_t groups, const uint8_t* w, \
                                                  int64_t block_bytes, int64_t first_block, int64_t n,            \
                                                  const int32_t* code_sums, int accumulate, int32_t* c,           \
                                                  int64_t ldc) {                                                   \
        vnni_tile(a, lda, groups, w, block_bytes, first_block, n, code_sums, accumulate, c, ldc, MR, NB);         \
    }
VNNI_TILE(1, 1) VNNI_TILE(2, 1) VNNI_TILE(3, 1) VNNI_TILE(4, 1) VNNI_TILE(5, 1) VNNI_TILE(6, 1) VNNI_TILE(7, 1)
VNNI_TILE(8, 1) VNNI_TILE(9, 1) VNNI_TILE(10, 1) VNNI_TILE(11, 1) VNNI_TILE(12, 1) VNNI_TILE(13, 1) VNNI_TILE(14, 1)
VNNI_TILE(1, 2) VNNI_TILE(2, 2) VNNI_TILE(3, 2) VNNI_TILE(4, 2) VNNI_TILE(5, 2) VNNI_TILE(6, 2)
VNNI_TILE(1, 4) VNNI_TILE(2, 4)
// By rows, the tiles of one block (1 to 14 rows), two (1 to 6) and four (1 or 2): each up to the most rows whose
// accumulators fit the 32 vector registers beside its weights and a row's codes.
static const VnniTile VNNI_ONE[VNNI_MAX_ROWS + 1] = {
    0, vnni_tile_1_1, vnni_tile_2_1, vnni_tile_3_1, vnni_tile_4_1, vnni_tile_5_1, vnni_tile_6_1, vnni_tile_7_1,
    vnni_tile_8_1, vnni_tile_9_1, vnni_tile_10_1, vnni_tile_11_1, vnni_tile_12_1, vnni_tile_13_1, vnni_tile_14_1};
static const VnniTile VNNI_TWO[VNNI_PAIR_ROWS + 1] = {
    0, vnni_tile_1_2, vnni_tile_2_2, vnni_tile_3_2, vnni_tile_4_2, vnni_tile_5_2, vnni_tile_6_2};
static const VnniTile VNNI_FOUR[VNNI_FOUR_ROWS + 1] = {0, vnni_tile_1_4, vnni_tile_2_4};
// The column group (blocks) of a call of 1 to 14 rows split by columns: its widest tile's (0: one block).
static const int VNNI_WIDE_BLOCKS[VNNI_MAX_ROWS + 1] = {0, 4, 4, 2, 2, 2, 2};

// Row blocks of at most the tile's rows for `blocks` (1, 2 or 4), as even as they can be, each times `groups` input
// groups of the weight blocks at `w`.
VNNI_TARGET static void vnni_row_blocks(const int8_t* a, int64_t rows, int64_t lda, int64_t groups,
                                        const uint8_t* w, int64_t block_bytes, int64_t first_block, int blocks,
                                        int64_t n, const int32_t* code_sums, int accumulate, int32_t* c,
                                        int64_t ldc) {
    const int most = blocks == 1 ? VNNI_MAX_ROWS : blocks == 2 ? VNNI_PAIR_ROWS : VNNI_FOUR_ROWS;
    const int64_t row_blocks = (rows + most - 1) / most;
    for (int64_t rb = 0, start = 0; rb < row_blocks; rb++) {
        int64_t mr = (rows - start) / (row_blocks - rb) + ((rows - start) % (row_blocks - rb) != 0);
        VnniTile tile = blocks == 1 ? VNNI_ONE[mr] : blocks == 2 ? VNNI_TWO[mr] : VNNI_FOUR[mr];
        tile(a + start * lda, lda, groups, w, block_bytes, first_block, n, code_sums + start, accumulate,
             c + start * ldc, ldc);
        start += mr;
    }
}

// One column group (`blocks` blocks from `first_block`) for every row, in input slices where there are several row
// blocks (int8_linear_f32.h's f32_group); a last, partial group of inputs from a copy of each row's last codes,
// zero-padded (the rows' bytes past k may not be there to read).
VNNI_TARGET static void vnni_group(const int8_t* a, int64_t rows, int64_t k, int64_t lda, const int32_t* code_sums,
                                   const uint8_t* packed, int64_t first_block, int blocks, int64_t n, int32_t* c,
                                   int64_t ldc) {
    const int64_t full = k / VNNI_GROUP, block_bytes = vnni_groups(k) * VNNI_GROUP_BYTES;
    const uint8_t* w = packed + first_block * block_bytes;
    const int64_t slice = rows > VNNI_MAX_ROWS ? VNNI_SLICE : full;
    for (int64_t g = 0; g < full; g += slice) {
        const int64_t count = full - g < slice ? full - g : slice;
        vnni_row_blocks(a + g * VNNI_GROUP, rows, lda, count, w + g * VNNI_GROUP_BYTES, block_bytes, first_block,
                        blocks, n, code_sums, g > 0, c, ldc);
    }
    if (k % VNNI_GROUP) {
        int8_t last[rows][VNNI_GROUP];
        memset(last, 0, sizeof last);
        for (int64_t r = 0; r < rows; r++) memcpy(last[r], a + r * lda + full * VNNI_GROUP, k % VNNI_GROUP);
        vnni_row_blocks(&last[0][0], rows, VNNI_GROUP, 1, w + full * VNNI_GROUP_BYTES, block_bytes, first_block,
                        blocks, n, code_sums, full > 0, c, ldc);
    }
}
#endif  // BOUQUET_VNNI

// The column group (blocks) of a call of `rows` split by columns: the widest tile's up to 6 rows, else one block.
INLINE int vnni_column_group(int64_t rows) {
#if BOUQUET_VNNI
    return rows <= VNNI_MAX_ROWS && VNNI_WIDE_BLOCKS[rows] > 1 ? VNNI_WIDE_BLOCKS[rows] : 1;
#else
    (void)rows;
    return 1;
#endif
}

// This thread's share of c [rows, n] int32 = codes [rows, k] times the packed weight: a run of column groups of
// `group` blocks, split as `omp for schedule(static)` would (no barrier after it); then, given `dequantize`, its columns to float32, a row
// at a time, while they are in cache (a call per row and column group took a fifth of a query's products' time).
static void vnni_columns(const int8_t* a, int64_t rows, int64_t k, int64_t lda, const int32_t* code_sums,
                         const uint8_t* packed, int64_t n, int32_t* c, int64_t ldc, const VnniDequantize* dequantize,
                         int group, int team, int me) {
#if BOUQUET_VNNI
    const int64_t blocks = (n + VNNI_BLOCK - 1) / VNNI_BLOCK;
    const int64_t groups = (blocks + group - 1) / group;
    const int64_t g0 = groups * me / team, g1 = groups * (me + 1) / team;
    for (int64_t g = g0; g < g1; g++) {
        int64_t first_block = g * group;
        if (first_block + group <= blocks)
            vnni_group(a, rows, k, lda, code_sums, packed, first_block, group, n, c, ldc);
        else  // the last, partial group, one block at a time
            for (int64_t b = first_block; b < blocks; b++)
                vnni_group(a, rows, k, lda, code_sums, packed, b, 1, n, c, ldc);
    }
    const int64_t first = g0 * group * VNNI_BLOCK, end = g1 * group * VNNI_BLOCK < n ? g1 * group * VNNI_BLOCK : n;
    for (int64_t r = 0; dequantize && first < end && r < rows; r++)
        dequantize_row(c + r * ldc + first, end - first, dequantize->row_scales[r], dequantize->row_zeros[r],
                       dequantize->col_scales + first, dequantize->col_sums + first, dequantize->bias + first,
                       dequantize->activation, 0);
#else
    (void)a, (void)rows, (void)k, (void)lda, (void)code_sums, (void)packed, (void)n, (void)c, (void)ldc;
    (void)dequantize, (void)group, (void)team, (void)me;
#endif
}

// From VNNI_SPLIT_ROWS rows (a document's step) threads split a call's rows, not its columns, and each takes its
// rows in chunks of up to VNNI_CHUNK_ROWS: every column group of a chunk, then its epilogue, while the chunk's sums
// are in cache (72 rows x 1,536 channels is 432 KB, in L2 beside the whole weight, up to 590 KB at MiniLM's
// shapes; a column group's weights stay in L1 while the chunk's row blocks pass over them). Split by columns, a
// 1,024-row step's sums (3 MB a thread at 1,536 channels) were out of L2 before they were dequantized, and a
// LayerNorm waited on both threads' columns at a barrier, then read every row again. A chunk's tiles are 6 rows
// by two blocks (24 accumulators; ten loads for 24 `vpdpbusd` a group of inputs, where 14 rows by one block take 16
// for 28), its slices of inputs VNNI_SLICE groups (32 KB of weights: measured no slower than 16).
enum { VNNI_SPLIT_ROWS = 64, VNNI_CHUNK_GROUP = 2, VNNI_CHUNK_ROWS = 12 * VNNI_PAIR_ROWS };

// This thread's rows [*first, *end) of `rows` split between `team` threads.
INLINE void vnni_row_share(int64_t rows, int team, int me, int64_t* first, int64_t* end) {
    *first = rows * me / team;
    *end = rows * (me + 1) / team;
}

INLINE int64_t vnni_chunk_end(int64_t start, int64_t end) {
    return end - start < VNNI_CHUNK_ROWS ? end : start + VNNI_CHUNK_ROWS;
}

// The product alone (what tests check it by): c [m, n] int32 (rows ldc elements apart) = a [m, k] int8 codes (rows
// lda bytes apart) times the packed [n, k] weight. 1 where this build has no VNNI (c untouched).
int bouquet_vnni_product(const int8_t* a, int64_t m, int64_t k, int64_t lda, const uint8_t* packed, int64_t n,
                         int32_t* c, int64_t ldc) {
    if (!BOUQUET_VNNI) return 1;
    if (m <= 0) return 0;
    int32_t code_sums[m];
#pragma omp parallel if (m * n * k >= VNNI_PARALLEL_WORK)
    if (m >= VNNI_SPLIT_ROWS) {
        int64_t first, end;
        vnni_row_share(m, omp_get_num_threads(), omp_get_thread_num(), &first, &end);
        for (int64_t start = first, stop; start < end; start = stop) {
            stop = vnni_chunk_end(start, end);
            for (int64_t r = start; r < stop; r++) code_sums[r] = code_sum(a + r * lda, k);
            vnni_columns(a + start * lda, stop - start, k, lda, code_sums + start, packed, n, c + start * ldc, ldc,
                         NULL, VNNI_CHUNK_GROUP, 1, 0);
        }
    } else {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) code_sums[r] = code_sum(a + r * lda, k);
        vnni_columns(a, m, k, lda, code_sums, packed, n, c, ldc, NULL, vnni_column_group(m), omp_get_num_threads(),
                     omp_get_thread_num());
    }
    return 0;
}
