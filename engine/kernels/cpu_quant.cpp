// GEMV straight from GGUF's blocks (llama.cpp's formats): y[m, n] = x[m, k] @ w[n, k]^T (+ bias) for the few fp32
// rows of a decode step, where w's rows are blocks of one of the types of cpu_blocks.h, and their dequantization for
// prefill's GEMM. Decode reads each weight once per step, and these blocks are a half (Q8_0) to a quarter (Q4_K) of
// bf16's bytes. A projection may be several parts of different types stacked by rows (Q4_K_M keeps q and k in Q4_K
// and v in Q6_K; qkv and gate/up are fused here).
//
// Two ways to multiply a quantized block (mode bit Q8X; with MIXED or Q16X, a second int8 digit of x, see gemv): with
// x in fp32 (the weights' integers widened to fp32: a float matmul with the dequantized weights up to summation
// order), or, as llama.cpp does, with x rounded to int8 per 32 values (scale max|x| / 127) and integer dot products,
// which take a third of the instructions. The integer form runs on rows packed in groups of 8 at load
// (cpu_packed.h), which takes a third again: decode is then bound by memory, not by instructions, on the 2-core
// machines measured (docs/models.md). The file's layout (cpu_rows.h) serves fp32 x and the rows past a part's last
// whole group.
#include <immintrin.h>
#include <stdint.h>

#include <string.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu_gemm16.h"
#include "cpu_packed.h"
#include "cpu_rows.h"

// Where AVX512-VNNI multiplies 512-bit vectors, a pass of at least PAGODA_PAIR_ROWS input rows takes two adjacent
// groups at once (pair_dot), where the products bound it; not a row or two, which memory bounds (docs/cpu-kernels.md)
constexpr int PAIR_ROWS = PAGODA_PAIR_ROWS;
#ifdef __AVX512VNNI__
constexpr bool WIDE = true;
#else
constexpr bool WIDE = false;
#endif

// Input rows a pass over the weights: 8 where AVX-512's 32 registers hold their sums and the group's weights, but 4
// for K-quants with mins in 256-bit vectors (one more vector a unit: 8 rows of them measured slower than two passes
// of 4; a pair of groups takes 8, 1.2-1.3x faster than 4)
template <int T, bool PAIR>
constexpr int tile() {
#ifdef __AVX512F__
    return Packed<T>::MIN && !PAIR ? 4 : 8;
#else
    return 4;
#endif
}

// A packed group (8 rows; PAIR: it and the next, 16 rows, in 512-bit vectors) times C input rows from c0
template <int T, int C, bool PAIR>
static void group_rows(const uint8_t* w, int64_t bytes, int64_t cols, const Input& in, int64_t c0, int64_t k,
                       const float* bias, float* y, int64_t ldy) {
    constexpr int QK = Block<T>::QK, BYTES = Packed<T>::BYTES;
    using V = std::conditional_t<PAIR, __m512, __m256>;
    const int64_t nb = k / 32;
    V acc[C];
    for (int c = 0; c < C; c++) acc[c] = V{};
    for (int64_t b = 0; b < cols; b++) {
        const uint8_t* at = w + b * BYTES;
        // A pair of groups of several rows: the thread's next pair's lines at this column, a pass ahead (a pair's own
        // lines further on are mostly its second group's, read already when a row is a few blocks). Else the group's
        // lines four blocks (or PAGODA_AHEAD) ahead; but not for a lone input row where the build has no PAGODA_AHEAD
        // (AMD): there the hardware's prefetchers alone read a one-row step's weights faster (Llama 3.2 1B Q4_K_M,
        // 2026-12-07: its Q6_K head 26 to 40 GB/s, its decode against llama.cpp 0.98x to 1.13x)
        constexpr int64_t AHEAD = PAGODA_AHEAD > 4 * BYTES ? PAGODA_AHEAD : 4 * BYTES;
        if constexpr (PAIR && C > 1)
            for (int line = 0; line < BYTES; line += 64) {
                _mm_prefetch((const char*)(at + 2 * bytes + line), _MM_HINT_T0);
                _mm_prefetch((const char*)(at + 3 * bytes + line), _MM_HINT_T0);
            }
        else if constexpr (PAGODA_AHEAD > 0 || C > 1)
            for (int line = 0; line < BYTES; line += 64) {
                _mm_prefetch((const char*)(at + AHEAD + line), _MM_HINT_T0);
                if constexpr (PAIR) _mm_prefetch((const char*)(at + bytes + AHEAD + line), _MM_HINT_T0);
            }
        XBlock x[C];
        for (int c = 0; c < C; c++) {
            const int64_t row = c0 + c, first = b * (QK / 32);
            const int64_t at = row * nb + first, rb = in.rest / 32;
            x[c] = {in.xq + row * k + b * QK, in.dx + at, in.xs + at, in.i16 + 2 * at,
                    in.rest ? in.xq + in.rest + row * k + b * QK : nullptr, in.dx + rb + at, in.i16 + 2 * (rb + at)};
        }
#ifdef __AVX512VNNI__
        if constexpr (PAIR) pair_dot<T, C>(at, at + bytes, x, acc);
        else
#endif
            group_dot<T, C>(at, x, acc);
    }
    for (int c = 0; c < C; c++) {
        float* out = y + (c0 + c) * ldy;
        if constexpr (PAIR)
            _mm512_storeu_ps(out, _mm512_add_ps(acc[c], bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps()));
        else
            _mm256_storeu_ps(out, _mm256_add_ps(acc[c], bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps()));
    }
}

