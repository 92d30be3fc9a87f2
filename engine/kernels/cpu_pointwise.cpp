// Decode's small ops on a CPU, each one C call where torch takes several dispatches: RMSNorm (with a residual, and per
// head), and RoPE, fp32 or bf16; and greedy sampling's argmax over a step's logits
// (bf16 computed in fp32 and rounded where the model's torch path rounds). SwiGLU runs inside the GEMV (cpu_gemv).
#include <immintrin.h>
#include <stdint.h>

#include <vector>

#include "cpu_math.h"

// out [m, n] = norm(x) (Gemma's when gemma), plus residual [m, n] where given (then rounded as T rounds the sum:
// Gemma's sandwich norms); out may be x or residual.
template <typename T>
static void rms_norm(const T* x, const T* w, float eps, T* out, int64_t m, int64_t n, int gemma, const T* residual) {
    std::vector<float> row(n);
    for (int64_t r = 0; r < m; r++) {
        norm_row(x + r * n, w, eps, row.data(), n, gemma);
        if (residual != nullptr)
            for (int64_t i = 0; i < n; i++) store(out + r * n + i, widen(residual[r * n + i]) + row[i]);
        else
            for (int64_t i = 0; i < n; i++) store(out + r * n + i, row[i]);
    }
}

// In place, heads [0, heads) of each token of x [t, stride] (head h at h * hd): each head RMS-normalised by w [hd]
// (Qwen3's and Gemma 3's q/k norms)
template <typename T>
static void norm_heads(T* x, const T* w, float eps, int64_t t, int64_t heads, int64_t stride, int64_t hd, int gemma) {
    for (int64_t j = 0; j < t; j++) rms_norm(x + j * stride, w, eps, x + j * stride, heads, hd, gemma, (const T*)0);
}

// In place, heads [0, heads) of each token of x [t, stride] (head h at h * hd): x * cos + roll(x, hd / 2) * ssin,
// cos and ssin [t, hd] (ssin: sin with rotate_half's sign folded in, see Rope in models/decoder.py). For bf16 rounded
// as torch.addcmul(x * cos, ...) rounds: the product, then the sum.
template <typename T>
static void rope(T* x, const T* cos, const T* ssin, int64_t t, int64_t heads, int64_t stride, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t j = 0; j < t; j++)
        for (int64_t h = 0; h < heads; h++) {
            T* v = x + j * stride + h * hd;
            const T* c = cos + j * hd;
            const T* s = ssin + j * hd;
            for (int64_t i = 0; i < half; i++) {
                const float a = widen(v[i]), b = widen(v[i + half]);
                store(v + i, round_as<T>(a * widen(c[i])) + b * widen(s[i]));
                store(v + i + half, round_as<T>(b * widen(c[i + half])) + a * widen(s[i + half]));
            }
        }
}

// The index of the largest of x[0, n) (the first of equals; the first NaN where there is one, as torch.argmax): the
// largest value in four independent chains of 8 lanes, then the first lane equal to it (or unordered)
static int64_t argmax_row(const float* x, int64_t n) {
    __m256 best[4], nan = _mm256_setzero_ps();
    for (auto& b : best) b = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int c = 0; c < 4; c++) {
            const __m256 v = _mm256_loadu_ps(x + i + 8 * c);
            best[c] = _mm256_max_ps(best[c], v), nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(best[0], best[1]), _mm256_max_ps(best[2], best[3])));
    float top = lanes[0];
    for (int j = 1; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
    bool any_nan = !_mm256_testz_ps(nan, nan);
    for (int64_t j = i; j < n; j++) any_nan |= x[j] != x[j], top = x[j] > top ? x[j] : top;
    const __m256 want = _mm256_set1_ps(top);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(v, any_nan ? v : want, any_nan ? _CMP_UNORD_Q : _CMP_EQ_OQ));
        if (hit) return j + __builtin_ctz(hit);
    }
    for (; j < n; j++)
        if (any_nan ? x[j] != x[j] : x[j] == top) return j;
    return 0;
}

extern "C" {
void argmax_f32(const float* x, int64_t m, int64_t n, int64_t* out) {
    for (int64_t r = 0; r < m; r++) out[r] = argmax_row(x + r * n, n);
}
void rms_norm_f32(const float* x, const float* w, float eps, float* out, int64_t m, int64_t n, int gemma,
                  const float* residual) {
    rms_norm(x, w, eps, out, m, n, gemma, residual);
}
void rms_norm_bf16(const bf16* x, const bf16* w, float eps, bf16* out, int64_t m, int64_t n, int gemma,
                   const bf16* residual) {
    rms_norm(x, w, eps, out, m, n, gemma, residual);
}
void norm_heads_f32(float* x, const float* w, float eps, int64_t t, int64_t heads, int64_t stride, int64_t hd,
                    int gemma) {
    norm_heads(x, w, eps, t, heads, stride, hd, gemma);
}
void norm_heads_bf16(bf16* x, const bf16* w, float eps, int64_t t, int64_t heads, int64_t stride, int64_t hd,
                     int gemma) {
    norm_heads(x, w, eps, t, heads, stride, hd, gemma);
}
void rope_f32(float* x, const float* cos, const float* ssin, int64_t t, int64_t heads, int64_t stride, int64_t hd) {
    rope(x, cos, ssin, t, heads, stride, hd);
}
void rope_bf16(bf16* x, const bf16* cos, const bf16* ssin, int64_t t, int64_t heads, int64_t stride, int64_t hd) {
    rope(x, cos, ssin, t, heads, stride, hd);
}
}
