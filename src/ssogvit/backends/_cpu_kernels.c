/* SSoG on the CPU (docs/operator.md, "Backends"; compiled, loaded and registered as torch ops by
 * ssogvit/backends/cpu.py).
 *
 * Kernel rows, built the R rows of a row of queries at a time in cache:
 *
 *     row[r, j] = lam_r * flush(softmax_j(-((j - q - mu_r) s_r)^2)),   then flushed again,
 *
 * (lam = 1 when no weights are given; flush(k) = 0 where k <= the type's smallest normal number): the arithmetic of
 * ssogvit.core.gaussian_rows followed, for weighted rows, by core.flush_tiny_product. NaN and infinities go through
 * as IEEE arithmetic takes them (the library is compiled without -ffinite-math-only): a NaN in a row's geometry
 * makes the whole row NaN, as torch's softmax does.
 *
 * ssog_mix_*:        the whole mixing of the patch tokens (inference, a training step's forward), steered or fixed,
 *                    one (image, head) at a time: for each query row iy, the column pass
 *                    U[r, k] = sum_jy K^y(g_(iy,k))[r, iy, jy] V[jy, k] for all columns k, then the row pass
 *                    out[iy, ix] = sum_(r,k) W(g_(iy,ix))[r, ix, k] U[r, k]; a head's result is kept aside and
 *                    written at the end, so `out` may be the values themselves.
 * ssog_mix_grad_*:   the steered mixing's backward, in the same order.
 * ssog_fixed_grad_*: the fixed mixing's backward, one source row at a time (the factorisation of the torch
 *                    backend's, so that non-finite numbers land where they land there). */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

/* glibc's vector exp (libmvec, reached through libm) for the kernel's exp loops. Its header declares the vector
 * variants under __FAST_MATH__ only, which -fno-finite-math-only (backends/cpu.py) leaves undefined; without them every
 * exp is a scalar call and the steered mixing takes twice as long. The vector variants give IEEE results for NaN and
 * infinities, as the scalar ones do. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__FAST_MATH__)
__attribute__((__simd__("notinbranch"))) float expf(float);
__attribute__((__simd__("notinbranch"))) double exp(double);
#endif

/* Each thread flushes denormal results to zero while it works (MXCSR's FTZ bit, restored at the end; x86 only): a
 * kernel entry just above the smallest normal number times a value below 1 is a denormal product, and an FMA that
 * makes one runs several times slower (the fixed mixing at 512 px took 2x as long). Such a product is below 1e-38,
 * far below the rounding of any sum it joins; NaN and infinities are unaffected, and denormal inputs stay as they
 * are (no DAZ). */
static inline unsigned ftz_enter(void) {
#if defined(__SSE__)
    unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8000);
    return csr;
#else
    return 0;
#endif
}

static inline void ftz_leave(unsigned csr) {
#if defined(__SSE__)
    _mm_setcsr(csr);
#else
    (void)csr;
#endif
}

/* Work at least this large (entries of tables, multiply-adds of the mixing) is split between the OpenMP threads (the
 * library links the libgomp that PyTorch has already loaded, so torch.set_num_threads applies). */
#define PARALLEL_ENTRIES 32768

/* The loop over the (image, head) units of a kernel: split between `threads` OpenMP threads where a unit's `macs` are
 * many enough, dynamically (units differ in cost), each thread flushing denormal results while it works. */
#define SSOG_UNITS_BEGIN                                                                                              \
    _Pragma("omp parallel num_threads(threads) if (macs >= PARALLEL_ENTRIES)") {                                      \
        unsigned csr = ftz_enter();                                                                                   \
        _Pragma("omp for schedule(dynamic, 1)")                                                                       \
        for (int64_t unit = 0; unit < units; ++unit) {
#define SSOG_UNITS_END                                                                                                \
        }                                                                                                             \
        ftz_leave(csr);                                                                                               \
    }

/* The register vectors of the products: 64 bytes where the flags allow AVX-512 (backends/cpu.py passes them on such
 * CPUs), 32 bytes (AVX2, or pairs of narrower registers) elsewhere. */
#ifdef __AVX512F__
#define VEC_BYTES 64
#else
#define VEC_BYTES 32
#endif
typedef float f32_vec __attribute__((vector_size(VEC_BYTES), aligned(sizeof(float))));
typedef double f64_vec __attribute__((vector_size(VEC_BYTES), aligned(sizeof(double))));
typedef int32_t f32_mask __attribute__((vector_size(VEC_BYTES))); /* a lane's comparison result: all ones or zeros */
typedef int64_t f64_mask __attribute__((vector_size(VEC_BYTES)));
typedef int32_t f32_ints __attribute__((vector_size(VEC_BYTES))); /* one 32-bit int per lane */
typedef int32_t f64_ints __attribute__((vector_size(VEC_BYTES / 2)));

/* Queries padded to whole vectors: 16 lanes (AVX-512's floats, two vectors of anything narrower). */
#define SSOG_LANES(count) (((count) + 15) / 16 * 16)

/* The R kernel rows of `count` queries, n positions each, laid out with the queries along the vector lanes: the
 * entry of atom ri, position j and query c at o[(ri * n + j) * cp + c], cp = SSOG_LANES(count) (lanes past `count`
 * repeat the last query and are never read). Query c has the index qi + c * dq, its rows' mu and s start at c * qs
 * and lie `es` elements apart, and its weights lam (if any) start at c * lqs. Every step runs lane-wise over a vector
 * of queries: a grid side (14 at 224 px) is shorter than one vector, so along a row the loops, the largest logit and
 * the sum would be mostly masked lanes and horizontal reductions. */
