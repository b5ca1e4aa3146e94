/* Fused CPU kernels for the sign, ternary, qsgd and uniform codecs, random-k's subsets,
 * sparse vectors, delta-golomb's bit streams, PowerSGD's low-rank product and CHOCO's step
 * (gossipdl.compression._native).
 *
 * numpy needs four passes over a 40 MB tensor for a sign encode (signbit,
 * packbits, a ±1 table lookup, a dot product for the L1 norm) and torch more;
 * these do it in one read pass (bits and L1 together) plus one write pass
 * (±scale), with AVX-512 or AVX2 where the CPU has them. The quantizers
 * (torch: 10-20 full-size temporaries per round trip) read x once for the
 * scales and once more to write the packed codes and the sender's estimate
 * (once in all when a block fits in cache), and decode in one write pass.
 *
 *   sign_encode(x, bits, block=0, sums=None) -> float
 *       bits[i // 8] bit (i % 8) = sign bit of x[i] (-0.0 counts as negative),
 *       least significant bit first, unused bits of the last byte 0 — the
 *       bytes of np.packbits(np.signbit(x), bitorder="little"). Returns Σ|x_i|,
 *       summed in float32 lanes over runs of at most 4096 values and in
 *       double across runs. With sums (float64, one per block of `block`
 *       values, the last block shorter; one for block 0 = the whole tensor),
 *       each block's Σ|x_i| goes there too.
 *   sign_expand(bits, scales, out, block=0) -> None
 *       out[i] = -s if bit i is set else s, s = scales[i // block] (float32;
 *       block 0: scales[0] for all).
 *   ternary_encode(x, packed, scales, out, seed, block=0) -> None
 *       TernGrad: scales[b] = max |x| of block b; t_i = sign(x_i) if
 *       u_i < |x_i|·(2^24/s) else 0; packed: t + 1 in base 3, five values a
 *       byte (ceil(n / 5) bytes, the last padded with t = 0); out = t·s.
 *   ternary_decode(packed, scales, out, block=0) -> None
 *       out = t·s (a byte over 242 gives some t in -1..1: the caller rejects it).
 *   qsgd_encode(x, packed, norms, out, levels, seed, block=0) -> None
 *       QSGD: norms[b] = ‖x‖₂ of block b (summed in double); level
 *       floor(r) + [u_i < r − floor(r)], r = |x_i|·(s/‖x‖), in [0, s]; code
 *       s ± level in ceil(log2(2s + 1)) bits, packed as pack_bits does;
 *       out = (code − s)·(‖x‖/s).
 *   qsgd_decode(packed, norms, out, levels, block=0) -> int
 *       out = (code − s)·(‖x‖/s); returns the largest code (the caller rejects
 *       one over 2s).
 *   uniform_encode(x, packed, lo, step, out, bits, block=0) -> None
 *       lo, hi = min, max of block b, step = (hi − lo)/(2^bits − 1); code =
 *       floor((x − lo)·(1/step) + 0.5) in [0, 2^bits − 1]; out = code·step + lo.
 *   uniform_decode(packed, lo, step, out, bits, block=0) -> None
 *       out = code·step + lo.
 *   subset_mark(draws, numel, bitmap, found, want) -> int
 *       Random-k's subset: for each draw in order, v = draw % numel; a v whose
 *       bit in bitmap (LSB first) is clear is set and counted, until `found`
 *       reaches `want`; returns the new count (the caller draws more while it
 *       is short). The bits set are the first `want` distinct values.
 *   subset_positions(bitmap, numel, value, out) -> None
 *       out (int64) = the positions below numel whose bit is `value` (1 or 0),
 *       ascending; their number must be out's length.
 *   codes_over(packed, bits, count, limit) -> bool
 *       Whether any of the first `count` codes of `bits` bits (1..8) packed LSB first
 *       (pack_bits' stream) is over `limit`: what QSGD's decoder checks on the host
 *       before the codes go to a GPU, where a check would make the host wait.
 *   magnitude_at_least(x, tau, idx, val) -> int
 *       The positions i (ascending) with |x_i| >= tau (float32 compare; NaN never) and
 *       x_i there, into int64 idx and float32 val, at most len(idx) of them; returns
 *       how many there are in all (the caller makes room and asks again if more).
 *   densify(idx, val, out) -> None
 *       out = 0 but at positions idx (int64, strictly rising, below len(out)), where
 *       it is val; other positions raise ValueError.
 *   low_rank_product(p, qt, out, rows, cols) -> None
 *       PowerSGD's P̂ Qᵀ for float32 p (rows × rank) and qt (rank × cols), row-major:
 *       out[r·cols + c] = (p[r][0]·qt[0][c] + p[r][1]·qt[1][c]) + p[r][2]·qt[2][c] + …,
 *       each product and sum rounded on its own (rank 0: 0), for the first len(out) <=
 *       rows·cols values (a cropped last row).
 *   choco_step(x, s, x_hat, gamma, out) -> None
 *       out = x + gamma·(s − x_hat) (float32, gamma rounded to float32), each operation
 *       rounded on its own in that order, as torch's three passes round them.
 *   golomb_sums(gaps, first) -> (int, int, int)
 *       Σ gaps >> (first + i) for i = 0, 1, 2: the unary bits for three parameters.
 *   golomb_pack(gaps, b, unary, rest) -> None
 *       delta-golomb's two streams for int64 gaps >= 0 (b <= 56; sizes exact).
 *   golomb_unpack(unary, rest, b, count, numel, out) -> int
 *       The count indices the streams code into int64 out: 0, or 1 when unary does
 *       not hold exactly count quotients ending in its last byte, 2 when an index
 *       would reach numel (out is then partly written).
 *   use_isa([name]) -> str
 *       Run the "avx512f", "avx2" or "generic" kernels from now on (the best
 *       the CPU has is picked at import; tests compare them) and return the
 *       previous choice; without a name, return the current one.
 *
 * A sign block must be a multiple of 8 values, so that each starts on a byte
 * of bits (the codec runs numpy for other blocks); the quantizers take any
 * block (0: the whole tensor; the last block shorter). u_i is 24 random bits
 * (see "Random numbers" below), drawn from `seed`.
 *
 * Arguments are contiguous buffers (numpy arrays): x and out float32, bits
 * and packed uint8, scales float32; sizes are checked and a mismatch raises
 * ValueError (no kernel reads or writes outside its buffers, whatever the
 * bytes). The GIL is released while a kernel runs.
 *
 * One thread: on the 2-core machine these were measured on, a 40 MB pass is
 * bound by memory bandwidth, and a second thread made it slower, not faster.
 * The encoder prefetches 4 KB ahead (1.22 -> 1.0 ms for a cold 40 MB read);
 * outputs of 16 MB or more that start on a 64-byte boundary are written with
 * non-temporal stores (they do not fit in cache anyway, and skipping the
 * read-for-ownership saves a third of the traffic).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define GOSSIPDL_X86 1
#include <immintrin.h>
#endif

#define BLOCK 4096                   /* values summed in float32 before the sum moves to double */
#define PREFETCH 1024                /* values ahead of the one being read */
#define STREAM_BYTES ((Py_ssize_t)16 << 20)

/* Non-temporal stores for an output that cannot stay in cache (a fence after them). */
static inline int stream_out(const float *out, int64_t n) {
    return (int64_t)n * 4 >= STREAM_BYTES && (uintptr_t)out % 64 == 0;
}

typedef double (*encode_t)(const float *x, uint8_t *bits, int64_t n);
typedef void (*expand_t)(const uint8_t *bits, float scale, float *out, int64_t n, int stream);

/* --- portable kernels (any CPU; also the last few values after a vector kernel) --- */

static double encode_generic(const float *x, uint8_t *bits, int64_t n) {
    double l1 = 0.0;
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t end = start + BLOCK < n ? start + BLOCK : n;
        float acc = 0.0f;
        for (int64_t i = start; i < end; i += 8) {
            int64_t m = end - i < 8 ? end - i : 8;
            unsigned byte = 0;
            for (int64_t j = 0; j < m; j++) {
                uint32_t u;
                float a;
                memcpy(&u, x + i + j, sizeof u);
                byte |= (u >> 31) << j;
                u &= 0x7fffffffu;
                memcpy(&a, &u, sizeof a);
                acc += a;
            }
            bits[i / 8] = (uint8_t)byte;
        }
        l1 += acc;
    }
    return l1;
}

static void expand_generic(const uint8_t *bits, float scale, float *out, int64_t n, int stream) {
    (void)stream;
    for (int64_t i = 0; i < n; i++)
        out[i] = (bits[i / 8] >> (i % 8)) & 1 ? -scale : scale;
}

#ifdef GOSSIPDL_X86
/* --- AVX-512: 16 values per mask register of sign bits; 64 per step --- */

/* Four accumulators: one would make every step wait for the previous add (4-cycle latency). */
__attribute__((target("avx512f"))) static double encode_avx512(const float *x, uint8_t *bits,
                                                               int64_t n) {
    const int64_t steps = n / 64;
    const __m512i zero = _mm512_setzero_si512();
    double l1 = 0.0;
    for (int64_t s0 = 0; s0 < steps; s0 += BLOCK / 64) {
        int64_t s1 = s0 + BLOCK / 64 < steps ? s0 + BLOCK / 64 : steps;
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                         _mm512_setzero_ps()};
        for (int64_t s = s0; s < s1; s++) {
            uint16_t masks[4];
            for (int k = 0; k < 4; k++) {
                _mm_prefetch((const char *)(x + 64 * s + 16 * k + PREFETCH), _MM_HINT_T0);
                __m512 v = _mm512_loadu_ps(x + 64 * s + 16 * k);
                masks[k] = _mm512_cmplt_epi32_mask(_mm512_castps_si512(v), zero);
                acc[k] = _mm512_add_ps(acc[k], _mm512_abs_ps(v));
            }
            memcpy(bits + 8 * s, masks, 8); /* little-endian: value 16k + j is bit j */
        }
        l1 += _mm512_reduce_add_ps(
            _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    }
    return l1 + encode_generic(x + 64 * steps, bits + 8 * steps, n - 64 * steps);
}

__attribute__((target("avx512f"))) static void expand_avx512(const uint8_t *bits, float scale,
                                                             float *out, int64_t n, int stream) {
    const int64_t groups = n / 16;
    const __m512 pos = _mm512_set1_ps(scale), neg = _mm512_set1_ps(-scale);
    for (int64_t g = 0; g < groups; g++) {
        uint16_t mask;
        memcpy(&mask, bits + 2 * g, 2);
        __m512 v = _mm512_mask_blend_ps(mask, pos, neg);
        if (stream)
            _mm512_stream_ps(out + 16 * g, v);
        else
            _mm512_storeu_ps(out + 16 * g, v);
    }
    if (stream)
        _mm_sfence();
    expand_generic(bits + 2 * groups, scale, out + 16 * groups, n - 16 * groups, 0);
}

/* --- AVX2: movemask gives 8 sign bits as one byte; 32 values per step --- */

__attribute__((target("avx2"))) static double encode_avx2(const float *x, uint8_t *bits,
                                                           int64_t n) {
    const int64_t steps = n / 32;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    double l1 = 0.0;
    for (int64_t s0 = 0; s0 < steps; s0 += BLOCK / 32) {
        int64_t s1 = s0 + BLOCK / 32 < steps ? s0 + BLOCK / 32 : steps;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                         _mm256_setzero_ps()};
        for (int64_t s = s0; s < s1; s++) {
            _mm_prefetch((const char *)(x + 32 * s + PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(x + 32 * s + 16 + PREFETCH), _MM_HINT_T0);
            for (int k = 0; k < 4; k++) {
                __m256 v = _mm256_loadu_ps(x + 32 * s + 8 * k);
                bits[4 * s + k] = (uint8_t)_mm256_movemask_ps(v);
                acc[k] = _mm256_add_ps(acc[k], _mm256_and_ps(v, magnitude));
            }
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]),
                                              _mm256_add_ps(acc[2], acc[3])));
        for (int k = 0; k < 8; k++)
            l1 += lanes[k];
    }
    return l1 + encode_generic(x + 32 * steps, bits + 4 * steps, n - 32 * steps);
}

__attribute__((target("avx2"))) static void expand_avx2(const uint8_t *bits, float scale,
                                                        float *out, int64_t n, int stream) {
    const int64_t bytes = n / 8;
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 pos = _mm256_set1_ps(scale), neg = _mm256_set1_ps(-scale);
    for (int64_t b = 0; b < bytes; b++) {
        __m256i set = _mm256_and_si256(_mm256_set1_epi32(bits[b]), lane_bit);
        __m256 v = _mm256_blendv_ps(pos, neg,
                                    _mm256_castsi256_ps(_mm256_cmpeq_epi32(set, lane_bit)));
        if (stream)
            _mm256_stream_ps(out + 8 * b, v);
        else
            _mm256_storeu_ps(out + 8 * b, v);
    }
    if (stream)
        _mm_sfence();
    expand_generic(bits + bytes, scale, out + 8 * bytes, n - 8 * bytes, 0);
}
#endif

/* --- the quantizers: ternary, qsgd, uniform ---
 *
 * Encode walks the tensor in chunks of CHUNK values (a multiple of 5, 8 and 16, so every
 * chunk starts on a byte of the packed stream) and each chunk in runs that share one block's
 * scale. A block's scale (max |x|, ‖x‖₂, or min and max) is computed when its first run
 * starts, over the whole block: for blocks that fit in cache the quantizing runs then read
 * them from cache, so x crosses memory once (twice for block 0, the whole tensor). A run
 * writes the sender's estimate to `out` and its codes to a chunk buffer in L1, packed into
 * the payload when the chunk is done (AVX-512 ternary packs a whole chunk of one block in
 * registers as it goes). Decode writes `out` block by block from the packed bytes (AVX-512),
 * or unpacks a chunk into L1 first (the others).
 *
 * The elementwise bodies are plain loops, written once and inlined into one function per
 * instruction set (the target attribute lets the compiler vectorize each for it); the
 * AVX-512 ones are written out with intrinsics (the compiler picks 256-bit vectors for
 * loops that store bytes) and stream large outputs past the cache. Every float operation is
 * IEEE elementwise, in the order the torch code does it, so all instruction sets give the
 * same bytes and values (setup.py turns off FMA contraction). The one sum, qsgd's Σ x², is
 * taken in double in an order per instruction set: its float32 norm is the same unless the
 * double sums straddle a float32 rounding boundary (about 1e-9 per block).
 */

