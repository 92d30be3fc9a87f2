// Prefill's GEMM over packed blocks with x rounded to int16 per 32 values (beside every integer setting of
// quantized_activations; models/quant.py's prefill16 says where): y[m, n] = x[m, k] @ w[n, k]^T, AVX512-VNNI
// multiplying int16 pairs (vpdpwssd, 32 products an instruction, bf16's rate and twice fp32's). The weights'
// integers are exact in int16, so the products differ from fp32's of the dequantized weights only by x's rounding
// (half of max|x| / 32767 a value) and the order of the fp32 additions.
//
// A panel of 32 weight rows (4 packed groups) is unpacked once into a thread's buffer: per pair of weights two
// 512-bit vectors, lane = row, each lane the pair's two int16; the rows' scale (and min) per unit. The products then
// run over the m input rows, 6 at a time: 12 int32 sums in registers, converted and scaled once a unit.
#pragma once
#include "cpu_packed.h"

#ifdef __AVX512VNNI__
#include <vector>

constexpr int PANEL = 32, TOKENS = 6;
// x's rows a pass over the panels takes: as many as 2 MiB of int16 hold, so that they stay in the caches while every
// panel reads them. Over Llama 3.2 1B's projections (rows up to 8192 wide) this ran at 1.04x torch's bf16 GEMM's
// speed, all 512 rows in one pass at 0.92x, and 256 KiB passes at 0.85x (a panel is unpacked again each pass)
constexpr int64_t CHUNK_BYTES = 2 << 20;

