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
 * Each exported function splits its rows among `threads` OpenMP threads, the calling thread's team:
 * the library is built with -fopenmp against the runtime torch has loaded, as inductor's kernels
 * are, so that its work and torch's share one set of threads. A pool of its own contended with the
 * OpenMP threads that torch's kernels leave spinning for a while after each parallel region, and ran
 * at half speed inside compiled graphs. Built without OpenMP, the pragmas are ignored and everything
 * runs in the calling thread.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

/* The version of this library's interface: native/__init__.py's signature table (_SIGNATURES)
   describes version _ABI_VERSION and refuses a library of another one. Bump both together. */
int te_serial_abi_version(void) { return 3; }

/* Transparent huge pages asked for over the whole 2 MB pages of [p, p + n): an output about to be
 * written in full then faults in once per 2 MB rather than once per 4 KB page (about 1 us each on a
 * VM). A hint: returns madvise's result, or 0 where there is nothing to ask. */
int te_serial_prefer_huge_pages(void *p, int64_t n) {
#if defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)1 << 21;
    uintptr_t a = ((uintptr_t)p + huge - 1) & ~(huge - 1), e = ((uintptr_t)p + (uintptr_t)n) & ~(huge - 1);
    return e > a ? madvise((void *)a, e - a, MADV_HUGEPAGE) : 0;
#else
    (void)p; (void)n;
    return 0;
#endif
}

/* counts[b] = how many of the n bytes at x equal b: four sub-histograms, so that runs of one byte
 * value (block scales are such) do not serialize on one counter. */
void te_serial_byte_histogram(const uint8_t *x, int64_t n, int64_t *counts) {
    int64_t h[4][256];
    memset(h, 0, sizeof h);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        h[0][x[i]]++;
        h[1][x[i + 1]]++;
        h[2][x[i + 2]]++;
        h[3][x[i + 3]]++;
    }
    for (; i < n; i++) h[0][x[i]]++;
    for (int b = 0; b < 256; b++) counts[b] = h[0][b] + h[1][b] + h[2][b] + h[3][b];
}

/* dst[i] = lut[src[i]] for n bytes: a byte's two halves each mapped at once (packed FP4 codes to the
 * two E4M3 bytes that hold the same values, little-endian: the low nibble's first). */
void te_serial_map_bytes_u16(const uint8_t *src, uint16_t *dst, int64_t n, const uint16_t *lut, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) dst[i] = lut[src[i]];
}

/* rows per thread: `rows` split `threads` ways, rounded up to whole units of `unit` rows */
static int64_t rows_per_thread(int64_t rows, int64_t unit, int threads) {
    int64_t step = (rows + threads - 1) / threads;
    return (step + unit - 1) / unit * unit;
}

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

static void transpose_rows(const uint8_t *src, uint8_t *dst, int64_t cols, int64_t ss, int64_t ds,
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

void te_serial_transpose_u8(const uint8_t *src, uint8_t *dst, int64_t rows, int64_t cols, int64_t ss, int64_t ds,
                            int threads) {
    int64_t step = rows_per_thread(rows, 64, threads);
    #pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t r0 = 0; r0 < rows; r0 += step)
        transpose_rows(src, dst, cols, ss, ds, r0, r0 + step < rows ? r0 + step : rows);
}

/* |x| maxima of a 16-bit float array (bf16 or fp16, sign-magnitude: |x| orders as bits & 0x7FFF)
 * over 1 x b blocks (row_out [rows, cols / b]) and b x 1 blocks (col_out [rows / b, cols]), rows
 * [r0, r1) only, r0 and r1 multiples of b, cols a multiple of b. Returns whether any element is
 * a NaN (magnitude bits above `inf_bits`); the maxima are then meaningless. One pass, read once. */
static int block_amax_rows(const uint16_t *x, int64_t cols, int64_t ss, int64_t b, uint16_t inf_bits,
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

int te_serial_block_amax_u16(const uint16_t *x, int64_t rows, int64_t cols, int64_t ss, int64_t b, uint16_t inf_bits,
                             uint16_t *row_out, uint16_t *col_out, int threads) {
    int64_t step = rows_per_thread(rows, b, threads);
    int nan = 0;
    #pragma omp parallel for num_threads(threads) schedule(static, 1) reduction(|:nan)
    for (int64_t r0 = 0; r0 < rows; r0 += step)
        nan |= block_amax_rows(x, cols, ss, b, inf_bits, row_out, col_out, r0, r0 + step < rows ? r0 + step : rows);
    return nan;
}

/* max |x| of a 2-D 16-bit float array (bf16 or fp16) as magnitude bits, rows [r0, r1); sets *nan
 * where an element is a NaN (magnitude bits above `inf_bits`). One read, vectorized by the compiler. */
static uint16_t amax_rows(const uint16_t *x, int64_t cols, int64_t ss, uint16_t inf_bits, int *nan,
                          int64_t r0, int64_t r1) {
    uint16_t m = 0, over = 0;
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *p = x + r * ss;
        for (int64_t j = 0; j < cols; j++) {
            uint16_t a = p[j] & 0x7FFF;
            m = a > m ? a : m;
            over |= (uint16_t)(a > inf_bits);
        }
    }
    *nan |= over != 0;
    return m;
}

/* max |x| as magnitude bits, or -1 where any element is a NaN (the tensor amax's pass, with the
 * NaN check that sends such inputs down the eager path) */
int32_t te_serial_amax_u16(const uint16_t *x, int64_t rows, int64_t cols, int64_t ss, uint16_t inf_bits,
                           int threads) {
    int64_t step = rows_per_thread(rows, 1, threads);
    int32_t m = 0;
    int nan = 0;
    #pragma omp parallel for num_threads(threads) schedule(static, 1) reduction(max:m) reduction(|:nan)
    for (int64_t r0 = 0; r0 < rows; r0 += step) {
        int got = 0;
        int32_t a = amax_rows(x, cols, ss, inf_bits, &got, r0, r0 + step < rows ? r0 + step : rows);
        m = a > m ? a : m;
        nan |= got;
    }
    return nan ? -1 : m;
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
 * The rule is written once, on 16 lanes at a time (GCC / Clang vector extensions: AVX-512 where the
 * CPU has it, narrower registers or scalar code elsewhere, the same IEEE operations lane by lane).
 * torch's own fp32 → FP8 conversion is scalar; this runs at about twice its speed. A row's last n % 16
 * elements go through the same rule in a zero-padded buffer.
 *
 * x is [outer..., n] contiguous, d = (d0, d1, d2) the outer sizes; the scale of element (i0, i1, i2, j)
 * is scale[i0 * s0 + i1 * s1 + i2 * s2 + j * sj] with sj 0 (one scale per row of n) or 1 (one per
 * element). Outer rows [o0, o1) of the d0 * d1 * d2 only, so that callers split the work. */
#include <string.h>

enum { LANES = 16 };
typedef float f32v __attribute__((vector_size(4 * LANES)));
typedef uint32_t u32v __attribute__((vector_size(4 * LANES)));
typedef uint16_t u16v __attribute__((vector_size(2 * LANES)));
typedef uint8_t u8v __attribute__((vector_size(LANES)));
typedef uint16_t u16v8 __attribute__((vector_size(LANES)));
typedef uint8_t u8v8 __attribute__((vector_size(LANES / 2)));
typedef float f32v8 __attribute__((vector_size(32)));
typedef float f32v4 __attribute__((vector_size(16)));

static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
/* a > t ? x : y and a < t ? x : y, lane by lane, for a and t below 2^31 (magnitude bits, small
 * codes): signed compares, which AVX2 has and GCC does not scalarize as it does unsigned ones. One
 * compare into a mask register and one blend with AVX-512, a compare and two bitwise ops elsewhere. */
typedef int32_t i32v __attribute__((vector_size(4 * LANES)));
#if defined(__AVX512F__)
#include <immintrin.h>
static inline u32v select_gt(u32v a, uint32_t t, u32v x, u32v y) {
    return (u32v)_mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask((__m512i)a, _mm512_set1_epi32((int)t)),
                                         (__m512i)y, (__m512i)x);
}
static inline u32v select_lt(u32v a, uint32_t t, u32v x, u32v y) {
    return (u32v)_mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask((__m512i)a, _mm512_set1_epi32((int)t)),
                                         (__m512i)y, (__m512i)x);
}
static inline u8v low_bytes(u32v a) { return (u8v)_mm512_cvtepi32_epi8((__m512i)a); }  /* each lane's low byte */
#else
static inline u32v select_gt(u32v a, uint32_t t, u32v x, u32v y) {
    u32v m = (u32v)((i32v)(t - a) >> 31);
    return (m & x) | (~m & y);
}
static inline u32v select_lt(u32v a, uint32_t t, u32v x, u32v y) {
    u32v m = (u32v)((i32v)(a - t) >> 31);
    return (m & x) | (~m & y);
}
#if defined(__AVX2__)
#include <immintrin.h>
static inline u8v low_bytes(u32v a) {
    a &= 0xFFu;
    __m256i lo = (__m256i)__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7);
    __m256i hi = (__m256i)__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);  /* 16 words in order */
    return (u8v)_mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}