#define CHUNK 4080 /* values per chunk: 5 * 816 = 16 * 255; 16 KB of float32, in L1 */
#define SLACK 64   /* bytes after a chunk buffer that an 8- or 32-byte copy may touch */
#define INLINE static inline __attribute__((always_inline))
#define TWO24 16777216.0f

/* Random numbers: 24 bits per value (as torch.rand's float32 has), the top bits of xoshiro128+
   (Blackman and Vigna 2018; their pick for float32) in 16 interleaved generators: value i of
   a call gets step i / 16 of generator i % 16, so every instruction set draws the same
   number for it. The 16 states come from the call's 64-bit seed by splitmix64. No multiply
   per value: a third of the cost of a counter hash here. The AVX-512 kernels draw each step
   in registers as they go (the drawing hides under the memory traffic); the others draw a
   chunk's numbers into an L1 buffer first. */
typedef struct {
    uint32_t s[4][16];
    float pending[16]; /* the last step drawn, for a run that starts inside it */
} xoshiro_t;

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void seed_lanes(xoshiro_t *g, uint64_t seed) {
    for (int w = 0; w < 4; w++)
        for (int l = 0; l < 16; l += 2) {
            uint64_t z = splitmix64(&seed);
            g->s[w][l] = (uint32_t)z, g->s[w][l + 1] = (uint32_t)(z >> 32);
        }
}

/* `steps` steps of the 16 generators: u[16 k + l] = step k of generator l, an integer in
   [0, 2^24) as a float (exact). */
/* GCC vector types of 8 lanes, two per step: the compiler maps them onto the registers each
   instruction set has (it would not vectorize a plain loop over the lanes; 16-lane types it
   spills to the stack under AVX2). */
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

INLINE void random_body(xoshiro_t *restrict g, int steps, float *restrict u) {
    for (int half = 0; half < 2; half++) {
        u32x8 s0, s1, s2, s3;
        memcpy(&s0, g->s[0] + 8 * half, 32), memcpy(&s1, g->s[1] + 8 * half, 32);
        memcpy(&s2, g->s[2] + 8 * half, 32), memcpy(&s3, g->s[3] + 8 * half, 32);
        for (int k = 0; k < steps; k++) {
            u32x8 result = s0 + s3, t = s1 << 9;
            s2 ^= s0;
            s3 ^= s1;
            s1 ^= s2;
            s0 ^= s3;
            s2 ^= t;
            s3 = (s3 << 11) | (s3 >> 21);
            f32x8 f = __builtin_convertvector((i32x8)(result >> 8), f32x8);
            memcpy(u + 16 * k + 8 * half, &f, 32);
        }
        memcpy(g->s[0] + 8 * half, &s0, 32), memcpy(g->s[1] + 8 * half, &s1, 32);
        memcpy(g->s[2] + 8 * half, &s2, 32), memcpy(g->s[3] + 8 * half, &s3, 32);
    }
}

/* max |x| as an integer compare of the magnitudes' bits (ordered like the floats; a NaN's
   bits are the largest, so a NaN scale results, as torch's amax gives). */
INLINE float max_abs_body(const float *restrict x, int64_t n) {
    uint32_t m = 0;
    for (int64_t j = 0; j < n; j++) {
        uint32_t u;
        memcpy(&u, x + j, 4);
        u &= 0x7fffffffu;
        m = u > m ? u : m;
    }
    float s;
    memcpy(&s, &m, 4);
    return s;
}

/* Σ x² in double (no overflow for any float32), in 16 lanes summed at the end. */
INLINE double sum_squares_body(const float *restrict x, int64_t n) {
    double acc[16] = {0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; l++)
            acc[l] += (double)x[j + l] * (double)x[j + l];
    for (; j < n; j++)
        acc[0] += (double)x[j] * (double)x[j];
    double total = 0.0;
    for (int l = 0; l < 16; l++)
        total += acc[l];
    return total;
}

/* An int32 ordered as the floats are (negative floats' other bits flipped), and back. */
INLINE int32_t order_key(int32_t bits) { return bits ^ ((bits >> 31) & 0x7fffffff); }

INLINE void min_max_body(const float *restrict x, int64_t n, float *lo, float *hi) {
    int32_t mn = INT32_MAX, mx = INT32_MIN;
    for (int64_t j = 0; j < n; j++) {
        int32_t b;
        memcpy(&b, x + j, 4);
        int32_t key = order_key(b);
        mn = key < mn ? key : mn;
        mx = key > mx ? key : mx;
    }
    mn = order_key(mn), mx = order_key(mx);
    memcpy(lo, &mn, 4);
    memcpy(hi, &mx, 4);
}

/* ternary: keep value j with probability |x|/s (u < |x|·(2^24/s)); digit t + 1 in {0, 1, 2};
   estimate t·s. */
INLINE void ternary_body(const float *restrict x, const float *restrict u, int m, float s,
                         float inv24, uint8_t *restrict digits, float *restrict out) {
    for (int j = 0; j < m; j++) {
        float v = x[j];
        int keep = u[j] < fabsf(v) * inv24;
        int digit = keep ? (v < 0.0f ? 0 : 2) : 1;
        digits[j] = (uint8_t)digit;
        out[j] = (float)(digit - 1) * s;
    }
}

/* qsgd: r = |x|·(s/‖x‖), level floor(r) + [u < r − floor(r)] in [0, s] (NaN: 0), code
   s ± level; estimate (code − s)·(‖x‖/s). */
INLINE void qsgd_body(const float *restrict x, const float *restrict u, int m, float scale,
                      float unit, float levels, uint8_t *restrict codes, float *restrict out) {
    for (int j = 0; j < m; j++) {
        float v = x[j];
        float r = fabsf(v) * scale;
        float low = floorf(r);
        float level = low + (u[j] < (r - low) * TWO24);
        level = level > 0.0f ? level : 0.0f;
        level = level < levels ? level : levels;
        float code = v < 0.0f ? levels - level : levels + level;
        codes[j] = (uint8_t)(int32_t)code;
        out[j] = (code - levels) * unit;
    }
}

/* uniform: code round((x − lo)·(1/step)) in [0, top] (NaN: 0); estimate code·step + lo. */
INLINE void uniform_body(const float *restrict x, int m, float lo, float step, float inverse,
                         float top, uint8_t *restrict codes, float *restrict out) {
    for (int j = 0; j < m; j++) {
        float code = floorf((x[j] - lo) * inverse + 0.5f);
        code = code > 0.0f ? code : 0.0f;
        code = code < top ? code : top;
        codes[j] = (uint8_t)(int32_t)code;
        out[j] = code * step + lo;
    }
}

/* decode bodies: trits (floats -1, 0, 1) times s; codes to (code − s)·unit or code·step + lo. */
INLINE void scale_body(const float *restrict t, int m, float s, float *restrict out) {
    for (int j = 0; j < m; j++)
        out[j] = t[j] * s;
}

INLINE void levels_body(const uint8_t *restrict codes, int m, float levels, float unit,
                        float *restrict out) {
    for (int j = 0; j < m; j++)
        out[j] = ((float)codes[j] - levels) * unit;
}

INLINE void grid_body(const uint8_t *restrict codes, int m, float lo, float step,
                      float *restrict out) {
    for (int j = 0; j < m; j++)
        out[j] = (float)codes[j] * step + lo;
}

INLINE uint8_t max_code_body(const uint8_t *restrict codes, int m) {
    uint8_t mx = 0;
    for (int j = 0; j < m; j++)
        mx = codes[j] > mx ? codes[j] : mx;
    return mx;
}

/* --- packing (portable: shifts and masks on 8 codes at a time, little-endian) --- */

/* codes[0, m) (each < 2^bits, zero from m on for 64 bytes) into the bit stream at dst, LSB
   first: the bytes of pack_bits. Eight groups of 8 codes at a time (one vector), each group
   then stored as 8 bytes at its place: the next overwrites the zeros past it. dst needs 8
   bytes of slack. */
INLINE void pack_codes_body(const uint8_t *restrict codes, int m, int bits,
                            uint8_t *restrict dst) {
    int groups = (m + 7) / 8;
    for (int g0 = 0; g0 < groups; g0 += 8) {
        uint64_t x[8];
        for (int k = 0; k < 8; k++) {
            uint64_t w;
            memcpy(&w, codes + 8 * (g0 + k), 8);
            w = (w & 0x00ff00ff00ff00ffull) | ((w & 0xff00ff00ff00ff00ull) >> (8 - bits));
            w = (w & 0x0000ffff0000ffffull) | ((w & 0xffff0000ffff0000ull) >> (16 - 2 * bits));
            x[k] = (w & 0x00000000ffffffffull) |
                   ((w & 0xffffffff00000000ull) >> (32 - 4 * bits));
        }
        for (int k = 0; k < 8 && g0 + k < groups; k++)
            memcpy(dst + (int64_t)(g0 + k) * bits, &x[k], 8);
    }
}

/* The inverse: 8 codes per `bits` bytes of src (which needs 8 bytes of slack), split in
   halves, quarters and eighths of the 64-bit word. */
INLINE void unpack_codes(const uint8_t *src, int m, int bits, uint8_t *codes) {
    const uint64_t half = (1ull << (4 * bits)) - 1; /* bits 8: 2^32 - 1 */
    const uint64_t quarter = 0x0000000100000001ull * ((1ull << (2 * bits)) - 1);
    const uint64_t eighth = 0x0001000100010001ull * ((1ull << bits) - 1);
    for (int g = 0; 8 * g < m; g++) {
        uint64_t x;
        memcpy(&x, src + (int64_t)g * bits, 8);
        x = (x & half) | (((x >> (4 * bits)) & half) << 32);
        x = (x & quarter) | (((x >> (2 * bits)) & quarter) << 16);
        x = (x & eighth) | (((x >> bits) & eighth) << 8);
        memcpy(codes + 8 * g, &x, 8);
    }
}

/* Base-3 digits (0..2) five to a byte, d0 + 3 d1 + 9 d2 + 27 d3 + 81 d4: byte 4 of the
   product of the eight digit bytes with 81, 27, 9, 3, 1 (no byte below it carries). */
static void pack_trits(const uint8_t *digits, int m, uint8_t *dst) {
    for (int g = 0; 5 * g < m; g++) {
        uint64_t x;
        memcpy(&x, digits + 5 * g, 8);
        dst[g] = (uint8_t)((x * 0x0103091b51ull) >> 32);
    }
}

static float trit_table[256][8]; /* row b: the 5 digits of b (b < 243) as -1, 0, 1; rest 0 */

static void fill_trit_table(void) {
    for (int b = 0; b < 243; b++)
        for (int k = 0, rest = b; k < 5; k++, rest /= 3)
            trit_table[b][k] = (float)(rest % 3 - 1);
}

/* bytes[0, g) to 5 g trit values (as floats) at t, which needs 3 floats of slack. */
INLINE void unpack_trits(const uint8_t *bytes, int64_t g, float *t) {
    for (int64_t j = 0; j < g; j++)
        memcpy(t + 5 * j, trit_table[bytes[j]], 32);
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Decode by chunks: a chunk's bytes unpacked into L1, then each block's run scaled into out. */
INLINE void ternary_decode_chunks(const uint8_t *packed, const float *scales, int64_t n,
                                  int64_t block, float *out) {
    float t[CHUNK + SLACK / 4];
    int64_t size = block ? block : n;
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        int64_t c1 = min64(c0 + CHUNK, n);
        unpack_trits(packed + c0 / 5, (c1 - c0 + 4) / 5, t);
        for (int64_t i = c0; i < c1;) {
            int64_t b = i / size, end = min64(c1, (b + 1) * size);
            scale_body(t + (i - c0), (int)(end - i), scales[b], out + i);
            i = end;
        }
    }
}

/* qsgd (grid 0: (code − a)·(b / a), a = levels, b = the norm; returns the largest code) or
   uniform (grid 1: code·b + a, a = lo, b = step). */
INLINE int codes_decode_chunks(const uint8_t *packed, const float *a, const float *b_,
                               float levels, int64_t n, int64_t block, int bits, int grid,
                               float *out) {
    uint8_t codes[CHUNK + SLACK], bytes[CHUNK + SLACK];
    int64_t size = block ? block : n;
    int top = 0;
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        int64_t c1 = min64(c0 + CHUNK, n);
        int m = (int)(c1 - c0);
        size_t have = (size_t)((int64_t)m * bits + 7) / 8;
        memcpy(bytes, packed + c0 / 8 * bits, have);
        memset(bytes + have, 0, 16);
        unpack_codes(bytes, m, bits, codes);
        if (!grid) {
            int mx = max_code_body(codes, m);
            top = mx > top ? mx : top;
        }
        for (int64_t i = c0; i < c1;) {
            int64_t b = i / size, end = min64(c1, (b + 1) * size);
            if (grid)
                grid_body(codes + (i - c0), (int)(end - i), a[b], b_[b], out + i);
            else
                levels_body(codes + (i - c0), (int)(end - i), levels, b_[b] / levels, out + i);
            i = end;
        }
    }
    return top;
}

typedef struct {
    float (*max_abs)(const float *, int64_t);
    double (*sum_squares)(const float *, int64_t);
    void (*min_max)(const float *, int64_t, float *, float *);
    void (*random)(xoshiro_t *, int, float *);
    void (*pack)(const uint8_t *, int, int, uint8_t *);
    void (*pack_trits)(const uint8_t *, int, uint8_t *);
    /* x, u (or, fused, the generators and x[0]'s index), values, scales, codes, out, stream */
    void (*ternary)(const float *, const float *, xoshiro_t *, int64_t, int, float, float,
                    uint8_t *, float *, int);
    /* a whole chunk in one block, packed as it goes (NULL: none) */
    void (*ternary_chunk)(const float *, xoshiro_t *, float, float, uint8_t *, float *, int);
    void (*qsgd)(const float *, const float *, xoshiro_t *, int64_t, int, float, float, float,
                 uint8_t *, float *, int);
    void (*uniform)(const float *, int, float, float, float, float, uint8_t *, float *, int);
    void (*ternary_decode)(const uint8_t *, const float *, int64_t, int64_t, float *);
    int (*qsgd_decode)(const uint8_t *, const float *, int64_t, int64_t, int, float *);
    void (*uniform_decode)(const uint8_t *, const float *, const float *, int64_t, int64_t, int,
                           float *);
    int fused; /* the encode kernels draw their own random numbers */
} quantizers_t;

