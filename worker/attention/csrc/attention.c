/* Attention over the paged KV pool, float32, for the CPU (docs/design.md §21).
 *
 * One call per layer for every query row of a step: row r reads the pool rows
 * slots[start[r] .. start[r] + count[r]) — a decode's whole view (already cut to the sliding
 * window), or one prefill query's causal, windowed part of its request's view. Every key and
 * value row (all KV heads of a slot, contiguous) is read straight from its slot, once per query
 * row: no gathered copy of the keys, no padding, no mask, and a sliding-window layer touches
 * only the window. Scores follow the HF eager order of the torch backend: (q . k) * scale, tanh
 * softcap, softmax in float32 with an optional sink logit per head in the denominator.
 *
 * Decode is bound by memory, not arithmetic: rows sit at scattered slots, so the hardware
 * prefetcher cannot run ahead. The key loop prefetches the key and value rows PREFETCH slots
 * ahead (values are then in cache for the second loop). Measured on one core, 12 layers of the
 * 46M Gemma-3 at batch 32 (62 MB of KV a step): 6.8 ms a step per KV head at a time without
 * prefetching, 3.0 ms like this (~20 GB/s).
 *
 * Prefill is bound by arithmetic instead: neighbouring query rows of one request read almost the
 * same keys. Up to TILE such rows (their runs' union at most TILE keys longer than the longest
 * run) are attended as a block: per KV head the union's keys are copied once, transposed, and its
 * values once, contiguous; then RB rows at a time, over only the columns those rows read, scores
 * come RB rows x KV vectors of keys per pass in registers (each key vector loaded once for RB
 * rows, no horizontal sums), each row's softmax runs over its own run (the rest weighs 0), and
 * outputs come RB rows x OV vectors of values per pass (the sizes below, per vector unit).
 * Measured on one AVX-512 core, 8 query and 2 KV heads of 64, rows one by one -> blocks: 4 x 256
 * prefill rows of a sliding-window layer (127) 3.66 -> 1.55 ms, of a full layer 4.85 -> 2.28 ms;
 * 512 rows after a 2,048-token prefix ~42 -> 17 ms. On an AVX2-only core (a 2-core AMD EPYC VM,
 * CPU time) the AVX-512 sizes ran the full layer's 4 x 256 rows in 141 ms, the AVX sizes 11.5.
 *
 * Plain C on purpose: built at run time by the system compiler for this machine (-march=native)
 * and called through ctypes, it needs no torch headers (a torch C++ extension takes ~1 minute to
 * build; this takes a second). Head sizes 64, 128 and 256 get their own copy of the loop with
 * the size known to the compiler (unrolled dot products); others run the generic copy.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PREFETCH 6 /* rows ahead */
#define TILE 64    /* query rows per block at most */
#define MIN_TILE 4 /* fewer neighbouring rows are attended one by one */

/* The register blocks are sized to the target's vector registers: a block's accumulators, the
 * vectors it loads and a broadcast must all stay in registers, or every multiply-add goes
 * through the stack (with AVX-512's sizes on a 16-register AVX2 core, prefill ran ~12x slower).
 * VW floats a vector; RB rows a block; KV key vectors a score pass; OV value vectors an output
 * pass. AVX-512 (32 x 16 floats): 8 x 2 + 2 score, 8 x 4 + 4 output registers. AVX/AVX2 (16 x 8
 * floats) and the rest (SSE, NEON: at least 16 x 4 floats): 4 x 2 + 2 and 4 x 2 + 2. */
#if defined(__AVX512F__)
#define VW 16
#define RB 8
#define OV 4
#else
#if defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#define RB 4
#define OV 2
#endif
#define KV 2
#define UNION_ALIGN 16 /* the union's columns are padded to a multiple of this (>= VW) */

typedef float vf __attribute__((vector_size(VW * 4)));

