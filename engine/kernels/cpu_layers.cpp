// Every layer of a decode step in one call, fp32 or bf16, over paged KV or dense (a buffer per row): per layer the
// fused calls of Layer.fused in models/decoder.py (RMSNorm + QKV, q/k norms, RoPE, KV write + attention, o_proj
// (+ its norm) + residual, RMSNorm + gate/up, gated activation + down (+ its norm) + residual), with no Python
// between them. The kernels are the ones the per-call path uses (cpu_gemv, cpu_pointwise, cpu_attention), so both
// paths compute the same thing.
#include <stdint.h>
#include <vector>

#include "cpu_math.h"

extern "C" {
void gemv_fused_f32(const float*, int64_t, const float*, const float*, float*, int64_t, int64_t, int, const float*,
                    float, int, const float*);
void gemv_fused_bf16(const bf16*, int64_t, const bf16*, const bf16*, bf16*, int64_t, int64_t, int, const bf16*, float,
                     int, const bf16*);
struct Mat;
void qgemv_fused(const float*, int64_t, const Mat*, const float*, float*, int64_t, int64_t, int, const float*, float,
                 int, const float*);
void rope_f32(float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t);
void rms_norm_f32(const float*, const float*, float, float*, int64_t, int64_t, int, const float*);
void rms_norm_bf16(const bf16*, const bf16*, float, bf16*, int64_t, int64_t, int, const bf16*);
void norm_heads_f32(float*, const float*, float, int64_t, int64_t, int64_t, int64_t, int);
void norm_heads_bf16(bf16*, const bf16*, float, int64_t, int64_t, int64_t, int64_t, int);
void rope_bf16(bf16*, const bf16*, const bf16*, int64_t, int64_t, int64_t, int64_t);
void paged_decode_f32(const float*, const float*, const float*, int64_t, int64_t, float*, float*, const int64_t*,
                      const int64_t*, int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                      int64_t, float*, int);
void paged_decode_bf16(const bf16*, const bf16*, const bf16*, int64_t, int64_t, bf16*, bf16*, const int64_t*,
                       const int64_t*, int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                       int64_t, bf16*, int);
}

static void fused(const float* x, int64_t m, const float* w, const float* b, float* y, int64_t n, int64_t k, int t,
                  const float* norm, float eps, int mode, const float* res) {
    gemv_fused_f32(x, m, w, b, y, n, k, t, norm, eps, mode, res);
}
static void fused(const bf16* x, int64_t m, const bf16* w, const bf16* b, bf16* y, int64_t n, int64_t k, int t,
                  const bf16* norm, float eps, int mode, const bf16* res) {
    gemv_fused_bf16(x, m, w, b, y, n, k, t, norm, eps, mode, res);
}
static void norm(const float* x, const float* w, float eps, float* out, int64_t m, int64_t n, int g, const float* r) {
    rms_norm_f32(x, w, eps, out, m, n, g, r);
}
static void norm(const bf16* x, const bf16* w, float eps, bf16* out, int64_t m, int64_t n, int g, const bf16* r) {
    rms_norm_bf16(x, w, eps, out, m, n, g, r);
}
static void heads(float* x, const float* w, float eps, int64_t t, int64_t h, int64_t st, int64_t hd, int g) {
    norm_heads_f32(x, w, eps, t, h, st, hd, g);
}
static void heads(bf16* x, const bf16* w, float eps, int64_t t, int64_t h, int64_t st, int64_t hd, int g) {
    norm_heads_bf16(x, w, eps, t, h, st, hd, g);
}
static void rope(float* x, const float* c, const float* s, int64_t t, int64_t h, int64_t st, int64_t hd) {
    rope_f32(x, c, s, t, h, st, hd);
}
static void rope(bf16* x, const bf16* c, const bf16* s, int64_t t, int64_t h, int64_t st, int64_t hd) {
    rope_bf16(x, c, s, t, h, st, hd);
}
// y = a projection of x as fused computes it, by a float weight w or, where q is set, by blocks (cpu_quant.cpp: fp32)
template <typename T>
static void project(const void* q, const T* x, int64_t m, const void* w, const void* b, T* y, int64_t n, int64_t k,
                    int t, const void* norm, float eps, int mode, const T* res) {
    if constexpr (sizeof(T) == 4)
        if (q != nullptr)
            return qgemv_fused(x, m, (const Mat*)q, (const float*)b, y, n, k, t, (const float*)norm, eps, mode, res);
    fused(x, m, (const T*)w, (const T*)b, y, n, k, t, (const T*)norm, eps, mode, res);
}