#else
static inline u8v low_bytes(u32v a) { return __builtin_convertvector(a, u8v); }
#endif
#endif

/* The codes of v in a small float type of `width` bits (sign on top) with `mbits` mantissa bits,
 * exponent bias `bias` and largest finite value `maxv`: E4M3 (8, 3, 7, 448), E5M2 (8, 2, 15, 57344),
 * E2M1 (4, 1, 1, 6). |v| above maxv, inf included, saturates to maxv's code: what clamping to
 * [-maxv, maxv] before rounding gives. NaN gives `nan_code`. Constant arguments fold. */
static inline u32v float_codes(f32v v, const int width, const int mbits, const int bias, const float maxv,
                               const uint32_t nan_code) {
    const int drop = 23 - mbits;                                       /* fp32 mantissa bits dropped */
    const uint32_t min_normal = (uint32_t)(127 + 1 - bias) << 23;      /* the type's smallest normal */
    const uint32_t magic = (uint32_t)(127 + 1 - bias - mbits + 23) << 23;  /* its ulp at fp32's last bit */
    const uint32_t rebias = (uint32_t)(127 - bias) << 23, max_bits = f2u(maxv);
    u32v b = (u32v)v, a = b & 0x7FFFFFFFu;
    u32v sub = (u32v)((f32v)a + u2f(magic)) - magic;
    u32v nor = (a - rebias + ((1u << (drop - 1)) - 1u) + ((a >> drop) & 1u)) >> drop;
    u32v r = select_lt(a, min_normal, sub, nor);
    r = select_gt(a, max_bits, (u32v){} + ((max_bits - rebias) >> drop), r);
    r |= (b >> (32 - width)) & (1u << (width - 1));  /* the sign, on top of the code */
    return select_gt(a, 0x7F800000u, (u32v){} + nan_code, r);
}

static inline f32v load_bf16(const uint16_t *p) {
    u16v h; memcpy(&h, p, sizeof h);
#if defined(__AVX512F__)
    return (f32v)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16);  /* GCC 12 makes 5 of the line below */
#endif
    return (f32v)(__builtin_convertvector(h, u32v) << 16);
}
static inline f32v load_f32(const float *p) { f32v v; memcpy(&v, p, sizeof v); return v; }
#if defined(__FLT16_MAX__)
typedef _Float16 f16v __attribute__((vector_size(2 * LANES)));
static inline f32v load_f16(const _Float16 *p) {
    f16v h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, f32v);
}
#endif

/* LANES scales from s: each its own where sj, else s[0] for all */
static inline f32v lanes_of(const float *s, int sj) { return sj ? load_f32(s) : (f32v){} + s[0]; }

/* NaN: 0x7F, the canonical code the eager path writes; E2M1 NaN: +6, as the PTX cvt (cuda_fp4.hpp) */
#define TO_E4M3(v) low_bytes(float_codes((v), 8, 3, 7, 448.0f, 0x7Fu))
#define TO_E5M2(v) low_bytes(float_codes((v), 8, 2, 15, 57344.0f, 0x7Fu))
#define TO_E2M1(v) float_codes((v), 4, 1, 1, 6.0f, 0x7u)

/* Each loop is made for every input kind (0 bf16, 1 fp16, 2 fp32), the FP8 ones for each FP8 type
 * too: INPUT_KINDS(M, P) expands M(P_<input>, element type, load) for each, FP8_KINDS(M, P)
 * M(P_<input>_<type>, element type, load, codes); INPUT_KIND_OF(NAME, P, FN_T) and
 * FP8_KIND_OF(NAME, P, FN_T) define NAME(in_kind[, e5m2]), the one for a kind, or 0 where not built. */
#if defined(__FLT16_MAX__)
#define F16_INPUT(M, P) M(P##_f16, _Float16, load_f16)
#define F16_INPUT_CASE(P, FN_T) case 1: return (FN_T)P##_f16;
#define F16_KINDS(M, P) M(P##_f16_e4m3, _Float16, load_f16, TO_E4M3) M(P##_f16_e5m2, _Float16, load_f16, TO_E5M2)
#define F16_CASES(P, FN_T) case 2: return (FN_T)P##_f16_e4m3; case 3: return (FN_T)P##_f16_e5m2;
#else
#define F16_INPUT(M, P)
#define F16_INPUT_CASE(P, FN_T)
#define F16_KINDS(M, P)
#define F16_CASES(P, FN_T)
#endif
#define INPUT_KINDS(M, P) M(P##_bf16, uint16_t, load_bf16) M(P##_f32, float, load_f32) F16_INPUT(M, P)
#define INPUT_KIND_OF(NAME, P, FN_T)                                                              \
    static FN_T NAME(int in_kind) {                                                               \
        switch (in_kind) {                                                                        \
        case 0: return (FN_T)P##_bf16;                                                            \
        F16_INPUT_CASE(P, FN_T)                                                                   \
        case 2: return (FN_T)P##_f32;                                                             \
        default: return 0;                                                                        \
        }                                                                                         \
    }
