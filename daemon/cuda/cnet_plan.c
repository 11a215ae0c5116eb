/*
 * cnet_plan.c - step programs of the CUDA inter-node stage (see cnet_plan.h) and their host emulation.
 */
#include "cuda/cnet_plan.h"

#include <stdlib.h>
#include <string.h>

static int vpush(cnet_vec_t *v, const void *e, size_t n) {
  if (v->len + n > v->cap) {
    size_t c = v->cap ? v->cap * 2 : 4096;
    while (c < v->len + n) c *= 2;
    uint8_t *q = realloc(v->p, c);
    if (!q) return -1;
    v->p = q;
    v->cap = c;
  }
  memcpy(v->p + v->len, e, n);
  v->len += n;
  return 0;
}

static void side_reset(cnet_side_t *s) {
  cnet_vec_t *v[] = {&s->pre_rows, &s->post_rows, &s->puts,       &s->pre_off, &s->pre_terms,
                     &s->pre_out,  &s->post_off,  &s->post_terms, &s->post_out};
  for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) v[i]->len = 0;
  memset(s->send_rows, 0, sizeof s->send_rows);
  memset(s->recv_rows, 0, sizeof s->recv_rows);
  s->num_recv = 0;
}

void cnet_prog_free(cnet_prog_t *pg) {
  for (int l = 0; l < EPD_MAX_RANKS; l++) {
    cnet_side_t *s = &pg->side[l];
    cnet_vec_t *v[] = {&s->pre_rows, &s->post_rows, &s->puts,       &s->pre_off, &s->pre_terms,
                       &s->pre_out,  &s->post_off,  &s->post_terms, &s->post_out};
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) free(v[i]->p);
  }
  free(pg->sidx);
  free(pg->ridx);
  memset(pg, 0, sizeof *pg);
}

/* Does token t of world rank src have an entry on a rank of node n? */
static int goes_to(const epd_ref_plan_t *p, uint32_t L, uint32_t src, uint32_t t, uint32_t n) {
  const int32_t *d = &p->dst_rank[((size_t)src * p->g.max_tokens + t) * p->g.topk];
  for (uint32_t k = 0; k < p->g.topk; k++)
    if (d[k] >= 0 && (uint32_t)d[k] / L == n) return 1;
  return 0;
}

/* Common part: geometry checks, reset, the exchange lists (sidx: own tokens per node, ridx: rail peers'
 * tokens that come here). */
static epd_result_t prog_begin(cnet_prog_t *pg, const epd_ref_plan_t *p, uint32_t nodes, uint32_t node,
                               uint32_t L, int combine, int fp8) {
  const epd_ref_geom_t *g = &p->g;
  if (!L || nodes < 2 || node >= nodes || nodes > CNET_MAX_NODES || (uint64_t)nodes * L != g->num_ranks ||
      L > EPD_MAX_RANKS || g->hidden % 128)
    return EPD_ERR_INVALID;
  size_t need = (size_t)L * nodes * g->max_tokens;
  if (need > pg->idx_cap) {
    int32_t *a = realloc(pg->sidx, need * 4), *b = a ? realloc(pg->ridx, need * 4) : NULL;
    if (a) pg->sidx = a;
    if (!b) return EPD_ERR_NOMEM;
    pg->ridx = b;
    pg->idx_cap = need;
  }
  pg->nodes = nodes;
  pg->node = node;
  pg->L = L;
  pg->H = g->hidden;
  pg->combine = combine;
  pg->fp8 = fp8;
  pg->row_bytes = combine ? (size_t)g->hidden * 4
                  : fp8   ? cnet_fp8_row_bytes(g->hidden)
                          : (size_t)g->hidden * 2;
  uint32_t M = g->max_tokens;
  for (uint32_t l = 0; l < L; l++) {
    cnet_side_t *s = &pg->side[l];
    side_reset(s);
    for (uint32_t n = 0; n < nodes; n++) {
      int32_t *si = &pg->sidx[((size_t)l * nodes + n) * M], *ri = &pg->ridx[((size_t)l * nodes + n) * M];
      for (uint32_t t = 0; t < M; t++) si[t] = ri[t] = -1;
      if (n == node) continue;
      uint32_t own = node * L + l, peer = n * L + l, cs = 0, cr = 0;
      for (uint32_t t = 0; t < p->num_tokens[own]; t++)
        if (goes_to(p, L, own, t, n)) si[t] = (int32_t)cs++;
      for (uint32_t t = 0; t < p->num_tokens[peer]; t++)
        if (goes_to(p, L, peer, t, node)) ri[t] = (int32_t)cr++;
      /* Dispatch sends own tokens and receives the peer's; combine returns partials the other way. */
      s->send_rows[n] = combine ? cr : cs;
      s->recv_rows[n] = combine ? cs : cr;
    }
  }
  return EPD_OK;
}

