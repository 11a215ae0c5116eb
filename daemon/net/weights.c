/*
 * weights.c - expert weights copied between nodes when a staged map moves an expert to another node's
 * slot; sent by the control thread, never under the engine lock.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "net/net_internal.h"

/* ---- expert weights between nodes ----
 * A node that stages a map (node 0 first, then every other node as its MAP_SET comes) reads, for each of
 * the map's copies whose source rank is its own and whose destination is on another node, the source
 * slot's weights (they are final: the source holds its expert in the active map and no staged copy
 * fills it; its control thread reads them, weights_read) and sends them to the destination's node as a
 * CTL_WEIGHTS frame: ctl_msg_t (version: the map's; req_id: the copy, 16 bits each of src rank, src slot, dst
 * rank, dst slot; status and why: a source that could not be read), then the bytes. The destination keeps
 * them (eng_wblob_put) and reports the map in its step frames only once every copy into it has its bytes
 * (eng_vote_report), so every node switches when every destination can write its slots; the switch writes
 * them. */

static uint64_t copy_id(const epd_weight_copy_t *cp) {
  return (uint64_t)(cp->src_rank & 0xffffu) << 48 | (uint64_t)(cp->src_slot & 0xffffu) << 32 |
         (uint64_t)(cp->dst_rank & 0xffffu) << 16 | (cp->dst_slot & 0xffffu);
}
_Static_assert(EPD_MAX_RANKS <= 0x10000, "copy_id packs ranks in 16 bits");

static int copy_out(const epd_engine_t *eng, const epd_weight_copy_t *cp) {
  return eng_rank_local(eng, cp->src_rank) && !eng_rank_local(eng, cp->dst_rank);
}

/* (mu) The frame of one copy: its source slot's bytes (read later, by the control thread), or (status != 0)
 * why there are none. */
static wout_t *wout_make(epd_engine_t *eng, eng_group_t *grp, const epd_weight_copy_t *cp, uint32_t version,
                         int status, const char *why) {
  wout_t *w = calloc(1, sizeof *w);
  if (!w) return NULL;
  w->node = cp->dst_rank / (uint32_t)eng->o.num_ranks;
  w->m = (ctl_msg_t){.kind = CTL_WEIGHTS, .version = version, .req_id = copy_id(cp), .status = status};
  if (status) {
    snprintf(w->m.why, sizeof w->m.why, "%s", why);
    return w;
  }
  w->bytes = grp->weight_bytes_per_slot;
  w->frame = w->bytes ? malloc(WOUT_HDR + w->bytes) : NULL;
  w->cp = *cp;
  w->gserial = grp->serial;
  eng_client_t *c = cp->src_rank < grp->g.num_ranks ? grp->client[cp->src_rank] : NULL;
  w->client_id = c ? c->id : 0;
  if (!w->bytes) {
    w->m.status = EPD_ERR_INVALID;
    snprintf(w->m.why, sizeof w->m.why, "group %s has no expert-weights region", grp->name);
  } else if (!w->frame) {
    w->m.status = EPD_ERR_NOMEM;
    snprintf(w->m.why, sizeof w->m.why, "out of memory for %llu bytes", (unsigned long long)w->bytes);
    w->bytes = 0;
  }
  return w;
}

/* (mu) Whether this node can read the source of a copy of map `version` now: its client is attached and no
 * older staged copy still fills the slot. */
static int source_ready(const eng_group_t *grp, const epd_weight_copy_t *cp, uint32_t version) {
  return cp->src_rank < grp->g.num_ranks && grp->client[cp->src_rank] &&
         !eng_slot_being_filled(grp, cp->src_rank, cp->src_slot, version);
}

/* (mu) After this node staged `version` with these copies (grp NULL or status != 0: it could not stage it,
 * so the destinations learn why at once instead of waiting): the frames it owes other nodes. A source it
 * cannot read yet is kept in grp->wdefer and read at a later step frame (weights_retry). */
