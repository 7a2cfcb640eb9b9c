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
