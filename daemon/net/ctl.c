/*
 * ctl.c - the control thread: control frames from the other nodes (expert maps, weights, drains,
 * removals, joins, lost and masked ranks), handled in arrival order with the engine lock; the receivers
 * never take it, so they always drain the links. Expert weights go out from here too, after the
 * incoming frames.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/net_internal.h"

int net_send_ctl(epd_net_t *net, uint32_t node, const char *group, const ctl_msg_t *m,
                 const epd_expert_map_t *map, const epd_weight_copy_t *cp) {
  uint32_t E = map ? m->num_experts : 0, nc = map ? m->ncopies : 0;
  size_t len = sizeof(net_hdr_t) + sizeof *m + MAP_NREP_BYTES(E) + (size_t)E * sizeof *map->rep +
               (size_t)nc * sizeof *cp;
  uint8_t *b = calloc(1, len);
  if (!b) return -1;
  net_hdr_t h = {.magic = CTL_MAGIC, .src_node = net->node_rank};
  snprintf(h.group, sizeof h.group, "%s", group);
  uint8_t *p = b;
  memcpy(p, &h, sizeof h);
  p += sizeof h;
  memcpy(p, m, sizeof *m);
  p += sizeof *m;
  if (E) {
    memcpy(p, map->nrep, E);
    p += MAP_NREP_BYTES(E); /* the padding stays zero (calloc) */
    memcpy(p, map->rep, (size_t)E * sizeof *map->rep);
    p += (size_t)E * sizeof *map->rep;
  }
  if (nc) memcpy(p, cp, (size_t)nc * sizeof *cp);
  int rc = net_send(net, node, b, len);
  free(b);
  return rc;
}

static int step_word(epd_net_t *net, uint32_t node, const char *group, uint64_t step, int what, int peer,
                     int code, uint64_t nodes, const char *why) {
  ctl_msg_t m = {.kind = CTL_STEP_OFF,
                 .req_id = step,
                 .status = what,
                 .version = (uint32_t)(peer + 1),
                 .code = code,
                 .mask = nodes};
  snprintf(m.why, sizeof m.why, "%s", why);
  return net_send_ctl(net, node, group, &m, NULL, NULL);
}

int epd_net_step_off(epd_net_t *net, uint32_t node, const char *group, uint64_t step, int what, int peer,
                     const char *why) {
  return step_word(net, node, group, step, what, peer, 0, 0, why);
}

int epd_net_step_no(epd_net_t *net, uint32_t node, const char *group, uint64_t step, int code, int peer,
                    const char *why) {
  return step_word(net, node, group, step, EPD_NET_OFF_NO, peer, code, 0, why);
}

int epd_net_step_ready(epd_net_t *net, uint32_t node, const char *group, uint64_t step, uint64_t nodes) {
  return step_word(net, node, group, step, EPD_NET_OFF_READY, -1, 0, nodes, "");
}

/* A notice of node n about its rank r (CTL_MASK, CTL_LOST): 1 if r is one of n's ranks, else logged. */
static int own_rank(uint32_t n, uint32_t r, uint32_t L) {
  if (n < MAX_NODES && r < EPD_MAX_RANKS && r / L == n) return 1;
  EPD_LOGW(EPD_SUB_ENGINE, "node %u sent a notice about rank %u, not one of its ranks: ignored", n, r);
  return 0;
}