#define SSOG_QUERY_ROWS(NAME, T, VEC, MASK, INTS, EXP, HUGE, TINY, LOW)                                               \
    static inline void NAME(T *o, const T *mu, const T *s, const T *lam, int64_t es, int64_t qs, int64_t lqs,         \
                            int64_t count, int qi, int dq, int n, int64_t r) {                                        \
        typedef VEC vec;                                                                                              \
        typedef MASK mask; /* selections are bitwise, by comparison masks */                                          \
        typedef INTS ints;                                                                                            \
        enum { L = VEC_BYTES / sizeof(T) };                                                                           \
        int64_t cp = SSOG_LANES(count), block = r * n * cp;                                                           \
        const vec one = (vec){0} + 1;                                                                                 \
        for (int64_t c0 = 0; c0 < cp; c0 += L)                                                                        \
            for (int64_t ri = 0; ri < r; ++ri) { /* logits minus each row's largest, as the softmax does */           \
                vec centre, sc, top;                                                                                  \
                ints q;                                                                                               \
                for (int l = 0; l < L; ++l) {                                                                         \
                    int64_t c = c0 + l < count ? c0 + l : count - 1;                                                  \
                    q[l] = qi + (int)c * dq, centre[l] = mu[c * qs + ri * es], sc[l] = s[c * qs + ri * es];           \
                    top[l] = -HUGE;                                                                                   \
                }                                                                                                     \
                T *blk = o + ri * n * cp + c0;                                                                        \
                for (int j = 0; j < n; ++j) { /* the int offset, converted: exact, and -ffast-math cannot regroup */ \
                    vec z = (__builtin_convertvector(j - q, vec) - centre) * sc, logit = -(z * z);                    \
                    mask up = logit > top; /* false for a NaN, which then stays in its entry */                       \
                    *(vec *)(blk + j * cp) = logit;                                                                   \
                    top = (vec)(((mask)logit & up) | ((mask)top & ~up));                                              \
                }                                                                                                     \
                for (int j = 0; j < n; ++j) { /* below LOW, whose exp is below the smallest normal number: 1 */      \
                    vec x = *(vec *)(blk + j * cp) - top;                                                             \
                    mask low = x < LOW;                                                                               \
                    *(vec *)(blk + j * cp) = (vec)(((mask)x & ~low) | ((mask)one & low));                             \
                }                                                                                                     \
            }                                                                                                         \
        /* exp over all rows at once, a vector at a time (so that no scalar exp peels off for alignment); the marked  \
           entries, the only positive ones, are zero. Every argument is in the vector exp's fast range (past it, it  \
           takes a scalar path), but NaN, which stays NaN. */                                                         \
        for (int64_t j0 = 0; j0 < block; j0 += L)                                                                     \
            for (int l = 0; l < L; ++l)                                                                               \
                o[j0 + l] = o[j0 + l] > 0 ? (T)0 : EXP(o[j0 + l]);                                                    \
        for (int64_t c0 = 0; c0 < cp; c0 += L)                                                                        \
            for (int64_t ri = 0; ri < r; ++ri) { /* normalise, flush, weight, flush */                                \
                vec sum = {0}, w;                                                                                     \
                T *blk = o + ri * n * cp + c0;                                                                        \
                for (int l = 0; l < L; ++l)                                                                           \
                    w[l] = lam ? lam[(c0 + l < count ? c0 + l : count - 1) * lqs + ri] : (T)1;                        \
                for (int j = 0; j < n; ++j)                                                                           \
                    sum += *(vec *)(blk + j * cp);                                                                    \
                vec inv = (T)1 / sum;                                                                                 \
                for (int j = 0; j < n; ++j) {                                                                         \
                    vec x = *(vec *)(blk + j * cp) * inv;                                                             \
                    x = (vec)((mask)x & ~(mask)(x <= TINY)) * w;                                                      \
                    *(vec *)(blk + j * cp) = (vec)((mask)x & ~(mask)(x <= TINY));                                     \
                }                                                                                                     \
            }                                                                                                         \
    }

/* c[i, :dh] (+)= sum_j a[i, j] b[j, :dh] for i < m, j < kk (a[i, j] at a + i lda + j acs; rows of b and c ldb, ldc
 * apart; added to c when `add`): both passes of the mixing and of its backward. Tiles
 * of 4 rows by two 32-byte vectors stay in registers while the b[j] go by (GCC's vector extension: AVX2 registers
 * where the flags allow it, pairs of narrower ones elsewhere); a tile of fewer rows repeats its last row and stores
 * only its own. */
#define SSOG_GEMM(NAME, T, VEC)                                                                                       \
    static inline void NAME(T *c, int64_t ldc, const T *a, int64_t lda, int64_t acs, const T *b, int64_t ldb,         \
                            int64_t m, int64_t kk, int64_t dh, int add) {                                             \
        typedef VEC vec;                                                                                              \
        enum { W = VEC_BYTES / sizeof(T) };                                                                           \
        for (int64_t m0 = 0; m0 < m; m0 += 4) {                                                                       \
            int64_t mr = m - m0 < 4 ? m - m0 : 4;                                                                     \
            const T *a0 = a + m0 * lda, *a1 = a0 + (mr > 1) * lda, *a2 = a0 + (mr > 2) * 2 * lda,                     \
                    *a3 = a0 + (mr > 3) * 3 * lda;                                                                    \
            T *c0 = c + m0 * ldc;                                                                                     \
            int64_t d0 = 0;                                                                                           \
            for (; d0 + 2 * W <= dh; d0 += 2 * W) {                                                                   \
                vec s00 = {0}, s01 = {0}, s10 = {0}, s11 = {0}, s20 = {0}, s21 = {0}, s30 = {0}, s31 = {0};           \
                for (int64_t j = 0; j < kk; ++j) {                                                                    \
                    vec b0 = *(const vec *)(b + j * ldb + d0), b1 = *(const vec *)(b + j * ldb + d0 + W);             \
                    T x0 = a0[j * acs], x1 = a1[j * acs], x2 = a2[j * acs], x3 = a3[j * acs];                         \
                    s00 += x0 * b0, s01 += x0 * b1, s10 += x1 * b0, s11 += x1 * b1;                                   \
                    s20 += x2 * b0, s21 += x2 * b1, s30 += x3 * b0, s31 += x3 * b1;                                   \
                }                                                                                                     \
                vec tile[4][2] = {{s00, s01}, {s10, s11}, {s20, s21}, {s30, s31}};                                    \
                for (int64_t i = 0; i < mr; ++i) {                                                                    \
                    vec *o0 = (vec *)(c0 + i * ldc + d0), *o1 = (vec *)(c0 + i * ldc + d0 + W);                       \
                    *o0 = add ? *o0 + tile[i][0] : tile[i][0];                                                        \
                    *o1 = add ? *o1 + tile[i][1] : tile[i][1];                                                        \
                }                                                                                                     \
            }                                                                                                         \
            for (; d0 + W <= dh; d0 += W) { /* then one vector at a time */                                           \
                vec s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};                                                           \
                for (int64_t j = 0; j < kk; ++j) {                                                                    \
                    vec b0 = *(const vec *)(b + j * ldb + d0);                                                        \
                    s0 += a0[j * acs] * b0, s1 += a1[j * acs] * b0, s2 += a2[j * acs] * b0, s3 += a3[j * acs] * b0;   \
                }                                                                                                     \
                vec tile[4] = {s0, s1, s2, s3};                                                                       \
                for (int64_t i = 0; i < mr; ++i) {                                                                    \
                    vec *o = (vec *)(c0 + i * ldc + d0);                                                              \
                    *o = add ? *o + tile[i] : tile[i];                                                                \
                }                                                                                                     \
            }                                                                                                         \
            for (int64_t i = 0; i < mr; ++i) /* widths that are not a multiple of W: the rest one by one */           \
                for (int64_t d = d0; d < dh; ++d) {                                                                   \
                    T sum = add ? c0[i * ldc + d] : (T)0;                                                             \
                    for (int64_t j = 0; j < kk; ++j)                                                                  \
                        sum += a[(m0 + i) * lda + j * acs] * b[j * ldb + d];                                          \
                    c0[i * ldc + d] = sum;                                                                            \
                }                                                                                                     \
        }                                                                                                             \
    }

