/*
 * engine.c - the backend-independent engine core: backend selection, groups and their geometry, client
 * attach/detach, arena layout, masked ranks, counters and snapshots (expert maps: maps.c).
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

int eng_rank_local(const epd_engine_t *eng, uint32_t r) {
  return eng->o.nodes <= 1 || r / (uint32_t)eng->o.num_ranks == eng->o.node_rank;
}

/* ---- masked ranks ----------------------------------------------------------------------------- */

void eng_mask_changed(epd_engine_t *eng, eng_group_t *grp) {
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
  eng_mask_changed(eng, grp);
  uint32_t lost_experts = 0;
  for (uint32_t e = 0; grp->mask_map.nrep && e < grp->g.num_experts; e++)
    lost_experts += !grp->mask_map.nrep[e];
  eng_emit(eng, "rank_masked", grp, rank, 0, 0, 0, grp->steps,
           "group %s rank %d masked from step %llu (%s): %u of %u experts without a live replica", grp->name,
           rank, (unsigned long long)grp->steps, why, lost_experts, grp->g.num_experts);
  if (eng->so && eng->so->rank_masked && eng_local_rank(eng, rank)) eng->so->rank_masked(eng, grp, rank, 1);
  eng_rehome(eng, grp);
}

int eng_local_rank(const epd_engine_t *eng, int rank) {
  return rank >= 0 && (uint32_t)rank / (uint32_t)eng->o.num_ranks == eng->o.node_rank;
}

void eng_unmask_rank(epd_engine_t *eng, eng_group_t *grp, int rank) {
  if (rank < 0 || rank >= (int)grp->g.num_ranks || !(grp->mask >> rank & 1)) return;
  grp->mask &= ~(1ull << rank);
  eng_mask_changed(eng, grp);
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
  if (eng->ops->group_free) eng->ops->group_free(g);
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
    eng_wblob_free(b);
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

eng_group_t *eng_find_group(epd_engine_t *eng, const char *name) {
  return find_group(eng, name);
}

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
  c->queue_bytes = eng_queue_bytes(grp);
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
  eng_map_table_write(c);
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
  /* A lost client's waits may still spin on its queue: a kernel that submitted from the GPU outlives its
   * process until the GPU tears the context down (under MPS the server evicts it, and a fault while it
   * does takes down every client of the GPU). Its submitted slots read FREE make them give up now, as a
   * detach does (libepd's ep_release); nothing answers a lost client's slots any more. */
  if (lost && !replaced && c->queue)
    for (unsigned i = 0; i < EPD_QUEUE_SLOTS; i++)
      if (eng_slot_state(&c->queue->slot[i]) == EPD_SLOT_SUBMITTED)
        __atomic_store_n(&c->queue->slot[i].state, EPD_SLOT_FREE, __ATOMIC_RELEASE);
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
