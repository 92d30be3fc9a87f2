// Decode's small fp32 ops on a CPU, each one C call where torch takes several dispatches: RMSNorm, SwiGLU, RoPE.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "cpu_math.h"

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for m rows of n
extern "C" void rms_norm_f32(const float* x, const float* w, float eps, float* out, int64_t m, int64_t n) {
    for (int64_t r = 0; r < m; r++) {
        const float* xr = x + r * n;
        float* o = out + r * n;
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float lane[8], ss = 0.f;
        _mm256_storeu_ps(lane, acc);
        for (int j = 0; j < 8; j++) ss += lane[j];
        for (; i < n; i++) ss += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(ss / n + eps);
        for (i = 0; i < n; i++) o[i] = xr[i] * inv * w[i];
    }
}

// out[r, i] = silu(gu[r, i]) * gu[r, n + i]: the gate and up halves of the fused projection
extern "C" void silu_mul_f32(const float* gu, float* out, int64_t m, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (int64_t r = 0; r < m; r++) {
        const float* g = gu + r * 2 * n;
        const float* u = g + n;
        float* o = out + r * n;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
        for (; i < n; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

// In place, heads [0, heads) of each token of x [t, stride] (head h at h * hd): x * cos + roll(x, hd / 2) * ssin,
// cos and ssin [t, hd] (ssin: sin with rotate_half's sign folded in, see Rope in models/qwen2.py)
extern "C" void rope_f32(float* x, const float* cos, const float* ssin, int64_t t, int64_t heads, int64_t stride,
                         int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t j = 0; j < t; j++)
        for (int64_t h = 0; h < heads; h++) {
            float* v = x + j * stride + h * hd;
            const float* c = cos + j * hd;
            const float* s = ssin + j * hd;
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] + b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
}
