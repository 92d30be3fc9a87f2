// A quantized weight's rows interleaved in groups of 8 (at load, for decode's integer GEMV in cpu_quant.cpp). In the
// file's layout a row's blocks follow each other, so a GEMV multiplies one row at a time and pays per block for the
// scale, the conversion to fp32 and the horizontal sum. Here one 32-byte vector holds 4 weights of each of 8 rows
// (lane = row), so one int8 dot product with 4 broadcast values of x advances 8 rows, and the scaling is one vector
// operation for 8 rows. A group's bytes per block column: the 8 rows' scales first, then the weights' bits.
//
// Weights are kept unsigned (q + OFF = the file's unsigned integers; Q8_0's with its top bit flipped), as vpdpbusd
// multiplies unsigned by signed: the offset's share, OFF times x's sum, is taken off once per scale unit.
#pragma once
#include "cpu_blocks.h"

constexpr int G = 8;    // rows a group

// a group's 32-byte chunk of nibbles holds 4 weights of each row for two groups of 4: low (g) and high (g + 4)
static inline __m256i nibble(const uint8_t* chunks, int g) {
    const __m256i v = load32(chunks + 32 * (g & 3));
    return g < 4 ? low4(v) : high4(v);
}
static inline void put_nibbles(const uint8_t q[G][32], uint8_t* chunks) {
    for (int c = 0; c < 4; c++)
        for (int r = 0; r < G; r++)
            for (int i = 0; i < 4; i++) chunks[32 * c + 4 * r + i] = (q[r][4 * c + i] & 15) | (q[r][4 * c + 16 + i] << 4);
}
static inline uint8_t nib(const uint8_t* b, int i) { return i < 16 ? b[i] & 15 : b[i - 16] >> 4; }

// 8 rows' 4 weights (u8, lane = row) times x's 4 values at x (int8, broadcast), added to each lane's int32
template <int OFF>
static inline __m256i dot4(__m256i acc, __m256i q, const int8_t* x) {
    int32_t four;
    memcpy(&four, x, 4);
    const __m256i xv = _mm256_set1_epi32(four);
#ifdef __AVX512VNNI__
    return _mm256_dpbusd_epi32(acc, q, xv);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (OFF == 128) {       // maddubs would saturate at 255 * 127 * 2: signed weights, x takes their sign
        const __m256i s = _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80));
        return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(s, s), _mm256_sign_epi8(xv, s)), ones));
    } else {
        return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones));
    }
#endif
}
#ifndef __AVX512VNNI__
// Without VNNI a dot4 is two multiplies (maddubs, then madd to widen its int16 pair sums), which bound a step of
// several rows on an AVX2 CPU. A unit's groups share one scale, so where the weights are small their pair sums
// (at most 2 x q_max x 127 with |x| <= 127) add up in int16 over RUN groups and widen once: Q4's 8 (8 x 3810),
// Q5_0's 4 (4 x 7874), Q6_K's 2 (2 x 16002); Q8_0's 32258 leaves no room.
template <int OFF>
constexpr int RUN = OFF == 0 || OFF == 8 ? 8 : OFF == 16 ? 4 : OFF == 32 ? 2 : 1;

template <int OFF, int N>
static inline __m256i dot_run(__m256i acc, const __m256i* q, const int8_t* x) {
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < N; j++) {
        int32_t four;
        memcpy(&four, x + 4 * j, 4);
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(q[j], _mm256_set1_epi32(four)));
    }
    return _mm256_add_epi32(acc, _mm256_madd_epi16(sum, _mm256_set1_epi16(1)));
}
#endif
// the int32 a unit's dot products start from: minus OFF times the sum of its x (isum); OFF = 128 without VNNI is
// signed already
template <int OFF>
static inline __m256i start(int isum) {
#ifndef __AVX512VNNI__
    if constexpr (OFF == 128) return _mm256_setzero_si256();
#endif
    return _mm256_set1_epi32(-OFF * isum);
}
static inline __m256 halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// x of one input row as the products read it, at a block column: int8 values, scale per 32 (dx), sums of the
// rounded values per 32 (xs, fp32: of both digits) and per 16 (i16, int); a second digit (Input's rest) where
// `q2` is set
struct XBlock {
    const int8_t* q;
    const float *dx, *xs;
    const int* i16;
    const int8_t* q2;
    const float* dx2;
    const int* i16b;
};

template <int T> struct Packed;

