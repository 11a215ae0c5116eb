/*
 * maps.c - expert maps in the engine core: validation and staging (SetExpertMap), the switch at a
 * dispatch step boundary with its weight copies (and the bytes other nodes send for them), and the map
 * table every client's queue mapping carries (epd_abi.h).
 */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>

#include "core/engine_internal.h"
#include "core/log.h"

#define ALIGN_UP(x, a) (((x) + (a)-1) / (a) * (a))
#define QUEUE_BYTES ALIGN_UP(sizeof(epd_queue_t), 4096)
#define MAP_TABLE_OFFSET QUEUE_BYTES /* the queue, then the map table */

/* Bytes of the queue mapping: the queue, then the map table (epd_abi.h), each page-aligned. */
uint64_t eng_queue_bytes(const eng_group_t *grp) {
  return QUEUE_BYTES + ALIGN_UP(epd_map_table_bytes(grp->g.num_experts, EPD_MAX_REPLICAS, grp->g.num_ranks,
                                                    grp->g.slots_per_rank),
                                4096);
}

/* Write the group's active map into a client's map table (a seqlock: see epd_abi.h). */
void eng_map_table_write(eng_client_t *c) {
  const eng_group_t *grp = c->grp;
  const epd_expert_map_t *m = &grp->map;
  if (!c->queue || c->queue_bytes < eng_queue_bytes(grp)) return;
  epd_map_table_t *t = (epd_map_table_t *)((uint8_t *)c->queue + MAP_TABLE_OFFSET);
  uint32_t E = m->num_experts, X = EPD_MAX_REPLICAS, RS = grp->g.num_ranks * grp->g.slots_per_rank;
  uint32_t *nrep = (uint32_t *)(t + 1), *rep = nrep + E;
  int32_t *slot_expert = (int32_t *)(rep + (size_t)E * X * 2);
  _Atomic uint32_t *seq = (_Atomic uint32_t *)&t->seq;
  uint32_t s0 = atomic_load_explicit(seq, memory_order_relaxed);
  atomic_store_explicit(seq, s0 | 1u, memory_order_relaxed);
  atomic_thread_fence(memory_order_release);
  t->magic = EPD_MAP_TABLE_MAGIC;
  t->version = m->version;
  t->num_experts = E;
  t->num_ranks = grp->g.num_ranks;
  t->slots_per_rank = grp->g.slots_per_rank;
  t->max_replicas = X;
  t->ranks_per_node = m->ranks_per_node;
  t->step = grp->steps;
  for (uint32_t i = 0; i < RS; i++) slot_expert[i] = -1;
  for (uint32_t e = 0; e < E; e++) {
    nrep[e] = m->nrep[e];
    for (uint32_t i = 0; i < X; i++) {
      rep[((size_t)e * X + i) * 2] = i < m->nrep[e] ? m->rep[e][i].rank : 0;
      rep[((size_t)e * X + i) * 2 + 1] = i < m->nrep[e] ? m->rep[e][i].slot : 0;
      if (i < m->nrep[e])
        slot_expert[m->rep[e][i].rank * grp->g.slots_per_rank + m->rep[e][i].slot] = (int32_t)e;
    }
  }
  c->queue->map_table_offset = MAP_TABLE_OFFSET;
  atomic_store_explicit((_Atomic uint64_t *)&c->queue->masked_ranks, grp->mask, memory_order_release);
  atomic_store_explicit(seq, (s0 | 1u) + 1u, memory_order_release);
}