/* The mixing of the patch tokens of `b` images: values v and out (B, P + N, H * dh) with rows `*_st` and images `*_sb`
 * elements apart (unit stride within a row). Steered: mu, s contiguous (B, N, H, R, 2), lam (B, N, H, R), and
 * ky = wx = NULL. Fixed: mu = s = lam = NULL and the field's tables, lam K^y (H, R, Gh, Gh) flushed as `ky` and
 * K^x laid out (H, Gw, R, Gw) for the row pass (`wx`), both contiguous (core.mix_fixed's lam K^y and K^x: the
 * torch backend's factors, so that exact zeros, and the non-finite numbers they meet, are the same). `work`:
 * ssog_mix_work(...) numbers for each of `threads` threads (allocated by the caller, so that PyTorch's allocator
 * counts them). Bands (docs/operator.md, "Bands"): NULL `by`, `bx` mix every entry; else each kernel row's
 * [lo, hi) (int32 pairs, core.axis_band) bounds the entries the passes read: fixed, by (H, R, Gh, 2) and bx
 * (H, R, Gw, 2); steered, one array (B, N, H, R, 2, 2), axis then [lo, hi), passed as by = band and bx = band + 2.
 * A head whose values are not all finite is mixed whole, so that an infinity meets the zeros it meets there. */
/* The union [lo, hi) of `count` bands (int32 [lo, hi) pairs, `stride` ints apart). */
static inline void band_union(const int32_t *band, int64_t stride, int64_t count, int64_t *lo, int64_t *hi) {
    *lo = band[0], *hi = band[1];
    for (int64_t i = 1; i < count; ++i) {
        *lo = band[i * stride] < *lo ? band[i * stride] : *lo;
        *hi = band[i * stride + 1] > *hi ? band[i * stride + 1] : *hi;
    }
}

/* The backwards' transposed bands: for each column j < n, the hull [lo, hi) of the `count` rows whose band
 * (int32 [lo, hi) pairs, `stride` ints apart) holds j, as int32 pairs in `col` (lo >= hi: none does); with `add`
 * widened to cover the rows of these bands as well (the union over atoms). */
static inline void band_columns(const int32_t *band, int64_t stride, int64_t count, int64_t n, int32_t *col,
                                int add) {
    for (int64_t j = 0; !add && j < n; ++j)
        col[2 * j] = (int32_t)count, col[2 * j + 1] = 0;
    for (int64_t i = 0; i < count; ++i)
        for (int64_t j = band[i * stride]; j < band[i * stride + 1]; ++j) {
            col[2 * j] = i < col[2 * j] ? (int32_t)i : col[2 * j];
            col[2 * j + 1] = i + 1 > col[2 * j + 1] ? (int32_t)(i + 1) : col[2 * j + 1];
        }
}

/* The union of `count` transposed bands (band_columns'), [0, 0) where all are empty. */
static inline void column_union(const int32_t *col, int64_t count, int64_t *lo, int64_t *hi) {
    band_union(col, 2, count, lo, hi);
    if (*hi <= *lo)
        *lo = *hi = 0;
}

/* [lo, hi) widened to a whole number of `w`-entry vectors inside [0, limit), where it fits: a product along the band
 * then runs in vectors, with no entry-by-entry tail (the entries it adds are computed exactly, as in the dense
 * kernel). */
static inline void band_widen(int64_t *lo, int64_t *hi, int64_t limit, int64_t w) {
    int64_t len = (*hi - *lo + w - 1) / w * w;
    len = len < limit ? len : limit;
    *hi = *lo + len < limit ? *lo + len : limit;
    *lo = *hi - len;
}

int64_t ssog_mix_work(int64_t gh, int64_t gw, int64_t r, int64_t dh) {
    return 2 * gh * gw * dh + r * gw * dh + r * (gh > gw ? gh : gw) * SSOG_LANES(gw);
}

#define SSOG_MIX(NAME, ROWS, GEMM, T)                                                                                 \
    void NAME(const T *v, T *out, const T *mu, const T *s, const T *lam, const T *ky, const T *wx, const int32_t *by, \
              const int32_t *bx, T *work, int64_t threads, int64_t b, int64_t v_sb, int64_t v_st, int64_t o_sb,       \
              int64_t o_st, int64_t p, int64_t gh, int64_t gw, int64_t heads, int64_t r, int64_t dh) {                \
        int64_t n = gh * gw, units = b * heads, size = ssog_mix_work(gh, gw, r, dh);                                  \
        int64_t macs = n * r * (gh + gw) * dh; /* per unit: units this large go to the threads */                     \
        SSOG_UNITS_BEGIN                                                                                              \
            int64_t bi = unit / heads, h = unit % heads;                                                              \
            /* the head's values column by column (each column pass reads one column, contiguous), its result,        \
               U[ri, k] for one row of queries, and that row's tables */                                              \
            T *mixed = work + omp_get_thread_num() * size, *cols = mixed + n * dh, *u = cols + n * dh;                \
            T *tab = u + r * gw * dh;                                                                                 \
            const T *vb = v + bi * v_sb + p * v_st + h * dh;                                                          \
            int banded = by != NULL;                                                                                  \
            for (int64_t t = 0; t < n; ++t)                                                                           \
                memcpy(cols + (t % gw * gh + t / gw) * dh, vb + t * v_st, sizeof(T) * dh);                            \
            for (int64_t e = 0; banded && e < n * dh; ++e)                                                            \
                banded = isfinite(cols[e]);                                                                           \
            for (int64_t iy = 0; iy < gh; ++iy) {                                                                     \
                /* column pass, U[:, k] for each column k: the y-rows of the tokens (iy, k) (steered: built here,     \
                   the tokens along the lanes, cp apart; fixed: row iy of the field's table, atoms Gh * Gh apart) */  \
                int64_t gi = ((bi * n + iy * gw) * heads + h) * r, cp = SSOG_LANES(gw); /* token (iy, 0) */           \
                if (!ky)                                                                                              \
                    ROWS(tab, mu + 2 * gi, s + 2 * gi, NULL, 2, 2 * heads * r, 0, gw, (int)iy, 0, (int)gh, r);        \
                int64_t ya = ky ? gh * gh : gh * cp, ys = ky ? 1 : cp, xa = ky ? r * gw : 1, xs = ky ? 1 : cp;       \
                for (int64_t k = 0; k < gw; ++k) { /* the y-rows' band: the union of the atoms' */                    \
                    int64_t lo = 0, hi = gh;                                                                          \
                    if (banded)                                                                                       \
                        band_union(ky ? by + (h * r * gh + iy) * 2 : by + (gi + k * heads * r) * 4, ky ? gh * 2 : 4,  \
                                   r, &lo, &hi);                                                                      \
                    GEMM(u + k * dh, gw * dh, (ky ? ky + (h * r * gh + iy) * gh : tab + k) + lo * ys, ya, ys,         \
                         cols + (k * gh + lo) * dh, dh, r, hi - lo, dh, 0);                                           \
                }                                                                                                     \
                /* row pass: the weighted x-rows of the queries (iy, ix) */                                           \
                if (!ky)                                                                                              \
                    ROWS(tab, mu + 2 * gi + 1, s + 2 * gi + 1, lam + gi, 2, 2 * heads * r, heads * r, gw, 0, 1,       \
                         (int)gw, r);                                                                                 \
                const T *wrow = ky ? wx + h * gw * r * gw : tab;                                                      \
                if (!banded)                                                                                          \
                    GEMM(mixed + iy * gw * dh, dh, wrow, xa, xs, u, dh, gw, r * gw, dh, 0);                           \
                for (int64_t ri = 0; banded && ri < r; ++ri) /* per atom, 4 queries at a time: their bands' union */  \
                    for (int64_t ix = 0; ix < gw; ix += 4) {                                                          \
                        int64_t lo, hi, m = gw - ix < 4 ? gw - ix : 4;                                                \
                        band_union(ky ? bx + ((h * r + ri) * gw + ix) * 2 : bx + (gi + ix * heads * r + ri) * 4,      \
                                   ky ? 2 : heads * r * 4, m, &lo, &hi);                                              \
                        GEMM(mixed + (iy * gw + ix) * dh, dh, wrow + ix * xa + (ri * gw + lo) * xs, xa, xs,           \
                             u + (ri * gw + lo) * dh, dh, m, hi - lo, dh, ri > 0);                                    \
                    }                                                                                                 \
            }                                                                                                         \
            T *ob = out + bi * o_sb + p * o_st + h * dh;                                                              \
            for (int64_t t = 0; t < n; ++t)                                                                           \
                memcpy(ob + t * o_st, mixed + t * dh, sizeof(T) * dh);                                                \
        SSOG_UNITS_END                                                                                                \
    }

