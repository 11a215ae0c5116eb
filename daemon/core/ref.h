/*
 * ref.h - the reference dispatch/combine of docs/SEMANTICS.md on plain host arrays.
 *
 * Pure functions, independent of the engine: the host backend executes steps with them, the unit tests
 * check their invariants, and the GPU tests use them as the expected result. A step is computed in two
 * parts: epd_ref_plan_build() validates every rank's input and computes the routing (destination rank,
 * slot and row of every (rank, token, k), HT rows and counts); the dispatch and combine functions then
 * move data according to that plan. The plan is also what a combine needs from its dispatch, so the
 * engine keeps one per bank.
 *
 * Buffers are those of include/epd/epd_abi.h (shapes with M = max_tokens, H = hidden, K = topk, S = slots per
 * rank, R = ranks, C = HT capacity); BF16 values are uint16_t bit patterns.
 */
#ifndef EPD_REF_H
#define EPD_REF_H

#include <stddef.h>
#include <stdint.h>

#include "core/engine.h"
#include "epd.h"

/* Group geometry as the reference needs it. */
typedef struct epd_ref_geom {
  uint32_t num_ranks, num_experts, hidden, topk, max_tokens, slots_per_rank, ht_capacity;
} epd_ref_geom_t;

/* One rank's dispatch input (buffers of its arena). */
typedef struct epd_ref_in {
  uint32_t num_tokens;
  const uint16_t *x;         /* [M, H] bf16 */
  const int64_t *topk_idx;   /* [M, K] */
  const float *topk_weights; /* [M, K] */
} epd_ref_in_t;

/* One rank's dispatch output. LL uses recv_x/recv_scales/recv_count/recv_src (LL_* buffers); HT uses
 * all of them (HT_* buffers). A NULL member is not written; a NULL epd_ref_out_t pointer skips the rank. */
typedef struct epd_ref_out {
  void *recv_x;             /* LL [S, R*M, H] / HT [C, H]; bf16, or fp8 bytes in the first H bytes of a row */
  float *recv_scales;       /* LL [S, R*M, H/128] / HT [C, H/128] */
  int32_t *recv_count;      /* [S] */
  int32_t *recv_src;        /* LL [S, R*M] / HT [C] */
  int64_t *recv_topk_idx;   /* HT [C, K] */
  float *recv_topk_weights; /* HT [C, K] */
} epd_ref_out_t;

/* Routing of one step over all ranks (arrays indexed by source rank first). */
typedef struct epd_ref_plan {
  epd_ref_geom_t g;
  uint32_t map_version;
  int mode;                /* EPD_MODE_LL/HT of the dispatch that used it, -1 before */
  uint32_t *num_tokens;    /* [R] */
  int32_t *dst_rank;       /* [R][M*K] -1: no expert (invalid or duplicate entry) */
  int32_t *dst_slot;       /* [R][M*K] */
  int32_t *dst_pos;        /* [R][M*K] LL row in the destination slot */
  float *weight;           /* [R][M*K] copy of the dispatch weights */
  int32_t *ht_pos;         /* [R][M][R] HT row of (src, t) on each destination rank, -1 */
  int32_t *ll_count;       /* [R][S] LL tokens per slot of each rank */
  int32_t *ht_count;       /* [R][S] HT (j, k) entries per slot of each rank */
  uint32_t *ll_recv;       /* [R] LL tokens received by each rank (all slots) */
  uint32_t *ht_recv;       /* [R] HT tokens received by each rank (may exceed C: overflow) */
  uint64_t *expert_tokens; /* [E] valid (t, k) entries routed to each logical expert this step */
  uint64_t *slot_tokens;   /* [R][S] the same per physical slot */
  /* Masked ranks (docs/SEMANTICS.md "Masked ranks"): the map given to epd_ref_plan_build may list no
   * replica for an expert (epd_ref_map_mask): its entries are dropped, counted per source rank. */
  uint32_t *dropped; /* [R] entries of each source rank's tokens dropped (no live replica) */
  int renormalize;   /* set before building: scale the weights a token keeps to its entries' sum */
} epd_ref_plan_t;

/* Allocate a plan for a geometry; EPD_ERR_NOMEM. */
epd_result_t epd_ref_plan_init(epd_ref_plan_t *p, const epd_ref_geom_t *g);
void epd_ref_plan_free(epd_ref_plan_t *p);
/* Validate every rank's input (T <= M, top-k ids in [-1, E)) and compute the routing with the map. An
 * expert without replicas in the map (a masked map) drops its entries (plan->dropped); with
 * plan->renormalize a token that lost entries has its remaining weights scaled to the sum of the weights
 * of all its valid entries.
 * On failure returns TOO_MANY_TOKENS or BAD_EXPERT, *bad_rank the rank at fault, and err says why. */
epd_result_t epd_ref_plan_build(epd_ref_plan_t *p, const epd_expert_map_t *map, const epd_ref_in_t *in,
                                int *bad_rank, char *err, size_t errlen);

/* LL dispatch of a built plan: fills out[r] of every rank r (out may hold NULL entries). */
epd_result_t epd_ref_ll_dispatch(epd_ref_plan_t *p, const epd_ref_in_t *in, int fp8,
                                 epd_ref_out_t *const *out);
/* LL combine: y[r] is rank r's LL_Y [S, R*M, H] bf16; writes out[r] = OUT [M, H] bf16 (NULL: skip). A
 * NULL y[r] (a rank masked since the dispatch) contributes nothing. */
epd_result_t epd_ref_ll_combine(const epd_ref_plan_t *p, const uint16_t *const *y, uint16_t *const *out);
/* HT dispatch: EPD_ERR_OVERFLOW (nothing written, *bad_rank the overflowing rank) when a rank would
 * receive more than C tokens. */
