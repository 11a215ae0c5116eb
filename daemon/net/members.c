/*
 * members.c - groups across nodes: a group's state (net_group_t), what the other nodes announce (removed
 * groups, drains, lost and masked ranks, joins of a group made again or of a restarted daemon), and the
 * table the core calls (eng_net_scaleout).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/net_internal.h"

static epd_result_t group_init(epd_engine_t *eng, eng_group_t *grp) {
  net_group_t *ng = calloc(1, sizeof *ng);
  if (!ng) return EPD_ERR_NOMEM;
  ng->sent_step = UINT64_MAX;
  ng->net = eng->o.net;
  for (int n = 0; n < EPD_MAX_RANKS; n++)
    ng->drain_from[n] = ng->gone_from[n] = ng->lost_from[n] = UINT64_MAX;
  grp->net = ng;
  return EPD_OK;
}

uint64_t eng_net_drain_from(const eng_group_t *grp, uint32_t n) {
  return grp->net && n < EPD_MAX_RANKS ? NG(grp)->drain_from[n] : UINT64_MAX;
}
uint64_t eng_net_frames_since(const eng_group_t *grp) {
  return grp->net ? NG(grp)->frames_since : 0;
}

/* (mu) To every other node: group grp is gone here from step `from` on (UINT64_MAX: it exists again). */
static void send_gone(epd_engine_t *eng, const eng_group_t *grp, uint64_t from) {
  epd_net_t *net = eng->o.net;
  ctl_msg_t m = {.kind = CTL_GONE, .req_id = from};
  for (uint32_t n = 0; n < eng->o.nodes; n++)
    if (n != eng->o.node_rank && net_send_ctl(net, n, grp->name, &m, NULL, NULL) && from != UINT64_MAX)
      EPD_LOGW(EPD_SUB_ENGINE,
               "group %s: the notice of its removal to node %u was not sent (its link is down)", grp->name,
               n);
}

/* (engine mu) name was removed here (and forget it: take), or remember that it was (put). */
static int removed_take(epd_net_t *net, const char *name) {
  for (uint32_t i = 0; i < 64; i++)
    if (net->removed[i][0] && !strcmp(net->removed[i], name)) {
      net->removed[i][0] = 0;
      return 1;
    }
  return 0;
}

void eng_net_group_removed(epd_engine_t *eng, eng_group_t *grp) {
  epd_net_t *net = eng->o.net;
  if (eng->o.nodes <= 1 || !net) return;
  /* from the first step whose part this node did not send: a step that failed here before its part went
   * out (a client left mid-collection) is one the others wait for too */
  const net_group_t *ng = grp->net;
  send_gone(eng, grp,
            ng && ng->sent_step != UINT64_MAX && ng->sent_step < grp->steps ? ng->sent_step + 1 : grp->steps);
  removed_take(net, grp->name); /* one entry per name */
  net->removed_next = (net->removed_next + 1) % 64;
  snprintf(net->removed[net->removed_next], sizeof net->removed[0], "%s", grp->name);
  /* made again here later, the group stages the newest map it had (the other nodes run it, or have it
   * staged): the maps then agree again through the frames' votes (a map with weight copies is not kept) */
  const epd_expert_map_t *m = grp->has_staged && !grp->nstaged_copies ? &grp->staged : &grp->map;
  if (m->version > 1 && net_pending_put(eng, eng->o.net, grp->name, m, 0))
    EPD_LOGW(EPD_SUB_ENGINE, "group %s: its expert map version %u is not kept for its next creation here",
             grp->name, m->version);
}

/* To node n, which made grp (or attached a lost rank of it) again: the step grp collects here (UINT64_MAX:
 * no such group here) and the map it runs (their version and hash, read under the engine lock). */
void net_send_join(epd_net_t *net, uint32_t n, const char *group, uint64_t steps, uint32_t version,
                   uint64_t hash, uint64_t mask) {
  ctl_msg_t r = {.kind = CTL_JOIN, .req_id = steps, .version = version, .hash = hash, .mask = mask};
  net_send_ctl(net, n, group, &r, NULL, NULL);
}

