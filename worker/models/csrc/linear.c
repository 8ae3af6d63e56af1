/* A linear layer for steps of few rows, on weights packed in column panels (docs/design.md §19).
 *
 *   y[m][n] = sum_k x[m][k] * W[n][k] (+ bias[n])      for m < M, n < N
 *
 * The weight is packed once as panels of NR = 16 output columns: panel j holds
 * W[16j .. 16j+15][k] for k = 0 .. K-1, k-major (16 consecutive floats per k), the last panel
 * zero-padded; the bias is padded to a whole panel too. A tile of up to MR = 6 input rows walks
 * one panel once: per k, two 8-float loads of the panel, one broadcast of each row's x[m][k]
 * and two fused multiply-adds per row into 12 accumulators (16 vector registers on AVX2). The
 * weight streams from memory once per step (the rows of one panel reuse it from the L2 cache),
 * with no horizontal sums; tiles of one or two rows keep two or four accumulator sets over
 * alternating k so the adds do not wait on each other. Plain C with GCC vector extensions,
 * compiled -march=native. The sum over k runs in one order per accumulator set: results are
 * deterministic for a given row count, and equal a matmul's to float32 rounding.
 */
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32), aligned(4)));

#define NR 16
#define MR 6
#define PREFETCH_FLOATS 256 /* 1 KiB ahead in the panel */

static inline __attribute__((always_inline)) void tile(const int mr, const int sets,
                                                       const float *restrict x, int64_t ldx,
                                                       const float *restrict p, int64_t K,
                                                       const float *restrict bias, int nvalid,
                                                       float *restrict y, int64_t ldy)
{
    v8 lo[4][MR], hi[4][MR];
    for (int s = 0; s < sets; s++)
        for (int m = 0; m < mr; m++) {
            lo[s][m] = (v8){0};
            hi[s][m] = (v8){0};
        }
    int64_t k = 0;
    for (; k + sets <= K; k += sets)
        for (int s = 0; s < sets; s++) {
            const float *pk = p + (k + s) * NR;
            __builtin_prefetch(pk + PREFETCH_FLOATS);
            v8 b0 = *(const v8 *)pk, b1 = *(const v8 *)(pk + 8);
            for (int m = 0; m < mr; m++) {
                float xv = x[m * ldx + k + s];
                lo[s][m] += xv * b0;
                hi[s][m] += xv * b1;
            }
        }
    for (; k < K; k++) {
        const float *pk = p + k * NR;
        v8 b0 = *(const v8 *)pk, b1 = *(const v8 *)(pk + 8);
        for (int m = 0; m < mr; m++) {
            float xv = x[m * ldx + k];
            lo[0][m] += xv * b0;
            hi[0][m] += xv * b1;
        }
    }
    for (int m = 0; m < mr; m++) {
        v8 a = lo[0][m], b = hi[0][m];
        for (int s = 1; s < sets; s++) {
            a += lo[s][m];
            b += hi[s][m];
        }
        if (bias) {
            a += *(const v8 *)bias;
            b += *(const v8 *)(bias + 8);
        }
        if (nvalid == NR) {
            *(v8 *)(y + m * ldy) = a;
            *(v8 *)(y + m * ldy + 8) = b;
        } else {
            float out[NR];
            memcpy(out, &a, sizeof a);
            memcpy(out + 8, &b, sizeof b);
            memcpy(y + m * ldy, out, (size_t)nvalid * sizeof(float));
        }
    }
}

/* x: [M][ldx] (K used), panels: [ceil(N/16)][K][16], bias: NULL or [ceil(N/16) * 16],
 * y: [M][ldy] (N written). The rows are split into equal tiles of at most MR. */
void swaserve_panel_linear_f32(const float *x, int64_t M, int64_t ldx, const float *panels,
                               const float *bias, int64_t N, int64_t K, float *y, int64_t ldy)
{
    if (M <= 0)
        return;
    const int64_t n_panels = (N + NR - 1) / NR;
    const int64_t tiles = (M + MR - 1) / MR, per = (M + tiles - 1) / tiles;
    for (int64_t j = 0; j < n_panels; j++) {
        const float *p = panels + j * K * NR;
        const float *bj = bias ? bias + j * NR : NULL;
        const int nvalid = (int)(N - j * NR < NR ? N - j * NR : NR);
        for (int64_t m0 = 0; m0 < M; m0 += per) {
            const int64_t mr = M - m0 < per ? M - m0 : per;
            const float *xm = x + m0 * ldx;
            float *ym = y + m0 * ldy + j * NR;
            switch (mr) { /* constant row counts: each tile unrolled into registers */
            case 6: tile(6, 1, xm, ldx, p, K, bj, nvalid, ym, ldy); break;
            case 5: tile(5, 1, xm, ldx, p, K, bj, nvalid, ym, ldy); break;
            case 4: tile(4, 1, xm, ldx, p, K, bj, nvalid, ym, ldy); break;
            case 3: tile(3, 2, xm, ldx, p, K, bj, nvalid, ym, ldy); break;
            case 2: tile(2, 2, xm, ldx, p, K, bj, nvalid, ym, ldy); break;
            default: tile(1, 4, xm, ldx, p, K, bj, nvalid, ym, ldy); break;
            }
        }
    }
}
