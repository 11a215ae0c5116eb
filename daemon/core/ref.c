/*
 * ref.c - the reference dispatch/combine (docs/SEMANTICS.md) on plain host arrays. Written for clarity,
 * not speed: it is the definition the GPU kernels are checked against.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/ref.h"

/* ---- number formats ----------------------------------------------------------------------------- */

float epd_bf16_to_f32(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

uint16_t epd_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

float epd_e4m3_to_f32(uint8_t b) {
  int sign = b & 0x80, exp = (b >> 3) & 0xf, man = b & 7;
  float v;
  if (exp == 15 && man == 7) return NAN;
  if (exp == 0)
    v = ldexpf((float)man, -9);
  else
    v = ldexpf(1.0f + man / 8.0f, exp - 7);
  return sign ? -v : v;
}

uint8_t epd_f32_to_e4m3(float f) {
  uint8_t sign = signbit(f) ? 0x80 : 0;
  if (isnan(f)) return 0x7f;
  float a = fabsf(f);
  if (a >= 448.0f) return sign | 0x7e; /* satfinite: +-inf and everything above clamps to 448 */
  if (a < 0.015625f) {                 /* below 2^-6: subnormal, multiples of 2^-9 */
    int q = (int)rintf(a * 512.0f);    /* exact scaling; rintf rounds to nearest even */
    return sign | (uint8_t)q;          /* q == 8 is the encoding of 2^-6 itself */
  }
  int e;
  frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1): unbiased exponent e - 1 */
  int ex = e - 1;
  int q = (int)rintf(ldexpf(a, 3 - ex)); /* 8..16 */
  if (q == 16) {
    q = 8;
    ex++;
  }
  uint8_t bits = (uint8_t)(((ex + 7) << 3) | (q - 8));
  if (bits > 0x7e) bits = 0x7e;
  return sign | bits;
}

void epd_ref_quant_row(const uint16_t *x, uint32_t hidden, uint8_t *q, float *scales) {
  for (uint32_t b = 0; b * 128 < hidden; b++) {
    uint32_t end = b * 128 + 128 < hidden ? b * 128 + 128 : hidden;
    float amax = 0;
    for (uint32_t i = b * 128; i < end;
         i++) { /* NaN skipped: glibc's fmaxf returns NaN for a signalling one */
      float v = fabsf(epd_bf16_to_f32(x[i]));
      if (!isnan(v)) amax = fmaxf(amax, v);
    }
    float scale = fmaxf(amax, 1e-4f) / 448.0f;
    scales[b] = scale;
    for (uint32_t i = b * 128; i < end; i++) q[i] = epd_f32_to_e4m3(epd_bf16_to_f32(x[i]) / scale);
  }
}

/* ---- expert maps -------------------------------------------------------------------------------- */

static epd_result_t map_alloc(epd_expert_map_t *m, uint32_t num_experts) {
  m->nrep = calloc(num_experts ? num_experts : 1, 1);
  m->rep = calloc(num_experts ? num_experts : 1, sizeof *m->rep);
  if (!m->nrep || !m->rep) {
    free(m->nrep);
    free(m->rep);
    m->nrep = NULL;
    m->rep = NULL;
    return EPD_ERR_NOMEM;
  }
  return EPD_OK;
}

epd_result_t epd_ref_map_default(epd_expert_map_t *m, uint32_t num_experts, uint32_t num_ranks,
                                 uint32_t slots_per_rank) {
  memset(m, 0, sizeof *m);
  if (num_ranks == 0 || num_experts == 0) return EPD_ERR_INVALID;
  uint32_t per = (num_experts + num_ranks - 1) / num_ranks;
  if (slots_per_rank < per) return EPD_ERR_INVALID;
  if (map_alloc(m, num_experts)) return EPD_ERR_NOMEM;
  m->version = 1;
  m->num_experts = num_experts;
  m->num_ranks = num_ranks;
  m->slots_per_rank = slots_per_rank;
  for (uint32_t e = 0; e < num_experts; e++) {
    m->nrep[e] = 1;
    m->rep[e][0].rank = e / per;
    m->rep[e][0].slot = e % per;
  }
  return EPD_OK;
}

