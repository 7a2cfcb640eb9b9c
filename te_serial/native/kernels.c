/* te-serial's native kernels. First, the byte transpose: dst[j][i] = src[i][j] for a 2-D array of 1-byte codes.
 *
 * Columnwise codes of several formats are the rowwise codes (or codes computed in row order)
 * transposed. torch's own copy of a transposed uint8 view, and inductor's transposed stores, move
 * them at 0.5-1 GB/s on a 2-core VM; this runs near memcpy speed: rows go in stripes of 64, each
 * stripe as 16 x 16 tiles transposed in SSE2 registers (four rounds of byte unpacks), and every
 * destination row receives 64 contiguous bytes per stripe, written as one whole cache line with
 * non-temporal stores where it is 16-byte aligned (no read-for-ownership of lines wholly
 * overwritten). Other targets, edges and unaligned rows take the scalar loops.
 *
 * Rows [r0, r1) of src only, so that callers split the work between threads.
 */
#include <stdint.h>

static void transpose_scalar(const uint8_t *src, uint8_t *dst, int64_t ss, int64_t ds,
                             int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    for (int64_t i = i0; i < i1; i++)
        for (int64_t j = j0; j < j1; j++) dst[j * ds + i] = src[i * ss + j];
}

#if defined(__SSE2__)
#include <emmintrin.h>
enum { STRIPE = 64, TILE = 16 };

/* t[k] = column k of the 16 x 16 tile at s (row stride ss) */
static inline void tile16(const uint8_t *s, int64_t ss, __m128i *t) {
    __m128i u[16];
    for (int k = 0; k < 16; k++) t[k] = _mm_loadu_si128((const __m128i *)(s + k * ss));
    for (int round = 0; round < 2; round++) {  /* each unpack round rotates (row, col) bits by one */
        for (int i = 0; i < 8; i++) {
            u[2 * i] = _mm_unpacklo_epi8(t[i], t[i + 8]);
            u[2 * i + 1] = _mm_unpackhi_epi8(t[i], t[i + 8]);
        }
        for (int i = 0; i < 8; i++) {
            t[2 * i] = _mm_unpacklo_epi8(u[i], u[i + 8]);
            t[2 * i + 1] = _mm_unpackhi_epi8(u[i], u[i + 8]);
        }
    }
}
#endif

void te_serial_transpose_u8(const uint8_t *src, uint8_t *dst, int64_t cols, int64_t ss, int64_t ds,
                            int64_t r0, int64_t r1) {
    int64_t i = r0;
#if defined(__SSE2__)
    for (; i + STRIPE <= r1; i += STRIPE) {
        int64_t j = 0;
        for (; j + TILE <= cols; j += TILE) {
            __m128i t[STRIPE / TILE][TILE];
            for (int q = 0; q < STRIPE / TILE; q++) tile16(src + (i + TILE * q) * ss + j, ss, t[q]);
            for (int k = 0; k < TILE; k++) {
                uint8_t *d = dst + (j + k) * ds + i;
                if (((uintptr_t)d & 15) == 0)
                    for (int q = 0; q < STRIPE / TILE; q++) _mm_stream_si128((__m128i *)(d + TILE * q), t[q][k]);
                else
                    for (int q = 0; q < STRIPE / TILE; q++) _mm_storeu_si128((__m128i *)(d + TILE * q), t[q][k]);
            }
        }
        transpose_scalar(src, dst, ss, ds, i, i + STRIPE, j, cols);
    }
    _mm_sfence();  /* the streamed lines are visible before the caller reads dst */
#endif
    transpose_scalar(src, dst, ss, ds, i, r1, 0, cols);
}

/* |x| maxima of a 16-bit float array (bf16 or fp16, sign-magnitude: |x| orders as bits & 0x7FFF)
 * over 1 x b blocks (row_out [rows, cols / b]) and b x 1 blocks (col_out [rows / b, cols]), rows
 * [r0, r1) only, r0 and r1 multiples of b, cols a multiple of b. Returns whether any element is
 * a NaN (magnitude bits above `inf_bits`); the maxima are then meaningless. One pass, read once. */
