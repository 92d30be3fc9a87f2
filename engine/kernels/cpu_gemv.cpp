// y[m, n] = x[m, k] @ w[n, k]^T (+ bias[n]) for the few rows of a decode step, fp32 or bf16, AVX2 + FMA; with 512-bit
// vectors where the library is built for AVX-512, and AVX512-BF16's vdpbf16ps for bf16 where it is built with that.
//
// Decode on a CPU is bound by reading the weights once per step. Each thread reads its share of w's rows one row
// after the other, start to end: one sequential stream, which the hardware prefetchers follow at close to the
// memory's bandwidth (several rows read side by side, as this kernel did before, fell well short of it: docs/cpu-kernels.md).
// Every input row is multiplied with a weight row while it is in L1, so w is read once whatever m is.
// Accumulation is in fp32 and each output rounded once, to nearest even; the rows of w are split over OpenMP
// threads, linked against the libgomp torch loaded, so one thread pool serves both.
#include <immintrin.h>
#include <stdint.h>

#include <type_traits>
#include <vector>

#include "cpu_math.h"

// The vector the dot products accumulate in: 512 bits where the library is built for AVX-512, else 256. `even` and
// `odd` widen 2 * N bf16 weights, the even-indexed by a shift and the odd-indexed by a mask, no shuffle.
#ifdef __AVX512F__
struct Vec {
    using V = __m512;
    using I = __m512i;
    static constexpr int N = 16;
    static V zero() { return _mm512_setzero_ps(); }
    static V load(const float* p) { return _mm512_loadu_ps(p); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static I raw(const bf16* p) { return _mm512_loadu_si512((const void*)p); }
    static V even(I v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
    static V odd(I v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000))); }
    static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#else
struct Vec {
    using V = __m256;
    using I = __m256i;
    static constexpr int N = 8;
    static V zero() { return _mm256_setzero_ps(); }
    static V load(const float* p) { return _mm256_loadu_ps(p); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static I raw(const bf16* p) { return _mm256_loadu_si256((const __m256i*)p); }
    static V even(I v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
    static V odd(I v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000))); }
    static float sum(V v) { return hsum(v); }
};
#endif