// d[8] (f16); then per group of 4 weights a chunk (8 rows x 4 bytes)
template <> struct Packed<Q8_0> {
    static constexpr int BYTES = 16 + 256, OFF = 128, UNIT = 32;
    static constexpr bool MIN = false;
    static void pack(const uint8_t* const src[G], uint8_t* dst) {
        for (int r = 0; r < G; r++) {
            memcpy(dst + 2 * r, src[r], 2);
            for (int g = 0; g < 8; g++)
                for (int i = 0; i < 4; i++) dst[16 + 32 * g + 4 * r + i] = src[r][2 + 4 * g + i] ^ 0x80;
        }
    }
    static __m256i q(const uint8_t* p, int, int g) { return load32(p + 16 + 32 * g); }
    static __m256 scale(const uint8_t* p, int) { return halves(p); }
    static __m256 mins(const uint8_t*, int) { return _mm256_setzero_ps(); }
};
// d[8] (f16); four chunks of nibbles
template <> struct Packed<Q4_0> {
    static constexpr int BYTES = 16 + 128, OFF = 8, UNIT = 32;
    static constexpr bool MIN = false;
    static void pack(const uint8_t* const src[G], uint8_t* dst) {
        uint8_t q[G][32];
        for (int r = 0; r < G; r++) {
            memcpy(dst + 2 * r, src[r], 2);
            for (int i = 0; i < 32; i++) q[r][i] = nib(src[r] + 2, i);
        }
        put_nibbles(q, dst + 16);
    }
    static __m256i q(const uint8_t* p, int, int g) { return nibble(p + 16, g); }
    static __m256 scale(const uint8_t* p, int) { return halves(p); }
    static __m256 mins(const uint8_t*, int) { return _mm256_setzero_ps(); }
};
// d[8] (f16); per group a 32-bit mask of the fifth bits (bit 4r + i: row r's weight 4g + i); four chunks of nibbles
template <> struct Packed<Q5_0> {
    static constexpr int BYTES = 16 + 32 + 128, OFF = 16, UNIT = 32;
    static constexpr bool MIN = false;
    static void pack(const uint8_t* const src[G], uint8_t* dst) {
        uint8_t q[G][32];
        uint32_t high[8] = {};
        for (int r = 0; r < G; r++) {
            memcpy(dst + 2 * r, src[r], 2);
            uint32_t qh;
            memcpy(&qh, src[r] + 2, 4);
            for (int i = 0; i < 32; i++) {
                q[r][i] = nib(src[r] + 6, i);
                high[i / 4] |= ((qh >> i) & 1u) << (4 * r + i % 4);
            }
        }
        memcpy(dst + 16, high, 32);
        put_nibbles(q, dst + 48);
    }
    static __m256i q(const uint8_t* p, int, int g) {
        uint32_t qh;
        memcpy(&qh, p + 16 + 4 * g, 4);
        const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
            _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
        return _mm256_or_si256(nibble(p + 48, g), high);
    }
    static __m256 scale(const uint8_t* p, int) { return halves(p); }
    static __m256 mins(const uint8_t*, int) { return _mm256_setzero_ps(); }
};

static inline __m256 bytes8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))); }

