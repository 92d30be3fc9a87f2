// GGUF's block formats (llama.cpp's), unpacked for the block kernels (cpu_quant.cpp): each type's weights as int8
// in weight order with a scale per SUB weights (and the K-quants' mins), or, for the float types, widened to fp32.
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"

// GGML's type ids
enum { F32 = 0, F16 = 1, Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14, BF16 = 30 };

// packed: rows in groups of 8 (cpu_packed.h), the rows past the last whole group in the file's layout after them
struct Part {
    const uint8_t* data;
    int64_t type, rows, row_bytes, packed;
};
// A projection's weight: parts stacked by rows (a fused projection), each in its own block type
struct Mat {
    int64_t parts;
    Part part[3];
};

static inline float half(const uint8_t* p) { return _cvtsh_ss(*(const uint16_t*)p); }
static inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
static inline __m256i high4(__m256i v) { return low4(_mm256_srli_epi16(v, 4)); }
// 8 int8 weights widened to fp32 lanes
static inline __m256 widen8(const int8_t* q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)q))); }

// Each type's block holds QK weights in BYTES bytes. `unpack` gives them as int8 in weight order (in buf, or in the
// block itself) with a scale per SUB weights and, for the K-quants (MIN), a min: weight = scale * q - min. The float
// types have no such form: FLOAT, and `deq` widens them.
template <int T> struct Block;