#define FP8_KINDS(M, P)                                                                           \
    M(P##_bf16_e4m3, uint16_t, load_bf16, TO_E4M3) M(P##_bf16_e5m2, uint16_t, load_bf16, TO_E5M2) \
    M(P##_f32_e4m3, float, load_f32, TO_E4M3) M(P##_f32_e5m2, float, load_f32, TO_E5M2) F16_KINDS(M, P)
#define FP8_KIND_OF(NAME, P, FN_T)                                                                \
    static FN_T NAME(int in_kind, int e5m2) {                                                     \
        switch (in_kind * 2 + e5m2) {                                                             \
        case 0: return (FN_T)P##_bf16_e4m3;                                                       \
        case 1: return (FN_T)P##_bf16_e5m2;                                                       \
        F16_CASES(P, FN_T)                                                                        \
        case 4: return (FN_T)P##_f32_e4m3;                                                        \
        case 5: return (FN_T)P##_f32_e5m2;                                                        \
        default: return 0;                                                                        \
        }                                                                                         \
    }

/* The outer rows' scale offsets i0 * s0 + i1 * s1 + i2 * s2, (i0, i1, i2) the row's index in the
 * outer sizes (d0, d1, d2), walked one row after another from row o */
typedef struct { int64_t i0, i1, i2, d1, d2, s0, s1, s2; } row_walk;
static inline row_walk walk_from(int64_t o, int64_t d1, int64_t d2, int64_t s0, int64_t s1, int64_t s2) {
    row_walk w = {o / d2 / d1, (o / d2) % d1, o % d2, d1, d2, s0, s1, s2};
    return w;
}
/* this row's offset; the walk moves on to the next row */
static inline int64_t walk_next(row_walk *w) {
    int64_t off = w->i0 * w->s0 + w->i1 * w->s1 + w->i2 * w->s2;
    if (++w->i2 == w->d2) { w->i2 = 0; if (++w->i1 == w->d1) { w->i1 = 0; w->i0++; } }
    return off;
}

/* E2M1 codes (one per 32-bit lane) packed two per byte: neighbouring lanes into LANES / 2 bytes,
 * lane 2i's code low (each 64-bit lane's two codes); or the lanes of two rows into LANES bytes */
static inline void pack_lanes(u32v c, uint8_t *y) {
    u16v8 w = (u16v8)low_bytes(c);  /* code 2i in the low byte of word i, code 2i + 1 in its high byte */
    u8v8 q = __builtin_convertvector((w | (w >> 4)) & 0xFFu, u8v8);
    memcpy(y, &q, LANES / 2);
}
static inline u8v paired_rows(u32v lo, u32v hi) { return low_bytes(lo | (hi << 4)); }
static inline void pack_rows(u32v lo, u32v hi, uint8_t *y) {
    u8v q = paired_rows(lo, hi);
    memcpy(y, &q, LANES);
}

#define CAST_ROW(NAME, T, LOAD, TO)                                                               \
    /* LANES elements from x, times the scales sv, to y */                                       \
    static inline void NAME##_lanes(const T *restrict x, f32v sv, uint8_t *restrict y) {          \
        u8v q = TO(LOAD(x) * sv);                                                                 \
        memcpy(y, &q, LANES);                                                                     \
    }                                                                                             \
    /* the last m < LANES elements of a row, through zero-padded buffers (out of the hot loop) */ \
    static __attribute__((noinline)) void NAME##_tail(const T *x, const float *s, int sj, uint8_t *y, int64_t m) { \
        T xt[LANES] = {0}; float st[LANES] = {0}; uint8_t yt[LANES];                              \
        memcpy(xt, x, (size_t)m * sizeof(T));                                                     \
        if (sj) memcpy(st, s, (size_t)m * sizeof(float));                                         \
        NAME##_lanes(xt, sj ? load_f32(st) : (f32v){} + s[0], yt);                                \
        memcpy(y, yt, (size_t)m);                                                                 \
    }                                                                                             \
    static void NAME(const void *xv, const float *scale, uint8_t *y, int64_t n, int64_t d1, int64_t d2, \
                     int64_t s0, int64_t s1, int64_t s2, int sj, int64_t o0, int64_t o1) {        \
        const T *x = xv;                                                                          \
        const int64_t whole = n / LANES * LANES;                                                  \
        row_walk w = walk_from(o0, d1, d2, s0, s1, s2);                                           \
        for (int64_t o = o0; o < o1; o++) {                                                       \
            const float *s = scale + walk_next(&w);                                               \
            const T *xr = x + o * n;                                                              \
            uint8_t *yr = y + (o - o0) * n;                                                       \
            if (sj) for (int64_t j = 0; j < whole; j += LANES) NAME##_lanes(xr + j, load_f32(s + j), yr + j); \
            else for (int64_t j = 0; j < whole; j += LANES) NAME##_lanes(xr + j, (f32v){} + s[0], yr + j); \
            if (whole < n) NAME##_tail(xr + whole, s + (sj ? whole : 0), sj, yr + whole, n - whole); \
        }                                                                                         \
    }

FP8_KINDS(CAST_ROW, cast)

/* E2M1 codes of fp32(x) * scale, two per byte (element 2i in the low nibble), rounded to nearest
 * even and saturated at ±6: NVFP4's data, numerics.scale_and_cast_to_fp4 by the same rule as the FP8
 * casts. Rows of n (a multiple of LANES) laid out and scaled as for the FP8 cast; the pairs are two
 * neighbours in a row (`rows` 0: each row's n codes into n / 2 bytes) or the same element of two
 * neighbouring rows (`rows` 1: rows 2i and 2i + 1 into one row of n bytes, i.e. along dim -2). */