// One step of a weight row's dot product with an input row: STEP weights (`W`, loaded once for every input row)
// against the input at the same positions (`Xs`, loaded once for every weight row), held as X in the order
// `input` (below) lays it out. Up to SOLO input rows, weight rows go one at a time (see gemv).
template <typename T> struct Dot;
template <> struct Dot<float> {
    using X = float;
    using W = Vec::V;
    using Xs = Vec::V;
    static constexpr int64_t STEP = Vec::N;
    static constexpr int SOLO = 2;
    static W load(const float* w) { return Vec::load(w); }
    static Xs load_x(const float* x) { return Vec::load(x); }
    static Vec::V add(Vec::V acc, W w, Xs x) { return Vec::fma(w, x, acc); }
};
#ifdef __AVX512BF16__
// vdpbf16ps: each lane adds the products of a pair of bf16 weights with a pair of bf16 inputs, in fp32. A bf16
// model's inputs are bf16 values already (the torch path's and input_row's roundings), so x in bf16 is exact and
// the products are the ones the widened path takes; only the order of the fp32 additions differs, and denormal
// inputs (below 1.2e-38) count as zero.
template <> struct Dot<bf16> {
    using X = bf16;
    using W = __m512bh;
    using Xs = __m512bh;
    static constexpr int64_t STEP = 32;
    static constexpr int SOLO = 4;
    static W load(const bf16* w) { return (__m512bh)_mm512_loadu_si512((const void*)w); }
    static Xs load_x(const bf16* x) { return load(x); }
    static Vec::V add(Vec::V acc, W w, Xs x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#else
// widened exactly; x is fp32 in the order of the widened lanes: per step its even-indexed half, then its odd
template <> struct Dot<bf16> {
    using X = float;
    struct W {
        Vec::V even, odd;
    };
    using Xs = W;
    static constexpr int64_t STEP = 2 * Vec::N;
    static constexpr int SOLO = 1;
    static W load(const bf16* w) {
        const Vec::I v = Vec::raw(w);
        return {Vec::even(v), Vec::odd(v)};
    }
    static Xs load_x(const float* x) { return {Vec::load(x), Vec::load(x + Vec::N)}; }
    static Vec::V add(Vec::V acc, W w, Xs x) { return Vec::fma(w.odd, x.odd, Vec::fma(w.even, x.even, acc)); }
};
#endif
template <typename T> using In = typename Dot<T>::X;

// An input row (fp32) as Dot<T> reads it: as is (fp32), rounded to bf16 (bf16 values already: exact), or per
// step its even-indexed values, then its odd (widened bf16); a tail shorter than a step stays in order.
template <typename T>
static void input(const float* row, int64_t k, In<T>* dst) {
    if constexpr (std::is_same_v<T, float>) {
        memcpy(dst, row, k * sizeof(float));
    } else if constexpr (std::is_same_v<In<T>, bf16>) {
        for (int64_t i = 0; i < k; i++) store(dst + i, row[i]);
    } else {
        const int64_t step = Dot<T>::STEP, steps = k / step * step, half = step / 2;
        for (int64_t i = 0; i < steps; i += step)
            for (int j = 0; j < half; j++) dst[i + j] = row[i + 2 * j], dst[i + half + j] = row[i + 2 * j + 1];
        for (int64_t t = steps; t < k; t++) dst[t] = row[t];
    }
}

// R weight rows from w (k weights each) against C input rows from x (each laid out by `input`, k apart):
// y[c * ldy + r] = their dot products (+ bias[r]). U accumulators a pair, so that R * C * U >= 4 independent
// chains of adds hide their latency; each weight vector is loaded once for the C input rows. With R > 1 the rows
// of the next block are prefetched, a line at a time (the streams side by side read slower without it); a lone
// stream, PAGODA_AHEAD bytes ahead where the build sets it (cpu_build.ahead: the CPUs it reads faster on).
template <typename T, int R, int C>
static inline void block(const In<T>* x, const T* w, int64_t k, const T* bias, T* y, int64_t ldy) {
    using D = Dot<T>;
    constexpr int U = R * C >= 4 ? 1 : 4 / (R * C);
    constexpr int64_t STEP = D::STEP;
    Vec::V acc[R][C][U];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            for (int u = 0; u < U; u++) acc[r][c][u] = Vec::zero();
    // acc[.][.][u] += the step at i
    const auto step = [&](int64_t i, int u) {
        typename D::W wv[R];
        if (R == 1 && PAGODA_AHEAD && i * sizeof(T) % 64 == 0)
            _mm_prefetch((const char*)(w + i) + PAGODA_AHEAD, _MM_HINT_T0);
        for (int r = 0; r < R; r++) {
            if (R > 1 && i * sizeof(T) % 64 == 0) _mm_prefetch((const char*)(w + (r + R) * k + i), _MM_HINT_T0);
            wv[r] = D::load(w + r * k + i);
        }
        for (int c = 0; c < C; c++) {
            const typename D::Xs xv = D::load_x(x + c * k + i);
            for (int r = 0; r < R; r++) acc[r][c][u] = D::add(acc[r][c][u], wv[r], xv);
        }
    };
    int64_t i = 0;
    for (; i + U * STEP <= k; i += U * STEP)
        for (int u = 0; u < U; u++) step(i + u * STEP, u);
    for (; i + STEP <= k; i += STEP) step(i, 0);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            for (int u = 1; u < U; u++) acc[r][c][0] = Vec::add(acc[r][c][0], acc[r][c][u]);
            float s = Vec::sum(acc[r][c][0]);
            for (int64_t t = i; t < k; t++) s += widen(w[r * k + t]) * widen(x[c * k + t]);
            store(y + c * ldy + r, bias ? s + widen(bias[r]) : s);
        }
}

// Weight rows [r0, r0 + R) against every input row: 4 at a time, then one at a time
template <typename T, int R>
static inline void rows(const In<T>* x, int64_t m, const T* w, const T* bias, T* y, int64_t n, int64_t k,
                        int64_t r0) {
    const T* b = bias ? bias + r0 : nullptr;
    int64_t c = 0;
    for (; c + 4 <= m; c += 4) block<T, R, 4>(x + c * k, w + r0 * k, k, b, y + c * n + r0, n);
    for (; c < m; c++) block<T, R, 1>(x + c * k, w + r0 * k, k, b, y + c * n + r0, n);
}

// x laid out by `input`. Up to Dot<T>::SOLO input rows: weight rows one at a time, each thread's in memory order.
// More: two weight rows at a time, so that each load of x serves two of them (there the arithmetic bounds the step
// more than the stream does).
template <typename T>
static void gemv(const In<T>* x, int64_t m, const T* w, const T* bias, T* y, int64_t n, int64_t k, int threads) {
    const int64_t step = m <= Dot<T>::SOLO ? 1 : 2, blocks = n / step;
    #pragma omp parallel for schedule(static) num_threads(threads) if (n * k * m >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        if (step == 1) rows<T, 1>(x, m, w, bias, y, n, k, b);
        else rows<T, 2>(x, m, w, bias, y, n, k, 2 * b);
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

// y = the GEMV of x's rows with a decode layer's neighbouring ops folded in, to save their dispatch: the input
// made by input_row (x is [m, 2k] when gated), then residual [m, n] added (rounded as T rounds).
template <typename T>
static void fused(const T* x, int64_t m, const T* w, const T* bias, T* y, int64_t n, int64_t k, int threads,
                  const T* norm_w, float eps, int mode, const T* residual) {
    thread_local std::vector<In<T>> in;
    thread_local std::vector<float> line;
    const bool gated = norm_w == nullptr && (mode & (SILU | GELU));
    // x is its own input where Dot takes T as it is (fp32; bf16 with vdpbf16ps)
    const bool as_is = std::is_same_v<In<T>, T> && norm_w == nullptr && !gated;
    if (!as_is) {
        in.resize(m * k);
        line.resize(k);
        for (int64_t c = 0; c < m; c++) {
            input_row(x + c * (gated ? 2 * k : k), k, norm_w, eps, mode, line.data());
            input<T>(line.data(), k, in.data() + c * k);
        }
    }
    gemv(as_is ? (const In<T>*)x : in.data(), m, w, bias, y, n, k, threads);
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