// d[8], dmin[8] (f16); per 32-weight unit its 8 rows' 6-bit scales, then mins, as bytes; per unit four chunks of nibbles
template <> struct Packed<Q4_K> {
    static constexpr int BYTES = 32 + 64 + 64 + 1024, OFF = 0, UNIT = 32;
    static constexpr bool MIN = true;
    static void pack(const uint8_t* const src[G], uint8_t* dst) {
        for (int r = 0; r < G; r++) {
            const uint8_t* b = src[r];
            const uint8_t* s = b + 4;
            memcpy(dst + 2 * r, b, 2), memcpy(dst + 16 + 2 * r, b + 2, 2);
            for (int j = 0; j < 8; j++) {
                dst[32 + 8 * j + r] = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
                dst[96 + 8 * j + r] = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | (s[j] >> 6) << 4;
            }
        }
        for (int j = 0; j < 8; j++) {
            uint8_t q[G][32];
            for (int r = 0; r < G; r++)
                for (int i = 0; i < 32; i++) q[r][i] = src[r][16 + 32 * (j / 2) + i] >> (j % 2 ? 4 : 0) & 15;
            put_nibbles(q, dst + 160 + 128 * j);
        }
    }
    static __m256i q(const uint8_t* p, int col, int g) { return nibble(p + 160 + 128 * col, g); }
    static __m256 scale(const uint8_t* p, int u) { return _mm256_mul_ps(halves(p), bytes8(p + 32 + 8 * u)); }
    static __m256 mins(const uint8_t* p, int u) { return _mm256_mul_ps(halves(p + 16), bytes8(p + 96 + 8 * u)); }
};
// d[8] (f16); per 16-weight unit its 8 rows' int8 scales; per 32-weight column 192 bytes, the file's 6 bits a weight:
// four chunks whose bytes hold groups 0-3's values whole (bits 0-5) and groups 4-7's top 2 bits (6-7), then two
// chunks of groups 4-7's low nibbles. A group is then one load and one mask, or two loads and four operations; the
// file's layout took five operations for every group, and a Q4_K_M file's head (Q6_K) read at half Q8_0's bandwidth
template <> struct Packed<Q6_K> {
    static constexpr int BYTES = 16 + 128 + 192 * 8, OFF = 32, UNIT = 16;
    static constexpr bool MIN = false;
    static int six(const uint8_t* b, int n) {     // weight n of a file block, unsigned
        const int h = n / 128, i = n % 128 / 32, l = n % 32;
        return (b[64 * h + 32 * (i & 1) + l] >> (i < 2 ? 0 : 4) & 15) | (b[128 + 32 * h + l] >> (2 * i) & 3) << 4;
    }
    static void pack(const uint8_t* const src[G], uint8_t* dst) {
        memset(dst, 0, BYTES);
        for (int r = 0; r < G; r++) {
            memcpy(dst + 2 * r, src[r] + 208, 2);
            for (int u = 0; u < 16; u++) dst[16 + 8 * u + r] = src[r][192 + u];
            for (int n = 0; n < 256; n++) {
                const int v = six(src[r], n), g = n % 32 / 4, at = 4 * r + n % 4;
                uint8_t* col = dst + 144 + 192 * (n / 32);
                if (g < 4) {
                    col[32 * g + at] |= v;
                } else {
                    col[32 * (g - 4) + at] |= (v >> 4) << 6;
                    col[128 + 32 * (g & 1) + at] |= (v & 15) << (g < 6 ? 0 : 4);
                }
            }
        }
    }
    static __m256i q(const uint8_t* p, int col, int g) {
        const uint8_t* c = p + 144 + 192 * col;
        const __m256i whole = load32(c + 32 * (g & 3));
        if (g < 4) return _mm256_and_si256(whole, _mm256_set1_epi8(63));
        const __m256i low = load32(c + 128 + 32 * (g & 1));
        const __m256i top = _mm256_and_si256(_mm256_srli_epi16(whole, 2), _mm256_set1_epi8(0x30));
        return _mm256_or_si256(g < 6 ? low4(low) : high4(low), top);
    }
    static __m256 scale(const uint8_t* p, int u) {
        return _mm256_mul_ps(halves(p), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 16 + 8 * u)))));
    }
    static __m256 mins(const uint8_t*, int) { return _mm256_setzero_ps(); }
};

// x's sum over a unit (its 32 values, or half `half` of them where a unit is 16) from its sums per 16
template <typename P>
static inline int unit_sum(const int* i16, int half) { return P::UNIT == 32 ? i16[0] + i16[1] : i16[half]; }

// A unit's weights (PER groups of 4, 8 rows) times one digit of x (int8 at xq, its sums per 16 at i16) as int32 lanes;
// two chains of dot products: vpdpbusd's latency, not its throughput, bounded a step of several input rows
template <typename P, int PER>
static inline __m256i unit_dot(const __m256i* q, const int8_t* xq, const int* i16, int half) {
    __m256i a = start<P::OFF>(unit_sum<P>(i16, half)), b = _mm256_setzero_si256();
#ifndef __AVX512VNNI__
    if constexpr (RUN<P::OFF> > 1) {
        for (int j = 0; j < PER; j += RUN<P::OFF>) a = dot_run<P::OFF, RUN<P::OFF>>(a, q + j, xq + 4 * j);
        return a;
    }
#endif
    for (int j = 0; j < PER; j += 2) {
        a = dot4<P::OFF>(a, q[j], xq + 4 * j);
        b = dot4<P::OFF>(b, q[j + 1], xq + 4 * (j + 1));
    }
    return _mm256_add_epi32(a, b);
}

// One block column of a group (8 rows) times C input rows (x at that column's first 32 values): acc[c]'s lanes are
// the rows' sums
template <int T, int C>
static inline void group_dot(const uint8_t* p, const XBlock* x, __m256 acc[C]) {
    using P = Packed<T>;
    constexpr int PER = P::UNIT / 4;                   // groups of 4 weights a unit
    for (int col = 0; col < Block<T>::QK / 32; col++)
        for (int half = 0; half < 32 / P::UNIT; half++) {
            const int u = col * (32 / P::UNIT) + half, g0 = half * PER;
            __m256i q[PER];
            for (int j = 0; j < PER; j++) q[j] = P::q(p, col, g0 + j);
            const __m256 s = P::scale(p, u);
            [[maybe_unused]] __m256 mn;
            if constexpr (P::MIN) mn = P::mins(p, u);
            for (int c = 0; c < C; c++) {
                for (int digit = 0; digit < (x[c].q2 ? 2 : 1); digit++) {
                    const float d = (digit ? x[c].dx2 : x[c].dx)[col];
                    if (d == 0.f) continue;
                    const __m256i dot = unit_dot<P, PER>(q, (digit ? x[c].q2 : x[c].q) + 32 * col + 4 * g0,
                                                         (digit ? x[c].i16b : x[c].i16) + 2 * col, half);
                    acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s, _mm256_set1_ps(d)), acc[c]);
                }
                if constexpr (P::MIN) acc[c] = _mm256_fnmadd_ps(mn, _mm256_set1_ps(x[c].xs[col]), acc[c]);
            }
        }
}