int te_serial_block_amax_u16(const uint16_t *x, int64_t cols, int64_t ss, int64_t b, uint16_t inf_bits,
                             uint16_t *row_out, uint16_t *col_out, int64_t r0, int64_t r1) {
    uint16_t nan_or = 0;
    for (int64_t i = r0; i < r1; i += b) {
        uint16_t *colmax = col_out + (i / b) * cols;
        for (int64_t j = 0; j < cols; j++) colmax[j] = 0;
        for (int64_t r = i; r < i + b; r++) {
            const uint16_t *p = x + r * ss;
            uint16_t *rowmax = row_out + r * (cols / b);
            for (int64_t j = 0; j < cols; j += b) {
                uint16_t m = 0;
                for (int64_t t = j; t < j + b; t++) {
                    uint16_t a = p[t] & 0x7FFF;
                    nan_or |= (uint16_t)(a > inf_bits);
                    m = a > m ? a : m;
                    colmax[t] = a > colmax[t] ? a : colmax[t];
                }
                rowmax[j / b] = m;
            }
        }
    }
    return nan_or != 0;
}

/* FP8 codes of fp32(x) * scale, clamped to the FP8 type's largest finite value, rounded to nearest
 * even: numerics.scale_and_cast_to_fp8 (TE's quantize step), one read of x and one write of codes.
 *
 * The conversions follow the FP8 definitions bit by bit (as torch's own c10 ones do): a normal
 * result keeps the top mantissa bits with a round-to-nearest-even increment; a result below the
 * smallest normal rounds through one fp32 addition of a power of two that aligns its last code bit
 * with fp32's last mantissa bit (the FPU's round to nearest even). NaN becomes 0x7F (the canonical
 * code the eager path writes). Built without -ffast-math and with -ffp-contract=off, so the product
 * and that addition are two IEEE roundings, never one FMA.
 *
 * x is [outer..., n] contiguous, d = (d0, d1, d2) the outer sizes; the scale of element (i0, i1, i2, j)
 * is scale[i0 * s0 + i1 * s1 + i2 * s2 + j * sj] with sj 0 (one scale per row of n) or 1 (one per
 * element). Outer rows [o0, o1) of the d0 * d1 * d2 only, so that callers split the work. */
