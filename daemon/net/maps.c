/*
 * maps.c - expert maps across nodes: the switch vote both backends run over their step frames
 * (engine_internal.h, eng_vote_*), and SetExpertMap on any node (node 0 numbers and stages every map and
 * sends it to the others).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "net/net_internal.h"

uint64_t epd_net_map_hash(const epd_expert_map_t *m) {
  uint64_t h = 1469598103934665603ull;
#define MIX(v)             \
  do {                     \
    h ^= (uint64_t)(v);    \
    h *= 1099511628211ull; \
  } while (0)
  MIX(m->version);
  for (uint32_t e = 0; e < m->num_experts; e++) {
    MIX(m->nrep[e]);
    for (uint32_t i = 0; i < m->nrep[e]; i++) {
      MIX(m->rep[e][i].rank);
      MIX(m->rep[e][i].slot);
    }
  }
#undef MIX
  return h;
}

/* ---- expert-map switches (both backends; engine_internal.h) ---- */

void eng_vote_switch(epd_engine_t *eng, eng_group_t *grp, eng_map_vote_t *v, uint64_t step) {
  if (!v->agree || v->agree_step + 1 != step) return;
  if (v->rep.version != v->agree_version || v->rep_hash != v->agree_hash) return;
  if (eng_apply_staged_version(eng, grp, &v->rep, v->rep_copies))
    EPD_LOGE(EPD_SUB_ENGINE, "group %s: staged map version %u agreed by every node is gone on node %u",
             grp->name, v->rep.version, eng->o.node_rank);
  v->agree = 0;
}

void eng_vote_report(epd_engine_t *eng, eng_group_t *grp, eng_map_vote_t *v) {
  /* weights this node owes other nodes and could not read when it staged their map */
  if (grp->wdefer && eng->o.net) net_weights_queue(eng->o.net, grp->name, net_weights_retry(eng, grp));
  eng_weights_clock(grp);
  /* a map whose copies into this node wait for bytes from another node, or whose copies from this node
   * still wait to be read here, is not reported yet, so no node switches to it before every destination
   * holds what it needs; the map reported before stays reported while it is not active (its copies are
   * the first rep_copies staged ones, their bytes are here): a node left behind still catches up */
  uint32_t sv = grp->has_staged ? grp->staged.version : 0;
  int owed = 0;
  for (const eng_wdefer_t *d = grp->wdefer; d && sv; d = d->next) owed |= d->version <= sv;
  if (sv && (owed || !eng_weights_ready(eng, grp))) {
    if (v->rep.version > grp->map.version) return;
    sv = 0;
  }
  if (sv == v->rep.version) return;
  epd_expert_map_free(&v->rep);
  memset(&v->rep, 0, sizeof v->rep);
  v->rep_hash = 0;
  v->rep_copies = 0;
  if (sv && epd_ref_map_copy(&v->rep, &grp->staged) == EPD_OK) {
    v->rep_hash = epd_net_map_hash(&v->rep);
    v->rep_copies = grp->nstaged_copies;
  } else {
    memset(&v->rep, 0, sizeof v->rep); /* out of memory: report none; the map switches later */
  }
}

void eng_vote_agree(eng_map_vote_t *v, const eng_map_peer_t *peers, uint32_t npeers, uint64_t step) {
  uint32_t sv = v->rep.version;
  int all = sv != 0, behind = 0;
  for (uint32_t i = 0; i < npeers; i++) {
    if (peers[i].staged_version != sv || peers[i].staged_hash != v->rep_hash) all = 0;
    if (sv && peers[i].map_version == sv && peers[i].map_hash == v->rep_hash) behind = 1;
  }
  v->agree = all || behind;
  v->agree_step = step;
  v->agree_version = sv;
  v->agree_hash = v->rep_hash;
}

void eng_vote_reset(eng_map_vote_t *v) {
  epd_expert_map_free(&v->rep);
  memset(v, 0, sizeof *v);
}

/* ---- expert maps across nodes (both backends) -------------------------------------------------- */

/* A control frame: net_hdr_t (CTL_MAGIC, the group), then ctl_msg_t, then for MAP_REQ and MAP_SET the
 * map (nrep[E], rep[E][EPD_MAX_REPLICAS]) and the weight copies. Node 0 numbers and stages every map
 * (its own SetExpertMap calls and the MAP_REQs of the other nodes, one at a time under its engine
 * lock) and sends each staged map as MAP_SET to every other node, in version order on every link; a
 * MAP_REQ is answered with MAP_REP after the MAP_SET to the asking node, so a SetExpertMap that
 * returns a version has that map staged on its node. */

