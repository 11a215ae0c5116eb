/*
 * frame.c - the checks every node runs on the parts of a step across nodes, for both backends (frame.h).
 * Every node sees the same parts, so every node reaches the same verdict.
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/net_internal.h"

static int verdict(int status, int rank, int *peer, char *why, size_t wl, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
static int verdict(int status, int rank, int *peer, char *why, size_t wl, const char *fmt, ...) {
  *peer = rank;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, wl, fmt, ap);
  va_end(ap);
  return status;
}

int net_frame_geom(const net_step_hdr_t *h, size_t len, size_t tail, uint32_t n, uint32_t me, uint32_t L,
                   uint32_t W, const epd_ref_geom_t *g, const char *group, int *peer, char *why, size_t wl) {
  if (h->num_experts != g->num_experts || h->hidden != g->hidden || h->topk != g->topk ||
      h->max_tokens != g->max_tokens)
    return verdict(
        EPD_ERR_MISMATCH, (int)(n * L), peer, why, wl,
        "group %s has num_experts %u, hidden %u, topk %u, max_tokens %u on node %u but %u, %u, %u, "
        "%u on node %u (the first attach on each node fixes it)",
        group, h->num_experts, h->hidden, h->topk, h->max_tokens, n, g->num_experts, g->hidden, g->topk,
        g->max_tokens, me);
  if (h->nlocal != L || h->world != W || len < sizeof *h + (size_t)L * sizeof(net_step_desc_t) + tail)
    return verdict(EPD_ERR_MISMATCH, (int)(n * L), peer, why, wl,
                   "node %u sent a frame for %u ranks of %u, this node expects %u of %u (engine.num_ranks "
                   "differs?)",
                   n, h->nlocal, h->world, L, W);
  return 0;
}

void net_frame_descs(const net_step_hdr_t *h, uint32_t n, uint32_t L, epd_desc_t *d) {
  const net_step_desc_t *nd = net_step_descs(h);
  for (uint32_t i = 0; i < L; i++) {
    memset(&d[n * L + i], 0, sizeof d[0]);
    d[n * L + i].op = nd[i].op;
    d[n * L + i].bank = nd[i].bank;
    d[n * L + i].flags = nd[i].flags;
    d[n * L + i].num_tokens = nd[i].num_tokens;
  }
}

int net_check_descs(const epd_desc_t *d, uint32_t W, int *peer, char *why, size_t wl) {
  for (uint32_t r = 0; r < W; r++) {
    if (!eng_op_ok(d[r].op))
      return verdict(EPD_ERR_INVALID, (int)r, peer, why, wl, "rank %u: op %u out of range [1, %u]", r,
                     d[r].op, EPD_OP_MAX - 1);
    if (d[r].bank >= EPD_NUM_BANKS)
      return verdict(EPD_ERR_INVALID, (int)r, peer, why, wl, "rank %u: bank %u out of range [0, %u)", r,
                     d[r].bank, EPD_NUM_BANKS);
    const int fl = eng_check_flags(&d[r], r, 1, why, wl);
    if (fl) {
      *peer = (int)r;
      return fl;
    }
  }
  for (uint32_t r = 1; r < W; r++)
    if (d[r].op != d[0].op || d[r].bank != d[0].bank ||
        (eng_op_dispatch(d[r].op) && (d[r].flags & EPD_DESC_FP8) != (d[0].flags & EPD_DESC_FP8)))
      return verdict(EPD_ERR_MISMATCH, (int)r, peer, why, wl,
                     "rank %u submitted op %u bank %u flags 0x%x, rank 0 op %u bank %u flags 0x%x", r,
                     d[r].op, d[r].bank, d[r].flags, d[0].op, d[0].bank, d[0].flags);
  return 0;
}

int net_check_maps(const net_step_hdr_t *const *h, uint32_t nodes, uint32_t me, uint32_t L, uint32_t version,
                   uint64_t hash, int *peer, char *why, size_t wl) {
  for (uint32_t n = 0; n < nodes; n++)
    if (n != me && h[n] && (h[n]->map_version != version || h[n]->map_hash != hash))
      return verdict(EPD_ERR_MISMATCH, (int)(n * L), peer, why, wl,
                     "node %u dispatches with expert map version %u, node %u with version %u%s (set the same "
                     "map on every node)",
                     n, h[n]->map_version, me, version,
                     h[n]->map_version == version ? " but different placements" : "");
  return 0;
}

void net_vote_frames(eng_map_vote_t *v, const net_step_hdr_t *const *h, uint32_t nodes, uint32_t me,
                     uint64_t step) {
  eng_map_peer_t peers[EPD_MAX_RANKS] = {{0}};
  uint32_t np = 0;
  for (uint32_t n = 0; n < nodes && np < EPD_MAX_RANKS; n++)
    if (n != me && h[n])
      peers[np++] =
          (eng_map_peer_t){h[n]->staged_version, h[n]->map_version, h[n]->staged_hash, h[n]->map_hash};
  eng_vote_agree(v, peers, np, step);
}

int net_frames_status(const net_step_hdr_t *const *h, uint32_t nodes, uint32_t me, uint32_t L, int *peer,
                      char *why, size_t wl) {
  for (uint32_t n = 0; n < nodes; n++)
    if (h[n] && h[n]->status)
      return verdict(h[n]->status,
                     h[n]->status != EPD_ERR_DRAINING ? h[n]->bad_rank
                     : n == me                        ? -1
                                                      : (int)(n * L),
                     peer, why, wl, "%.*s", (int)sizeof h[n]->why, h[n]->why);
  return 0;
}

int net_part_missing(epd_engine_t *eng, eng_group_t *grp, const char *group, uint32_t n, uint64_t step,
                     int dispatch, uint64_t later, int *peer, char *why, size_t wl) {
  const uint32_t L = (uint32_t)eng->o.num_ranks;
  char lw[160];
  if (epd_net_node_dead(eng->o.net, n, lw, sizeof lw)) {
    if (grp) net_node_out(eng, grp, n, "the link to its node is down");
    return verdict(EPD_ERR_PEER, (int)(n * L), peer, why, wl,
                   "the data link to node %u (ranks %u..%u) is down: %s", n, n * L, n * L + L - 1, lw);
  }
  if (grp && eng_net_drain_from(grp, n) <= step && dispatch) {
    /* its notice came after every frame it sent (one link, in order): this dispatch's part will not come
     * (a draining node still runs combines: their parts come as usual); groups that mask go on without
     * it from the next step */
    net_node_out(eng, grp, n, "its node is draining");
    return verdict(EPD_ERR_DRAINING, (int)(n * L), peer, why, wl,
                   "node %u (ranks %u..%u) is draining: it takes no dispatch of group %s from step %llu on",
                   n, n * L, n * L + L - 1, group, (unsigned long long)eng_net_drain_from(grp, n));
  }
  const int gone = grp ? eng_net_gone(grp, n, L, step, why, wl) : -1;
  if (gone >= 0) {
    net_node_out(eng, grp, n,
                 NG(grp)->gone_from[n] <= step ? "the group was removed on its node"
                                               : "the last live rank of its node lost its client");
    *peer = gone;
    return EPD_ERR_PEER;
  }
  if (later) {
    eng_net_skipped(group, n, L, step, later, why, wl);
    *peer = (int)(n * L);
    return EPD_ERR_PEER;
  }
  return 0;
}