/* c[i ldc + j cs] (+)= sum_d a[i lda + d] b[j ldb + d] for i < m, j < nn, d < kk (long: the fixed backward's
 * dL/dKyl = G U^T over a row of queries). Tiles of 4 rows of a by NT_J rows of b keep 4 NT_J vector accumulators in
 * registers while d goes by (a tile at an edge repeats its last row and stores only its own), the lanes are summed
 * at the end, the last kk % W terms one by one. */
#if VEC_BYTES == 64
#define NT_J 4 /* 16 accumulators of the 32 AVX-512 registers */
#else
#define NT_J 2
#endif
#define SSOG_GEMM_NT(NAME, T, VEC)                                                                                \
    static inline void NAME(T *c, int64_t ldc, int64_t cs, const T *a, int64_t lda, const T *b, int64_t ldb,      \
                            int64_t m, int64_t nn, int64_t kk, int add) {                                         \
        typedef VEC vec;                                                                                              \
        enum { W = VEC_BYTES / sizeof(T) };                                                                           \
        int64_t kv = kk / W * W;                                                                                  \
        for (int64_t i0 = 0; i0 < m; i0 += 4) {                                                                   \
            int64_t mi = m - i0 < 4 ? m - i0 : 4;                                                                 \
            const T *ra[4];                                                                                       \
            for (int i = 0; i < 4; ++i)                                                                           \
                ra[i] = a + (i0 + (i < mi ? i : mi - 1)) * lda;                                                   \
            for (int64_t j0 = 0; j0 < nn; j0 += NT_J) {                                                           \
                int64_t nj = nn - j0 < NT_J ? nn - j0 : NT_J;                                                     \
                const T *rb[NT_J];                                                                                \
                for (int j = 0; j < NT_J; ++j)                                                                    \
                    rb[j] = b + (j0 + (j < nj ? j : nj - 1)) * ldb;                                               \
                vec acc[4][NT_J] = {{{0}}};                                                                       \
                for (int64_t d = 0; d < kv; d += W) {                                                             \
                    vec y[NT_J];                                                                                  \
                    for (int j = 0; j < NT_J; ++j)                                                                \
                        y[j] = *(const vec *)(rb[j] + d);                                                         \
                    for (int i = 0; i < 4; ++i) {                                                                 \
                        vec x = *(const vec *)(ra[i] + d);                                                        \
                        for (int j = 0; j < NT_J; ++j)                                                            \
                            acc[i][j] += x * y[j];                                                                \
                    }                                                                                                 \
                }                                                                                                     \
                for (int64_t i = 0; i < mi; ++i)                                                                  \
                    for (int64_t j = 0; j < nj; ++j) {                                                            \
                        T sum = 0;                                                                                \
                        for (int l = 0; l < W; ++l)                                                               \
                            sum += acc[i][j][l];                                                                  \
                        for (int64_t d = kv; d < kk; ++d)                                                         \
                            sum += ra[i][d] * rb[j][d];                                                           \
                        T *o = c + (i0 + i) * ldc + (j0 + j) * cs;                                                \
                        *o = add ? *o + sum : sum;                                                                \
                    }                                                                                                 \
            }                                                                                                         \
        }                                                                                                             \
    }

/* c[i ldc + j] (+)= sum_d a[i lda + d] b[j ldb + d] for i < m, j < nn, d < kk when kk is short (a head's width):
 * b transposed into `scratch` (kk rows of P = nn rounded up to a vector, zero-padded), so that the product is one
 * GEMM whose vectors run along j; `scratch`: SSOG_BT_SCRATCH(m, nn, kk) numbers. (Dot products this short spend
 * more time summing their vectors' lanes than multiplying.) */
#define SSOG_BT_SCRATCH(m, nn, kk) (((nn) + 64) * ((kk) + (m)))
#define SSOG_GEMM_BT(NAME, GEMM, T)                                                                                   \
    static inline void NAME(T *c, int64_t ldc, const T *a, int64_t lda, const T *b, int64_t ldb, int64_t m,           \
                            int64_t nn, int64_t kk, int add, T *scratch) {                                            \
        enum { W = VEC_BYTES / sizeof(T) };                                                                           \
        int64_t p = (nn + W - 1) / W * W;                                                                             \
        T *bt = scratch, *ct = scratch + kk * p;                                                                      \
        for (int64_t d = 0; d < kk; ++d) {                                                                            \
            for (int64_t j = 0; j < nn; ++j)                                                                          \
                bt[d * p + j] = b[j * ldb + d];                                                                       \
            for (int64_t j = nn; j < p; ++j)                                                                          \
                bt[d * p + j] = 0;                                                                                    \
        }                                                                                                             \
        GEMM(ct, p, a, lda, 1, bt, p, m, kk, p, 0);                                                                   \
        for (int64_t i = 0; i < m; ++i)                                                                               \
            for (int64_t j = 0; j < nn; ++j)                                                                          \
                c[i * ldc + j] = add ? c[i * ldc + j] + ct[i * p + j] : ct[i * p + j];                                \
    }