static inline int qsgd_bits(long levels) { return 32 - __builtin_clz((unsigned)(2 * levels)); }

/* One set of functions per instruction set, each the bodies above compiled for it (`stream`,
   non-temporal stores, only the AVX-512 ones use). */
#define QUANTIZERS(SUFFIX, TARGET)                                                             \
    TARGET static float max_abs_##SUFFIX(const float *x, int64_t n) {                          \
        return max_abs_body(x, n);                                                             \
    }                                                                                          \
    TARGET static double sum_squares_##SUFFIX(const float *x, int64_t n) {                     \
        return sum_squares_body(x, n);                                                         \
    }                                                                                          \
    TARGET static void min_max_##SUFFIX(const float *x, int64_t n, float *lo, float *hi) {     \
        min_max_body(x, n, lo, hi);                                                            \
    }                                                                                          \
    TARGET static void random_##SUFFIX(xoshiro_t *g, int steps, float *u) {                    \
        random_body(g, steps, u);                                                              \
    }                                                                                          \
    TARGET static void pack_##SUFFIX(const uint8_t *codes, int m, int bits, uint8_t *dst) {    \
        pack_codes_body(codes, m, bits, dst);                                                  \
    }                                                                                          \
    TARGET static void ternary_##SUFFIX(const float *x, const float *u, xoshiro_t *lanes,      \
                                        int64_t i0, int m, float s, float inv24,               \
                                        uint8_t *digits, float *out, int stream) {             \
        (void)lanes, (void)i0, (void)stream;                                                   \
        ternary_body(x, u, m, s, inv24, digits, out);                                          \
    }                                                                                          \
    TARGET static void qsgd_##SUFFIX(const float *x, const float *u, xoshiro_t *lanes,         \
                                     int64_t i0, int m, float scale, float unit, float levels, \
                                     uint8_t *codes, float *out, int stream) {                 \
        (void)lanes, (void)i0, (void)stream;                                                   \
        qsgd_body(x, u, m, scale, unit, levels, codes, out);                                   \
    }                                                                                          \
    TARGET static void uniform_##SUFFIX(const float *x, int m, float lo, float step,           \
                                        float inverse, float top, uint8_t *codes, float *out,  \
                                        int stream) {                                          \
        (void)stream;                                                                          \
        uniform_body(x, m, lo, step, inverse, top, codes, out);                                \
    }                                                                                          \
    TARGET static void ternary_decode_##SUFFIX(const uint8_t *packed, const float *scales,     \
                                               int64_t n, int64_t block, float *out) {         \
        ternary_decode_chunks(packed, scales, n, block, out);                                  \
    }                                                                                          \
    TARGET static int qsgd_decode_##SUFFIX(const uint8_t *packed, const float *norms,          \
                                           int64_t n, int64_t block, int levels, float *out) { \
        return codes_decode_chunks(packed, NULL, norms, (float)levels, n, block,               \
                                   qsgd_bits(levels), 0, out);                                 \
    }                                                                                          \
    TARGET static void uniform_decode_##SUFFIX(const uint8_t *packed, const float *lo,         \
                                               const float *step, int64_t n, int64_t block,    \
                                               int bits, float *out) {                         \
        codes_decode_chunks(packed, lo, step, 0.0f, n, block, bits, 1, out);                   \
    }

QUANTIZERS(generic, )
static const quantizers_t quantizers_generic = {
    max_abs_generic, sum_squares_generic, min_max_generic, random_generic, pack_generic, pack_trits,
    ternary_generic, NULL, qsgd_generic, uniform_generic,
    ternary_decode_generic, qsgd_decode_generic, uniform_decode_generic, 0,
};

#ifdef GOSSIPDL_X86
QUANTIZERS(avx2, __attribute__((target("avx2"))))
static const quantizers_t quantizers_avx2 = {
    max_abs_avx2, sum_squares_avx2, min_max_avx2, random_avx2, pack_avx2, pack_trits,
    ternary_avx2, NULL, qsgd_avx2, uniform_avx2,
    ternary_decode_avx2, qsgd_decode_avx2, uniform_decode_avx2, 0,
};

/* --- AVX-512: 16 values per step; the scalar bodies before the first aligned step and after
   the last (they compute the same values) --- */

#define AVX512 __attribute__((target("avx512f")))
#define LANES _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)

/* The 16 generators in registers: one step's 16 numbers as floats. */
typedef struct {
    __m512i s0, s1, s2, s3;
} lanes512_t;

AVX512 static inline lanes512_t load_lanes(const xoshiro_t *g) {
    lanes512_t r = {_mm512_loadu_si512(g->s[0]), _mm512_loadu_si512(g->s[1]),
                    _mm512_loadu_si512(g->s[2]), _mm512_loadu_si512(g->s[3])};
    return r;
}

AVX512 static inline void store_lanes(xoshiro_t *g, const lanes512_t *r) {
    _mm512_storeu_si512(g->s[0], r->s0), _mm512_storeu_si512(g->s[1], r->s1);
    _mm512_storeu_si512(g->s[2], r->s2), _mm512_storeu_si512(g->s[3], r->s3);
}

AVX512 static inline __m512 step_lanes(lanes512_t *r) {
    __m512i result = _mm512_add_epi32(r->s0, r->s3), t = _mm512_slli_epi32(r->s1, 9);
    r->s2 = _mm512_xor_si512(r->s2, r->s0);
    r->s3 = _mm512_xor_si512(r->s3, r->s1);
    r->s1 = _mm512_xor_si512(r->s1, r->s2);
    r->s0 = _mm512_xor_si512(r->s0, r->s3);
    r->s2 = _mm512_xor_si512(r->s2, t);
    r->s3 = _mm512_rol_epi32(r->s3, 11);
    return _mm512_cvtepi32_ps(_mm512_srli_epi32(result, 8));
}

AVX512 static void random_avx512(xoshiro_t *g, int steps, float *u) {
    lanes512_t r = load_lanes(g);
    for (int k = 0; k < steps; k++)
        _mm512_storeu_ps(u + 16 * k, step_lanes(&r));
    store_lanes(g, &r);
}

/* As pack_codes_body: 8 groups of 8 codes (one vector) at a time. */
AVX512 static void pack_avx512(const uint8_t *codes, int m, int bits, uint8_t *dst) {
    const __m512i even8 = _mm512_set1_epi64(0x00ff00ff00ff00ffll);
    const __m512i even16 = _mm512_set1_epi64(0x0000ffff0000ffffll);
    const __m512i even32 = _mm512_set1_epi64(0x00000000ffffffffll);
    int groups = (m + 7) / 8;
    for (int g0 = 0; g0 < groups; g0 += 8) {
        uint64_t x[8];
        __m512i w = _mm512_loadu_si512(codes + 8 * g0);
        w = _mm512_or_si512(_mm512_and_si512(w, even8),
                            _mm512_srli_epi64(_mm512_andnot_si512(even8, w), 8 - bits));
        w = _mm512_or_si512(_mm512_and_si512(w, even16),
                            _mm512_srli_epi64(_mm512_andnot_si512(even16, w), 16 - 2 * bits));
        w = _mm512_or_si512(_mm512_and_si512(w, even32),
                            _mm512_srli_epi64(_mm512_andnot_si512(even32, w), 32 - 4 * bits));
        _mm512_storeu_si512(x, w);
        for (int k = 0; k < 8 && g0 + k < groups; k++)
            memcpy(dst + (int64_t)(g0 + k) * bits, &x[k], 8);
    }
}

/* As pack_trits, 80 digits (16 bytes) at a time: the five vectors of 16 digits rearranged by
   permutes into digit k of bytes 0..15, k = 0..4, then summed in base 3. */
static int32_t trit_pick[3][5][16]; /* for digit k: from vectors 0-1, 2-3, 4 */
static uint16_t trit_from23[5], trit_from4[5];

/* The 16 bytes of 80 digits (5 vectors of 16, in order). */
AVX512 static inline __m128i pack80(const __m512i v[5]) {
    __m512i sum = _mm512_setzero_si512();
    for (int k = 4; k >= 0; k--) {
        __m512i low = _mm512_permutex2var_epi32(v[0], _mm512_loadu_si512(trit_pick[0][k]), v[1]);
        __m512i mid = _mm512_permutex2var_epi32(v[2], _mm512_loadu_si512(trit_pick[1][k]), v[3]);
        __m512i digit = _mm512_mask_blend_epi32(trit_from23[k], low, mid);
        digit = _mm512_mask_permutexvar_epi32(digit, trit_from4[k],
                                              _mm512_loadu_si512(trit_pick[2][k]), v[4]);
        sum = _mm512_add_epi32(_mm512_add_epi32(sum, _mm512_slli_epi32(sum, 1)), digit);
    }
    return _mm512_cvtepi32_epi8(sum);
}

AVX512 static void pack_trits_avx512(const uint8_t *digits, int m, uint8_t *dst) {
    int tiles = m / 80;
    for (int t = 0; t < tiles; t++) {
        __m512i v[5];
        for (int q = 0; q < 5; q++)
            v[q] = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(digits + 80 * t + 16 * q)));
        _mm_storeu_si128((__m128i *)(dst + 16 * t), pack80(v));
    }
    pack_trits(digits + 80 * tiles, m - 80 * tiles, dst + 16 * tiles);
}

AVX512 static inline void store16(float *p, __m512 v, int stream) {
    if (stream)
        _mm512_stream_ps(p, v);
    else
        _mm512_storeu_ps(p, v);
}

/* Values before out's next 64-byte boundary (all m without streaming: unaligned stores). */
static inline int head_of(const float *out, int m, int stream) {
    if (!stream)
        return 0;
    int head = (int)(((64 - ((uintptr_t)out & 63)) & 63) / 4);
    return head < m ? head : m;
}

AVX512 static float max_abs_avx512(const float *x, int64_t n) {
    __m512i m[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                    _mm512_setzero_si512()};
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    int64_t j = 0;
    for (; j + 64 <= n; j += 64) {
        _mm_prefetch((const char *)(x + j + PREFETCH), _MM_HINT_T0);
        for (int k = 0; k < 4; k++)
            m[k] = _mm512_max_epu32(
                m[k], _mm512_and_si512(_mm512_loadu_si512(x + j + 16 * k), magnitude));
    }
    uint32_t top = _mm512_reduce_max_epu32(
        _mm512_max_epu32(_mm512_max_epu32(m[0], m[1]), _mm512_max_epu32(m[2], m[3])));
    float rest = max_abs_body(x + j, n - j), s;
    uint32_t bits;
    memcpy(&bits, &rest, 4);
    top = bits > top ? bits : top;
    memcpy(&s, &top, 4);
    return s;
}

AVX512 static double sum_squares_avx512(const float *x, int64_t n) {
    __m512d acc[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(),
                      _mm512_setzero_pd()};
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        _mm_prefetch((const char *)(x + j + PREFETCH), _MM_HINT_T0);
        for (int k = 0; k < 4; k++) {
            __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + j + 8 * k));
            acc[k] = _mm512_add_pd(acc[k], _mm512_mul_pd(v, v));
        }
    }
    __m512d total = _mm512_add_pd(_mm512_add_pd(acc[0], acc[1]), _mm512_add_pd(acc[2], acc[3]));
    return _mm512_reduce_add_pd(total) + sum_squares_body(x + j, n - j);
}

AVX512 static inline __m512i order_key_avx512(__m512i b) {
    return _mm512_xor_si512(b, _mm512_and_si512(_mm512_srai_epi32(b, 31),
                                                _mm512_set1_epi32(0x7fffffff)));
}

AVX512 static void min_max_avx512(const float *x, int64_t n, float *lo, float *hi) {
    __m512i mn[2] = {_mm512_set1_epi32(INT32_MAX), _mm512_set1_epi32(INT32_MAX)};
    __m512i mx[2] = {_mm512_set1_epi32(INT32_MIN), _mm512_set1_epi32(INT32_MIN)};
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        _mm_prefetch((const char *)(x + j + PREFETCH), _MM_HINT_T0);
        for (int k = 0; k < 2; k++) {
            __m512i key = order_key_avx512(_mm512_loadu_si512(x + j + 16 * k));
            mn[k] = _mm512_min_epi32(mn[k], key);
            mx[k] = _mm512_max_epi32(mx[k], key);
        }
    }
    int32_t low = _mm512_reduce_min_epi32(_mm512_min_epi32(mn[0], mn[1]));
    int32_t high = _mm512_reduce_max_epi32(_mm512_max_epi32(mx[0], mx[1]));
    float rest_lo, rest_hi;
    min_max_body(x + j, n - j, &rest_lo, &rest_hi);
    int32_t bits;
    memcpy(&bits, &rest_lo, 4);
    low = order_key(bits) < low ? order_key(bits) : low;
    memcpy(&bits, &rest_hi, 4);
    high = order_key(bits) > high ? order_key(bits) : high;
    low = order_key(low), high = order_key(high);
    memcpy(lo, &low, 4);
    memcpy(hi, &high, 4);
}

/* A run from value i0: its first values up to a multiple of 16 take the rest of the step
   drawn last (the previous run ended inside it), its whole vectors draw a step each in
   registers, its last values a step drawn into `pending` for the next run. Vectors start at
   multiples of 16, so out + i0 + j is 64-byte aligned (for streaming) when out is. */
#define FUSED_RUN(BODY, VECTOR, ...)                                                           \
    int j = (int)((16 - i0 % 16) % 16);                                                        \
    j = j < m ? j : m;                                                                         \
    BODY(x, lanes->pending + i0 % 16, j, __VA_ARGS__, codes, out);                             \
    lanes512_t r = load_lanes(lanes);                                                          \
    for (; j + 16 <= m; j += 16) {                                                             \
        __m512 u = step_lanes(&r);                                                             \
        VECTOR                                                                                 \
    }                                                                                          \
    if (j < m) {                                                                               \
        _mm512_storeu_ps(lanes->pending, step_lanes(&r));                                      \
        BODY(x + j, lanes->pending, m - j, __VA_ARGS__, codes + j, out + j);                   \
    }                                                                                          \
    store_lanes(lanes, &r);