epd_result_t eng_slot_weights_io(epd_engine_t *eng, eng_group_t *grp, uint32_t rank, uint32_t slot,
                                 uint64_t off, uint64_t len, void *host, int write, char *err,
                                 size_t errlen) {
  const uint64_t wb = grp->weight_bytes_per_slot, woff = eng_buf_offset(grp, EPD_BUF_EXPERT_WEIGHTS, 0);
  eng_client_t *c = rank < grp->g.num_ranks ? grp->client[rank] : NULL;
  if (!wb || woff == UINT64_MAX || slot >= grp->g.slots_per_rank) {
    snprintf(err, errlen, "group %s has no expert-weights region or no slot %u", grp->name, slot);
    return EPD_ERR_INVALID;
  }
  if (off > wb || len > wb - off) {
    snprintf(err, errlen, "bytes %llu..%llu are outside a slot of %llu", (unsigned long long)off,
             (unsigned long long)(off + len), (unsigned long long)wb);
    return EPD_ERR_INVALID;
  }
  if (!c || !eng_rank_local(eng, rank)) {
    snprintf(err, errlen, "rank %u has no attached client on node %u", rank, eng->o.node_rank);
    return EPD_ERR_NOT_FOUND;
  }
  if (eng->ops->arena_io)
    return eng->ops->arena_io(eng, c, woff + slot * wb + off, host, len, write, err, errlen);
  uint8_t *w = (uint8_t *)eng_buf(c, EPD_BUF_EXPERT_WEIGHTS, 0) + slot * wb + off;
  if (write)
    memcpy(w, host, len);
  else
    memcpy(host, w, len);
  return EPD_OK;
}

static int same_copy(const epd_weight_copy_t *a, const epd_weight_copy_t *b) {
  return a->src_rank == b->src_rank && a->src_slot == b->src_slot && a->dst_rank == b->dst_rank &&
         a->dst_slot == b->dst_slot;
}

void eng_wblob_free(eng_wblob_t *b) {
  free(b->data);
  free(b);
}

void eng_wblob_put(eng_group_t *grp, const epd_weight_copy_t *cp, uint32_t version, int status,
                   const char *why, uint8_t *data, uint64_t bytes) {
  for (eng_wblob_t **pp = &grp->wblobs; *pp; pp = &(*pp)->next)
    if (same_copy(&(*pp)->cp, cp) && (*pp)->version == version) {
      eng_wblob_t *old = *pp;
      *pp = old->next;
      eng_wblob_free(old);
      break;
    }
  eng_wblob_t *b = calloc(1, sizeof *b);
  if (!b) {
    free(data);
    return; /* the map waits: this node does not report it ready */
  }
  b->cp = *cp;
  b->version = version;
  b->status = status;
  snprintf(b->why, sizeof b->why, "%s", why ? why : "");
  b->data = data;
  b->bytes = bytes;
  b->next = grp->wblobs;
  grp->wblobs = b;
}

/* The received bytes of staged copy i (NULL: not yet). */
static eng_wblob_t *wblob_of(const eng_group_t *grp, uint32_t i) {
  for (eng_wblob_t *b = grp->wblobs; b; b = b->next)
    if (same_copy(&b->cp, &grp->staged_copies[i]) && b->version == grp->staged_copy_meta[i].version) return b;
  return NULL;
}

static int copy_from_node(const epd_engine_t *eng, const epd_weight_copy_t *cp) {
  return eng_rank_local(eng, cp->dst_rank) && !eng_rank_local(eng, cp->src_rank);
}

uint32_t eng_weights_wait_ms(const epd_engine_t *eng) {
  const uint64_t w = 4ull * eng->o.step_timeout_ms;
  return w > 10000 ? (uint32_t)(w < UINT32_MAX ? w : UINT32_MAX) : 10000u;
}

int eng_weights_ready(const epd_engine_t *eng, const eng_group_t *grp) {
  const uint64_t now = eng_now_ns(), wait = (uint64_t)eng_weights_wait_ms(eng) * 1000000ull;
  for (uint32_t i = 0; i < grp->nstaged_copies; i++)
    if (copy_from_node(eng, &grp->staged_copies[i]) && !wblob_of(grp, i) &&
        (!grp->staged_copy_meta[i].staged_ns || now - grp->staged_copy_meta[i].staged_ns < wait))
      return 0;
  return 1;
}

void eng_weights_clock(eng_group_t *grp) {
  uint64_t now = 0;
  for (uint32_t i = 0; i < grp->nstaged_copies; i++)
    if (!grp->staged_copy_meta[i].staged_ns)
      grp->staged_copy_meta[i].staged_ns = now ? now : (now = eng_now_ns());
}

int eng_slot_being_filled(const eng_group_t *grp, uint32_t rank, uint32_t slot, uint32_t v) {
  for (uint32_t i = 0; i < grp->nstaged_copies; i++)
    if (grp->staged_copies[i].dst_rank == rank && grp->staged_copies[i].dst_slot == slot &&
        grp->staged_copy_meta[i].version < v)
      return 1;
  return 0;
}