/* Backward of one kernel row K = softmax_j(-(d_j s)^2), d_j = (j - q) - mu, given g = dL/dK (K's entries `ks` apart,
 * g's contiguous): with t_j = K_j (g_j - sum_i K_i g_i) d_j, dL/dmu = 2 s^2 sum_j t_j and dL/ds = -2 s sum_j t_j d_j
 * (the arithmetic of backends._common.gaussian_rows_grad; flushed entries are zero in K and pass nothing). */
#define SSOG_ROW_GRAD(NAME, T)                                                                                        \
    static inline void NAME(const T *k, int64_t ks, const T *g, int q, int n, T mu, T s, T *g_mu, T *g_s) {           \
        T dot = 0, sm = 0, ss = 0;                                                                                    \
        for (int j = 0; j < n; ++j)                                                                                   \
            dot += k[j * ks] * g[j];                                                                                  \
        for (int j = 0; j < n; ++j) {                                                                                 \
            T d = (T)(j - q) - mu, t = k[j * ks] * (g[j] - dot) * d;                                                  \
            sm += t;                                                                                                  \
            ss += t * d;                                                                                              \
        }                                                                                                             \
        *g_mu = 2 * s * s * sm;                                                                                       \
        *g_s = -2 * s * ss;                                                                                           \
    }

/* Gradients of the steered mixing (docs/operator.md, "Backward"), one (image, head) at a time, each row of queries
 * recomputing its tables (laid out as SSOG_QUERY_ROWS builds them) and U: with W = lam K^x and G = dL/dout,
 * dL/dW = G U^T, dL/dU = W^T G, dL/dlam = sum_k dL/dW K^x, dL/dK^x = lam dL/dW, dL/dK^y = dL/dU V^T,
 * dL/dV = K^y^T dL/dU. Arguments as in ssog_mix_*, plus g (dL/dout, rows `g_st` and images `g_sb` apart), gv (dL/dV
 * of the patch rows, written; rows `gv_st`, images `gv_sb` apart) and g_mu, g_s, g_lam (shaped as mu, s, lam,
 * written). `band`: the steered bands of ssog_mix_* as one array (B, N, H, R, 2, 2), or NULL: each product then
 * reads only the entries of the bands, the column pass and dL/dK^y the union of the atoms' y-bands of a token, dL/dW
 * and dL/dU the queries whose x-band (of an atom) holds one of four sources k, and the tables' gradients are zero
 * outside the bands (docs/operator.md, "Bands"); a head whose values or output gradient are not all finite is
 * differentiated whole. `work`: ssog_mix_grad_work(...) numbers per thread. */
int64_t ssog_mix_grad_work(int64_t gh, int64_t gw, int64_t r, int64_t dh) {
    int64_t rg = r * gw, cp = SSOG_LANES(gw), py = SSOG_LANES(gh);
    return 2 * gh * gw * dh + gw * dh * py + 2 * rg * dh + gw * dh + r * gh * cp + r * py + 3 * rg * cp +
           SSOG_BT_SCRATCH(rg, gw, dh) + 2 * rg;
}