/* 16 values of ternary_body: the digits (0..2, as int32), the estimate stored. */
AVX512 static inline __m512i ternary16(const float *x, __m512 u, __m512 vs, __m512 vinv,
                                       float *out, int stream) {
    _mm_prefetch((const char *)(x + PREFETCH), _MM_HINT_T0);
    __m512 v = _mm512_loadu_ps(x);
    __mmask16 keep = _mm512_cmp_ps_mask(u, _mm512_mul_ps(_mm512_abs_ps(v), vinv), _CMP_LT_OQ);
    __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 t = _mm512_mask_blend_ps(neg, _mm512_set1_ps(1.0f), _mm512_set1_ps(-1.0f));
    store16(out, _mm512_mul_ps(_mm512_maskz_mov_ps(keep, t), vs), stream);
    return _mm512_mask_blend_epi32(keep, _mm512_set1_epi32(1),
                                   _mm512_maskz_mov_epi32(~neg, _mm512_set1_epi32(2)));
}

AVX512 static void ternary_avx512(const float *x, const float *u_, xoshiro_t *lanes, int64_t i0,
                                  int m, float s, float inv24, uint8_t *codes, float *out,
                                  int stream) {
    const __m512 vs = _mm512_set1_ps(s), vinv = _mm512_set1_ps(inv24);
    (void)u_;
    FUSED_RUN(ternary_body, {
        __m512i digit = ternary16(x + j, u, vs, vinv, out + j, stream);
        _mm_storeu_si128((__m128i *)(codes + j), _mm512_cvtepi32_epi8(digit));
    }, s, inv24)
}

/* A whole chunk in one block (value 0 of it a multiple of CHUNK): 80 values at a time, their
   16 bytes packed in registers (the separate packing pass costs as much as the max pass). */
AVX512 static void ternary_chunk_avx512(const float *x, xoshiro_t *lanes, float s, float inv24,
                                        uint8_t *packed, float *out, int stream) {
    const __m512 vs = _mm512_set1_ps(s), vinv = _mm512_set1_ps(inv24);
    lanes512_t r = load_lanes(lanes);
    for (int t = 0; t < CHUNK / 80; t++) {
        __m512i digits[5];
        for (int q = 0; q < 5; q++) {
            int j = 80 * t + 16 * q;
            digits[q] = ternary16(x + j, step_lanes(&r), vs, vinv, out + j, stream);
        }
        _mm_storeu_si128((__m128i *)(packed + 16 * t), pack80(digits));
    }
    store_lanes(lanes, &r);
}

AVX512 static void qsgd_avx512(const float *x, const float *u_, xoshiro_t *lanes, int64_t i0,
                               int m, float scale, float unit, float levels, uint8_t *codes,
                               float *out, int stream) {
    const __m512 vscale = _mm512_set1_ps(scale), vunit = _mm512_set1_ps(unit);
    const __m512 vlevels = _mm512_set1_ps(levels), zero = _mm512_setzero_ps();
    (void)u_;
    FUSED_RUN(qsgd_body, {
        _mm_prefetch((const char *)(x + j + PREFETCH), _MM_HINT_T0);
        __m512 v = _mm512_loadu_ps(x + j);
        __m512 r = _mm512_mul_ps(_mm512_abs_ps(v), vscale);
        __m512 low = _mm512_roundscale_ps(r, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        __m512 frac = _mm512_mul_ps(_mm512_sub_ps(r, low), _mm512_set1_ps(TWO24));
        __mmask16 up = _mm512_cmp_ps_mask(u, frac, _CMP_LT_OQ);
        __m512 level = _mm512_add_ps(low, _mm512_maskz_mov_ps(up, _mm512_set1_ps(1.0f)));
        level = _mm512_min_ps(_mm512_max_ps(level, zero), vlevels); /* NaN: 0, as the body */
        __mmask16 neg = _mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ);
        __m512 code = _mm512_mask_blend_ps(neg, _mm512_add_ps(vlevels, level),
                                           _mm512_sub_ps(vlevels, level));
        _mm_storeu_si128((__m128i *)(codes + j),
                         _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(code)));
        store16(out + j, _mm512_mul_ps(_mm512_sub_ps(code, vlevels), vunit), stream);
    }, scale, unit, levels)
}

AVX512 static void uniform_avx512(const float *x, int m, float lo, float step, float inverse,
                                  float top, uint8_t *codes, float *out, int stream) {
    const __m512 vlo = _mm512_set1_ps(lo), vstep = _mm512_set1_ps(step);
    const __m512 vinv = _mm512_set1_ps(inverse), vtop = _mm512_set1_ps(top);
    int j = head_of(out, m, stream);
    uniform_body(x, j, lo, step, inverse, top, codes, out);
    for (; j + 16 <= m; j += 16) {
        _mm_prefetch((const char *)(x + j + PREFETCH), _MM_HINT_T0);
        __m512 q = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + j), vlo), vinv);
        __m512 code = _mm512_roundscale_ps(_mm512_add_ps(q, _mm512_set1_ps(0.5f)),
                                           _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        code = _mm512_min_ps(_mm512_max_ps(code, _mm512_setzero_ps()), vtop);
        _mm_storeu_si128((__m128i *)(codes + j),
                         _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(code)));
        store16(out + j, _mm512_add_ps(_mm512_mul_ps(code, vstep), vlo), stream);
    }
    uniform_body(x + j, m - j, lo, step, inverse, top, codes + j, out + j);
}

/* Decode straight from the packed bytes, 16 values per step from value p on, p a multiple
   of 16 (so out + p is 64-byte aligned when out is). Per phase p % 5 of the first value: each
   lane's byte (of 4 read at p / 5) and the multiplier that divides it by 3^digit. */
static int32_t trit_shift[5][16], trit_magic[5][16];
/* Per bits: each lane's byte (of a 16-bit window) and shift within it. */
static int32_t code_byte[9][16], code_shift[9][16];

static void fill_decode_tables(void) {
    static const int32_t power[5] = {1, 3, 9, 27, 81};
    for (int phase = 0; phase < 5; phase++)
        for (int l = 0; l < 16; l++) {
            trit_shift[phase][l] = 8 * ((phase + l) / 5);
            trit_magic[phase][l] = (65536 + power[(phase + l) % 5] - 1) / power[(phase + l) % 5];
        }
    for (int bits = 1; bits <= 8; bits++)
        for (int l = 0; l < 16; l++)
            code_byte[bits][l] = l * bits / 8, code_shift[bits][l] = l * bits % 8;
    for (int k = 0; k < 5; k++)
        for (int g = 0; g < 16; g++) {
            int e = 5 * g + k; /* digit k of byte g: value e of the 80 */
            trit_pick[0][k][g] = e < 32 ? e : 0;
            trit_pick[1][k][g] = e >= 32 && e < 64 ? e - 32 : 0;
            trit_pick[2][k][g] = e >= 64 ? e - 64 : 0;
            trit_from23[k] |= (uint16_t)((e >= 32 && e < 64) << g);
            trit_from4[k] |= (uint16_t)((e >= 64) << g);
        }
}

/* Value i's trit (a byte >= 243 gives 0) and code, read byte by byte (never past nbytes). */
static inline float trit_at(const uint8_t *packed, int64_t i) {
    return trit_table[packed[i / 5]][i % 5];
}

static inline int code_at(const uint8_t *packed, int64_t nbytes, int bits, int64_t i) {
    int64_t bit = i * bits, k = bit >> 3;
    unsigned w = packed[k] | (k + 1 < nbytes ? (unsigned)packed[k + 1] << 8 : 0u);
    return (int)((w >> (bit & 7)) & ((1u << bits) - 1));
}

/* Values [i, end) of one block: the first scalar up to a multiple of 16, then 16 at a time
   while the bytes read stay inside the payload, the rest scalar. */
AVX512 static void trits_run_avx512(const uint8_t *packed, int64_t nbytes, int64_t i,
                                    int64_t end, float s, float *out, int stream) {
    const __m512 vs = _mm512_set1_ps(s);
    for (; i < end && i % 16; i++)
        out[i] = trit_at(packed, i) * s;
    for (; i + 16 <= end && i / 5 + 4 <= nbytes; i += 16) {
        int phase = (int)(i % 5);
        uint32_t word;
        memcpy(&word, packed + i / 5, 4);
        __m512i b = _mm512_and_si512(
            _mm512_srlv_epi32(_mm512_set1_epi32((int)word),
                              _mm512_loadu_si512(trit_shift[phase])),
            _mm512_set1_epi32(0xff));
        __m512i q = _mm512_srli_epi32(
            _mm512_mullo_epi32(b, _mm512_loadu_si512(trit_magic[phase])), 16);
        __m512i third = _mm512_srli_epi32(_mm512_mullo_epi32(q, _mm512_set1_epi32(21846)), 16);
        __m512i digit = _mm512_sub_epi32(q, _mm512_mullo_epi32(third, _mm512_set1_epi32(3)));
        __m512 t = _mm512_cvtepi32_ps(_mm512_sub_epi32(digit, _mm512_set1_epi32(1)));
        store16(out + i, _mm512_mul_ps(t, vs), stream);
    }
    for (; i < end; i++)
        out[i] = trit_at(packed, i) * s;
}

/* As trits_run_avx512 for codes of `bits` bits: (code − a)·b (grid 0) or code·b + a (grid 1);
   returns the largest code. */
AVX512 static int codes_run_avx512(const uint8_t *packed, int64_t nbytes, int bits, int64_t i,
                                   int64_t end, float a, float b, int grid, float *out,
                                   int stream) {
    const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
    const __m512i index = _mm512_loadu_si512(code_byte[bits]);
    const __m512i shift = _mm512_loadu_si512(code_shift[bits]);
    const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
    __m512i top = _mm512_setzero_si512();
    int mx = 0;
    for (; i < end && i % 16; i++) {
        int code = code_at(packed, nbytes, bits, i);
        mx = code > mx ? code : mx;
        out[i] = grid ? (float)code * b + a : ((float)code - a) * b;
    }
    for (; i + 16 <= end && i / 8 * bits + 17 <= nbytes; i += 16) {
        const uint8_t *window = packed + i / 8 * bits;
        __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)window));
        __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(window + 1)));
        __m512i pairs = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 8));
        __m512i code = _mm512_and_si512(
            _mm512_srlv_epi32(_mm512_permutexvar_epi32(index, pairs), shift), mask);
        top = _mm512_max_epi32(top, code);
        __m512 c = _mm512_cvtepi32_ps(code);
        store16(out + i,
                grid ? _mm512_add_ps(_mm512_mul_ps(c, vb), va)
                     : _mm512_mul_ps(_mm512_sub_ps(c, va), vb),
                stream);
    }
    for (; i < end; i++) {
        int code = code_at(packed, nbytes, bits, i);
        mx = code > mx ? code : mx;
        out[i] = grid ? (float)code * b + a : ((float)code - a) * b;
    }
    int vmx = _mm512_reduce_max_epi32(top);
    return vmx > mx ? vmx : mx;
}

AVX512 static void ternary_decode_avx512(const uint8_t *packed, const float *scales, int64_t n,
                                         int64_t block, float *out) {
    int64_t size = block ? block : n, nbytes = (n + 4) / 5;
    int stream = stream_out(out, n);
    for (int64_t i = 0, b = 0; i < n; i += size, b++)
        trits_run_avx512(packed, nbytes, i, min64(i + size, n), scales[b], out, stream);
    _mm_sfence();
}

AVX512 static int qsgd_decode_avx512(const uint8_t *packed, const float *norms, int64_t n,
                                     int64_t block, int levels, float *out) {
    int64_t size = block ? block : n, bits = qsgd_bits(levels), nbytes = (n * bits + 7) / 8;
    int stream = stream_out(out, n), top = 0;
    for (int64_t i = 0, b = 0; i < n; i += size, b++) {
        int mx = codes_run_avx512(packed, nbytes, (int)bits, i, min64(i + size, n),
                                  (float)levels, norms[b] / (float)levels, 0, out, stream);
        top = mx > top ? mx : top;
    }
    _mm_sfence();
    return top;
}

AVX512 static void uniform_decode_avx512(const uint8_t *packed, const float *lo,
                                         const float *step, int64_t n, int64_t block, int bits,
                                         float *out) {
    int64_t size = block ? block : n, nbytes = (n * bits + 7) / 8;
    int stream = stream_out(out, n);
    for (int64_t i = 0, b = 0; i < n; i += size, b++)
        codes_run_avx512(packed, nbytes, bits, i, min64(i + size, n), lo[b], step[b], 1, out,
                         stream);
    _mm_sfence();
}

static const quantizers_t quantizers_avx512 = {
    max_abs_avx512, sum_squares_avx512, min_max_avx512, random_avx512, pack_avx512,
    pack_trits_avx512,
    ternary_avx512, ternary_chunk_avx512, qsgd_avx512, uniform_avx512,
    ternary_decode_avx512, qsgd_decode_avx512, uniform_decode_avx512, 1,
};
#endif

static const quantizers_t *quantizers = &quantizers_generic;

/* --- encode drivers: chunks, block runs, scales --- */

static inline void fence(void) {
#ifdef GOSSIPDL_X86
    _mm_sfence();
#endif
}