epd_result_t epd_ref_map_validate(const epd_expert_map_t *m, uint32_t num_experts, uint32_t num_ranks,
                                  uint32_t slots_per_rank, char *err, size_t errlen) {
  if (m->num_experts != num_experts) {
    snprintf(err, errlen, "map has %u experts, the group has %u", m->num_experts, num_experts);
    return EPD_ERR_INVALID;
  }
  if (m->num_ranks && m->num_ranks != num_ranks) {
    snprintf(err, errlen, "map has num_ranks %u, the group has %u", m->num_ranks, num_ranks);
    return EPD_ERR_INVALID;
  }
  if (m->slots_per_rank && m->slots_per_rank != slots_per_rank) {
    snprintf(err, errlen, "map has slots_per_rank %u, the group has %u", m->slots_per_rank, slots_per_rank);
    return EPD_ERR_INVALID;
  }
  if (!m->nrep || !m->rep) {
    snprintf(err, errlen, "map has no placements");
    return EPD_ERR_INVALID;
  }
  uint32_t *owner = malloc(sizeof *owner * (size_t)num_ranks * slots_per_rank);
  if (!owner) return EPD_ERR_NOMEM;
  for (size_t i = 0; i < (size_t)num_ranks * slots_per_rank; i++) owner[i] = UINT32_MAX;
  epd_result_t rc = EPD_OK;
  for (uint32_t e = 0; e < num_experts && rc == EPD_OK; e++) {
    if (m->nrep[e] < 1 || m->nrep[e] > EPD_MAX_REPLICAS) {
      snprintf(err, errlen, "expert %u has %u replicas; allowed 1..%u", e, m->nrep[e], EPD_MAX_REPLICAS);
      rc = EPD_ERR_INVALID;
      break;
    }
    for (uint32_t i = 0; i < m->nrep[e]; i++) {
      epd_replica_t r = m->rep[e][i];
      if (r.rank >= num_ranks) {
        snprintf(err, errlen, "expert %u replica %u: rank %u out of range [0, %u)", e, i, r.rank, num_ranks);
        rc = EPD_ERR_INVALID;
        break;
      }
      if (r.slot >= slots_per_rank) {
        snprintf(err, errlen, "expert %u replica %u: slot %u out of range [0, %u)", e, i, r.slot,
                 slots_per_rank);
        rc = EPD_ERR_INVALID;
        break;
      }
      uint32_t *o = &owner[(size_t)r.rank * slots_per_rank + r.slot];
      if (*o != UINT32_MAX) {
        snprintf(err, errlen, "expert %u replica %u: (rank %u, slot %u) is already used by expert %u", e, i,
                 r.rank, r.slot, *o);
        rc = EPD_ERR_INVALID;
        break;
      }
      *o = e;
    }
  }
  free(owner);
  return rc;
}

epd_result_t epd_ref_map_copy(epd_expert_map_t *dst, const epd_expert_map_t *src) {
  *dst = *src;
  dst->nrep = NULL;
  dst->rep = NULL;
  if (map_alloc(dst, src->num_experts)) return EPD_ERR_NOMEM;
  memcpy(dst->nrep, src->nrep, src->num_experts);
  memcpy(dst->rep, src->rep, sizeof *src->rep * src->num_experts);
  return EPD_OK;
}

epd_result_t epd_ref_map_mask(epd_expert_map_t *dst, const epd_expert_map_t *src, uint64_t mask) {
  epd_result_t rc = epd_ref_map_copy(dst, src);
  if (rc) return rc;
  for (uint32_t e = 0; e < src->num_experts; e++) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < src->nrep[e]; i++)
      if (!(src->rep[e][i].rank < 64 && (mask >> src->rep[e][i].rank & 1))) dst->rep[e][n++] = src->rep[e][i];
    dst->nrep[e] = (uint8_t)n;
  }
  return EPD_OK;
}

void epd_expert_map_free(epd_expert_map_t *map) {
  if (!map) return;
  free(map->nrep);
  free(map->rep);
  map->nrep = NULL;
  map->rep = NULL;
}