static void ctl_handle(epd_engine_t *eng, net_frame_t *f) {
  epd_net_t *net = eng->o.net;
  const net_hdr_t *h = (const net_hdr_t *)f->buf;
  ctl_msg_t c;
  if (f->len < sizeof *h + sizeof c) {
    EPD_LOGW(EPD_SUB_ENGINE, "node %u sent a truncated control frame", f->src_node);
    return;
  }
  memcpy(&c, f->buf + sizeof *h, sizeof c);
  c.why[sizeof c.why - 1] = 0;
  char group[EPD_GROUP_NAME_MAX];
  snprintf(group, sizeof group, "%s", f->group);
  const uint32_t L = (uint32_t)eng->o.num_ranks; /* ranks per node */
  if (c.kind == CTL_LINK_UP) {
    if (f->local && f->src_node < MAX_NODES) net_link_up(eng, f->src_node);
    return;
  }
  if (c.kind == CTL_LINK_DOWN) { /* groups that mask go on without the node until it is back */
    if (!f->local || f->src_node >= eng->o.nodes) return;
    pthread_mutex_lock(&eng->mu);
    for (eng_group_t *g = eng->groups; g; g = g->next)
      net_node_out(eng, g, f->src_node, "the link to its node is down");
    pthread_mutex_unlock(&eng->mu);
    return;
  }
  if (c.kind ==
      CTL_WORLD) { /* why: the new world communicator's id (EPD_NET_COMM_ID_BYTES), mask: its nodes */
    /* node 0 hands out the whole world; the first node left one without the lost nodes */
    const uint32_t from = c.mask ? (uint32_t)__builtin_ctzll(c.mask) : 0;
    const uint64_t all = eng->o.nodes >= 64 ? ~0ull : (1ull << eng->o.nodes) - 1;
    if ((c.mask & ~all) || (!f->local && f->src_node != from)) {
      EPD_LOGW(EPD_SUB_ENGINE,
               "node %u sent the id of a world communicator of nodes 0x%llx (only its first node may, node 0 "
               "for every node, and only of this world's nodes): ignored",
               f->src_node, (unsigned long long)c.mask);
      return;
    }
    pthread_mutex_lock(&eng->mu);
    if (eng->ops->world_remake) eng->ops->world_remake(eng, (const uint8_t *)c.why, c.mask);
    pthread_mutex_unlock(&eng->mu);
    return;
  }
  if (c.kind == CTL_STEP_OFF) { /* asks go to the lead, answers come from it (the backend checks that) */
    const int ok = c.status == EPD_NET_OFF_WORLD ? !group[0] : c.status >= 0 && c.status <= EPD_NET_OFF_READY;
    if (f->local || f->src_node >= eng->o.nodes || !ok) {
      EPD_LOGW(EPD_SUB_ENGINE,
               "node %u sent a step notice (%d) about group %s step %llu that is not its to send: ignored",
               f->src_node, c.status, group, (unsigned long long)c.req_id);
      return;
    }
    pthread_mutex_lock(&eng->mu);
    if (eng->ops->step_off)
      eng->ops->step_off(eng, group, c.req_id, f->src_node, c.status, (int)c.version - 1, c.code, c.mask,
                         c.why);
    pthread_mutex_unlock(&eng->mu);
    return;
  }
  if (c.kind == CTL_MAP_REP) {
    pthread_mutex_lock(&net->mu);
    for (ctl_wait_t *w = net->waits; w; w = w->next)
      if (w->req_id == c.req_id) {
        w->done = 1;
        w->status = c.status;
        w->version = c.version;
        snprintf(w->why, sizeof w->why, "%s", c.why);
      }
    pthread_cond_broadcast(&net->wait_cv);
    pthread_mutex_unlock(&net->mu);
    return;
  }
  if (c.kind == CTL_DRAIN) { /* req_id = the group's first step from which the sender takes no dispatch */
    if (f->src_node >= MAX_NODES || f->src_node >= EPD_MAX_RANKS) return;
    pthread_mutex_lock(&eng->mu);
    eng_group_t *grp = group[0] ? eng_find_group(eng, group) : NULL;
    if (grp) NG(grp)->drain_from[f->src_node] = c.req_id;
    if (!group[0]) {
      /* the last notice of a drain (after one per group of the sender): a group of this node that the
       * sender has not has no step it would take; nor has a group made here later */
      net->peer_draining[f->src_node] = c.req_id != UINT64_MAX;
      for (eng_group_t *g = eng->groups; g; g = g->next)
        if (c.req_id == UINT64_MAX || NG(g)->drain_from[f->src_node] == UINT64_MAX)
          NG(g)->drain_from[f->src_node] = c.req_id;
    }
    pthread_mutex_unlock(&eng->mu);
    if (!group[0]) {
      if (c.req_id != UINT64_MAX)
        EPD_LOGI(EPD_SUB_ENGINE,
                 "node %u is draining: the dispatches of groups it does not have fail here "
                 "with EPD_ERR_DRAINING",
                 f->src_node);
      return;
    }
    if (grp && c.req_id != UINT64_MAX)
      EPD_LOGI(EPD_SUB_ENGINE,
               "group %s: node %u is draining: its dispatches from step %llu on fail here "
               "with EPD_ERR_DRAINING",
               group, f->src_node, (unsigned long long)c.req_id);
    else if (grp)
      EPD_LOGI(EPD_SUB_ENGINE, "group %s: node %u takes steps again", group, f->src_node);
    return;
  }
  if (c.kind == CTL_WEIGHTS) {
    net_weights_in(eng, f, &c, group);
    return;
  }
  if (c.kind ==
      CTL_GONE) { /* req_id: the sender's first step without the group; UINT64_MAX: it exists again */
    if (f->src_node >= MAX_NODES || f->src_node >= EPD_MAX_RANKS) return;
    pthread_mutex_lock(&eng->mu);
    eng_group_t *grp = eng_find_group(eng, group);
    const int made = c.req_id == UINT64_MAX;
    /* a node out of a group that masks (net_node_out) takes part again from the first step this node has
     * not sent: the one it is told to run from (the steps sent run without it) */
    const int was_out = grp && net_node_masked(eng, grp->mask, f->src_node);
    const uint64_t was = grp ? NG(grp)->gone_from[f->src_node] : UINT64_MAX,
                   steps = !grp              ? 0
                           : was_out && made ? net_join_step(eng, grp, f->src_node)
                                             : grp->steps,
                   mask = grp ? grp->mask : 0;
    const int masks = grp && grp->on_rank_loss == EPD_RANK_LOSS_MASK;
    /* a creation notice is answered with the map this node runs (a removal needs nothing back) */
    const uint32_t version = grp && made ? grp->map.version : 0;
    const uint64_t hash = grp && made ? epd_net_map_hash(&grp->map) : 0;
    int lost_r[EPD_MAX_RANKS], nlost = 0;
    const uint32_t me0 = net->node_rank * L;
    for (uint32_t r = me0; grp && made && r < me0 + L && r < EPD_MAX_RANKS; r++)
      if (grp->lost[r] && !grp->client[r]) lost_r[nlost++] = (int)r;
    if (grp) NG(grp)->gone_from[f->src_node] = c.req_id;
    if (grp && made) /* a group made there has none of its ranks' clients lost */
      for (uint32_t r = f->src_node * L; r < f->src_node * L + L && r < EPD_MAX_RANKS; r++)
        NG(grp)->lost_from[r] = UINT64_MAX;
    if (grp && made)
      net_node_back(eng, grp, f->src_node, -1);
    else if (grp)
      net_node_out(eng, grp, f->src_node, "the group was removed on its node");
    pthread_mutex_unlock(&eng->mu);
    if (made) {
      /* made there (again): tell it the step this node's group collects, which from now on waits for
       * its part (it takes this number before its first part goes out) */
      net_send_join(net, f->src_node, group, grp ? steps : UINT64_MAX, version, hash, mask);
      /* and which of this node's ranks lost their client (its parts do not come until they attach again) */
      for (int k = 0; k < nlost; k++) {
        ctl_msg_t m = {.kind = CTL_LOST, .req_id = steps, .version = lost_r[k]};
        net_send_ctl(net, f->src_node, group, &m, NULL, NULL);
      }
    }
    if (grp && !made && !masks) /* (a group that masks logged taking the node out) */
      EPD_LOGW(EPD_SUB_ENGINE,
               "group %s: removed on node %u at its step %llu (its last client there left): its "
               "steps from then on fail here with EPD_ERR_PEER",
               group, f->src_node, (unsigned long long)c.req_id);
    else if (grp && made && was != UINT64_MAX)
      EPD_LOGI(EPD_SUB_ENGINE,
               "group %s: made again on node %u; its steps wait for that node again from step %llu", group,
               f->src_node, (unsigned long long)steps);
    return;
  }
  if (c.kind == CTL_MASK) {
    const uint32_t r = c.version, n = f->src_node;
    if (!own_rank(n, r, L)) return;
    pthread_mutex_lock(&eng->mu);
    eng_group_t *grp = eng_find_group(eng, group);
    if (grp && c.status)
      eng_mask_rank(eng, grp, (int)r, "masked on its node");
    else if (grp && !net_node_gone(eng, grp, n)) /* an out node comes back with its lost rank (CTL_LOST) */
      eng_unmask_rank(eng, grp, (int)r);
    pthread_mutex_unlock(&eng->mu);
    return;
  }
  if (c.kind == CTL_LOST) {
    const uint32_t r = c.version, n = f->src_node;
    if (!own_rank(n, r, L)) return;
    const int back = c.req_id == UINT64_MAX;
    pthread_mutex_lock(&eng->mu);
    eng_group_t *grp = eng_find_group(eng, group);
    const int was_out = grp && net_node_masked(eng, grp->mask, n);
    const uint64_t steps = !grp              ? UINT64_MAX
                           : was_out && back ? net_join_step(eng, grp, n)
                                             : grp->steps,
                   mask = grp ? grp->mask : 0;
    const int masks = grp && grp->on_rank_loss == EPD_RANK_LOSS_MASK;
    const uint32_t version = grp && back ? grp->map.version : 0;
    const uint64_t hash = grp && back ? epd_net_map_hash(&grp->map) : 0;
    if (grp) NG(grp)->lost_from[r] = c.req_id;
    /* groups that mask: a node tells the loss of its last live rank only (the others it masks) */
    if (grp && back)
      net_node_back(eng, grp, n, (int)r);
    else if (grp)
      net_node_out(eng, grp, n, "the last live rank of its node lost its client");
    pthread_mutex_unlock(&eng->mu);
    if (back) net_send_join(net, n, group, steps, version, hash, mask); /* taken there if it is ahead */
    if (grp && !back && !masks) /* (a group that masks logged taking the node out) */
      EPD_LOGW(EPD_SUB_ENGINE,
               "group %s: the client of rank %u died on node %u at its step %llu: the group's steps "
               "from then on fail here with EPD_ERR_PEER until the rank is attached again",
               group, r, n, (unsigned long long)c.req_id);
    else if (grp && back)
      EPD_LOGI(EPD_SUB_ENGINE, "group %s: rank %u has a client again on node %u", group, r, n);
    return;
  }
  if (c.kind == CTL_JOIN) { /* req_id: the step the sender's group is at (UINT64_MAX: none there) */
    if (f->src_node >= MAX_NODES || f->src_node >= 64) return;
    pthread_mutex_lock(&eng->mu);
    eng_group_t *grp = eng_find_group(eng, group);
    if (grp) net_join_reply(eng, grp, f->src_node, &c);
    pthread_mutex_unlock(&eng->mu);
    return;
  }
  epd_expert_map_t m;
  const epd_weight_copy_t *cp = NULL;
  if ((c.kind != CTL_MAP_REQ && c.kind != CTL_MAP_SET) || net_parse_map(f, &c, &m, &cp)) {
    EPD_LOGW(EPD_SUB_ENGINE, "node %u sent a malformed control frame (kind %u)", f->src_node, c.kind);
    return;
  }
  if (c.kind == CTL_MAP_REQ) {
    ctl_msg_t r = {.kind = CTL_MAP_REP, .req_id = c.req_id};
    if (net->node_rank != 0) {
      r.status = EPD_ERR_PROTOCOL;
      snprintf(r.why, sizeof r.why, "node %u is not node 0", net->node_rank);
    } else {
      wout_t *wo = NULL;
      pthread_mutex_lock(&eng->mu);
      r.status = net_stage_and_send(eng, group, &m, cp, c.ncopies, &r.version, &wo, r.why, sizeof r.why);
      pthread_mutex_unlock(&eng->mu);
      net_weights_queue(net, group, wo);
    }
    net_send_ctl(net, f->src_node, group, &r, NULL, NULL);
    return;
  }
  /* MAP_SET from node 0. */
  char err[320] = "";
  pthread_mutex_lock(&eng->mu);
  eng_group_t *grp = eng_find_group(eng, group);
  epd_result_t rc = grp ? eng_stage_map(eng, grp, &m, cp, c.ncopies, c.version, 0, NULL, err, sizeof err)
                        : EPD_ERR_NOT_FOUND;
  const int kept = grp ? 1 : net_pending_put(eng, net, group, &m, c.ncopies);
  /* the copies whose source is here: their bytes, or why this node cannot give them */
  wout_t *wo = net_weights_out(eng, grp, cp, c.ncopies, c.version, rc == EPD_ERR_NOT_FOUND ? 0 : (int)rc,
                               rc ? err : NULL);
  pthread_mutex_unlock(&eng->mu);
  net_weights_queue(net, group, wo);
  if (rc == EPD_ERR_NOT_FOUND && kept == 0)
    EPD_LOGI(EPD_SUB_ENGINE,
             "group %s: expert map version %u from node 0 kept: the group does not exist on node "
             "%u yet; it is staged when the group is created here",
             group, c.version, net->node_rank);
  else if (rc == EPD_ERR_NOT_FOUND)
    EPD_LOGW(
        EPD_SUB_ENGINE,
        "group %s: expert map version %u from node 0 ignored: the group does not exist on "
        "node %u, and the map %s (no node switches to it; set it again once the group exists on every node)",
        group, c.version, net->node_rank,
        kept == -2 ? "carries weight copies, which are not kept" : "could not be kept (out of memory)");
  else if (rc)
    EPD_LOGE(EPD_SUB_ENGINE,
             "group %s: expert map version %u from node 0 refused on node %u: %s (no node "
             "switches to it)",
             group, c.version, net->node_rank, err);
  else
    EPD_LOGI(EPD_SUB_ENGINE, "group %s: expert map version %u staged from node 0 (%u weight copies)", group,
             c.version, c.ncopies);
}

