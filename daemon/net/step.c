/*
 * step.c - the host backend's step across nodes: each node sends the other nodes its ranks'
 * descriptors and the tokens routed to their ranks, runs the reference over the world once every part
 * is in, and returns its own ranks' results (scaleout.h, eng_net_step).
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/net_internal.h"

static void free_bufs(net_group_t *ng) {
  epd_ref_plan_free(&ng->lplan);
  for (int r = 0; r < EPD_MAX_RANKS; r++) {
    free(ng->x[r]);
    free(ng->idx[r]);
    free(ng->w[r]);
    ng->x[r] = NULL;
    ng->idx[r] = NULL;
    ng->w[r] = NULL;
  }
  free(ng->ht_local);
  ng->ht_local = NULL;
  ng->have_bufs = 0;
}

void eng_net_group_free(eng_group_t *grp) {
  net_group_t *ng = grp->net;
  if (!ng) return;
  /* The group's queued frames belong to this incarnation: a group of the same name created later
   * starts again at step 0 and must not take them. */
  net_drop_queued(ng->net, grp->name, -1);
  free_bufs(ng);
  eng_vote_reset(&ng->vote);
  for (int n = 0; n < MAX_NODES; n++) free(ng->frame[n]);
  free(ng);
  grp->net = NULL;
}

/* The host backend's step state of grp, its buffers allocated at the first call. */
static net_group_t *group_state(epd_engine_t *eng, eng_group_t *grp) {
  net_group_t *ng = grp->net;
  if (!ng || ng->have_bufs) return ng;
  const epd_ref_geom_t *g = &grp->g;
  uint32_t L = (uint32_t)eng->o.num_ranks, me = eng->o.node_rank;
  int ok = epd_ref_plan_init(&ng->lplan, g) == EPD_OK;
  ng->ht_local = calloc(g->num_ranks, sizeof *ng->ht_local);
  ok = ok && ng->ht_local;
  for (uint32_t r = 0; r < g->num_ranks && ok; r++) {
    if (r / L == me) continue;
    ng->x[r] = calloc((size_t)g->max_tokens * g->hidden, 2);
    ng->idx[r] = malloc((size_t)g->max_tokens * g->topk * 8);
    ng->w[r] = calloc((size_t)g->max_tokens * g->topk, 4);
    ok = ng->x[r] && ng->idx[r] && ng->w[r];
  }
  if (!ok) {
    free_bufs(ng);
    return NULL;
  }
  ng->have_bufs = 1;
  return ng;
}

/* Does token (src, t) of plan p have an entry on a rank of node n? */
static int goes_to(const epd_ref_plan_t *p, uint32_t L, uint32_t src, uint32_t t, uint32_t n) {
  const epd_ref_geom_t *g = &p->g;
  const int32_t *d = &p->dst_rank[((size_t)src * g->max_tokens + t) * g->topk];
  for (uint32_t k = 0; k < g->topk; k++)
    if (d[k] >= 0 && (uint32_t)d[k] / L == n) return 1;
  return 0;
}

/* acc += this node's part of OUT[src][t]: its ranks' weighted expert outputs (LL) / rows (HT). */
static void add_partial(const epd_ref_plan_t *p, int mode, uint32_t L, uint32_t node,
                        const uint16_t *const *y, uint32_t src, uint32_t t, float *acc) {
  const epd_ref_geom_t *g = &p->g;
  uint32_t R = g->num_ranks, M = g->max_tokens, K = g->topk, H = g->hidden;
  if (mode == EPD_MODE_LL) {
    size_t row = ((size_t)src * M + t) * K;
    for (uint32_t k = 0; k < K; k++) {
      int32_t d = p->dst_rank[row + k];
      if (d < 0 || (uint32_t)d / L != node || !y[d]) continue; /* !y: a rank masked since the dispatch */
      const uint16_t *yr = y[d] + ((size_t)p->dst_slot[row + k] * R * M + p->dst_pos[row + k]) * H;
      float w = p->weight[row + k];
      for (uint32_t h = 0; h < H; h++) acc[h] += w * epd_bf16_to_f32(yr[h]);
    }
  } else {
    const int32_t *hp = &p->ht_pos[((size_t)src * M + t) * R];
    for (uint32_t r = node * L; r < (node + 1) * L; r++) {
      if (hp[r] < 0 || !y[r]) continue;
      const uint16_t *yr = y[r] + (size_t)hp[r] * H;
      for (uint32_t h = 0; h < H; h++) acc[h] += epd_bf16_to_f32(yr[h]);
    }
  }
}

