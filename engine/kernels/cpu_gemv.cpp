// y[m, n] = x[m, k] @ w[n, k]^T (+ bias[n]) for the few rows of a decode step, fp32 or bf16, AVX2 + FMA; with 512-bit
// loads where the library is built for AVX-512 (cpu_build: a CPU that has it), which read memory faster here.
//
// Decode on a CPU is bound by reading the weights once per step. Each block below streams R weight rows
// through registers and multiplies them with C input rows, so the weights are read once whatever m is.
// bf16 is widened to fp32 on load (exact), accumulated in fp32 and rounded once on store, to nearest even.
// Rows of w are split over OpenMP threads; linked against the libgomp torch loaded, so one thread pool serves both.
#include <immintrin.h>
#include <stdint.h>

#include <vector>

#include "cpu_math.h"

// The lane sums of four vectors at once: [sum(a), sum(b), sum(c), sum(d)]
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 all = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1));
}

// Sums of the vector lanes plus the scalar tail [i, k), stored: y[c * ldy + r] for r < R, c < C. Accumulators are
// reduced four at a time, which takes fewer shuffles than one at a time.
template <typename T, int R, int C>
static inline void finish(__m256 (&acc)[C][R], const float* x, const T* w, int64_t i, int64_t k, const T* bias,
                          T* y, int64_t ldy) {
    float sums[C * R];
    __m256* v = &acc[0][0];
    int j = 0;
    for (; j + 4 <= C * R; j += 4) _mm_storeu_ps(sums + j, hsum4(v[j], v[j + 1], v[j + 2], v[j + 3]));
    for (; j < C * R; j++) sums[j] = hsum(v[j]);
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) {
            float s = sums[c * R + r];
            for (int64_t t = i; t < k; t++) s += widen(w[r * k + t]) * x[c * k + t];
            store(y + c * ldy + r, bias ? s + widen(bias[r]) : s);
        }
}

#ifdef __AVX512F__
constexpr int64_t CHUNK = 32;     // bf16 weights a load: x is laid out per chunk, its even-indexed half first

static inline __m256 narrow(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// Accumulators of 16 lanes folded to 8, for finish
template <int R, int C>
static inline void fold(__m512 (&wide)[C][R], __m256 (&acc)[C][R]) {
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) acc[c][r] = narrow(wide[c][r]);
}

// fp32: R weight rows against C input rows (stride k), 16 lanes at a time.
template <int R, int C>
static inline void block(const float* x, const float* w, int64_t k, const float* bias, float* y, int64_t ldy) {
    __m512 wide[C][R];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) wide[c][r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        __m512 wv[R];
        for (int r = 0; r < R; r++) wv[r] = _mm512_loadu_ps(w + r * k + i);
        for (int c = 0; c < C; c++) {
            __m512 xv = _mm512_loadu_ps(x + c * k + i);
            for (int r = 0; r < R; r++) wide[c][r] = _mm512_fmadd_ps(wv[r], xv, wide[c][r]);
        }
    }
    __m256 acc[C][R];
    fold<R, C>(wide, acc);
    finish<float, R, C>(acc, x, w, i, k, bias, y, ldy);
}

// bf16: 32 weights at a time, the even-indexed widened by a shift and the odd-indexed by a mask, no shuffle; x is
// fp32 in the same order (see fused). The next block's line is prefetched.
template <int R, int C>
static inline void block(const float* x, const bf16* w, int64_t k, const bf16* bias, bf16* y, int64_t ldy) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000);
    __m512 wide[C][R];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) wide[c][r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + CHUNK <= k; i += CHUNK) {
        __m512 even[R], odd[R];
        for (int r = 0; r < R; r++) {
            _mm_prefetch((const char*)(w + (r + R) * k + i), _MM_HINT_T0);
            __m512i v = _mm512_loadu_si512((const void*)(w + r * k + i));
            even[r] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            odd[r] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
        }
        for (int c = 0; c < C; c++) {
            __m512 xe = _mm512_loadu_ps(x + c * k + i), xo = _mm512_loadu_ps(x + c * k + i + 16);
            for (int r = 0; r < R; r++)
                wide[c][r] = _mm512_fmadd_ps(odd[r], xo, _mm512_fmadd_ps(even[r], xe, wide[c][r]));
        }
    }
    __m256 acc[C][R];
    fold<R, C>(wide, acc);
    finish<bf16, R, C>(acc, x, w, i, k, bias, y, ldy);
}
#else
// fp32: R weight rows against C input rows (stride k), 8 lanes at a time.
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
            if (R > 1) __asm__("" : "+x"(xv));      // keep xv in a register: folded into each FMA it loads R times
            for (int r = 0; r < R; r++) acc[c][r] = _mm256_fmadd_ps(wv[r], xv, acc[c][r]);
        }
    }
    finish<float, R, C>(acc, x, w, i, k, bias, y, ldy);
}

constexpr int64_t CHUNK = 16;     // bf16 weights a load: x is laid out per chunk, its even-indexed half first