#define SSOG_MIX_GRAD(NAME, ROWS, GEMM, GEMM_BT, ROW_GRAD, T, VEC, INTS, TINY)                                        \
    void NAME(const T *v, const T *g, T *gv, const T *mu, const T *s, const T *lam, const int32_t *band, T *g_mu,     \
              T *g_s, T *g_lam, T *work, int64_t threads, int64_t b, int64_t v_sb, int64_t v_st, int64_t g_sb,        \
              int64_t g_st, int64_t gv_sb, int64_t gv_st, int64_t p, int64_t gh, int64_t gw, int64_t heads,           \
              int64_t r, int64_t dh) {                                                                                \
        int64_t n = gh * gw, units = b * heads, size = ssog_mix_grad_work(gh, gw, r, dh), rg = r * gw;                \
        int64_t cp = SSOG_LANES(gw), py = SSOG_LANES(gh), qs = heads * r, macs = 3 * n * r * (gh + gw) * dh;          \
        typedef VEC vec;                                                                                              \
        typedef INTS ints;                                                                                            \
        enum { L = VEC_BYTES / sizeof(T) };                                                                           \
        int64_t pw = (gw + L - 1) / L * L;                                                                            \
        SSOG_UNITS_BEGIN                                                                                              \
            int64_t bi = unit / heads, h = unit % heads, lo, hi;                                                      \
            /* the head's values column by column, and each column transposed (dh rows of py, zero-padded) */         \
            T *cols = work + omp_get_thread_num() * size, *gcols = cols + n * dh, *colt = gcols + n * dh;             \
            T *u = colt + gw * dh * py, *gu = u + rg * dh, *gq = gu + rg * dh, *ky = gq + gw * dh;                    \
            T *gky = ky + r * gh * cp, *kx = gky + r * py, *w = kx + rg * cp, *gwq = w + rg * cp;                     \
            T *scratch = gwq + rg * cp;                                                                               \
            int32_t *xcol = (int32_t *)(scratch + SSOG_BT_SCRATCH(rg, gw, dh));                                       \
            const T *vb = v + bi * v_sb + p * v_st + h * dh, *gb = g + bi * g_sb + p * g_st + h * dh;                 \
            for (int64_t t = 0; t < n; ++t)                                                                           \
                memcpy(cols + (t % gw * gh + t / gw) * dh, vb + t * v_st, sizeof(T) * dh);                            \
            int banded = band != NULL;                                                                                \
            for (int64_t t = 0; banded && t < n; ++t) /* every value (cols holds them all) and dL/dout */             \
                for (int64_t d = 0; banded && d < dh; ++d)                                                            \
                    banded = isfinite(cols[t * dh + d]) && isfinite(gb[t * g_st + d]);                                \
            memset(colt, 0, sizeof(T) * gw * dh * py);                                                                \
            for (int64_t k = 0; k < gw; ++k)                                                                          \
                for (int64_t jy = 0; jy < gh; ++jy)                                                                   \
                    for (int64_t d = 0; d < dh; ++d)                                                                  \
                        colt[(k * dh + d) * py + jy] = cols[(k * gh + jy) * dh + d];                                  \
            memset(gcols, 0, sizeof(T) * n * dh);                                                                     \
            for (int64_t iy = 0; iy < gh; ++iy) {                                                                     \
                int64_t gi = ((bi * n + iy * gw) * heads + h) * r; /* token (iy, 0) */                                \
                ROWS(ky, mu + 2 * gi, s + 2 * gi, NULL, 2, 2 * qs, 0, gw, (int)iy, 0, (int)gh, r);                    \
                for (int64_t k = 0; k < gw; ++k) { /* U, within the union of the atoms' y-bands of token (iy, k) */   \
                    lo = 0, hi = gh;                                                                                  \
                    if (banded)                                                                                       \
                        band_union(band + (gi + k * qs) * 4, 4, r, &lo, &hi);                                         \
                    GEMM(u + k * dh, gw * dh, ky + k + lo * cp, gh * cp, cp, cols + (k * gh + lo) * dh, dh, r,        \
                         hi - lo, dh, 0);                                                                             \
                }                                                                                                     \
                ROWS(kx, mu + 2 * gi + 1, s + 2 * gi + 1, NULL, 2, 2 * qs, 0, gw, 0, 1, (int)gw, r);                  \
                for (int64_t ri = 0; ri < r; ++ri) /* W = lam K^x, flushed */                                         \
                    for (int64_t k = 0; k < gw; ++k)                                                                  \
                        for (int64_t ix = 0; ix < gw; ++ix) {                                                         \
                            T x = kx[(ri * gw + k) * cp + ix] * lam[gi + ix * qs + ri];                               \
                            w[(ri * gw + k) * cp + ix] = x <= TINY ? (T)0 : x;                                        \
                        }                                                                                             \
                for (int64_t ix = 0; ix < gw; ++ix)                                                                   \
                    memcpy(gq + ix * dh, gb + (iy * gw + ix) * g_st, sizeof(T) * dh);                                 \
                if (!banded) {                                                                                        \
                    GEMM_BT(gwq, cp, u, dh, gq, dh, rg, gw, dh, 0, scratch); /* dL/dW, laid out as W */               \
                    GEMM(gu, dh, w, cp, 1, gq, dh, rg, gw, dh, 0);           /* dL/dU = W^T G (R Gw, dh) */           \
                } else { /* four sources k of an atom at a time, the queries ix whose x-band holds one of them */     \
                    T *gt = scratch; /* G transposed (dh rows of pw), so that dL/dW runs along the queries */         \
                    for (int64_t d = 0; d < dh; ++d)                                                                  \
                        for (int64_t ix = 0; ix < pw; ++ix)                                                           \
                            gt[d * pw + ix] = ix < gw ? gq[ix * dh + d] : (T)0;                                       \
                    memset(gwq, 0, sizeof(T) * rg * cp);                                                              \
                    for (int64_t ri = 0; ri < r; ++ri)                                                                \
                        band_columns(band + (gi + ri) * 4 + 2, qs * 4, gw, gw, xcol + ri * gw * 2, 0);                \
                    for (int64_t ri = 0; ri < r; ++ri)                                                                \
                        for (int64_t k = 0; k < gw; k += 4) {                                                         \
                            int64_t m = gw - k < 4 ? gw - k : 4, at = ri * gw + k;                                    \
                            column_union(xcol + at * 2, m, &lo, &hi);                                                 \
                            GEMM(gu + at * dh, dh, w + at * cp + lo, cp, 1, gq + lo * dh, dh, m, hi - lo, dh, 0);     \
                            band_widen(&lo, &hi, pw, L);                                                              \
                            GEMM(gwq + at * cp + lo, cp, u + at * dh, dh, 1, gt + lo, pw, m, dh, hi - lo, 0);         \
                        }                                                                                             \
                }                                                                                                     \
                for (int64_t ri = 0; ri < r; ++ri) /* the queries (iy, ix), a vector at a time: weights, x-rows */    \
                    for (int64_t c0 = 0; c0 < cp; c0 += L) {                                                          \
                        vec lv, mv, sv, gl = {0}, dot = {0}, sm = {0}, ss = {0};                                      \
                        ints q;                                                                                       \
                        for (int l = 0; l < L; ++l) {                                                                 \
                            int64_t at = gi + (c0 + l < gw ? c0 + l : gw - 1) * qs + ri;                              \
                            q[l] = (int)(c0 + l), lv[l] = lam[at], mv[l] = mu[2 * at + 1], sv[l] = s[2 * at + 1];     \
                        }                                                                                             \
                        const T *kr = kx + ri * gw * cp + c0;                                                         \
                        T *gk = gwq + ri * gw * cp + c0;                                                              \
                        for (int64_t k = 0; k < gw; ++k) { /* dL/dlam, and dL/dK^x = lam dL/dW, stored: the sum       \
                            below must see the rounded products the dot product saw (a fused multiply-add there      \
                            would not, and the cancellation in g - dot would keep the difference) */                 \
                            vec kv = *(const vec *)(kr + k * cp), gv = *(vec *)(gk + k * cp);                         \
                            gl += gv * kv;                                                                            \
                            *(vec *)(gk + k * cp) = gv * lv;                                                          \
                        }                                                                                             \
                        for (int64_t k = 0; k < gw; ++k)                                                              \
                            dot += *(const vec *)(kr + k * cp) * *(const vec *)(gk + k * cp);                         \
                        for (int64_t k = 0; k < gw; ++k) { /* the row's backward (ROW_GRAD, lane-wise) */             \
                            vec kv = *(const vec *)(kr + k * cp), gv = *(const vec *)(gk + k * cp);                   \
                            vec d = __builtin_convertvector((int)k - q, vec) - mv, t = kv * (gv - dot) * d;           \
                            sm += t;                                                                                  \
                            ss += t * d;                                                                              \
                        }                                                                                             \
                        for (int l = 0; l < L && c0 + l < gw; ++l) {                                                  \
                            int64_t at = gi + (c0 + l) * qs + ri;                                                     \
                            g_lam[at] = gl[l];                                                                        \
                            g_mu[2 * at + 1] = 2 * sv[l] * sv[l] * sm[l];                                             \
                            g_s[2 * at + 1] = -2 * sv[l] * ss[l];                                                     \
                        }                                                                                             \
                    }                                                                                                 \
                for (int64_t k = 0; k < gw; ++k) { /* the tokens (iy, k): their y-rows, and dL/dV */                  \
                    lo = 0, hi = gh;                                                                                  \
                    int64_t wlo = 0, whi = py;                                                                        \
                    if (banded) { /* the union of the atoms' y-bands, as in the column pass */                        \
                        band_union(band + (gi + k * qs) * 4, 4, r, &lo, &hi);                                         \
                        wlo = lo, whi = hi;                                                                           \
                        band_widen(&wlo, &whi, py, L);                                                                \
                        memset(gky, 0, sizeof(T) * r * py);                                                           \
                    }                                                                                                 \
                    GEMM(gky + wlo, py, gu + k * dh, gw * dh, 1, colt + k * dh * py + wlo, py, r, dh, whi - wlo, 0);  \
                    GEMM(gcols + (k * gh + lo) * dh, dh, ky + k + lo * cp, cp, gh * cp, gu + k * dh, gw * dh,         \
                         hi - lo, r, dh, 1);                                                                          \
                    for (int64_t ri = 0; ri < r; ++ri) {                                                              \
                        int64_t at = gi + k * qs + ri;                                                                \
                        ROW_GRAD(ky + ri * gh * cp + k, cp, gky + ri * py, (int)iy, (int)gh, mu[2 * at], s[2 * at],   \
                                 g_mu + 2 * at, g_s + 2 * at);                                                        \
                    }                                                                                                 \
                }                                                                                                     \
            }                                                                                                         \
            T *ob = gv + bi * gv_sb + p * gv_st + h * dh;                                                             \
            for (int64_t t = 0; t < n; ++t)                                                                           \
                memcpy(ob + t * gv_st, gcols + (t % gw * gh + t / gw) * dh, sizeof(T) * dh);                          \
        SSOG_UNITS_END                                                                                                \
    }