void net_pending_free(pending_map_t *p) {
  epd_expert_map_free(&p->map);
  free(p);
}

/* Parse a MAP_REQ / MAP_SET body into m (its arrays point into the frame; free nothing); -1 if
 * malformed. */
int net_parse_map(const net_frame_t *f, const ctl_msg_t *c, epd_expert_map_t *m,
                  const epd_weight_copy_t **cp) {
  size_t E = c->num_experts, need = sizeof(net_hdr_t) + sizeof *c + MAP_NREP_BYTES(E) + E * sizeof *m->rep +
                                    (size_t)c->ncopies * sizeof **cp;
  if (!E || E > (1u << 20) || c->ncopies > (1u << 16) || f->len != need) return -1;
  memset(m, 0, sizeof *m);
  m->num_experts = c->num_experts;
  m->version = c->version;
  uint8_t *p = f->buf + sizeof(net_hdr_t) + sizeof *c;
  m->nrep = p;
  m->rep = (epd_replica_t(*)[EPD_MAX_REPLICAS])(void *)(p + MAP_NREP_BYTES(E));
  *cp = c->ncopies ? (const epd_weight_copy_t *)(void *)(p + MAP_NREP_BYTES(E) + E * sizeof *m->rep) : NULL;
  return 0;
}

/* (eng->mu, node 0) Stage a map with the next version and send it to every other node. */
epd_result_t net_stage_and_send(epd_engine_t *eng, const char *group, const epd_expert_map_t *map,
                                const epd_weight_copy_t *cp, uint32_t ncopies, uint32_t *version, wout_t **wo,
                                char *err, size_t errlen) {
  epd_net_t *net = eng->o.net;
  eng_group_t *grp = eng_find_group(eng, group);
  if (!grp) {
    snprintf(err, errlen, "group \"%s\" not found on node 0 (attach it on every node before SetExpertMap)",
             group);
    return EPD_ERR_NOT_FOUND;
  }
  epd_result_t rc = eng_stage_map(eng, grp, map, cp, ncopies, 0, 1, version, err, errlen);
  if (rc) return rc;
  ctl_msg_t m = {
      .kind = CTL_MAP_SET, .version = *version, .num_experts = map->num_experts, .ncopies = ncopies};
  for (uint32_t n = 1; n < net->nodes; n++)
    if (net_send_ctl(net, n, group, &m, map, cp))
      EPD_LOGE(EPD_SUB_ENGINE,
               "group %s: expert map version %u not sent to node %u (link down): no node "
               "switches to it",
               group, *version, n);
  EPD_LOGI(EPD_SUB_ENGINE, "group %s: expert map version %u staged and sent to every node (%u weight copies)",
           group, *version, ncopies);
  *wo = net_weights_out(eng, grp, cp, ncopies, *version, 0, NULL); /* queued by the caller */
  return EPD_OK;
}

/* (engine mu) Keep a map for a group this node does not have yet: the last one node 0 sent per group
 * (node 0 sends them in staging order over one link; a lower version than a kept one means the group
 * was re-created on node 0, whose numbering restarted). At most engine.max_groups are kept, the oldest
 * dropped first. A map with weight copies is not kept (-2): copies staged on one incarnation of a group
 * must not run on another. */
int net_pending_put(epd_engine_t *eng, epd_net_t *net, const char *group, const epd_expert_map_t *m,
                    uint32_t ncopies) {
  if (ncopies) return -2;
  pending_map_t **pp = &net->pending;
  uint32_t n = 0;
  for (; *pp; pp = &(*pp)->next, n++)
    if (!strcmp((*pp)->group, group)) break;
  if (!*pp && n >= (eng->o.max_groups ? eng->o.max_groups : 8) && net->pending) {
    pending_map_t *old = net->pending; /* the oldest: entries are appended */
    net->pending = old->next;
    if (pp == &old->next) pp = &net->pending;
    net_pending_free(old);
  }
  pending_map_t *p = calloc(1, sizeof *p);
  if (!p || epd_ref_map_copy(&p->map, m) != EPD_OK) {
    free(p);
    return -1;
  }
  snprintf(p->group, sizeof p->group, "%s", group);
  if (*pp) { /* replace the kept one in place */
    p->next = (*pp)->next;
    net_pending_free(*pp);
  }
  *pp = p;
  return 0;
}

