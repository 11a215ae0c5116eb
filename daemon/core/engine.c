/*
 * engine.c - the backend-independent engine core: backend selection, groups and their geometry, client
 * attach/detach, arena layout, expert maps (validation, staging, switch), counters and snapshots.
 * Execution of steps belongs to the backends (engine_host.c, engine_cuda.c).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <pthread.h>
#include <unistd.h>

#include "core/engine_internal.h"
#include "core/log.h"

#define ALIGN_UP(x, a) (((x) + (a)-1) / (a) * (a))
#define QUEUE_BYTES ALIGN_UP(sizeof(epd_queue_t), 4096)
#define MAX_TOPK 16u
#define MAX_TOKENS_PACK 0xffffffu /* tokens of a rank must fit EPD_SRC_PACK's 24 bits */

/* memfd_create + ftruncate + mmap shared; returns the fd (the mapping in *map) or -1 with err set. */
static int make_memfd(const char *name, uint64_t bytes, void **map, char *err, size_t errlen) {
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) {
    snprintf(err, errlen, "memfd_create(%s): %s", name, strerror(errno));
    return -1;
  }
  if (ftruncate(fd, (off_t)bytes) < 0) {
    snprintf(err, errlen, "ftruncate(%s, %llu): %s", name, (unsigned long long)bytes, strerror(errno));
    close(fd);
    return -1;
  }
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    snprintf(err, errlen, "mmap(%s, %llu): %s", name, (unsigned long long)bytes, strerror(errno));
    close(fd);
    return -1;
  }
  *map = p;
  return fd;
}

int eng_client_memfd(const eng_client_t *c, const char *what, uint64_t bytes, void **map, char *err,
                     size_t errlen) {
  char name[64];
  snprintf(name, sizeof name, "epd-%s-%llu", what, (unsigned long long)c->id);
  return make_memfd(name, bytes, map, err, errlen);
}

void eng_queue_init(eng_client_t *c, epd_queue_t *q) {
  q->magic = EPD_QUEUE_MAGIC;
  q->abi_version = EPD_ABI_VERSION;
  q->nslots = EPD_QUEUE_SLOTS;
  q->rank = (uint32_t)c->rank;
  q->client_id = c->id;
  q->map_version = c->grp->map.version;
  c->next_slot = 0;
  c->in_step = 0;
}

void eng_slot_complete(epd_queue_t *q, epd_slot_t *s, const epd_comp_t *comp, uint32_t map_version) {
  s->comp = *comp;
  if (comp->status && !q->sticky_error) q->sticky_error = comp->status;
  q->map_version = map_version;
  q->steps_done++;
  atomic_store_explicit((_Atomic uint32_t *)&s->state, EPD_SLOT_DONE, memory_order_release);
}

int eng_lost_rank(const eng_group_t *grp, char *why, size_t len) {
  for (uint32_t p = 0; p < grp->g.num_ranks; p++)
    if (grp->lost[p] && !grp->client[p]) {
      snprintf(why, len, "the client of rank %u died and has not been replaced", p);
      return (int)p;
    }
  return -1;
}

int eng_timeout_rank(const epd_engine_t *eng, const int *arrived, uint32_t num_ranks, char *why, size_t len) {
  int missing = -1;
  for (uint32_t r = 0; r < num_ranks && missing < 0; r++)
    if (!arrived[r]) missing = (int)r;
  snprintf(why, len, "waited %u ms for rank %d", eng->o.step_timeout_ms, missing);
  return missing;
}

void eng_rank_thread_init(const char *prefix, int rank) {
  char name[16];
  snprintf(name, sizeof name, "%s%d", prefix, rank);
  pthread_setname_np(pthread_self(), name);
  /* Few-microsecond sleeps need a small timer slack (the default 50 us would make every sleep long). */
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
}

void eng_sleep_ns(long ns) {
  struct timespec ts = {0, ns};
  nanosleep(&ts, NULL);
}