uint64_t eng_weights_from_node(epd_engine_t *eng, eng_group_t *grp, uint32_t i) {
  const epd_weight_copy_t *cp = &grp->staged_copies[i];
  eng_wblob_t *b = wblob_of(grp, i);
  char why[200] = "";
  if (!b)
    snprintf(why, sizeof why, "its weights did not come from node %u within %u ms",
             cp->src_rank / (uint32_t)eng->o.num_ranks, eng_weights_wait_ms(eng));
  else if (b->status)
    snprintf(why, sizeof why, "node %u could not read them: %s", cp->src_rank / (uint32_t)eng->o.num_ranks,
             b->why);
  else if (b->bytes != grp->weight_bytes_per_slot)
    snprintf(why, sizeof why, "%llu bytes came for a slot of %llu", (unsigned long long)b->bytes,
             (unsigned long long)grp->weight_bytes_per_slot);
  else
    eng_slot_weights_io(eng, grp, cp->dst_rank, cp->dst_slot, 0, b->bytes, b->data, 1, why, sizeof why);
  if (why[0]) {
    eng_emit(eng, "error", grp, (int)cp->dst_rank, 0, 0, 0, grp->steps,
             "group %s: weight copy (%u,%u) -> (%u,%u) skipped: %s", grp->name, cp->src_rank, cp->src_slot,
             cp->dst_rank, cp->dst_slot, why);
    return 0;
  }
  return grp->weight_bytes_per_slot;
}

/* After a switch to version v: the received weights of copies of v or older are used or stale. */
static void wblobs_drop_upto(eng_group_t *grp, uint32_t v) {
  for (eng_wblob_t **pp = &grp->wblobs; *pp;) {
    if ((*pp)->version <= v) {
      eng_wblob_t *b = *pp;
      *pp = b->next;
      eng_wblob_free(b);
    } else {
      pp = &(*pp)->next;
    }
  }
}

/* The host backend's weight copies: memcpy between the clients' weights regions (every rank of the group
 * is attached: a step is being executed). Returns bytes copied. */
static uint64_t do_weight_copies(epd_engine_t *eng, eng_group_t *grp) {
  if (eng->ops->copy_weights) return grp->nstaged_copies ? eng->ops->copy_weights(eng, grp) : 0;
  uint64_t bytes = 0, wb = grp->weight_bytes_per_slot;
  for (uint32_t i = 0; i < grp->nstaged_copies; i++) {
    const epd_weight_copy_t *cp = &grp->staged_copies[i];
    /* Scale-out: a node copies only into its own ranks, with the bytes the source's node sent where the
     * source is elsewhere. */
    if (!eng_rank_local(eng, cp->dst_rank)) continue;
    if (!eng_rank_local(eng, cp->src_rank)) {
      bytes += eng_weights_from_node(eng, grp, i);
      continue;
    }
    eng_client_t *src = grp->client[cp->src_rank], *dst = grp->client[cp->dst_rank];
    uint8_t *sw = src ? eng_buf(src, EPD_BUF_EXPERT_WEIGHTS, 0) : NULL;
    uint8_t *dw = dst ? eng_buf(dst, EPD_BUF_EXPERT_WEIGHTS, 0) : NULL;
    if (!sw || !dw) {
      eng_emit(eng, "error", grp, sw ? (int)cp->dst_rank : (int)cp->src_rank, 0, 0, 0, grp->steps,
               "group %s: weight copy (%u,%u) -> (%u,%u) skipped: rank %u has no attached client", grp->name,
               cp->src_rank, cp->src_slot, cp->dst_rank, cp->dst_slot, sw ? cp->dst_rank : cp->src_rank);
      continue;
    }
    memmove(dw + cp->dst_slot * wb, sw + cp->src_slot * wb, wb);
    bytes += wb;
  }
  return bytes;
}

/* Make m active (taken over), after the first ncopies of the staged copies (those m carried); the rest
 * stay staged with the newer staged map, if any (none: unstage, once the copies are done). */