/* The fixed field's axis kernels (core.axis_kernels): K[a, i, j] for `atoms` rows of atoms a (centre mu[a], scale
 * s[a]; the fixed field has one per head and atom) and i, j < n, each atom's table built as SSOG_QUERY_ROWS builds it
 * (its n queries i along the lanes), then written out row by row; `work`: ssog_axis_kernels_work(n) numbers. */
int64_t ssog_axis_kernels_work(int64_t n) {
    return n * SSOG_LANES(n);
}

#define SSOG_AXIS_KERNELS(NAME, ROWS, T)                                                                              \
    void NAME(const T *mu, const T *s, T *out, T *work, int64_t atoms, int64_t n) {                                   \
        int64_t cp = SSOG_LANES(n);                                                                                   \
        unsigned csr = ftz_enter();                                                                                   \
        for (int64_t a = 0; a < atoms; ++a) {                                                                         \
            ROWS(work, mu + a, s + a, NULL, 0, 0, 0, n, 0, 1, (int)n, 1);                                             \
            for (int64_t i = 0; i < n; ++i)                                                                           \
                for (int64_t j = 0; j < n; ++j)                                                                       \
                    out[(a * n + i) * n + j] = work[j * cp + i];                                                      \
        }                                                                                                             \
        ftz_leave(csr);                                                                                               \
    }

/* Their backward: dL/dmu[a] and dL/ds[a] given g = dL/dK (contiguous as K), the sums over the rows i of ROW_GRAD. */
#define SSOG_AXIS_KERNELS_GRAD(NAME, ROW_GRAD, T)                                                                     \
    void NAME(const T *k, const T *g, const T *mu, const T *s, T *g_mu, T *g_s, int64_t atoms, int64_t n) {           \
        for (int64_t a = 0; a < atoms; ++a) {                                                                         \
            T sum_mu = 0, sum_s = 0;                                                                                  \
            for (int64_t i = 0; i < n; ++i) {                                                                         \
                T dm, ds;                                                                                             \
                ROW_GRAD(k + (a * n + i) * n, 1, g + (a * n + i) * n, (int)i, (int)n, mu[a], s[a], &dm, &ds);         \
                sum_mu += dm, sum_s += ds;                                                                            \
            }                                                                                                         \
            g_mu[a] = sum_mu, g_s[a] = sum_s;                                                                         \
        }                                                                                                             \
    }

/* Gradients of the fixed mixing (docs/operator.md, "Backward"), one (image, head) at a time and, within it, one source
 * row jy at a time, the x-pass recomputed: with Kyl = lam K^y (H, R, Gh, Gh) as `kyl`, K^x (H, R, Gw, Gw) as `kx`
 * (both contiguous) and G = dL/dout, U = K^x V[jy], dL/dKyl[r, :, jy] = G U[r]^T, dL/dU[r] = sum_iy Kyl[r, iy, jy]
 * G[iy], dL/dK^x += dL/dU V[jy]^T, dL/dV[jy] = K^x^T dL/dU (G and U read as (Gh, Gw dh) and (R, Gw dh)). Values and
 * gradients as in ssog_mix_grad_*; g_kyl (B, H, R, Gh, Gh) and g_kx (B, H, R, Gw, Gw), zero on entry, are written
 * per image (the caller sums them, so that the result does not depend on the number of threads). Bands as in
 * ssog_mix_* (fixed: `by`, `bx`, or NULL): each product then reads only the entries of the bands, and the tables'
 * gradients are written within them only (docs/operator.md, "Bands": what consumes them multiplies them by the
 * table's entries, so this is only for a field's own tables); a head whose values or output gradient are not all
 * finite is differentiated whole. `work`: ssog_fixed_grad_work(...) numbers per thread. */
int64_t ssog_fixed_grad_work(int64_t gh, int64_t gw, int64_t r, int64_t dh) {
    return 3 * gh * gw * dh + 2 * r * gw * dh + SSOG_BT_SCRATCH(r * gw, gw, dh) + 2 * (r * gw + gh);
}

