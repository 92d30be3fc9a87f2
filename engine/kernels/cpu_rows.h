// The block kernels in the file's layout, a weight row at a time (cpu_quant.cpp): a GEMV of a few input rows by
// rows of blocks (x in fp32 or int8) and the blocks' dequantization. Packed rows (cpu_packed.h) take the rows
// these leave over.
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "cpu_blocks.h"

// The inputs of one call: x, its sums per 32, and (Q8X) its int8 form with a scale per 32 and integer sums per 16;
// with a second digit (rest > 0), the rounding of what the first left, `rest` values further on in xq (and rest / 32
// further in dx and i16, 2 x that); a block whose second scale is 0 has none
struct Input {
    const float *x, *xs, *dx;
    const int8_t* xq;
    const int* i16;
    int64_t rest;
};

// Weight rows [r0, r0 + R) of one part against C input rows (stride k; xs: their sums per 32, for mins), summed
// into y[c * ldy + r]. A float type's block is widened into fp32 once and multiplied with every input row; a
// quantized block is unpacked to int8 once, and per SUB weights its integers times x are summed in fp32, then
// scaled; a min's term is the min times x's sum.
template <int T, int R, int C>
static void block(const float* x, const float* xs, const uint8_t* w, int64_t row_bytes, int64_t k, const float* bias,
                  float* y, int64_t ldy) {
    using B = Block<T>;
    __m256 acc[C][R];
    float low[C][R] = {};
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) acc[c][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / B::QK; b++) {
        const uint8_t* at = w + b * B::BYTES;
        for (int r = 0; r < R; r++) _mm_prefetch((const char*)(at + (r + 2 * R) * row_bytes), _MM_HINT_T0);
        const float* xb = x + b * B::QK;
        if constexpr (B::FLOAT) {
            alignas(32) float buf[R][B::QK];
            for (int r = 0; r < R; r++) B::deq(at + r * row_bytes, buf[r]);
            for (int i = 0; i < B::QK; i += 8)
                for (int c = 0; c < C; c++) {
                    const __m256 xv = _mm256_loadu_ps(xb + c * k + i);
                    for (int r = 0; r < R; r++) acc[c][r] = _mm256_fmadd_ps(_mm256_load_ps(buf[r] + i), xv, acc[c][r]);
                }
        } else {
            constexpr int SUBS = B::QK / B::SUB, V = B::SUB / 8;
            alignas(32) int8_t buf[R][B::QK];
            float sc[R][SUBS], mn[R][SUBS];
            const int8_t* q[R];
            for (int r = 0; r < R; r++) q[r] = B::unpack(at + r * row_bytes, buf[r], sc[r], mn[r]);
            for (int s = 0; s < SUBS; s++) {
                const int o = s * B::SUB;
                __m256 part[C][R];
                for (int c = 0; c < C; c++)
                    for (int r = 0; r < R; r++) part[c][r] = _mm256_setzero_ps();
                for (int v = 0; v < V; v++)
                    for (int r = 0; r < R; r++) {
                        const __m256 wv = widen8(q[r] + o + 8 * v);       // once, for every input row
                        for (int c = 0; c < C; c++)
                            part[c][r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xb + c * k + o + 8 * v), part[c][r]);
                    }
                for (int c = 0; c < C; c++)
                    for (int r = 0; r < R; r++) {
                        acc[c][r] = _mm256_fmadd_ps(part[c][r], _mm256_set1_ps(sc[r][s]), acc[c][r]);
                        if constexpr (B::MIN) low[c][r] += mn[r][s] * xs[c * (k / 32) + (b * B::QK + o) / 32];
                    }
            }
        }
    }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) y[c * ldy + r] = hsum(acc[c][r]) - low[c][r] + (bias ? bias[r] : 0.f);
}

