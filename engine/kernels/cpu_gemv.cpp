// y[m, n] = x[m, k] @ w[n, k]^T (+ bias[n]) for the few rows of a decode step, fp32, AVX2 + FMA.
//
// Decode on a CPU is bound by reading the weights once per step. Each block below streams R weight rows
// through registers and multiplies them with C input rows, so the weights are read once whatever m is.
// Rows of w are split over OpenMP threads; linked against the libgomp torch loaded, so one thread pool serves both.
#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

// R weight rows (from w) against C input rows (from x, stride k); writes y[c * ldy + r] for r < R, c < C.
template <int R, int C>
static inline void block(const float* x, const float* w, int64_t k, const float* bias, float* y, int64_t ldy) {
    __m256 acc[C][R];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) acc[c][r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        __m256 wv[R];
        for (int r = 0; r < R; r++) wv[r] = _mm256_loadu_ps(w + r * k + i);
        for (int c = 0; c < C; c++) {
            __m256 xv = _mm256_loadu_ps(x + c * k + i);
            for (int r = 0; r < R; r++) acc[c][r] = _mm256_fmadd_ps(wv[r], xv, acc[c][r]);
        }
    }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) {
            float s = hsum(acc[c][r]);
            for (int64_t t = i; t < k; t++) s += w[r * k + t] * x[c * k + t];
            y[c * ldy + r] = bias ? s + bias[r] : s;
        }
}

// Weight rows [r0, r0 + R) against every input row: 4 input rows at a time, then one at a time.
template <int R>
static inline void rows(const float* x, int64_t m, const float* w, const float* bias, float* y,
                        int64_t n, int64_t k, int64_t r0) {
    const float* b = bias ? bias + r0 : nullptr;
    int64_t c = 0;
    if (R == 2)
        for (; c + 4 <= m; c += 4) block<R, 4>(x + c * k, w + r0 * k, k, b, y + c * n + r0, n);
    for (; c < m; c++) block<R, 1>(x + c * k, w + r0 * k, k, b, y + c * n + r0, n);
}

extern "C" void gemv_f32(const float* x, int64_t m, const float* w, const float* bias, float* y,
                         int64_t n, int64_t k, int threads) {
    // One input row: 4 weight rows a block (4 accumulators hide the FMA latency). More rows: 2 x 4 a block.
    const int64_t step = m == 1 ? 4 : 2, blocks = n / step;
    #pragma omp parallel for schedule(static) num_threads(threads) if (n * k * m >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        if (step == 4) rows<4>(x, m, w, bias, y, n, k, b * 4);
        else rows<2>(x, m, w, bias, y, n, k, b * 2);
    }
    for (int64_t r = blocks * step; r < n; r++) rows<1>(x, m, w, bias, y, n, k, r);
}