// A group (or a pair of them) times all m input rows, tile() at a time
template <int T, bool PAIR>
static void group_tiles(const uint8_t* w, int64_t bytes, int64_t cols, const Input& in, int64_t m, int64_t k,
                        const float* bias, float* y, int64_t ldy) {
    constexpr int TILE = tile<T, PAIR>();
    for (int64_t c0 = 0; c0 < m; c0 += TILE) {
        switch (m - c0 < TILE ? m - c0 : TILE) {
#define TILE_CASE(C) case C: group_rows<T, C, PAIR>(w, bytes, cols, in, c0, k, bias, y, ldy); break;
            TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) TILE_CASE(7)
#undef TILE_CASE
            default: group_rows<T, TILE, PAIR>(w, bytes, cols, in, c0, k, bias, y, ldy);
        }
    }
}

template <int T>
static void packed_gemv(const Input& in, int64_t m, const Part& p, int64_t k, const float* bias, float* y, int64_t ldy,
                        int threads) {
    const int64_t groups = p.rows / G, cols = k / Block<T>::QK, bytes = cols * Packed<T>::BYTES;
    const bool pairs = WIDE && m >= PAIR_ROWS;
    #pragma omp parallel for schedule(static) num_threads(threads) if (p.rows * k * m >= 65536)
    for (int64_t unit = 0; unit < (pairs ? (groups + 1) / 2 : groups); unit++) {
        const int64_t g = pairs ? 2 * unit : unit;
        const float* bg = bias ? bias + g * G : nullptr;
        if constexpr (WIDE)
            if (pairs && g + 1 < groups) {
                group_tiles<T, true>(p.data + g * bytes, bytes, cols, in, m, k, bg, y + g * G, ldy);
                continue;
            }
        group_tiles<T, false>(p.data + g * bytes, bytes, cols, in, m, k, bg, y + g * G, ldy);
    }
    const uint8_t* tail = p.data + groups * bytes;
    for (int64_t r = groups * G; r < p.rows; r++)
        for (int64_t c = 0; c < m; c++)
            run_block<T, 1, 1>(in, c, tail + (r - groups * G) * p.row_bytes, p.row_bytes, k, bias ? bias + r : nullptr,
                               y + c * ldy + r, ldy);
}