// bf16: 16 weights at a time, the even-indexed widened by a shift and the odd-indexed by a mask, no shuffle; x is
// fp32 in the same order (see fused). The next block is prefetched: +19% measured, none for fp32.
template <int R, int C>
static inline void block(const float* x, const bf16* w, int64_t k, const bf16* bias, bf16* y, int64_t ldy) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000);
    __m256 acc[C][R];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) acc[c][r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + CHUNK <= k; i += CHUNK) {
        __m256 even[R], odd[R];
        for (int r = 0; r < R; r++) {
            if ((i & 31) == 0) _mm_prefetch((const char*)(w + (r + R) * k + i), _MM_HINT_T0);
            __m256i v = _mm256_loadu_si256((const __m256i*)(w + r * k + i));
            even[r] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            odd[r] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        }
        for (int c = 0; c < C; c++) {
            __m256 xe = _mm256_loadu_ps(x + c * k + i), xo = _mm256_loadu_ps(x + c * k + i + 8);
            for (int r = 0; r < R; r++)
                acc[c][r] = _mm256_fmadd_ps(odd[r], xo, _mm256_fmadd_ps(even[r], xe, acc[c][r]));
        }
    }
    finish<bf16, R, C>(acc, x, w, i, k, bias, y, ldy);
}

#endif

// Weight rows [r0, r0 + R) against every input row: 4 input rows at a time, then one at a time.
template <typename T, int R>
static inline void rows(const float* x, int64_t m, const T* w, const T* bias, T* y, int64_t n, int64_t k,
                        int64_t r0) {
    const T* b = bias ? bias + r0 : nullptr;
    int64_t c = 0;
    if (R == 2)
        for (; c + 4 <= m; c += 4) block<R, 4>(x + c * k, w + r0 * k, k, b, y + c * n + r0, n);
    for (; c < m; c++) block<R, 1>(x + c * k, w + r0 * k, k, b, y + c * n + r0, n);
}

// x is fp32 (for bf16 weights: widened and reordered by the caller).
template <typename T>
static void gemv(const float* x, int64_t m, const T* w, const T* bias, T* y, int64_t n, int64_t k, int threads) {
    // One input row: 4 weight rows a block (4 accumulators hide the FMA latency). More rows: 2 x 4 a block.
    const int64_t step = m == 1 ? 4 : 2, blocks = n / step;
    #pragma omp parallel for schedule(static) num_threads(threads) if (n * k * m >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        if (step == 4) rows<T, 4>(x, m, w, bias, y, n, k, b * 4);
        else rows<T, 2>(x, m, w, bias, y, n, k, b * 2);
    }
    for (int64_t r = blocks * step; r < n; r++) rows<T, 1>(x, m, w, bias, y, n, k, r);
}

// y = the GEMV of x's rows, with a decode layer's neighbouring ops folded in to save their dispatch: the input
// RMS-normalised by norm_w first, or (silu) x is [m, 2k] = [gate | up] and the input silu(gate) * up; then
// residual [m, n] added. bf16 rounds after each op where the model's torch path does (see cpu_math.h).
template <typename T>
static void fused(const T* x, int64_t m, const T* w, const T* bias, T* y, int64_t n, int64_t k, int threads,
                  const T* norm_w, float eps, int silu, const T* residual) {
    thread_local std::vector<float> in, row;
    const float* input = (const float*)x;
    if (norm_w != nullptr || silu || sizeof(T) == 2) {
        in.resize(m * k);
        row.resize(k);
        const int64_t stride = silu ? 2 * k : k, chunks = k / CHUNK * CHUNK, half = CHUNK / 2;
        for (int64_t c = 0; c < m; c++) {
            const T* xr = x + c * stride;
            float* out = sizeof(T) == 2 ? row.data() : in.data() + c * k;
            if (norm_w != nullptr) norm_row(xr, norm_w, eps, out, k);
            else if (silu) silu_row(xr, xr + k, out, k);
            else for (int64_t i = 0; i < k; i++) out[i] = widen(xr[i]);
            if (sizeof(T) == 2) {         // the bf16 block's lane order: per chunk, the even then the odd; the tail as is
                float* dst = in.data() + c * k;
                for (int64_t i = 0; i < chunks; i += CHUNK)
                    for (int j = 0; j < half; j++) dst[i + j] = out[i + 2 * j], dst[i + half + j] = out[i + 2 * j + 1];
                for (int64_t t = chunks; t < k; t++) dst[t] = out[t];
            }
        }
        input = in.data();
    }
    gemv(input, m, w, bias, y, n, k, threads);
    if (residual != nullptr)
        for (int64_t i = 0; i < m * n; i++) store(y + i, widen(y[i]) + widen(residual[i]));
}

extern "C" {
void gemv_f32(const float* x, int64_t m, const float* w, const float* bias, float* y, int64_t n, int64_t k,
              int threads) {
    gemv(x, m, w, bias, y, n, k, threads);
}
void gemv_bf16(const bf16* x, int64_t m, const bf16* w, const bf16* bias, bf16* y, int64_t n, int64_t k,
               int threads) {
    fused(x, m, w, bias, y, n, k, threads, (const bf16*)nullptr, 0.f, 0, (const bf16*)nullptr);
}
void gemv_fused_f32(const float* x, int64_t m, const float* w, const float* bias, float* y, int64_t n, int64_t k,
                    int threads, const float* norm_w, float eps, int silu, const float* residual) {
    fused(x, m, w, bias, y, n, k, threads, norm_w, eps, silu, residual);
}
void gemv_fused_bf16(const bf16* x, int64_t m, const bf16* w, const bf16* bias, bf16* y, int64_t n, int64_t k,
                     int threads, const bf16* norm_w, float eps, int silu, const bf16* residual) {
    fused(x, m, w, bias, y, n, k, threads, norm_w, eps, silu, residual);
}
}