#ifdef __AVX512VNNI__
static inline __m512i both(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
static inline __m512 both(__m256 a, __m256 b) { return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1); }

// group_dot for two groups at once (p0's rows in lanes 0-7, p1's in 8-15) in 512-bit vectors: one vpdpbusd advances
// 16 rows, twice group_dot's products an instruction, where several input rows make the step bound by them. The
// input rows' first digits go through a unit's weights together, one chain of sums a row interleaved with the
// others', so no row's chain waits on its own latency
template <int T, int C>
static inline void pair_dot(const uint8_t* p0, const uint8_t* p1, const XBlock* x, __m512 acc[C]) {
    using P = Packed<T>;
    constexpr int PER = P::UNIT / 4;
    for (int col = 0; col < Block<T>::QK / 32; col++)
        for (int half = 0; half < 32 / P::UNIT; half++) {
            const int u = col * (32 / P::UNIT) + half, g0 = half * PER;
            __m512i q[PER];
            for (int j = 0; j < PER; j++) q[j] = both(P::q(p0, col, g0 + j), P::q(p1, col, g0 + j));
            const __m512 s = both(P::scale(p0, u), P::scale(p1, u));
            __m512i a[C];
            for (int c = 0; c < C; c++) {
                a[c] = _mm512_set1_epi32(-P::OFF * unit_sum<P>(x[c].i16 + 2 * col, half));
            }
            for (int j = 0; j < PER; j++)
                for (int c = 0; c < C; c++) {
                    int32_t four;
                    memcpy(&four, x[c].q + 32 * col + 4 * (g0 + j), 4);
                    a[c] = _mm512_dpbusd_epi32(a[c], q[j], _mm512_set1_epi32(four));
                }
            for (int c = 0; c < C; c++)
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[c]), _mm512_mul_ps(s, _mm512_set1_ps(x[c].dx[col])), acc[c]);
            for (int c = 0; c < C; c++) {          // the second digits: a few blocks of a few rows
                if (!x[c].q2 || x[c].dx2[col] == 0.f) continue;
                const int8_t* xq = x[c].q2 + 32 * col + 4 * g0;
                __m512i b = _mm512_set1_epi32(-P::OFF * unit_sum<P>(x[c].i16b + 2 * col, half));
                for (int j = 0; j < PER; j++) {
                    int32_t four;
                    memcpy(&four, xq + 4 * j, 4);
                    b = _mm512_dpbusd_epi32(b, q[j], _mm512_set1_epi32(four));
                }
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), _mm512_mul_ps(s, _mm512_set1_ps(x[c].dx2[col])), acc[c]);
            }
            if constexpr (P::MIN) {
                const __m512 mn = both(P::mins(p0, u), P::mins(p1, u));
                for (int c = 0; c < C; c++) acc[c] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(x[c].xs[col]), acc[c]);
            }
        }
}
#endif

// A group's rows [8, QK] of one block column as fp32 (out's rows ld apart), as gguf.quants.dequantize computes them
template <int T>
static void group_deq(const uint8_t* p, float* out, int64_t ld) {
    using P = Packed<T>;
    constexpr int PER = P::UNIT / 4;
    for (int u = 0; u < Block<T>::QK / P::UNIT; u++) {
        alignas(32) float s[G], mn[G];
        _mm256_store_ps(s, P::scale(p, u)), _mm256_store_ps(mn, P::mins(p, u));
        for (int j = 0; j < PER; j++) {
            const int col = u * P::UNIT / 32, g = u * PER % 8 + j;
            alignas(32) uint8_t q[32];
            _mm256_store_si256((__m256i*)q, P::q(p, col, g));
            for (int r = 0; r < G; r++) {
                int32_t four;
                memcpy(&four, q + 4 * r, 4);
                const __m128i v = _mm_sub_epi32(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(four)), _mm_set1_epi32(P::OFF));
                __m128 w = _mm_mul_ps(_mm_cvtepi32_ps(v), _mm_set1_ps(s[r]));
                if constexpr (P::MIN) w = _mm_sub_ps(w, _mm_set1_ps(mn[r]));
                _mm_storeu_ps(out + r * ld + 32 * col + 4 * g, w);
            }
        }
    }
}