/* ---- plan --------------------------------------------------------------------------------------- */

epd_result_t epd_ref_plan_init(epd_ref_plan_t *p, const epd_ref_geom_t *g) {
  memset(p, 0, sizeof *p);
  p->g = *g;
  p->mode = -1;
  size_t R = g->num_ranks, MK = (size_t)g->max_tokens * g->topk, S = g->slots_per_rank;
  p->num_tokens = calloc(R, sizeof *p->num_tokens);
  p->dst_rank = calloc(R * MK + 1, sizeof *p->dst_rank);
  p->dst_slot = calloc(R * MK + 1, sizeof *p->dst_slot);
  p->dst_pos = calloc(R * MK + 1, sizeof *p->dst_pos);
  p->weight = calloc(R * MK + 1, sizeof *p->weight);
  p->ht_pos = calloc(R * g->max_tokens * R + 1, sizeof *p->ht_pos);
  p->ll_count = calloc(R * S + 1, sizeof *p->ll_count);
  p->ht_count = calloc(R * S + 1, sizeof *p->ht_count);
  p->ll_recv = calloc(R, sizeof *p->ll_recv);
  p->ht_recv = calloc(R, sizeof *p->ht_recv);
  p->expert_tokens = calloc(g->num_experts + 1, sizeof *p->expert_tokens);
  p->slot_tokens = calloc(R * S + 1, sizeof *p->slot_tokens);
  p->dropped = calloc(R, sizeof *p->dropped);
  if (!p->num_tokens || !p->dst_rank || !p->dst_slot || !p->dst_pos || !p->weight || !p->ht_pos ||
      !p->ll_count || !p->ht_count || !p->ll_recv || !p->ht_recv || !p->expert_tokens || !p->slot_tokens ||
      !p->dropped) {
    epd_ref_plan_free(p);
    return EPD_ERR_NOMEM;
  }
  return EPD_OK;
}

void epd_ref_plan_free(epd_ref_plan_t *p) {
  free(p->num_tokens);
  free(p->dst_rank);
  free(p->dst_slot);
  free(p->dst_pos);
  free(p->weight);
  free(p->ht_pos);
  free(p->ll_count);
  free(p->ht_count);
  free(p->ll_recv);
  free(p->ht_recv);
  free(p->expert_tokens);
  free(p->slot_tokens);
  free(p->dropped);
  memset(p, 0, sizeof *p);
  p->mode = -1;
}