/* (mu) Node n's reply to this node's creation notice: the step it is at (UINT64_MAX: none). */
void net_join_reply(epd_engine_t *eng, eng_group_t *grp, uint32_t n, const ctl_msg_t *c) {
  if (!(NG(grp)->join_wait >> n & 1)) return;
  NG(grp)->join_wait &= ~(1ull << n);
  if (c->req_id == UINT64_MAX) return;
  /* groups that mask: a third node that is out of the steps there is out here too (made again here, this
   * node heard nothing of its leaving; its own ranks masked there come with its first part) */
  for (uint32_t m = 0; m < eng->o.nodes; m++)
    if (m != n && net_node_masked(eng, c->mask, m))
      net_node_out(eng, grp, m, "out of the steps on the node that answered this node's return");
  if (c->req_id < NG(grp)->join_step) return;
  NG(grp)->join_step = c->req_id;
  NG(grp)->join_map_version = c->version;
  NG(grp)->join_map_hash = c->hash;
}

int eng_net_joining(epd_engine_t *eng, eng_group_t *grp) {
  epd_net_t *net = eng->o.net;
  if (NG(grp)->join_wait) {
    char why[160];
    for (uint32_t n = 0; n < eng->o.nodes && n < 64; n++)
      if (NG(grp)->join_wait >> n & 1 && epd_net_node_dead(net, n, why, sizeof why))
        NG(grp)->join_wait &= ~(1ull << n);
    if (NG(grp)->join_wait &&
        eng_now_ns() - NG(grp)->join_ns > (uint64_t)eng->o.step_timeout_ms * 1000000ull) {
      EPD_LOGW(EPD_SUB_ENGINE,
               "group %s: no reply to its creation notice from every node within %u ms: it "
               "steps on from step %llu",
               grp->name, eng->o.step_timeout_ms, (unsigned long long)grp->steps);
      NG(grp)->join_wait = 0;
    }
    if (NG(grp)->join_wait) return 1;
  }
  if (!NG(grp)->join_step) return 0;
  if (grp->steps == 0) {
    grp->steps = NG(grp)->join_step;
    /* the map they run, kept here when the group went (eng_net_group_removed) and staged at its
     * creation: active at once, so that the first dispatch's maps agree */
    if (grp->has_staged && !grp->nstaged_copies && grp->staged.version == NG(grp)->join_map_version &&
        epd_net_map_hash(&grp->staged) == NG(grp)->join_map_hash)
      eng_apply_staged_map(eng, grp);
    EPD_LOGI(EPD_SUB_ENGINE,
             "group %s: made again here while the other nodes step it: it runs from their "
             "step %llu, expert map version %u",
             grp->name, (unsigned long long)grp->steps, grp->map.version);
  } else if (NG(grp)->join_step > grp->steps) {
    /* a rank attached again after its client died: the others stepped on (failing) meanwhile */
    EPD_LOGI(EPD_SUB_ENGINE,
             "group %s: a rank attached again here; the other nodes are at step %llu: it runs "
             "from there (was at %llu)",
             grp->name, (unsigned long long)NG(grp)->join_step, (unsigned long long)grp->steps);
    grp->steps = NG(grp)->join_step;
  }
  NG(grp)->join_step = 0;
  return 0;
}

int eng_net_gone(const eng_group_t *grp, uint32_t n, uint32_t L, uint64_t step, char *why, size_t len) {
  if (n >= EPD_MAX_RANKS) return -1;
  /* a rank's dead client first: the group's removal there (its other clients leaving) may follow it */
  for (uint32_t r = n * L; r < n * L + L && r < EPD_MAX_RANKS; r++)
    if (NG(grp)->lost_from[r] <= step) {
      snprintf(why, len,
               "the client of rank %u died on node %u at its step %llu of group %s and has not been replaced",
               r, n, (unsigned long long)NG(grp)->lost_from[r], grp->name);
      return (int)r;
    }
  if (NG(grp)->gone_from[n] > step) return -1;
  snprintf(
      why, len,
      "node %u (ranks %u..%u) has no client of group %s since its step %llu (the group was removed there): "
      "its clients there must attach again",
      n, n * L, n * L + L - 1, grp->name, (unsigned long long)NG(grp)->gone_from[n]);
  return (int)(n * L);
}

const char *eng_net_skipped(const char *group, uint32_t n, uint32_t L, uint64_t step, uint64_t later,
                            char *why, size_t len) {
  snprintf(
      why, len,
      "node %u (ranks %u..%u) sent its part of step %llu of group %s but none of step %llu (the step failed "
      "there)",
      n, n * L, n * L + L - 1, (unsigned long long)later, group, (unsigned long long)step);
  return why;
}