static void *ctl_main(void *arg) {
  epd_engine_t *eng = arg;
  epd_net_t *net = eng->o.net;
  pthread_setname_np(pthread_self(), "epd-netctl");
  pthread_mutex_lock(&net->mu);
  for (;;) {
    while (!net->ctl_head && !net->wq_head && !net->ctl_stop) pthread_cond_wait(&net->ctl_cv, &net->mu);
    if (net->ctl_stop) break;
    if (!net->ctl_head && net->wq_head) { /* expert weights out once the incoming frames are handled (a
                                           * MAP_REP must not wait behind a large transfer) */
      wq_t *q = net->wq_head;
      net->wq_head = q->next;
      if (!net->wq_head) net->wq_tail = NULL;
      pthread_mutex_unlock(&net->mu);
      net_weights_send(net, q->group, q->w);
      free(q);
      pthread_mutex_lock(&net->mu);
      continue;
    }
    net_frame_t *f = net->ctl_head;
    net->ctl_head = f->next;
    if (!net->ctl_head) net->ctl_tail = NULL;
    pthread_mutex_unlock(&net->mu);
    ctl_handle(eng, f);
    free(f->buf);
    free(f);
    pthread_mutex_lock(&net->mu);
  }
  pthread_mutex_unlock(&net->mu);
  return NULL;
}