epd_result_t eng_net_stage_map(epd_engine_t *eng, eng_group_t *grp, const epd_expert_map_t *map,
                               const epd_weight_copy_t *copies, uint32_t ncopies, uint32_t *version_out,
                               char *errbuf, size_t errlen) {
  epd_net_t *net = eng->o.net;
  if (net->node_rank != 0) {
    snprintf(errbuf, errlen, "only node 0 stages maps");
    return EPD_ERR_UNSUPPORTED;
  }
  wout_t *wo = NULL;
  const epd_result_t rc =
      net_stage_and_send(eng, grp->name, map, copies, ncopies, version_out, &wo, errbuf, errlen);
  net_weights_queue(net, grp->name, wo); /* takes the link layer's lock only */
  return rc;
}

epd_result_t eng_net_set_map(epd_engine_t *eng, const char *group, const epd_expert_map_t *map,
                             const epd_weight_copy_t *copies, uint32_t ncopies, uint32_t *version_out,
                             char *errbuf, size_t errlen) {
  epd_net_t *net = eng->o.net;
  uint32_t version = 0;
  epd_result_t rc;
  if (net->node_rank == 0) {
    wout_t *wo = NULL;
    pthread_mutex_lock(&eng->mu);
    rc = net_stage_and_send(eng, group, map, copies, ncopies, &version, &wo, errbuf, errlen);
    pthread_mutex_unlock(&eng->mu);
    net_weights_queue(net, group, wo);
    if (!rc && version_out) *version_out = version;
    return rc;
  }
  /* Refuse what this node can tell is wrong without asking node 0. */
  pthread_mutex_lock(&eng->mu);
  eng_group_t *grp = eng_find_group(eng, group);
  if (!grp) {
    snprintf(errbuf, errlen, "group \"%s\" not found", group);
    rc = EPD_ERR_NOT_FOUND;
  } else {
    rc = epd_ref_map_validate(map, grp->g.num_experts, grp->g.num_ranks, grp->g.slots_per_rank, errbuf,
                              errlen);
  }
  pthread_mutex_unlock(&eng->mu);
  if (rc) return rc;
  ctl_wait_t w = {.status = EPD_ERR_TIMEOUT};
  pthread_mutex_lock(&net->mu);
  w.req_id = ++net->next_req;
  w.next = net->waits;
  net->waits = &w;
  pthread_mutex_unlock(&net->mu);
  ctl_msg_t m = {
      .kind = CTL_MAP_REQ, .req_id = w.req_id, .num_experts = map->num_experts, .ncopies = ncopies};
  int sent = net_send_ctl(net, 0, group, &m, map, copies) == 0;
  uint32_t wait_ms = eng->o.step_timeout_ms > 10000 ? eng->o.step_timeout_ms : 10000;
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += wait_ms / 1000;
  dl.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
  if (dl.tv_nsec >= 1000000000L) dl.tv_sec++, dl.tv_nsec -= 1000000000L;
  pthread_mutex_lock(&net->mu);
  while (sent && !w.done && !atomic_load(&net->peer[0].dead))
    if (pthread_cond_timedwait(&net->wait_cv, &net->mu, &dl) == ETIMEDOUT) break;
  for (ctl_wait_t **pp = &net->waits; *pp; pp = &(*pp)->next)
    if (*pp == &w) {
      *pp = w.next;
      break;
    }
  pthread_mutex_unlock(&net->mu);
  if (!w.done) {
    char why[160] = "";
    if (epd_net_node_dead(net, 0, why, sizeof why)) {
      snprintf(errbuf, errlen, "SetExpertMap goes through node 0, and the data link to node 0 is down: %s",
               why);
      return EPD_ERR_PEER;
    }
    snprintf(errbuf, errlen,
             "node 0 did not answer this SetExpertMap within %u ms (if it staged the map, every "
             "node still switches to it together)",
             wait_ms);
    return EPD_ERR_TIMEOUT;
  }
  if (w.status) {
    snprintf(errbuf, errlen, "%s", w.why[0] ? w.why : eng_result_name(w.status));
    return w.status;
  }
  if (version_out) *version_out = w.version;
  return EPD_OK;
}