// Rows [r0, r0 + rows) of a packed part as fp32 (a group cut by the range goes through a buffer)
template <int T>
static void packed_dequant(const Part& p, int64_t r0, int64_t rows, int64_t k, float* out, int threads) {
    constexpr int QK = Block<T>::QK;
    const int64_t groups = p.rows / G, cols = k / QK, bytes = cols * Packed<T>::BYTES, end = r0 + rows;
    const int64_t last = end < groups * G ? (end + G - 1) / G : groups;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows > G)
    for (int64_t g = r0 / G; g < last; g++) {
        const int64_t lo = g * G > r0 ? g * G : r0, hi = (g + 1) * G < end ? (g + 1) * G : end;
        std::vector<float> buf(lo == g * G && hi == (g + 1) * G ? 0 : G * k);
        float* dst = buf.empty() ? out + (lo - r0) * k : buf.data();
        for (int64_t b = 0; b < cols; b++) group_deq<T>(p.data + g * bytes + b * Packed<T>::BYTES, dst + b * QK, k);
        if (!buf.empty()) memcpy(out + (lo - r0) * k, buf.data() + (lo - g * G) * k, (hi - lo) * k * sizeof(float));
    }
    const uint8_t* tail = p.data + groups * bytes;
    for (int64_t r = r0 > groups * G ? r0 : groups * G; r < end; r++)
        for (int64_t b = 0; b < cols; b++)
            deq<T>(tail + (r - groups * G) * p.row_bytes + b * Block<T>::BYTES, out + (r - r0) * k + b * QK);
}

// The part's rows packed into dst (dst null: the bytes it takes)
template <int T>
static int64_t pack_part(const Part& p, int64_t k, uint8_t* dst) {
    const int64_t groups = p.rows / G, cols = k / Block<T>::QK, bytes = cols * Packed<T>::BYTES;
    const int64_t tail = (p.rows - groups * G) * p.row_bytes;
    if (dst == nullptr) return groups * bytes + tail;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < cols; b++) {
            const uint8_t* src[G];
            for (int r = 0; r < G; r++) src[r] = p.data + (g * G + r) * p.row_bytes + b * Block<T>::BYTES;
            Packed<T>::pack(src, dst + g * bytes + b * Packed<T>::BYTES);
        }
    memcpy(dst + groups * bytes, p.data + groups * G * p.row_bytes, tail);
    return groups * bytes + tail;
}

#define PACKED(type, call)                                                                    \
    switch (type) {                                                                           \
        case Q8_0: call(Q8_0); break;                                                         \
        case Q4_0: call(Q4_0); break;                                                         \
        case Q5_0: call(Q5_0); break;                                                         \
        case Q4_K: call(Q4_K); break;                                                         \
        case Q6_K: call(Q6_K); break;                                                         \
    }

#define DISPATCH(type, call)                                                                  \
    switch (type) {                                                                           \
        case F32: call(F32); break;                                                           \
        case F16: call(F16); break;                                                           \
        case BF16: call(BF16); break;                                                         \
        case Q8_0: call(Q8_0); break;                                                         \
        case Q4_0: call(Q4_0); break;                                                         \
        case Q5_0: call(Q5_0); break;                                                         \
        case Q4_K: call(Q4_K); break;                                                         \
        case Q6_K: call(Q6_K); break;                                                         \
    }

// x's 32-value blocks as int8 (xq) and scale (dx = max|x| / 127; the values rounded to nearest even), and the sums
// (xs) of the values the products see: x's own, or with dx its rounded ones. The int8 form in vectors throughout (a
// block's max and integer sums are exact in any order); it ran once a GEMV on one thread, with the other waiting.
static void quantize_x(const float* x, int64_t blocks, int8_t* xq, float* dx, float* xs, int* i16) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t i = 0; i < blocks; i++) {
        const float* v = x + 32 * i;
        if (dx == nullptr) {
            float sum = 0.f;
            for (int j = 0; j < 32; j++) sum += v[j];
            xs[i] = sum;
            continue;
        }
        __m256 vs[4];
        for (int j = 0; j < 4; j++) vs[j] = _mm256_loadu_ps(v + 8 * j);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, vs[0]), _mm256_andnot_ps(sign, vs[1])),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, vs[2]), _mm256_andnot_ps(sign, vs[3])));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        dx[i] = amax / 127.f;
        const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        __m256i n[4];
        for (int j = 0; j < 4; j++) n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(vs[j], inv));
        // |n| <= 127: the packs do not saturate, and the int32 lanes sum as the int8 values do
        const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(n[0], n[1]), 0xd8);
        const __m256i w16b = _mm256_permute4x64_epi64(_mm256_packs_epi32(n[2], n[3]), 0xd8);
        _mm256_storeu_si256((__m256i*)(xq + 32 * i), _mm256_permute4x64_epi64(_mm256_packs_epi16(w16, w16b), 0xd8));
        i16[2 * i] = hsum(_mm256_add_epi32(n[0], n[1]));
        i16[2 * i + 1] = hsum(_mm256_add_epi32(n[2], n[3]));
        xs[i] = dx[i] * (i16[2 * i] + i16[2 * i + 1]);
    }
}

