/* The steered mixing's kernel tables on the CPU (docs/operator.md, "Backends"; compiled and loaded by
 * ssogvit/backends/cpu.py). One call builds the rows of a head chunk:
 *
 *     out[m, c, q, r, j] = lam * flush(softmax_j(-((j - q - mu) s)^2)),   then flushed again,
 *
 * with mu, s, lam = mu[m, c, q, r] etc. (lam = 1 when no weights are given) and flush(k) = 0 where k <= the type's
 * smallest normal number: the same arithmetic as ssogvit.ops.gaussian_rows followed, for the weighted rows, by
 * backends._common.flush_tiny_product. The inputs hold a contiguous (C, Q, R) block per m, blocks `stride_m` apart;
 * the output is contiguous. The R rows of one query are built together in cache, their exp as one vector loop. */
#include <float.h>
#include <math.h>
#include <stdint.h>

/* Tables at least this large are split between the OpenMP threads (the library links the libgomp that PyTorch has
 * already loaded, so torch.set_num_threads applies); smaller ones are not worth the hand-off. */
#define PARALLEL_ENTRIES 32768

#define SSOG_ROWS(NAME, T, EXP, MAX, HUGE, TINY, LOW)                                                            \
    void NAME(const T *mu, const T *s, const T *lam, T *out, int64_t stride_m, int64_t m_count, int64_t c,         \
              int64_t q, int64_t r) {                                                                             \
        int n = (int)q, block = (int)(r * q);                                                                     \
        _Pragma("omp parallel for schedule(static) if (m_count * c * q * r * q >= PARALLEL_ENTRIES)")            \
        for (int64_t t = 0; t < m_count * c * q; ++t) {                                                           \
            int64_t m = t / (c * q), ci = t / q % c;                                                              \
            int qi = (int)(t % q); /* int: AVX2 converts 32-bit ints to floats, not 64-bit ones */                \
            int64_t k0 = (ci * q + qi) * r, src = m * stride_m + k0;                                              \
            T *o = out + (m * c * q * r + k0) * q; /* the R rows of query qi, one after the other */             \
            for (int64_t ri = 0; ri < r; ++ri) { /* logits minus the row's largest, as the softmax does */      \
                T centre = mu[src + ri], sc = s[src + ri], top = -HUGE;                                           \
                T *row = o + ri * q;                                                                              \
                for (int j = 0; j < n; ++j) {                                                                     \
                    T z = ((T)(j - qi) - centre) * sc, logit = -(z * z);                                          \
                    row[j] = logit;                                                                               \
                    top = logit > top ? logit : top;                                                              \
                }                                                                                                 \
                for (int j = 0; j < n; ++j)                                                                       \
                    row[j] -= top;                                                                                \
            }                                                                                                     \
            /* exp over the R rows at once (long vectors); arguments below LOW, whose exp is below the type's    \
               smallest normal number, are clamped into exp's fast range and then zeroed */                       \
            for (int j = 0; j < block; ++j) {                                                                     \
                T x = o[j], e = EXP(MAX(x, LOW));                                                                 \
                o[j] = x < LOW ? (T)0 : e;                                                                        \
            }                                                                                                     \
            for (int64_t ri = 0; ri < r; ++ri) { /* normalise, flush, weight, flush */                           \
                T *row = o + ri * q, sum = 0, w = lam ? lam[src + ri] : (T)1;                                     \
                for (int j = 0; j < n; ++j)                                                                       \
                    sum += row[j];                                                                                \
                T inv = (T)1 / sum;                                                                               \
                for (int j = 0; j < n; ++j) {                                                                     \
                    T v = row[j] * inv;                                                                           \
                    v = (v <= TINY ? (T)0 : v) * w;                                                               \
                    row[j] = v <= TINY ? (T)0 : v;                                                                \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
    }

SSOG_ROWS(ssog_rows_f32, float, expf, fmaxf, FLT_MAX, FLT_MIN, -87.0f)
SSOG_ROWS(ssog_rows_f64, double, exp, fmax, DBL_MAX, DBL_MIN, -708.0)