// q, k and v: slices of each row of qkv, `stride` apart
static void attend(const float* qkv, int64_t stride, float* kc, float* vc, const int64_t* slots,
                   const int64_t* tables, int64_t width, const int64_t* lens, int64_t m, int64_t nh, int64_t nkv,
                   int64_t hd, int64_t bs, float scale, int64_t window, float* out, int t) {
    paged_decode_f32(qkv, qkv + nh * hd, qkv + (nh + nkv) * hd, stride, stride, kc, vc, slots, tables, width, lens,
                     m, nh, nkv, hd, bs, scale, window, out, t);
}
static void attend(const bf16* qkv, int64_t stride, bf16* kc, bf16* vc, const int64_t* slots,
                   const int64_t* tables, int64_t width, const int64_t* lens, int64_t m, int64_t nh, int64_t nkv,
                   int64_t hd, int64_t bs, float scale, int64_t window, bf16* out, int t) {
    paged_decode_bf16(qkv, qkv + nh * hd, qkv + (nh + nkv) * hd, stride, stride, kc, vc, slots, tables, width, lens,
                      m, nh, nkv, hd, bs, scale, window, out, t);
}

// One layer's weights, each of the model's dtype (biases and the family's optional norms null where it has none; a
// projection in blocks has its Mat in the *_q field instead, fp32 only),
// its sliding window (0: none), which of the step's two RoPE tables it takes (Gemma 3: local or global), its KV
// layer group (engine/kv/layout.py: the slots and block tables it uses) and its page of a block (its K (V) cache
// starts page * cache_layer elements in)
struct Weights {
    const void *qkv_w, *qkv_b, *o_w, *o_b, *gate_up_w, *gate_up_b, *down_w, *down_b, *input_norm, *post_norm,
        *q_norm, *k_norm, *attn_out_norm, *mlp_out_norm, *qkv_q, *o_q, *gate_up_q, *down_q;
    int64_t window, rope, group, page;
};

// The model's sizes and the caches' layout; mode: the gated activation (SILU or GELU) and GEMMA_NORM (cpu_math.h)
struct Dims {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, block_size, cache_layer, mode;
    float eps, scale;
};

// Dense KV: row c's own buffer [layers, 2 (K, V), caps[c], n_kv, head_dim] at bufs[c]. Each is one block of
// caps[c] positions to paged_decode, the row's new token at its last position (lens[c] - 1).
struct Dense {
    void* const* bufs;
    const int64_t* caps;
};