int net_frames_mask(epd_engine_t *eng, eng_group_t *grp, const net_step_hdr_t *const *h, uint64_t sent,
                    int *peer, char *why, size_t wl) {
  const uint32_t L = (uint32_t)eng->o.num_ranks, me = eng->o.node_rank;
  uint64_t differ = 0;
  for (uint32_t n = 0; n < eng->o.nodes; n++) {
    if (n == me || !h[n]) continue;
    differ |= h[n]->mask ^ sent;
    /* a draining node's refused dispatch (this step fails with EPD_ERR_DRAINING): out of the next steps,
     * as where its part does not come (net_part_missing) */
    if (grp && h[n]->status == EPD_ERR_DRAINING) net_node_out(eng, grp, n, "its node is draining");
  }
  if (!differ) return 0;
  for (uint32_t n = 0; grp && n < eng->o.nodes; n++) {
    /* a part sent before its node's loss came here must not take the node back in */
    if (n == me || !h[n] || net_node_gone(eng, grp, n)) continue;
    for (uint32_t r = n * L; r < (n + 1) * L && r < 64; r++) {
      if ((h[n]->mask >> r & 1) && !(grp->mask >> r & 1))
        eng_mask_rank(eng, grp, (int)r, "masked on its node");
      if (!(h[n]->mask >> r & 1) && (grp->mask >> r & 1)) eng_unmask_rank(eng, grp, (int)r);
    }
  }
  const int r = __builtin_ctzll(differ);
  return verdict(
      EPD_ERR_PEER, r, peer, why, wl,
      "rank %d is %smasked on node %u but not on every node yet: the step fails, the next one runs "
      "without the ranks each node masked",
      r, (sent >> r & 1) ? "" : "not ", me);
}

