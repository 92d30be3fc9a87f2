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

// The vector the blocks below compute in: 512 bits where the library is built for AVX-512, else 256. `narrow` folds
// it to 8 lanes for finish; `even` and `odd` widen 2 * N bf16 weights, the even-indexed by a shift and the
// odd-indexed by a mask, no shuffle.
#ifdef __AVX512F__
struct Vec {
    using V = __m512;
    static constexpr int N = 16;
    static V zero() { return _mm512_setzero_ps(); }
    static V load(const float* p) { return _mm512_loadu_ps(p); }
    static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static __m512i raw(const bf16* p) { return _mm512_loadu_si512((const void*)p); }
    static V even(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
    static V odd(__m512i v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000))); }
    static __m256 narrow(V v) {
        return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    }
};
#else
struct Vec {
    using V = __m256;
    static constexpr int N = 8;
    static V zero() { return _mm256_setzero_ps(); }
    static V load(const float* p) { return _mm256_loadu_ps(p); }
    static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static __m256i raw(const bf16* p) { return _mm256_loadu_si256((const __m256i*)p); }
    static V even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
    static V odd(__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000))); }
    static __m256 narrow(V v) { return v; }
};
#endif
constexpr int64_t CHUNK = 2 * Vec::N;     // bf16 weights a load: x is laid out per chunk, its even-indexed half first

template <typename T, int R, int C>
static inline void finish_wide(Vec::V (&wide)[C][R], const float* x, const T* w, int64_t i, int64_t k, const T* bias,
                               T* y, int64_t ldy) {
    __m256 acc[C][R];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) acc[c][r] = Vec::narrow(wide[c][r]);
    finish<T, R, C>(acc, x, w, i, k, bias, y, ldy);
}

// fp32: R weight rows against C input rows (stride k), N lanes at a time. Each row's weights are prefetched AHEAD
// floats ahead of its loads, a line at a time (faster here with 512-bit loads: README). A prefetch past the end of
// w never faults.
constexpr int64_t AHEAD = 512;

template <int R, int C>
static inline void block(const float* x, const float* w, int64_t k, const float* bias, float* y, int64_t ldy) {
    Vec::V acc[C][R];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) acc[c][r] = Vec::zero();
    int64_t i = 0;
    for (; i + Vec::N <= k; i += Vec::N) {
        Vec::V wv[R];
        for (int r = 0; r < R; r++) {
            if ((i & 15) == 0) _mm_prefetch((const char*)(w + r * k + i + AHEAD), _MM_HINT_T0);   // one line
            wv[r] = Vec::load(w + r * k + i);
        }
        for (int c = 0; c < C; c++) {
            Vec::V xv = Vec::load(x + c * k + i);
            if (R > 1) __asm__("" : "+v"(xv));      // keep xv in a register: folded into each FMA it loads R times
            for (int r = 0; r < R; r++) acc[c][r] = Vec::fma(wv[r], xv, acc[c][r]);
        }
    }
    finish_wide<float, R, C>(acc, x, w, i, k, bias, y, ldy);
}

// bf16: CHUNK weights at a time, widened exactly; x is fp32 in the same order (see fused). The next block's lines
// are prefetched: +19% measured with 256-bit loads, none for fp32.
template <int R, int C>
static inline void block(const float* x, const bf16* w, int64_t k, const bf16* bias, bf16* y, int64_t ldy) {
    Vec::V acc[C][R];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) acc[c][r] = Vec::zero();
    int64_t i = 0;
    for (; i + CHUNK <= k; i += CHUNK) {
        Vec::V even[R], odd[R];
        for (int r = 0; r < R; r++) {
            if ((i & 31) == 0) _mm_prefetch((const char*)(w + (r + R) * k + i), _MM_HINT_T0);   // one line a row
            const auto v = Vec::raw(w + r * k + i);
            even[r] = Vec::even(v);
            odd[r] = Vec::odd(v);
        }
        for (int c = 0; c < C; c++) {
            const Vec::V xe = Vec::load(x + c * k + i), xo = Vec::load(x + c * k + i + Vec::N);
            for (int r = 0; r < R; r++) acc[c][r] = Vec::fma(odd[r], xo, Vec::fma(even[r], xe, acc[c][r]));
        }
    }
    finish_wide<bf16, R, C>(acc, x, w, i, k, bias, y, ldy);
}

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

// One row of a fused call's input in fp32: x itself, RMS-normalised by norm_w (Gemma's when mode has GEMMA_NORM),
// or act(gate) * up of x = [gate | up] (mode SILU or GELU), each op rounded as the model's torch path rounds for T
// (see cpu_math.h)
template <typename T>
static void input_row(const T* x, int64_t k, const T* norm_w, float eps, int mode, float* out) {
    if (norm_w != nullptr) norm_row(x, norm_w, eps, out, k, mode & GEMMA_NORM);
    else if (mode & SILU) silu_row(x, x + k, out, k);
    else if (mode & GELU) gelu_row(x, x + k, out, k);
    else for (int64_t i = 0; i < k; i++) out[i] = widen(x[i]);
}

// A row in the bf16 block's lane order: per chunk, the even-indexed values, then the odd; the tail as is
static void to_lanes(const float* row, int64_t k, float* dst) {
    const int64_t chunks = k / CHUNK * CHUNK, half = CHUNK / 2;
    for (int64_t i = 0; i < chunks; i += CHUNK)
        for (int j = 0; j < half; j++) dst[i + j] = row[i + 2 * j], dst[i + half + j] = row[i + 2 * j + 1];
    for (int64_t t = chunks; t < k; t++) dst[t] = row[t];
}

// y = the GEMV of x's rows with a decode layer's neighbouring ops folded in, to save their dispatch: the input
// made by input_row (x is [m, 2k] when gated), then residual [m, n] added (rounded as T rounds).
template <typename T>
static void fused(const T* x, int64_t m, const T* w, const T* bias, T* y, int64_t n, int64_t k, int threads,
                  const T* norm_w, float eps, int mode, const T* residual) {
    thread_local std::vector<float> in, row;
    const bool gated = norm_w == nullptr && (mode & (SILU | GELU));
    const bool bf = sizeof(T) == 2, as_is = !bf && norm_w == nullptr && !gated;    // fp32 x is its own input
    if (!as_is) {
        in.resize(m * k);
        row.resize(k);
        for (int64_t c = 0; c < m; c++) {
            input_row(x + c * (gated ? 2 * k : k), k, norm_w, eps, mode, bf ? row.data() : in.data() + c * k);
            if (bf) to_lanes(row.data(), k, in.data() + c * k);
        }
    }
    gemv(as_is ? (const float*)x : in.data(), m, w, bias, y, n, k, threads);
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
                    int threads, const float* norm_w, float eps, int mode, const float* residual) {
    fused(x, m, w, bias, y, n, k, threads, norm_w, eps, mode, residual);
}
void gemv_fused_bf16(const bf16* x, int64_t m, const bf16* w, const bf16* bias, bf16* y, int64_t n, int64_t k,
                     int threads, const bf16* norm_w, float eps, int mode, const bf16* residual) {
    fused(x, m, w, bias, y, n, k, threads, norm_w, eps, mode, residual);
}
}