void eng_net_notify_drain(epd_engine_t *eng, int drain) {
  epd_net_t *net = eng->o.net;
  if (eng->o.nodes <= 1 || !net) return;
  for (eng_group_t *g = eng->groups; g; g = g->next) {
    /* both backends refuse dispatches only (combines still run), from the step the backend says: the
     * host backend still runs a step some local rank already joined (engine_host.c refuses only a first
     * arrival); cuda fails every dispatch from the group's next step on (its frame says
     * EPD_ERR_DRAINING, and a frame sent before the drain reaches the peers before this notice) */
    ctl_msg_t m = {.kind = CTL_DRAIN,
                   .req_id = !drain                 ? UINT64_MAX
                             : eng->ops->drain_step ? eng->ops->drain_step(g)
                                                    : g->steps};
    for (uint32_t n = 0; n < eng->o.nodes; n++)
      if (n != eng->o.node_rank && net_send_ctl(net, n, g->name, &m, NULL, NULL))
        EPD_LOGW(EPD_SUB_ENGINE, "group %s: the drain notice to node %u was not sent (its link is down)",
                 g->name, n);
  }
  /* then one for every group, those that do not exist here included (group ""; step 0: all of them) */
  ctl_msg_t m = {.kind = CTL_DRAIN, .req_id = drain ? 0 : UINT64_MAX};
  for (uint32_t n = 0; n < eng->o.nodes; n++)
    if (n != eng->o.node_rank) net_send_ctl(net, n, "", &m, NULL, NULL);
}