static void ternary_encode_all(const float *x, int64_t n, int64_t block, uint64_t seed,
                               uint8_t *packed, float *scales, float *out) {
    uint8_t digits[CHUNK + SLACK];
    float u[CHUNK];
    xoshiro_t lanes;
    int64_t size = block ? block : n, block_end = 0, b = -1;
    int stream = stream_out(out, n);
    float s = 0.0f, inv24 = 0.0f;
    seed_lanes(&lanes, seed);
    if (n == 0 && block == 0)
        scales[0] = 0.0f;
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        int64_t c1 = min64(c0 + CHUNK, n);
        if (!quantizers->fused)
            quantizers->random(&lanes, (int)(c1 - c0 + 15) / 16, u);
        int packed_already = 0;
        for (int64_t i = c0; i < c1;) {
            if (i == block_end) {
                int64_t length = min64(size, n - i);
                s = scales[++b] = quantizers->max_abs(x + i, length);
                inv24 = s > 0.0f ? TWO24 / s : 0.0f;
                block_end = i + length;
            }
            if (i == c0 && c1 - c0 == CHUNK && block_end >= c1 && quantizers->ternary_chunk) {
                quantizers->ternary_chunk(x + i, &lanes, s, inv24, packed + c0 / 5, out + i,
                                          stream);
                packed_already = 1;
                break;
            }
            int64_t end = min64(c1, block_end);
            quantizers->ternary(x + i, u + (i - c0), &lanes, i, (int)(end - i), s, inv24,
                                digits + (i - c0), out + i, stream);
            i = end;
        }
        if (packed_already)
            continue;
        int m = (int)(c1 - c0);
        memset(digits + m, 1, 8); /* the last byte's unused digits: t = 0 */
        quantizers->pack_trits(digits, m, packed + c0 / 5);
    }
    fence();
}

static void qsgd_encode_all(const float *x, int64_t n, int64_t block, int levels, uint64_t seed,
                            uint8_t *packed, float *norms, float *out) {
    uint8_t codes[CHUNK + SLACK], bytes[CHUNK + SLACK];
    float u[CHUNK];
    xoshiro_t lanes;
    const int bits = qsgd_bits(levels);
    const float s = (float)levels;
    int64_t size = block ? block : n, block_end = 0, b = -1;
    int stream = stream_out(out, n);
    float scale = 0.0f, unit = 0.0f;
    seed_lanes(&lanes, seed);
    if (n == 0 && block == 0)
        norms[0] = 0.0f;
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        int64_t c1 = min64(c0 + CHUNK, n);
        if (!quantizers->fused)
            quantizers->random(&lanes, (int)(c1 - c0 + 15) / 16, u);
        for (int64_t i = c0; i < c1;) {
            if (i == block_end) {
                int64_t length = min64(size, n - i);
                float norm = norms[++b] = (float)sqrt(quantizers->sum_squares(x + i, length));
                scale = norm > 0.0f ? s / norm : 0.0f;
                unit = norm / s;
                block_end = i + length;
            }
            int64_t end = min64(c1, block_end);
            quantizers->qsgd(x + i, u + (i - c0), &lanes, i, (int)(end - i), scale, unit, s,
                             codes + (i - c0), out + i, stream);
            i = end;
        }
        int m = (int)(c1 - c0);
        memset(codes + m, 0, 64);
        quantizers->pack(codes, m, bits, bytes);
        memcpy(packed + c0 / 8 * bits, bytes, (size_t)((int64_t)m * bits + 7) / 8);
    }
    fence();
}

static void uniform_encode_all(const float *x, int64_t n, int64_t block, int bits,
                               uint8_t *packed, float *los, float *steps, float *out) {
    uint8_t codes[CHUNK + SLACK], bytes[CHUNK + SLACK];
    const float top = (float)((1 << bits) - 1);
    int64_t size = block ? block : n, block_end = 0, b = -1;
    int stream = stream_out(out, n);
    float lo = 0.0f, step = 0.0f, inverse = 0.0f;
    if (n == 0 && block == 0)
        los[0] = steps[0] = 0.0f;
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        int64_t c1 = min64(c0 + CHUNK, n);
        for (int64_t i = c0; i < c1;) {
            if (i == block_end) {
                int64_t length = min64(size, n - i);
                float hi;
                quantizers->min_max(x + i, length, &lo, &hi);
                step = (hi - lo) / top;
                inverse = step > 0.0f ? 1.0f / step : 0.0f;
                los[++b] = lo, steps[b] = step;
                block_end = i + length;
            }
            int64_t end = min64(c1, block_end);
            quantizers->uniform(x + i, (int)(end - i), lo, step, inverse, top, codes + (i - c0),
                                out + i, stream);
            i = end;
        }
        int m = (int)(c1 - c0);
        memset(codes + m, 0, 64);
        quantizers->pack(codes, m, bits, bytes);
        memcpy(packed + c0 / 8 * bits, bytes, (size_t)((int64_t)m * bits + 7) / 8);
    }
    fence();
}

/* --- sparse vectors: top-k's candidates, and a dense vector from sorted (index, value) pairs
 *
 * at_least reads x once and records every |x_i| >= tau: the vector kernels compare 16 (8)
 * magnitudes at a time and visit only the lanes that pass (about 1 in 100 for a top-1%
 * candidate threshold). densify writes a dense vector once: each 64-byte (32-byte) piece is
 * built in a register, zeros with the values that fall in it, and stored once (past the
 * cache when the output is large), instead of zeroing the whole vector and writing the
 * values over it. A position that is not above the one before it, or not below n, makes
 * densify return -1 (the caller raises; nothing is written outside out). */

typedef int64_t (*at_least_t)(const float *x, int64_t n, float tau, int64_t *idx, float *val,
                              int64_t cap);
typedef int (*densify_t)(const int64_t *idx, const float *val, int64_t k, float *out, int64_t n,
                         int stream);

/* Records of the positions in `hits` (bits of x[base..base+32)), at most cap written. */
static inline int64_t take_hits(uint32_t hits, int64_t base, const float *x, int64_t *idx,
                                float *val, int64_t cap, int64_t count) {
    for (; hits; hits &= hits - 1, count++)
        if (count < cap) {
            int64_t p = base + __builtin_ctz(hits);
            idx[count] = p;
            val[count] = x[p];
        }
    return count;
}

static int64_t at_least_from(const float *x, int64_t from, int64_t n, float tau, int64_t *idx,
                             float *val, int64_t cap, int64_t count) {
    for (int64_t i = from; i < n; i++)
        count = take_hits(fabsf(x[i]) >= tau, i, x, idx, val, cap, count);
    return count;
}

static int64_t at_least_generic(const float *x, int64_t n, float tau, int64_t *idx, float *val,
                                int64_t cap) {
    return at_least_from(x, 0, n, tau, idx, val, cap, 0);
}

/* Zeros in out[from..n), then each remaining pair in place (checked). */
static int densify_from(const int64_t *idx, const float *val, int64_t k, float *out,
                        int64_t from, int64_t n, int64_t prev) {
    memset(out + from, 0, (size_t)(n - from) * 4);
    for (int64_t j = 0; j < k; prev = idx[j], j++) {
        if (idx[j] <= prev || idx[j] >= n)
            return -1;
        out[idx[j]] = val[j];
    }
    return 0;
}

static int densify_generic(const int64_t *idx, const float *val, int64_t k, float *out, int64_t n,
                           int stream) {
    (void)stream;
    return densify_from(idx, val, k, out, 0, n, -1);
}

#ifdef GOSSIPDL_X86
__attribute__((target("avx512f"))) static int64_t at_least_avx512(const float *x, int64_t n,
                                                                  float tau, int64_t *idx,
                                                                  float *val, int64_t cap) {
    const __m512 t = _mm512_set1_ps(tau);
    int64_t count = 0, i = 0;
    for (; i + 32 <= n; i += 32) {
        _mm_prefetch((const char *)(x + i + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(x + i + 16 + PREFETCH), _MM_HINT_T0);
        uint32_t lo = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + i)), t, _CMP_GE_OQ);
        uint32_t hi = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + i + 16)), t,
                                         _CMP_GE_OQ);
        count = take_hits(lo | hi << 16, i, x, idx, val, cap, count);
    }
    return at_least_from(x, i, n, tau, idx, val, cap, count);
}

__attribute__((target("avx2"))) static int64_t at_least_avx2(const float *x, int64_t n, float tau,
                                                             int64_t *idx, float *val,
                                                             int64_t cap) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 t = _mm256_set1_ps(tau);
    int64_t count = 0, i = 0;
    for (; i + 32 <= n; i += 32) {
        _mm_prefetch((const char *)(x + i + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(x + i + 16 + PREFETCH), _MM_HINT_T0);
        uint32_t hits = 0;
        for (int q = 0; q < 4; q++) {
            __m256 v = _mm256_and_ps(_mm256_loadu_ps(x + i + 8 * q), magnitude);
            hits |= (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v, t, _CMP_GE_OQ)) << (8 * q);
        }
        count = take_hits(hits, i, x, idx, val, cap, count);
    }
    return at_least_from(x, i, n, tau, idx, val, cap, count);
}

__attribute__((target("avx512f"))) static int densify_avx512(const int64_t *idx, const float *val,
                                                             int64_t k, float *out, int64_t n,
                                                             int stream) {
    int64_t j = 0, prev = -1, base = 0;
    for (; base + 16 <= n; base += 16) {
        __m512 v = _mm512_setzero_ps();
        for (; j < k && idx[j] < base + 16; prev = idx[j], j++) {
            if (idx[j] <= prev) /* the ones before are below base: this one is in [base, +16) */
                return -1;
            v = _mm512_mask_mov_ps(v, (__mmask16)(1u << (idx[j] - base)), _mm512_set1_ps(val[j]));
        }
        if (stream)
            _mm512_stream_ps(out + base, v);
        else
            _mm512_storeu_ps(out + base, v);
    }
    if (stream)
        _mm_sfence();
    return densify_from(idx + j, val + j, k - j, out, base, n, prev);
}

__attribute__((target("avx2"))) static int densify_avx2(const int64_t *idx, const float *val,
                                                        int64_t k, float *out, int64_t n,
                                                        int stream) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t j = 0, prev = -1, base = 0;
    for (; base + 8 <= n; base += 8) {
        __m256 v = _mm256_setzero_ps();
        for (; j < k && idx[j] < base + 8; prev = idx[j], j++) {
            if (idx[j] <= prev)
                return -1;
            __m256i at = _mm256_cmpeq_epi32(lanes, _mm256_set1_epi32((int)(idx[j] - base)));
            v = _mm256_blendv_ps(v, _mm256_set1_ps(val[j]), _mm256_castsi256_ps(at));
        }
        if (stream)
            _mm256_stream_ps(out + base, v);
        else
            _mm256_storeu_ps(out + base, v);
    }
    if (stream)
        _mm_sfence();
    return densify_from(idx + j, val + j, k - j, out, base, n, prev);
}
#endif

/* --- PowerSGD's low-rank product: out = P̂ Qᵀ, a row at a time
 *
 * Value (r, c) is p[r][0]·qt[0][c] + p[r][1]·qt[1][c] + …, added in that order with every
 * product and sum rounded on its own: the bits of reconstruct's numpy and torch passes. Each
 * value is built in a register and stored once, where numpy built a block of rows in cache
 * in two passes per rank and the output crossed memory as the cache let it go. Qᵀ (rank rows
 * of cols floats: 25 KB for 10M values at rank 2) stays in cache; a row of P̂ is rank
 * broadcasts. out is the first n values of the row-major product, n <= rows·cols (a cropped
 * last row stops at n). AVX-512 streams the 64-byte pieces inside a row past the cache when
 * the output is large and writes a row's ends (pieces it shares with its neighbours) with
 * masked stores; the others run one portable body and write through the cache. */

typedef void (*low_rank_row_t)(const float *p, const float *qt, int64_t rank, int64_t cols,
                               int64_t m, float *out, int stream);

#define LOW_RANK_VECS 2 /* vectors of 4 values summed side by side: two share each broadcast */

/* Values [0, m) of one row from its rank values p: LOW_RANK_VECS GCC vectors of 4 at a time,
   the rest one by one. 4 lanes, the width every target has: 8-lane vectors went through the
   stack without AVX (the generic kernel was then no faster than numpy). */
INLINE void low_rank_row_body(const float *p, const float *qt, int64_t rank, int64_t cols,
                              int64_t m, float *out) {
    int64_t c = 0;
    for (; c + 4 * LOW_RANK_VECS <= m; c += 4 * LOW_RANK_VECS) {
        f32x4 acc[LOW_RANK_VECS], q;
        for (int k = 0; k < LOW_RANK_VECS; k++) {
            memcpy(&q, qt + c + 4 * k, 16);
            acc[k] = p[0] * q;
        }
        for (int64_t j = 1; j < rank; j++) {
            const float pj = p[j];
            for (int k = 0; k < LOW_RANK_VECS; k++) {
                memcpy(&q, qt + j * cols + c + 4 * k, 16);
                acc[k] = acc[k] + pj * q;
            }
        }
        for (int k = 0; k < LOW_RANK_VECS; k++)
            memcpy(out + c + 4 * k, &acc[k], 16);
    }
    for (; c < m; c++) {
        float acc = p[0] * qt[c];
        for (int64_t j = 1; j < rank; j++)
            acc = acc + p[j] * qt[j * cols + c];
        out[c] = acc;
    }
}

static void low_rank_row_generic(const float *p, const float *qt, int64_t rank, int64_t cols,
                                 int64_t m, float *out, int stream) {
    (void)stream;
    low_rank_row_body(p, qt, rank, cols, m, out);
}

#ifdef GOSSIPDL_X86
__attribute__((target("avx2"))) static void low_rank_row_avx2(const float *p, const float *qt,
                                                              int64_t rank, int64_t cols,
                                                              int64_t m, float *out, int stream) {
    (void)stream;
    low_rank_row_body(p, qt, rank, cols, m, out);
}

/* The 16 values from column c in `lanes` (Qᵀ is not read in the others). */
AVX512 static inline __m512 low_rank16(const float *p, const float *qt, int64_t rank,
                                       int64_t cols, int64_t c, __mmask16 lanes) {
    __m512 acc = _mm512_mul_ps(_mm512_set1_ps(p[0]), _mm512_maskz_loadu_ps(lanes, qt + c));
    for (int64_t j = 1; j < rank; j++)
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(p[j]),
                                               _mm512_maskz_loadu_ps(lanes, qt + j * cols + c)));
    return acc;
}

/* Masked stores up to out's next 64-byte boundary (streaming only) and after the last whole
   vector; whole vectors between, streamed or not. */
AVX512 static void low_rank_row_avx512(const float *p, const float *qt, int64_t rank,
                                       int64_t cols, int64_t m, float *out, int stream) {
    int64_t c = head_of(out, (int)min64(m, 16), stream);
    __mmask16 head = (__mmask16)((1u << c) - 1);
    if (head)
        _mm512_mask_storeu_ps(out, head, low_rank16(p, qt, rank, cols, 0, head));
    for (; c + 16 <= m; c += 16)
        store16(out + c, low_rank16(p, qt, rank, cols, c, 0xffff), stream);
    __mmask16 rest = (__mmask16)((1u << (m - c)) - 1);
    if (rest)
        _mm512_mask_storeu_ps(out + c, rest, low_rank16(p, qt, rank, cols, c, rest));
}
#endif