static void switch_map(epd_engine_t *eng, eng_group_t *grp, epd_expert_map_t *m, uint32_t ncopies,
                       int unstage) {
  uint32_t old = grp->map.version, all = grp->nstaged_copies;
  if (ncopies > all) ncopies = all;
  grp->nstaged_copies = ncopies;
  uint64_t copied = do_weight_copies(eng, grp);
  if (unstage) grp->has_staged = 0;
  grp->nstaged_copies = all - ncopies;
  if (grp->nstaged_copies) {
    memmove(grp->staged_copies, grp->staged_copies + ncopies,
            sizeof *grp->staged_copies * grp->nstaged_copies);
    memmove(grp->staged_copy_meta, grp->staged_copy_meta + ncopies,
            sizeof *grp->staged_copy_meta * grp->nstaged_copies);
  } else {
    free(grp->staged_copies);
    free(grp->staged_copy_meta);
    grp->staged_copies = NULL;
    grp->staged_copy_meta = NULL;
  }
  wblobs_drop_upto(grp, m->version);
  grp->weight_bytes_copied += copied;
  grp->map_switches++;
  epd_expert_map_free(&grp->map);
  grp->map = *m;
  memset(m, 0, sizeof *m);
  for (uint32_t r = 0; r < grp->g.num_ranks; r++)
    if (grp->client[r]) eng_map_table_write(grp->client[r]);
  if (grp->mask) eng_mask_changed(eng, grp);
  eng_emit(eng, "map_switch", grp, -1, 0, old, grp->map.version, grp->steps,
           "group %s switched expert map %u -> %u at step %llu (%llu weight bytes copied)", grp->name, old,
           grp->map.version, (unsigned long long)grp->steps, (unsigned long long)copied);
}

void eng_apply_staged_map(epd_engine_t *eng, eng_group_t *grp) {
  if (!grp->has_staged) return;
  switch_map(eng, grp, &grp->staged, grp->nstaged_copies, 1);
}

int eng_apply_staged_version(epd_engine_t *eng, eng_group_t *grp, const epd_expert_map_t *m,
                             uint32_t ncopies) {
  if (!grp->has_staged || grp->staged.version < m->version) return -1;
  if (grp->staged.version == m->version) {
    eng_apply_staged_map(eng, grp);
    return 0;
  }
  epd_expert_map_t c;
  if (epd_ref_map_copy(&c, m)) return -1;
  c.num_ranks = m->num_ranks;
  c.slots_per_rank = m->slots_per_rank;
  c.ranks_per_node = m->ranks_per_node;
  c.version = m->version;
  switch_map(eng, grp, &c, ncopies, 0);
  return 0;
}

/* ---- expert maps -------------------------------------------------------------------------------- */

epd_result_t epd_engine_set_map(epd_engine_t *eng, const char *group, const epd_expert_map_t *map,
                                uint32_t *version_out, char *errbuf, size_t errlen) {
  return epd_engine_set_map_copies(eng, group, map, NULL, 0, version_out, errbuf, errlen);
}

/* Logical expert a map places on (rank, slot), or -1. */
static int32_t map_slot_expert(const epd_expert_map_t *m, uint32_t rank, uint32_t slot) {
  for (uint32_t e = 0; e < m->num_experts; e++)
    for (uint32_t i = 0; i < m->nrep[e] && i < EPD_MAX_REPLICAS; i++)
      if (m->rep[e][i].rank == rank && m->rep[e][i].slot == slot) return (int32_t)e;
  return -1;
}

/* Check a map's weight copies against the group and against the copies still staged (a slot being
 * migrated): (mu). */