#define CAST_FP4(NAME, T, LOAD)                                                                   \
    /* the loop, inlined with sj a constant (a run-time sj kept the scales in memory) */          \
    static inline __attribute__((always_inline)) void NAME##_loop(const T *x, const float *scale, uint8_t *y, \
            int64_t n, row_walk w, const int sj, int rows, int64_t o0, int64_t o1) {             \
        for (int64_t o = o0; o < o1; o += 1 + rows) {                                             \
            const float *sa = scale + walk_next(&w);                                              \
            if (rows) {                                                                           \
                const float *sb = scale + walk_next(&w);                                          \
                for (int64_t j = 0; j < n; j += LANES)                                            \
                    pack_rows(TO_E2M1(LOAD(x + o * n + j) * lanes_of(sa + j * sj, sj)),           \
                              TO_E2M1(LOAD(x + (o + 1) * n + j) * lanes_of(sb + j * sj, sj)), y + o / 2 * n + j); \
            } else {                                                                              \
                for (int64_t j = 0; j < n; j += LANES)                                            \
                    pack_lanes(TO_E2M1(LOAD(x + o * n + j) * lanes_of(sa + j * sj, sj)), y + (o * n + j) / 2); \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    static void NAME(const void *xv, const float *scale, uint8_t *y, int64_t n, int64_t d1, int64_t d2, \
                     int64_t s0, int64_t s1, int64_t s2, int sj, int rows, int64_t o0, int64_t o1) { \
        row_walk w = walk_from(o0, d1, d2, s0, s1, s2);                                           \
        if (sj) NAME##_loop(xv, scale, y, n, w, 1, rows, o0, o1);                                 \
        else NAME##_loop(xv, scale, y, n, w, 0, rows, o0, o1);                                    \
    }

INPUT_KINDS(CAST_FP4, fp4)
typedef void (*fp4_cast_fn)(const void *, const float *, uint8_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int, int, int64_t, int64_t);
INPUT_KIND_OF(fp4_cast_of, fp4, fp4_cast_fn)

/* The value of each E2M1 code (magnitude index m in bits 0-2, sign in bit 3), built as fp32 bits:
 * m >= 2 is 2^((m >> 1) - 1) * (1 + (m & 1) / 2), m = 1 is 0.5, m = 0 is 0. */
static inline f32v e2m1_values(u32v c) {
    u32v m = c & 7u;
    u32v normal = (((m >> 1) + 126u) << 23) | ((m & 1u) << 22);
    u32v v = select_gt(m, 1u, normal, select_gt(m, 0u, (u32v){} + (126u << 23), (u32v){}));
    return (f32v)(v | ((c & 8u) << 28));
}

/* err(((q * sf) * amax) / denom - x) for codes c of x (q their values): |d|, or d * d with `mse` */
static inline f32v e2m1_error(f32v x, u32v c, f32v sf, float amax, float denom, int mse) {
    f32v d = ((e2m1_values(c) * sf) * amax) / denom - x;
    return mse ? d * d : (f32v)((u32v)d & 0x7FFFFFFFu);
}

/* in_kind: 0 bf16, 1 fp16, 2 fp32. Returns 0, or -1 for a kind not built or n not a multiple of
 * LANES (the callers then run torch's ops). With `rows`, d0 * d1 * d2 is even (pairs of rows). */
int te_serial_scale_cast_fp4(const void *x, const float *scale, uint8_t *y, int in_kind, int64_t n,
                             int64_t d0, int64_t d1, int64_t d2, int64_t s0, int64_t s1, int64_t s2, int sj,
                             int rows, int threads) {
    fp4_cast_fn fn = fp4_cast_of(in_kind);
    int64_t outer = d0 * d1 * d2, step = rows_per_thread(outer, 2, threads);
    if (!fn || n % LANES || (rows && outer % 2)) return -1;
    #pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t o0 = 0; o0 < outer; o0 += step)
        fn(x, scale, y, n, d1, d2, s0, s1, s2, sj, rows, o0, o0 + step < outer ? o0 + step : outer);
    return 0;
}

/* a CAST_ROW function: outer rows [o0, o1), codes written from y on (row o0's first) */
typedef void (*fp8_cast_fn)(const void *, const float *, uint8_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int, int64_t, int64_t);

FP8_KIND_OF(fp8_cast_of, cast, fp8_cast_fn)

/* fp32 values of FP8 codes (16 per lane group): torch's conversion bit for bit where the value is a
 * number (exact: normals rebiased, subnormals m * 2^-9 or m * 2^-16, signed zeros), and a NaN where
 * the code is one (E4M3 0x7F / 0xFF; E5M2 exponent 31 with a mantissa; E5M2 infinities stay). */
static inline f32v e4m3_values(u32v c) {
    u32v e = (c >> 3) & 15u, m = c & 7u;
    u32v normal = ((e + 120u) << 23) | (m << 20);
    u32v sub = (u32v)(__builtin_convertvector((i32v)m, f32v) * 0x1p-9f);
    u32v v = select_lt(e, 1u, sub, normal);
    v = select_gt(c & 0x7Fu, 0x7Eu, (u32v){} + 0x7FF00000u, v);  /* NaN, as c10's conversion makes it */
    return (f32v)(v | ((c & 0x80u) << 24));
}
static inline f32v e5m2_values(u32v c) {
    u32v e = (c >> 2) & 31u, m = c & 3u;
    u32v normal = ((e + 112u) << 23) | (m << 21);
    u32v sub = (u32v)(__builtin_convertvector((i32v)m, f32v) * 0x1p-16f);
    u32v v = select_lt(e, 1u, sub, normal);
    v = select_gt(e, 30u, 0x7F800000u | (m << 21) | select_gt(m, 0u, (u32v){} + 0x400000u, (u32v){}), v);
    return (f32v)(v | ((c & 0x80u) << 24));
}
static inline u32v load_u8(const uint8_t *p) {  /* through 16-bit lanes: GCC widens 8 to 32 bits lane by lane */
    u8v b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, u16v), u32v);
}

/* y = fp32(code) * scale over rows laid out and scaled as for the casts (CAST_ROW): an FP8
 * dequantize, one read of the codes and one write of the values */
#define DEQUANT_ROW(NAME, VALUES)                                                                 \
    static inline void NAME##_lanes(const uint8_t *restrict q, f32v sv, float *restrict y) {      \
        f32v v = VALUES(load_u8(q)) * sv;                                                         \
        memcpy(y, &v, sizeof v);                                                                  \
    }                                                                                             \
    static __attribute__((noinline)) void NAME##_tail(const uint8_t *q, const float *s, int sj, float *y, int64_t m) { \
        uint8_t qt[LANES] = {0}; float st[LANES] = {0}, yt[LANES];                                \
        memcpy(qt, q, (size_t)m);                                                                 \
        if (sj) memcpy(st, s, (size_t)m * sizeof(float));                                         \
        NAME##_lanes(qt, sj ? load_f32(st) : (f32v){} + s[0], yt);                                \
        memcpy(y, yt, (size_t)m * sizeof(float));                                                 \
    }                                                                                             \
    static void NAME(const uint8_t *q, const float *scale, float *y, int64_t n, int64_t d1, int64_t d2, \
                     int64_t s0, int64_t s1, int64_t s2, int sj, int64_t o0, int64_t o1) {        \
        const int64_t whole = n / LANES * LANES;                                                  \
        row_walk w = walk_from(o0, d1, d2, s0, s1, s2);                                           \
        for (int64_t o = o0; o < o1; o++) {                                                       \
            const float *s = scale + walk_next(&w);                                               \
            const uint8_t *qr = q + o * n;                                                        \
            float *yr = y + o * n;                                                                \
            if (sj) for (int64_t j = 0; j < whole; j += LANES) NAME##_lanes(qr + j, load_f32(s + j), yr + j); \
            else for (int64_t j = 0; j < whole; j += LANES) NAME##_lanes(qr + j, (f32v){} + s[0], yr + j); \
            if (whole < n) NAME##_tail(qr + whole, s + (sj ? whole : 0), sj, yr + whole, n - whole); \
        }                                                                                         \
    }