void net_silent_why(uint32_t n, uint32_t L, uint32_t timeout_ms, char *why, size_t wl) {
  snprintf(why, wl, "waited %u ms for rank %u: node %u (ranks %u..%u) did not send its part of the step",
           timeout_ms, n * L, n, n * L, n * L + L - 1);
}

int net_parts_take(epd_engine_t *eng, eng_group_t *grp, const char *group, uint64_t step, uint64_t since,
                   uint64_t sent_mask, int dispatch, uint64_t timeout_from, uint8_t **frame, size_t *flen,
                   int *peer, char *why, size_t wl) {
  epd_net_t *net = eng->o.net;
  const uint32_t L = (uint32_t)eng->o.num_ranks, me = eng->o.node_rank;
  /* every part that came, then what a missing one means */
  uint64_t later[MAX_NODES] = {0}; /* node n's part of a later step came with none of this one's */
  const net_step_hdr_t *h[MAX_NODES] = {0};
  int missing = 0, st;
  for (uint32_t n = 0; n < eng->o.nodes && n < MAX_NODES; n++) {
    if (n == me) continue;
    if (net_node_masked(eng, sent_mask, n)) {
      size_t len;
      free(epd_net_take_payload(net, group, step, n, since, NULL, &len));
      continue;
    }
    if (!frame[n]) frame[n] = epd_net_take_payload(net, group, step, n, since, &later[n], &flen[n]);
    missing |= !frame[n];
    if (frame[n] && flen[n] >= sizeof(net_step_hdr_t)) h[n] = (const net_step_hdr_t *)frame[n];
  }
  *peer = -1;
  if ((st = net_frames_mask(eng, grp, h, sent_mask, peer, why, wl))) return st;
  for (uint32_t n = 0; missing && n < eng->o.nodes && n < MAX_NODES; n++) {
    if (n == me || frame[n] || net_node_masked(eng, sent_mask, n)) continue;
    if ((st = net_part_missing(eng, grp, group, n, step, dispatch, later[n], peer, why, wl))) return st;
    const uint64_t now = eng_now_ns();
    if (timeout_from && now > timeout_from &&
        now - timeout_from > (uint64_t)eng->o.step_timeout_ms * 1000000ull) {
      net_silent_why(n, L, eng->o.step_timeout_ms, why, wl);
      eng->rank[n * L].timeouts++;
      *peer = (int)(n * L);
      return EPD_ERR_TIMEOUT;
    }
  }
  return missing ? NET_PARTS_WAIT : NET_PARTS_IN;
}