/* Token t of world rank src as seen on this node: its BF16 row in the own arena, or its received row
 * (FP8 dispatch: FP8 bytes, *scales their scales; else BF16, *scales 0). */
static uint64_t xrow(const cnet_prog_t *pg, const epd_ref_plan_t *p, const cnet_addr_t *addr, uint32_t src,
                     uint32_t t, uint64_t *scales) {
  uint32_t L = pg->L, n = src / L, l = src % L, M = p->g.max_tokens;
  *scales = 0;
  if (n == pg->node) return addr[l].buf[EPD_BUF_X] + t * (uint64_t)p->g.hidden * 2;
  uint64_t row = addr[l].xrecv[n] + (uint64_t)pg->ridx[((size_t)l * pg->nodes + n) * M + t] * pg->row_bytes;
  if (pg->fp8) *scales = row + p->g.hidden;
  return row;
}

static int put32(cnet_side_t *s, uint64_t dst, uint32_t v) {
  epd_k_net_put_t e = {dst, v, 0};
  return vpush(&s->puts, &e, sizeof e);
}

epd_result_t cnet_build_dispatch(cnet_prog_t *pg, const epd_ref_plan_t *p, uint32_t nodes, uint32_t node,
                                 uint32_t L, int mode, int fp8, const cnet_addr_t *addr) {
  epd_result_t rc = prog_begin(pg, p, nodes, node, L, 0, fp8);
  if (rc) return rc;
  const epd_ref_geom_t *g = &p->g;
  uint32_t W = g->num_ranks, M = g->max_tokens, K = g->topk, S = g->slots_per_rank, H = g->hidden;
  uint64_t rb = (uint64_t)H * 2, nb = epd_ref_scale_blocks(H);
  int oom = 0;
  /* pre: own tokens into the exchange rows, once per node (FP8 dispatch: quantised here, so half the
   * bytes cross; the expansion copies them) */
  uint64_t xb = pg->row_bytes;
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t n = 0; n < nodes; n++) {
      if (n == node) continue;
      const int32_t *si = &pg->sidx[((size_t)l * nodes + n) * M];
      for (uint32_t t = 0; t < p->num_tokens[node * L + l]; t++) {
        if (si[t] < 0) continue;
        uint64_t dst = addr[l].xsend[n] + (uint64_t)si[t] * xb;
        epd_k_net_row_t r = {addr[l].buf[EPD_BUF_X] + t * rb, dst, fp8 ? dst + H : 0, 0};
        oom |= vpush(&pg->side[l].pre_rows, &r, sizeof r);
      }
    }
  /* post: expansion at this node's ranks */
  for (uint32_t src = 0; src < W; src++)
    for (uint32_t t = 0; t < p->num_tokens[src]; t++) {
      size_t row = ((size_t)src * M + t) * K;
      uint64_t x = 0, xs = 0;
      if (mode == EPD_MODE_LL) {
        for (uint32_t k = 0; k < K; k++) {
          int32_t d = p->dst_rank[row + k];
          if (d < 0 || (uint32_t)d / L != node) continue;
          uint32_t l = (uint32_t)d % L;
          uint64_t j = (uint64_t)p->dst_slot[row + k] * W * M + (uint64_t)p->dst_pos[row + k];
          if (!x) x = xrow(pg, p, addr, src, t, &xs);
          epd_k_net_row_t r = {x, addr[l].buf[EPD_BUF_LL_RECV_X] + j * rb,
                               fp8 ? addr[l].buf[EPD_BUF_LL_RECV_SCALES] + j * nb * 4 : 0, xs};
          oom |= vpush(&pg->side[l].post_rows, &r, sizeof r);
          oom |=
              put32(&pg->side[l], addr[l].buf[EPD_BUF_LL_RECV_SRC] + j * 4, (uint32_t)EPD_SRC_PACK(src, t));
        }
      } else {
        const int32_t *hp = &p->ht_pos[((size_t)src * M + t) * W];
        for (uint32_t l = 0; l < L; l++) {
          uint32_t r = node * L + l;
          if (hp[r] < 0) continue;
          uint64_t j = (uint64_t)hp[r];
          if (!x) x = xrow(pg, p, addr, src, t, &xs);
          epd_k_net_row_t e = {x, addr[l].buf[EPD_BUF_HT_RECV_X] + j * rb,
                               fp8 ? addr[l].buf[EPD_BUF_HT_RECV_SCALES] + j * nb * 4 : 0, xs};
          cnet_side_t *s = &pg->side[l];
          oom |= vpush(&s->post_rows, &e, sizeof e);
          oom |= put32(s, addr[l].buf[EPD_BUF_HT_RECV_SRC] + j * 4, (uint32_t)EPD_SRC_PACK(src, t));
          for (uint32_t k = 0; k < K; k++) {
            int local = p->dst_rank[row + k] == (int32_t)r;
            int64_t id = local ? p->dst_slot[row + k] : -1;
            float w = local ? p->weight[row + k] : 0.0f;
            uint32_t wb;
            memcpy(&wb, &w, 4);
            uint64_t a = addr[l].buf[EPD_BUF_HT_RECV_TOPK_IDX] + (j * K + k) * 8;
            oom |= put32(s, a, (uint32_t)(uint64_t)id);
            oom |= put32(s, a + 4, (uint32_t)((uint64_t)id >> 32));
            oom |= put32(s, addr[l].buf[EPD_BUF_HT_RECV_TOPK_WEIGHTS] + (j * K + k) * 4, wb);
          }
        }
      }
    }
  for (uint32_t l = 0; l < L; l++) {
    uint32_t r = node * L + l;
    cnet_side_t *s = &pg->side[l];
    const int32_t *cnt = (mode == EPD_MODE_LL ? p->ll_count : p->ht_count) + (size_t)r * S;
    uint64_t cb = addr[l].buf[mode == EPD_MODE_LL ? EPD_BUF_LL_RECV_COUNT : EPD_BUF_HT_RECV_COUNT];
    /* a masked rank has no arena (address 0: its client is gone) and receives nothing */
    for (uint32_t sl = 0; cb && sl < S; sl++) oom |= put32(s, cb + sl * 4, (uint32_t)cnt[sl]);
    s->num_recv = mode == EPD_MODE_LL ? p->ll_recv[r] : p->ht_recv[r];
  }
  return oom ? EPD_ERR_NOMEM : EPD_OK;
}