DEQUANT_ROW(dequant_e4m3, e4m3_values)
DEQUANT_ROW(dequant_e5m2, e5m2_values)

void te_serial_dequant_fp8(const uint8_t *q, const float *scale, float *y, int e5m2, int64_t n, int64_t d0,
                           int64_t d1, int64_t d2, int64_t s0, int64_t s1, int64_t s2, int sj, int threads) {
    int64_t rows = d0 * d1 * d2, step = rows_per_thread(rows, 1, threads);
    #pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t o0 = 0; o0 < rows; o0 += step) {
        int64_t o1 = o0 + step < rows ? o0 + step : rows;
        if (e5m2) dequant_e5m2(q, scale, y, n, d1, d2, s0, s1, s2, sj, o0, o1);
        else dequant_e4m3(q, scale, y, n, d1, d2, s0, s1, s2, sj, o0, o1);
    }
}

/* Returns 0, or -1 for a kind not built. */
int te_serial_scale_cast_fp8(const void *x, const float *scale, uint8_t *y, int in_kind, int e5m2, int64_t n,
                             int64_t d0, int64_t d1, int64_t d2, int64_t s0, int64_t s1, int64_t s2, int sj,
                             int threads) {
    fp8_cast_fn fn = fp8_cast_of(in_kind, e5m2);
    if (!fn) return -1;
    int64_t rows = d0 * d1 * d2, step = rows_per_thread(rows, 1, threads);
    #pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t o0 = 0; o0 < rows; o0 += step)
        fn(x, scale, y + o0 * n, n, d1, d2, s0, s1, s2, sj, o0, o0 + step < rows ? o0 + step : rows);
    return 0;
}

/* Both usages of a 1 x b / b x 1 block format from one read of x [rows, cols]: yr = codes of x times
 * its row block's scale (rs [rows, cols / b]), yc = codes of x times its column block's scale
 * (cs [rows / b, cols]); each the cast's rule. One loop over each row serves both, so the row scale
 * changes every b elements without a row loop per block (MXFP8's 1 x 32 rows ran 40% slower so). */
#define CAST_PAIR(NAME, T, LOAD, TO)                                                              \
    static void NAME(const void *xv, const float *rs, const float *cs, uint8_t *yr, uint8_t *yc, int64_t cols, \
                     int64_t b, int64_t r0, int64_t r1) {                                         \
        const T *x = xv;                                                                          \
        const int64_t nb = cols / b;                                                              \
        int shift = 0;                                                                            \
        while ((1 << shift) < b) shift++;  /* b a power of two: j / b as a shift */               \
        for (int64_t r = r0; r < r1; r++) {                                                       \
            const T *xr = x + r * cols;                                                           \
            const float *rsr = rs + r * nb, *csr = cs + r / b * cols;                             \
            for (int64_t j = 0; j < cols; j += LANES) {                                           \
                f32v v = LOAD(xr + j);                                                            \
                u8v a = TO(v * rsr[j >> shift]), c = TO(v * load_f32(csr + j));                  \
                memcpy(yr + r * cols + j, &a, LANES);                                             \
                memcpy(yc + r * cols + j, &c, LANES);                                             \
            }                                                                                     \
        }                                                                                         \
    }

FP8_KINDS(CAST_PAIR, pair)
typedef void (*fp8_pair_fn)(const void *, const float *, const float *, uint8_t *, uint8_t *, int64_t, int64_t,
                            int64_t, int64_t);
FP8_KIND_OF(fp8_pair_of, pair, fp8_pair_fn)

/* in_kind and e5m2 as for te_serial_scale_cast_fp8; b a power of two, at least LANES, dividing rows and cols.
 * Returns 0, or -1 where it does not apply. */
int te_serial_scale_cast_fp8_pair(const void *x, const float *rs, const float *cs, uint8_t *yr, uint8_t *yc,
                                  int in_kind, int e5m2, int64_t rows, int64_t cols, int64_t b, int threads) {
    fp8_pair_fn fn = fp8_pair_of(in_kind, e5m2);
    if (!fn || b < LANES || (b & (b - 1)) || rows % b || cols % b) return -1;
    int64_t step = rows_per_thread(rows, 1, threads);
    #pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t r0 = 0; r0 < rows; r0 += step)
        fn(x, rs, cs, yr, yc, cols, b, r0, r0 + step < rows ? r0 + step : rows);
    return 0;
}

/* Rows [0, R) split among the threads in whole units of `unit` rows, each thread's share run
 * `stripe` rows at a time (0: all at once) as the statements after `failed`, over rows [sb, se),
 * with `buf` a buffer of `buf_bytes` of the thread's own where that is above 0 (`failed` set where
 * it could not be had). The loops whose codes are transposed in cache, a stripe at a time, use it. */
#define FOR_STRIPES(R, unit, stripe, threads, buf_bytes, failed, ...)                             \
    do {                                                                                          \
        const int64_t step_ = rows_per_thread(R, unit, threads);                                  \
        _Pragma("omp parallel for num_threads(threads) schedule(static, 1) reduction(|:failed)")  \
        for (int64_t r0_ = 0; r0_ < R; r0_ += step_) {                                            \
            const int64_t r1_ = r0_ + step_ < R ? r0_ + step_ : R, h_ = (stripe) > 0 ? (stripe) : r1_ - r0_; \
            uint8_t *buf = (buf_bytes) > 0 ? malloc((size_t)(buf_bytes)) : 0;                     \
            if ((buf_bytes) > 0 && !buf) { failed = 1; continue; }                                \
            for (int64_t sb = r0_; sb < r1_; sb += h_) {                                          \
                const int64_t se = sb + h_ < r1_ ? sb + h_ : r1_;                                 \
                __VA_ARGS__                                                                       \
            }                                                                                     \
            free(buf);                                                                            \
        }                                                                                         \
    } while (0)

/* te_serial_scale_cast_fp8 whose codes, as a row-major [rows, cols] array (each row whole outer rows
 * of n), are also written transposed to yt [cols, rows]: 64 rows at a time, cast, then transposed
 * while they are in cache (rather than read back from memory). With y NULL only the transpose is
 * kept (each stripe goes through a buffer of 64 rows). Returns 0, or -1 for a kind not built, cols
 * not a multiple of n, or no memory for the buffer. */