static low_rank_row_t low_rank_row_kernel = low_rank_row_generic;

/* out[0, n) = the first n values of P̂ Qᵀ (p rows of rank, qt rank rows of cols; rank 0:
   zeros); the caller has checked that n <= rows·cols. */
static void low_rank_product_all(const float *p, const float *qt, int64_t rank, int64_t cols,
                                 int64_t n, float *out) {
    if (rank == 0) {
        memset(out, 0, (size_t)n * 4);
        return;
    }
    int stream = stream_out(out, n);
    for (int64_t start = 0, r = 0; start < n; start += cols, r++)
        low_rank_row_kernel(p + r * rank, qt, rank, cols, min64(cols, n - start), out + start,
                            stream);
    fence();
}

/* --- CHOCO's step: out = x + g·(s − h), in one pass ---
 *
 * torch takes three passes (s − h into out, times g, plus x); this reads the three vectors
 * once and writes out once, past the cache when it is large. Each operation is rounded on
 * its own, in torch's order, so the bits are torch's. */

typedef void (*step_t)(const float *x, const float *s, const float *h, float g, float *out,
                       int64_t from, int64_t n, int stream);

static void step_generic(const float *x, const float *s, const float *h, float g, float *out,
                         int64_t from, int64_t n, int stream) {
    (void)stream;
    for (int64_t i = from; i < n; i++) {
        float d = (s[i] - h[i]) * g;
        out[i] = x[i] + d;
    }
}

#ifdef GOSSIPDL_X86
__attribute__((target("avx512f"))) static void step_avx512(const float *x, const float *s,
                                                           const float *h, float g, float *out,
                                                           int64_t from, int64_t n, int stream) {
    const __m512 gv = _mm512_set1_ps(g);
    int64_t i = from;
    for (; i + 16 <= n; i += 16) {
        __m512 d = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_loadu_ps(h + i)), gv);
        __m512 v = _mm512_add_ps(_mm512_loadu_ps(x + i), d);
        if (stream)
            _mm512_stream_ps(out + i, v);
        else
            _mm512_storeu_ps(out + i, v);
    }
    if (stream)
        _mm_sfence();
    step_generic(x, s, h, g, out, i, n, 0);
}

__attribute__((target("avx2"))) static void step_avx2(const float *x, const float *s,
                                                      const float *h, float g, float *out,
                                                      int64_t from, int64_t n, int stream) {
    const __m256 gv = _mm256_set1_ps(g);
    int64_t i = from;
    for (; i + 8 <= n; i += 8) {
        __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_loadu_ps(h + i)), gv);
        __m256 v = _mm256_add_ps(_mm256_loadu_ps(x + i), d);
        if (stream)
            _mm256_stream_ps(out + i, v);
        else
            _mm256_storeu_ps(out + i, v);
    }
    if (stream)
        _mm_sfence();
    step_generic(x, s, h, g, out, i, n, 0);
}
#endif

static encode_t encode_kernel = encode_generic;
static expand_t expand_kernel = expand_generic;
static at_least_t at_least_kernel = at_least_generic;
static densify_t densify_kernel = densify_generic;
static step_t step_kernel = step_generic;
static const char *isa = "generic";

/* Use the kernels for `name` ("avx512f", "avx2" or "generic"), or the best the CPU has (NULL).
   Returns 0, or -1 when the CPU lacks that instruction set or the name is unknown. */
static int pick_kernels(const char *name) {
    int any = name == NULL;
#ifdef GOSSIPDL_X86
    __builtin_cpu_init();
    if ((any || !strcmp(name, "avx512f")) && __builtin_cpu_supports("avx512f")) {
        encode_kernel = encode_avx512, expand_kernel = expand_avx512, isa = "avx512f";
        at_least_kernel = at_least_avx512, densify_kernel = densify_avx512;
        step_kernel = step_avx512;
        quantizers = &quantizers_avx512, low_rank_row_kernel = low_rank_row_avx512;
        return 0;
    }
    if ((any || !strcmp(name, "avx2")) && __builtin_cpu_supports("avx2")) {
        encode_kernel = encode_avx2, expand_kernel = expand_avx2, isa = "avx2";
        at_least_kernel = at_least_avx2, densify_kernel = densify_avx2;
        step_kernel = step_avx2;
        quantizers = &quantizers_avx2, low_rank_row_kernel = low_rank_row_avx2;
        return 0;
    }
#endif
    if (any || !strcmp(name, "generic")) {
        encode_kernel = encode_generic, expand_kernel = expand_generic, isa = "generic";
        at_least_kernel = at_least_generic, densify_kernel = densify_generic;
        step_kernel = step_generic;
        quantizers = &quantizers_generic, low_rank_row_kernel = low_rank_row_generic;
        return 0;
    }
    return -1;
}

/* --- Python entry points --- */

/* Blocks of `block` values (0: all n in one), each through the kernel on its own. */
static double encode_blocks(const float *x, uint8_t *bits, int64_t n, int64_t block,
                            double *sums) {
    int64_t size = block ? block : n;
    double total = 0.0;
    if (size == 0) { /* an empty tensor is one block of nothing */
        if (sums != NULL)
            sums[0] = 0.0;
        return 0.0;
    }
    for (int64_t start = 0, b = 0; start < n; start += size, b++) {
        double l1 = encode_kernel(x + start, bits + start / 8, n - start < size ? n - start : size);
        if (sums != NULL)
            sums[b] = l1;
        total += l1;
    }
    return total;
}

static void expand_blocks(const uint8_t *bits, const float *scales, float *out, int64_t n,
                          int64_t block, int stream) {
    int64_t size = block ? block : n;
    for (int64_t start = 0, b = 0; start < n; start += size, b++)
        expand_kernel(bits + start / 8, scales[b], out + start, n - start < size ? n - start : size,
                      stream);
}

/* Blocks in a buffer of n values: 1 for block 0 (the whole tensor), else ceil(n / block);
   -1 (ValueError set) for a block that is negative or not a multiple of 8. */
static Py_ssize_t count_blocks(Py_ssize_t n, Py_ssize_t block, const char *what) {
    if (block < 0 || block % 8 != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: block %zd must be 0 (whole tensor) or a positive multiple of 8", what,
                     block);
        return -1;
    }
    return block == 0 ? 1 : (n + block - 1) / block;
}

static int check_entries(Py_ssize_t bytes, Py_ssize_t item, Py_ssize_t want, const char *what,
                         const char *name) {
    if (bytes != want * item) {
        PyErr_Format(PyExc_ValueError, "%s: %zd blocks need %zd bytes of %s, got %zd", what, want,
                     want * item, name, bytes);
        return -1;
    }
    return 0;
}

static int check_sizes(Py_ssize_t value_bytes, Py_ssize_t bit_bytes, const char *what) {
    if (value_bytes % 4 != 0) {
        PyErr_Format(PyExc_ValueError, "%s: a float32 buffer of %zd bytes is not whole values",
                     what, value_bytes);
        return -1;
    }
    Py_ssize_t n = value_bytes / 4;
    if (bit_bytes != (n + 7) / 8) {
        PyErr_Format(PyExc_ValueError, "%s: %zd values need %zd bytes of sign bits, got %zd", what,
                     n, (n + 7) / 8, bit_bytes);
        return -1;
    }
    return 0;
}

static PyObject *sign_encode(PyObject *self, PyObject *args) {
    Py_buffer x, bits, sums = {0};
    Py_ssize_t block = 0;
    double l1 = 0.0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*|nw*:sign_encode", &x, &bits, &block, &sums))
        return NULL;
    int ok = check_sizes(x.len, bits.len, "sign_encode") == 0;
    Py_ssize_t blocks = ok ? count_blocks(x.len / 4, block, "sign_encode") : -1;
    ok = blocks >= 0 &&
         (sums.buf == NULL || check_entries(sums.len, 8, blocks, "sign_encode", "sums") == 0);
    if (ok) {
        Py_BEGIN_ALLOW_THREADS l1 = encode_blocks(x.buf, bits.buf, x.len / 4, block, sums.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&bits);
    if (sums.buf != NULL)
        PyBuffer_Release(&sums);
    return ok ? PyFloat_FromDouble(l1) : NULL;
}

static PyObject *sign_expand(PyObject *self, PyObject *args) {
    Py_buffer bits, scales, out;
    Py_ssize_t block = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*|n:sign_expand", &bits, &scales, &out, &block))
        return NULL;
    int ok = check_sizes(out.len, bits.len, "sign_expand") == 0;
    Py_ssize_t blocks = ok ? count_blocks(out.len / 4, block, "sign_expand") : -1;
    ok = blocks >= 0 && check_entries(scales.len, 4, blocks, "sign_expand", "scales") == 0;
    if (ok) {
        /* every block starts on a 64-byte boundary too when the block is a multiple of 16 */
        int stream = out.len >= STREAM_BYTES && (uintptr_t)out.buf % 64 == 0 && block % 16 == 0;
        Py_BEGIN_ALLOW_THREADS expand_blocks(bits.buf, scales.buf, out.buf, out.len / 4, block,
                                             stream);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&bits);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&out);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* --- Python entry points of the quantizers --- */

#define MAX_BUFFERS 5

typedef struct {
    Py_buffer b[MAX_BUFFERS];
    int count;
} buffers_t;

static void release(buffers_t *held) {
    for (int i = 0; i < held->count; i++)
        PyBuffer_Release(&held->b[i]);
}

/* The float32 values in a buffer, or -1 (ValueError set) when its bytes are not whole values. */
static Py_ssize_t values_in(const Py_buffer *b, const char *what) {
    if (b->len % 4 != 0) {
        PyErr_Format(PyExc_ValueError, "%s: a float32 buffer of %zd bytes is not whole values",
                     what, b->len);
        return -1;
    }
    return b->len / 4;
}

/* Blocks for n values: 1 for block 0 (the whole tensor, even empty), else ceil(n / block). */
static Py_ssize_t any_blocks(Py_ssize_t n, Py_ssize_t block, const char *what) {
    if (block < 0) {
        PyErr_Format(PyExc_ValueError, "%s: block %zd must be 0 (whole tensor) or positive",
                     what, block);
        return -1;
    }
    return block == 0 ? 1 : (n + block - 1) / block;
}

static int want_bytes(const Py_buffer *b, Py_ssize_t want, Py_ssize_t n, const char *what,
                      const char *name) {
    if (b->len != want) {
        PyErr_Format(PyExc_ValueError, "%s: %zd values need %zd bytes of %s, got %zd", what, n,
                     want, name, b->len);
        return -1;
    }
    return 0;
}

/* Checks shared by every quantizer: values (x or out) of n float32, packed bytes for
   `bits_per_value` bits each (0: base 3, 5 per byte), `per_block` arrays of one float32 per
   block. */
static int check_quantizer(const char *what, const Py_buffer *values, const Py_buffer *packed,
                           int bits_per_value, const Py_buffer *const *per_block, int arrays,
                           Py_ssize_t block, Py_ssize_t *n) {
    *n = values_in(values, what);
    if (*n < 0)
        return -1;
    Py_ssize_t bytes = bits_per_value ? (Py_ssize_t)(((int64_t)*n * bits_per_value + 7) / 8)
                                      : (*n + 4) / 5;
    if (want_bytes(packed, bytes, *n, what, "packed codes") < 0)
        return -1;
    Py_ssize_t blocks = any_blocks(*n, block, what);
    if (blocks < 0)
        return -1;
    for (int i = 0; i < arrays; i++)
        if (check_entries(per_block[i]->len, 4, blocks, what, "scales") < 0)
            return -1;
    return 0;
}

static int check_same_size(const Py_buffer *x, const Py_buffer *out, const char *what) {
    if (x->len != out->len) {
        PyErr_Format(PyExc_ValueError, "%s: out has %zd bytes, x %zd", what, out->len, x->len);
        return -1;
    }
    return 0;
}

static int check_levels(long levels, const char *what) {
    if (levels < 1 || levels > 127) {
        PyErr_Format(PyExc_ValueError, "%s: levels %ld must be 1..127", what, levels);
        return -1;
    }
    return 0;
}

static int check_bits(int bits, const char *what) {
    if (bits < 1 || bits > 8) {
        PyErr_Format(PyExc_ValueError, "%s: bits %d must be 1..8", what, bits);
        return -1;
    }
    return 0;
}

static PyObject *ternary_encode(PyObject *self, PyObject *args) {
    buffers_t held = {.count = 4};
    Py_buffer *x = &held.b[0], *packed = &held.b[1], *scales = &held.b[2], *out = &held.b[3];
    unsigned long long seed;
    Py_ssize_t block = 0, n;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*w*w*K|n:ternary_encode", x, packed, scales, out, &seed,
                          &block))
        return NULL;
    const Py_buffer *per_block[] = {scales};
    int ok = check_quantizer("ternary_encode", x, packed, 0, per_block, 1, block, &n) == 0 &&
             check_same_size(x, out, "ternary_encode") == 0;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS ternary_encode_all(x->buf, n, block, seed, packed->buf,
                                                  scales->buf, out->buf);
        Py_END_ALLOW_THREADS
    }
    release(&held);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *ternary_decode(PyObject *self, PyObject *args) {
    buffers_t held = {.count = 3};
    Py_buffer *packed = &held.b[0], *scales = &held.b[1], *out = &held.b[2];
    Py_ssize_t block = 0, n;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*|n:ternary_decode", packed, scales, out, &block))
        return NULL;
    const Py_buffer *per_block[] = {scales};
    int ok = check_quantizer("ternary_decode", out, packed, 0, per_block, 1, block, &n) == 0;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS quantizers->ternary_decode(packed->buf, scales->buf, n, block,
                                                          out->buf);
        Py_END_ALLOW_THREADS
    }
    release(&held);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *qsgd_encode(PyObject *self, PyObject *args) {
    buffers_t held = {.count = 4};
    Py_buffer *x = &held.b[0], *packed = &held.b[1], *norms = &held.b[2], *out = &held.b[3];
    unsigned long long seed;
    long levels;
    Py_ssize_t block = 0, n;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*w*w*lK|n:qsgd_encode", x, packed, norms, out, &levels,
                          &seed, &block))
        return NULL;
    const Py_buffer *per_block[] = {norms};
    int ok = check_levels(levels, "qsgd_encode") == 0 &&
             check_quantizer("qsgd_encode", x, packed, qsgd_bits(levels), per_block, 1, block,
                             &n) == 0 &&
             check_same_size(x, out, "qsgd_encode") == 0;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS qsgd_encode_all(x->buf, n, block, (int)levels, seed, packed->buf,
                                               norms->buf, out->buf);
        Py_END_ALLOW_THREADS
    }
    release(&held);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *qsgd_decode(PyObject *self, PyObject *args) {
    buffers_t held = {.count = 3};
    Py_buffer *packed = &held.b[0], *norms = &held.b[1], *out = &held.b[2];
    long levels;
    Py_ssize_t block = 0, n;
    int top = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*l|n:qsgd_decode", packed, norms, out, &levels, &block))
        return NULL;
    const Py_buffer *per_block[] = {norms};
    int ok = check_levels(levels, "qsgd_decode") == 0 &&
             check_quantizer("qsgd_decode", out, packed, qsgd_bits(levels), per_block, 1, block,
                             &n) == 0;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS top = quantizers->qsgd_decode(packed->buf, norms->buf, n,
                                                            block, (int)levels, out->buf);
        Py_END_ALLOW_THREADS
    }
    release(&held);
    return ok ? PyLong_FromLong(top) : NULL;
}