// x's second int8 digit, the rounding of what its first (xq, dx; m rows of nb blocks) left, for each block whose scale
// is over `over` times its row's median block's (0: every block): an outlier block's scale is set by a few large
// values, which its other values' rounding then errs by as much, and real models' activations have such channels
// (docs/models.md). At `at` blocks past the first digit in xq (x 32), dx, xs (added to the first's: a min's term
// sees both digits) and i16 (x 2); another block's second scale is 0, which the products skip.
static void second_digit(const float* x, int64_t m, int64_t nb, float over, int8_t* xq, float* dx, float* xs, int* i16) {
    const int64_t at = m * nb;
    thread_local std::vector<float> sorted;
    for (int64_t c = 0; c < m; c++) {
        float bar = -1.f;
        if (over > 0.f) {
            sorted.assign(dx + c * nb, dx + (c + 1) * nb);
            std::nth_element(sorted.begin(), sorted.begin() + nb / 2, sorted.end());
            bar = over * sorted[nb / 2];
        }
        for (int64_t i = c * nb; i < (c + 1) * nb; i++) {
            if (!(dx[i] > bar)) { dx[at + i] = 0.f; continue; }
            float rest[32];
            for (int j = 0; j < 32; j++) rest[j] = x[32 * i + j] - dx[i] * xq[32 * i + j];
            quantize_x(rest, 1, xq + 32 * (at + i), dx + at + i, xs + at + i, i16 + 2 * (at + i));
            xs[i] += xs[at + i];
        }
    }
}

// y = x @ w^T (+ bias), w's parts one after another in y's columns; int8: x rounded to int8 for quantized parts.
// over >= 0 (with int8): a second int8 digit (second_digit; 1/254 of the first's scale) where the first errs most, 0
// for every block (x to about 16 bits), multiplied with the same unpacked weights as the first; float parts take x
static void gemv(const float* x, int64_t m, const Mat* w, const float* bias, float* y, int64_t n, int64_t k,
                 int threads, bool int8, float over) {
    thread_local std::vector<float> xs, dx;
    thread_local std::vector<int8_t> xq;
    thread_local std::vector<int> i16;
    for (int64_t i = 0; i < w->parts; i++) int8 |= w->part[i].packed != 0;      // packed parts take int8 x only
    const int64_t digits = int8 && over >= 0.f ? 2 : 1, blocks = m * (k / 32);
    xs.resize(digits * blocks), dx.resize(digits * blocks), i16.resize(2 * digits * blocks);
    xq.resize(int8 ? digits * m * k : 0);
    quantize_x(x, blocks, xq.data(), int8 ? dx.data() : nullptr, xs.data(), i16.data());
    if (digits == 2) second_digit(x, m, k / 32, over, xq.data(), dx.data(), xs.data(), i16.data());
    const Input in = {x, xs.data(), dx.data(), int8 ? xq.data() : nullptr, i16.data(), digits == 2 ? m * k : 0};
    int64_t col = 0;
    for (int64_t i = 0; i < w->parts; i++) {
        const Part& p = w->part[i];
        const float* b = bias ? bias + col : nullptr;
#define GEMV(T) part_gemv<T>(in, m, p, k, b, y + col, n, threads)
#define PGEMV(T) packed_gemv<T>(in, m, p, k, b, y + col, n, threads)
        if (p.packed) PACKED(p.type, PGEMV) else DISPATCH(p.type, GEMV)
#undef PGEMV
#undef GEMV
        col += p.rows;
    }
}

