/*
 * epd-worker - a test worker: attaches to one rank of a group through libepd and runs dispatch -> toy
 * expert -> combine steps, checking every result against the reference (daemon/ref.c).
 *
 * Every worker generates the inputs of ALL ranks from (seed, step, rank), so it can compute the whole
 * step's reference locally. The toy expert of slot s on rank r is y = scale(r, s) * recv_x (BF16); OUT
 * must then be the sum over the token's valid entries of weight * scale(dest) * x (x dequantised for
 * FP8), within BF16 rounding.
 *
 * Usage: epd-worker -s SOCKET -g GROUP -r RANK -n NRANKS --steps N --seed S [--experts E --hidden H
 *        --topk K --tokens T] [--mode ll|ht] [--fp8] [--skew] [--die-at-step k] [--map-every N] [--bench N]
 *        [--ht-every N] [-v]
 * --ht-every N: every N-th step is an HT dispatch/combine (the rest LL) in the same group.
 * --dense: HT dispatches with EPD_DESC_HT_DENSE (every token to every rank); the rows of tokens with no
 * entry here get NaN partials, which the combine must leave out.
 * --map-every N: rank 0 stages a new random expert map (redundant replicas included) through
 * SetExpertMap after every N-th step; every rank reads the map of each step from libepd's mapped map
 * table (epd_expert_slots, no round trip) and checks the step against the reference with it.
 * --bench N: then N unchecked steps (dispatch + combine of the last step's inputs), timed back to back.
 * --weights W: attach with an expert-weights region of W bytes per slot; every slot holds its logical
 * expert's weights (a pattern of the expert id, the expert's output scale in word 0), the toy expert of a
 * slot takes its scale from the slot's weights, and with --map-every rank 0 stages maps that move
 * replicas into free slots with weight copies (SetExpertMap copies): after each switch every slot the
 * map places an expert in must hold exactly that expert's weights, and every combine must match the
 * reference computed with each logical expert's own scale (stale or missing copies fail the step).
 * --graph: (LL, CUDA backend) each bank's dispatch and combine are captured once into CUDA graphs
 * (libepd stream submission: stream memory operations) and every step replays them, num_tokens fixed
 * at max_tokens; with --map-every the same graphs keep replaying across the map switches.
 * --node-ranks N: the world spans nodes of N ranks each (scale-out): the reference picks replicas the
 * way the daemons do (those on the source's node first).
 * --specials: about a third of each rank's tokens get one 128-channel group of special values
 * (epd_ref_gen_specials: signed zeros, subnormals, infinities, NaNs, an all-NaN group, ...); FP8 rows
 * must still equal the reference byte for byte, and the combine must give NaN / the infinity where the
 * reference does.
 * --hold-at K --hold-file PATH: after the dispatch of step K is checked, print "holding before the
 * combine of step K" and wait (up to 60 s) until PATH exists, then go on (a drain between the two: the
 * combine must still run and match, the next dispatch fail with EPD_ERR_DRAINING).
 * --same-inputs: every step uses step 0's inputs and bank 0 (workers that start at different steps of the
 * group, e.g. one restarted, still agree on the reference).
 * --until-streak N: an op that fails is reported and skipped (after a failed dispatch the next step's
 * dispatch follows, 20 ms later), and the worker stops, exit 0, once N steps in a row ran and matched
 * after its last failure (at most 2000 failures; --steps bounds the steps tried). --streak-any: N steps
 * in a row also stop it when none failed (a worker that joins a running group, whose first ops may fail
 * while the nodes agree on the step again).
 * --mask --ht-every N: the HT steps are every N-th step pair of the group (by the group step numbers
 * the completions report), so that a worker that restarts keeps the others' cadence.
 * --mask: attach with on_rank_loss = EPD_RANK_LOSS_MASK (--renormalize: and renormalisation); every
 * step's reference is computed with the mask its completion reports (no tokens from masked ranks, the
 * map without their replicas), and the entries dropped must be those of experts with no live replica.
 * Exit: 0 all steps matched; 1 a result differed; 2 an op or the attach failed; 3 --die-at-step.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <getopt.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "epd.h"
#include "epd.pb-c.h"
#include "core/ref.h"
#include "rpc_client.h"

typedef struct args {
  const char *sock, *group;
  int rank, nranks, steps, ht, fp8, skew, die_at, verbose, map_every, bench;
  uint64_t seed;
  uint32_t experts, hidden, topk, tokens;
  uint64_t weights;
  int graph, ht_every, node_ranks, dense, specials, hold_at, same_inputs, streak, streak_any;
  const char *hold_file;
  int mask, renorm;
} args_t;

static args_t A = {NULL, "default", -1, 0, 10, 0, 0, 0, -1, 0, 0, 0, 1,    16, 256,
                   4,    64,        0,  0, 0,  0, 0, 0, -1, 0, 0, 0, NULL, 0,  0};

/* The flags of a dispatch in HT mode (ht) or LL: flags, plus EPD_DESC_HT_DENSE for HT with --dense. */
static uint32_t dispatch_flags(uint32_t flags, int ht) {
  return flags | (ht && A.dense ? (uint32_t)EPD_DESC_HT_DENSE : 0u);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

/* ---- arena access: plain memory for the host backend, CUDA driver copies for GPU arenas ---------- */

static int on_gpu;
static int (*cu_htod)(uint64_t, const void *, size_t);
static int (*cu_dtoh)(void *, uint64_t, size_t);
static int (*cu_sync)(void);

/* --graph: driver entry points (CUstream, CUgraph, CUgraphExec as void *). */
static struct {
  int (*stream_create)(void **, unsigned);
  int (*begin)(void *, int);
  int (*end)(void *, void **);
  int (*inst)(void **, void *, unsigned long long);
  int (*launch)(void *, void *);
  int (*query)(void *);
} cug;

static void gpu_copy_init(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  if (h) {
    cu_htod = (int (*)(uint64_t, const void *, size_t))dlsym(h, "cuMemcpyHtoD_v2");
    cu_dtoh = (int (*)(void *, uint64_t, size_t))dlsym(h, "cuMemcpyDtoH_v2");
    cu_sync = (int (*)(void))dlsym(h, "cuCtxSynchronize");
    cug.stream_create = (int (*)(void **, unsigned))dlsym(h, "cuStreamCreate");
    cug.begin = (int (*)(void *, int))dlsym(h, "cuStreamBeginCapture_v2");
    cug.end = (int (*)(void *, void **))dlsym(h, "cuStreamEndCapture");
    cug.inst = (int (*)(void **, void *, unsigned long long))dlsym(h, "cuGraphInstantiateWithFlags");
    cug.launch = (int (*)(void *, void *))dlsym(h, "cuGraphLaunch");
    cug.query = (int (*)(void *))dlsym(h, "cuStreamQuery");
  }
  if (!cu_htod || !cu_dtoh || !cu_sync) {
    fprintf(stderr, "epd-worker: GPU arena but no libcuda.so.1 copy functions\n");
    exit(2);
  }
}

static void rd(void *dst, const void *src, size_t n);

/* --graph: the captured ops of each bank, their queue slots, the stream they replay on. */
static void *g_stream, *g_exec[2][EPD_NUM_BANKS];
static unsigned g_slot[2][EPD_NUM_BANKS];

static void graph_capture(epd_ep_t *ep, uint32_t T, uint32_t flags) {
  if (!cug.stream_create || !cug.begin || !cug.end || !cug.inst || !cug.launch || !cug.query) {
    fprintf(stderr, "epd-worker: --graph: libcuda.so.1 lacks the graph entry points\n");
    exit(2);
  }
  if (cug.stream_create(&g_stream, 1 /* CU_STREAM_NON_BLOCKING */)) {
    fprintf(stderr, "epd-worker: --graph: cuStreamCreate failed\n");
    exit(2);
  }
  for (unsigned b = 0; b < EPD_NUM_BANKS; b++)
    for (int op = 0; op < 2; op++) {
      void *graph = NULL;
      g_slot[op][b] = (unsigned)epd_info(ep, EPD_INFO_NEXT_SLOT);
      int e1 = cug.begin(g_stream, 1 /* CU_STREAM_CAPTURE_MODE_THREAD_LOCAL */);
      epd_result_t rc = op == 0 ? epd_dispatch(ep, EPD_MODE_LL, T, flags, b, g_stream)
                                : epd_combine(ep, EPD_MODE_LL, b, g_stream);
      int e2 = cug.end(g_stream, &graph);
      if (e1 || rc || e2 || cug.inst(&g_exec[op][b], graph, 0)) {
        fprintf(stderr, "rank %d: --graph: capturing %s bank %u failed (%d, %s, %d)\n", A.rank,
                op ? "combine" : "dispatch", b, e1, rc ? epd_last_error(ep) : "ok", e2);
        exit(2);
      }
    }
}

/* Replay one captured op and return its completion status (the record read from its slot). */
static epd_result_t graph_run(epd_ep_t *ep, int op, unsigned bank, epd_comp_t *comp) {
  if (cug.launch(g_exec[op][bank], g_stream)) {
    fprintf(stderr, "rank %d: cuGraphLaunch failed\n", A.rank);
    exit(2);
  }
  double dl = now_us() + 60e6;
  int q;
  while ((q = cug.query(g_stream)) == 600 /* CUDA_ERROR_NOT_READY */)
    if (now_us() > dl) {
      fprintf(stderr, "rank %d: graph replay (%s bank %u) not done after 60 s\n", A.rank,
              op ? "combine" : "dispatch", bank);
      exit(2);
    }
  if (q) {
    fprintf(stderr, "rank %d: graph replay: CUDA error %d\n", A.rank, q);
    exit(2);
  }
  /* The stream waited for DONE and freed the slot; the record stays in the slot. */
  return epd_slot_status(ep, g_slot[op][bank], comp);
}

/* A copy from pageable memory may return before its DMA has landed (CUDA's synchronous-copy rules),
 * and the daemon's kernel reads the arena as soon as an op is submitted: wr() leaves wr_pending set and
 * landed(), called before every submission, waits for the copies once. Seen on 4x H100 without it: the
 * first combine of a bank read y rows still zero (one expert's share missing). */
static int wr_pending;

static void wr(void *dst, const void *src, size_t n) {
  if (!n) return;
  if (!on_gpu) {
    memcpy(dst, src, n);
  } else if (cu_htod((uint64_t)(uintptr_t)dst, src, n)) {
    fprintf(stderr, "epd-worker: cuMemcpyHtoD failed\n");
    exit(2);
  } else {
    wr_pending = 1;
  }
}

static void landed(void) {
  if (!wr_pending) return;
  if (cu_sync()) {
    fprintf(stderr, "epd-worker: cuCtxSynchronize failed\n");
    exit(2);
  }
  wr_pending = 0;
}

static void rd(void *dst, const void *src, size_t n) {
  if (!n) return;
  if (!on_gpu) {
    memcpy(dst, src, n);
  } else if (cu_dtoh(dst, (uint64_t)(uintptr_t)src, n)) {
    fprintf(stderr, "epd-worker: cuMemcpyDtoH failed\n");
    exit(2);
  }
}

static void fill(void *dst, int byte, size_t n) {
  void *tmp = malloc(n ? n : 1);
  memset(tmp, byte, n);
  wr(dst, tmp, n);
  free(tmp);
}

static void *bufp(epd_ep_t *ep, int kind, unsigned bank, size_t need) {
  size_t bytes = 0;
  void *p = epd_buffer(ep, kind, bank, &bytes);
  if (!p || bytes < need) {
    fprintf(stderr, "epd-worker: buffer kind %d bank %u: %zu bytes, need %zu\n", kind, bank, bytes, need);
    exit(2);
  }
  return p;
}

/* ---- expert map ---------------------------------------------------------------------------------- */

/* Fetch the group's active map over the control RPC (after a SetExpertMap the default is not it). */
static int fetch_map(epd_expert_map_t *m, uint32_t E, uint32_t R, uint32_t S) {
  char err[512];
  epd_rpc_t *rpc = NULL;
  if (epd_rpc_open(A.sock, 10000, &rpc, err, sizeof err)) {
    fprintf(stderr, "rank %d: GetExpertMap: %s\n", A.rank, err);
    return -1;
  }
  Epd__V1__GetExpertMapRequest req = EPD__V1__GET_EXPERT_MAP_REQUEST__INIT;
  req.protocol_version = EPD_PROTOCOL_VERSION;
  req.group = (char *)A.group;
  ProtobufCMessage *msg = NULL;
  epd_result_t rc = epd_rpc_call(rpc, "/epd.v1.Control/GetExpertMap", &req.base,
                                 &epd__v1__expert_map__descriptor, &msg, err, sizeof err);
  epd_rpc_close(rpc);
  if (rc) {
    fprintf(stderr, "rank %d: GetExpertMap: %s\n", A.rank, err);
    return -1;
  }
  Epd__V1__ExpertMap *em = (Epd__V1__ExpertMap *)msg;
  epd_expert_map_free(m);
  epd_ref_map_default(m, E, R, S);
  m->version = em->version;
  for (size_t i = 0; i < em->n_experts; i++) {
    const Epd__V1__ExpertPlacement *p = em->experts[i];
    if (p->expert >= E) continue;
    m->nrep[p->expert] = (uint8_t)(p->n_replicas > EPD_MAX_REPLICAS ? EPD_MAX_REPLICAS : p->n_replicas);
    for (size_t k = 0; k < m->nrep[p->expert]; k++)
      m->rep[p->expert][k] = (epd_replica_t){p->replicas[k]->rank, p->replicas[k]->slot};
  }
  protobuf_c_message_free_unpacked(msg, NULL);
  m->ranks_per_node = (uint32_t)A.node_ranks;
  char verr[256];
  if (epd_ref_map_validate(m, E, R, S, verr, sizeof verr)) {
    fprintf(stderr, "rank %d: map from the daemon is invalid: %s\n", A.rank, verr);
    return -1;
  }
  return 0;
}

/* The active map from libepd's mapped table (no round trip); -1 if the daemon publishes none. */
static int table_map(epd_ep_t *ep, epd_expert_map_t *m, uint32_t E, uint32_t R, uint32_t S) {
  epd_expert_map_free(m);
  epd_ref_map_default(m, E, R, S);
  uint32_t v0 = epd_map_version(ep), v = 0;
  if (!v0) return -1;
  for (uint32_t e = 0; e < E; e++) {
    epd_replica_t reps[EPD_MAX_REPLICAS];
    uint32_t n = 0;
    if (epd_expert_slots(ep, e, reps, EPD_MAX_REPLICAS, &n, &v) || v != v0 || n < 1 || n > EPD_MAX_REPLICAS) {
      fprintf(stderr, "rank %d: map table: expert %u: %s (version %u, then %u)\n", A.rank, e,
              epd_last_error(ep), v0, v);
      return -2;
    }
    m->nrep[e] = (uint8_t)n;
    for (uint32_t i = 0; i < n; i++) m->rep[e][i] = reps[i];
  }
  m->version = v0;
  m->ranks_per_node = (uint32_t)A.node_ranks;
  /* The slot -> expert rows must agree with the replica lists. */
  int32_t se[1024];
  if (S <= 1024 && !epd_slot_experts(ep, se, S, &v) && v == v0)
    for (uint32_t s = 0; s < S; s++) {
      int32_t want = -1;
      for (uint32_t e = 0; e < E; e++)
        for (uint32_t i = 0; i < m->nrep[e]; i++)
          if (m->rep[e][i].rank == (uint32_t)A.rank && m->rep[e][i].slot == s) want = (int32_t)e;
      if (se[s] != want) {
        fprintf(stderr, "rank %d: map table: slot %u holds expert %d, the replica lists say %d\n", A.rank, s,
                se[s], want);
        return -2;
      }
    }
  char verr[256];
  if (epd_ref_map_validate(m, E, R, S, verr, sizeof verr)) {
    fprintf(stderr, "rank %d: map table is invalid: %s\n", A.rank, verr);
    return -2;
  }
  return 0;
}

/* SetExpertMap answered RESOURCE_EXHAUSTED: the last staged map's migration still holds a slot the new
 * one names (it is built on the active map): staging waits for the next --map-every step. */
static int map_busy;

/* SetExpertMap over the control RPC: the map in `pl`, plus weight copies; its version or 0. */
static uint32_t send_map(Epd__V1__ExpertPlacement **plp, uint32_t E, Epd__V1__WeightCopy **wcp, size_t ncp,
                         int step) {
  Epd__V1__ExpertMap m = EPD__V1__EXPERT_MAP__INIT;
  m.group = (char *)A.group;
  m.n_experts = E;
  m.experts = plp;
  Epd__V1__SetExpertMapRequest q = EPD__V1__SET_EXPERT_MAP_REQUEST__INIT;
  q.protocol_version = EPD_PROTOCOL_VERSION;
  q.map = &m;
  q.n_copies = ncp;
  q.copies = wcp;
  char err[512];
  uint32_t v = 0;
  epd_rpc_t *rpc = NULL;
  ProtobufCMessage *rep = NULL;
  map_busy = 0;
  if (epd_rpc_open(A.sock, 10000, &rpc, err, sizeof err) ||
      epd_rpc_call(rpc, "/epd.v1.Control/SetExpertMap", &q.base, &epd__v1__set_expert_map_reply__descriptor,
                   &rep, err, sizeof err)) {
    map_busy = ncp > 0 && strstr(err, "RESOURCE_EXHAUSTED") && strstr(err, "is being migrated");
    fprintf(map_busy ? stdout : stderr, "rank %d step %d: SetExpertMap: %s%s\n", A.rank, step, err,
            map_busy ? " (staged at the next step that stages a map)" : "");
  } else
    v = ((Epd__V1__SetExpertMapReply *)rep)->version;
  if (rep) protobuf_c_message_free_unpacked(rep, NULL);
  if (rpc) epd_rpc_close(rpc);
  return v;
}

/* --map-every: stage a random valid map (seeded by the step) with SetExpertMap; its version or 0. */
static uint32_t stage_random_map(uint32_t E, uint32_t R, uint32_t S, int step) {
  uint64_t st = A.seed * 7919 + (uint64_t)step;
  uint32_t n = R * S, *perm = malloc(sizeof *perm * n);
  for (uint32_t i = 0; i < n; i++) perm[i] = i;
  for (uint32_t i = n - 1; i > 0; i--) {
    uint32_t j = (uint32_t)(epd_ref_rand(&st) % (i + 1)), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  Epd__V1__ExpertPlacement *pl = calloc(E, sizeof *pl), **plp = calloc(E, sizeof *plp);
  Epd__V1__Replica *rp = calloc(n, sizeof *rp), **rpp = calloc(n, sizeof *rpp);
  uint32_t used = 0;
  for (uint32_t e = 0; e < E; e++) {
    epd__v1__expert_placement__init(&pl[e]);
    pl[e].expert = e;
    plp[e] = &pl[e];
    pl[e].replicas = &rpp[used];
    uint32_t spare = n - used - (E - e); /* slots left after one for this and every later expert */
    uint32_t nr = 1 + (spare > 0 && epd_ref_rand(&st) % 3 == 0);
    for (uint32_t i = 0; i < nr; i++, used++) {
      epd__v1__replica__init(&rp[used]);
      rp[used].rank = perm[used] / S;
      rp[used].slot = perm[used] % S;
      rpp[used] = &rp[used];
      pl[e].n_replicas++;
    }
  }
  uint32_t v = send_map(plp, E, NULL, 0, step);
  free(perm);
  free(pl);
  free(plp);
  free(rp);
  free(rpp);
  return v;
}

/* ---- expert weights (--weights) ------------------------------------------------------------------- */

/* Word i of logical expert e's weights; word 0 is the expert's output scale (toy expert). */
static float logical_scale(uint32_t e) {
  return 0.5f + 0.0625f * (float)(e % 24);
}
static uint32_t wword(uint32_t e, uint64_t i) {
  if (i == 0) {
    float f = logical_scale(e);
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
  }
  return (e + 1u) * 0x01000193u ^ (uint32_t)(i * 2654435761u);
}

/* Write the weights of every local slot the map places an expert in. */
static void weights_fill(uint8_t *wbuf, const epd_expert_map_t *m, uint32_t E, uint32_t S) {
  uint64_t nw = A.weights / 4;
  uint32_t *tmp = malloc(A.weights);
  for (uint32_t e = 0; e < E; e++)
    for (uint32_t i = 0; i < m->nrep[e]; i++) {
      if (m->rep[e][i].rank != (uint32_t)A.rank || m->rep[e][i].slot >= S) continue;
      for (uint64_t w = 0; w < nw; w++) tmp[w] = wword(e, w);
      wr(wbuf + (size_t)m->rep[e][i].slot * A.weights, tmp, A.weights);
    }
  free(tmp);
}

/* Every local slot of the map must hold its expert's weights, word for word; returns slots wrong. */
static int weights_check(uint8_t *wbuf, const epd_expert_map_t *m, uint32_t E, uint32_t S, int step) {
  uint64_t nw = A.weights / 4;
  uint32_t *got = malloc((size_t)S * A.weights);
  rd(got, wbuf, (size_t)S * A.weights);
  int bad = 0;
  for (uint32_t e = 0; e < E; e++)
    for (uint32_t i = 0; i < m->nrep[e]; i++) {
      if (m->rep[e][i].rank != (uint32_t)A.rank || m->rep[e][i].slot >= S) continue;
      const uint32_t *sw = got + (size_t)m->rep[e][i].slot * nw;
      for (uint64_t w = 0; w < nw; w++)
        if (sw[w] != wword(e, w)) {
          if (bad++ < 5)
            fprintf(
                stderr,
                "rank %d step %d (map v%u): slot %u word %llu is 0x%08x, expert %u's weights say 0x%08x\n",
                A.rank, step, m->version, m->rep[e][i].slot, (unsigned long long)w, sw[w], e, wword(e, w));
          break;
        }
    }
  free(got);
  return bad;
}

/* --weights with --map-every: from the active map, move 1-3 experts' replicas into free slots, copying
 * the weights from a replica the active map has (copies never chain: sources hold an expert now,
 * destinations are free now); half the time the expert's old replica is dropped (a move). */
static uint32_t
    copies_across; /* --weights --map-every --node-ranks: staged copies whose ranks are on two nodes */
static uint32_t stage_migration_map(const epd_expert_map_t *cur, uint32_t E, uint32_t R, uint32_t S, int step,
                                    uint32_t *ncopies) {
  uint64_t st = A.seed * 104729 + (uint64_t)step;
  epd_expert_map_t m = *cur;
  uint8_t *held = calloc((size_t)R * S, 1);
  for (uint32_t e = 0; e < E; e++)
    for (uint32_t i = 0; i < cur->nrep[e]; i++) held[cur->rep[e][i].rank * S + cur->rep[e][i].slot] = 1;
  uint8_t nrep[4096];
  epd_replica_t rep[4096][EPD_MAX_REPLICAS];
  if (E > 4096) return 0;
  for (uint32_t e = 0; e < E; e++) {
    nrep[e] = cur->nrep[e];
    memcpy(rep[e], cur->rep[e], sizeof rep[e]);
  }
  /* Keep a quarter of the slots free: drop the first replica of experts that have several. */
  uint32_t nfree0 = 0;
  for (uint32_t i = 0; i < R * S; i++) nfree0 += !held[i];
  for (uint32_t e0 = (uint32_t)(epd_ref_rand(&st) % E), n = 0; n < E && nfree0 < R * S / 4; n++) {
    uint32_t e = (e0 + n) % E;
    if (nrep[e] < 2) continue;
    memmove(&rep[e][0], &rep[e][1], sizeof(epd_replica_t) * (nrep[e] - 1u));
    nrep[e]--;
    nfree0++; /* free in the new map; not a copy destination in this one (it holds weights now) */
  }
  Epd__V1__WeightCopy wc[8], *wcp[8];
  size_t ncp = 0;
  uint32_t moves = 1 + (uint32_t)(epd_ref_rand(&st) % 3);
  for (uint32_t k = 0; k < moves && ncp < 8; k++) {
    uint32_t e = (uint32_t)(epd_ref_rand(&st) % E);
    if (nrep[e] >= EPD_MAX_REPLICAS || !cur->nrep[e]) continue;
    uint32_t nfree = 0, pick;
    for (uint32_t i = 0; i < R * S; i++) nfree += !held[i];
    if (!nfree) break;
    pick = (uint32_t)(epd_ref_rand(&st) % nfree);
    uint32_t f = 0;
    for (uint32_t i = 0; i < R * S; i++)
      if (!held[i] && pick-- == 0) {
        f = i;
        break;
      }
    held[f] = 1; /* not a destination twice */
    const epd_replica_t src = cur->rep[e][epd_ref_rand(&st) % cur->nrep[e]];
    rep[e][nrep[e]++] = (epd_replica_t){f / S, f % S};
    epd__v1__weight_copy__init(&wc[ncp]);
    wc[ncp].src_rank = src.rank;
    wc[ncp].src_slot = src.slot;
    wc[ncp].dst_rank = f / S;
    wc[ncp].dst_slot = f % S;
    wcp[ncp] = &wc[ncp];
    ncp++;
    if (nrep[e] >= 2 && epd_ref_rand(&st) % 2) { /* drop the first replica: the expert moved */
      memmove(&rep[e][0], &rep[e][1], sizeof(epd_replica_t) * (nrep[e] - 1u));
      nrep[e]--;
    }
  }
  Epd__V1__ExpertPlacement *pl = calloc(E, sizeof *pl), **plp = calloc(E, sizeof *plp);
  Epd__V1__Replica *rp = calloc((size_t)E * EPD_MAX_REPLICAS, sizeof *rp),
                   **rpp = calloc((size_t)E * EPD_MAX_REPLICAS, sizeof *rpp);
  for (uint32_t e = 0; e < E; e++) {
    epd__v1__expert_placement__init(&pl[e]);
    pl[e].expert = e;
    pl[e].replicas = &rpp[e * EPD_MAX_REPLICAS];
    for (uint32_t i = 0; i < nrep[e]; i++) {
      Epd__V1__Replica *r = &rp[e * EPD_MAX_REPLICAS + i];
      epd__v1__replica__init(r);
      r->rank = rep[e][i].rank;
      r->slot = rep[e][i].slot;
      rpp[e * EPD_MAX_REPLICAS + i] = r;
    }
    pl[e].n_replicas = nrep[e];
    plp[e] = &pl[e];
  }
  uint32_t v = send_map(plp, E, wcp, ncp, step);
  *ncopies = (uint32_t)ncp;
  for (size_t i = 0; i < ncp && A.node_ranks > 0 && v; i++) /* copies between ranks of two nodes */
    copies_across += wc[i].src_rank / (uint32_t)A.node_ranks != wc[i].dst_rank / (uint32_t)A.node_ranks;
  (void)m;
  free(held);
  free(pl);
  free(plp);
  free(rp);
  free(rpp);
  return v;
}

/* ---- die-at-step --------------------------------------------------------------------------------- */

typedef struct dying {
  epd_ep_t *ep;
  uint32_t T, flags;
  unsigned bank;
} dying_t;

static void *dispatch_thread(void *arg) {
  dying_t *d = arg;
  epd_dispatch(d->ep, A.ht ? EPD_MODE_HT : EPD_MODE_LL, d->T, d->flags, d->bank, NULL);
  return NULL;
}

/* ---- main ---------------------------------------------------------------------------------------- */

static float expert_scale(uint32_t rank, uint32_t slot) {
  return 0.5f + 0.125f * (float)((rank * 7 + slot) % 8);
}

/* The toy expert's scale for a local slot: from the slot's weights with --weights (a slot whose weights
 * are no expert's gives NaN, so the step fails), else fixed per (rank, slot). */
static float slot_scale(uint32_t rank, uint32_t slot, const void *wbuf, const float *slot_f) {
  return wbuf ? slot_f[slot] : expert_scale(rank, slot);
}

static uint32_t tokens_of(uint64_t step, uint32_t rank, uint32_t M) {
  if (step == 0 || A.graph) return M; /* a full batch once; graphs captured num_tokens */
  uint64_t st = A.seed ^ (step * 0x9e37u) ^ ((uint64_t)rank << 32);
  uint64_t r = epd_ref_rand(&st);
  if (r % 16 == 0) return 0; /* an empty batch now and then */
  return (uint32_t)(r % (M + 1));
}

static void usage(void) {
  fprintf(stderr,
          "usage: epd-worker -s SOCKET -g GROUP -r RANK -n NRANKS --steps N --seed S [--experts E "
          "--hidden H --topk K --tokens T] [--mode ll|ht] [--fp8] [--skew] [--die-at-step k] "
          "[--map-every N] [--node-ranks N] [--weights BYTES] [--graph] [--bench N] [--ht-every N] "
          "[--dense] [--specials] [--hold-at K --hold-file PATH] [-v]\n");
  exit(2);
}

/* --until-streak: a failed op is reported and skipped (1), 20 ms later the next step's dispatch follows;
 * 0 past 2000 failures. */
static int skip_failed(const epd_ep_t *ep, const char *op, int step, int *fails) {
  if (A.streak <= 0 || ++*fails > 2000) return 0;
  printf("rank %d step %d: %s failed (skipped): %s\n", A.rank, step, op, epd_last_error(ep));
  fflush(NULL);
  usleep(20000);
  return 1;
}

static void parse(int argc, char **argv) {
  static const struct option lo[] = {{"socket", 1, 0, 's'},
                                     {"group", 1, 0, 'g'},
                                     {"rank", 1, 0, 'r'},
                                     {"nranks", 1, 0, 'n'},
                                     {"steps", 1, 0, 'S'},
                                     {"seed", 1, 0, 'e'},
                                     {"experts", 1, 0, 'E'},
                                     {"hidden", 1, 0, 'H'},
                                     {"topk", 1, 0, 'K'},
                                     {"tokens", 1, 0, 'T'},
                                     {"mode", 1, 0, 'm'},
                                     {"fp8", 0, 0, 'f'},
                                     {"skew", 0, 0, 'k'},
                                     {"die-at-step", 1, 0, 'd'},
                                     {"verbose", 0, 0, 'v'},
                                     {"map-every", 1, 0, 'M'},
                                     {"node-ranks", 1, 0, 'N'},
                                     {"weights", 1, 0, 'W'},
                                     {"graph", 0, 0, 'G'},
                                     {"bench", 1, 0, 'B'},
                                     {"ht-every", 1, 0, 'X'},
                                     {"dense", 0, 0, 'D'},
                                     {"specials", 0, 0, 'Z'},
                                     {"hold-at", 1, 0, 'h'},
                                     {"hold-file", 1, 0, 'F'},
                                     {"same-inputs", 0, 0, 'I'},
                                     {"until-streak", 1, 0, 'U'},
                                     {"streak-any", 0, 0, 'Y'},
                                     {"mask", 0, 0, 'Q'},
                                     {"renormalize", 0, 0, 'R'},
                                     {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "s:g:r:n:v", lo, NULL)) != -1) {
    switch (c) {
      case 's':
        A.sock = optarg;
        break;
      case 'g':
        A.group = optarg;
        break;
      case 'r':
        A.rank = atoi(optarg);
        break;
      case 'n':
        A.nranks = atoi(optarg);
        break;
      case 'S':
        A.steps = atoi(optarg);
        break;
      case 'e':
        A.seed = strtoull(optarg, NULL, 0);
        break;
      case 'E':
        A.experts = (uint32_t)atoi(optarg);
        break;
      case 'H':
        A.hidden = (uint32_t)atoi(optarg);
        break;
      case 'K':
        A.topk = (uint32_t)atoi(optarg);
        break;
      case 'T':
        A.tokens = (uint32_t)atoi(optarg);
        break;
      case 'm':
        if (!strcmp(optarg, "ll"))
          A.ht = 0;
        else if (!strcmp(optarg, "ht"))
          A.ht = 1;
        else
          usage();
        break;
      case 'f':
        A.fp8 = 1;
        break;
      case 'k':
        A.skew = 1;
        break;
      case 'd':
        A.die_at = atoi(optarg);
        break;
      case 'v':
        A.verbose = 1;
        break;
      case 'M':
        A.map_every = atoi(optarg);
        break;
      case 'N':
        A.node_ranks = atoi(optarg);
        break;
      case 'W':
        A.weights = strtoull(optarg, NULL, 0);
        break;
      case 'G':
        A.graph = 1;
        break;
      case 'B':
        A.bench = atoi(optarg);
        break;
      case 'X':
        A.ht_every = atoi(optarg);
        break;
      case 'D':
        A.dense = 1;
        break;
      case 'Z':
        A.specials = 1;
        break;
      case 'h':
        A.hold_at = atoi(optarg);
        break;
      case 'F':
        A.hold_file = optarg;
        break;
      case 'I':
        A.same_inputs = 1;
        break;
      case 'U':
        A.streak = atoi(optarg);
        break;
      case 'Q':
        A.mask = 1;
        break;
      case 'R':
        A.renorm = 1;
        break;
      case 'Y':
        A.streak_any = 1;
        break;
      default:
        usage();
    }
  }
  if (A.rank < 0 || A.nranks < 1 || A.rank >= A.nranks || A.steps < 0) usage();
  if (A.graph && (A.ht || A.die_at >= 0 || A.bench)) {
    fprintf(stderr, "epd-worker: --graph runs LL steps (no --mode ht, no --die-at-step, no --bench)\n");
    exit(2);
  }
  if ((A.hold_at >= 0) != (A.hold_file != NULL) || (A.hold_at >= 0 && A.graph)) {
    fprintf(stderr, "epd-worker: --hold-at and --hold-file go together (and not with --graph)\n");
    exit(2);
  }
  if (A.weights % 4 || (A.weights && A.weights < 4)) {
    fprintf(stderr, "epd-worker: --weights must be a positive multiple of 4\n");
    exit(2);
  }
  if (A.fp8 && A.hidden % 128) {
    fprintf(stderr, "epd-worker: --fp8 needs --hidden a multiple of 128\n");
    exit(2);
  }
}

int main(int argc, char **argv) {
  parse(argc, argv);
  setvbuf(stdout, NULL, _IOLBF, 0);
  epd_connect_opts_t co = EPD_CONNECT_OPTS_INITIALIZER;
  co.socket_path = A.sock;
  epd_conn_t *conn = NULL;
  epd_result_t rc = epd_connect(&co, &conn);
  if (rc) {
    fprintf(stderr, "rank %d: connect: %s: %s\n", A.rank, epd_strerror(rc), epd_conn_last_error(NULL));
    return 2;
  }
  epd_attach_opts_t ao = EPD_ATTACH_OPTS_INITIALIZER;
  ao.group = A.group;
  ao.rank = A.rank;
  ao.num_experts = A.experts;
  ao.hidden = A.hidden;
  ao.topk = A.topk;
  ao.max_tokens = A.tokens;
  char name[64];
  snprintf(name, sizeof name, "epd-worker:r%d", A.rank);
  ao.client_name = name;
  ao.weight_bytes_per_slot = A.weights;
  ao.on_rank_loss = A.mask ? EPD_RANK_LOSS_MASK : 0;
  ao.renormalize = (uint32_t)A.renorm;
  epd_ep_t *ep = NULL;
  /* A replaced rank's dead client may still be being detached: retry BUSY for a few seconds. */
  double t_end = now_us() + 5e6;
  while ((rc = epd_attach(conn, &ao, &ep)) == EPD_ERR_BUSY && now_us() < t_end) usleep(50000);
  if (rc) {
    fprintf(stderr, "rank %d: attach: %s: %s\n", A.rank, epd_strerror(rc), epd_conn_last_error(conn));
    return 2;
  }
  on_gpu = (int)epd_info(ep, EPD_INFO_ON_GPU);
  if (on_gpu) gpu_copy_init();
  if (A.graph && !on_gpu) {
    fprintf(stderr, "rank %d: --graph needs the cuda backend (stream-ordered submission)\n", A.rank);
    return 2;
  }
  epd_ref_geom_t g = {
      (uint32_t)epd_info(ep, EPD_INFO_NUM_RANKS),  (uint32_t)epd_info(ep, EPD_INFO_NUM_EXPERTS),
      (uint32_t)epd_info(ep, EPD_INFO_HIDDEN),     (uint32_t)epd_info(ep, EPD_INFO_TOPK),
      (uint32_t)epd_info(ep, EPD_INFO_MAX_TOKENS), (uint32_t)epd_info(ep, EPD_INFO_SLOTS_PER_RANK),
      (uint32_t)epd_info(ep, EPD_INFO_HT_CAPACITY)};
  if ((int)g.num_ranks != A.nranks) {
    fprintf(stderr, "rank %d: the group has %u ranks, -n says %d\n", A.rank, g.num_ranks, A.nranks);
    return 2;
  }
  uint32_t R = g.num_ranks, M = g.max_tokens, H = g.hidden, K = g.topk, S = g.slots_per_rank,
           C = g.ht_capacity;
  uint32_t nb = epd_ref_scale_blocks(H), me = (uint32_t)A.rank;
  epd_expert_map_t map;
  memset(&map, 0, sizeof map);
  epd_ref_map_default(&map, g.num_experts, R, S);
  map.ranks_per_node = (uint32_t)A.node_ranks;
  if (epd_info(ep, EPD_INFO_MAP_VERSION) != 1 && fetch_map(&map, g.num_experts, R, S)) return 2;
  /* --weights: this rank's slots get their experts' weights before its first dispatch (a copy at a
   * switch needs every rank's dispatch, so no copy can read a slot before it is filled). */
  uint8_t *wbuf = A.weights ? bufp(ep, EPD_BUF_EXPERT_WEIGHTS, 0, (size_t)S * A.weights) : NULL;
  float *slot_f = calloc(S, sizeof *slot_f); /* --weights: each local slot's scale, from its weights */
  uint32_t total_copies = 0;
  int weight_checks = 0;
  if (wbuf) weights_fill(wbuf, &map, g.num_experts, S);
  /* Every rank's inputs, and this rank's expected outputs. */
  uint16_t *xs[EPD_MAX_RANKS];
  int64_t *is[EPD_MAX_RANKS];
  float *ws[EPD_MAX_RANKS];
  epd_ref_in_t in[EPD_MAX_RANKS];
  for (uint32_t r = 0; r < R; r++) {
    xs[r] = calloc((size_t)M * H + 1, 2);
    is[r] = calloc((size_t)M * K + 1, 8);
    ws[r] = calloc((size_t)M * K + 1, 4);
  }
  const int any_ht = A.ht || A.ht_every > 0;
  size_t rows = A.ht ? C : (size_t)S * R * M;
  if (A.ht_every > 0 && C > rows) rows = C;
  epd_ref_out_t want;
  memset(&want, 0, sizeof want);
  want.recv_x = calloc(rows + 1, (size_t)H * 2);
  want.recv_scales = calloc(rows + 1, (size_t)nb * 4);
  want.recv_count = calloc(S, 4);
  want.recv_src = calloc(rows + 1, 4);
  if (any_ht) {
    want.recv_topk_idx = calloc(rows + 1, (size_t)K * 8);
    want.recv_topk_weights = calloc(rows + 1, (size_t)K * 4);
  }
  epd_ref_out_t *outs[EPD_MAX_RANKS] = {NULL};
  outs[me] = &want;
  /* Host copies of what the daemon wrote. */
  uint8_t *got_x = malloc(rows * H * 2 + 1);
  float *got_sc = malloc(rows * nb * 4 + 4);
  int32_t *got_cnt = malloc((size_t)S * 4);
  int32_t *got_src = malloc(rows * 4 + 4);
  int64_t *got_ti = malloc(rows * K * 8 + 8);
  float *got_tw = malloc(rows * K * 4 + 4);
  uint16_t *y = calloc(rows * H + 1, 2);
  uint16_t *out = malloc((size_t)M * H * 2 + 2);
  float *xq = malloc(sizeof(float) * H);
  uint32_t *seg_n = calloc(S + 1, sizeof *seg_n); /* rows read back per slot (LL) or in all (HT) */
  epd_ref_plan_t plan;
  epd_ref_plan_init(&plan, &g);
  int bad_steps = 0, nswitch = 0, nstaged = 0;
  double t_ops = 0;
  uint32_t last_T = 0;
  unsigned last_bank = 0;
  uint32_t flags = A.fp8 ? EPD_DESC_FP8 : 0;
  if (A.graph) graph_capture(ep, M, flags);
  epd_comp_t comp;
  int nht = 0;
  uint64_t step0 = 0; /* group step of the first dispatch: every op is one group step */
  int fails = 0, streak = 0, after_fail = 0, ok_steps = 0; /* --until-streak */
  /* --mask --ht-every: the group step the next dispatch should run as (from the last completion; -1:
   * none yet). Workers that restart at any step follow the cadence of the group's steps, not their own
   * count: one that guesses wrong at its first op fails that step once, then agrees. */
  int64_t next_g = -1;
  for (int step = 0; step < A.steps; step++) {
    if (A.streak > 0 && (fails || A.streak_any) &&
        streak >= A.streak) { /* --until-streak: N steps in a row after the last failure */
      printf("rank %d: %d steps in a row after %d failed ops\n", A.rank, streak, fails);
      A.steps = ok_steps;
      break;
    }
    const uint64_t gstep = A.same_inputs ? 0 : (uint64_t)step; /* the step the inputs are made for */
    /* --ht-every N: every N-th step is an HT step in an LL group (same buffers, other kinds) */
    const int ht = A.ht || (A.ht_every > 0 && (A.mask && next_g >= 0 ? (next_g / 2) % A.ht_every
                                                                     : step % A.ht_every) == A.ht_every - 1);
    const epd_mode_t mode = ht ? EPD_MODE_HT : EPD_MODE_LL;
    if (ht && !A.ht) nht++;
    const uint32_t dflags = dispatch_flags(flags, ht); /* this step's dispatch */
    rows = ht ? C : (size_t)S * R * M;
    unsigned bank = A.same_inputs ? 0u : (unsigned)step % EPD_NUM_BANKS;
    for (uint32_t r = 0; r < R; r++) {
      uint32_t T = tokens_of(gstep, r, M);
      epd_ref_gen_input(A.seed, gstep, r, &g, T, A.skew, xs[r], is[r], ws[r]);
      if (A.specials) epd_ref_gen_specials(A.seed, gstep, r, T, H, xs[r]);
      in[r] = (epd_ref_in_t){T, xs[r], is[r], ws[r]};
    }
    uint32_t T = in[me].num_tokens;
    last_T = T;
    last_bank = bank;
    wr(bufp(ep, EPD_BUF_X, bank, (size_t)M * H * 2), xs[me], (size_t)T * H * 2);
    wr(bufp(ep, EPD_BUF_TOPK_IDX, bank, (size_t)M * K * 8), is[me], (size_t)T * K * 8);
    wr(bufp(ep, EPD_BUF_TOPK_WEIGHTS, bank, (size_t)M * K * 4), ws[me], (size_t)T * K * 4);
    /* Poison what the ops must write. */
    int kcnt = ht ? EPD_BUF_HT_RECV_COUNT : EPD_BUF_LL_RECV_COUNT;
    fill(bufp(ep, kcnt, bank, (size_t)S * 4), 0xa5, (size_t)S * 4);
    fill(bufp(ep, EPD_BUF_OUT, bank, (size_t)M * H * 2), 0xa5, (size_t)M * H * 2);
    landed();
    if (step == A.die_at) {
      dying_t d = {ep, T, dispatch_flags(flags, A.ht), bank}; /* sent in A.ht's mode */
      pthread_t th;
      pthread_create(&th, NULL, dispatch_thread, &d);
      usleep(100000);
      printf("rank %d: dying at step %d after submitting its dispatch\n", A.rank, step);
      fflush(NULL);
      _exit(3);
    }
    double t0 = now_us();
    rc = A.graph ? graph_run(ep, 0, bank, &comp) : epd_dispatch(ep, mode, T, dflags, bank, NULL);
    double t1 = now_us();
    if (rc && skip_failed(ep, "dispatch", step, &fails)) {
      streak = 0;
      after_fail = 1;
      epd_comp_t fc;
      if (!A.graph && epd_op_status(ep, &fc) == EPD_OK) next_g = (int64_t)fc.step + 1;
      continue;
    }
    if (rc) {
      fprintf(stderr, "rank %d step %d: dispatch failed: %s\n", A.rank, step,
              A.graph ? epd_strerror(rc) : epd_last_error(ep));
      return 2;
    }
    if (!A.graph) epd_op_status(ep, &comp);
    /* --mask: a step that failed for the ranks that had arrived when a peer was lost (they skip it) takes
     * a group step number the ranks that came later never see: a gap, not an error */
    if (step == 0 || after_fail || (A.mask && comp.step > step0 + 2 * (uint64_t)step))
      step0 = comp.step - 2 * (uint64_t)step;
    after_fail = 0;
    if (comp.step != step0 + 2 * (uint64_t)step) {
      fprintf(stderr, "rank %d step %d: dispatch ran as group step %llu, want %llu\n", A.rank, step,
              (unsigned long long)comp.step, (unsigned long long)(step0 + 2 * (uint64_t)step));
      bad_steps++;
    }
    if (comp.map_version != map.version) {
      int t = table_map(ep, &map, g.num_experts, R, S);
      if (t == -2 || (t == -1 && fetch_map(&map, g.num_experts, R, S))) return 2;
      nswitch++;
    }
    if (comp.map_version != map.version) {
      fprintf(stderr, "rank %d step %d: dispatch used map %u, the daemon reports %u\n", A.rank, step,
              comp.map_version, map.version);
      return 2;
    }
    if (wbuf) {
      /* The toy expert of each slot runs the weights the slot holds: its scale is word 0. */
      for (uint32_t s = 0; s < S; s++) {
        float f;
        rd(&f, wbuf + (size_t)s * A.weights, 4);
        slot_f[s] = NAN; /* weights that are no expert's */
        for (uint32_t e = 0; e < g.num_experts && e < 24; e++)
          if (f == logical_scale(e)) slot_f[s] = f;
      }
      if (step == 0 || nswitch != weight_checks) {
        weight_checks = nswitch;
        if (weights_check(wbuf, &map, g.num_experts, S, step)) {
          fprintf(stderr, "rank %d step %d: expert weights do not follow map v%u\n", A.rank, step,
                  map.version);
          bad_steps++;
        }
      }
    }
    int bad = -1;
    char err[256];
    /* --mask: the step's reference has no tokens from the masked ranks and routes by the map without
     * their replicas */
    epd_ref_in_t rin[EPD_MAX_RANKS];
    epd_expert_map_t mmap = {0};
    for (uint32_t r = 0; r < R; r++) {
      rin[r] = in[r];
      if (comp.masked >> r & 1) rin[r].num_tokens = 0;
    }
    if (comp.masked && epd_ref_map_mask(&mmap, &map, comp.masked)) return 2;
    plan.renormalize = A.renorm;
    rc = epd_ref_plan_build(&plan, comp.masked ? &mmap : &map, rin, &bad, err, sizeof err);
    epd_expert_map_free(&mmap);
    if (rc) {
      fprintf(stderr, "rank %d step %d: reference: %s\n", A.rank, step, err);
      return 2;
    }
    if (comp.dropped != plan.dropped[me]) {
      fprintf(stderr, "rank %d step %d: %u entries dropped (mask 0x%llx), want %u\n", A.rank, step,
              comp.dropped, (unsigned long long)comp.masked, plan.dropped[me]);
      bad_steps++;
    }
    if (ht && A.dense) epd_ref_ht_dense(&plan);
    if (ht)
      epd_ref_ht_dispatch(&plan, rin, A.fp8, outs, &bad);
    else
      epd_ref_ll_dispatch(&plan, rin, A.fp8, outs);
    /* Compare this rank's received buffers with the reference. */
    int errs = 0;
    uint32_t nrecv = ht ? plan.ht_recv[me] : plan.ll_recv[me];
    if (comp.num_recv != nrecv) {
      fprintf(stderr, "rank %d step %d: num_recv %u, want %u\n", A.rank, step, comp.num_recv, nrecv);
      errs++;
    }
    rd(got_cnt, bufp(ep, kcnt, bank, (size_t)S * 4), (size_t)S * 4);
    /* Read back only the rows the daemon says it wrote (whole LL buffers are large on GPUs). */
    uint8_t *dx = bufp(ep, ht ? EPD_BUF_HT_RECV_X : EPD_BUF_LL_RECV_X, bank, rows * H * 2);
    float *dsc = bufp(ep, ht ? EPD_BUF_HT_RECV_SCALES : EPD_BUF_LL_RECV_SCALES, bank, rows * nb * 4);
    int32_t *dsrc = bufp(ep, ht ? EPD_BUF_HT_RECV_SRC : EPD_BUF_LL_RECV_SRC, bank, rows * 4);
    uint16_t *dy = bufp(ep, ht ? EPD_BUF_HT_Y : EPD_BUF_LL_Y, bank, rows * H * 2);
    uint32_t nseg = ht ? 1 : S, seg_rows = ht ? C : R * M;
    for (uint32_t sg = 0; sg < nseg; sg++) {
      int32_t n = ht ? (int32_t)comp.num_recv : got_cnt[sg];
      seg_n[sg] = n < 0 ? 0 : (uint32_t)n > seg_rows ? seg_rows : (uint32_t)n;
      size_t r0 = (size_t)sg * seg_rows, n2 = seg_n[sg];
      rd(got_x + r0 * H * 2, dx + r0 * H * 2, n2 * H * 2);
      if (A.fp8) rd(got_sc + r0 * nb, dsc + r0 * nb, n2 * nb * 4);
      rd(got_src + r0, dsrc + r0, n2 * 4);
      if (ht) {
        rd(got_ti, bufp(ep, EPD_BUF_HT_RECV_TOPK_IDX, bank, rows * K * 8), n2 * K * 8);
        rd(got_tw, bufp(ep, EPD_BUF_HT_RECV_TOPK_WEIGHTS, bank, rows * K * 4), n2 * K * 4);
      }
    }
    for (uint32_t s = 0; s < S; s++)
      if (got_cnt[s] != want.recv_count[s] && errs++ < 5)
        fprintf(stderr, "rank %d step %d: recv_count[%u] = %d, want %d\n", A.rank, step, s, got_cnt[s],
                want.recv_count[s]);
    size_t xb = A.fp8 ? H : (size_t)H * 2;
    /* Received rows, and the toy expert on them. */
    uint32_t nrows = ht ? nrecv : S * R * M;
    for (uint32_t row = 0; row < nrows && !errs; row++) {
      uint32_t s = ht ? 0 : row / (R * M), j = ht ? row : row % (R * M);
      if (!ht && (int32_t)j >= want.recv_count[s]) continue;
      if (got_src[row] != want.recv_src[row] ||
          memcmp(got_x + (size_t)row * H * 2, (uint8_t *)want.recv_x + (size_t)row * H * 2, xb) ||
          (A.fp8 && memcmp(got_sc + (size_t)row * nb, want.recv_scales + (size_t)row * nb, (size_t)nb * 4)) ||
          (ht &&
           (memcmp(got_ti + (size_t)row * K, want.recv_topk_idx + (size_t)row * K, (size_t)K * 8) ||
            memcmp(got_tw + (size_t)row * K, want.recv_topk_weights + (size_t)row * K, (size_t)K * 4)))) {
        if (errs++ < 5)
          fprintf(
              stderr,
              "rank %d step %d: received row %u (slot %u, src 0x%x, want 0x%x) differs from the reference\n",
              A.rank, step, j, s, got_src[row], want.recv_src[row]);
        continue;
      }
      for (uint32_t h = 0; h < H; h++)
        xq[h] = A.fp8 ? epd_e4m3_to_f32(got_x[(size_t)row * H * 2 + h]) * got_sc[(size_t)row * nb + h / 128]
                      : epd_bf16_to_f32(((uint16_t *)got_x)[(size_t)row * H + h]);
      float f = 0;
      if (ht) {
        int local = 0;
        for (uint32_t k = 0; k < K; k++)
          if (got_ti[(size_t)row * K + k] >= 0) {
            f += got_tw[(size_t)row * K + k] *
                 slot_scale(me, (uint32_t)got_ti[(size_t)row * K + k], wbuf, slot_f);
            local = 1;
          }
        if (!local) f = NAN; /* a dense row of a token with no entry here: not a partial */
      } else {
        f = slot_scale(me, s, wbuf, slot_f);
      }
      for (uint32_t h = 0; h < H; h++) y[(size_t)row * H + h] = epd_f32_to_bf16(f * xq[h]);
    }
    if (errs) {
      bad_steps++;
      fprintf(stderr, "rank %d step %d: dispatch result differs from the reference (%d errors)\n", A.rank,
              step, errs);
    }
    for (uint32_t sg = 0; sg < nseg; sg++) {
      size_t r0 = (size_t)sg * seg_rows;
      wr(dy + r0 * H, y + r0 * H, (size_t)seg_n[sg] * H * 2);
    }
    landed();
    if (step == A.hold_at) {
      printf("rank %d: holding before the combine of step %d\n", A.rank, step);
      fflush(NULL);
      for (int i = 0; i < 6000 && access(A.hold_file, F_OK); i++) usleep(10000);
      if (access(A.hold_file, F_OK)) {
        fprintf(stderr, "rank %d step %d: %s did not appear within 60 s\n", A.rank, step, A.hold_file);
        return 2;
      }
    }
    double t2 = now_us();
    epd_comp_t ccomp;
    rc = A.graph ? graph_run(ep, 1, bank, &ccomp) : epd_combine(ep, mode, bank, NULL);
    t_ops += (t1 - t0) + (now_us() - t2);
    if (rc && skip_failed(ep, "combine", step, &fails)) {
      streak = 0;
      after_fail = 1;
      epd_comp_t fc;
      if (!A.graph && epd_op_status(ep, &fc) == EPD_OK) next_g = (int64_t)fc.step + 1;
      continue;
    }
    if (rc) {
      fprintf(stderr, "rank %d step %d: combine failed: %s\n", A.rank, step,
              A.graph ? epd_strerror(rc) : epd_last_error(ep));
      return 2;
    }
    ok_steps++;
    if (fails || A.streak_any) streak++;
    if (!A.graph) epd_op_status(ep, &ccomp); /* graph replays: the record of the replayed slot */
    next_g = (int64_t)ccomp.step + 1;
    if (ccomp.step != comp.step + 1 || ccomp.map_version != comp.map_version) {
      fprintf(stderr, "rank %d step %d: combine ran as group step %llu map %u, want %llu map %u\n", A.rank,
              step, (unsigned long long)ccomp.step, ccomp.map_version, (unsigned long long)comp.step + 1,
              comp.map_version);
      bad_steps++;
    }
    /* A rank masked since the dispatch: the entries routed to it are dropped in the combine. */
    const uint64_t gone = ccomp.masked & ~comp.masked;
    if (ccomp.dropped != plan.dropped[me] + (gone ? epd_ref_plan_routed_to(&plan, me, gone) : 0)) {
      fprintf(stderr, "rank %d step %d: combine dropped %u entries (mask 0x%llx after 0x%llx)\n", A.rank,
              step, ccomp.dropped, (unsigned long long)ccomp.masked, (unsigned long long)comp.masked);
      bad_steps++;
    }
    /* OUT[t] = sum over valid entries of w * scale(dest) * x, x as the destination received it. */
    rd(out, bufp(ep, EPD_BUF_OUT, bank, (size_t)M * H * 2), (size_t)T * H * 2);
    int oerrs = 0;
    for (uint32_t t = 0; t < T && !errs; t++) {
      uint8_t q[128];
      float sc[1];
      for (uint32_t h = 0; h < H; h++) {
        float xv = epd_bf16_to_f32(xs[me][(size_t)t * H + h]);
        if (A.fp8) {
          if (h % 128 == 0) epd_ref_quant_row(xs[me] + (size_t)t * H + h, 128, q, sc);
          xv = epd_e4m3_to_f32(q[h % 128]) * sc[0];
        }
        float wantv = 0, mag = 0;
        for (uint32_t k = 0; k < K; k++) {
          size_t e = ((size_t)me * M + t) * K + k;
          if (plan.dst_rank[e] < 0 || (gone >> plan.dst_rank[e] & 1)) continue;
          float esc = wbuf ? logical_scale((uint32_t)is[me][(size_t)t * K + k])
                           : expert_scale((uint32_t)plan.dst_rank[e], (uint32_t)plan.dst_slot[e]);
          float term = plan.weight[e] * esc * xv;
          wantv += term;
          mag += fabsf(term);
        }
        float gotv = epd_bf16_to_f32(out[(size_t)t * H + h]);
        /* special inputs: NaN where the reference has NaN, the same infinity */
        int ok = isnan(wantv)   ? isnan(gotv)
                 : isinf(wantv) ? gotv == wantv
                                : fabsf(gotv - wantv) <= mag / 64 + 1e-6f;
        if (!ok && oerrs++ < 5)
          fprintf(stderr, "rank %d step %d: out[%u][%u] = %g, want %g\n", A.rank, step, t, h, gotv, wantv);
      }
    }
    if (oerrs) {
      bad_steps += errs ? 0 : 1;
      fprintf(stderr, "rank %d step %d: combine result differs from the reference (%d errors)\n", A.rank,
              step, oerrs);
    }
    if (step == A.hold_at) {
      printf("rank %d: the combine of step %d after the hold: %s\n", A.rank, step,
             errs || oerrs ? "differs" : "ok");
      fflush(NULL);
    }
    if (A.verbose)
      printf("rank %d step %d: %s%s T=%u recv=%u map v%u %s\n", A.rank, step, ht ? "HT" : "LL",
             A.fp8 ? " fp8" : "", T, nrecv, comp.map_version, errs || oerrs ? "MISMATCH" : "ok");
    if (A.map_every > 0 && A.rank == 0 && (step + 1) % A.map_every == 0) {
      uint32_t nc = 0;
      if (wbuf ? stage_migration_map(&map, g.num_experts, R, S, step, &nc)
               : stage_random_map(g.num_experts, R, S, step)) {
        total_copies += nc;
        nstaged++;
      } else if (!map_busy) {
        return 2;
      }
    }
  }
  if (A.map_every > 0)
    printf("rank %d: %d map switches seen, %d maps staged, %u weight copies asked (%u across nodes)\n",
           A.rank, nswitch, nstaged, total_copies, copies_across);
  /* --bench N: N more steps of the last bank's inputs, unchecked, back to back: no reference work between
   * ops, so the time is the ops' own (every rank waits for the slowest), not the workers' skew. */
  if (A.bench > 0 && !bad_steps) {
    double *dt = calloc((size_t)A.bench * 2, sizeof *dt), sd = 0, sc = 0;
    for (int i = 0; i < A.bench && dt && !rc; i++) {
      double b0 = now_us();
      rc = epd_dispatch(ep, A.ht ? EPD_MODE_HT : EPD_MODE_LL, last_T, dispatch_flags(flags, A.ht), last_bank,
                        NULL);
      double b1 = now_us();
      if (!rc) rc = epd_combine(ep, A.ht ? EPD_MODE_HT : EPD_MODE_LL, last_bank, NULL);
      dt[i] = b1 - b0;
      dt[A.bench + i] = now_us() - b1;
      sd += dt[i];
      sc += dt[A.bench + i];
    }
    if (rc || !dt) {
      fprintf(stderr, "rank %d: bench step failed: %s\n", A.rank, dt ? epd_last_error(ep) : "out of memory");
      free(dt);
      return 2;
    }
    qsort(dt, (size_t)A.bench, sizeof *dt, cmp_double);
    qsort(dt + A.bench, (size_t)A.bench, sizeof *dt, cmp_double);
    printf(
        "rank %d: bench %d steps of %u tokens: dispatch mean %.1f us (median %.1f), combine mean %.1f us "
        "(median %.1f)\n",
        A.rank, A.bench, last_T, sd / A.bench, dt[A.bench / 2], sc / A.bench, dt[A.bench + A.bench / 2]);
    free(dt);
  }
  if (A.ht_every > 0) printf("rank %d: %d HT steps in between\n", A.rank, nht);
  const int ksub = epd_info(ep, EPD_INFO_KERNEL_SUBMIT) == 1;
  rc = epd_detach(ep);
  if (rc) fprintf(stderr, "rank %d: detach: %s: %s\n", A.rank, epd_strerror(rc), epd_conn_last_error(conn));
  epd_disconnect(conn);
  for (uint32_t r = 0; r < R; r++) {
    free(xs[r]);
    free(is[r]);
    free(ws[r]);
  }
  free(want.recv_x);
  free(want.recv_scales);
  free(want.recv_count);
  free(want.recv_src);
  free(want.recv_topk_idx);
  free(want.recv_topk_weights);
  free(got_x);
  free(got_sc);
  free(got_cnt);
  free(got_src);
  free(got_ti);
  free(got_tw);
  free(y);
  free(out);
  free(xq);
  free(seg_n);
  free(slot_f);
  epd_ref_plan_free(&plan);
  epd_expert_map_free(&map);
  if (bad_steps) {
    printf("rank %d: %d of %d steps differ from the reference\n", A.rank, bad_steps, A.steps);
    return 1;
  }
  printf("rank %d: %d steps ok, %.1f us/step (%s%s%s%s%s%s)\n", A.rank, A.steps,
         A.steps ? t_ops / A.steps : 0.0, A.ht ? "HT" : "LL", A.fp8 ? ", fp8" : "", A.skew ? ", skew" : "",
         A.graph ? ", graph replays" : "", A.weights ? ", weights" : "", ksub ? ", kernel submission" : "");
  return rc ? 2 : 0;
}