static PyObject *uniform_encode(PyObject *self, PyObject *args) {
    buffers_t held = {.count = 5};
    Py_buffer *x = &held.b[0], *packed = &held.b[1], *lo = &held.b[2], *step = &held.b[3],
              *out = &held.b[4];
    int bits;
    Py_ssize_t block = 0, n;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*w*w*w*i|n:uniform_encode", x, packed, lo, step, out, &bits,
                          &block))
        return NULL;
    const Py_buffer *per_block[] = {lo, step};
    int ok = check_bits(bits, "uniform_encode") == 0 &&
             check_quantizer("uniform_encode", x, packed, bits, per_block, 2, block, &n) == 0 &&
             check_same_size(x, out, "uniform_encode") == 0;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS uniform_encode_all(x->buf, n, block, bits, packed->buf, lo->buf,
                                                  step->buf, out->buf);
        Py_END_ALLOW_THREADS
    }
    release(&held);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *uniform_decode(PyObject *self, PyObject *args) {
    buffers_t held = {.count = 4};
    Py_buffer *packed = &held.b[0], *lo = &held.b[1], *step = &held.b[2], *out = &held.b[3];
    int bits;
    Py_ssize_t block = 0, n;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*w*i|n:uniform_decode", packed, lo, step, out, &bits,
                          &block))
        return NULL;
    const Py_buffer *per_block[] = {lo, step};
    int ok = check_bits(bits, "uniform_decode") == 0 &&
             check_quantizer("uniform_decode", out, packed, bits, per_block, 2, block, &n) == 0;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS quantizers->uniform_decode(packed->buf, lo->buf, step->buf, n,
                                                          block, bits, out->buf);
        Py_END_ALLOW_THREADS
    }
    release(&held);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* --- random-k's subset: the first distinct values of a stream, as a bitmap --- */