/* (mu) To every other node: the client of local rank `rank` of grp is gone from step `from` on (UINT64_MAX:
 * the rank has a client again). */
static void send_lost(epd_engine_t *eng, const eng_group_t *grp, int rank, uint64_t from) {
  ctl_msg_t m = {.kind = CTL_LOST, .req_id = from, .version = (uint32_t)rank};
  for (uint32_t n = 0; n < eng->o.nodes; n++)
    if (n != eng->o.node_rank && net_send_ctl(eng->o.net, n, grp->name, &m, NULL, NULL))
      EPD_LOGW(EPD_SUB_ENGINE,
               "group %s: the notice that rank %d %s to node %u was not sent (its link is down)", grp->name,
               rank, from == UINT64_MAX ? "has a client again" : "lost its client", n);
}

void eng_net_rank_lost(epd_engine_t *eng, eng_group_t *grp, int rank, uint64_t from) {
  if (eng->o.nodes <= 1 || !eng->o.net) return;
  if (grp->on_rank_loss == EPD_RANK_LOSS_MASK)
    EPD_LOGW(EPD_SUB_ENGINE,
             "group %s: the last live rank of this node, %d, has no client from step %llu: the other "
             "nodes go on without this node until a worker attaches to it again",
             grp->name, rank, (unsigned long long)from);
  else
    EPD_LOGW(EPD_SUB_ENGINE,
             "group %s: the client of rank %d died at step %llu: the other nodes fail the group's "
             "steps at once until the rank is attached again",
             grp->name, rank, (unsigned long long)from);
  send_lost(eng, grp, rank, from);
}

void eng_net_rank_back(epd_engine_t *eng, eng_group_t *grp, int rank) {
  epd_net_t *net = eng->o.net;
  if (eng->o.nodes <= 1 || !net) return;
  /* as at a creation: the others reply with the step they are at, taken here if it is ahead (replies to
   * the creation notice still due serve as well: they carry the same) */
  char why[160];
  if (!NG(grp)->join_wait) {
    NG(grp)->join_step = 0;
    NG(grp)->join_ns = eng_now_ns();
    for (uint32_t n = 0; n < eng->o.nodes && n < 64; n++)
      if (n != eng->o.node_rank && !epd_net_node_dead(net, n, why, sizeof why))
        NG(grp)->join_wait |= 1ull << n;
  }
  send_lost(eng, grp, rank, UINT64_MAX);
}

/* A rank of this node was masked or is back (groups that mask): the other nodes route without it, or
 * with it again, from the first step whose part they send after this notice (run_step fails a step
 * they sent before it). */
static void rank_masked(epd_engine_t *eng, eng_group_t *grp, int rank, int masked) {
  ctl_msg_t m = {.kind = CTL_MASK, .version = (uint32_t)rank, .status = masked, .req_id = grp->steps};
  for (uint32_t n = 0; n < eng->o.nodes; n++)
    if (n != eng->o.node_rank && net_send_ctl(eng->o.net, n, grp->name, &m, NULL, NULL))
      EPD_LOGW(EPD_SUB_ENGINE,
               "group %s: the notice that rank %d is %s to node %u was not sent (its link is down)",
               grp->name, rank, masked ? "masked" : "back", n);
}

uint64_t eng_net_first_unsent(const eng_group_t *grp) {
  const net_group_t *ng = grp->net; /* none yet: nothing sent */
  return ng && ng->sent_step == grp->steps ? grp->steps + 1 : grp->steps;
}

void eng_net_sent(eng_group_t *grp, uint64_t step, uint64_t mask) {
  if (!grp->net) return;
  NG(grp)->sent_step = step;
  NG(grp)->sent_mask = mask;
}

int eng_net_last_live_here(const epd_engine_t *eng, const eng_group_t *grp, int rank) {
  if (eng->o.nodes <= 1) return 0;
  const uint32_t L = (uint32_t)eng->o.num_ranks, base = eng->o.node_rank * L;
  for (uint32_t r = base; r < base + L; r++)
    if ((int)r != rank && !(grp->mask >> r & 1)) return 0;
  return 1;
}

