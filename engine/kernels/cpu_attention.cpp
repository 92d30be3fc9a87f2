// Paged decode attention on a CPU, fp32 or bf16 (computed in fp32, the output rounded once): write each row's new K/V at its slot, then attend over its block table.
//
// One call per layer replaces the torch reference's two index_copy_, two gathers and SDPA; at decode sizes those
// cost more in dispatch than in arithmetic. Query heads are split over OpenMP threads (torch's libgomp).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "cpu_math.h"

template <typename T>
static inline float dot(const float* a, const T* b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
    float r = hsum(acc);
    for (; i < n; i++) r += a[i] * widen(b[i]);
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

// One query head over positions [first, len) of its sequence: scores[p] = q.K[p] * scale, softmax,
// o = sum_p w[p] V[p]. K[p] and V[p] are the head's rows in the caches, `row` floats apart within a block, found a
// block at a time through `table`; scores are indexed from `first`.
// HD > 0 is the head size at compile time: q and the output stay in registers. HD == 0 takes any head size.
// qh and o are fp32; the caches are T.
template <int HD, typename T>
static void attend(const float* qh, const T* kc, const T* vc, const int64_t* table, int64_t first, int64_t len,
                   int64_t bs, int64_t row, int64_t hd, float scale, float* scores, float* o) {
    constexpr int R = HD / 8;
    __m256 qv[R > 0 ? R : 1], acc[R > 0 ? R : 1];
    for (int j = 0; j < R; j++) qv[j] = _mm256_loadu_ps(qh + 8 * j);
    float top = -INFINITY;
    scores -= first;
    for (int64_t p0 = first - first % bs; p0 < len; p0 += bs) {
        const int64_t n = len - p0 < bs ? len - p0 : bs;
        const T* kb = kc + table[p0 / bs] * bs * row;
        for (int64_t i = p0 < first ? first - p0 : 0; i < n; i++) {
            const T* kr = kb + i * row;
            float s;
            if constexpr (R > 0) {             // two FMA chains: half the latency a position
                __m256 a = _mm256_mul_ps(qv[0], load8(kr));
                __m256 b = _mm256_mul_ps(qv[1], load8(kr + 8));
                for (int j = 2; j < R; j += 2) {
                    a = _mm256_fmadd_ps(qv[j], load8(kr + 8 * j), a);
                    b = _mm256_fmadd_ps(qv[j + 1], load8(kr + 8 * j + 8), b);
                }
                s = hsum(_mm256_add_ps(a, b)) * scale;
            } else {
                s = dot(qh, kr, hd) * scale;
            }
            scores[p0 + i] = s;
            top = s > top ? s : top;
        }
    }
    const float inv = 1.0f / exp_shifted(scores + first, len - first, top);
    for (int j = 0; j < R; j++) acc[j] = _mm256_setzero_ps();
    if constexpr (R == 0) memset(o, 0, hd * sizeof(float));
    for (int64_t p0 = first - first % bs; p0 < len; p0 += bs) {
        const int64_t n = len - p0 < bs ? len - p0 : bs;
        const T* vb = vc + table[p0 / bs] * bs * row;
        for (int64_t i = p0 < first ? first - p0 : 0; i < n; i++) {
            const T* vr = vb + i * row;
            if constexpr (R > 0) {
                const __m256 w = _mm256_set1_ps(scores[p0 + i]);
                for (int j = 0; j < R; j++) acc[j] = _mm256_fmadd_ps(w, load8(vr + 8 * j), acc[j]);
            } else {
                for (int64_t d = 0; d < hd; d++) o[d] += scores[p0 + i] * widen(vr[d]);
            }
        }
    }
    if constexpr (R > 0) {
        for (int j = 0; j < R; j++) _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(acc[j], _mm256_set1_ps(inv)));
    } else {
        for (int64_t d = 0; d < hd; d++) o[d] *= inv;
    }
}

// q [B, nh, hd] and k, v [B, n_kv, hd], rows q_stride and kv_stride elements apart (slices of one QKV output
// need no copy); out [B, nh, hd]; caches [slots, n_kv, hd] (one layer); tables [B, width] of block ids. A `window`
// > 0 limits each query to its row's last `window` positions (a sliding-window layer).
template <typename T>
static void paged_decode(const T* q, const T* k, const T* v, int64_t q_stride, int64_t kv_stride, T* k_cache,
                         T* v_cache, const int64_t* slots, const int64_t* tables, int64_t width,
                         const int64_t* seq_lens, int64_t B, int64_t nh, int64_t n_kv, int64_t hd, int64_t bs,
                         float scale, int64_t window, T* out, int threads) {
    const int64_t row = n_kv * hd, group = nh / n_kv;
    for (int64_t b = 0; b < B; b++) {
        memcpy(k_cache + slots[b] * row, k + b * kv_stride, row * sizeof(T));
        memcpy(v_cache + slots[b] * row, v + b * kv_stride, row * sizeof(T));
    }
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) work += seq_lens[b];
    #pragma omp parallel num_threads(threads) if (work * nh * hd >= (1 << 17))
    {
        std::vector<float> scores, qf(hd), of(hd);
        #pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * nh; bh++) {
            const int64_t b = bh / nh, h = bh % nh, len = seq_lens[b], off = (h / group) * hd;
            const int64_t first = window > 0 && len > window ? len - window : 0;
            const T *kc = k_cache + off, *vc = v_cache + off;
            const int64_t* table = tables + b * width;
            for (int64_t d = 0; d < hd; d++) qf[d] = widen(q[b * q_stride + h * hd + d]);
            scores.resize(len - first);
            float *sc = scores.data(), *o = of.data();
            if (hd == 64) attend<64>(qf.data(), kc, vc, table, first, len, bs, row, hd, scale, sc, o);
            else if (hd == 128) attend<128>(qf.data(), kc, vc, table, first, len, bs, row, hd, scale, sc, o);
            else if (hd == 256) attend<256>(qf.data(), kc, vc, table, first, len, bs, row, hd, scale, sc, o);
            else attend<0>(qf.data(), kc, vc, table, first, len, bs, row, hd, scale, sc, o);
            for (int64_t d = 0; d < hd; d++) store(out + bh * hd + d, of[d]);
        }
    }
}

extern "C" {
void paged_decode_f32(const float* q, const float* k, const float* v, int64_t q_stride, int64_t kv_stride,
                      float* k_cache, float* v_cache, const int64_t* slots, const int64_t* tables, int64_t width,
                      const int64_t* seq_lens, int64_t B, int64_t nh, int64_t n_kv, int64_t hd, int64_t bs,
                      float scale, int64_t window, float* out, int threads) {
    paged_decode(q, k, v, q_stride, kv_stride, k_cache, v_cache, slots, tables, width, seq_lens, B, nh, n_kv, hd, bs,
                 scale, window, out, threads);
}
void paged_decode_bf16(const bf16* q, const bf16* k, const bf16* v, int64_t q_stride, int64_t kv_stride,
                       bf16* k_cache, bf16* v_cache, const int64_t* slots, const int64_t* tables, int64_t width,
                       const int64_t* seq_lens, int64_t B, int64_t nh, int64_t n_kv, int64_t hd, int64_t bs,
                       float scale, int64_t window, bf16* out, int threads) {
    paged_decode(q, k, v, q_stride, kv_stride, k_cache, v_cache, slots, tables, width, seq_lens, B, nh, n_kv, hd, bs,
                 scale, window, out, threads);
}
}