static PyObject *subset_mark(PyObject *self, PyObject *args) {
    Py_buffer draws, bitmap;
    Py_ssize_t numel, found, want;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nw*nn:subset_mark", &draws, &numel, &bitmap, &found, &want))
        return NULL;
    int ok = numel > 0 && 0 <= found && found <= want && want <= numel &&
             draws.len % 8 == 0 && bitmap.len >= (numel + 7) / 8;
    if (!ok)
        PyErr_Format(PyExc_ValueError,
                     "subset_mark: need numel > 0, 0 <= found <= want <= numel, whole uint64 "
                     "draws and %zd bitmap bytes (numel %zd, found %zd, want %zd, %zd draw "
                     "bytes, %zd bitmap bytes)",
                     (numel + 7) / 8, numel, found, want, draws.len, bitmap.len);
    if (ok) {
        const uint64_t *d = draws.buf;
        uint8_t *seen = bitmap.buf;
        Py_ssize_t n = draws.len / 8;
        Py_BEGIN_ALLOW_THREADS for (Py_ssize_t i = 0; i < n && found < want; i++) {
            uint64_t v = d[i] % (uint64_t)numel;
            uint8_t bit = (uint8_t)(1u << (v & 7));
            if (!(seen[v >> 3] & bit)) {
                seen[v >> 3] |= bit;
                found++;
            }
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&draws);
    PyBuffer_Release(&bitmap);
    return ok ? PyLong_FromSsize_t(found) : NULL;
}

/* The 8 bytes of buf from byte `at` as a little-endian word (byte `at` in the low bits, so
   bit i of a bitmap is bit i of its word), zeros for the bytes past `size`. */
static inline uint64_t load_le64(const uint8_t *buf, int64_t size, int64_t at) {
    uint64_t word = 0;
    if (at + 8 <= size) {
        memcpy(&word, buf + at, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        word = __builtin_bswap64(word);
#endif
        return word;
    }
    for (int64_t i = 0; at + i < size; i++)
        word |= (uint64_t)buf[at + i] << (8 * i);
    return word;
}

static PyObject *subset_positions(PyObject *self, PyObject *args) {
    Py_buffer bitmap, out;
    Py_ssize_t numel;
    int value;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*npw*:subset_positions", &bitmap, &numel, &value, &out))
        return NULL;
    int ok = numel >= 0 && bitmap.len >= (numel + 7) / 8 && out.len % 8 == 0;
    Py_ssize_t count = 0, want = out.len / 8;
    if (ok) {
        const uint8_t *bits = bitmap.buf;
        int64_t *dst = out.buf;
        uint64_t flip = value ? 0 : ~(uint64_t)0;
        Py_ssize_t words = numel / 64;
        Py_BEGIN_ALLOW_THREADS for (Py_ssize_t w = 0; w <= words; w++) {
            uint64_t hits = load_le64(bits, (numel + 7) / 8, w * 8) ^ flip;
            if (w == words) /* the last bits; those past numel are not positions */
                hits &= ((uint64_t)1 << (numel % 64)) - 1;
            int64_t base = (int64_t)w * 64;
            if (count + 2 <= want) {
                /* Most words of a sparse subset hold 0–2 positions: write two without a
                 * branch (an empty word's are overwritten later) and count them all. A
                 * loop over each word's bits mispredicted its exit: 13 ns a position. */
                uint64_t rest = hits & (hits - 1), past = (uint64_t)1 << 63;
                dst[count] = base + __builtin_ctzll(hits | past);
                dst[count + 1] = base + __builtin_ctzll(rest | past);
                Py_ssize_t at = count + 2;
                for (rest &= rest - 1; rest; rest &= rest - 1, at++)
                    if (at < want)
                        dst[at] = base + __builtin_ctzll(rest);
                count += __builtin_popcountll(hits);
            } else {
                for (; hits; hits &= hits - 1, count++)
                    if (count < want)
                        dst[count] = base + __builtin_ctzll(hits);
            }
        }
        Py_END_ALLOW_THREADS
        ok = count == want;
    }
    if (!ok)
        PyErr_Format(PyExc_ValueError,
                     "subset_positions: %zd positions have bit %d, but out holds %zd int64 "
                     "(numel %zd, %zd bitmap bytes)",
                     count, value, want, numel, bitmap.len);
    PyBuffer_Release(&bitmap);
    PyBuffer_Release(&out);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* Whether any of `groups` groups of eight `bits`-bit codes (each group `bits` bytes) is over
   `limit`, with `bits` a constant in each instance so the masks are immediates. SWAR: the
   even codes and (shifted down) the odd ones each sit in a word with a free slot of `bits`
   bits above every code, so code + (2^bits - 1 - limit) carries into that slot exactly when
   the code is over the limit: a few word operations for eight codes. */
static inline uint64_t codes_over_groups(const uint8_t *buf, int64_t groups, const int bits,
                                         int64_t limit) {
    uint64_t field = ((uint64_t)1 << bits) - 1, mask = 0, add = 0, carry = 0;
    for (int j = 0; j < 8; j += 2) {
        mask |= field << (j * bits);
        add |= (field - (uint64_t)limit) << (j * bits);
        carry |= (uint64_t)1 << (j * bits + bits);
    }
    uint64_t over = 0;
    for (int64_t g = 0; g < groups; g++) {
        uint64_t word;
        memcpy(&word, buf + g * bits, 8); /* the caller leaves 8 bytes readable */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        word = __builtin_bswap64(word);
#endif
        over |= ((word & mask) + add) | (((word >> bits) & mask) + add);
    }
    return over & carry;
}

static PyObject *codes_over(PyObject *self, PyObject *args) {
    Py_buffer packed;
    int bits;
    Py_ssize_t count, limit;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*inn:codes_over", &packed, &bits, &count, &limit))
        return NULL;
    int ok = bits >= 1 && bits <= 8 && count >= 0 && limit >= 0 &&
             packed.len * 8 >= (Py_ssize_t)bits * count;
    uint64_t over = 0;
    if (ok && limit < ((Py_ssize_t)1 << bits) - 1) { /* else no code can be over it */
        const uint8_t *buf = packed.buf;
        const int64_t size = packed.len, groups = count / 8;
        /* Whole groups whose word load stays inside the buffer, then the rest word by word. */
        int64_t fast = size >= 8 ? (size - 8) / bits + 1 : 0;
        fast = fast < groups ? fast : groups;
        Py_BEGIN_ALLOW_THREADS switch (bits) {
#define CODES_OVER_CASE(B)                                                                     \
    case B:                                                                                    \
        over = codes_over_groups(buf, fast, B, limit);                                         \
        break;
            CODES_OVER_CASE(1)
            CODES_OVER_CASE(2)
            CODES_OVER_CASE(3)
            CODES_OVER_CASE(4)
            CODES_OVER_CASE(5)
            CODES_OVER_CASE(6)
            CODES_OVER_CASE(7)
            CODES_OVER_CASE(8)
#undef CODES_OVER_CASE
        }
        for (int64_t g = fast; g * 8 < count && !over; g++) {
            uint64_t word = load_le64(buf, size, g * bits);
            int64_t left = count - g * 8;
            for (int j = 0; j < (left < 8 ? left : 8); j++)
                over |= ((word >> (j * bits)) & (((uint64_t)1 << bits) - 1)) > (uint64_t)limit;
        }
        Py_END_ALLOW_THREADS
    } else if (!ok) {
        PyErr_Format(PyExc_ValueError,
                     "codes_over: %zd codes of %d bits (1..8) need %zd bytes, got %zd; "
                     "limit %zd must be >= 0",
                     count, bits, ((Py_ssize_t)bits * count + 7) / 8, packed.len, limit);
    }
    PyBuffer_Release(&packed);
    if (!ok)
        return NULL;
    return PyBool_FromLong(over != 0);
}

/* --- sparse vectors --- */

static PyObject *magnitude_at_least(PyObject *self, PyObject *args) {
    Py_buffer x, idx, val;
    float tau;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*fw*w*:magnitude_at_least", &x, &tau, &idx, &val))
        return NULL;
    int64_t cap = idx.len / 8, count = 0;
    int ok = x.len % 4 == 0 && idx.len % 8 == 0 && val.len == cap * 4;
    if (!ok)
        PyErr_Format(PyExc_ValueError,
                     "magnitude_at_least: need whole float32 x, whole int64 idx and as many "
                     "float32 val (%zd, %zd and %zd bytes)",
                     x.len, idx.len, val.len);
    else {
        Py_BEGIN_ALLOW_THREADS count =
            at_least_kernel(x.buf, x.len / 4, tau, idx.buf, val.buf, cap);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&idx);
    PyBuffer_Release(&val);
    return ok ? PyLong_FromLongLong(count) : NULL;
}

static PyObject *densify(PyObject *self, PyObject *args) {
    Py_buffer idx, val, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*:densify", &idx, &val, &out))
        return NULL;
    int64_t k = idx.len / 8, n = out.len / 4;
    int ok = idx.len % 8 == 0 && val.len == k * 4 && out.len % 4 == 0, placed = 0;
    if (!ok)
        PyErr_Format(PyExc_ValueError,
                     "densify: need whole int64 idx, as many float32 val and a whole float32 "
                     "out (%zd, %zd and %zd bytes)",
                     idx.len, val.len, out.len);
    else {
        int stream = stream_out(out.buf, n);
        Py_BEGIN_ALLOW_THREADS placed = densify_kernel(idx.buf, val.buf, k, out.buf, n, stream);
        Py_END_ALLOW_THREADS
        ok = placed == 0;
        if (!ok)
            PyErr_Format(PyExc_ValueError,
                         "densify: positions must rise strictly and lie in [0, %lld)",
                         (long long)n);
    }
    PyBuffer_Release(&idx);
    PyBuffer_Release(&val);
    PyBuffer_Release(&out);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* --- PowerSGD's low-rank product --- */

/* The rank of float32 p (rows × rank) and qt (rank × cols), or -1 (ValueError set) when their
   sizes do not share one, or out (float32) holds more than rows·cols values. */
static Py_ssize_t low_rank_of(const Py_buffer *p, const Py_buffer *qt, const Py_buffer *out,
                              Py_ssize_t rows, Py_ssize_t cols) {
    Py_ssize_t np_ = p->len / 4, nq = qt->len / 4, n = out->len / 4;
    Py_ssize_t rank = rows > 0 ? np_ / rows : cols > 0 ? nq / cols : 0;
    if (p->len % 4 || qt->len % 4 || rows < 0 || cols < 0 || np_ != rank * rows ||
        (cols ? nq % cols || nq / cols != rank : nq != 0)) {
        PyErr_Format(PyExc_ValueError,
                     "low_rank_product: p (%zd bytes) and qt (%zd bytes) must be float32 "
                     "rows x rank and rank x cols for one rank (rows %zd, cols %zd)",
                     p->len, qt->len, rows, cols);
        return -1;
    }
    if (out->len % 4 || (cols ? n / cols + (n % cols != 0) > rows : n != 0)) {
        PyErr_Format(PyExc_ValueError,
                     "low_rank_product: out (%zd bytes) must be float32 values, at most rows x "
                     "cols = %zd x %zd",
                     out->len, rows, cols);
        return -1;
    }
    return rank;
}

static PyObject *low_rank_product(PyObject *self, PyObject *args) {
    Py_buffer p, qt, out;
    Py_ssize_t rows, cols;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*nn:low_rank_product", &p, &qt, &out, &rows, &cols))
        return NULL;
    Py_ssize_t rank = low_rank_of(&p, &qt, &out, rows, cols);
    if (rank >= 0) {
        Py_BEGIN_ALLOW_THREADS low_rank_product_all(p.buf, qt.buf, rank, cols, out.len / 4,
                                                    out.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&p);
    PyBuffer_Release(&qt);
    PyBuffer_Release(&out);
    if (rank < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *choco_step(PyObject *self, PyObject *args) {
    Py_buffer x, s, h, out;
    float g;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*fw*:choco_step", &x, &s, &h, &g, &out))
        return NULL;
    int ok = x.len % 4 == 0 && s.len == x.len && h.len == x.len && out.len == x.len;
    if (!ok)
        PyErr_Format(PyExc_ValueError,
                     "choco_step: x, s, x_hat and out must be float32 vectors of one length "
                     "(%zd, %zd, %zd and %zd bytes)",
                     x.len, s.len, h.len, out.len);
    else {
        int64_t n = x.len / 4;
        int stream = stream_out(out.buf, n);
        Py_BEGIN_ALLOW_THREADS step_kernel(x.buf, s.buf, h.buf, g, out.buf, 0, n, stream);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&s);
    PyBuffer_Release(&h);
    PyBuffer_Release(&out);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* --- delta-golomb: Golomb–Rice bit streams of index gaps ---
 *
 * numpy needs a byte per bit and several passes (unpackbits, flatnonzero, packbits by
 * rows); these walk the two bit streams once. Both streams are LSB first: the unary one
 * holds q_j zeros then a one per gap, the other b-bit remainders back to back. Decode
 * reads what arrived over the network: it never reads outside the two streams, bounds
 * every quotient before shifting it, and checks each index against numel. */

#define GOLOMB_MAX_B 56 /* a remainder plus its bit offset fits one 64-bit load */

/* The `b` bits of buf from bit `bit` on (LSB first), zeros past its end (b <= 56). */
static inline uint64_t load_bits(const uint8_t *buf, int64_t size, int64_t bit, int b) {
    uint64_t word = load_le64(buf, size, bit >> 3);
    return (word >> (bit & 7)) & (((uint64_t)1 << b) - 1);
}

/* 0; 1 when the unary stream does not hold exactly `count` ones ending in its last byte;
   2 when a gap runs past numel. */
static int golomb_unpack_all(const uint8_t *unary, int64_t usize, const uint8_t *rest,
                             int64_t rsize, int b, int64_t count, int64_t numel, int64_t *out) {
    int64_t bit = 0, ubits = usize * 8, prev = -1, limit = numel >> b;
    for (int64_t j = 0; j < count; j++) {
        int64_t start = bit;
        uint64_t word = 0;
        for (;;) { /* the next one bit at or after `bit` */
            if (bit >= ubits)
                return 1;
            word = load_bits(unary, usize, bit, 56);
            if (word)
                break;
            bit += 56;
        }
        bit += __builtin_ctzll(word);
        if (bit >= ubits)
            return 1;
        int64_t q = bit - start;
        bit++;
        if (q > limit)
            return 2;
        int64_t gap = (q << b) | (int64_t)load_bits(rest, rsize, j * (int64_t)b, b);
        if (gap >= numel - prev - 1)
            return 2;
        prev += gap + 1;
        out[j] = prev;
    }
    /* the last one sits in the last byte, and only zero padding follows it */
    if (count ? (bit + 7) / 8 != usize || ((bit & 7) && unary[usize - 1] >> (bit & 7))
              : usize != 0)
        return 1;
    return 0;
}

static void golomb_pack_all(const int64_t *gaps, int64_t count, int b, uint8_t *unary,
                            int64_t usize, uint8_t *rest, int64_t rsize) {
    memset(unary, 0, (size_t)usize);
    memset(rest, 0, (size_t)rsize);
    int64_t bit = 0;
    for (int64_t j = 0; j < count; j++) {
        bit += gaps[j] >> b;
        unary[bit >> 3] |= (uint8_t)(1u << (bit & 7));
        bit++;
        uint64_t r = (uint64_t)gaps[j] & (((uint64_t)1 << b) - 1);
        for (int64_t at = j * (int64_t)b, left = b; left > 0;) { /* LSB first, by bytes */
            int shift = (int)(at & 7), take = 8 - shift < left ? 8 - shift : (int)left;
            rest[at >> 3] |= (uint8_t)((r & ((1u << take) - 1)) << shift);
            r >>= take, at += take, left -= take;
        }
    }
}

static PyObject *golomb_unpack(PyObject *self, PyObject *args) {
    Py_buffer unary, rest, out;
    int b;
    Py_ssize_t count, numel;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*innw*:golomb_unpack", &unary, &rest, &b, &count, &numel,
                          &out))
        return NULL;
    int ok = 0 <= b && b <= GOLOMB_MAX_B && count >= 0 && numel >= 0 && count <= numel &&
             out.len == count * 8 && rest.len == (count * b + 7) / 8;
    int status = 0;
    if (!ok)
        PyErr_Format(PyExc_ValueError,
                     "golomb_unpack: need 0 <= b <= %d, 0 <= count <= numel, %zd bytes of "
                     "remainders and int64 out of count (b %d, count %zd, numel %zd, %zd and "
                     "%zd bytes)",
                     GOLOMB_MAX_B, (count * b + 7) / 8, b, count, numel, rest.len, out.len);
    else {
        Py_BEGIN_ALLOW_THREADS status = golomb_unpack_all(unary.buf, unary.len, rest.buf,
                                                          rest.len, b, count, numel, out.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&unary);
    PyBuffer_Release(&rest);
    PyBuffer_Release(&out);
    return ok ? PyLong_FromLong(status) : NULL;
}

static PyObject *golomb_sums(PyObject *self, PyObject *args) {
    Py_buffer gaps;
    int first;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*i:golomb_sums", &gaps, &first))
        return NULL;
    int ok = gaps.len % 8 == 0 && 0 <= first && first <= 61;
    int64_t sums[3] = {0, 0, 0};
    if (!ok)
        PyErr_Format(PyExc_ValueError,
                     "golomb_sums: need int64 gaps and 0 <= first <= 61 (%zd bytes, first %d)",
                     gaps.len, first);
    else {
        const int64_t *g = gaps.buf;
        int64_t count = gaps.len / 8;
        Py_BEGIN_ALLOW_THREADS for (int64_t j = 0; j < count; j++) {
            sums[0] += g[j] >> first;
            sums[1] += g[j] >> (first + 1);
            sums[2] += g[j] >> (first + 2);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&gaps);
    return ok ? Py_BuildValue("(LLL)", (long long)sums[0], (long long)sums[1],
                              (long long)sums[2])
              : NULL;
}

static PyObject *golomb_pack(PyObject *self, PyObject *args) {
    Py_buffer gaps, unary, rest;
    int b;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*iw*w*:golomb_pack", &gaps, &b, &unary, &rest))
        return NULL;
    int64_t count = gaps.len / 8, ones = 0;
    const int64_t *g = gaps.buf;
    int ok = gaps.len % 8 == 0 && 0 <= b && b <= GOLOMB_MAX_B;
    for (int64_t j = 0; ok && j < count; j++) {
        ok = g[j] >= 0;
        ones += ok ? (g[j] >> b) + 1 : 0;
    }
    ok = ok && unary.len == (ones + 7) / 8 && rest.len == (count * b + 7) / 8;
    if (!ok)
        PyErr_Format(PyExc_ValueError,
                     "golomb_pack: need int64 gaps >= 0, 0 <= b <= %d, %lld bytes of unary "
                     "code and %lld of remainders (b %d, %zd and %zd bytes)",
                     GOLOMB_MAX_B, (long long)((ones + 7) / 8), (long long)((count * b + 7) / 8),
                     b, unary.len, rest.len);
    else {
        Py_BEGIN_ALLOW_THREADS golomb_pack_all(g, count, b, unary.buf, unary.len, rest.buf,
                                               rest.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&gaps);
    PyBuffer_Release(&unary);
    PyBuffer_Release(&rest);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *use_isa(PyObject *self, PyObject *args) {
    const char *name = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "|s:use_isa", &name))
        return NULL;
    const char *before = isa;
    if (name != NULL && pick_kernels(name) < 0) {
        PyErr_Format(PyExc_ValueError,
                     "instruction set %s is unknown or not on this CPU (the %s kernels run)", name,
                     before);
        return NULL;
    }
    return PyUnicode_FromString(before);
}

static PyMethodDef methods[] = {
    {"sign_encode", sign_encode, METH_VARARGS,
     "sign_encode(x, bits, block=0, sums=None) -> float: write the packed sign bits of "
     "float32 x into bits (LSB first) and return the sum of |x|; with sums (float64), the "
     "sum of each block of `block` values (0: the whole tensor) too."},
    {"sign_expand", sign_expand, METH_VARARGS,
     "sign_expand(bits, scales, out, block=0): out[i] = -s if sign bit i is set, else s, "
     "with s = scales[i // block] (float32; block 0: scales[0])."},
    {"ternary_encode", ternary_encode, METH_VARARGS,
     "ternary_encode(x, packed, scales, out, seed, block=0): TernGrad of float32 x: max |x| "
     "per block into scales, base-3 digits 5 per byte into packed, s*t into out."},
    {"ternary_decode", ternary_decode, METH_VARARGS,
     "ternary_decode(packed, scales, out, block=0): out[i] = t_i * scales[i // block] "
     "(bytes >= 243 decode as 0: the caller rejects them)."},
    {"qsgd_encode", qsgd_encode, METH_VARARGS,
     "qsgd_encode(x, packed, norms, out, levels, seed, block=0): QSGD of float32 x: the "
     "2-norm per block into norms, codes level + s packed LSB first, the estimate into out."},
    {"qsgd_decode", qsgd_decode, METH_VARARGS,
     "qsgd_decode(packed, norms, out, levels, block=0) -> int: out[i] = (code - s) * norm / s; "
     "returns the largest code (the caller rejects one over 2 * levels)."},
    {"uniform_encode", uniform_encode, METH_VARARGS,
     "uniform_encode(x, packed, lo, step, out, bits, block=0): min/max rounding of float32 x "
     "to bits-bit codes; lo and step per block; code * step + lo into out."},
    {"uniform_decode", uniform_decode, METH_VARARGS,
     "uniform_decode(packed, lo, step, out, bits, block=0): out[i] = code * step + lo."},
    {"subset_mark", subset_mark, METH_VARARGS,
     "subset_mark(draws, numel, bitmap, found, want) -> int: set the bits of draw % numel "
     "(uint64 draws, in order) until `want` distinct values are set; returns their count."},
    {"subset_positions", subset_positions, METH_VARARGS,
     "subset_positions(bitmap, numel, value, out): the positions below numel whose bit is "
     "`value`, ascending, into int64 out (their number must be its length)."},
    {"codes_over", codes_over, METH_VARARGS,
     "codes_over(packed, bits, count, limit) -> bool: whether any of count bits-bit codes "
     "(1..8) packed LSB first, as pack_bits writes them, is over limit (>= 0)."},
    {"magnitude_at_least", magnitude_at_least, METH_VARARGS,
     "magnitude_at_least(x, tau, idx, val) -> int: the positions (ascending) and values of "
     "float32 x where |x| >= tau into int64 idx and float32 val, at most their length; "
     "returns how many there are in all."},
    {"densify", densify, METH_VARARGS,
     "densify(idx, val, out): float32 out = 0 but at the int64 positions idx (strictly "
     "rising, below len(out)), where it is val; ValueError for any other positions."},
    {"low_rank_product", low_rank_product, METH_VARARGS,
     "low_rank_product(p, qt, out, rows, cols): float32 out = the first len(out) values "
     "(at most rows * cols) of p @ qt, row-major, for p rows x rank and qt rank x cols: "
     "((p0 q0 + p1 q1) + p2 q2) + ..., each product and sum rounded on its own."},
    {"choco_step", choco_step, METH_VARARGS,
     "choco_step(x, s, x_hat, gamma, out): float32 out = x + gamma * (s - x_hat), each "
     "operation rounded on its own in that order (torch's bits), in one pass."},
    {"golomb_sums", golomb_sums, METH_VARARGS,
     "golomb_sums(gaps, first) -> (int, int, int): the sums of gaps >> first, >> first + 1 "
     "and >> first + 2 over int64 gaps (the quotients' bits for three Rice parameters)."},
    {"golomb_pack", golomb_pack, METH_VARARGS,
     "golomb_pack(gaps, b, unary, rest): the Golomb-Rice code of int64 gaps >= 0 with "
     "parameter 2**b: quotients in unary (zeros then a one) and b-bit remainders, both LSB "
     "first, into uint8 unary and rest of exactly the sizes they need."},
    {"golomb_unpack", golomb_unpack, METH_VARARGS,
     "golomb_unpack(unary, rest, b, count, numel, out) -> int: the count indices whose gaps "
     "the two streams code, into int64 out; 0, or 1 if unary does not hold exactly count "
     "quotients ending in its last byte, or 2 if an index would reach numel."},
    {"use_isa", use_isa, METH_VARARGS,
     "use_isa([name]) -> str: run the avx512f, avx2 or generic kernels from now on (tests "
     "compare them); returns the previous choice (without a name: the current one). "
     "ValueError if this CPU lacks it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "_native",
    "Fused CPU kernels for the sign, ternary, qsgd and uniform codecs, random-k's subsets, "
    "sparse vectors, delta-golomb's bit streams, PowerSGD's low-rank product and CHOCO's "
    "step; see gossipdl.compression._kernels.",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    fill_trit_table();
#ifdef GOSSIPDL_X86
    fill_decode_tables();
#endif
    pick_kernels(NULL);
    return PyModule_Create(&module);
}
