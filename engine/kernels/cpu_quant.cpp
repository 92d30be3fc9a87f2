// GEMV straight from GGUF's blocks (llama.cpp's formats): y[m, n] = x[m, k] @ w[n, k]^T (+ bias) for the few fp32
// rows of a decode step, where w's rows are blocks of one of TYPES, and its dequantization for prefill's GEMM.
//
// Activations stay in fp32 (llama.cpp rounds them to 8 bits first): each block is dequantized into fp32 lanes, as
// gguf.quants.dequantize computes it, and multiplied in fp32, so the result is a float matmul with the dequantized
// weights up to summation order. Decode reads each weight once per step, and these blocks are a half (Q8_0) to a
// quarter (Q4_K) of bf16's bytes. A projection may be several parts of different types stacked by rows (Q4_K_M keeps
// q and k in Q4_K and v in Q6_K; qkv and gate/up are fused here).
#include <immintrin.h>
#include <stdint.h>

#include <vector>

#include "cpu_math.h"

// GGML's type ids
enum { F32 = 0, F16 = 1, Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14, BF16 = 30 };

struct Part {
    const uint8_t* data;
    int64_t type, rows, row_bytes;
};
// A projection's weight: parts stacked by rows (a fused projection), each in its own block type
struct Mat {
    int64_t parts;
    Part part[3];
};

static inline float half(const uint8_t* p) { return _cvtsh_ss(*(const uint16_t*)p); }

// 8 int32 lanes to fp32, times d, stored
static inline void put8(__m256i q, __m256 d, float* out) { _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d)); }

template <int T> struct Block;          // QK weights in BYTES bytes, dequantized into out[QK]