wout_t *net_weights_out(epd_engine_t *eng, eng_group_t *grp, const epd_weight_copy_t *cp, uint32_t n,
                        uint32_t version, int status, const char *why) {
  wout_t *head = NULL, **tail = &head;
  for (uint32_t i = 0; i < n; i++) {
    if (!copy_out(eng, &cp[i])) continue;
    int st = status ? status : !grp ? EPD_ERR_NOT_FOUND : 0;
    const char *wy = status ? why : "the group does not exist on the source's node";
    if (!st && !source_ready(grp, &cp[i], version)) {
      eng_wdefer_t *d = calloc(1, sizeof *d);
      if (d) {
        *d = (eng_wdefer_t){grp->wdefer, cp[i], version};
        grp->wdefer = d;
        continue;
      }
      st = EPD_ERR_NOMEM;
      wy = "out of memory";
    }
    wout_t *w = wout_make(eng, grp, &cp[i], version, st, wy);
    if (!w) break; /* the destination waits eng_weights_wait_ms, then skips the copy */
    *tail = w;
    tail = &w->next;
  }
  return head;
}

/* (mu) The deferred sources that can be read now (those of maps already active are dropped: their switch
 * skipped the copy). */
wout_t *net_weights_retry(epd_engine_t *eng, eng_group_t *grp) {
  wout_t *head = NULL, **tail = &head;
  for (eng_wdefer_t **pp = &grp->wdefer; *pp;) {
    eng_wdefer_t *d = *pp;
    if (d->version <= grp->map.version) {
      *pp = d->next;
      free(d);
      continue;
    }
    if (!source_ready(grp, &d->cp, d->version)) {
      pp = &d->next;
      continue;
    }
    wout_t *w = wout_make(eng, grp, &d->cp, d->version, 0, NULL);
    if (!w) break;
    *tail = w;
    tail = &w->next;
    *pp = d->next;
    free(d);
  }
  return head;
}

#ifdef EPD_TEST_HOOKS
void epd_net_test_weights_delay(epd_net_t *net, uint32_t ms) {
  atomic_store(&net->weights_delay_ms, ms);
}
#endif

void net_wout_free(wout_t *w) {
  while (w) {
    wout_t *next = w->next;
    free(w->frame);
    free(w);
    w = next;
  }
}

/* Hand the frames to the control thread (any thread, engine lock held or not). */
void net_weights_queue(epd_net_t *net, const char *group, wout_t *w) {
  if (!w) return;
  wq_t *q = calloc(1, sizeof *q);
  if (!q) { /* the destinations wait eng_weights_wait_ms, then skip the copies */
    net_wout_free(w);
    return;
  }
  snprintf(q->group, sizeof q->group, "%s", group);
  q->w = w;
  pthread_mutex_lock(&net->mu);
  if (!net->ctl_on) { /* stopping: nothing sends any more */
    pthread_mutex_unlock(&net->mu);
    net_wout_free(w);
    free(q);
    return;
  }
  if (net->wq_tail)
    net->wq_tail->next = q;
  else
    net->wq_head = q;
  net->wq_tail = q;
  pthread_cond_signal(&net->ctl_cv);
  pthread_mutex_unlock(&net->mu);
}

/* Read a frame's source slot (the control thread): WREAD_CHUNK bytes per hold of the engine lock, so the
 * node's steps wait at most one chunk's copy (from the GPU on cuda), not the whole slot's. Every chunk
 * comes from the same client of the same group incarnation; else the frame says why there are no bytes.
 * The bytes cannot change meanwhile: no node switches to the map (so no copy can fill this slot) before
 * the destination has them. */
static void weights_read(epd_net_t *net, const char *group, wout_t *w) {
  epd_engine_t *eng = net->eng;
  for (uint64_t off = 0; off < w->bytes && !w->m.status; off += WREAD_CHUNK) {
    const uint64_t n = w->bytes - off < WREAD_CHUNK ? w->bytes - off : WREAD_CHUNK;
    pthread_mutex_lock(&eng->mu);
    eng_group_t *grp = eng_find_group(eng, group);
    eng_client_t *c = grp && w->cp.src_rank < grp->g.num_ranks ? grp->client[w->cp.src_rank] : NULL;
    if (!grp || grp->serial != w->gserial) {
      w->m.status = EPD_ERR_NOT_FOUND;
      snprintf(w->m.why, sizeof w->m.why, "group %s was removed on node %u before the slot was read", group,
               net->node_rank);
    } else if (!c || c->id != w->client_id) {
      w->m.status = EPD_ERR_PEER;
      snprintf(w->m.why, sizeof w->m.why, "the client of rank %u %s while its slot was read", w->cp.src_rank,
               c ? "was replaced" : "left");
    } else {
      w->m.status = eng_slot_weights_io(eng, grp, w->cp.src_rank, w->cp.src_slot, off, n,
                                        w->frame + WOUT_HDR + off, 0, w->m.why, sizeof w->m.why);
    }
    pthread_mutex_unlock(&eng->mu);
  }
  if (w->m.status) {
    free(w->frame);
    w->frame = NULL;
    w->bytes = 0;
  }
}