/* A growing byte buffer for frames. */
typedef struct obuf {
  uint8_t *p;
  size_t len, cap;
  int oom;
} obuf_t;
static void *oput(obuf_t *b, const void *src, size_t n) {
  if (b->oom) return NULL;
  if (b->len + n > b->cap) {
    size_t c = b->cap ? b->cap * 2 : 4096;
    while (c < b->len + n) c *= 2;
    uint8_t *q = realloc(b->p, c);
    if (!q) {
      b->oom = 1;
      return NULL;
    }
    b->p = q;
    b->cap = c;
  }
  void *at = b->p + b->len;
  if (src) memcpy(at, src, n);
  b->len += n;
  return at;
}

/* Build and send this node's frame of the step to every other node. */
static void send_step(epd_engine_t *eng, eng_group_t *grp, net_group_t *ng, epd_desc_t *desc) {
  epd_net_t *net = eng->o.net;
  const epd_ref_geom_t *g = &grp->g;
  uint32_t L = (uint32_t)eng->o.num_ranks, me = eng->o.node_rank, base = me * L, W = g->num_ranks;
  uint32_t M = g->max_tokens, H = g->hidden, K = g->topk;
  /* Masked ranks of this node take no part: their descriptors are the first live rank's, with no tokens
   * (eng_net_last_live_here keeps one live). */
  const uint64_t mask = grp->mask;
  uint32_t first = base;
  while (first + 1 < base + L && (mask >> first & 1)) first++;
  const epd_desc_t *d0 = &desc[first];
  int same = 1;
  for (uint32_t r = base; r < base + L; r++) {
    if (mask >> r & 1) {
      desc[r] = *d0;
      desc[r].num_tokens = 0;
      continue;
    }
    const epd_desc_t *d = &desc[r];
    same &= eng_op_ok(d->op) && d->bank < EPD_NUM_BANKS && d->op == d0->op && d->bank == d0->bank &&
            (d->flags & EPD_DESC_FP8) == (d0->flags & EPD_DESC_FP8);
  }
  ng->sent_mask = mask;
  ng->lstatus = EPD_OK;
  ng->lbad = -1;
  ng->lwhy[0] = 0;
  memset(ng->ht_local, 0, sizeof *ng->ht_local * W);
  int dispatch = same && eng_op_dispatch(d0->op),
      mode = d0->op <= EPD_OP_LL_COMBINE ? EPD_MODE_LL : EPD_MODE_HT;
  epd_ref_in_t in[EPD_MAX_RANKS]; /* this node's ranks' tokens (a dispatch) */
  memset(in, 0, sizeof in);
  if (dispatch) {
    eng_vote_switch(eng, grp, &ng->vote, grp->steps);
    for (uint32_t r = base; r < base + L; r++)
      if (!(mask >> r & 1)) in[r] = eng_ref_in(grp->client[r], d0->bank, desc[r].num_tokens);
    ng->lplan.renormalize = grp->renormalize;
    ng->lstatus =
        epd_ref_plan_build(&ng->lplan, eng_route_map(grp), in, &ng->lbad, ng->lwhy, sizeof ng->lwhy);
    if (!ng->lstatus) memcpy(ng->ht_local, ng->lplan.ht_recv, sizeof *ng->ht_local * W);
  }
  eng_vote_report(eng, grp, &ng->vote);
  const epd_ref_plan_t *gp = &grp->plan[d0->bank < EPD_NUM_BANKS ? d0->bank : 0];
  int combine = same && !dispatch && grp->plan_valid[d0->bank] && gp->mode == mode;
  if (same && !dispatch && !combine) {
    ng->lstatus = EPD_ERR_STATE;
    snprintf(ng->lwhy, sizeof ng->lwhy,
             "%s combine of bank %u without a successful %s dispatch of that bank "
             "on node %u",
             mode == EPD_MODE_LL ? "LL" : "HT", d0->bank, mode == EPD_MODE_LL ? "LL" : "HT", me);
  }
  const uint16_t *y[EPD_MAX_RANKS] = {0};
  if (combine)
    for (uint32_t r = base; r < base + L; r++)
      if (!(mask >> r & 1)) y[r] = eng_ref_y(grp->client[r], mode, d0->bank);
  for (uint32_t n = 0; n < eng->o.nodes; n++) {
    if (n == me || net_node_masked(eng, mask, n)) continue; /* a node out of the steps gets none */
    /* the link's header, then the part as the CUDA backend's: step header, descriptors, this backend's
     * own (HT counts, then tokens or partials) */
    obuf_t b = {0};
    net_hdr_t lh = {.magic = NET_MAGIC, .src_node = me, .step = grp->steps};
    snprintf(lh.group, sizeof lh.group, "%s", grp->name);
    oput(&b, &lh, sizeof lh);
    net_step_hdr_t h = {.status = ng->lstatus,
                        .bad_rank = ng->lbad,
                        .nlocal = L,
                        .world = W,
                        .num_experts = g->num_experts,
                        .hidden = H,
                        .topk = K,
                        .max_tokens = M,
                        .map_version = grp->map.version,
                        .staged_version = ng->vote.rep.version,
                        .map_hash = epd_net_map_hash(&grp->map),
                        .staged_hash = ng->vote.rep_hash,
                        .mask = mask};
    snprintf(h.why, sizeof h.why, "%.*s", (int)sizeof h.why - 1, ng->lwhy);
    oput(&b, &h, sizeof h);
    for (uint32_t r = base; r < base + L; r++) {
      net_step_desc_t nd = {desc[r].op, desc[r].bank, desc[r].flags, desc[r].num_tokens};
      oput(&b, &nd, sizeof nd);
    }
    oput(&b, ng->ht_local, sizeof *ng->ht_local * W);
    if (dispatch && !ng->lstatus) {
      /* Each token once per destination node, only if it routes to a rank there. */
      for (uint32_t r = base; r < base + L; r++) {
        size_t at = b.len;
        uint32_t cnt = 0;
        oput(&b, &cnt, 4);
        for (uint32_t t = 0; t < ng->lplan.num_tokens[r]; t++) {
          if (!goes_to(&ng->lplan, L, r, t, n)) continue;
          oput(&b, &t, 4);
          oput(&b, in[r].x + (size_t)t * H, (size_t)H * 2);
          oput(&b, in[r].topk_idx + (size_t)t * K, (size_t)K * 8);
          oput(&b, in[r].topk_weights + (size_t)t * K, (size_t)K * 4);
          cnt++;
        }
        if (!b.oom) memcpy(b.p + at, &cnt, 4);
      }
    } else if (combine) {
      /* One float32 partial per (token of node n, this node). */
      float *acc = malloc(sizeof(float) * H);
      for (uint32_t s = n * L; s < (n + 1) * L && acc; s++) {
        size_t at = b.len;
        uint32_t cnt = 0;
        oput(&b, &cnt, 4);
        for (uint32_t t = 0; t < gp->num_tokens[s]; t++) {
          if (!goes_to(gp, L, s, t, me)) continue;
          for (uint32_t hh = 0; hh < H; hh++) acc[hh] = 0;
          add_partial(gp, mode, L, me, y, s, t, acc);
          oput(&b, &t, 4);
          oput(&b, acc, sizeof(float) * H);
          cnt++;
        }
        if (!b.oom) memcpy(b.p + at, &cnt, 4);
      }
      if (!acc) b.oom = 1;
      free(acc);
    }
    if (b.oom) {
      /* Tell the peer rather than leave it to time out. */
      b.len = 0;
      b.oom = 0;
      /* the same header with no ranks: the receivers fail the step with its status */
      h.status = EPD_ERR_NOMEM;
      h.bad_rank = (int32_t)base;
      h.nlocal = 0;
      snprintf(h.why, sizeof h.why, "node %u: out of memory building the step's frame", me);
      oput(&b, &lh, sizeof lh);
      oput(&b, &h, sizeof h);
      ng->lstatus = EPD_ERR_NOMEM;
      ng->lbad = (int)base;
      snprintf(ng->lwhy, sizeof ng->lwhy, "%s", h.why);
    }
    if (b.p) net_send(net, n, b.p, b.len);
    free(b.p);
  }
}