epd_result_t epd_ref_plan_build(epd_ref_plan_t *p, const epd_expert_map_t *map, const epd_ref_in_t *in,
                                int *bad_rank, char *err, size_t errlen) {
  const epd_ref_geom_t *g = &p->g;
  uint32_t R = g->num_ranks, M = g->max_tokens, K = g->topk, S = g->slots_per_rank, E = g->num_experts;
  *bad_rank = -1;
  p->mode = -1;
  /* Validate everything before touching the plan's routing. */
  for (uint32_t r = 0; r < R; r++) {
    if (in[r].num_tokens > M) {
      *bad_rank = (int)r;
      snprintf(err, errlen, "rank %u: num_tokens %u over max_tokens %u", r, in[r].num_tokens, M);
      return EPD_ERR_TOO_MANY_TOKENS;
    }
    for (uint32_t i = 0; i < in[r].num_tokens * K; i++) {
      int64_t e = in[r].topk_idx[i];
      if (e < -1 || e >= (int64_t)E) {
        *bad_rank = (int)r;
        snprintf(err, errlen, "rank %u: topk_idx[%u][%u] = %lld outside [-1, %u)", r, i / K, i % K,
                 (long long)e, E);
        return EPD_ERR_BAD_EXPERT;
      }
    }
  }
  if (map->num_experts != E) {
    snprintf(err, errlen, "map has %u experts, the group has %u", map->num_experts, E);
    return EPD_ERR_INTERNAL;
  }
  p->map_version = map->version;
  memset(p->ll_count, 0, sizeof *p->ll_count * R * S);
  memset(p->ht_count, 0, sizeof *p->ht_count * R * S);
  memset(p->ll_recv, 0, sizeof *p->ll_recv * R);
  memset(p->ht_recv, 0, sizeof *p->ht_recv * R);
  memset(p->expert_tokens, 0, sizeof *p->expert_tokens * E);
  memset(p->slot_tokens, 0, sizeof *p->slot_tokens * R * S);
  memset(p->dropped, 0, sizeof *p->dropped * R);
  /* Ordered by src, then t, then k: the row of every entry in its destination slot and rank. */
  for (uint32_t src = 0; src < R; src++) {
    uint32_t T = in[src].num_tokens;
    p->num_tokens[src] = T;
    for (uint32_t t = 0; t < T; t++) {
      size_t row = ((size_t)src * M + t) * K;
      int32_t *hp = &p->ht_pos[((size_t)src * M + t) * R];
      for (uint32_t r = 0; r < R; r++) hp[r] = -1;
      double all = 0, kept = 0; /* the weights of the token's valid entries, and of those routed */
      int lost = 0;
      for (uint32_t k = 0; k < K; k++) {
        int64_t e = in[src].topk_idx[(size_t)t * K + k];
        p->weight[row + k] = in[src].topk_weights[(size_t)t * K + k];
        p->dst_rank[row + k] = -1;
        p->dst_slot[row + k] = -1;
        p->dst_pos[row + k] = -1;
        if (e < 0) continue;
        int dup = 0;
        for (uint32_t k2 = 0; k2 < k; k2++)
          if (in[src].topk_idx[(size_t)t * K + k2] == e) dup = 1;
        if (dup) continue;
        all += p->weight[row + k];
        if (!map->nrep[e]) { /* no live replica (a masked map): dropped */
          p->dropped[src]++;
          lost = 1;
          continue;
        }
        kept += p->weight[row + k];
        epd_replica_t d = epd_ref_map_dest(map, M, src, t, (uint32_t)e);
        p->dst_rank[row + k] = (int32_t)d.rank;
        p->dst_slot[row + k] = (int32_t)d.slot;
        p->dst_pos[row + k] = p->ll_count[(size_t)d.rank * S + d.slot]++;
        p->ll_recv[d.rank]++;
        p->expert_tokens[e]++;
        p->slot_tokens[(size_t)d.rank * S + d.slot]++;
        p->ht_count[(size_t)d.rank * S + d.slot]++;
        if (hp[d.rank] < 0) hp[d.rank] = (int32_t)p->ht_recv[d.rank]++;
      }
      /* renormalise: the weights the token keeps scaled to what all its valid entries weighed (a token
       * that lost nothing, or kept nothing, is left alone) */
      if (p->renormalize && lost && kept != 0) {
        const float f = (float)(all / kept);
        for (uint32_t k = 0; k < K; k++)
          if (p->dst_rank[row + k] >= 0) p->weight[row + k] *= f;
      }
    }
  }
  return EPD_OK;
}

uint32_t epd_ref_plan_routed_to(const epd_ref_plan_t *p, uint32_t src, uint64_t ranks) {
  const size_t MK = (size_t)p->g.max_tokens * p->g.topk;
  uint32_t n = 0;
  for (size_t i = 0; i < (size_t)p->num_tokens[src] * p->g.topk; i++) {
    const int32_t d = p->dst_rank[src * MK + i];
    n += d >= 0 && d < 64 && (ranks >> d & 1);
  }
  return n;
}

/* ---- data movement ------------------------------------------------------------------------------ */

/* Write one token row into a receive row: bf16 copy, or fp8 bytes plus scales. */
static void put_row(const epd_ref_geom_t *g, const uint16_t *x, int fp8, void *recv_x, float *recv_scales,
                    size_t row) {
  uint32_t H = g->hidden, nb = epd_ref_scale_blocks(H);
  if (!recv_x && !recv_scales) return;
  if (fp8) {
    for (uint32_t b = 0; b < nb; b++) {
      uint32_t w = H - b * 128 < 128 ? H - b * 128 : 128;
      uint8_t q[128];
      float sc;
      epd_ref_quant_row(x + b * 128, w, q, &sc);
      if (recv_x) memcpy((uint8_t *)recv_x + row * H * 2 + b * 128, q, w);
      if (recv_scales) recv_scales[row * nb + b] = sc;
    }
  } else if (recv_x) {
    memcpy((uint8_t *)recv_x + row * H * 2, x, (size_t)H * 2);
  }
}

