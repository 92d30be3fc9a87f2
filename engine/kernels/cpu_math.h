// Vector math and bf16 conversions shared by the CPU kernels (AVX2 + FMA).
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

typedef uint16_t bf16;

// Bytes ahead of a GEMV's weight stream to prefetch (cpu_build.ahead sets it per CPU); 0: the hardware's alone
#ifndef PAGODA_AHEAD
#define PAGODA_AHEAD 0
#endif
// Input rows from which a VNNI GEMV pass takes two groups of weight rows in 512-bit vectors (cpu_build.pair_rows)
#ifndef PAGODA_PAIR_ROWS
#define PAGODA_PAIR_ROWS 4
#endif

static inline float widen(float v) { return v; }
static inline float widen(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline void store(float* p, float v) { *p = v; }
static inline void store(bf16* p, float v) {     // to nearest even, as torch rounds
    uint32_t u;
    memcpy(&u, &v, 4);
    *p = (bf16)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
// v rounded as a T would hold it: identity for fp32; for bf16 what torch's bf16 op would have stored
template <typename T>
static inline float round_as(float v) {
    T t;
    store(&t, v);
    return widen(t);
}

// 8 consecutive values widened to fp32 lanes
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const bf16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// The sum of the 8 lanes
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
static inline int hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

// e^x, 8 lanes, within 2 ulp for x in [-87, 88] (clamped there): x = n ln2 + r, e^r by Cephes' polynomial
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    static const float c[] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                              5.0000001201e-1f};
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    for (float ci : c) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(ci));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// 8 lanes rounded to bf16 precision (to nearest even), kept as fp32
static inline __m256 round8_bf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000)));
}
template <typename T>
static inline __m256 round8_as(__m256 v) {
    if constexpr (sizeof(T) == 2) return round8_bf16(v);
    else return v;
}

// What a fused call folds into its input (`mode`, bits): the gated activation of x = [gate | up], and Gemma's norm;
// and for blocks (cpu_quant.cpp) whether x is rounded to int8 for the dot products, with a second int8 digit for
// every block (Q16X) or for those whose scale is over MIXED_OVER times their row's median block's (MIXED)
enum { SILU = 1, GELU = 2, GEMMA_NORM = 4, Q8X = 8, Q16X = 16, MIXED = 32 };
constexpr float MIXED_OVER = 3.f;

// One row of n: out[i] = x[i] / sqrt(mean(x^2) + eps) * w[i], in fp32. For bf16 rounded where the model's torch
// path rounds: the normalised x, then its product with w (Hugging Face's Qwen2RMSNorm). Gemma's (gemma): scaled by
// 1 + w in fp32 and rounded once (Gemma3RMSNorm).
template <typename T>
static inline void norm_row(const T* x, const T* w, float eps, float* out, int64_t n, bool gemma = false) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = load8(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum(acc);
    for (; i < n; i++) ss += widen(x[i]) * widen(x[i]);
    const float inv = 1.f / sqrtf(ss / n + eps);
    if (gemma) {
        for (i = 0; i < n; i++) out[i] = round_as<T>(widen(x[i]) * inv * (1.f + widen(w[i])));
        return;
    }
    for (i = 0; i < n; i++) out[i] = round_as<T>(widen(w[i]) * round_as<T>(widen(x[i]) * inv));
}

// One row of n: out[i] = gelu_tanh(g[i]) * u[i] (GeGLU, transformers' gelu_pytorch_tanh), in fp32; for bf16
// rounded after the GELU and after the product, as torch rounds F.gelu(gate, approximate="tanh") * up. The
// vectors take 0.5 (1 + tanh(y)) as 1 / (1 + e^(-2y)), the same function
template <typename T>
static inline void gelu_row(const T* g, const T* u, float* out, int64_t n) {
    const float c = 0.7978845608028654f;          // sqrt(2 / pi)
    const __m256 one = _mm256_set1_ps(1.f), m2c = _mm256_set1_ps(-2.f * c), cube = _mm256_set1_ps(0.044715f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = load8(g + i);
        const __m256 y = _mm256_mul_ps(m2c, _mm256_fmadd_ps(_mm256_mul_ps(cube, gv), _mm256_mul_ps(gv, gv), gv));
        const __m256 a = round8_as<T>(_mm256_div_ps(gv, _mm256_add_ps(one, exp8(y))));
        _mm256_storeu_ps(out + i, round8_as<T>(_mm256_mul_ps(a, load8(u + i))));
    }
    for (; i < n; i++) {
        const float gi = widen(g[i]);
        const float a = round_as<T>(0.5f * gi * (1.f + tanhf(c * (gi + 0.044715f * gi * gi * gi))));
        out[i] = round_as<T>(a * widen(u[i]));
    }
}

// One row of n: out[i] = silu(g[i]) * u[i], in fp32; for bf16 rounded after the silu and after the product, as
// torch's F.silu(gate) * up rounds
template <typename T>
static inline void silu_row(const T* g, const T* u, float* out, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = load8(g + i);
        const __m256 s = round8_as<T>(_mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv)))));
        _mm256_storeu_ps(out + i, round8_as<T>(_mm256_mul_ps(s, load8(u + i))));
    }
    for (; i < n; i++) {
        const float gi = widen(g[i]);
        out[i] = round_as<T>(round_as<T>(gi / (1.f + expf(-gi))) * widen(u[i]));
    }
}