int te_serial_scale_cast_fp8_t(const void *x, const float *scale, uint8_t *y, uint8_t *yt, int in_kind, int e5m2,
                               int64_t n, int64_t d1, int64_t d2, int64_t s0, int64_t s1, int64_t s2, int sj,
                               int64_t rows, int64_t cols, int threads) {
    fp8_cast_fn fn = fp8_cast_of(in_kind, e5m2);
    if (!fn || cols % n) return -1;
    const int64_t per_row = cols / n;
    int failed = 0;
    FOR_STRIPES(rows, 64, 64, threads, y ? 0 : 64 * cols, failed,
        uint8_t *codes = y ? y + sb * cols : buf;
        fn(x, scale, codes, n, d1, d2, s0, s1, s2, sj, sb * per_row, se * per_row);
        transpose_rows(codes, yt + sb, cols, cols, rows, 0, se - sb););
    return failed ? -1 : 0;
}

/* NVFP4 4over6 in one pass (quantize_4over6_nvfp4.cuh): each block of 16 (or 16 x 16 tile) is cast
 * with both candidate scales (enc4, sf4: map-to-4; enc6, sf6: map-to-6), each candidate's error
 * summed over the block in order (fp32). A tile's 16 blocks (16 rows, or 16 columns, of 16) add
 * their sums in the warp's tree order (i and i + 8, then i + 4, 2, 1). A block (tile) keeps
 * map-to-4's codes where that sum is strictly lower (a NaN sum keeps map-to-6); pick says which.
 *
 * A candidate's decoded values ((q * sf) * amax) / denom take 16 values per scale: they are made
 * once per scale value as a table and looked up by code, the same IEEE operations as per element. */
static inline f32v decode_table(float sf, float amax, float denom) {
    const u32v codes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return ((e2m1_values(codes) * sf) * amax) / denom;
}
/* tbl[c] for each lane's code c (0-15) */
static inline f32v lookup16(f32v tbl, u32v c) {
#if defined(__AVX512F__)
    return (f32v)_mm512_permutexvar_ps((__m512i)c, (__m512)tbl);
#elif defined(__AVX2__)
    __m256 lo = (__m256)__builtin_shufflevector(tbl, tbl, 0, 1, 2, 3, 4, 5, 6, 7);
    __m256 hi = (__m256)__builtin_shufflevector(tbl, tbl, 8, 9, 10, 11, 12, 13, 14, 15);
    u32v s = c << 28;  /* bit 3 (codes 8-15) as each lane's sign: the blend's selector */
    __m256i c0 = (__m256i)__builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7);
    __m256i c1 = (__m256i)__builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15);
    __m256 s0 = (__m256)__builtin_shufflevector(s, s, 0, 1, 2, 3, 4, 5, 6, 7);
    __m256 s1 = (__m256)__builtin_shufflevector(s, s, 8, 9, 10, 11, 12, 13, 14, 15);
    f32v8 r0 = (f32v8)_mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, c0), _mm256_permutevar8x32_ps(hi, c0), s0);
    f32v8 r1 = (f32v8)_mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, c1), _mm256_permutevar8x32_ps(hi, c1), s1);
    return __builtin_shufflevector(r0, r1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    f32v r;
    for (int i = 0; i < LANES; i++) r[i] = tbl[c[i] & 15u];
    return r;
#endif
}
static inline f32v table_error(f32v x, u32v c, f32v tbl, const int mse) {
    f32v d = lookup16(tbl, c) - x;
    return mse ? d * d : (f32v)((u32v)d & 0x7FFFFFFFu);
}
/* a candidate's decode table for scale bits `bits`, remade only when they change */
typedef struct { uint32_t bits; int valid; f32v tbl; } table_cache;
static inline f32v table_for(table_cache *t, float sf, float amax, float denom) {
    uint32_t b = f2u(sf);
    if (!t->valid || t->bits != b) { t->tbl = decode_table(sf, amax, denom); t->bits = b; t->valid = 1; }
    return t->tbl;
}
/* the sum of a tile's 16 block sums (lane i: block i) in the warp's order (reduce_group_sum_16:
 * shfl_down by 8, 4, 2, 1): lane i + h onto lane i for h = 8, 4, 2, 1 */
static inline float tile_sum(f32v e) {
    f32v8 t8 = __builtin_shufflevector(e, e, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(e, e, 8, 9, 10, 11, 12, 13, 14, 15);
    f32v4 t4 = __builtin_shufflevector(t8, t8, 0, 1, 2, 3) + __builtin_shufflevector(t8, t8, 4, 5, 6, 7);
    return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

/* lane r: m[r][0] + m[r][1] + ... + m[r][15], added in that order (fp32), for the 16 rows of m:
 * each block's error sum, 16 blocks at a time. With AVX2, four 8 x 8 transposes put a row's terms in
 * one lane, so the adds run 8 rows at a time; elsewhere row by row. */
#if defined(__AVX2__)
static inline void transpose8(__m256 *r) {  /* r[i][j] -> r[j][i] */
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20); r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20); r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31); r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31); r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}
#endif
static inline f32v row_sums16(float m[16][16]) {
#if defined(__AVX2__)
    f32v8 half[2];
    for (int h = 0; h < 16; h += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int q = 0; q < 16; q += 8) {
            __m256 t[8];
            for (int k = 0; k < 8; k++) t[k] = _mm256_loadu_ps(&m[h + k][q]);
            transpose8(t);  /* t[i]: term q + i of rows h .. h + 7 */
            for (int i = 0; i < 8; i++) acc = q + i == 0 ? t[0] : _mm256_add_ps(acc, t[i]);
        }
        half[h / 8] = (f32v8)acc;
    }
    return __builtin_shufflevector(half[0], half[1], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    f32v sums;
    for (int r = 0; r < 16; r++) {
        float a = m[r][0];
        for (int i = 1; i < 16; i++) a += m[r][i];
        sums[r] = a;
    }
    return sums;
#endif
}

/* 1 x 16 blocks along `cols` == 0 (rows: grids [R, C / 16], codes [R, C / 2]) or `cols` == 1
 * (columns: grids [R / 16, C], codes packed as pairs of rows, [R / 2, C] from `yoff`'s row on) */