epd_result_t epd_ref_ll_dispatch(epd_ref_plan_t *p, const epd_ref_in_t *in, int fp8,
                                 epd_ref_out_t *const *out) {
  const epd_ref_geom_t *g = &p->g;
  uint32_t R = g->num_ranks, M = g->max_tokens, K = g->topk, S = g->slots_per_rank, H = g->hidden;
  if (fp8 && H % 128) return EPD_ERR_INVALID;
  p->mode = EPD_MODE_LL;
  for (uint32_t src = 0; src < R; src++) {
    for (uint32_t t = 0; t < p->num_tokens[src]; t++) {
      size_t row = ((size_t)src * M + t) * K;
      for (uint32_t k = 0; k < K; k++) {
        int32_t d = p->dst_rank[row + k];
        if (d < 0 || !out[d]) continue;
        size_t j = (size_t)p->dst_slot[row + k] * R * M + (size_t)p->dst_pos[row + k];
        epd_ref_out_t *o = out[d];
        put_row(g, in[src].x + (size_t)t * H, fp8, o->recv_x, fp8 ? o->recv_scales : NULL, j);
        if (o->recv_src) o->recv_src[j] = EPD_SRC_PACK(src, t);
      }
    }
  }
  for (uint32_t r = 0; r < R; r++)
    if (out[r] && out[r]->recv_count)
      memcpy(out[r]->recv_count, p->ll_count + (size_t)r * S, sizeof(int32_t) * S);
  return EPD_OK;
}

epd_result_t epd_ref_ll_combine(const epd_ref_plan_t *p, const uint16_t *const *y, uint16_t *const *out) {
  const epd_ref_geom_t *g = &p->g;
  uint32_t R = g->num_ranks, M = g->max_tokens, K = g->topk, H = g->hidden;
  float *acc = malloc(sizeof(float) * (H ? H : 1));
  if (!acc) return EPD_ERR_NOMEM;
  for (uint32_t src = 0; src < R; src++) {
    if (!out[src]) continue;
    for (uint32_t t = 0; t < p->num_tokens[src]; t++) {
      size_t row = ((size_t)src * M + t) * K;
      for (uint32_t h = 0; h < H; h++) acc[h] = 0;
      for (uint32_t k = 0; k < K; k++) {
        int32_t d = p->dst_rank[row + k];
        if (d < 0 || !y[d]) continue;
        const uint16_t *yr = y[d] + ((size_t)p->dst_slot[row + k] * R * M + p->dst_pos[row + k]) * H;
        float w = p->weight[row + k];
        for (uint32_t h = 0; h < H; h++) acc[h] += w * epd_bf16_to_f32(yr[h]);
      }
      for (uint32_t h = 0; h < H; h++) out[src][(size_t)t * H + h] = epd_f32_to_bf16(acc[h]);
    }
  }
  free(acc);
  return EPD_OK;
}

void epd_ref_ht_dense(epd_ref_plan_t *p) {
  const epd_ref_geom_t *g = &p->g;
  uint32_t R = g->num_ranks, M = g->max_tokens, N = 0;
  for (uint32_t src = 0; src < R; src++) {
    for (uint32_t t = 0; t < p->num_tokens[src]; t++)
      for (uint32_t r = 0; r < R; r++) p->ht_pos[((size_t)src * M + t) * R + r] = (int32_t)(N + t);
    N += p->num_tokens[src];
  }
  for (uint32_t r = 0; r < R; r++) p->ht_recv[r] = N;
}

