// Decode's small fp32 ops on a CPU, each one C call where torch takes several dispatches: RMSNorm and SwiGLU.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

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
    for (int64_t r = 0; r < m; r++) {
        const float* g = gu + r * 2 * n;
        const float* u = g + n;
        float* o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}