static epd_result_t check_copies(epd_engine_t *eng, const eng_group_t *grp, const epd_expert_map_t *map,
                                 const epd_weight_copy_t *cp, uint32_t n, char *err, size_t errlen) {
  const epd_ref_geom_t *g = &grp->g;
  if (n && !grp->weight_bytes_per_slot) {
    snprintf(err, errlen,
             "copies: group \"%s\" has no expert-weights region (attach with "
             "weight_bytes_per_slot > 0)",
             grp->name);
    return EPD_ERR_INVALID;
  }
  if (n && strcmp(eng->ops->name, "host") && !eng->ops->copy_weights) {
    snprintf(err, errlen, "copies: backend %s cannot copy expert weights", eng->ops->name);
    return EPD_ERR_UNSUPPORTED;
  }
  if (n > g->num_ranks * g->slots_per_rank) {
    snprintf(err, errlen, "copies: %u copies, at most one per destination slot (%u)", n,
             g->num_ranks * g->slots_per_rank);
    return EPD_ERR_INVALID;
  }
  for (uint32_t i = 0; i < n; i++) {
    if (cp[i].src_rank >= g->num_ranks || cp[i].dst_rank >= g->num_ranks ||
        cp[i].src_slot >= g->slots_per_rank || cp[i].dst_slot >= g->slots_per_rank) {
      snprintf(err, errlen,
               "copies[%u]: (rank %u, slot %u) -> (rank %u, slot %u): ranks must be in [0, %u), "
               "slots in [0, %u)",
               i, cp[i].src_rank, cp[i].src_slot, cp[i].dst_rank, cp[i].dst_slot, g->num_ranks,
               g->slots_per_rank);
      return EPD_ERR_INVALID;
    }
    if (cp[i].src_rank == cp[i].dst_rank && cp[i].src_slot == cp[i].dst_slot) {
      snprintf(err, errlen, "copies[%u]: source and destination are the same slot (rank %u, slot %u)", i,
               cp[i].src_rank, cp[i].src_slot);
      return EPD_ERR_INVALID;
    }
    for (uint32_t j = 0; j < i; j++) {
      if (cp[j].dst_rank == cp[i].dst_rank && cp[j].dst_slot == cp[i].dst_slot) {
        snprintf(err, errlen,
                 "copies[%u]: destination (rank %u, slot %u) is also the destination of copies[%u]", i,
                 cp[i].dst_rank, cp[i].dst_slot, j);
        return EPD_ERR_INVALID;
      }
      /* All copies of a map happen at once: a chain would depend on their order. */
      if ((cp[j].dst_rank == cp[i].src_rank && cp[j].dst_slot == cp[i].src_slot) ||
          (cp[i].dst_rank == cp[j].src_rank && cp[i].dst_slot == cp[j].src_slot)) {
        snprintf(err, errlen,
                 "copies[%u] and copies[%u]: one copies from the slot the other copies into; "
                 "split the migration into two maps",
                 j, i);
        return EPD_ERR_INVALID;
      }
    }
    /* The destination must end up holding the expert the map places there, i.e. the source's expert in
     * the active map; a copy into a slot the new map leaves free is allowed (prefetch). */
    int32_t want = map_slot_expert(map, cp[i].dst_rank, cp[i].dst_slot);
    int32_t have = map_slot_expert(&grp->map, cp[i].src_rank, cp[i].src_slot);
    if (want >= 0 && have >= 0 && want != have) {
      snprintf(err, errlen,
               "copies[%u]: source (rank %u, slot %u) holds expert %d in the active map version %u, "
               "but the map places expert %d on the destination (rank %u, slot %u)",
               i, cp[i].src_rank, cp[i].src_slot, have, grp->map.version, want, cp[i].dst_rank,
               cp[i].dst_slot);
      return EPD_ERR_INVALID;
    }
  }
  /* A slot being migrated: the staged map's copies run at its switch. A new map replaces the staged
   * one but inherits its copies, so it must not change what those copies fill, nor copy from or into
   * their slots. */
  for (uint32_t k = 0; grp->has_staged && k < grp->nstaged_copies; k++) {
    const epd_weight_copy_t *p = &grp->staged_copies[k];
    int32_t staged_e = map_slot_expert(&grp->staged, p->dst_rank, p->dst_slot);
    int32_t new_e = map_slot_expert(map, p->dst_rank, p->dst_slot);
    if (staged_e != new_e) {
      snprintf(err, errlen,
               "(rank %u, slot %u) is being migrated for staged map version %u (expert %d); this map "
               "places %s%d there: send it after the switch or keep the slot",
               p->dst_rank, p->dst_slot, grp->staged.version, staged_e,
               new_e < 0 ? "nothing, not expert " : "expert ", new_e < 0 ? staged_e : new_e);
      return EPD_ERR_BUSY;
    }
    for (uint32_t i = 0; i < n; i++)
      if ((cp[i].dst_rank == p->dst_rank && cp[i].dst_slot == p->dst_slot) ||
          (cp[i].src_rank == p->dst_rank && cp[i].src_slot == p->dst_slot) ||
          (cp[i].dst_rank == p->src_rank && cp[i].dst_slot == p->src_slot)) {
        snprintf(err, errlen,
                 "copies[%u]: (rank %u, slot %u) -> (rank %u, slot %u) touches a slot being migrated for "
                 "staged map version %u ((rank %u, slot %u) -> (rank %u, slot %u)); send it after the switch",
                 i, cp[i].src_rank, cp[i].src_slot, cp[i].dst_rank, cp[i].dst_slot, grp->staged.version,
                 p->src_rank, p->src_slot, p->dst_rank, p->dst_slot);
        return EPD_ERR_BUSY;
      }
  }
  return EPD_OK;
}