void eng_net_group_created(epd_engine_t *eng, eng_group_t *grp) {
  epd_net_t *net = eng->o.net;
  if (eng->o.nodes <= 1 || !net) return;
  /* the other nodes forget an earlier removal here and reply with the step they are at; made again
   * here (its workers restarted), the first part of the group waits for their replies and takes that
   * step (eng_net_joining); made for the first time, every node starts at step 0 */
  NG(grp)->join_wait = 0;
  NG(grp)->join_step = 0;
  NG(grp)->join_ns = eng_now_ns();
  /* parts of a later step that came before this creation are an earlier life's (net_take's later) */
  NG(grp)->frames_since = epd_net_frame_seq(net);
  char why[160];
  if (removed_take(net, grp->name) || net->rejoined) /* made again here, or this daemon restarted */
    for (uint32_t n = 0; n < eng->o.nodes && n < 64; n++)
      if (n != eng->o.node_rank && !epd_net_node_dead(net, n, why, sizeof why))
        NG(grp)->join_wait |= 1ull << n;
  send_gone(eng, grp, UINT64_MAX);
  /* groups that mask: a node whose link is down already takes no part (its LINK_DOWN came before) */
  for (uint32_t n = 0; n < eng->o.nodes; n++)
    if (n != eng->o.node_rank && epd_net_node_dead(net, n, why, sizeof why))
      net_node_out(eng, grp, n, "the link to its node is down");
  /* a node that drains takes no step of a group made here after its notice */
  for (uint32_t n = 0; n < eng->o.nodes && n < MAX_NODES && n < EPD_MAX_RANKS; n++)
    if (net->peer_draining[n]) NG(grp)->drain_from[n] = 0;
  for (pending_map_t **pp = &net->pending; *pp; pp = &(*pp)->next) {
    pending_map_t *p = *pp;
    if (strcmp(p->group, grp->name)) continue;
    *pp = p->next;
    char err[320] = "";
    epd_result_t rc = eng_stage_map(eng, grp, &p->map, NULL, 0, p->map.version, 0, NULL, err, sizeof err);
    if (rc)
      EPD_LOGE(EPD_SUB_ENGINE,
               "group %s: expert map version %u kept from node 0 refused at the group's creation on "
               "node %u: %s (no node switches to it)",
               grp->name, p->map.version, net->node_rank, err);
    else
      EPD_LOGI(EPD_SUB_ENGINE,
               "group %s: expert map version %u kept from node 0 staged at the group's creation", grp->name,
               p->map.version);
    net_pending_free(p);
    return;
  }
}

/* (control thread) The link to node n is up again: its daemon restarted and joined the running world.
 * What this node knew of node n's groups (removed, draining, lost clients) is void; node 0 sends node n
 * the map each group runs, kept there until the group is made (a made group asks the others for their
 * step, as one made again: eng_net_group_created, and makes that map active if they run it). */
void net_link_up(epd_engine_t *eng, uint32_t n) {
  epd_net_t *net = eng->o.net;
  const uint32_t L = (uint32_t)eng->o.num_ranks;
  uint32_t maps = 0;
  pthread_mutex_lock(&eng->mu);
  net->peer_draining[n] = 0;
  for (eng_group_t *g = eng->groups; g; g = g->next) {
    NG(g)->gone_from[n] = NG(g)->drain_from[n] = UINT64_MAX;
    for (uint32_t r = n * L; r < n * L + L && r < EPD_MAX_RANKS; r++) NG(g)->lost_from[r] = UINT64_MAX;
    if (net->node_rank != 0 || g->map.version <= 1) continue;
    ctl_msg_t m = {.kind = CTL_MAP_SET, .version = g->map.version, .num_experts = g->map.num_experts};
    if (!net_send_ctl(net, n, g->name, &m, &g->map, NULL)) maps++;
  }
  pthread_mutex_unlock(&eng->mu);
  EPD_LOGI(EPD_SUB_ENGINE, "node %u joined the running world again%s", n,
           net->node_rank == 0 ? "" : " (node 0 sends it the groups' expert maps)");
  if (net->node_rank == 0)
    EPD_LOGI(EPD_SUB_ENGINE, "node %u: the expert maps of %u groups sent to it", n, maps);
}

/* ---- nodes out of a group's steps (groups that mask) ---------------------------------------------- */