/* Read, send and free (the control thread). */
void net_weights_send(epd_net_t *net, const char *group, wout_t *w) {
#ifdef EPD_TEST_HOOKS
  const uint32_t delay = atomic_load(&net->weights_delay_ms);
  if (w && delay) usleep(delay * 1000u);
#endif
  while (w) {
    wout_t *next = w->next;
    if (!w->m.status) weights_read(net, group, w);
    /* an error frame has no bytes: its header alone */
    uint8_t *b = w->frame ? w->frame : malloc(WOUT_HDR);
    net_hdr_t h = {.magic = CTL_MAGIC, .src_node = net->node_rank};
    snprintf(h.group, sizeof h.group, "%s", group);
    int rc = -1;
    if (b) {
      memcpy(b, &h, sizeof h);
      memcpy(b + sizeof h, &w->m, sizeof w->m);
      rc = net_send(net, w->node, b, WOUT_HDR + w->bytes);
    }
    if (rc)
      EPD_LOGE(EPD_SUB_ENGINE,
               "group %s: the weights of a copy for map version %u not sent to node %u (%s): it "
               "waits %u ms for them, then skips the copy",
               group, w->m.version, w->node, b ? "link down" : "out of memory",
               eng_weights_wait_ms(net->eng));
    free(b);
    free(w);
    w = next;
  }
}

/* A CTL_WEIGHTS frame (the control thread). */
void net_weights_in(epd_engine_t *eng, const net_frame_t *f, const ctl_msg_t *c, const char *group) {
  const size_t hl = sizeof(net_hdr_t) + sizeof *c;
  const uint64_t bytes = f->len - hl;
  const epd_weight_copy_t cp = {(uint32_t)(c->req_id >> 48), (uint32_t)(c->req_id >> 32) & 0xffffu,
                                (uint32_t)(c->req_id >> 16) & 0xffffu, (uint32_t)c->req_id & 0xffffu};
  pthread_mutex_lock(&eng->mu);
  eng_group_t *grp = eng_find_group(eng, group);
  const char *bad =
      !grp ? "the group does not exist here"
      : cp.dst_rank >= grp->g.num_ranks || !eng_rank_local(eng, cp.dst_rank) ||
              cp.src_rank >= grp->g.num_ranks || cp.src_rank / (uint32_t)eng->o.num_ranks != f->src_node
          ? "its ranks are not a copy from that node into this one"
      : cp.dst_slot >= grp->g.slots_per_rank || cp.src_slot >= grp->g.slots_per_rank
          ? "a slot is out of range"
      : !c->status && bytes != grp->weight_bytes_per_slot ? "its size is not the group's weights per slot"
                                                          : NULL;
  if (!bad && c->version <= grp->map.version) bad = "its map version is already active here";
  uint8_t *data = NULL;
  if (!bad && !c->status && bytes && !(data = malloc(bytes))) bad = "out of memory";
  if (!bad) {
    if (data) memcpy(data, f->buf + hl, bytes);
    eng_wblob_put(grp, &cp, c->version, c->status, c->why, data, c->status ? 0 : bytes);
  }
  pthread_mutex_unlock(&eng->mu);
  if (bad)
    EPD_LOGW(EPD_SUB_ENGINE,
             "group %s: weights of copy (%u,%u) -> (%u,%u) for map version %u from node %u "
             "dropped: %s",
             group, cp.src_rank, cp.src_slot, cp.dst_rank, cp.dst_slot, c->version, f->src_node, bad);
  else if (c->status)
    EPD_LOGW(EPD_SUB_ENGINE,
             "group %s: weights of copy (%u,%u) -> (%u,%u) for map version %u: node %u could not "
             "read them (%s); the copy is skipped at the switch",
             group, cp.src_rank, cp.src_slot, cp.dst_rank, cp.dst_slot, c->version, f->src_node, c->why);
  else
    EPD_LOGI(EPD_SUB_ENGINE,
             "group %s: weights of copy (%u,%u) -> (%u,%u) for map version %u received from node %u "
             "(%llu bytes)",
             group, cp.src_rank, cp.src_slot, cp.dst_rank, cp.dst_slot, c->version, f->src_node,
             (unsigned long long)bytes);
}