/* Serialised by eng->mu: every call gets the next version (or `version`, given by node 0 in scale-out);
 * the map staged last before a dispatch step boundary is the one that becomes active there (earlier
 * staged maps are never active, their weight copies are inherited). */
epd_result_t eng_stage_map(epd_engine_t *eng, eng_group_t *grp, const epd_expert_map_t *map,
                           const epd_weight_copy_t *copies, uint32_t ncopies, uint32_t version, int check,
                           uint32_t *version_out, char *errbuf, size_t errlen) {
  epd_result_t rc;
  if ((rc = epd_ref_map_validate(map, grp->g.num_experts, grp->g.num_ranks, grp->g.slots_per_rank, errbuf,
                                 errlen)))
    return rc;
  if (check && (rc = check_copies(eng, grp, map, copies, ncopies, errbuf, errlen))) return rc;
  uint32_t nall = grp->nstaged_copies + ncopies;
  epd_weight_copy_t *all = NULL;
  eng_copy_meta_t *allv = NULL;
  if (nall && (!(all = malloc(sizeof *all * nall)) || !(allv = malloc(sizeof *allv * nall)))) {
    free(all);
    snprintf(errbuf, errlen, "out of memory");
    return EPD_ERR_NOMEM;
  }
  if (grp->nstaged_copies) {
    memcpy(all, grp->staged_copies, sizeof *all * grp->nstaged_copies);
    memcpy(allv, grp->staged_copy_meta, sizeof *allv * grp->nstaged_copies);
  }
  if (ncopies) memcpy(all + grp->nstaged_copies, copies, sizeof *all * ncopies);
  epd_expert_map_t m;
  if ((rc = epd_ref_map_copy(&m, map))) {
    free(all);
    free(allv);
    snprintf(errbuf, errlen, "out of memory");
    return rc;
  }
  m.num_ranks = grp->g.num_ranks;
  m.slots_per_rank = grp->g.slots_per_rank;
  m.ranks_per_node = eng->o.ranks_per_node;
  const uint32_t prev_last = grp->last_version;
  m.version = version ? version : grp->last_version + 1;
  grp->last_version = m.version;
  if (grp->has_staged) epd_expert_map_free(&grp->staged);
  grp->staged = m;
  grp->has_staged = 1;
  /* staged_ns: 0 until this node's first step frame after staging (eng_weights_clock) */
  for (uint32_t i = grp->nstaged_copies; i < nall; i++) allv[i] = (eng_copy_meta_t){m.version, 0};
  /* node 0 numbered this map below one this node staged before: the group was re-created there (its
   * numbering restarted); weights received for those versions belong to the old incarnation */
  if (version && version <= prev_last)
    for (eng_wblob_t **pp = &grp->wblobs; *pp;) {
      if ((*pp)->version >= version) {
        eng_wblob_t *b = *pp;
        *pp = b->next;
        eng_wblob_free(b);
      } else {
        pp = &(*pp)->next;
      }
    }
  free(grp->staged_copies);
  free(grp->staged_copy_meta);
  grp->staged_copies = all;
  grp->staged_copy_meta = allv;
  grp->nstaged_copies = nall;
  if (version_out) *version_out = m.version;
  /* A backend that runs steps without the engine thread (CUDA persistent kernels) must stop before the
   * call returns: the first dispatch executing after it uses the staged map. */
  if (eng->ops->sync_steps) eng->ops->sync_steps(eng, grp);
  EPD_LOGD(EPD_SUB_ENGINE, "group %s: expert map version %u staged (%u weight copies pending)", grp->name,
           m.version, nall);
  return EPD_OK;
}