// x rounded to int16 per 32 values: q [m, k], scale dx and sum of the rounded values xs per 32 [m, k / 32]
static void quantize16(const float* x, int64_t blocks, int16_t* q, float* dx, float* xs) {
    for (int64_t i = 0; i < blocks; i++) {
        const __m512 a = _mm512_loadu_ps(x + 32 * i), b = _mm512_loadu_ps(x + 32 * i + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
        _mm256_storeu_si256((__m256i*)(q + 32 * i), _mm512_cvtsepi32_epi16(qa));
        _mm256_storeu_si256((__m256i*)(q + 32 * i + 16), _mm512_cvtsepi32_epi16(qb));
        dx[i] = amax / 32767.f;
        xs[i] = dx[i] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
}

// A packed part's groups [g0, g0 + 4) (those past `groups` as zeros) into a panel: wq [k / 2][32] int32 (two int16),
// s and mn [k / UNIT][32]
template <int T>
static void unpack_panel(const uint8_t* data, int64_t groups, int64_t g0, int64_t k, int32_t* wq, float* s, float* mn) {
    using P = Packed<T>;
    constexpr int QK = Block<T>::QK, UNITS = QK / P::UNIT;
    const int64_t cols = k / QK, bytes = cols * P::BYTES;
    const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m512i off = _mm512_set1_epi16(P::OFF);
    for (int gi = 0; gi < PANEL / G; gi++) {
        const int64_t g = g0 + gi;
        for (int64_t b = 0; b < cols; b++) {
            const uint8_t* p = data + g * bytes + b * P::BYTES;
            for (int u = 0; u < UNITS; u++) {
                float* su = s + (b * UNITS + u) * PANEL + gi * G;
                float* mu = mn + (b * UNITS + u) * PANEL + gi * G;
                _mm256_storeu_ps(su, g < groups ? P::scale(p, u) : _mm256_setzero_ps());
                _mm256_storeu_ps(mu, g < groups && P::MIN ? P::mins(p, u) : _mm256_setzero_ps());
            }
            for (int col = 0; col < QK / 32; col++)
                for (int f = 0; f < 8; f++) {        // 4 weights of each of the group's 8 rows: two pairs
                    __m512i v = _mm512_setzero_si512();
                    if (g < groups)
                        v = _mm512_permutexvar_epi32(order, _mm512_sub_epi16(_mm512_cvtepu8_epi16(P::q(p, col, f)), off));
                    const int64_t pair = (b * QK + 32 * col + 4 * f) / 2;
                    _mm256_storeu_si256((__m256i*)(wq + pair * PANEL + gi * G), _mm512_castsi512_si256(v));
                    _mm256_storeu_si256((__m256i*)(wq + (pair + 1) * PANEL + gi * G), _mm512_extracti64x4_epi64(v, 1));
                }
        }
    }
}

// C input rows (from row c0) times a panel: y[c][0..32) (only `valid` of them stored), plus bias
template <int UNIT, bool MIN, int C>
static void panel_rows(const int32_t* wq, const float* s, const float* mn, const int16_t* xq, const float* dx,
                       const float* xs, int64_t c0, int64_t k, const float* bias, float* y, int64_t ldy, int valid) {
    __m512 acc[C][2];
    for (int c = 0; c < C; c++) acc[c][0] = acc[c][1] = _mm512_setzero_ps();
    const int64_t nb = k / 32;
    for (int64_t u = 0; u < k / UNIT; u++) {
        __m512i dot[C][2];
        for (int c = 0; c < C; c++) dot[c][0] = dot[c][1] = _mm512_setzero_si512();
        const int32_t* w = wq + u * (UNIT / 2) * PANEL;
        #pragma GCC unroll 16
        for (int j = 0; j < UNIT / 2; j++) {
            const __m512i w0 = _mm512_loadu_si512(w + j * PANEL), w1 = _mm512_loadu_si512(w + j * PANEL + 16);
            for (int c = 0; c < C; c++) {
                int32_t pair;
                memcpy(&pair, xq + (c0 + c) * k + u * UNIT + 2 * j, 4);
                const __m512i xv = _mm512_set1_epi32(pair);
                dot[c][0] = _mm512_dpwssd_epi32(dot[c][0], w0, xv);
                dot[c][1] = _mm512_dpwssd_epi32(dot[c][1], w1, xv);
            }
        }
        const __m512 s0 = _mm512_loadu_ps(s + u * PANEL), s1 = _mm512_loadu_ps(s + u * PANEL + 16);
        const int64_t blk = u * UNIT / 32;
        for (int c = 0; c < C; c++) {
            const __m512 d = _mm512_set1_ps(dx[(c0 + c) * nb + blk]);
            acc[c][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[c][0]), _mm512_mul_ps(s0, d), acc[c][0]);
            acc[c][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[c][1]), _mm512_mul_ps(s1, d), acc[c][1]);
        }
        if constexpr (MIN) {     // a min's term: the min times the sum of x's rounded values over the unit
            const __m512 m0 = _mm512_loadu_ps(mn + u * PANEL), m1 = _mm512_loadu_ps(mn + u * PANEL + 16);
            for (int c = 0; c < C; c++) {
                const __m512 sum = _mm512_set1_ps(xs[(c0 + c) * nb + blk]);
                acc[c][0] = _mm512_fnmadd_ps(m0, sum, acc[c][0]);
                acc[c][1] = _mm512_fnmadd_ps(m1, sum, acc[c][1]);
            }
        }
    }
    const __mmask16 lo = valid >= 16 ? 0xFFFF : (1u << valid) - 1, hi = valid >= 32 ? 0xFFFF : valid > 16 ? (1u << (valid - 16)) - 1 : 0;
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(lo, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(hi, bias + 16) : _mm512_setzero_ps();
    for (int c = 0; c < C; c++) {
        float* out = y + (c0 + c) * ldy;
        _mm512_mask_storeu_ps(out, lo, _mm512_add_ps(acc[c][0], b0));
        _mm512_mask_storeu_ps(out + 16, hi, _mm512_add_ps(acc[c][1], b1));
    }
}

template <int T>
static void panel_tiles(const int32_t* wq, const float* s, const float* mn, const int16_t* xq, const float* dx,
                        const float* xs, int64_t m, int64_t k, const float* bias, float* y, int64_t ldy, int valid) {
    constexpr int UNIT = Packed<T>::UNIT;
    constexpr bool MIN = Packed<T>::MIN;
    for (int64_t c0 = 0; c0 < m; c0 += TOKENS) {
        switch (m - c0 < TOKENS ? m - c0 : TOKENS) {
#define PANEL_CASE(C) case C: panel_rows<UNIT, MIN, C>(wq, s, mn, xq, dx, xs, c0, k, bias, y, ldy, valid); break;
            PANEL_CASE(1) PANEL_CASE(2) PANEL_CASE(3) PANEL_CASE(4) PANEL_CASE(5)
#undef PANEL_CASE
            default: panel_rows<UNIT, MIN, TOKENS>(wq, s, mn, xq, dx, xs, c0, k, bias, y, ldy, valid);
        }
    }
}

// A packed part (its whole groups: rows % 8 == 0) times m rows of x16, panel by panel across the threads
template <int T>
static void packed_gemm16(const int16_t* xq, const float* dx, const float* xs, int64_t m, const Part& p, int64_t k,
                          const float* bias, float* y, int64_t ldy, int threads) {
    const int64_t groups = p.rows / G, panels = (p.rows + PANEL - 1) / PANEL;
    constexpr int UNIT = Packed<T>::UNIT;
    const int64_t chunk = std::max<int64_t>(TOKENS, CHUNK_BYTES / (2 * k) / TOKENS * TOKENS), nb = k / 32;
    #pragma omp parallel num_threads(threads)
    {
        std::vector<int32_t> wq(k / 2 * PANEL);
        std::vector<float> s(k / UNIT * PANEL), mn(k / UNIT * PANEL);
        for (int64_t c0 = 0; c0 < m; c0 += chunk) {
            const int64_t rows = std::min(chunk, m - c0);
            #pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < panels; i++) {
                unpack_panel<T>(p.data, groups, i * (PANEL / G), k, wq.data(), s.data(), mn.data());
                const int valid = (int)std::min<int64_t>(PANEL, p.rows - i * PANEL);
                panel_tiles<T>(wq.data(), s.data(), mn.data(), xq + c0 * k, dx + c0 * nb, xs + c0 * nb, rows, k,
                               bias ? bias + i * PANEL : nullptr, y + c0 * ldy + i * PANEL, ldy, valid);
            }
        }
    }
}
#endif