/* This node's terms of token t of src: LL its entries here (k order), HT its rows here (rank order). */
static int own_terms(cnet_vec_t *terms, const epd_ref_plan_t *p, uint32_t L, uint32_t node, int mode,
                     const cnet_addr_t *addr, uint32_t src, uint32_t t) {
  const epd_ref_geom_t *g = &p->g;
  uint32_t W = g->num_ranks, M = g->max_tokens, K = g->topk;
  uint64_t rb = (uint64_t)g->hidden * 2;
  int oom = 0;
  if (mode == EPD_MODE_LL) {
    size_t row = ((size_t)src * M + t) * K;
    for (uint32_t k = 0; k < K; k++) {
      int32_t d = p->dst_rank[row + k];
      if (d < 0 || (uint32_t)d / L != node) continue;
      uint64_t j = (uint64_t)p->dst_slot[row + k] * W * M + (uint64_t)p->dst_pos[row + k];
      epd_k_net_term_t tm = {addr[(uint32_t)d % L].buf[EPD_BUF_LL_Y] + j * rb, p->weight[row + k], 0};
      oom |= vpush(terms, &tm, sizeof tm);
    }
  } else {
    const int32_t *hp = &p->ht_pos[((size_t)src * M + t) * W];
    for (uint32_t l = 0; l < L; l++) {
      int32_t j = hp[node * L + l];
      if (j < 0) continue;
      epd_k_net_term_t tm = {addr[l].buf[EPD_BUF_HT_Y] + (uint64_t)j * rb, 1.0f, 0};
      oom |= vpush(terms, &tm, sizeof tm);
    }
  }
  return oom;
}

static int close_row(cnet_vec_t *off, const cnet_vec_t *terms, cnet_vec_t *out, uint64_t dst) {
  uint32_t end = cnet_count(terms, sizeof(epd_k_net_term_t));
  int oom = vpush(out, &dst, sizeof dst);
  return oom | vpush(off, &end, sizeof end);
}