template <> struct Block<F32> {
    static constexpr int QK = 32, BYTES = 128;
    static void deq(const uint8_t* b, float* out) { memcpy(out, b, BYTES); }
};
template <> struct Block<F16> {
    static constexpr int QK = 32, BYTES = 64;
    static void deq(const uint8_t* b, float* out) {
        for (int i = 0; i < QK; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + 2 * i))));
    }
};
template <> struct Block<BF16> {
    static constexpr int QK = 32, BYTES = 64;
    static void deq(const uint8_t* b, float* out) {
        for (int i = 0; i < QK; i += 8) _mm256_storeu_ps(out + i, load8((const bf16*)b + i));
    }
};
// d (f16), 32 int8
template <> struct Block<Q8_0> {
    static constexpr int QK = 32, BYTES = 34;
    static void deq(const uint8_t* b, float* out) {
        const __m256 d = _mm256_set1_ps(half(b));
        for (int i = 0; i < QK; i += 8) put8(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 2 + i))), d, out + i);
    }
};
// d (f16), 16 bytes: weight i < 16 is the low nibble of byte i, weight 16 + i its high nibble; minus 8
template <> struct Block<Q4_0> {
    static constexpr int QK = 32, BYTES = 18;
    static void deq(const uint8_t* b, float* out) {
        const __m256 d = _mm256_set1_ps(half(b));
        const __m128i q = _mm_loadu_si128((const __m128i*)(b + 2)), lo4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
        const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, lo4), eight);
        const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), lo4), eight);
        put8(_mm256_cvtepi8_epi32(lo), d, out);
        put8(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)), d, out + 8);
        put8(_mm256_cvtepi8_epi32(hi), d, out + 16);
        put8(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)), d, out + 24);
    }
};
// d (f16), qh (32 bits: weight i's fifth bit is bit i), 16 bytes of nibbles as Q4_0; minus 16
template <> struct Block<Q5_0> {
    static constexpr int QK = 32, BYTES = 22;
    static void deq(const uint8_t* b, float* out) {
        const __m256 d = _mm256_set1_ps(half(b));
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        const __m128i q = _mm_loadu_si128((const __m128i*)(b + 6)), lo4 = _mm_set1_epi8(0x0F);
        const __m128i nib[2] = {_mm_and_si128(q, lo4), _mm_and_si128(_mm_srli_epi16(q, 4), lo4)};
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
        const __m256i sixteen = _mm256_set1_epi32(16), bits = _mm256_set1_epi32((int)qh);
        for (int i = 0; i < QK; i += 8) {
            const __m128i n = i & 8 ? _mm_srli_si128(nib[i / 16], 8) : nib[i / 16];
            const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(bits, _mm256_add_epi32(lanes, _mm256_set1_epi32(i))), one);
            const __m256i v = _mm256_or_si256(_mm256_cvtepu8_epi32(n), _mm256_slli_epi32(high, 4));
            put8(_mm256_sub_epi32(v, sixteen), d, out + i);
        }
    }
};
// 256 weights: d, dmin (f16), 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles. Sub-block j (32
// weights) is d * scale_j * q - dmin * min_j; 64 weights a run of 32 bytes, low nibbles first.
template <> struct Block<Q4_K> {
    static constexpr int QK = 256, BYTES = 144;
    static void scale_min(int j, const uint8_t* s, int* sc, int* mn) {
        if (j < 4) *sc = s[j] & 63, *mn = s[j + 4] & 63;
        else *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    static void deq(const uint8_t* b, float* out) {
        const float d = half(b), dmin = half(b + 2);
        const uint8_t *s = b + 4, *q = b + 16;
        for (int j = 0; j < 8; j += 2, q += 32, out += 64)
            for (int h = 0; h < 2; h++) {
                int sc, mn;
                scale_min(j + h, s, &sc, &mn);
                const __m256 a = _mm256_set1_ps(d * sc), m = _mm256_set1_ps(dmin * mn);
                for (int i = 0; i < 32; i += 8) {
                    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + i)));
                    v = h ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(0xF));
                    _mm256_storeu_ps(out + 32 * h + i, _mm256_sub_ps(_mm256_mul_ps(a, _mm256_cvtepi32_ps(v)), m));
                }
            }
    }
};
// 256 weights: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16 weights), d (f16);
// weight = d * scale * (6-bit q - 32). Per half of 128: ql[l] low/high nibbles are weights l and l + 64, ql[l + 32]'s
// weights l + 32 and l + 96, their high bits qh[l] >> 0, 4, 2, 6.
template <> struct Block<Q6_K> {
    static constexpr int QK = 256, BYTES = 210;
    static void deq(const uint8_t* b, float* out) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t* sc = (const int8_t*)(b + 192);
        const float d = half(b + 208);
        const __m256i lo4 = _mm256_set1_epi32(0xF), three = _mm256_set1_epi32(3), off = _mm256_set1_epi32(32);
        for (int n = 0; n < 2; n++, ql += 64, qh += 32, sc += 8, out += 128)
            for (int l = 0; l < 32; l += 8) {
                const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(ql + l)));
                const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(ql + l + 32)));
                const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(qh + l)));
                const __m256i q[4] = {
                    _mm256_or_si256(_mm256_and_si256(a, lo4), _mm256_slli_epi32(_mm256_and_si256(h, three), 4)),
                    _mm256_or_si256(_mm256_and_si256(c, lo4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2), three), 4)),
                    _mm256_or_si256(_mm256_srli_epi32(a, 4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 4), three), 4)),
                    _mm256_or_si256(_mm256_srli_epi32(c, 4), _mm256_slli_epi32(_mm256_srli_epi32(h, 6), 4))};
                const int is = l / 16;
                for (int k = 0; k < 4; k++)
                    put8(_mm256_sub_epi32(q[k], off), _mm256_set1_ps(d * sc[is + 2 * k]), out + 32 * k + l);
            }
    }
};

// Weight rows [r0, r0 + R) of one part against C input rows (stride k): each block of each row dequantized once,
// into buf, and multiplied with every input row. Sums stored to y[c * ldy + r].
template <int T, int R, int C>
static void block(const float* x, const uint8_t* w, int64_t row_bytes, int64_t k, const float* bias, float* y,
                  int64_t ldy) {
    using B = Block<T>;
    alignas(32) float buf[R][B::QK];
    __m256 acc[C][R];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) acc[c][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / B::QK; b++) {
        for (int r = 0; r < R; r++) {
            _mm_prefetch((const char*)(w + (r + R) * row_bytes + b * B::BYTES), _MM_HINT_T0);
            B::deq(w + r * row_bytes + b * B::BYTES, buf[r]);
        }
        for (int i = 0; i < B::QK; i += 8)
            for (int c = 0; c < C; c++) {
                const __m256 xv = _mm256_loadu_ps(x + c * k + b * B::QK + i);
                for (int r = 0; r < R; r++) acc[c][r] = _mm256_fmadd_ps(_mm256_load_ps(buf[r] + i), xv, acc[c][r]);
            }
    }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) y[c * ldy + r] = hsum(acc[c][r]) + (bias ? bias[r] : 0.f);
}