static inline vf vf_load(const float *p)
{
    vf r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline void vf_store(float *p, vf x) { memcpy(p, &x, sizeof x); }

static inline __attribute__((always_inline)) void prefetch_row(const float *r, int64_t floats)
{
    for (int64_t x = 0; x < floats; x += 16) /* one 64-byte line */
        __builtin_prefetch(r + x, 0, 3);
}

/* One query row: hq query heads (g = hq / hkv per KV head) against the n keys of slots `sl`.
 * `scores` holds hq * n floats, `acc` hq * dv. Inlined into each size-specialised caller. */
static inline __attribute__((always_inline)) void attend(
    const float *q, const int64_t *sl, int64_t n, const float *k, const float *v,
    const int64_t hq, const int64_t hkv, const int64_t d, const int64_t dv, float scale,
    float softcap, const float *sinks, float *scores, float *acc, float *o)
{
    const int64_t g = hq / hkv, krow = hkv * d, vrow = hkv * dv;
    for (int64_t j = 0; j < PREFETCH && j < n; j++) prefetch_row(k + sl[j] * krow, krow);
    /* scores[h * n + j] = (q_h . k_j) * scale */
    for (int64_t j = 0; j < n; j++) {
        if (j + PREFETCH < n) {
            prefetch_row(k + sl[j + PREFETCH] * krow, krow);
            prefetch_row(v + sl[j + PREFETCH] * vrow, vrow);
        }
        const float *kr = k + sl[j] * krow;
        for (int64_t h = 0; h < hq; h++) {
            const float *qh = q + h * d, *kh = kr + (h / g) * d;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t x = 0; x < d; x++) dot += qh[x] * kh[x];
            scores[h * n + j] = dot * scale;
        }
    }
    for (int64_t h = 0; h < hq; h++) {
        float *s = scores + h * n;
        if (softcap > 0.0f)
            for (int64_t j = 0; j < n; j++) s[j] = tanhf(s[j] / softcap) * softcap;
        float top = s[0];
        for (int64_t j = 1; j < n; j++) top = s[j] > top ? s[j] : top;
        const float sink = sinks ? sinks[h] : 0.0f;
        if (sinks && sink > top) top = sink;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; j++) {
            s[j] = expf(s[j] - top);
            sum += s[j];
        }
        if (sinks) sum += expf(sink - top);
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < n; j++) s[j] *= inv;
    }
    for (int64_t x = 0; x < hq * dv; x++) acc[x] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        if (j + PREFETCH < n) prefetch_row(v + sl[j + PREFETCH] * vrow, vrow);
        const float *vr = v + sl[j] * vrow;
        for (int64_t h = 0; h < hq; h++) {
            const float p = scores[h * n + j];
            const float *vh = vr + (h / g) * dv;
            float *a = acc + h * dv;
#pragma omp simd
            for (int64_t x = 0; x < dv; x++) a[x] += p * vh[x];
        }
    }
    for (int64_t x = 0; x < hq * dv; x++) o[x] = acc[x];
}

/* Rows r0 .. r0 + nr of one block; row i's keys are union columns [lo_i, lo_i + count) of the
 * nu keys at slots[u0 ..]. Scratch: kt d * nup, vu nup * dv, s RB * nup floats (nup = nu
 * rounded up to 16). dv is a multiple of 16. */