epd_result_t epd_ref_ht_dispatch(epd_ref_plan_t *p, const epd_ref_in_t *in, int fp8,
                                 epd_ref_out_t *const *out, int *bad_rank) {
  const epd_ref_geom_t *g = &p->g;
  uint32_t R = g->num_ranks, M = g->max_tokens, K = g->topk, S = g->slots_per_rank, H = g->hidden;
  *bad_rank = -1;
  if (fp8 && H % 128) return EPD_ERR_INVALID;
  for (uint32_t r = 0; r < R; r++)
    if (p->ht_recv[r] > g->ht_capacity) {
      *bad_rank = (int)r;
      return EPD_ERR_OVERFLOW;
    }
  p->mode = EPD_MODE_HT;
  for (uint32_t src = 0; src < R; src++) {
    for (uint32_t t = 0; t < p->num_tokens[src]; t++) {
      size_t row = ((size_t)src * M + t) * K;
      const int32_t *hp = &p->ht_pos[((size_t)src * M + t) * R];
      for (uint32_t r = 0; r < R; r++) {
        if (hp[r] < 0 || !out[r]) continue;
        epd_ref_out_t *o = out[r];
        size_t j = (size_t)hp[r];
        put_row(g, in[src].x + (size_t)t * H, fp8, o->recv_x, fp8 ? o->recv_scales : NULL, j);
        if (o->recv_src) o->recv_src[j] = EPD_SRC_PACK(src, t);
        for (uint32_t k = 0; k < K; k++) {
          int local = p->dst_rank[row + k] == (int32_t)r;
          if (o->recv_topk_idx) o->recv_topk_idx[j * K + k] = local ? p->dst_slot[row + k] : -1;
          if (o->recv_topk_weights) o->recv_topk_weights[j * K + k] = local ? p->weight[row + k] : 0.0f;
        }
      }
    }
  }
  for (uint32_t r = 0; r < R; r++)
    if (out[r] && out[r]->recv_count)
      memcpy(out[r]->recv_count, p->ht_count + (size_t)r * S, sizeof(int32_t) * S);
  return EPD_OK;
}

epd_result_t epd_ref_ht_combine(const epd_ref_plan_t *p, const uint16_t *const *y, uint16_t *const *out) {
  const epd_ref_geom_t *g = &p->g;
  uint32_t R = g->num_ranks, M = g->max_tokens, H = g->hidden, K = g->topk;
  float *acc = malloc(sizeof(float) * (H ? H : 1));
  if (!acc) return EPD_ERR_NOMEM;
  for (uint32_t src = 0; src < R; src++) {
    if (!out[src]) continue;
    for (uint32_t t = 0; t < p->num_tokens[src]; t++) {
      const int32_t *hp = &p->ht_pos[((size_t)src * M + t) * R];
      const int32_t *dr = &p->dst_rank[((size_t)src * M + t) * K];
      for (uint32_t h = 0; h < H; h++) acc[h] = 0;
      for (uint32_t r = 0; r < R; r++) {
        /* the ranks holding an entry of t (a dense layout's other rows are not partials) */
        int routed = 0;
        for (uint32_t k = 0; k < K; k++) routed |= dr[k] == (int32_t)r;
        if (hp[r] < 0 || !routed || !y[r]) continue;
        const uint16_t *yr = y[r] + (size_t)hp[r] * H;
        for (uint32_t h = 0; h < H; h++) acc[h] += epd_bf16_to_f32(yr[h]);
      }
      for (uint32_t h = 0; h < H; h++) out[src][(size_t)t * H + h] = epd_f32_to_bf16(acc[h]);
    }
  }
  free(acc);
  return EPD_OK;
}

/* ---- deterministic inputs ----------------------------------------------------------------------- */

