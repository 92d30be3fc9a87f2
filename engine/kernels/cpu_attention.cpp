// Paged decode attention on a CPU, fp32: write each row's new K/V at its slot, then attend over its block table.
//
// One call per layer replaces the torch reference's two index_copy_, two gathers and SDPA; at decode sizes those
// cost more in dispatch than in arithmetic. Query heads are split over OpenMP threads (torch's libgomp).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "cpu_math.h"

static inline float dot(const float* a, const float* b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_hadd_ps(s, s);
    float r = _mm_cvtss_f32(_mm_hadd_ps(s, s));
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

// s[p] = e^(s[p] - top) in place; returns their sum
static inline float exp_shifted(float* s, int64_t n, float top) {
    const __m256 t = _mm256_set1_ps(top);
    __m256 acc = _mm256_setzero_ps();
    int64_t p = 0;
    for (; p + 8 <= n; p += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + p), t));
        _mm256_storeu_ps(s + p, e);
        acc = _mm256_add_ps(acc, e);
    }
    float total = hsum(acc);
    for (; p < n; p++) total += (s[p] = expf(s[p] - top));
    return total;
}

static inline void axpy(float a, const float* x, float* y, int64_t n) {     // y += a * x
    const __m256 av = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

// q, out [B, nh, hd]; k, v [B, n_kv, hd]; caches [slots, n_kv, hd] (one layer); tables [B, width] of block ids.
extern "C" void paged_decode_f32(const float* q, const float* k, const float* v, float* k_cache, float* v_cache,
                                 const int64_t* slots, const int64_t* tables, int64_t width, const int64_t* seq_lens,
                                 int64_t B, int64_t nh, int64_t n_kv, int64_t hd, int64_t bs, float scale,
                                 float* out, int threads) {
    const int64_t row = n_kv * hd, group = nh / n_kv;
    for (int64_t b = 0; b < B; b++) {
        memcpy(k_cache + slots[b] * row, k + b * row, row * sizeof(float));
        memcpy(v_cache + slots[b] * row, v + b * row, row * sizeof(float));
    }
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) work += seq_lens[b];
    #pragma omp parallel num_threads(threads) if (work * nh * hd >= (1 << 17))
    {
        std::vector<float> scores;
        #pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * nh; bh++) {
            const int64_t b = bh / nh, h = bh % nh, len = seq_lens[b], off = (h / group) * hd;
            const float* qh = q + bh * hd;
            const int64_t* table = tables + b * width;
            scores.resize(len);
            float top = -INFINITY;
            for (int64_t p = 0; p < len; p++) {
                const int64_t slot = table[p / bs] * bs + p % bs;
                scores[p] = dot(qh, k_cache + slot * row + off, hd) * scale;
                top = scores[p] > top ? scores[p] : top;
            }
            float total = exp_shifted(scores.data(), len, top);
            float* o = out + bh * hd;
            memset(o, 0, hd * sizeof(float));
            for (int64_t p = 0; p < len; p++) {
                const int64_t slot = table[p / bs] * bs + p % bs;
                axpy(scores[p] / total, v_cache + slot * row + off, o, hd);
            }
        }
    }
}