static inline __attribute__((always_inline)) void attend_block(
    const float *q, int64_t q_stride, const float *k, const float *v, const int64_t *sl,
    const int64_t *lo, const int64_t *cnt, int64_t nr, int64_t nu, const int64_t hq,
    const int64_t hkv, const int64_t d, const int64_t dv, float scale, float softcap,
    const float *sinks, float *kt, float *vu, float *s, float *out, int64_t out_stride)
{
    const int64_t g = hq / hkv, krow = hkv * d, vrow = hkv * dv;
    const int64_t nup = (nu + UNION_ALIGN - 1) & ~(int64_t)(UNION_ALIGN - 1);
    for (int64_t kh = 0; kh < hkv; kh++) {
        for (int64_t j = 0; j < nu; j++) {
            if (j + PREFETCH < nu) {
                prefetch_row(k + sl[j + PREFETCH] * krow + kh * d, d);
                prefetch_row(v + sl[j + PREFETCH] * vrow + kh * dv, dv);
            }
            const float *kr = k + sl[j] * krow + kh * d;
            for (int64_t x = 0; x < d; x++) kt[x * nup + j] = kr[x];
            memcpy(vu + j * dv, v + sl[j] * vrow + kh * dv, sizeof(float) * (size_t)dv);
        }
        for (int64_t j = nu; j < nup; j++) {
            for (int64_t x = 0; x < d; x++) kt[x * nup + j] = 0.0f;
            memset(vu + j * dv, 0, sizeof(float) * (size_t)dv);
        }
        for (int64_t h = kh * g; h < (kh + 1) * g; h++)
            for (int64_t i0 = 0; i0 < nr; i0 += RB) {
                /* RB rows at a time: columns [c0, c1) hold every key they read */
                const int64_t rb = nr - i0 < RB ? nr - i0 : RB;
                int64_t c0 = lo[i0], c1 = lo[i0] + cnt[i0];
                for (int64_t a = 1; a < rb; a++) {
                    if (lo[i0 + a] < c0) c0 = lo[i0 + a];
                    if (lo[i0 + a] + cnt[i0 + a] > c1) c1 = lo[i0 + a] + cnt[i0 + a];
                }
                const int64_t jc0 = c0 & ~(int64_t)(VW - 1);
                const float *qi[RB];
                float *p[RB];
                for (int64_t a = 0; a < RB; a++) {
                    qi[a] = q + (i0 + (a < rb ? a : 0)) * q_stride + h * d;
                    p[a] = s + (a < rb ? a : 0) * nup;
                }
                /* p[a][j] = (q_a . k_j) * scale, KV (two) key vectors a pass */
                for (int64_t jc = jc0; jc < c1; jc += KV * VW) {
                    const int64_t two = jc + VW < c1;
                    vf acc[RB][KV] = {};
                    for (int64_t x = 0; x < d; x++) {
                        const vf k0 = vf_load(kt + x * nup + jc);
                        const vf k1 = two ? vf_load(kt + x * nup + jc + VW) : k0;
                        for (int64_t a = 0; a < RB; a++) {
                            acc[a][0] += qi[a][x] * k0;
                            acc[a][1] += qi[a][x] * k1;
                        }
                    }
                    for (int64_t a = 0; a < rb; a++) {
                        vf_store(p[a] + jc, acc[a][0] * scale);
                        if (two) vf_store(p[a] + jc + VW, acc[a][1] * scale);
                    }
                }
                /* each row's softmax over its own columns; the others in [c0, c1) weigh 0 */
                for (int64_t a = 0; a < rb; a++) {
                    float *row = p[a];
                    const int64_t lo_a = lo[i0 + a], hi_a = lo_a + cnt[i0 + a];
                    if (softcap > 0.0f)
                        for (int64_t j = lo_a; j < hi_a; j++) row[j] = tanhf(row[j] / softcap) * softcap;
                    float top = row[lo_a];
                    for (int64_t j = lo_a + 1; j < hi_a; j++) top = row[j] > top ? row[j] : top;
                    const float sink = sinks ? sinks[h] : 0.0f;
                    if (sinks && sink > top) top = sink;
                    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                    for (int64_t j = lo_a; j < hi_a; j++) {
                        row[j] = expf(row[j] - top);
                        sum += row[j];
                    }
                    if (sinks) sum += expf(sink - top);
                    const float inv = 1.0f / sum;
                    for (int64_t j = lo_a; j < hi_a; j++) row[j] *= inv;
                    for (int64_t j = c0; j < lo_a; j++) row[j] = 0.0f;
                    for (int64_t j = hi_a; j < c1; j++) row[j] = 0.0f;
                }
                /* out_a = sum_j p_aj v_j, up to OV value vectors a pass */
                for (int64_t c = 0; c < dv; c += OV * VW) {
                    const int64_t nc = dv - c < OV * VW ? (dv - c) / VW : OV;
                    vf acc[RB][OV] = {};
                    for (int64_t j = c0; j < c1; j++) {
                        vf vv[OV];
                        for (int64_t w = 0; w < OV; w++)
                            vv[w] = vf_load(vu + j * dv + c + VW * (w < nc ? w : 0));
                        for (int64_t a = 0; a < RB; a++)
                            for (int64_t w = 0; w < OV; w++) acc[a][w] += p[a][j] * vv[w];
                    }
                    for (int64_t a = 0; a < rb; a++)
                        for (int64_t w = 0; w < nc; w++)
                            vf_store(out + (i0 + a) * out_stride + h * dv + c + VW * w, acc[a][w]);
                }
            }
    }
}

struct block_scratch {
    float *buf; /* kt, vu, s of attend_block */
    int64_t nup; /* the union length (rounded up to 16) it has room for */
};