uint64_t epd_ref_rand(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static float rand_unit(uint64_t *st) {
  return (float)(epd_ref_rand(st) >> 40) / (float)(1 << 24);
}

void epd_ref_gen_input(uint64_t seed, uint64_t step, uint32_t rank, const epd_ref_geom_t *g,
                       uint32_t num_tokens, int skew, uint16_t *x, int64_t *topk_idx, float *topk_weights) {
  uint64_t st = seed * 0x100000001b3ull ^ (step << 20) ^ ((uint64_t)rank << 48) ^ 0x6a09e667f3bcc909ull;
  uint32_t H = g->hidden, K = g->topk, E = g->num_experts;
  uint32_t per = (E + g->num_ranks - 1) / g->num_ranks;
  for (size_t i = 0; i < (size_t)num_tokens * H; i++) x[i] = epd_f32_to_bf16(rand_unit(&st) * 4.0f - 2.0f);
  for (uint32_t t = 0; t < num_tokens; t++)
    for (uint32_t k = 0; k < K; k++) {
      uint64_t u = epd_ref_rand(&st);
      int64_t e;
      if (u % 100 < 10)
        e = -1;
      else if (k > 0 && u % 100 < 15)
        e = topk_idx[(size_t)t * K + (u >> 32) % k];
      else if (skew && (u >> 8) % 100 < 70)
        e = (int64_t)((u >> 32) % per);
      else
        e = (int64_t)((u >> 32) % E);
      topk_idx[(size_t)t * K + k] = e;
      topk_weights[(size_t)t * K + k] = 0.05f + 0.95f * rand_unit(&st);
    }
}

/* Special groups: each pattern fills the 128 values of one scale group. */
static uint16_t spec_value(uint32_t pat, uint32_t i, uint64_t *st) {
  const uint64_t u = epd_ref_rand(st);
  const uint16_t sign = (u >> 20) & 1 ? 0x8000 : 0;
  const uint16_t normal = epd_f32_to_bf16(rand_unit(st) * 4.0f - 2.0f);
  static const uint16_t nans[] = {0x7fc0, 0xffc0, 0x7f81, 0xff81, 0x7fff, 0xffff, 0x7fa5};
  switch (pat) {
    case 0: /* signed zeros: amax 0, the floor scale */
      return sign;
    case 1: /* BF16 subnormals: amax below the floor */
      return sign | (uint16_t)(1 + u % 127);
    case 2: /* one +inf: an infinite scale, finite values give signed zeros, inf / inf NaN */
      return i == 37 ? 0x7f80 : normal;
    case 3: /* both infinities and a NaN */
      return i == 5 ? 0xff80 : i == 90 ? 0x7f80 : i == 91 ? 0x7fc1 : normal;
    case 4: /* NaNs (quiet, signalling, both signs) among normals: the amax skips them */
      return i % 9 == 4 ? nans[u % 7] : normal;
    case 5: /* every value NaN */
      return sign | 0x7f80 | (uint16_t)(1 + u % 127);
    case 6: /* around the floor 1e-4 */
      return sign | epd_f32_to_bf16(1e-4f * (0.5f + rand_unit(st)));
    case 7: /* large finite values (2^100 scale) */
      return sign | epd_f32_to_bf16(ldexpf(0.5f + rand_unit(st), 100));
    default: /* one value of 1, the others tiny: quotients in e4m3's subnormal range and below it */
      return i == 64 ? (uint16_t)(sign | 0x3f80)
                     : (uint16_t)(sign | epd_f32_to_bf16(ldexpf(rand_unit(st), -6 - (int)(u % 10))));
  }
}

void epd_ref_gen_specials(uint64_t seed, uint64_t step, uint32_t rank, uint32_t num_tokens, uint32_t hidden,
                          uint16_t *x) {
  uint64_t st = seed * 0x9e3779b97f4a7c15ull ^ (step << 24) ^ ((uint64_t)rank << 52) ^ 0x3c6ef372fe94f82bull;
  const uint32_t nb = hidden / 128;
  if (hidden % 128 || !nb) return;
  for (uint32_t t = 0; t < num_tokens; t++) {
    uint64_t u = epd_ref_rand(&st);
    if (u % 3) continue;
    uint32_t b = (uint32_t)((u >> 8) % nb), pat = (uint32_t)((u >> 32) % EPD_REF_SPECIALS);
    for (uint32_t i = 0; i < 128; i++) x[(size_t)t * hidden + b * 128 + i] = spec_value(pat, i, &st);
  }
}