// (Both forms prefetch the rows two groups ahead: decode ran 10-20% faster than with one, paired on a 0.5B Q8_0.)
// The integer form of `block`: x as int8 (xq) with a scale per 32 (dx). Per 32 weights, |q| times x with q's signs
// (maddubs: u8 x s8 pairs into int16, then int32), converted to fp32 and scaled by the weights' scale (one a 16 for
// Q6_K: half the lanes each) times x's. With AVX512-VNNI one vpdpbusd does the pairs' and quads' sums.
template <int T, int R, int C>
static void iblock(const int8_t* xq, const float* dx, const float* xs, int64_t rest, const uint8_t* w, int64_t row_bytes,
                   int64_t k, const float* bias, float* y, int64_t ldy) {
    using B = Block<T>;
    constexpr int CHUNKS = B::QK / 32;
    const int64_t nb = k / 32;
    __m256 acc[C][R];
    float low[C][R] = {};
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) acc[c][r] = _mm256_setzero_ps();
    [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < k / B::QK; b++) {
        const uint8_t* at = w + b * B::BYTES;
        for (int r = 0; r < R; r++) _mm_prefetch((const char*)(at + (r + 2 * R) * row_bytes), _MM_HINT_T0);
        alignas(32) int8_t buf[R][B::QK];
        float sc[R][B::QK / B::SUB], mn[R][B::QK / B::SUB];
        const int8_t* q[R];
        for (int r = 0; r < R; r++) q[r] = B::unpack(at + r * row_bytes, buf[r], sc[r], mn[r]);
        for (int j = 0; j < CHUNKS; j++) {
            const int64_t blk = b * CHUNKS + j;
            __m256i qv[R], mag[R];
            for (int r = 0; r < R; r++) {
                qv[r] = _mm256_loadu_si256((const __m256i*)(q[r] + 32 * j));
                mag[r] = _mm256_sign_epi8(qv[r], qv[r]);
            }
            for (int c = 0; c < C; c++) {
                for (int64_t digit = 0; digit <= (rest > 0); digit++) {
                    const int64_t at = digit * rest;
                    const float d = dx[at / 32 + c * nb + blk];
                    if (d == 0.f) continue;
                    const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + at + c * k + 32 * blk));
                    for (int r = 0; r < R; r++) {
#ifdef __AVX512VNNI__
                        const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), mag[r], _mm256_sign_epi8(xv, qv[r]));
#else
                        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(mag[r], _mm256_sign_epi8(xv, qv[r])), ones);
#endif
                        const __m256 scale = B::SUB == 32 ? _mm256_set1_ps(sc[r][j] * d)
                            : _mm256_setr_m128(_mm_set1_ps(sc[r][2 * j] * d), _mm_set1_ps(sc[r][2 * j + 1] * d));
                        acc[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[c][r]);
                    }
                }
                if constexpr (B::MIN)
                    for (int r = 0; r < R; r++) low[c][r] += mn[r][j] * xs[c * nb + blk];
            }
        }
    }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) y[c * ldy + r] = hsum(acc[c][r]) - low[c][r] + (bias ? bias[r] : 0.f);
}


template <int T, int R, int C>
static void run_block(const Input& in, int64_t c, const uint8_t* w, int64_t rb, int64_t k, const float* bias, float* y,
                      int64_t ldy) {
    const int64_t nb = k / 32;
    if constexpr (!Block<T>::FLOAT)
        if (in.xq != nullptr)
            return iblock<T, R, C>(in.xq + c * k, in.dx + c * nb, in.xs + c * nb, in.rest, w, rb, k, bias, y, ldy);
    block<T, R, C>(in.x + c * k, in.xs + c * nb, w, rb, k, bias, y, ldy);
}

// One part's rows [0, n) into y's columns (y [m, ldy]); rows split over threads
template <int T>
static void part_gemv(const Input& in, int64_t m, const Part& p, int64_t k, const float* bias, float* y, int64_t ldy,
                      int threads) {
    const int64_t n = p.rows, rb = p.row_bytes;
    const int64_t step = m == 1 ? 4 : 2, blocks = n / step;
    #pragma omp parallel for schedule(static) num_threads(threads) if (n * k * m >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t r0 = b * step;
        const float* bb = bias ? bias + r0 : nullptr;
        const uint8_t* w = p.data + r0 * rb;
        if (step == 4) { run_block<T, 4, 1>(in, 0, w, rb, k, bb, y + r0, ldy); continue; }
        int64_t c = 0;
        for (; c + 4 <= m; c += 4) run_block<T, 2, 4>(in, c, w, rb, k, bb, y + c * ldy + r0, ldy);
        for (; c < m; c++) run_block<T, 2, 1>(in, c, w, rb, k, bb, y + c * ldy + r0, ldy);
    }
    for (int64_t r = blocks * step; r < n; r++)
        for (int64_t c = 0; c < m; c++)
            run_block<T, 1, 1>(in, c, p.data + r * rb, rb, k, bias ? bias + r : nullptr, y + c * ldy + r, ldy);
}

template <int T>
static void part_dequant(const Part& p, int64_t k, float* out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < p.rows; r++)
        for (int64_t b = 0; b < k / Block<T>::QK; b++)
            deq<T>(p.data + r * p.row_bytes + b * Block<T>::BYTES, out + r * k + b * Block<T>::QK);
}