uint64_t eng_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t realtime_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void eng_emit(epd_engine_t *eng, const char *kind, const eng_group_t *grp, int rank, uint64_t client_id,
              uint32_t old_version, uint32_t new_version, uint64_t step, const char *fmt, ...) {
  char msg[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (!eng->on_event) return;
  epd_engine_event_t ev = {kind, grp ? grp->name : "", rank, client_id, old_version, new_version, step, msg};
  eng->on_event(eng->event_arg, &ev);
}

/* Bytes of the queue mapping: the queue, then the map table (epd_abi.h), each page-aligned. */
#define MAP_TABLE_OFFSET QUEUE_BYTES
static uint64_t queue_bytes_for(const eng_group_t *grp) {
  return QUEUE_BYTES + ALIGN_UP(epd_map_table_bytes(grp->g.num_experts, EPD_MAX_REPLICAS, grp->g.num_ranks,
                                                    grp->g.slots_per_rank),
                                4096);
}

/* Write the group's active map into a client's map table (a seqlock: see epd_abi.h). */
static void map_table_write(eng_client_t *c) {
  const eng_group_t *grp = c->grp;
  const epd_expert_map_t *m = &grp->map;
  if (!c->queue || c->queue_bytes < queue_bytes_for(grp)) return;
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

int eng_rank_local(const epd_engine_t *eng, uint32_t r) {
  return eng->o.nodes <= 1 || r / (uint32_t)eng->o.num_ranks == eng->o.node_rank;
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

static void wblob_free(eng_wblob_t *b) {
  free(b->data);
  free(b);
}

void eng_wblob_put(eng_group_t *grp, const epd_weight_copy_t *cp, uint32_t version, int status,
                   const char *why, uint8_t *data, uint64_t bytes) {
  for (eng_wblob_t **pp = &grp->wblobs; *pp; pp = &(*pp)->next)
    if (same_copy(&(*pp)->cp, cp) && (*pp)->version == version) {
      eng_wblob_t *old = *pp;
      *pp = old->next;
      wblob_free(old);
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
      wblob_free(b);
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

/* ---- masked ranks ----------------------------------------------------------------------------- */

static void mask_changed(epd_engine_t *eng, eng_group_t *grp) {
  epd_expert_map_free(&grp->mask_map);
  if (grp->mask && epd_ref_map_mask(&grp->mask_map, &grp->map, grp->mask))
    EPD_LOGE(EPD_SUB_ENGINE, "group %s: out of memory for the masked map: its steps route by the full map",
             grp->name);
  for (uint32_t r = 0; r < grp->g.num_ranks; r++)
    if (grp->client[r] && grp->client[r]->queue)
      atomic_store_explicit((_Atomic uint64_t *)&grp->client[r]->queue->masked_ranks, grp->mask,
                            memory_order_release);
}

void eng_mask_rank(epd_engine_t *eng, eng_group_t *grp, int rank, const char *why) {
  if (rank < 0 || rank >= (int)grp->g.num_ranks || grp->on_rank_loss != EPD_RANK_LOSS_MASK ||
      (grp->mask >> rank & 1))
    return;
  grp->mask |= 1ull << rank;
  grp->masks++;
  /* A dispatch none of whose ranks is live any more has no combine to wait for (a rank waiting to rejoin
   * would wait for it forever). */
  const uint64_t all = grp->g.num_ranks >= 64 ? ~0ull : (1ull << grp->g.num_ranks) - 1;
  for (uint32_t b = 0; b < EPD_NUM_BANKS; b++)
    if ((grp->open_banks >> b & 1) && !(all & ~grp->plan_mask[b] & ~grp->mask)) grp->open_banks &= ~(1u << b);
  mask_changed(eng, grp);
  uint32_t lost_experts = 0;
  for (uint32_t e = 0; grp->mask_map.nrep && e < grp->g.num_experts; e++)
    lost_experts += !grp->mask_map.nrep[e];
  eng_emit(eng, "rank_masked", grp, rank, 0, 0, 0, grp->steps,
           "group %s rank %d masked from step %llu (%s): %u of %u experts without a live replica", grp->name,
           rank, (unsigned long long)grp->steps, why, lost_experts, grp->g.num_experts);
  if (eng->so && eng->so->rank_masked && eng_local_rank(eng, rank)) eng->so->rank_masked(eng, grp, rank, 1);
}

int eng_local_rank(const epd_engine_t *eng, int rank) {
  return rank >= 0 && (uint32_t)rank / (uint32_t)eng->o.num_ranks == eng->o.node_rank;
}

void eng_unmask_rank(epd_engine_t *eng, eng_group_t *grp, int rank) {
  if (rank < 0 || rank >= (int)grp->g.num_ranks || !(grp->mask >> rank & 1)) return;
  grp->mask &= ~(1ull << rank);
  mask_changed(eng, grp);
  eng_emit(eng, "rank_unmasked", grp, rank, 0, 0, 0, grp->steps, "group %s rank %d back from step %llu",
           grp->name, rank, (unsigned long long)grp->steps);
  if (eng->so && eng->so->rank_masked && eng_local_rank(eng, rank)) eng->so->rank_masked(eng, grp, rank, 0);
}

const epd_expert_map_t *eng_route_map(const eng_group_t *grp) {
  return grp->mask && grp->mask_map.nrep ? &grp->mask_map : &grp->map;
}

uint32_t eng_live_ranks(const eng_group_t *grp) {
  return grp->g.num_ranks - (uint32_t)__builtin_popcountll(grp->mask);
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
    if (grp->client[r]) map_table_write(grp->client[r]);
  if (grp->mask) mask_changed(eng, grp);
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

void eng_record_op(epd_engine_t *eng, int rank, uint32_t op, int status, uint64_t bytes,
                   uint64_t latency_ns) {
  if (op < EPD_OP_MAX) {
    epd_op_snap_t *s = &eng->opstat[op];
    s->count++;
    if (status) s->errors++;
    s->bytes += bytes;
    int b = 0;
    while (b < EPD_LAT_BUCKETS - 1 && latency_ns > (1000ull << b)) b++;
    s->lat_bucket[b]++;
    s->lat_sum_s += latency_ns / 1e9;
  }
  if (rank >= 0 && rank < EPD_MAX_RANKS) {
    eng_rank_stats_t *r = &eng->rank[rank];
    r->ops++;
    r->bytes_sent += bytes;
    if (status) r->errors++;
    if (status == EPD_ERR_TIMEOUT) r->timeouts++;
  }
}

const char *eng_result_name(int result) {
  static const char *const names[] = {"EPD_OK",
                                      "EPD_ERR_INVALID",
                                      "EPD_ERR_NOMEM",
                                      "EPD_ERR_SYSTEM",
                                      "EPD_ERR_RPC",
                                      "EPD_ERR_PROTOCOL",
                                      "EPD_ERR_NOT_FOUND",
                                      "EPD_ERR_BUSY",
                                      "EPD_ERR_TIMEOUT",
                                      "EPD_ERR_PEER",
                                      "EPD_ERR_DRAINING",
                                      "EPD_ERR_CUDA",
                                      "EPD_ERR_NCCL",
                                      "EPD_ERR_UNSUPPORTED",
                                      "EPD_ERR_BAD_EXPERT",
                                      "EPD_ERR_TOO_MANY_TOKENS",
                                      "EPD_ERR_PERMISSION",
                                      "EPD_ERR_OVERFLOW",
                                      "EPD_ERR_MISMATCH",
                                      "EPD_ERR_CLOSED",
                                      "EPD_ERR_STATE",
                                      "EPD_ERR_INTERNAL"};
  _Static_assert(sizeof names / sizeof names[0] == -EPD_ERR_MIN, "a name for every result code");
  return result <= 0 && result > EPD_ERR_MIN ? names[-result] : "EPD_ERR_UNKNOWN";
}

uint64_t eng_buf_offset(const eng_group_t *g, uint32_t kind, uint32_t bank) {
  for (uint32_t i = 0; i < g->nbufs; i++)
    if (g->bufs[i].kind == kind && g->bufs[i].bank == bank) return g->bufs[i].offset;
  return UINT64_MAX;
}

void *eng_buf(const eng_client_t *c, uint32_t kind, uint32_t bank) {
  const uint64_t off = eng_buf_offset(c->grp, kind, bank);
  return c->arena && off != UINT64_MAX ? c->arena + off : NULL;
}

epd_ref_in_t eng_ref_in(eng_client_t *c, uint32_t bank, uint32_t num_tokens) {
  return (epd_ref_in_t){num_tokens, eng_buf(c, EPD_BUF_X, bank), eng_buf(c, EPD_BUF_TOPK_IDX, bank),
                        eng_buf(c, EPD_BUF_TOPK_WEIGHTS, bank)};
}

const uint16_t *eng_ref_y(eng_client_t *c, int mode, uint32_t bank) {
  return eng_buf(c, mode == EPD_MODE_LL ? EPD_BUF_LL_Y : EPD_BUF_HT_Y, bank);
}

void eng_ref_io(eng_client_t *c, int mode, uint32_t bank, uint32_t num_tokens, epd_ref_in_t *in,
                epd_ref_out_t *out) {
  *in = eng_ref_in(c, bank, num_tokens);
  memset(out, 0, sizeof *out);
  const int ll = mode == EPD_MODE_LL;
  out->recv_x = eng_buf(c, ll ? EPD_BUF_LL_RECV_X : EPD_BUF_HT_RECV_X, bank);
  out->recv_scales = eng_buf(c, ll ? EPD_BUF_LL_RECV_SCALES : EPD_BUF_HT_RECV_SCALES, bank);
  out->recv_count = eng_buf(c, ll ? EPD_BUF_LL_RECV_COUNT : EPD_BUF_HT_RECV_COUNT, bank);
  out->recv_src = eng_buf(c, ll ? EPD_BUF_LL_RECV_SRC : EPD_BUF_HT_RECV_SRC, bank);
  if (!ll) {
    out->recv_topk_idx = eng_buf(c, EPD_BUF_HT_RECV_TOPK_IDX, bank);
    out->recv_topk_weights = eng_buf(c, EPD_BUF_HT_RECV_TOPK_WEIGHTS, bank);
  }
}

/* ---- create / destroy --------------------------------------------------------------------------- */

static const eng_backend_ops_t *find_backend(const char *name) {
  for (int i = 0; eng_backends[i]; i++)
    if (!strcmp(eng_backends[i]->name, name)) return eng_backends[i];
  return NULL;
}

epd_result_t epd_engine_world_id(const char *backend, uint8_t *id, char *err, size_t errlen) {
  const eng_backend_ops_t *b = find_backend(backend);
  if (!b) {
    snprintf(err, errlen, "%s backend not built", backend);
    return EPD_ERR_UNSUPPORTED;
  }
  if (!b->world_id) {
    snprintf(err, errlen, "the %s backend needs no world communicator", backend);
    return EPD_ERR_UNSUPPORTED;
  }
  return b->world_id(id, err, errlen) ? EPD_ERR_UNSUPPORTED : EPD_OK;
}

epd_result_t epd_engine_create(const epd_engine_opts_t *opts, epd_engine_event_fn on_event, void *event_arg,
                               epd_engine_t **out, char *errbuf, size_t errlen) {
  *out = NULL;
  const char *bname = opts->backend && *opts->backend ? opts->backend : "auto";
  const eng_backend_ops_t *ops = NULL;
  if (opts->num_ranks < 1 || opts->num_ranks > EPD_MAX_RANKS) {
    snprintf(errbuf, errlen, "num_ranks %d out of range [1, %d]", opts->num_ranks, EPD_MAX_RANKS);
    return EPD_ERR_INVALID;
  }
  if (!strcmp(bname, "auto")) {
    /* the first backend usable here; each one passed over says why in one line */
    for (int i = 0; !ops && eng_backends[i]; i++) {
      char why[320] = "";
      const eng_backend_ops_t *b = eng_backends[i];
      if (!b->available || b->available(why, sizeof why) || !eng_backends[i + 1])
        ops = b;
      else
        EPD_LOGI(EPD_SUB_ENGINE, "backend auto: not %s (%s)", b->name, why);
    }
  } else if (!(ops = find_backend(bname))) {
    if (!strcmp(bname, "cuda")) {
      snprintf(errbuf, errlen, "cuda backend not built");
      return EPD_ERR_UNSUPPORTED;
    }
    snprintf(errbuf, errlen, "backend \"%s\" unknown; allowed: auto, host, cuda", bname);
    return EPD_ERR_INVALID;
  }
  if (opts->nodes > 1 &&
      ((ops->world_id && !opts->comm_id) || !opts->net ||
       opts->nodes * (uint32_t)opts->num_ranks > EPD_MAX_RANKS || opts->node_rank >= opts->nodes)) {
    snprintf(errbuf, errlen,
             ops->world_id && !opts->comm_id
                 ? "%u nodes: the %s backend needs the world communicator's id from the rendezvous"
                 : "%u nodes: needs connected data links, node_rank < nodes and nodes * num_ranks <= 64",
             opts->nodes, ops->name);
    return EPD_ERR_UNSUPPORTED;
  }
  epd_engine_t *eng = calloc(1, sizeof *eng);
  if (!eng) return EPD_ERR_NOMEM;
  eng->o = *opts;
  if (eng->o.nodes < 2) {
    eng->o.nodes = 1;
    eng->o.node_rank = 0;
    eng->o.net = NULL;
  }
  eng->o.backend = NULL; /* the caller's string may not outlive us */
  if (!eng->o.step_timeout_ms) eng->o.step_timeout_ms = 10000;
  if (!eng->o.slots_factor_pct) eng->o.slots_factor_pct = 100;
  if (!eng->o.max_groups) eng->o.max_groups = 16;
  if (!eng->o.max_clients_per_rank) eng->o.max_clients_per_rank = 16;
  if (!eng->o.max_topk || eng->o.max_topk > MAX_TOPK) eng->o.max_topk = MAX_TOPK;
  if (!eng->o.max_tokens || eng->o.max_tokens > MAX_TOKENS_PACK) eng->o.max_tokens = MAX_TOKENS_PACK;
  if (!eng->o.max_experts) eng->o.max_experts = 1024;
  if (!eng->o.max_hidden) eng->o.max_hidden = 16384;
  if (!eng->o.max_arena_bytes) eng->o.max_arena_bytes = 8ull << 30;
  eng->ops = ops;
  eng->on_event = on_event;
  eng->event_arg = event_arg;
  eng->next_client_id = 1;
  pthread_mutex_init(&eng->mu, NULL);
  epd_result_t rc = ops->create(eng, errbuf, errlen);
  eng->o.comm_id = NULL; /* the caller's: create used it */
  if (rc) {
    pthread_mutex_destroy(&eng->mu);
    free(eng);
    return rc;
  }
  EPD_LOGI(EPD_SUB_ENGINE, "engine up: backend %s, mode %s, %d ranks", ops->name, ops->mode(eng),
           opts->num_ranks);
  *out = eng;
  return EPD_OK;
}

static void group_free(const epd_engine_t *eng, eng_group_t *g) {
  if (eng->so) eng->so->group_free(g);
  epd_expert_map_free(&g->map);
  epd_expert_map_free(&g->staged);
  epd_expert_map_free(&g->mask_map);
  for (unsigned b = 0; b < EPD_NUM_BANKS; b++) epd_ref_plan_free(&g->plan[b]);
  free(g->expert_tokens);
  free(g->slot_tokens);
  free(g->staged_copies);
  free(g->staged_copy_meta);
  while (g->wblobs) {
    eng_wblob_t *b = g->wblobs;
    g->wblobs = b->next;
    wblob_free(b);
  }
  while (g->wdefer) {
    eng_wdefer_t *d = g->wdefer;
    g->wdefer = d->next;
    free(d);
  }
  free(g);
}

void epd_engine_destroy(epd_engine_t *eng) {
  if (!eng) return;
  eng->ops->destroy(eng);
  pthread_mutex_lock(&eng->mu);
  while (eng->clients) {
    eng_client_t *c = eng->clients;
    eng->clients = c->next;
    eng->ops->client_free(eng, c);
    free(c);
  }
  while (eng->groups) {
    eng_group_t *g = eng->groups;
    eng->groups = g->next;
    group_free(eng, g);
  }
  pthread_mutex_unlock(&eng->mu);
  pthread_mutex_destroy(&eng->mu);
  free(eng);
}

const char *epd_engine_backend(const epd_engine_t *eng) {
  return eng->ops->name;
}
const char *epd_engine_mode(const epd_engine_t *eng) {
  return eng->ops->mode(eng);
}
int epd_engine_num_ranks(const epd_engine_t *eng) {
  return eng->o.num_ranks;
}
int epd_engine_world_ranks(const epd_engine_t *eng) {
  return eng->o.num_ranks * (int)eng->o.nodes;
}

/* ---- groups ------------------------------------------------------------------------------------- */

static eng_group_t *find_group(epd_engine_t *eng, const char *name) {
  for (eng_group_t *g = eng->groups; g; g = g->next)
    if (!strcmp(g->name, name)) return g;
  return NULL;
}

static void detach_locked(epd_engine_t *eng, eng_client_t *c, int lost, int replaced);

static eng_client_t *find_client(epd_engine_t *eng, uint64_t id) {
  for (eng_client_t *c = eng->clients; c; c = c->next)
    if (c->id == id) return c;
  return NULL;
}

/* Lay the arena out: every kind for every bank, 64-byte aligned. Returns the total size. */
static uint64_t layout(eng_group_t *grp) {
  const epd_ref_geom_t *g = &grp->g;
  uint64_t M = g->max_tokens, H = g->hidden, K = g->topk, S = g->slots_per_rank, R = g->num_ranks,
           C = g->ht_capacity, nb = epd_ref_scale_blocks(g->hidden);
  uint64_t size[EPD_BUF_KINDS] = {
      [EPD_BUF_X] = M * H * 2,
      [EPD_BUF_X_SCALES] = M * nb * 4,
      [EPD_BUF_TOPK_IDX] = M * K * 8,
      [EPD_BUF_TOPK_WEIGHTS] = M * K * 4,
      [EPD_BUF_LL_RECV_X] = S * R * M * H * 2,
      [EPD_BUF_LL_RECV_SCALES] = S * R * M * nb * 4,
      [EPD_BUF_LL_RECV_COUNT] = S * 4,
      [EPD_BUF_LL_RECV_SRC] = S * R * M * 4,
      [EPD_BUF_LL_Y] = S * R * M * H * 2,
      [EPD_BUF_OUT] = M * H * 2,
      [EPD_BUF_HT_RECV_X] = C * H * 2,
      [EPD_BUF_HT_RECV_SCALES] = C * nb * 4,
      [EPD_BUF_HT_RECV_TOPK_IDX] = C * K * 8,
      [EPD_BUF_HT_RECV_TOPK_WEIGHTS] = C * K * 4,
      [EPD_BUF_HT_RECV_SRC] = C * 4,
      [EPD_BUF_HT_RECV_COUNT] = S * 4,
      [EPD_BUF_HT_Y] = C * H * 2,
  };
  uint64_t off = 0;
  grp->nbufs = 0;
  for (uint32_t bank = 0; bank < EPD_NUM_BANKS; bank++)
    for (uint32_t k = 0; k < EPD_BUF_KINDS; k++) {
      epd_buffer_desc_t *d = &grp->bufs[grp->nbufs++];
      d->kind = k;
      d->bank = bank;
      d->offset = off;
      d->bytes = size[k];
      off = ALIGN_UP(off + size[k], 64);
    }
  if (grp->weight_bytes_per_slot) { /* page-aligned: workers may register it with their GPU or NIC */
    off = ALIGN_UP(off, 4096);
    epd_buffer_desc_t *d = &grp->bufs[grp->nbufs++];
    d->kind = EPD_BUF_EXPERT_WEIGHTS;
    d->bank = 0;
    d->offset = off;
    d->bytes = S * grp->weight_bytes_per_slot;
    off += d->bytes;
  }
  return ALIGN_UP(off, 4096);
}

/* Check one geometry field against [lo, hi]. */
static int check_range(const char *field, uint32_t v, uint32_t lo, uint32_t hi, char *err, size_t errlen) {
  if (v >= lo && v <= hi) return 0;
  snprintf(err, errlen, "%s %u out of range [%u, %u]", field, v, lo, hi);
  return -1;
}

static epd_result_t group_create(epd_engine_t *eng, const char *name, const epd_attach_req_t *req,
                                 eng_group_t **out, char *err, size_t errlen) {
  const epd_engine_opts_t *o = &eng->o;
  if (eng->ngroups >= o->max_groups) {
    snprintf(err, errlen, "group \"%s\": max_groups %u reached", name, o->max_groups);
    return EPD_ERR_BUSY;
  }
  if (!req->num_experts || !req->hidden || !req->topk || !req->max_tokens) {
    snprintf(err, errlen,
             "group \"%s\" does not exist: the first attach must give num_experts, hidden, "
             "topk and max_tokens (got %u, %u, %u, %u)",
             name, req->num_experts, req->hidden, req->topk, req->max_tokens);
    return EPD_ERR_INVALID;
  }
  if (check_range("num_experts", req->num_experts, 1, o->max_experts, err, errlen) ||
      check_range("hidden", req->hidden, 8, o->max_hidden, err, errlen) ||
      check_range("topk", req->topk, 1, o->max_topk, err, errlen) ||
      check_range("max_tokens", req->max_tokens, 1, o->max_tokens, err, errlen))
    return EPD_ERR_INVALID;
  if (req->hidden % 8) {
    snprintf(err, errlen, "hidden %u is not a multiple of 8", req->hidden);
    return EPD_ERR_INVALID;
  }
  eng_group_t *g = calloc(1, sizeof *g);
  if (!g) return EPD_ERR_NOMEM;
  g->serial = ++eng->next_group_serial;
  snprintf(g->name, sizeof g->name, "%s", name);
  uint32_t R = (uint32_t)o->num_ranks * o->nodes, E = req->num_experts; /* world ranks */
  uint32_t per = (E + R - 1) / R;
  uint64_t slots = ((uint64_t)E * o->slots_factor_pct + (uint64_t)R * 100 - 1) / ((uint64_t)R * 100);
  g->g.num_ranks = R;
  g->g.num_experts = E;
  g->g.hidden = req->hidden;
  g->g.topk = req->topk;
  g->g.max_tokens = req->max_tokens;
  g->g.slots_per_rank = (uint32_t)(slots > per ? slots : per);
  g->g.ht_capacity = o->ht_capacity_factor ? o->ht_capacity_factor * req->max_tokens : R * req->max_tokens;
  uint64_t max_wb = o->max_weight_bytes_per_slot ? o->max_weight_bytes_per_slot : 1ull << 30;
  if (req->weight_bytes_per_slot > max_wb) {
    snprintf(err, errlen, "weight_bytes_per_slot %llu out of range [0, %llu]",
             (unsigned long long)req->weight_bytes_per_slot, (unsigned long long)max_wb);
    free(g);
    return EPD_ERR_INVALID;
  }
  g->weight_bytes_per_slot = req->weight_bytes_per_slot;
  g->on_rank_loss = req->on_rank_loss ? req->on_rank_loss : EPD_RANK_LOSS_FAIL;
  g->renormalize = req->renormalize != 0;
  g->arena_bytes = layout(g);
  epd_result_t rc = EPD_OK;
  if (g->arena_bytes > o->max_arena_bytes) {
    snprintf(err, errlen,
             "group \"%s\": arena of %llu bytes (experts %u, hidden %u, topk %u, max_tokens %u, "
             "%u slots x %u ranks) exceeds max_arena_bytes %llu",
             name, (unsigned long long)g->arena_bytes, E, req->hidden, req->topk, req->max_tokens,
             g->g.slots_per_rank, R, (unsigned long long)o->max_arena_bytes);
    rc = EPD_ERR_INVALID;
    goto fail;
  }
  if ((rc = epd_ref_map_default(&g->map, E, R, g->g.slots_per_rank))) goto fail;
  g->map.ranks_per_node = o->ranks_per_node;
  g->last_version = 1;
  for (unsigned b = 0; b < EPD_NUM_BANKS; b++)
    if ((rc = epd_ref_plan_init(&g->plan[b], &g->g))) goto fail;
  g->expert_tokens = calloc(E, sizeof *g->expert_tokens);
  g->slot_tokens = calloc((size_t)R * g->g.slots_per_rank, sizeof *g->slot_tokens);
  if (!g->expert_tokens || !g->slot_tokens) {
    rc = EPD_ERR_NOMEM;
    goto fail;
  }
  if (eng->so && (rc = eng->so->group_init(eng, g))) goto fail;
  g->next = eng->groups;
  eng->groups = g;
  eng->ngroups++;
  EPD_LOGI(EPD_SUB_ENGINE,
           "group %s created: %u experts, hidden %u, topk %u, max_tokens %u, %u slots/rank, "
           "ht capacity %u, arena %llu bytes",
           name, E, req->hidden, req->topk, req->max_tokens, g->g.slots_per_rank, g->g.ht_capacity,
           (unsigned long long)g->arena_bytes);
  *out = g;
  return EPD_OK;
fail:
  if (rc == EPD_ERR_NOMEM) snprintf(err, errlen, "out of memory creating group \"%s\"", name);
  group_free(eng, g);
  return rc;
}

static void group_unlink(epd_engine_t *eng, eng_group_t *grp) {
  for (eng_group_t **p = &eng->groups; *p; p = &(*p)->next)
    if (*p == grp) {
      *p = grp->next;
      eng->ngroups--;
      break;
    }
}

/* Later attaches must match the group's geometry where they give a value. */
static epd_result_t check_geometry(const eng_group_t *g, const epd_attach_req_t *req, char *err,
                                   size_t errlen) {
  struct {
    const char *name;
    uint32_t want, have;
  } f[] = {
      {"num_experts", req->num_experts, g->g.num_experts},
      {"hidden", req->hidden, g->g.hidden},
      {"topk", req->topk, g->g.topk},
      {"max_tokens", req->max_tokens, g->g.max_tokens},
  };
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
    if (f[i].want && f[i].want != f[i].have) {
      snprintf(err, errlen, "%s %u does not match group \"%s\" (%s %u); pass 0 or %u", f[i].name, f[i].want,
               g->name, f[i].name, f[i].have, f[i].have);
      return EPD_ERR_INVALID;
    }
  if (req->weight_bytes_per_slot && req->weight_bytes_per_slot != g->weight_bytes_per_slot) {
    snprintf(err, errlen, "weight_bytes_per_slot %llu does not match group \"%s\" (%llu); pass 0 or %llu",
             (unsigned long long)req->weight_bytes_per_slot, g->name,
             (unsigned long long)g->weight_bytes_per_slot, (unsigned long long)g->weight_bytes_per_slot);
    return EPD_ERR_INVALID;
  }
  if (req->on_rank_loss && req->on_rank_loss != g->on_rank_loss) {
    snprintf(err, errlen, "on_rank_loss %s does not match group \"%s\" (%s); pass 0 or the group's",
             req->on_rank_loss == EPD_RANK_LOSS_MASK ? "mask" : "fail", g->name,
             g->on_rank_loss == EPD_RANK_LOSS_MASK ? "mask" : "fail");
    return EPD_ERR_INVALID;
  }
  if (req->renormalize && !g->renormalize) {
    snprintf(err, errlen, "renormalize 1 does not match group \"%s\" (0); pass 0", g->name);
    return EPD_ERR_INVALID;
  }
  return EPD_OK;
}

/* ---- attach / detach ---------------------------------------------------------------------------- */

epd_result_t epd_engine_attach(epd_engine_t *eng, const epd_attach_req_t *req, epd_attach_info_t *info,
                               char *errbuf, size_t errlen) {
  char name[EPD_GROUP_NAME_MAX];
  snprintf(name, sizeof name, "%.*s", (int)strnlen(req->group, sizeof req->group), req->group);
  if (!name[0]) snprintf(name, sizeof name, "default");
  epd_result_t rc = EPD_OK;
  eng_group_t *grp = NULL;
  int created = 0;
  eng_client_t *c = NULL;
  pthread_mutex_lock(&eng->mu);
  if (eng->draining) {
    snprintf(errbuf, errlen, "the daemon is draining: no new attach");
    rc = EPD_ERR_DRAINING;
    goto out;
  }
  int rank0 = (int)eng->o.node_rank * eng->o.num_ranks; /* scale-out: this node's world ranks */
  if (req->rank < rank0 || req->rank >= rank0 + eng->o.num_ranks) {
    if (eng->o.nodes > 1)
      snprintf(errbuf, errlen,
               "rank %d out of range [%d, %d): this daemon is node %u of %u and owns world ranks "
               "%d..%d (attach each world rank at the daemon of its node)",
               req->rank, rank0, rank0 + eng->o.num_ranks, eng->o.node_rank, eng->o.nodes, rank0,
               rank0 + eng->o.num_ranks - 1);
    else
      snprintf(errbuf, errlen, "rank %d out of range [0, %d)", req->rank, eng->o.num_ranks);
    rc = EPD_ERR_INVALID;
    goto out;
  }
  if (req->on_rank_loss > EPD_RANK_LOSS_MASK) {
    snprintf(errbuf, errlen, "on_rank_loss %u: allowed 0 (the group's), 1 (fail) or 2 (mask)",
             req->on_rank_loss);
    rc = EPD_ERR_INVALID;
    goto out;
  }
  if (req->on_rank_loss == EPD_RANK_LOSS_MASK && (!eng->ops->masks || (eng->so && eng->ops->masks < 2))) {
    snprintf(errbuf, errlen, "on_rank_loss = mask: the %s backend%s does not mask ranks yet (use fail)",
             eng->ops->name, eng->so ? " across nodes" : "");
    rc = EPD_ERR_UNSUPPORTED;
    goto out;
  }
  if (req->renormalize && !eng->ops->renormalizes) {
    snprintf(errbuf, errlen,
             "renormalize = 1: the %s backend does not renormalise the weights of masked "
             "entries (pass 0)",
             eng->ops->name);
    rc = EPD_ERR_UNSUPPORTED;
    goto out;
  }
  grp = find_group(eng, name);
  if (grp) {
    if ((rc = check_geometry(grp, req, errbuf, errlen))) goto out;
  } else {
    if ((rc = group_create(eng, name, req, &grp, errbuf, errlen))) goto out;
    created = 1;
  }
  if (grp->client[req->rank] && grp->client[req->rank]->hung) {
    /* The rank made its peers time out and has not submitted since: the new client takes its place
     * (its queue and memory are released; the old process, if it wakes up, finds its attachment gone). */
    eng_client_t *old = grp->client[req->rank];
    EPD_LOGW(EPD_SUB_ENGINE,
             "group %s rank %d: client %llu (pid %u) hung since a step timed out waiting for it: "
             "replaced by a new attach",
             name, req->rank, (unsigned long long)old->id, old->pid);
    detach_locked(eng, old, 1, 1);
  }
  if (grp->client[req->rank]) {
    snprintf(errbuf, errlen, "rank %d of group \"%s\" is already attached (client %llu)", req->rank, name,
             (unsigned long long)grp->client[req->rank]->id);
    rc = EPD_ERR_BUSY;
    goto out;
  }
  uint32_t on_rank = 0;
  for (eng_client_t *o = eng->clients; o; o = o->next) on_rank += o->rank == req->rank;
  if (on_rank >= eng->o.max_clients_per_rank) {
    snprintf(errbuf, errlen, "rank %d has %u clients: max_clients_per_rank %u reached", req->rank, on_rank,
             eng->o.max_clients_per_rank);
    rc = EPD_ERR_BUSY;
    goto out;
  }
  c = calloc(1, sizeof *c);
  if (!c) {
    rc = EPD_ERR_NOMEM;
    snprintf(errbuf, errlen, "out of memory");
    goto out;
  }
  c->id = eng->next_client_id++;
  c->grp = grp;
  c->rank = req->rank;
  c->pid = req->pid;
  c->uid = req->uid;
  c->gid = req->gid;
  c->attached_ns = realtime_ns();
  c->queue_fd = c->arena_fd = -1;
  c->queue_bytes = queue_bytes_for(grp);
  c->arena_bytes = grp->arena_bytes;
  snprintf(c->name, sizeof c->name, "%.*s", (int)strnlen(req->name, sizeof req->name), req->name);
  if (!c->name[0]) snprintf(c->name, sizeof c->name, "pid:%u", req->pid);
  if ((rc = eng->ops->client_alloc(eng, c, errbuf, errlen))) {
    free(c);
    c = NULL;
    goto out;
  }
  c->next = eng->clients;
  eng->clients = c;
  eng->nclients++;
  grp->client[c->rank] = c;
  const int was_lost = grp->lost[c->rank];
  grp->lost[c->rank] = 0;
  if (created && eng->so)
    eng->so->group_created(eng, grp);
  else if (was_lost && eng->so)
    eng->so->rank_back(eng, grp, c->rank);
  map_table_write(c);
  memset(info, 0, sizeof *info);
  info->client_id = c->id;
  info->queue_fd = c->queue_fd;
  info->arena_fd = c->arena_fd;
  info->queue_bytes = c->queue_bytes;
  info->arena_bytes = c->arena_bytes;
  info->device = eng->ops->device(eng, c->rank);
  info->on_gpu = info->device >= 0;
  info->has_uuid = eng->ops->device_uuid && eng->ops->device_uuid(eng, c->rank, info->device_uuid);
  info->num_ranks = grp->g.num_ranks;
  info->num_experts = grp->g.num_experts;
  info->hidden = grp->g.hidden;
  info->topk = grp->g.topk;
  info->max_tokens = grp->g.max_tokens;
  info->slots_per_rank = grp->g.slots_per_rank;
  info->ht_capacity = grp->g.ht_capacity;
  info->map_version = grp->map.version;
  info->nbuffers = grp->nbufs;
  info->weight_bytes_per_slot = grp->weight_bytes_per_slot;
  memcpy(info->buffers, grp->bufs, sizeof grp->bufs[0] * grp->nbufs);
  EPD_LOGI(EPD_SUB_ENGINE, "client %llu (%s, pid %u) attached to group %s rank %d", (unsigned long long)c->id,
           c->name, c->pid, name, c->rank);
out:
  if (rc && created) {
    group_unlink(eng, grp);
    group_free(eng, grp);
  }
  pthread_mutex_unlock(&eng->mu);
  return rc;
}

epd_result_t epd_engine_client_fds(epd_engine_t *eng, uint64_t client_id, int *queue_fd, int *arena_fd) {
  pthread_mutex_lock(&eng->mu);
  eng_client_t *c = find_client(eng, client_id);
  if (c) {
    *queue_fd = c->queue_fd;
    *arena_fd = c->arena_fd;
  }
  pthread_mutex_unlock(&eng->mu);
  return c ? EPD_OK : EPD_ERR_NOT_FOUND;
}

/* (mu) Detach c: backend leave, event, unlink, free; the group goes with its last client. replaced: a
 * hung client that a new attach of its rank takes over; it is in no step (arriving clears "hung"), so the
 * step its peers are collecting goes on with the new client, and the group stays for it. */
static void detach_locked(epd_engine_t *eng, eng_client_t *c, int lost, int replaced) {
  eng_group_t *grp = c->grp;
  if (!replaced || c->in_step) eng->ops->client_leave(eng, c, replaced ? 0 : lost);
  if (lost)
    eng_emit(eng, "client_lost", grp, c->rank, c->id, 0, 0, grp->steps,
             "client %llu (%s, pid %u) of group %s rank %d %s", (unsigned long long)c->id, c->name, c->pid,
             grp->name, c->rank, replaced ? "hung: replaced by a new attach" : "lost");
  EPD_LOGI(EPD_SUB_ENGINE, "client %llu detached from group %s rank %d%s", (unsigned long long)c->id,
           grp->name, c->rank, lost ? " (lost)" : "");
  for (eng_client_t **p = &eng->clients; *p; p = &(*p)->next)
    if (*p == c) {
      *p = c->next;
      break;
    }
  eng->nclients--;
  grp->client[c->rank] = NULL;
  eng->ops->client_free(eng, c);
  free(c);
  /* A group lives while it has clients: its geometry is then free to change. */
  if (!eng_last_client(grp, NULL)) return;
  if (!replaced) {
    EPD_LOGI(EPD_SUB_ENGINE, "group %s has no clients left: removed", grp->name);
    if (eng->so) eng->so->group_removed(eng, grp);
    group_unlink(eng, grp);
    group_free(eng, grp);
  }
}

int eng_last_client(const eng_group_t *grp, const eng_client_t *c) {
  for (uint32_t r = 0; r < grp->g.num_ranks; r++)
    if (grp->client[r] && grp->client[r] != c) return 0;
  return 1;
}

epd_result_t epd_engine_detach(epd_engine_t *eng, uint64_t client_id, int lost) {
  pthread_mutex_lock(&eng->mu);
  eng_client_t *c = find_client(eng, client_id);
  if (!c) {
    pthread_mutex_unlock(&eng->mu);
    return EPD_ERR_NOT_FOUND;
  }
  detach_locked(eng, c, lost, 0);
  pthread_mutex_unlock(&eng->mu);
  return EPD_OK;
}

void eng_mark_hung(eng_group_t *grp, int rank) {
  if (rank >= 0 && rank < EPD_MAX_RANKS && grp->client[rank]) grp->client[rank]->hung = 1;
}

void epd_engine_set_draining(epd_engine_t *eng, int drain) {
  pthread_mutex_lock(&eng->mu);
  const int was = eng->draining;
  eng->draining = drain != 0;
  if (eng->draining && eng->ops->sync_steps) eng->ops->sync_steps(eng, NULL); /* no step runs past it */
  if (eng->so && was != eng->draining) eng->so->notify_drain(eng, eng->draining);
  pthread_mutex_unlock(&eng->mu);
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

eng_group_t *eng_find_group(epd_engine_t *eng, const char *name) {
  return find_group(eng, name);
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
        wblob_free(b);
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
  eng_group_t *grp = find_group(eng, name);
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
  eng_group_t *grp = find_group(eng, name);
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
  eng_group_t *grp = find_group(eng, name);
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
      map_table_write(grp->client[r]);
      if (grp->client[r]->queue) grp->client[r]->queue->map_version = m.version; /* what epd_info reports */
    }
out:
  pthread_mutex_unlock(&eng->mu);
  return rc;
}

/* ---- snapshots ---------------------------------------------------------------------------------- */

epd_result_t epd_engine_snapshot(epd_engine_t *eng, epd_engine_snap_t *out) {
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&eng->mu);
  out->backend = eng->ops->name;
  out->mode = eng->ops->mode(eng);
  out->num_ranks = (uint32_t)eng->o.num_ranks;
  out->ngroups = eng->ngroups;
  out->nclients = eng->nclients;
  out->draining = eng->draining;
  out->groups = calloc(eng->ngroups + 1, sizeof *out->groups);
  out->clients = calloc(eng->nclients + 1, sizeof *out->clients);
  out->ranks = calloc((size_t)eng->o.num_ranks, sizeof *out->ranks);
  if (!out->groups || !out->clients || !out->ranks) goto nomem;
  uint32_t i = 0;
  for (eng_group_t *g = eng->groups; g; g = g->next, i++) {
    epd_group_snap_t *s = &out->groups[i];
    snprintf(s->name, sizeof s->name, "%s", g->name);
    s->num_experts = g->g.num_experts;
    s->hidden = g->g.hidden;
    s->topk = g->g.topk;
    s->max_tokens = g->g.max_tokens;
    s->slots_per_rank = g->g.slots_per_rank;
    for (uint32_t r = 0; r < g->g.num_ranks; r++) s->attached_ranks += g->client[r] != NULL;
    s->map_version = g->map.version;
    s->steps = g->steps;
    snprintf(s->mode, sizeof s->mode, "%s",
             eng->ops->group_mode ? eng->ops->group_mode(eng, g) : eng->ops->mode(eng));
    if (eng->so) eng->so->group_note(g, eng->o.nodes, s->nodes, sizeof s->nodes);
    s->on_rank_loss = g->on_rank_loss;
    s->renormalize = g->renormalize;
    s->masked_ranks = g->mask;
    s->entries_dropped = g->entries_dropped;
    s->masks = g->masks;
    s->expert_tokens = malloc(sizeof(uint64_t) * g->g.num_experts);
    if (!s->expert_tokens) goto nomem;
    memcpy(s->expert_tokens, g->expert_tokens, sizeof(uint64_t) * g->g.num_experts);
    size_t nslots = (size_t)g->g.num_ranks * g->g.slots_per_rank;
    s->num_ranks = g->g.num_ranks;
    s->map_switches = g->map_switches;
    s->weight_bytes_copied = g->weight_bytes_copied;
    s->slot_tokens = malloc(sizeof(uint64_t) * nslots);
    if (!s->slot_tokens) goto nomem;
    memcpy(s->slot_tokens, g->slot_tokens, sizeof(uint64_t) * nslots);
  }
  i = 0;
  for (eng_client_t *c = eng->clients; c; c = c->next, i++) {
    epd_client_snap_t *s = &out->clients[i];
    s->client_id = c->id;
    snprintf(s->name, sizeof s->name, "%s", c->name);
    snprintf(s->group, sizeof s->group, "%s", c->grp->name);
    s->rank = c->rank;
    s->pid = c->pid;
    s->uid = c->uid;
    s->ops = c->ops;
    s->attached_ns = c->attached_ns;
    s->arena_bytes = c->arena_bytes;
  }
  out->nodes = eng->o.nodes;
  out->node_rank = eng->o.node_rank;
  out->world_ranks = eng->o.nodes * (uint32_t)eng->o.num_ranks;
  out->inter_node_transport = eng->o.nodes <= 1 ? "none" : eng->ops->inter_node_transport;
  out->gin = eng->ops->gin ? eng->ops->gin(eng) : NULL;
  out->rendezvous = eng->o.nodes <= 1 ? "" : eng->o.rendezvous_tls ? "mutual-tls" : "plaintext";
  if (eng->so)
    eng->so->links(eng, out->links, sizeof out->links, &out->links_down, &out->net_tx_bytes,
                   &out->net_rx_bytes, &out->net_tx_frames, &out->net_rx_frames);
  for (int li = 0; li < eng->o.num_ranks; li++) {
    epd_rank_snap_t *s = &out->ranks[li];
    int r = (int)eng->o.node_rank * eng->o.num_ranks + li; /* world rank */
    s->rank = r;
    s->device = eng->ops->device(eng, r);
    for (int lj = 0; lj < eng->o.num_ranks && s->device >= 0; lj++)
      s->gpu_ranks += eng->ops->device(eng, (int)eng->o.node_rank * eng->o.num_ranks + lj) == s->device;
    s->has_uuid = eng->ops->device_uuid && eng->ops->device_uuid(eng, r, s->device_uuid);
    s->buffer_bytes = eng->ops->rank_bytes(eng, r);
    for (eng_client_t *c = eng->clients; c; c = c->next)
      if (c->rank == r) {
        s->clients++;
        s->buffer_bytes += c->queue_bytes + c->arena_bytes;
      }
    s->ops = eng->rank[r].ops;
    s->bytes_sent = eng->rank[r].bytes_sent;
    s->timeouts = eng->rank[r].timeouts;
    s->errors = eng->rank[r].errors;
    memcpy(s->wait_ns_by_peer, eng->rank[r].wait_ns_by_peer, sizeof s->wait_ns_by_peer);
  }
  memcpy(out->ops, eng->opstat, sizeof out->ops);
  pthread_mutex_unlock(&eng->mu);
  return EPD_OK;
nomem:
  pthread_mutex_unlock(&eng->mu);
  epd_engine_snapshot_free(out);
  return EPD_ERR_NOMEM;
}

void epd_engine_snapshot_free(epd_engine_snap_t *snap) {
  if (!snap) return;
  if (snap->groups)
    for (uint32_t i = 0; i < snap->ngroups; i++) {
      free(snap->groups[i].expert_tokens);
      free(snap->groups[i].slot_tokens);
    }
  free(snap->groups);
  free(snap->clients);
  free(snap->ranks);
  snap->groups = NULL;
  snap->clients = NULL;
  snap->ranks = NULL;
}

void eng_fail(epd_engine_t *eng, const char *fmt, ...) {
  if (atomic_load(&eng->failed)) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(eng->failed_msg, sizeof eng->failed_msg, fmt, ap);
  va_end(ap);
  atomic_store(&eng->failed, 1);
  EPD_LOGE(EPD_SUB_ENGINE, "engine failed: %s", eng->failed_msg);
  eng_emit(eng, "error", NULL, -1, 0, 0, 0, 0, "engine failed: %s", eng->failed_msg);
}

const char *epd_engine_failure(const epd_engine_t *eng) {
  return atomic_load(&((epd_engine_t *)eng)->failed) ? eng->failed_msg : NULL;
}