extern "C" {
// fp32 rows as gemv_fused_f32 (cpu_gemv.cpp) takes them: x itself, RMS-normalised by norm_w, or act(gate) * up of
// x = [gate | up] (mode), then multiplied (with x in int8 where mode has Q8X); residual [m, n] added
void qgemv_fused(const float* x, int64_t m, const Mat* w, const float* bias, float* y, int64_t n, int64_t k,
                 int threads, const float* norm_w, float eps, int mode, const float* residual) {
    thread_local std::vector<float> in;
    const bool gated = norm_w == nullptr && (mode & (SILU | GELU));
    const float* src = x;
    if (norm_w != nullptr || gated) {
        in.resize(m * k);
        for (int64_t c = 0; c < m; c++) {
            const float* row = x + c * (gated ? 2 * k : k);
            float* out = in.data() + c * k;
            if (norm_w != nullptr) norm_row(row, norm_w, eps, out, k, mode & GEMMA_NORM);
            else if (mode & SILU) silu_row(row, row + k, out, k);
            else gelu_row(row, row + k, out, k);
        }
        src = in.data();
    }
    gemv(src, m, w, bias, y, n, k, threads, mode & Q8X, mode & Q16X ? 0.f : mode & MIXED ? MIXED_OVER : -1.f);
    if (residual != nullptr)
        for (int64_t i = 0; i < m * n; i++) y[i] += residual[i];
}

// Rows [r0, r0 + rows) of w as fp32, out [rows, k] (an embedding's rows, or the whole weight for prefill's GEMM)
void qdequant(const Mat* w, int64_t r0, int64_t rows, int64_t k, float* out, int threads) {
    for (int64_t i = 0; i < w->parts && rows > 0; i++) {
        const Part& p = w->part[i];
        if (r0 >= p.rows) { r0 -= p.rows; continue; }
        const int64_t take = rows < p.rows - r0 ? rows : p.rows - r0;
        const Part sub = {p.data + r0 * p.row_bytes, p.type, take, p.row_bytes, 0};
#define DEQ(T) part_dequant<T>(sub, k, out, threads)
#define PDEQ(T) packed_dequant<T>(p, r0, take, k, out, threads)
        if (p.packed) PACKED(p.type, PDEQ) else DISPATCH(p.type, DEQ)
#undef PDEQ
#undef DEQ
        out += take * k, rows -= take, r0 = 0;
    }
}

// Prefill's rows with x rounded to int16 per 32 values (cpu_gemm16.h): y [m, n] = x @ w^T (+ bias); 0 (nothing
// done) where the build has no AVX512-VNNI or a part is not whole packed groups, and the caller dequantizes instead
int qgemm16(const float* x, int64_t m, const Mat* w, const float* bias, float* y, int64_t n, int64_t k, int threads) {
#ifdef __AVX512VNNI__
    for (int64_t i = 0; i < w->parts; i++)
        if (!w->part[i].packed || w->part[i].rows % G) return 0;
    const int64_t blocks = m * (k / 32);
    std::vector<int16_t> xq(m * k);
    std::vector<float> dx(blocks), xs(blocks);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < m; c++) quantize16(x + c * k, k / 32, xq.data() + c * k, dx.data() + c * (k / 32), xs.data() + c * (k / 32));
    int64_t col = 0;
    for (int64_t i = 0; i < w->parts; i++) {
        const Part& p = w->part[i];
#define GEMM(T) packed_gemm16<T>(xq.data(), dx.data(), xs.data(), m, p, k, bias ? bias + col : nullptr, y + col, n, threads)
        PACKED(p.type, GEMM)
#undef GEMM
        col += p.rows;
    }
    return 1;
#else
    return 0;
#endif
}

// Part i of w with its rows packed into dst (cpu_packed.h); dst null: the bytes it takes (0: a type not packed)
int64_t qpack(const Mat* w, int64_t i, int64_t k, uint8_t* dst) {
    int64_t size = 0;
#define PACK(T) size = pack_part<T>(w->part[i], k, dst)
    PACKED(w->part[i].type, PACK)
#undef PACK
    return size;
}

// Rows ids[0..count) of w, out [count, k] (an embedding's lookup)
void qrows(const Mat* w, const int64_t* ids, int64_t count, int64_t k, float* out) {
    for (int64_t i = 0; i < count; i++) qdequant(w, ids[i], 1, k, out + i * k, 1);
}
}
