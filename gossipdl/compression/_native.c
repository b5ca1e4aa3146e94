/* Fused CPU kernels for the sign codec (gossipdl.compression._native).
 *
 * numpy needs four passes over a 40 MB tensor for a sign encode (signbit,
 * packbits, a ±1 table lookup, a dot product for the L1 norm) and torch more;
 * these do it in one read pass (bits and L1 together) plus one write pass
 * (±scale), with AVX-512 or AVX2 where the CPU has them.
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
 *   use_isa([name]) -> str
 *       Run the "avx512f", "avx2" or "generic" kernels from now on (the best
 *       the CPU has is picked at import; tests compare them) and return the
 *       previous choice; without a name, return the current one.
 *
 * A block must be a multiple of 8 values, so that each starts on a byte of
 * bits (the codec runs numpy for other blocks).
 *
 * Arguments are contiguous buffers (numpy arrays): x and out float32, bits
 * uint8 of ceil(n / 8) bytes; sizes are checked and a mismatch raises
 * ValueError. The GIL is released while a kernel runs.
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
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define GOSSIPDL_X86 1
#include <immintrin.h>
#endif

#define BLOCK 4096                   /* values summed in float32 before the sum moves to double */
#define PREFETCH 1024                /* values ahead of the one being read */
#define STREAM_BYTES ((Py_ssize_t)16 << 20)

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

static encode_t encode_kernel = encode_generic;
static expand_t expand_kernel = expand_generic;
static const char *isa = "generic";

/* Use the kernels for `name` ("avx512f", "avx2" or "generic"), or the best the CPU has (NULL).
   Returns 0, or -1 when the CPU lacks that instruction set or the name is unknown. */
static int pick_kernels(const char *name) {
    int any = name == NULL;
#ifdef GOSSIPDL_X86
    __builtin_cpu_init();
    if ((any || !strcmp(name, "avx512f")) && __builtin_cpu_supports("avx512f")) {
        encode_kernel = encode_avx512, expand_kernel = expand_avx512, isa = "avx512f";
        return 0;
    }
    if ((any || !strcmp(name, "avx2")) && __builtin_cpu_supports("avx2")) {
        encode_kernel = encode_avx2, expand_kernel = expand_avx2, isa = "avx2";
        return 0;
    }
#endif
    if (any || !strcmp(name, "generic")) {
        encode_kernel = encode_generic, expand_kernel = expand_generic, isa = "generic";
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
    {"use_isa", use_isa, METH_VARARGS,
     "use_isa([name]) -> str: run the avx512f, avx2 or generic kernels from now on (tests "
     "compare them); returns the previous choice (without a name: the current one). "
     "ValueError if this CPU lacks it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "_native",
    "Fused CPU kernels for the sign codec; see gossipdl.compression._kernels.",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    pick_kernels(NULL);
    return PyModule_Create(&module);
}