#define FP4_4OVER6(NAME, T, LOAD)                                                                 \
    static inline __attribute__((always_inline)) void NAME##_loop(const T *x, int64_t C, const float *enc4, \
            const float *sf4, const float *enc6, const float *sf6, uint8_t *y, uint8_t *pick, const int cols, \
            float amax, float denom, const int mse, int64_t r0, int64_t r1, int64_t yoff) {       \
        const int64_t nb = C / LANES;                                                             \
        table_cache t4 = {0}, t6 = {0};                                                           \
        if (!cols) {  /* rows: stripes of up to 16 rows, one block column at a time */            \
            for (int64_t s = r0; s < r1; s += 16) {                                               \
                int h = r1 - s < 16 ? (int)(r1 - s) : 16;                                         \
                for (int64_t kb = 0; kb < nb; kb++) {                                             \
                    float m4[16][LANES], m6[16][LANES];  /* each row's terms */                   \
                    uint8_t c4[16][LANES / 2], c6[16][LANES / 2];                                 \
                    for (int r = 0; r < h; r++) {                                                 \
                        const int64_t b = (s + r) * nb + kb;                                      \
                        f32v v = LOAD(x + (s + r) * C + kb * LANES);                              \
                        u32v q4 = TO_E2M1(v * enc4[b]), q6 = TO_E2M1(v * enc6[b]);                \
                        f32v a4 = table_error(v, q4, table_for(&t4, sf4[b], amax, denom), mse);   \
                        f32v a6 = table_error(v, q6, table_for(&t6, sf6[b], amax, denom), mse);   \
                        memcpy(m4[r], &a4, sizeof a4);                                            \
                        memcpy(m6[r], &a6, sizeof a6);                                            \
                        pack_lanes(q4, c4[r]);                                                    \
                        pack_lanes(q6, c6[r]);                                                    \
                    }                                                                             \
                    if (h < 16) { memset(m4[h], 0, sizeof m4[0] * (16 - h)); memset(m6[h], 0, sizeof m6[0] * (16 - h)); } \
                    u8v p = low_bytes((u32v)(row_sums16(m4) < row_sums16(m6)) & 1u);  /* NaN: false */ \
                    for (int r = 0; r < h; r++) {                                                 \
                        memcpy(y + (s + r) * (C / 2) + kb * (LANES / 2), p[r] ? c4[r] : c6[r], LANES / 2); \
                        pick[(s + r) * nb + kb] = p[r];                                           \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            return;                                                                               \
        }                                                                                         \
        for (int64_t s = r0; s < r1; s += 16) {  /* columns: a block row of 16 rows, 16 columns at a time */ \
            const float *e4s = enc4 + s / 16 * C, *f4s = sf4 + s / 16 * C;                       \
            const float *e6s = enc6 + s / 16 * C, *f6s = sf6 + s / 16 * C;                       \
            for (int64_t j = 0; j < C; j += LANES) {                                              \
                f32v n4 = load_f32(e4s + j), n6 = load_f32(e6s + j);                              \
                f32v d4 = load_f32(f4s + j), d6 = load_f32(f6s + j);                              \
                /* one scale for all 16 lanes: the table; else each lane's values */              \
                int one = 1;                                                                      \
                for (int i = 1; i < LANES; i++)                                                   \
                    one &= f2u(d4[i]) == f2u(d4[0]) && f2u(d6[i]) == f2u(d6[0]);                  \
                f32v tb4 = one ? table_for(&t4, d4[0], amax, denom) : (f32v){};                   \
                f32v tb6 = one ? table_for(&t6, d6[0], amax, denom) : (f32v){};                   \
                f32v acc4 = {0}, acc6 = {0};                                                      \
                u8v b4[8], b6[8];                                                                 \
                for (int k = 0; k < 16; k += 2) {                                                 \
                    f32v xa = LOAD(x + (s + k) * C + j), xb = LOAD(x + (s + k + 1) * C + j);     \
                    u32v a4 = TO_E2M1(xa * n4), bb4 = TO_E2M1(xb * n4);                           \
                    u32v a6 = TO_E2M1(xa * n6), bb6 = TO_E2M1(xb * n6);                           \
                    if (one) {                                                                    \
                        acc4 += table_error(xa, a4, tb4, mse); acc4 += table_error(xb, bb4, tb4, mse); \
                        acc6 += table_error(xa, a6, tb6, mse); acc6 += table_error(xb, bb6, tb6, mse); \
                    } else {                                                                      \
                        acc4 += e2m1_error(xa, a4, d4, amax, denom, mse);                         \
                        acc4 += e2m1_error(xb, bb4, d4, amax, denom, mse);                        \
                        acc6 += e2m1_error(xa, a6, d6, amax, denom, mse);                         \
                        acc6 += e2m1_error(xb, bb6, d6, amax, denom, mse);                        \
                    }                                                                             \
                    b4[k / 2] = paired_rows(a4, bb4);                                             \
                    b6[k / 2] = paired_rows(a6, bb6);                                             \
                }                                                                                 \
                u8v p = low_bytes((u32v)(acc4 < acc6) & 1u), m = (u8v)(p != 0);  /* NaN: false */ \
                for (int k = 0; k < 8; k++) {                                                     \
                    u8v o = (b4[k] & m) | (b6[k] & ~m);                                           \
                    memcpy(y + ((s - yoff) / 2 + k) * C + j, &o, LANES);                          \
                }                                                                                 \
                memcpy(pick + s / 16 * C + j, &p, LANES);                                         \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    static void NAME(const void *xv, int64_t C, const float *enc4, const float *sf4, const float *enc6, \
                     const float *sf6, uint8_t *y, uint8_t *pick, int cols, float amax, float denom, int mse, \
                     int64_t r0, int64_t r1, int64_t yoff) {                                      \
        if (cols) {                                                                               \
            if (mse) NAME##_loop(xv, C, enc4, sf4, enc6, sf6, y, pick, 1, amax, denom, 1, r0, r1, yoff); \
            else NAME##_loop(xv, C, enc4, sf4, enc6, sf6, y, pick, 1, amax, denom, 0, r0, r1, yoff); \
        } else {                                                                                  \
            if (mse) NAME##_loop(xv, C, enc4, sf4, enc6, sf6, y, pick, 0, amax, denom, 1, r0, r1, yoff); \
            else NAME##_loop(xv, C, enc4, sf4, enc6, sf6, y, pick, 0, amax, denom, 0, r0, r1, yoff); \
        }                                                                                         \
    }

/* 16 x 16 tiles (grids [R / 16, C / 16]): a tile's one pair of candidate scales serves both usages,
 * so each element is cast, and its two errors taken, once for both. The rowwise choice sums a
 * tile's errors row by row (each row in order), the columnwise one column by column (each down the
 * rows in order), the loop above's sums either way. Rows: codes yr [R, C / 2], choices pr; columns:
 * codes as pairs of rows, yc [R / 2, C] from `yoff`'s row on, choices pc; either usage NULL to skip. */
#define FP4_4OVER6_TILES(NAME, T, LOAD)                                                           \
    static inline __attribute__((always_inline)) void NAME##_loop(const T *x, int64_t C, const float *enc4, \
            const float *sf4, const float *enc6, const float *sf6, uint8_t *yr, uint8_t *pr, uint8_t *yc, \
            uint8_t *pc, float amax, float denom, const int mse, int64_t r0, int64_t r1, int64_t yoff) { \
        const int64_t nb = C / LANES;                                                             \
        for (int64_t s = r0; s < r1; s += 16) {                                                   \
            for (int64_t kb = 0; kb < nb; kb++) {                                                 \
                const int64_t g = s / 16 * nb + kb;                                               \
                const f32v n4 = (f32v){} + enc4[g], n6 = (f32v){} + enc6[g];                      \
                const f32v tb4 = decode_table(sf4[g], amax, denom), tb6 = decode_table(sf6[g], amax, denom); \
                float m4[16][LANES], m6[16][LANES];  /* each row's terms */                       \
                uint8_t c4[16][LANES / 2], c6[16][LANES / 2];  /* each row's codes */             \
                u8v b4[8], b6[8];  /* pairs of rows' codes */                                     \
                f32v acc4 = {0}, acc6 = {0};  /* each column's sum */                             \
                for (int k = 0; k < 16; k += 2) {                                                 \
                    const T *xr = x + (s + k) * C + kb * LANES;                                   \
                    f32v xa = LOAD(xr), xb = LOAD(xr + C);                                        \
                    u32v a4 = TO_E2M1(xa * n4), bb4 = TO_E2M1(xb * n4);                           \
                    u32v a6 = TO_E2M1(xa * n6), bb6 = TO_E2M1(xb * n6);                           \
                    f32v ea4 = table_error(xa, a4, tb4, mse), eb4 = table_error(xb, bb4, tb4, mse); \
                    f32v ea6 = table_error(xa, a6, tb6, mse), eb6 = table_error(xb, bb6, tb6, mse); \
                    if (yr) {                                                                     \
                        memcpy(m4[k], &ea4, sizeof ea4); memcpy(m4[k + 1], &eb4, sizeof eb4);     \
                        memcpy(m6[k], &ea6, sizeof ea6); memcpy(m6[k + 1], &eb6, sizeof eb6);     \
                        pack_lanes(a4, c4[k]); pack_lanes(bb4, c4[k + 1]);                        \
                        pack_lanes(a6, c6[k]); pack_lanes(bb6, c6[k + 1]);                        \
                    }                                                                             \
                    if (yc) {                                                                     \
                        acc4 += ea4; acc4 += eb4; acc6 += ea6; acc6 += eb6;                       \
                        b4[k / 2] = paired_rows(a4, bb4);                                         \
                        b6[k / 2] = paired_rows(a6, bb6);                                         \
                    }                                                                             \
                }                                                                                 \
                if (yr) {  /* NaN: false, map-to-6 */                                             \
                    const int p = tile_sum(row_sums16(m4)) < tile_sum(row_sums16(m6));           \
                    for (int r = 0; r < 16; r++)                                                  \
                        memcpy(yr + (s + r) * (C / 2) + kb * (LANES / 2), p ? c4[r] : c6[r], LANES / 2); \
                    pr[g] = (uint8_t)p;                                                           \
                }                                                                                 \
                if (yc) {                                                                         \
                    const int p = tile_sum(acc4) < tile_sum(acc6);                                \
                    for (int k = 0; k < 8; k++)                                                   \
                        memcpy(yc + ((s - yoff) / 2 + k) * C + kb * LANES, p ? &b4[k] : &b6[k], LANES); \
                    pc[g] = (uint8_t)p;                                                           \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    static void NAME(const void *xv, int64_t C, const float *enc4, const float *sf4, const float *enc6, \
                     const float *sf6, uint8_t *yr, uint8_t *pr, uint8_t *yc, uint8_t *pc, float amax, \
                     float denom, int mse, int64_t r0, int64_t r1, int64_t yoff) {                \
        if (mse) NAME##_loop(xv, C, enc4, sf4, enc6, sf6, yr, pr, yc, pc, amax, denom, 1, r0, r1, yoff); \
        else NAME##_loop(xv, C, enc4, sf4, enc6, sf6, yr, pr, yc, pc, amax, denom, 0, r0, r1, yoff); \
    }

INPUT_KINDS(FP4_4OVER6, fp4_4over6)
typedef void (*fp4_4over6_fn)(const void *, int64_t, const float *, const float *, const float *, const float *,
                              uint8_t *, uint8_t *, int, float, float, int, int64_t, int64_t, int64_t);
INPUT_KIND_OF(fp4_4over6_of, fp4_4over6, fp4_4over6_fn)
INPUT_KINDS(FP4_4OVER6_TILES, fp4_4over6_tiles)
typedef void (*fp4_4over6_tiles_fn)(const void *, int64_t, const float *, const float *, const float *,
                                    const float *, uint8_t *, uint8_t *, uint8_t *, uint8_t *, float, float, int,
                                    int64_t, int64_t, int64_t);
INPUT_KIND_OF(fp4_4over6_tiles_of, fp4_4over6_tiles, fp4_4over6_tiles_fn)

/* x [R, C] contiguous (in_kind as for the casts), C a multiple of 16; R a multiple of 16 for
 * columns. 1 x 16 blocks along the rows (cols == 0) or down the columns (cols == 1); columns'
 * codes written transposed, [C, R / 2] as the usage keeps them: 128 rows at a time into a buffer
 * of 64 packed rows, then transposed while in cache (whole 64-byte lines to each destination
 * row). Returns 0, or -1 where it does not apply or memory ran out. */
int te_serial_fp4_4over6(const void *x, int in_kind, int64_t R, int64_t C, const float *enc4, const float *sf4,
                         const float *enc6, const float *sf6, uint8_t *y, uint8_t *pick, int cols, float amax,
                         float denom, int mse, int threads) {
    fp4_4over6_fn fn = fp4_4over6_of(in_kind);
    if (!fn || C % LANES || (cols && R % 16)) return -1;
    uint8_t *yr = cols ? 0 : y, *yc = cols ? y : 0;
    int failed = 0;
    FOR_STRIPES(R, yc ? 128 : 16, yc ? 128 : 0, threads, yc ? 64 * C : 0, failed,
        fn(x, C, enc4, sf4, enc6, sf6, yc ? buf : yr, pick, cols, amax, denom, mse, sb, se, sb);
        if (yc) transpose_rows(buf, yc + sb / 2, C, C, R / 2, 0, (se - sb) / 2););
    return failed ? -1 : 0;
}

/* The same for 16 x 16 tiles, R and C multiples of 16: either usage, or both from one pass (yr, pr
 * or yc, pc NULL to skip one). */
int te_serial_fp4_4over6_tiles(const void *x, int in_kind, int64_t R, int64_t C, const float *enc4,
                               const float *sf4, const float *enc6, const float *sf6, uint8_t *yr, uint8_t *pr,
                               uint8_t *yc, uint8_t *pc, float amax, float denom, int mse, int threads) {
    fp4_4over6_tiles_fn fn = fp4_4over6_tiles_of(in_kind);
    if (!fn || C % LANES || R % 16) return -1;
    int failed = 0;
    FOR_STRIPES(R, yc ? 128 : 16, yc ? 128 : 0, threads, yc ? 64 * C : 0, failed,
        fn(x, C, enc4, sf4, enc6, sf6, yr, pr, yc ? buf : 0, pc, amax, denom, mse, sb, se, sb);
        if (yc) transpose_rows(buf, yc + sb / 2, C, C, R / 2, 0, (se - sb) / 2););
    return failed ? -1 : 0;
}