int eng_net_missing_rank(epd_engine_t *eng, const eng_group_t *grp, const int *arrived, char *why,
                         size_t len) {
  uint32_t L = (uint32_t)eng->o.num_ranks, me = eng->o.node_rank, base = me * L;
  for (uint32_t r = base; r < base + L; r++)
    if (!arrived[r] && !(grp->mask >> r & 1)) {
      snprintf(why, len, "waited %u ms for rank %u", eng->o.step_timeout_ms, r);
      return (int)r;
    }
  const net_group_t *ng = grp->net;
  for (uint32_t n = 0; n < eng->o.nodes; n++)
    if (n != me && !(ng && ng->frame[n]) &&
        !(ng && ng->sent_step == grp->steps && net_node_masked(eng, ng->sent_mask, n)) &&
        !net_has(eng->o.net, grp->name, grp->steps, n)) {
      net_silent_why(n, L, eng->o.step_timeout_ms, why, len);
      return (int)(n * L);
    }
  snprintf(why, len, "waited %u ms for the step", eng->o.step_timeout_ms);
  return -1;
}

static int fail(eng_net_result_t *res, int status, int peer, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int fail(eng_net_result_t *res, int status, int peer, const char *fmt, ...) {
  res->status = status;
  res->peer = peer;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(res->why, sizeof res->why, fmt, ap);
  va_end(ap);
  return 1;
}

static void drop_frames(net_group_t *ng) {
  for (int n = 0; n < MAX_NODES; n++) {
    free(ng->frame[n]);
    ng->frame[n] = NULL;
  }
}

static int run_step(epd_engine_t *eng, eng_group_t *grp, net_group_t *ng, const epd_desc_t *desc,
                    eng_net_result_t *res) {
  const epd_ref_geom_t *g = &grp->g;
  uint32_t L = (uint32_t)eng->o.num_ranks, me = eng->o.node_rank, base = me * L, W = g->num_ranks;
  uint32_t nodes = eng->o.nodes, M = g->max_tokens, H = g->hidden, K = g->topk;
  /* The global descriptors, world rank order; each node's step header (this node's own status in own) and
   * the host backend's part after the descriptors: HT counts per world rank, then the payload. */
  epd_desc_t d[EPD_MAX_RANKS];
  const net_step_hdr_t *hs[MAX_NODES] = {0};
  const uint8_t *pay[MAX_NODES] = {0}, *end[MAX_NODES] = {0};
  const uint32_t *htc[MAX_NODES] = {0};
  net_step_hdr_t own = {.status = ng->lstatus, .bad_rank = ng->lbad};
  snprintf(own.why, sizeof own.why, "%.*s", (int)sizeof own.why - 1, ng->lwhy);
  char why[256];
  int peer = -1, st;
  for (uint32_t n = 0; n < nodes; n++)
    hs[n] = n == me ? &own : ng->frame[n] ? (const net_step_hdr_t *)ng->frame[n] : NULL;
  net_vote_frames(&ng->vote, hs, nodes, me, grp->steps);
  /* A node that could not build its frame (out of memory) fails the step everywhere. */
  if (ng->lstatus == EPD_ERR_NOMEM) return fail(res, EPD_ERR_NOMEM, ng->lbad, "%s", ng->lwhy);
  for (uint32_t n = 0; n < nodes; n++) {
    if (n == me) {
      for (uint32_t r = base; r < base + L; r++) d[r] = desc[r];
      htc[n] = ng->ht_local;
      continue;
    }
    if (!ng->frame[n]) continue; /* a node out of the step (its ranks all masked: below) */
    const net_step_hdr_t *h = hs[n];
    if (h->nlocal == 0) return fail(res, h->status ? h->status : EPD_ERR_PEER, h->bad_rank, "%s", h->why);
    if ((st = net_frame_geom(h, ng->flen[n], (size_t)W * 4, n, me, L, W, g, grp->name, &peer, why,
                             sizeof why)))
      return fail(res, st, peer, "%s", why);
    net_frame_descs(h, n, L, d);
    htc[n] = (const uint32_t *)(net_step_descs(h) + L);
    pay[n] = (const uint8_t *)(htc[n] + W);
    end[n] = ng->frame[n] + ng->flen[n];
  }
  /* every frame in had the mask this node sent (eng_net_step, mask_differs); the ranks of a node out of
   * the step take part as masked ranks do */
  const uint64_t mask = ng->sent_mask;
  res->mask = mask;
  for (uint32_t r = 0; r < W; r++)
    if (r / L != me && !ng->frame[r / L]) {
      d[r] = desc[base];
      d[r].num_tokens = 0;
      d[r].user_tag = 0;
    }
  /* masked ranks' descriptors are their node's first live rank's */
  if ((st = net_check_descs(d, W, &peer, why, sizeof why))) return fail(res, st, peer, "%s", why);
  uint32_t op = d[0].op, bank = d[0].bank;
  int fp8 = (d[0].flags & EPD_DESC_FP8) != 0, mode = op <= EPD_OP_LL_COMBINE ? EPD_MODE_LL : EPD_MODE_HT;
  epd_ref_plan_t *plan = &grp->plan[bank];
  res->map_version = grp->map.version;
  if (eng_op_dispatch(op)) {
    /* the host backend checks FP8's hidden here; the CUDA backend refuses such a group at attach */
    if (fp8 && H % 128)
      return fail(res, EPD_ERR_INVALID, -1, "FP8 dispatch needs hidden a multiple of 128 (hidden %u)", H);
    if ((st = net_check_maps(hs, nodes, me, L, grp->map.version, epd_net_map_hash(&grp->map), &peer, why,
                             sizeof why)))
      return fail(res, st, peer, "%s", why);
    /* Input errors, the lowest node's first (every node reports the same). The host backend's parts carry
     * each node's routing errors of its own tokens, so they come after the agreement on what to run; the
     * CUDA backend's carry only a node's failure to take part, checked first there. */
    if ((st = net_frames_status(hs, nodes, me, L, &peer, why, sizeof why)))
      return fail(res, st, peer, "%s", why);
    /* HT capacity over the world: the sum of every node's counts. */
    if (mode == EPD_MODE_HT)
      for (uint32_t r = 0; r < W; r++) {
        uint64_t sum = 0;
        for (uint32_t n = 0; n < nodes; n++) sum += htc[n] ? htc[n][r] : 0;
        if (sum > g->ht_capacity)
          return fail(res, EPD_ERR_OVERFLOW, (int)r, "rank %u would receive %llu tokens, HT capacity %u", r,
                      (unsigned long long)sum, g->ht_capacity);
      }
    /* The global view: own ranks' arenas, the other ranks' received tokens (the rest routes nowhere). */
    epd_ref_in_t in[EPD_MAX_RANKS];
    epd_ref_out_t outs[EPD_MAX_RANKS], *out[EPD_MAX_RANKS];
    memset(outs, 0, sizeof outs);
    for (uint32_t r = 0; r < W; r++) {
      out[r] = NULL;
      if (r / L == me && (mask >> r & 1)) {
        memset(&in[r], 0, sizeof in[r]);
        continue;
      }
      if (r / L == me) {
        eng_ref_io(grp->client[r], mode, bank, d[r].num_tokens, &in[r], &outs[r]);
        out[r] = &outs[r];
        continue;
      }
      uint32_t T = d[r].num_tokens > M ? M : d[r].num_tokens;
      for (size_t i = 0; i < (size_t)T * K; i++) ng->idx[r][i] = -1;
      in[r] = (epd_ref_in_t){T, ng->x[r], ng->idx[r], ng->w[r]};
    }
    for (uint32_t n = 0; n < nodes; n++) {
      if (n == me || !pay[n]) continue;
      const uint8_t *p = pay[n];
      size_t ent = 4 + (size_t)H * 2 + (size_t)K * 12;
      for (uint32_t r = n * L; r < (n + 1) * L; r++) {
        uint32_t cnt;
        if (p + 4 > end[n])
          return fail(res, EPD_ERR_PEER, (int)r, "node %u sent a truncated dispatch frame", n);
        memcpy(&cnt, p, 4);
        p += 4;
        if (cnt > in[r].num_tokens || (size_t)(end[n] - p) < cnt * ent)
          return fail(res, EPD_ERR_PEER, (int)r, "node %u sent a malformed dispatch frame", n);
        for (uint32_t i = 0; i < cnt; i++, p += ent) {
          uint32_t t;
          memcpy(&t, p, 4);
          if (t >= in[r].num_tokens)
            return fail(res, EPD_ERR_PEER, (int)r, "node %u sent token %u of %u", n, t, in[r].num_tokens);
          memcpy(ng->x[r] + (size_t)t * H, p + 4, (size_t)H * 2);
          memcpy(ng->idx[r] + (size_t)t * K, p + 4 + (size_t)H * 2, (size_t)K * 8);
          memcpy(ng->w[r] + (size_t)t * K, p + 4 + (size_t)H * 2 + (size_t)K * 8, (size_t)K * 4);
        }
      }
    }
    why[0] = 0;
    int bad = -1;
    grp->plan_valid[bank] = 0;
    plan->renormalize = grp->renormalize;
    /* route with the mask every node sent: a notice may have changed grp->mask since */
    const epd_expert_map_t *route = eng_route_map(grp);
    epd_expert_map_t sent_map;
    memset(&sent_map, 0, sizeof sent_map);
    if (mask != grp->mask) {
      if (mask && epd_ref_map_mask(&sent_map, &grp->map, mask))
        return fail(res, EPD_ERR_NOMEM, -1, "out of memory for the step's masked map");
      route = mask ? &sent_map : &grp->map;
    }
    epd_result_t rc = epd_ref_plan_build(plan, route, in, &bad, why, sizeof why);
    epd_expert_map_free(&sent_map);
    if (rc) return fail(res, rc, bad, "%s", why);
    rc = mode == EPD_MODE_LL ? epd_ref_ll_dispatch(plan, in, fp8, out)
                             : epd_ref_ht_dispatch(plan, in, fp8, out, &bad);
    if (rc) return fail(res, rc, bad, "dispatch failed (rank %d)", bad);
    grp->plan_valid[bank] = 1;
    grp->plan_mask[bank] = mask;
    grp->open_banks |= 1u << bank;
    res->map_version = plan->map_version;
    uint64_t row = (uint64_t)H * (fp8 ? 1 : 2) + (fp8 ? epd_ref_scale_blocks(H) * 4 : 0);
    for (uint32_t r = base; r < base + L; r++) {
      res->num_recv[r] = mode == EPD_MODE_LL ? plan->ll_recv[r] : plan->ht_recv[r];
      grp->step_dropped[r] = plan->dropped[r];
      grp->entries_dropped += plan->dropped[r];
      uint64_t rows = 0;
      for (uint32_t t = 0; t < plan->num_tokens[r]; t++)
        for (uint32_t k = 0; k < K; k++) rows += plan->dst_rank[((size_t)r * M + t) * K + k] >= 0;
      res->bytes[r] = rows * row;
    }
    /* Statistics count the tokens of this node's ranks (each node counts its own). */
    for (uint32_t e = 0; e < g->num_experts; e++) grp->expert_tokens[e] += ng->lplan.expert_tokens[e];
    for (size_t i = 0; i < (size_t)W * g->slots_per_rank; i++)
      grp->slot_tokens[i] += ng->lplan.slot_tokens[i];
    res->status = EPD_OK;
    return 1;
  }
  /* Combine: own partials plus every other node's, added in node order, rounded once. A node that
   * could not combine (no valid dispatch of the bank there) says so in its frame. */
  if ((st = net_frames_status(hs, nodes, me, L, &peer, why, sizeof why)))
    return fail(res, st, peer, "%s", why);
  if (!grp->plan_valid[bank] || plan->mode != mode)
    return fail(res, EPD_ERR_STATE, -1, "%s combine of bank %u without a successful %s dispatch of that bank",
                mode == EPD_MODE_LL ? "LL" : "HT", bank, mode == EPD_MODE_LL ? "LL" : "HT");
  const uint16_t *y[EPD_MAX_RANKS] = {0};
  for (uint32_t r = base; r < base + L; r++)
    if (!(mask >> r & 1)) y[r] = eng_ref_y(grp->client[r], mode, bank);
  /* Ranks masked since the dispatch: their expert outputs are gone, their entries dropped (as on one node).
   */
  const uint64_t gone = mask & ~grp->plan_mask[bank];
  grp->open_banks &= ~(1u << bank);
  /* Index the partial rows: part[n][(r - base) * M + t]. */
  const float **part = calloc((size_t)nodes * L * M, sizeof *part);
  float *acc = malloc(sizeof(float) * H);
  if (!part || !acc) {
    free(part);
    free(acc);
    return fail(res, EPD_ERR_NOMEM, -1, "out of memory combining");
  }
  int bad_frame = -1;
  for (uint32_t n = 0; n < nodes && bad_frame < 0; n++) {
    if (n == me || !pay[n]) continue;
    const uint8_t *p = pay[n];
    size_t ent = 4 + (size_t)H * 4;
    for (uint32_t r = base; r < base + L && bad_frame < 0; r++) {
      uint32_t cnt;
      if (p + 4 > end[n]) {
        bad_frame = (int)n;
        break;
      }
      memcpy(&cnt, p, 4);
      p += 4;
      if ((size_t)(end[n] - p) < cnt * ent) bad_frame = (int)n;
      for (uint32_t i = 0; i < cnt && bad_frame < 0; i++, p += ent) {
        uint32_t t;
        memcpy(&t, p, 4);
        if (t >= M)
          bad_frame = (int)n;
        else
          part[((size_t)n * L + (r - base)) * M + t] = (const float *)(p + 4);
      }
    }
  }
  if (bad_frame >= 0) {
    free(part);
    free(acc);
    return fail(res, EPD_ERR_PEER, bad_frame * (int)L, "node %d sent a malformed combine frame", bad_frame);
  }
  for (uint32_t r = base; r < base + L; r++) {
    if (mask >> r & 1) continue;
    grp->step_dropped[r] = plan->dropped[r];
    if (gone) {
      const uint32_t nd = epd_ref_plan_routed_to(plan, r, gone);
      grp->step_dropped[r] += nd;
      grp->entries_dropped += nd;
    }
    uint16_t *o = eng_buf(grp->client[r], EPD_BUF_OUT, bank);
    for (uint32_t t = 0; t < plan->num_tokens[r]; t++) {
      for (uint32_t h = 0; h < H; h++) acc[h] = 0;
      for (uint32_t n = 0; n < nodes; n++) {
        if (n == me) {
          add_partial(plan, mode, L, me, y, r, t, acc);
          continue;
        }
        const float *pr = part[((size_t)n * L + (r - base)) * M + t];
        if (pr)
          for (uint32_t h = 0; h < H; h++) acc[h] += pr[h];
      }
      for (uint32_t h = 0; h < H; h++) o[(size_t)t * H + h] = epd_f32_to_bf16(acc[h]);
    }
    res->num_recv[r] = mode == EPD_MODE_LL ? plan->ll_recv[r] : plan->ht_recv[r];
    res->bytes[r] = (uint64_t)res->num_recv[r] * H * 2;
  }
  free(part);
  free(acc);
  res->status = EPD_OK;
  return 1;
}

int eng_net_step(epd_engine_t *eng, eng_group_t *grp, const int *arrived, epd_desc_t *desc,
                 eng_net_result_t *res) {
  uint32_t L = (uint32_t)eng->o.num_ranks, me = eng->o.node_rank, base = me * L;
  memset(res, 0, sizeof *res);
  res->peer = -1;
  for (uint32_t r = base; r < base + L; r++)
    if (!arrived[r] && !(grp->mask >> r & 1)) return 0; /* masked ranks take no part */
  net_group_t *ng = group_state(eng, grp);
  if (!ng) return fail(res, EPD_ERR_NOMEM, -1, "out of memory for the group's scale-out state");
  if (ng->sent_step != grp->steps) {
    if (eng_net_joining(eng, grp)) return 0; /* made just now: the step number comes with the replies */
    drop_frames(ng);
    send_step(eng, grp, ng, desc);
    ng->sent_step = grp->steps;
  }
  /* the other nodes' parts (the local ranks' op: desc[base]'s; run_step checks that they agree); the
   * engine's collection times the step out */
  int peer = -1;
  const int st = net_parts_take(eng, grp, grp->name, grp->steps, NG(grp)->frames_since, ng->sent_mask,
                                eng_op_dispatch(desc[base].op), 0, ng->frame, ng->flen, &peer, res->why,
                                sizeof res->why);
  if (st == NET_PARTS_WAIT) return 0; /* parts still to come */
  if (st != NET_PARTS_IN) {
    drop_frames(ng);
    res->status = st;
    res->peer = peer;
    return 1;
  }
  int done = run_step(eng, grp, ng, desc, res);
  drop_frames(ng);
  return done;
}