#include <string.h>

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* The FP8 code of v (|v| within the type's range, or NaN) for a type with `mbits` mantissa bits
 * and exponent bias `bias` (E4M3: 3, 7; E5M2: 2, 15). Constant arguments fold when inlined. */
static inline uint8_t fp8_code(float v, const int mbits, const int bias) {
    const int drop = 23 - mbits;                                       /* fp32 mantissa bits dropped */
    const uint32_t min_normal = (uint32_t)(127 + 1 - bias) << 23;      /* the type's smallest normal */
    const uint32_t magic = (uint32_t)(127 + 1 - bias - mbits + 23) << 23;  /* its ulp at fp32's last bit */
    uint32_t b = f2u(v), a = b & 0x7FFFFFFFu, sign = (b >> 24) & 0x80u;
    uint32_t sub = f2u(u2f(a) + u2f(magic)) - magic;
    uint32_t nor = (a - ((uint32_t)(127 - bias) << 23) + ((1u << (drop - 1)) - 1u) + ((a >> drop) & 1u)) >> drop;
    uint32_t r = (a < min_normal ? sub : nor) | sign;
    return (uint8_t)(a > 0x7F800000u ? 0x7Fu : r);
}

#define TO_E4M3(v) fp8_code((v), 3, 7)
#define TO_E5M2(v) fp8_code((v), 2, 15)

static inline float clampf(float v, float m) { return v > m ? m : (v < -m ? -m : v); }  /* NaN stays */
static inline float from_bf16(uint16_t h) { return u2f((uint32_t)h << 16); }

#define CAST_ROW(NAME, T, LOAD, TO, MAXV)                                                         \
    /* restrict: no runtime aliasing checks before each 32-element row (a third of its time) */   \
    static inline void NAME##_const(const T *restrict x, float s, uint8_t *restrict y, int64_t n) { \
        for (int64_t j = 0; j < n; j++) y[j] = TO(clampf(LOAD(x[j]) * s, MAXV));                 \
    }                                                                                             \
    static inline void NAME##_const32(const T *restrict x, float s, uint8_t *restrict y) {        \
        for (int j = 0; j < 32; j++) y[j] = TO(clampf(LOAD(x[j]) * s, MAXV));                    \
    }                                                                                             \
    static inline void NAME##_each(const T *restrict x, const float *restrict s, uint8_t *restrict y, \
                                   int64_t n) {                                                   \
        for (int64_t j = 0; j < n; j++) y[j] = TO(clampf(LOAD(x[j]) * s[j], MAXV));              \
    }                                                                                             \
    static void NAME(const T *x, const float *scale, uint8_t *y, int64_t n, int64_t d1, int64_t d2, \
                     int64_t s0, int64_t s1, int64_t s2, int sj, int64_t o0, int64_t o1) {        \
        int64_t i2 = o0 % d2, i1 = (o0 / d2) % d1, i0 = o0 / d2 / d1;                            \
        for (int64_t o = o0; o < o1; o++) {                                                       \
            const float *s = scale + i0 * s0 + i1 * s1 + i2 * s2;                                 \
            if (sj) NAME##_each(x + o * n, s, y + o * n, n);                                      \
            else if (n == 32) NAME##_const32(x + o * n, *s, y + o * n);                           \
            else NAME##_const(x + o * n, *s, y + o * n, n);                                       \
            if (++i2 == d2) { i2 = 0; if (++i1 == d1) { i1 = 0; i0++; } }                         \
        }                                                                                         \
    }

#define IDENT(v) (v)
#define HALF(v) ((float)(v))
CAST_ROW(cast_bf16_e4m3, uint16_t, from_bf16, TO_E4M3, 448.0f)
CAST_ROW(cast_bf16_e5m2, uint16_t, from_bf16, TO_E5M2, 57344.0f)
CAST_ROW(cast_f32_e4m3, float, IDENT, TO_E4M3, 448.0f)
CAST_ROW(cast_f32_e5m2, float, IDENT, TO_E5M2, 57344.0f)
#if defined(__FLT16_MAX__)
CAST_ROW(cast_f16_e4m3, _Float16, HALF, TO_E4M3, 448.0f)
CAST_ROW(cast_f16_e5m2, _Float16, HALF, TO_E5M2, 57344.0f)
#endif

/* in_kind: 0 bf16, 1 fp16, 2 fp32; e5m2: 0 E4M3, 1 E5M2. Returns 0, or -1 for a kind not built. */
int te_serial_scale_cast_fp8(const void *x, const float *scale, uint8_t *y, int in_kind, int e5m2, int64_t n,
                             int64_t d1, int64_t d2, int64_t s0, int64_t s1, int64_t s2, int sj,
                             int64_t o0, int64_t o1) {
    switch (in_kind * 2 + e5m2) {
    case 0: cast_bf16_e4m3(x, scale, y, n, d1, d2, s0, s1, s2, sj, o0, o1); return 0;
    case 1: cast_bf16_e5m2(x, scale, y, n, d1, d2, s0, s1, s2, sj, o0, o1); return 0;
#if defined(__FLT16_MAX__)
    case 2: cast_f16_e4m3(x, scale, y, n, d1, d2, s0, s1, s2, sj, o0, o1); return 0;
    case 3: cast_f16_e5m2(x, scale, y, n, d1, d2, s0, s1, s2, sj, o0, o1); return 0;
#endif
    case 4: cast_f32_e4m3(x, scale, y, n, d1, d2, s0, s1, s2, sj, o0, o1); return 0;
    case 5: cast_f32_e5m2(x, scale, y, n, d1, d2, s0, s1, s2, sj, o0, o1); return 0;
    default: return -1;
    }
}