// One part's rows [0, n) into y's columns (y [m, ldy]); rows split over threads
template <int T>
static void part_gemv(const float* x, int64_t m, const Part& p, int64_t k, const float* bias, float* y, int64_t ldy,
                      int threads) {
    const int64_t n = p.rows, rb = p.row_bytes;
    const int64_t step = m == 1 ? 4 : 2, blocks = n / step;
    #pragma omp parallel for schedule(static) num_threads(threads) if (n * k * m >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t r0 = b * step;
        const float* bb = bias ? bias + r0 : nullptr;
        const uint8_t* w = p.data + r0 * rb;
        if (step == 4) { block<T, 4, 1>(x, w, rb, k, bb, y + r0, ldy); continue; }
        int64_t c = 0;
        for (; c + 4 <= m; c += 4) block<T, 2, 4>(x + c * k, w, rb, k, bb, y + c * ldy + r0, ldy);
        for (; c < m; c++) block<T, 2, 1>(x + c * k, w, rb, k, bb, y + c * ldy + r0, ldy);
    }
    for (int64_t r = blocks * step; r < n; r++)
        for (int64_t c = 0; c < m; c++)
            block<T, 1, 1>(x + c * k, p.data + r * rb, rb, k, bias ? bias + r : nullptr, y + c * ldy + r, ldy);
}

template <int T>
static void part_dequant(const Part& p, int64_t k, float* out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < p.rows; r++)
        for (int64_t b = 0; b < k / Block<T>::QK; b++)
            Block<T>::deq(p.data + r * p.row_bytes + b * Block<T>::BYTES, out + r * k + b * Block<T>::QK);
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

// y = x @ w^T (+ bias), w's parts one after another in y's columns
static void gemv(const float* x, int64_t m, const Mat* w, const float* bias, float* y, int64_t n, int64_t k,
                 int threads) {
    int64_t col = 0;
    for (int64_t i = 0; i < w->parts; i++) {
        const Part& p = w->part[i];
        const float* b = bias ? bias + col : nullptr;
#define GEMV(T) part_gemv<T>(x, m, p, k, b, y + col, n, threads)
        DISPATCH(p.type, GEMV)
#undef GEMV
        col += p.rows;
    }
}

extern "C" {
// fp32 rows as gemv_fused_f32 (cpu_gemv.cpp) takes them: x itself, RMS-normalised by norm_w, or act(gate) * up of
// x = [gate | up] (mode), then multiplied; residual [m, n] added
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
    gemv(src, m, w, bias, y, n, k, threads);
    if (residual != nullptr)
        for (int64_t i = 0; i < m * n; i++) y[i] += residual[i];
}

// Rows [r0, r0 + rows) of w as fp32, out [rows, k] (an embedding's rows, or the whole weight for prefill's GEMM)
void qdequant(const Mat* w, int64_t r0, int64_t rows, int64_t k, float* out, int threads) {
    for (int64_t i = 0; i < w->parts && rows > 0; i++) {
        const Part& p = w->part[i];
        if (r0 >= p.rows) { r0 -= p.rows; continue; }
        const int64_t take = rows < p.rows - r0 ? rows : p.rows - r0;
        const Part sub = {p.data + r0 * p.row_bytes, p.type, take, p.row_bytes};
#define DEQ(T) part_dequant<T>(sub, k, out, threads)
        DISPATCH(p.type, DEQ)
#undef DEQ
        out += take * k, rows -= take, r0 = 0;
    }
}

// Rows ids[0..count) of w, out [count, k] (an embedding's lookup)
void qrows(const Mat* w, const int64_t* ids, int64_t count, int64_t k, float* out) {
    for (int64_t i = 0; i < count; i++) qdequant(w, ids[i], 1, k, out + i * k, 1);
}
}