#define SSOG_FIXED_GRAD(NAME, GEMM, GEMM_NT, GEMM_BT, T)                                                              \
    void NAME(const T *v, const T *g, T *gv, const T *kyl, const T *kx, const int32_t *by, const int32_t *bx,         \
              T *g_kyl, T *g_kx, T *work, int64_t threads, int64_t b, int64_t v_sb, int64_t v_st, int64_t g_sb,       \
              int64_t g_st, int64_t gv_sb, int64_t gv_st, int64_t p, int64_t gh, int64_t gw, int64_t heads,           \
              int64_t r, int64_t dh) {                                                                                \
        int64_t n = gh * gw, units = b * heads, size = ssog_fixed_grad_work(gh, gw, r, dh), rg = r * gw;              \
        int64_t row = gw * dh, macs = n * r * (3 * gw + 2 * gh) * dh;                                                 \
        enum { W = VEC_BYTES / sizeof(T) };                                                                           \
        int64_t pw = (gw + W - 1) / W * W;                                                                            \
        SSOG_UNITS_BEGIN                                                                                              \
            int64_t bi = unit / heads, h = unit % heads;                                                              \
            T *vr = work + omp_get_thread_num() * size, *gr = vr + n * dh, *gvr = gr + n * dh;                        \
            T *u = gvr + n * dh, *gu = u + rg * dh, *scratch = gu + rg * dh;                                          \
            int32_t *xcol = (int32_t *)(scratch + SSOG_BT_SCRATCH(rg, gw, dh)), *ycol = xcol + 2 * rg;                \
            const T *vb = v + bi * v_sb + p * v_st + h * dh, *gb = g + bi * g_sb + p * g_st + h * dh;                 \
            for (int64_t t = 0; t < n; ++t) { /* the head's values and output gradient, in raster order */            \
                memcpy(vr + t * dh, vb + t * v_st, sizeof(T) * dh);                                                   \
                memcpy(gr + t * dh, gb + t * g_st, sizeof(T) * dh);                                                   \
            }                                                                                                         \
            int banded = by != NULL;                                                                                  \
            for (int64_t e = 0; banded && e < n * dh; ++e)                                                            \
                banded = isfinite(vr[e]) && isfinite(gr[e]);                                                          \
            const int32_t *by_h = banded ? by + h * r * gh * 2 : NULL, *bx_h = banded ? bx + h * rg * 2 : NULL;       \
            for (int64_t ri = 0; banded && ri < r; ++ri) { /* the rows iy (any atom), queries ix holding a column */  \
                band_columns(by_h + ri * gh * 2, 2, gh, gh, ycol, ri > 0);                                            \
                band_columns(bx_h + ri * gw * 2, 2, gw, gw, xcol + ri * gw * 2, 0);                                   \
            }                                                                                                         \
            const T *kyl_h = kyl + h * r * gh * gh, *kx_h = kx + h * rg * gw;                                         \
            T *gkyl = g_kyl + unit * r * gh * gh, *gkx = g_kx + unit * rg * gw;                                       \
            for (int64_t jy = 0; jy < gh; ++jy) {                                                                     \
                const T *vj = vr + jy * row;                                                                          \
                if (!banded) {                                                                                        \
                    GEMM(u, dh, kx_h, gw, 1, vj, dh, rg, gw, dh, 0);                 /* U = K^x V[jy] (R Gw, dh) */   \
                    GEMM_NT(gkyl + jy, gh, gh * gh, gr, row, u, row, gh, r, row, 0); /* dL/dKyl[:, :, jy] */          \
                    GEMM(gu, row, kyl_h + jy, gh * gh, gh, gr, row, r, gh, row, 0); /* dL/dU (R, Gw dh) */            \
                    GEMM_BT(gkx, gw, gu, dh, vj, dh, rg, gw, dh, 1, scratch);       /* dL/dK^x (R Gw, Gw) */          \
                    GEMM(gvr + jy * row, dh, kx_h, 1, gw, gu, dh, gw, rg, dh, 0);   /* dL/dV[jy] (Gw, dh) */          \
                    continue;                                                                                         \
                }                                                                                                     \
                int64_t lo, hi;                                                                                       \
                for (int64_t ri = 0; ri < r; ++ri) /* U, per atom and four queries ix: the union of their bands */    \
                    for (int64_t ix = 0; ix < gw; ix += 4) {                                                          \
                        int64_t m = gw - ix < 4 ? gw - ix : 4, at = ri * gw + ix;                                     \
                        band_union(bx_h + at * 2, 2, m, &lo, &hi);                                                    \
                        GEMM(u + at * dh, dh, kx_h + at * gw + lo, gw, 1, vj + lo * dh, dh, m, hi - lo, dh, 0);       \
                    }                                                                                                 \
                column_union(ycol + 2 * jy, 1, &lo, &hi); /* the rows iy whose band (any atom) holds jy */            \
                GEMM_NT(gkyl + lo * gh + jy, gh, gh * gh, gr + lo * row, row, u, row, hi - lo, r, row, 0);            \
                GEMM(gu, row, kyl_h + lo * gh + jy, gh * gh, gh, gr + lo * row, row, r, hi - lo, row, 0);             \
                T *vt = scratch; /* V[jy] transposed (dh rows of pw), so that dL/dK^x runs along the bands */         \
                for (int64_t d = 0; d < dh; ++d)                                                                      \
                    for (int64_t j = 0; j < pw; ++j)                                                                  \
                        vt[d * pw + j] = j < gw ? vj[j * dh + d] : (T)0;                                              \
                for (int64_t ri = 0; ri < r; ++ri)                                                                    \
                    for (int64_t ix = 0; ix < gw; ix += 4) {                                                          \
                        int64_t m = gw - ix < 4 ? gw - ix : 4, at = ri * gw + ix;                                     \
                        band_union(bx_h + at * 2, 2, m, &lo, &hi);                                                    \
                        band_widen(&lo, &hi, gw, W);                                                                  \
                        GEMM(gkx + at * gw + lo, gw, gu + at * dh, dh, 1, vt + lo, pw, m, dh, hi - lo, 1);            \
                    }                                                                                                 \
                for (int64_t ri = 0; ri < r; ++ri) /* dL/dV[jy], four columns jx at a time: the queries ix reading    \
                                                      one of them */                                                  \
                    for (int64_t jx = 0; jx < gw; jx += 4) {                                                          \
                        int64_t m = gw - jx < 4 ? gw - jx : 4;                                                        \
                        column_union(xcol + (ri * gw + jx) * 2, m, &lo, &hi);                                         \
                        GEMM(gvr + (jy * gw + jx) * dh, dh, kx_h + (ri * gw + lo) * gw + jx, 1, gw,                   \
                             gu + (ri * gw + lo) * dh, dh, m, hi - lo, dh, ri > 0);                                   \
                    }                                                                                                 \
            }                                                                                                         \
            T *ob = gv + bi * gv_sb + p * gv_st + h * dh;                                                             \
            for (int64_t t = 0; t < n; ++t)                                                                           \
                memcpy(ob + t * gv_st, gvr + t * dh, sizeof(T) * dh);                                                 \
        SSOG_UNITS_END                                                                                                \
    }

/* LOW: log(FLT_MIN), log(DBL_MIN) */
SSOG_QUERY_ROWS(query_rows_f32, float, f32_vec, f32_mask, f32_ints, expf, FLT_MAX, FLT_MIN, -87.33654f)
SSOG_QUERY_ROWS(query_rows_f64, double, f64_vec, f64_mask, f64_ints, exp, DBL_MAX, DBL_MIN, -708.3964)
SSOG_GEMM(gemm_f32, float, f32_vec)
SSOG_GEMM(gemm_f64, double, f64_vec)
SSOG_GEMM_NT(gemm_nt_f32, float, f32_vec)
SSOG_GEMM_NT(gemm_nt_f64, double, f64_vec)
SSOG_GEMM_BT(gemm_bt_f32, gemm_f32, float)
SSOG_GEMM_BT(gemm_bt_f64, gemm_f64, double)
SSOG_ROW_GRAD(row_grad_f32, float)
SSOG_ROW_GRAD(row_grad_f64, double)
SSOG_MIX(ssog_mix_f32, query_rows_f32, gemm_f32, float)
SSOG_MIX(ssog_mix_f64, query_rows_f64, gemm_f64, double)
SSOG_MIX_GRAD(ssog_mix_grad_f32, query_rows_f32, gemm_f32, gemm_bt_f32, row_grad_f32, float, f32_vec, f32_ints,
              FLT_MIN)
SSOG_MIX_GRAD(ssog_mix_grad_f64, query_rows_f64, gemm_f64, gemm_bt_f64, row_grad_f64, double, f64_vec, f64_ints,
              DBL_MIN)
SSOG_FIXED_GRAD(ssog_fixed_grad_f32, gemm_f32, gemm_nt_f32, gemm_bt_f32, float)
SSOG_FIXED_GRAD(ssog_fixed_grad_f64, gemm_f64, gemm_nt_f64, gemm_bt_f64, double)
SSOG_AXIS_KERNELS(ssog_axis_kernels_f32, query_rows_f32, float)
SSOG_AXIS_KERNELS(ssog_axis_kernels_f64, query_rows_f64, double)
SSOG_AXIS_KERNELS_GRAD(ssog_axis_kernels_grad_f32, row_grad_f32, float)
SSOG_AXIS_KERNELS_GRAD(ssog_axis_kernels_grad_f64, row_grad_f64, double)