epd_result_t epd_engine_set_map_copies(epd_engine_t *eng, const char *group, const epd_expert_map_t *map,
                                       const epd_weight_copy_t *copies, uint32_t ncopies,
                                       uint32_t *version_out, char *errbuf, size_t errlen) {
  const char *name = group && *group ? group : "default";
  /* Scale-out (either backend): node 0 numbers and stages every map and sends it to every node
   * (net/maps.c); the nodes switch to it at the same step (the vote in net/maps.c, over the step frames
   * of net/step.c for the host backend and of cuda/engine_cuda_net.c for cuda). */
  if (eng->so) return eng->so->set_map(eng, name, map, copies, ncopies, version_out, errbuf, errlen);
  pthread_mutex_lock(&eng->mu);
  epd_result_t rc = EPD_OK;
  eng_group_t *grp = eng_find_group(eng, name);
  if (!grp) {
    snprintf(errbuf, errlen, "group \"%s\" not found", name);
    rc = EPD_ERR_NOT_FOUND;
  } else {
    rc = eng_stage_map(eng, grp, map, copies, ncopies, 0, 1, version_out, errbuf, errlen);
  }
  pthread_mutex_unlock(&eng->mu);
  return rc;
}

epd_result_t epd_engine_get_map(epd_engine_t *eng, const char *group, epd_expert_map_t *out) {
  const char *name = group && *group ? group : "default";
  pthread_mutex_lock(&eng->mu);
  eng_group_t *grp = eng_find_group(eng, name);
  epd_result_t rc = grp ? epd_ref_map_copy(out, &grp->map) : EPD_ERR_NOT_FOUND;
  pthread_mutex_unlock(&eng->mu);
  return rc;
}

/* A restored map replaces the default map of a group that has run nothing yet, keeping its version, so
 * that the next SetExpertMap continues the numbering (daemon restart with daemon.state_dir). */
epd_result_t epd_engine_restore_map(epd_engine_t *eng, const char *group, const epd_expert_map_t *map,
                                    char *errbuf, size_t errlen) {
  const char *name = group && *group ? group : "default";
  pthread_mutex_lock(&eng->mu);
  epd_result_t rc = EPD_OK;
  eng_group_t *grp = eng_find_group(eng, name);
  epd_expert_map_t m;
  if (!grp) {
    snprintf(errbuf, errlen, "group \"%s\" not found", name);
    rc = EPD_ERR_NOT_FOUND;
    goto out;
  }
  if (grp->steps || grp->has_staged || grp->last_version != 1 || map->version < 1) {
    snprintf(errbuf, errlen, "group \"%s\" already has map version %u or ran steps", name, grp->last_version);
    rc = EPD_ERR_STATE;
    goto out;
  }
  if ((rc = epd_ref_map_validate(map, grp->g.num_experts, grp->g.num_ranks, grp->g.slots_per_rank, errbuf,
                                 errlen)))
    goto out;
  if ((rc = epd_ref_map_copy(&m, map))) goto out;
  m.num_ranks = grp->g.num_ranks;
  m.slots_per_rank = grp->g.slots_per_rank;
  m.ranks_per_node = eng->o.ranks_per_node;
  m.version = map->version;
  epd_expert_map_free(&grp->map);
  grp->map = m;
  grp->last_version = m.version;
  for (uint32_t r = 0; r < grp->g.num_ranks; r++)
    if (grp->client[r]) {
      eng_map_table_write(grp->client[r]);
      if (grp->client[r]->queue) grp->client[r]->queue->map_version = m.version; /* what epd_info reports */
    }
out:
  pthread_mutex_unlock(&eng->mu);
  return rc;
}