epd_result_t epd_ref_ht_dispatch(epd_ref_plan_t *p, const epd_ref_in_t *in, int fp8,
                                 epd_ref_out_t *const *out, int *bad_rank);
/* HT dense layout (EPD_DESC_HT_DENSE) of a built plan: every rank receives every token, row
 * sum(T of the ranks before src) + t; the entries of other ranks stay -1 (call before the dispatch). */
void epd_ref_ht_dense(epd_ref_plan_t *p);
/* HT combine: y[r] is rank r's HT_Y [C, H] bf16; out[r] = OUT [M, H] bf16 (NULL: skip). Sums the rows
 * of the ranks that hold an entry of the token; a NULL y[r] contributes nothing. */
epd_result_t epd_ref_ht_combine(const epd_ref_plan_t *p, const uint16_t *const *y, uint16_t *const *out);

/* Number of 128-channel scale blocks of a row (ceil(H/128)). */
static inline uint32_t epd_ref_scale_blocks(uint32_t hidden) {
  return (hidden + 127) / 128;
}

/* Number formats. */
float epd_bf16_to_f32(uint16_t b);
uint16_t epd_f32_to_bf16(float f); /* round to nearest even; NaN stays NaN */
float epd_e4m3_to_f32(uint8_t b);
uint8_t epd_f32_to_e4m3(float f); /* round to nearest even, saturating to +-448 (satfinite); NaN 0x7f */
/* Quantise one row of H bf16 values to FP8 with per-128-block scales (SEMANTICS.md). */
void epd_ref_quant_row(const uint16_t *x, uint32_t hidden, uint8_t *q, float *scales);

/* Default map (version 1): expert e on rank e / ceil(E/R), slot e % ceil(E/R). Arrays malloc'ed. */
epd_result_t epd_ref_map_default(epd_expert_map_t *m, uint32_t num_experts, uint32_t num_ranks,
                                 uint32_t slots_per_rank);
/* Check a map against a geometry: every expert placed, replicas 1..EPD_MAX_REPLICAS, rank and slot in
 * range, no (rank, slot) used twice; EPD_ERR_INVALID with a message naming the expert and replica. */
epd_result_t epd_ref_map_validate(const epd_expert_map_t *m, uint32_t num_experts, uint32_t num_ranks,
                                  uint32_t slots_per_rank, char *err, size_t errlen);
/* Deep copy (arrays malloc'ed). */
epd_result_t epd_ref_map_copy(epd_expert_map_t *dst, const epd_expert_map_t *src);
/* The map without the replicas on the masked ranks (bit r of mask: world rank r), each expert's other
 * replicas in map order; an expert with none left has nrep 0 (its entries are dropped). dst is
 * allocated (epd_expert_map_free). */
epd_result_t epd_ref_map_mask(epd_expert_map_t *dst, const epd_expert_map_t *src, uint64_t mask);
/* Entries of source rank src's tokens the plan routed to any rank of `ranks` (bit r). */
uint32_t epd_ref_plan_routed_to(const epd_ref_plan_t *p, uint32_t src, uint64_t ranks);
/* Replica of expert e used by token t of rank src (SEMANTICS.md): with u = src * M + t, the replica
 * (u % n) of the n replicas on src's node (node = rank / ranks_per_node), in map order; when the node
 * has none, or there is one node, replica u % nrep[e]. */
static inline epd_replica_t epd_ref_map_dest(const epd_expert_map_t *m, uint32_t max_tokens, uint32_t src,
                                             uint32_t t, uint32_t e) {
  uint64_t u = (uint64_t)src * max_tokens + t;
  uint32_t rpn = m->ranks_per_node, n = m->nrep[e];
  if (rpn && rpn < m->num_ranks && n > 1) {
    uint32_t node = src / rpn, nl = 0, loc[EPD_MAX_REPLICAS];
    for (uint32_t i = 0; i < n; i++)
      if (m->rep[e][i].rank / rpn == node) loc[nl++] = i;
    if (nl) return m->rep[e][loc[u % nl]];
  }
  return m->rep[e][u % n];
}

/* Deterministic test inputs of one rank for (seed, step, rank): x random BF16 in [-2, 2), top-k ids
 * with about 10% -1 entries and 5% duplicates, weights in [0.05, 1). skew != 0 sends about 70% of the
 * picks to the experts of the default map's rank 0. Writes num_tokens rows of x [., H], topk [., K],
 * weights [., K]. Used by the tests, epd-worker and the GPU tests so that every process can rebuild
 * every rank's input. */
void epd_ref_gen_input(uint64_t seed, uint64_t step, uint32_t rank, const epd_ref_geom_t *g,
                       uint32_t num_tokens, int skew, uint16_t *x, int64_t *topk_idx, float *topk_weights);
/* Special values for the FP8 quantiser, over inputs made by epd_ref_gen_input: about a third of the
 * tokens get one 128-channel group replaced by one of EPD_REF_SPECIALS patterns (signed zeros, BF16
 * subnormals, +inf, both infinities with a NaN, NaNs among normals, all NaN, values around the 1e-4
 * floor, 2^100-scale values, one 1 among tiny values). Deterministic in (seed, step, rank); hidden a
 * multiple of 128 (else nothing changes). */
#define EPD_REF_SPECIALS 9
void epd_ref_gen_specials(uint64_t seed, uint64_t step, uint32_t rank, uint32_t num_tokens, uint32_t hidden,
                          uint16_t *x);
/* splitmix64 step, for tests that need their own random numbers. */
uint64_t epd_ref_rand(uint64_t *state);

#endif /* EPD_REF_H */