// x [m, hidden] in and out; cos[i], ssin[i] [m, head_dim] (RoPE table i); lens [m]; paged KV: slots [groups, m],
// tables [groups, m, width] (group g's as for paged_decode); or dense KV where `dense` is set (the paged arguments
// are then unused)
template <typename T>
static void run(const Weights* layers, const Dims* d, T* x, int64_t m, const T* const* cos, const T* const* ssin,
                T* k_cache, T* v_cache, const int64_t* slots, const int64_t* tables, int64_t width,
                const int64_t* lens, const Dense* dense, int threads) {
    const int64_t hd = d->head_dim, q_n = d->heads * hd, kv_n = d->kv_heads * hd, qkv_n = q_n + 2 * kv_n;
    const int gemma = (d->mode & GEMMA_NORM) ? 1 : 0, act = (int)(d->mode & (SILU | GELU));
    thread_local std::vector<T> qkv, att, mid, gate_up, out;
    qkv.resize(m * qkv_n), att.resize(m * q_n), out.resize(m * d->hidden);
    mid.resize(m * d->hidden), gate_up.resize(m * 2 * d->intermediate);
    const int q8 = (int)(d->mode & (Q8X | Q16X | MIXED));  // blocks: x in int8 (and a second digit) for their products
    for (int64_t l = 0; l < d->layers; l++) {
        const Weights& w = layers[l];
        project(w.qkv_q, x, m, w.qkv_w, w.qkv_b, qkv.data(), qkv_n, d->hidden, threads, w.input_norm, d->eps,
                gemma * GEMMA_NORM | q8, (const T*)nullptr);
        if (w.q_norm != nullptr) {
            heads(qkv.data(), (const T*)w.q_norm, d->eps, m, d->heads, qkv_n, hd, gemma);
            heads(qkv.data() + q_n, (const T*)w.k_norm, d->eps, m, d->kv_heads, qkv_n, hd, gemma);
        }
        rope(qkv.data(), cos[w.rope], ssin[w.rope], m, d->heads + d->kv_heads, qkv_n, hd);
        if (dense == nullptr) {
            attend(qkv.data(), qkv_n, k_cache + w.page * d->cache_layer, v_cache + w.page * d->cache_layer,
                   slots + w.group * m, tables + w.group * m * width, width, lens, m, d->heads, d->kv_heads, hd,
                   d->block_size, d->scale, w.window, att.data(), threads);
        } else {
            for (int64_t c = 0; c < m; c++) {
                const int64_t cap = dense->caps[c], slot = lens[c] - 1, block = 0;
                T* kc = (T*)dense->bufs[c] + l * 2 * cap * kv_n;
                attend(qkv.data() + c * qkv_n, qkv_n, kc, kc + cap * kv_n, &slot, &block, 1, lens + c, 1, d->heads,
                       d->kv_heads, hd, cap, d->scale, w.window, att.data() + c * q_n, threads);
            }
        }
        if (w.attn_out_norm == nullptr) {        // mid = x + o_proj(att)
            project(w.o_q, att.data(), m, w.o_w, w.o_b, mid.data(), d->hidden, q_n, threads, nullptr, 0.f, q8, x);
        } else {                                 // mid = x + norm(o_proj(att))
            project(w.o_q, att.data(), m, w.o_w, w.o_b, out.data(), d->hidden, q_n, threads, nullptr, 0.f, q8,
                    (const T*)nullptr);
            norm(out.data(), (const T*)w.attn_out_norm, d->eps, mid.data(), m, d->hidden, gemma, x);
        }
        project(w.gate_up_q, mid.data(), m, w.gate_up_w, w.gate_up_b, gate_up.data(), 2 * d->intermediate,
                d->hidden, threads, w.post_norm, d->eps, gemma * GEMMA_NORM | q8, (const T*)nullptr);
        if (w.mlp_out_norm == nullptr) {         // x = mid + down(act(gate) * up)
            project(w.down_q, gate_up.data(), m, w.down_w, w.down_b, x, d->hidden, d->intermediate, threads,
                    nullptr, 0.f, act | q8, mid.data());
        } else {                                 // x = mid + norm(down(act(gate) * up))
            project(w.down_q, gate_up.data(), m, w.down_w, w.down_b, out.data(), d->hidden, d->intermediate,
                    threads, nullptr, 0.f, act | q8, (const T*)nullptr);
            norm(out.data(), (const T*)w.mlp_out_norm, d->eps, x, m, d->hidden, gemma, mid.data());
        }
    }
}

extern "C" {
void decode_layers_f32(const Weights* layers, const Dims* d, float* x, int64_t m, const float* const* cos,
                       const float* const* ssin, float* k_cache, float* v_cache, const int64_t* slots,
                       const int64_t* tables, int64_t width, const int64_t* lens, const Dense* dense, int threads) {
    run(layers, d, x, m, cos, ssin, k_cache, v_cache, slots, tables, width, lens, dense, threads);
}
void decode_layers_bf16(const Weights* layers, const Dims* d, bf16* x, int64_t m, const bf16* const* cos,
                        const bf16* const* ssin, bf16* k_cache, bf16* v_cache, const int64_t* slots,
                        const int64_t* tables, int64_t width, const int64_t* lens, const Dense* dense, int threads) {
    run(layers, d, x, m, cos, ssin, k_cache, v_cache, slots, tables, width, lens, dense, threads);
}
}