void eng_rehome(epd_engine_t *eng, eng_group_t *grp) {
  const epd_expert_map_t *m = &grp->map;
  const uint32_t R = grp->g.num_ranks, S = grp->g.slots_per_rank, E = grp->g.num_experts;
  /* across nodes node 0 decides for all (it learns every node's masks) and stages through the layer */
  if (!eng->o.rehome_replicas || (eng->o.nodes > 1 && eng->o.node_rank != 0) || !grp->weight_bytes_per_slot ||
      !grp->mask || !m->nrep)
    return;
  /* a map this function staged and that is not active yet is built on (a node out masks its ranks one by
   * one); another staged map is the application's */
  if (grp->has_staged && grp->staged.version != grp->rehome_version) {
    EPD_LOGW(EPD_SUB_ENGINE, "group %s: a map is staged: the masked ranks' replicas are not re-homed",
             grp->name);
    return;
  }
  const epd_expert_map_t *base = grp->has_staged ? &grp->staged : m;
  uint8_t *used = calloc((size_t)R * S, 1);
  uint32_t *load = calloc(R, sizeof *load);
  epd_weight_copy_t *cp = malloc(sizeof *cp * (size_t)E * EPD_MAX_REPLICAS);
  epd_expert_map_t nm;
  memset(&nm, 0, sizeof nm);
  if (!used || !load || !cp || epd_ref_map_copy(&nm, base)) {
    EPD_LOGW(EPD_SUB_ENGINE, "group %s: out of memory re-homing the masked ranks' replicas", grp->name);
    goto out;
  }
  for (uint32_t e = 0; e < E; e++)
    for (uint32_t i = 0; i < nm.nrep[e]; i++) {
      used[(size_t)nm.rep[e][i].rank * S + nm.rep[e][i].slot] = 1;
      load[nm.rep[e][i].rank]++;
    }
  uint32_t ncp = 0, lost = 0, homeless = 0;
  for (uint32_t e = 0; e < E; e++) {
    /* the weights' source: a live replica of the active map; the live replicas wanted: as many as the
     * active map has */
    const epd_replica_t *src = NULL;
    for (uint32_t i = 0; i < m->nrep[e] && !src; i++)
      if (!(grp->mask >> m->rep[e][i].rank & 1)) src = &m->rep[e][i];
    uint32_t live = 0;
    for (uint32_t i = 0; i < nm.nrep[e]; i++) live += !(grp->mask >> nm.rep[e][i].rank & 1);
    if (live >= m->nrep[e]) continue;
    if (!src) { /* its weights are on masked ranks only: nothing to copy from */
      lost++;
      continue;
    }
    for (; live < m->nrep[e] && nm.nrep[e] < EPD_MAX_REPLICAS; live++) {
      /* the least loaded live rank without a replica of e, with a free slot */
      int best = -1;
      for (uint32_t r = 0; r < R; r++) {
        if ((grp->mask >> r & 1) || load[r] >= S) continue;
        int has = 0;
        for (uint32_t i = 0; i < nm.nrep[e]; i++) has |= nm.rep[e][i].rank == r;
        if (!has && (best < 0 || load[r] < load[best])) best = (int)r;
      }
      if (best < 0) {
        homeless++;
        break;
      }
      uint32_t s = 0;
      while (used[(size_t)best * S + s]) s++;
      used[(size_t)best * S + s] = 1;
      load[best]++;
      nm.rep[e][nm.nrep[e]++] = (epd_replica_t){(uint32_t)best, s};
      cp[ncp++] = (epd_weight_copy_t){src->rank, src->slot, (uint32_t)best, s};
    }
  }
  if (ncp) {
    char err[320] = "";
    uint32_t v = 0;
    const epd_result_t rc = eng->so ? eng->so->stage_map(eng, grp, &nm, cp, ncp, &v, err, sizeof err)
                                    : eng_stage_map(eng, grp, &nm, cp, ncp, 0, 1, &v, err, sizeof err);
    if (rc) {
      EPD_LOGW(EPD_SUB_ENGINE, "group %s: re-homing the masked ranks' replicas: %s", grp->name, err);
    } else {
      grp->rehome_version = v;
      EPD_LOGI(EPD_SUB_ENGINE,
               "group %s: %u replica(s) of the masked ranks re-homed onto free slots of live ranks: map "
               "version %u staged, active once their weights are copied",
               grp->name, ncp, v);
    }
  }
  if (homeless)
    EPD_LOGW(EPD_SUB_ENGINE,
             "group %s: %u expert(s) of the masked ranks found no free slot on a live rank "
             "(engine.slots_factor_pct leaves too few): they keep fewer replicas",
             grp->name, homeless);
  if (lost)
    eng_emit(eng, "experts_lost", grp, -1, 0, 0, 0, grp->steps,
             "group %s: %u expert(s) have no live replica: their entries are dropped until a map places them "
             "again (load their weights on a free slot and set the map)",
             grp->name, lost);
out:
  epd_expert_map_free(&nm);
  free(cp);
  free(load);
  free(used);
}