epd_result_t eng_net_ctl_start(epd_engine_t *eng, char *err, size_t errlen) {
  epd_net_t *net = eng->o.net;
  if (!net) return EPD_OK;
  pthread_mutex_lock(&net->mu);
  net->eng = eng;
  net->ctl_on = 1;
  net->ctl_stop = 0;
  pthread_mutex_unlock(&net->mu);
  int e = pthread_create(&net->ctl_th, NULL, ctl_main, eng);
  if (e) {
    snprintf(err, errlen, "pthread_create for the map control thread: %s", strerror(e));
    return EPD_ERR_SYSTEM;
  }
  net->ctl_started = 1;
  return EPD_OK;
}

void eng_net_ctl_stop(epd_engine_t *eng) {
  epd_net_t *net = eng->o.net;
  if (!net) return;
  pthread_mutex_lock(&net->mu);
  net->ctl_stop = 1;
  net->ctl_on = 0;
  pthread_cond_broadcast(&net->ctl_cv);
  pthread_mutex_unlock(&net->mu);
  if (net->ctl_started) pthread_join(net->ctl_th, NULL);
  net->ctl_started = 0;
  pthread_mutex_lock(&net->mu);
  while (net->ctl_head) {
    net_frame_t *f = net->ctl_head;
    net->ctl_head = f->next;
    free(f->buf);
    free(f);
  }
  net->ctl_tail = NULL;
  wq_t *q = net->wq_head;
  net->wq_head = net->wq_tail = NULL;
  net->eng = NULL;
  pthread_mutex_unlock(&net->mu);
  while (q) {
    wq_t *next = q->next;
    net_wout_free(q->w);
    free(q);
    q = next;
  }
}