template <> struct Block<F32> {
    static constexpr int QK = 32, BYTES = 128;
    static constexpr bool FLOAT = true;
    static void deq(const uint8_t* b, float* out) { memcpy(out, b, BYTES); }
};
template <> struct Block<F16> {
    static constexpr int QK = 32, BYTES = 64;
    static constexpr bool FLOAT = true;
    static void deq(const uint8_t* b, float* out) {
        for (int v = 0; v < 4; v++) _mm256_storeu_ps(out + 8 * v, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + 16 * v))));
    }
};
template <> struct Block<BF16> {
    static constexpr int QK = 32, BYTES = 64;
    static constexpr bool FLOAT = true;
    static void deq(const uint8_t* b, float* out) { for (int v = 0; v < 4; v++) _mm256_storeu_ps(out + 8 * v, load8((const bf16*)b + 8 * v)); }
};
// d (f16), 32 int8
template <> struct Block<Q8_0> {
    static constexpr int QK = 32, BYTES = 34, SUB = 32;
    static constexpr bool FLOAT = false, MIN = false;
    static const int8_t* unpack(const uint8_t* b, int8_t*, float* sc, float*) {
        sc[0] = half(b);
        return (const int8_t*)(b + 2);
    }
};
// d (f16), 16 bytes: weight i < 16 is the low nibble of byte i, weight 16 + i its high nibble; minus 8
template <> struct Block<Q4_0> {
    static constexpr int QK = 32, BYTES = 18, SUB = 32;
    static constexpr bool FLOAT = false, MIN = false;
    static const int8_t* unpack(const uint8_t* b, int8_t* buf, float* sc, float*) {
        sc[0] = half(b);
        const __m128i raw = _mm_loadu_si128((const __m128i*)(b + 2));
        const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
        _mm256_storeu_si256((__m256i*)buf, _mm256_sub_epi8(low4(both), _mm256_set1_epi8(8)));
        return buf;
    }
};
// d (f16), qh (32 bits: weight i's fifth bit is bit i), 16 bytes of nibbles as Q4_0; minus 16
template <> struct Block<Q5_0> {
    static constexpr int QK = 32, BYTES = 22, SUB = 32;
    static constexpr bool FLOAT = false, MIN = false;
    static const int8_t* unpack(const uint8_t* b, int8_t* buf, float* sc, float*) {
        sc[0] = half(b);
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        const __m128i raw = _mm_loadu_si128((const __m128i*)(b + 6));
        const __m256i nib = low4(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw));
        // byte i of the 32 holds byte i / 8 of qh, then tests its bit i % 8
        const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
            _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
        _mm256_storeu_si256((__m256i*)buf, _mm256_sub_epi8(_mm256_or_si256(nib, high), _mm256_set1_epi8(16)));
        return buf;
    }
};
// 256 weights: d, dmin (f16), 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles. Sub-block j (32
// weights) is d * scale_j * q - dmin * min_j; sub-blocks 2i and 2i + 1 are the low and high nibbles of bytes
// [32i, 32i + 32).
template <> struct Block<Q4_K> {
    static constexpr int QK = 256, BYTES = 144, SUB = 32;
    static constexpr bool FLOAT = false, MIN = true;
    static const int8_t* unpack(const uint8_t* b, int8_t* buf, float* sc, float* mn) {
        // the 6-bit scales and mins, four bytes at a time: sub-block j < 4 has the low 6 bits of bytes j (scale) and
        // 4 + j (min); j >= 4 the nibbles of byte 4 + j under the top 2 bits of bytes j - 4 and j
        uint32_t w[3];
        memcpy(w, b + 4, 12);
        const uint32_t six = 0x3F3F3F3F, four = 0x0F0F0F0F, two = 0x03030303;
        const uint32_t sm[4] = {w[0] & six, (w[2] & four) | (((w[0] >> 6) & two) << 4), w[1] & six,
                                ((w[2] >> 4) & four) | (((w[1] >> 6) & two) << 4)};
        const __m128i all = _mm_loadu_si128((const __m128i*)sm);                   // 8 scales, 8 mins
        const __m256 d = _mm256_set1_ps(half(b)), dmin = _mm256_set1_ps(half(b + 2));
        _mm256_storeu_ps(sc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(all))));
        _mm256_storeu_ps(mn, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(all, 8)))));
        for (int i = 0; i < 4; i++) {
            const __m256i raw = load32(b + 16 + 32 * i);
            _mm256_storeu_si256((__m256i*)(buf + 64 * i), low4(raw));
            _mm256_storeu_si256((__m256i*)(buf + 64 * i + 32), high4(raw));
        }
        return buf;
    }
};
// 256 weights: 128 bytes of low nibbles (ql), 64 of high 2-bit pairs (qh), 16 int8 scales, d (f16); weight =
// d * scale * (6-bit q - 32). Per half h of 128 weights and l < 32: weight 32i + l (i < 4) is the low (i < 2) or
// high nibble of ql[64h + 32 (i & 1) + l] with bits 2i of qh[32h + l] above it; its scale is the (weight / 16)th.
template <> struct Block<Q6_K> {
    static constexpr int QK = 256, BYTES = 210, SUB = 16;
    static constexpr bool FLOAT = false, MIN = false;
    static const int8_t* unpack(const uint8_t* b, int8_t* buf, float* sc, float*) {
        const __m256 d = _mm256_set1_ps(half(b + 208));
        for (int j = 0; j < 16; j += 8)
            _mm256_storeu_ps(sc + j, _mm256_mul_ps(d, widen8((const int8_t*)(b + 192) + j)));
        const __m256i three = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
        for (int h = 0; h < 2; h++) {
            const __m256i a = load32(b + 64 * h), c = load32(b + 64 * h + 32), qh = load32(b + 128 + 32 * h);
            const __m256i nib[4] = {low4(a), low4(c), high4(a), high4(c)};
            for (int i = 0; i < 4; i++) {
                const __m256i top = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), three), 4);
                _mm256_storeu_si256((__m256i*)(buf + 128 * h + 32 * i), _mm256_sub_epi8(_mm256_or_si256(nib[i], top), off));
            }
        }
        return buf;
    }
};

// Block b of a row as fp32, out[QK], as gguf.quants.dequantize computes it: scale * q - min
template <int T>
static void deq(const uint8_t* b, float* out) {
    using B = Block<T>;
    if constexpr (B::FLOAT) {
        B::deq(b, out);
    } else {
        alignas(32) int8_t buf[B::QK];
        float sc[B::QK / B::SUB], mn[B::QK / B::SUB];
        const int8_t* q = B::unpack(b, buf, sc, mn);
        for (int i = 0; i < B::QK; i += 8) {
            __m256 w = _mm256_mul_ps(widen8(q + i), _mm256_set1_ps(sc[i / B::SUB]));
            if (B::MIN) w = _mm256_sub_ps(w, _mm256_set1_ps(mn[i / B::SUB]));
            _mm256_storeu_ps(out + i, w);
        }
    }
}