epd_result_t cnet_build_combine(cnet_prog_t *pg, const epd_ref_plan_t *p, uint32_t nodes, uint32_t node,
                                uint32_t L, int mode, const cnet_addr_t *addr) {
  epd_result_t rc = prog_begin(pg, p, nodes, node, L, 1, 0);
  if (rc) return rc;
  const epd_ref_geom_t *g = &p->g;
  uint32_t M = g->max_tokens, H = g->hidden;
  uint64_t fb = (uint64_t)H * 4, rb = (uint64_t)H * 2;
  uint32_t zero = 0;
  int oom = 0;
  for (uint32_t l = 0; l < L; l++) {
    cnet_side_t *s = &pg->side[l];
    oom |= vpush(&s->pre_off, &zero, 4);
    oom |= vpush(&s->post_off, &zero, 4);
    /* pre: partials of the rail peers' tokens received here, in exchange order */
    for (uint32_t n = 0; n < nodes; n++) {
      if (n == node) continue;
      const int32_t *ri = &pg->ridx[((size_t)l * nodes + n) * M];
      uint32_t peer = n * L + l;
      for (uint32_t t = 0; t < p->num_tokens[peer]; t++) {
        if (ri[t] < 0) continue;
        oom |= own_terms(&s->pre_terms, p, L, node, mode, addr, peer, t);
        oom |= close_row(&s->pre_off, &s->pre_terms, &s->pre_out, addr[l].psend[n] + (uint64_t)ri[t] * fb);
      }
    }
    /* post: every own token, node order */
    uint32_t own = node * L + l;
    for (uint32_t t = 0; t < p->num_tokens[own]; t++) {
      for (uint32_t n = 0; n < nodes; n++) {
        if (n == node) {
          oom |= own_terms(&s->post_terms, p, L, node, mode, addr, own, t);
          continue;
        }
        int32_t i = pg->sidx[((size_t)l * nodes + n) * M + t];
        if (i < 0) continue;
        epd_k_net_term_t tm = {addr[l].precv[n] + (uint64_t)i * fb, 1.0f, 1};
        oom |= vpush(&s->post_terms, &tm, sizeof tm);
      }
      oom |= close_row(&s->post_off, &s->post_terms, &s->post_out, addr[l].buf[EPD_BUF_OUT] + t * rb);
    }
    s->num_recv = mode == EPD_MODE_LL ? p->ll_recv[own] : p->ht_recv[own];
  }
  return oom ? EPD_ERR_NOMEM : EPD_OK;
}

/* ---- host emulation ----------------------------------------------------------------------------- */

void cnet_exec_rows(const cnet_vec_t *rows, uint32_t hidden, int fp8) {
  uint32_t n = cnet_count(rows, sizeof(epd_k_net_row_t)), nb = epd_ref_scale_blocks(hidden);
  const epd_k_net_row_t *r = (const epd_k_net_row_t *)rows->p;
  for (uint32_t i = 0; i < n; i++) {
    const uint16_t *x = (const uint16_t *)(uintptr_t)r[i].src;
    if (r[i].src_scales) {
      memcpy((void *)(uintptr_t)r[i].dst, x, hidden);
      memcpy((void *)(uintptr_t)r[i].scales, (const void *)(uintptr_t)r[i].src_scales, (size_t)nb * 4);
      continue;
    }
    if (!fp8) {
      memcpy((void *)(uintptr_t)r[i].dst, x, (size_t)hidden * 2);
      continue;
    }
    for (uint32_t b = 0; b < nb; b++)
      epd_ref_quant_row(x + b * 128, 128, (uint8_t *)(uintptr_t)r[i].dst + b * 128,
                        (float *)(uintptr_t)r[i].scales + b);
  }
}

void cnet_exec_wsum(const cnet_vec_t *off, const cnet_vec_t *terms, const cnet_vec_t *out, uint32_t hidden,
                    int out_f32) {
  uint32_t n = cnet_count(out, 8);
  const uint32_t *o = (const uint32_t *)off->p;
  const epd_k_net_term_t *tm = (const epd_k_net_term_t *)terms->p;
  const uint64_t *dst = (const uint64_t *)out->p;
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t h = 0; h < hidden; h++) {
      float acc = 0.0f;
      for (uint32_t t = o[i]; t < o[i + 1]; t++) {
        float v = tm[t].f32 ? ((const float *)(uintptr_t)tm[t].src)[h]
                            : epd_bf16_to_f32(((const uint16_t *)(uintptr_t)tm[t].src)[h]);
        float prod = tm[t].w * v;
        acc = acc + prod;
      }
      if (out_f32)
        ((float *)(uintptr_t)dst[i])[h] = acc;
      else
        ((uint16_t *)(uintptr_t)dst[i])[h] = epd_f32_to_bf16(acc);
    }
}

void cnet_exec_puts(const cnet_vec_t *puts) {
  uint32_t n = cnet_count(puts, sizeof(epd_k_net_put_t));
  const epd_k_net_put_t *p = (const epd_k_net_put_t *)puts->p;
  for (uint32_t i = 0; i < n; i++) memcpy((void *)(uintptr_t)p[i].dst, &p[i].value, 4);
}