static int grow(struct block_scratch *b, int64_t nu, int64_t d, int64_t dv)
{
    const int64_t nup = (nu + UNION_ALIGN - 1) & ~(int64_t)(UNION_ALIGN - 1);
    if (nup <= b->nup) return 0;
    free(b->buf);
    b->buf = malloc(sizeof(float) * (size_t)((d + dv + RB) * nup));
    b->nup = b->buf ? nup : 0;
    return b->buf ? 0 : -1;
}

/* Every row: neighbouring rows whose runs overlap as a block, the others one by one. */
static inline __attribute__((always_inline)) int run_rows(
    const float *q, int64_t q_stride, const float *k, const float *v, const int64_t *slots,
    const int64_t *start, const int64_t *count, int64_t rows, const int64_t hq, const int64_t hkv,
    const int64_t d, const int64_t dv, float scale, float softcap, const float *sinks, float *out,
    int64_t out_stride, float *scores, float *acc, struct block_scratch *blk)
{
    for (int64_t r = 0; r < rows;) {
        if (count[r] <= 0) {
            r++;
            continue;
        }
        int64_t u0 = start[r], u1 = start[r] + count[r], longest = count[r], e = r + 1;
        while (e < rows && e - r < TILE && count[e] > 0) {
            const int64_t a = start[e] < u0 ? start[e] : u0;
            const int64_t b = start[e] + count[e] > u1 ? start[e] + count[e] : u1;
            const int64_t l = count[e] > longest ? count[e] : longest;
            if (b - a > l + TILE) break; /* not neighbours: another request, or a decode */
            u0 = a, u1 = b, longest = l, e++;
        }
        if (e - r >= MIN_TILE && dv % 16 == 0) {
            int64_t lo[TILE];
            for (int64_t i = 0; i < e - r; i++) lo[i] = start[r + i] - u0;
            if (grow(blk, u1 - u0, d, dv) != 0) return -1;
            const int64_t nup = blk->nup;
            attend_block(q + r * q_stride, q_stride, k, v, slots + u0, lo, count + r, e - r,
                         u1 - u0, hq, hkv, d, dv, scale, softcap, sinks, blk->buf,
                         blk->buf + d * nup, blk->buf + (d + dv) * nup, out + r * out_stride,
                         out_stride);
        } else {
            for (int64_t i = r; i < e; i++)
                attend(q + i * q_stride, slots + start[i], count[i], k, v, hq, hkv, d, dv, scale,
                       softcap, sinks, scores, acc, out + i * out_stride);
        }
        r = e;
    }
    return 0;
}

#define RUN_ROWS(D, DV)                                                                        \
    rc = run_rows(q, q_stride, k, v, slots, start, count, rows, hq, hkv, (D), (DV), scale,     \
                  softcap, sinks, out, out_stride, scores, acc, &blk)

/* Query row r (of q and out) attends to the keys at slots[start[r] .. start[r] + count[r]):
 * a decode's whole view, or one prefill query's causal, windowed part of its request's view.
 * A row with count 0 is skipped (its output row is left as it was).
 * Returns 0, or -1 when the scratch memory cannot be allocated (rows may be half written). */
int swaserve_attention_f32(
    const float *q, int64_t q_stride,      /* query row r at q + r * q_stride, heads of d contiguous */
    const float *k, const float *v,        /* pool [slots, hkv, d] and [slots, hkv, dv], contiguous */
    const int64_t *slots,                  /* key slots, each row's a contiguous run */
    const int64_t *start, const int64_t *count, int64_t rows,
    int64_t hq, int64_t hkv, int64_t d, int64_t dv,
    float scale, float softcap,            /* softcap <= 0: none */
    const float *sinks,                    /* [hq] or NULL */
    float *out, int64_t out_stride)        /* out + r * out_stride, heads of dv contiguous */
{
    int64_t longest = 1;
    for (int64_t r = 0; r < rows; r++)
        if (count[r] > longest) longest = count[r];
    float *scores = malloc(sizeof(float) * (size_t)(hq * longest + hq * dv));
    if (scores == NULL) return -1;
    float *acc = scores + hq * longest;
    struct block_scratch blk = {NULL, 0};
    int rc;
    if (d == 64 && dv == 64) {
        RUN_ROWS(64, 64);
    } else if (d == 128 && dv == 128) {
        RUN_ROWS(128, 128);
    } else if (d == 256 && dv == 256) {
        RUN_ROWS(256, 256);
    } else {
        RUN_ROWS(d, dv);
    }
    free(blk.buf);
    free(scores);
    return rc;
}