uint64_t net_join_step(const epd_engine_t *eng, const eng_group_t *grp, uint32_t n) {
  const net_group_t *ng = grp->net;
  return ng && ng->sent_step == grp->steps && net_node_masked(eng, ng->sent_mask, n) ? grp->steps + 1
                                                                                     : grp->steps;
}

int net_node_gone(epd_engine_t *eng, const eng_group_t *grp, uint32_t n) {
  const uint32_t L = (uint32_t)eng->o.num_ranks;
  char why[160];
  if (n >= eng->o.nodes || n >= EPD_MAX_RANKS) return 0;
  if (epd_net_node_dead(eng->o.net, n, why, sizeof why) || NG(grp)->gone_from[n] != UINT64_MAX) return 1;
  for (uint32_t r = n * L; r < n * L + L && r < EPD_MAX_RANKS; r++)
    if (NG(grp)->lost_from[r] != UINT64_MAX) return 1;
  return 0;
}

int net_node_masked(const epd_engine_t *eng, uint64_t mask, uint32_t n) {
  const uint32_t L = (uint32_t)eng->o.num_ranks;
  if (n == eng->o.node_rank || (n + 1) * L > 64) return 0;
  const uint64_t all = (L >= 64 ? ~0ull : (1ull << L) - 1) << (n * L);
  return (mask & all) == all;
}

void net_node_out(epd_engine_t *eng, eng_group_t *grp, uint32_t n, const char *why) {
  const uint32_t L = (uint32_t)eng->o.num_ranks;
  if (grp->on_rank_loss != EPD_RANK_LOSS_MASK || n == eng->o.node_rank || n >= eng->o.nodes ||
      net_node_masked(eng, grp->mask, n))
    return;
  EPD_LOGW(EPD_SUB_ENGINE, "group %s: node %u (ranks %u..%u) is out of its steps from step %llu (%s)",
           grp->name, n, n * L, n * L + L - 1, (unsigned long long)eng_net_first_unsent(grp), why);
  for (uint32_t r = n * L; r < n * L + L && r < grp->g.num_ranks; r++) eng_mask_rank(eng, grp, (int)r, why);
}

void net_node_back(epd_engine_t *eng, eng_group_t *grp, uint32_t n, int r) {
  const uint32_t L = (uint32_t)eng->o.num_ranks;
  if (grp->on_rank_loss != EPD_RANK_LOSS_MASK || n == eng->o.node_rank || n >= eng->o.nodes) return;
  for (uint32_t k = n * L; k < n * L + L && k < grp->g.num_ranks; k++)
    if (r < 0 || (int)k == r) eng_unmask_rank(eng, grp, (int)k);
}

/* ---- the table the core calls ------------------------------------------------------------------ */

static void group_note(const eng_group_t *grp, uint32_t nodes, char *out, size_t len) {
  size_t nl = 0;
  if (len) out[0] = 0;
  const net_group_t *ng = grp->net;
  for (uint32_t n = 0; ng && n < nodes && n < EPD_MAX_RANKS; n++) {
    char one[64] = "";
    if (ng->gone_from[n] != UINT64_MAX)
      snprintf(one, sizeof one, "node %u removed it at step %llu", n, (unsigned long long)ng->gone_from[n]);
    else if (ng->drain_from[n] != UINT64_MAX)
      snprintf(one, sizeof one, "node %u drains from step %llu", n, (unsigned long long)ng->drain_from[n]);
    if (one[0] && nl < len) nl += (size_t)snprintf(out + nl, len - nl, "%s%s", nl ? "; " : "", one);
  }
}

static void links(const epd_engine_t *eng, char *out, size_t len, uint64_t *down, uint64_t *tx_bytes,
                  uint64_t *rx_bytes, uint64_t *tx_frames, uint64_t *rx_frames) {
  epd_net_links(eng->o.net, out, len, down);
  epd_net_counters(eng->o.net, tx_bytes, rx_bytes, tx_frames, rx_frames);
}

const eng_scaleout_t eng_net_scaleout = {
    .group_init = group_init,
    .group_created = eng_net_group_created,
    .rank_back = eng_net_rank_back,
    .rank_masked = rank_masked,
    .group_removed = eng_net_group_removed,
    .group_free = eng_net_group_free,
    .notify_drain = eng_net_notify_drain,
    .stage_map = eng_net_stage_map,
    .set_map = eng_net_set_map,
    .group_note = group_note,
    .links = links,
};
