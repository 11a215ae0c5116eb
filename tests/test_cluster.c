/*
 * test_cluster.c - scale-out in-process: two host-backend engines as nodes 0 and 1 of one world (2 ranks
 * each, 4 world ranks) over real loopback TCP links (daemon/net/link.c). Every step's dispatch output must
 * equal the single-node reference of the 4-rank world byte for byte, combine within BF16 rounding of
 * it; the bytes node 0 sends for a dispatch must be exactly one copy of each token per destination
 * node (deduplicated across that node's ranks); an expert map set on either node reaches the other and
 * becomes active on every rank at the same step; maps that cannot be are refused on every node.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "cuda/cuda_comm.h"
#include "core/engine.h"
#include "net/engine_net.h"
#include "core/ref.h"
#include "test.h"

#define L 2           /* ranks per node */
#define W 4           /* world ranks */
#define HDR_BYTES 320 /* sizeof(net_hdr_t) in net_internal.h, plus the 8-byte length in front of a frame */

typedef struct cl_client {
  epd_attach_info_t info;
  epd_queue_t *q;
  uint8_t *arena;
  uint32_t next;
} cl_client_t;

static uint64_t ms_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void *cbuf(cl_client_t *c, uint32_t kind, uint32_t bank) {
  for (uint32_t i = 0; i < c->info.nbuffers; i++)
    if (c->info.buffers[i].kind == kind && c->info.buffers[i].bank == bank)
      return c->arena + c->info.buffers[i].offset;
  epd_test_fail(__FILE__, __LINE__, "buffer kind %u bank %u missing", kind, bank);
}

static void csubmit(cl_client_t *c, uint32_t op, uint32_t T, uint32_t flags, uint32_t bank) {
  epd_slot_t *s = &c->q->slot[c->next];
  memset(&s->desc, 0, sizeof s->desc);
  s->desc.op = op;
  s->desc.num_tokens = T;
  s->desc.flags = flags;
  s->desc.bank = bank;
  atomic_store_explicit((_Atomic uint32_t *)&s->state, EPD_SLOT_SUBMITTED, memory_order_release);
}

static epd_comp_t cwait(cl_client_t *c) {
  epd_slot_t *s = &c->q->slot[c->next];
  uint64_t end = ms_now() + 20000;
  while (atomic_load_explicit((_Atomic uint32_t *)&s->state, memory_order_acquire) != EPD_SLOT_DONE) {
    if (ms_now() > end) epd_test_fail(__FILE__, __LINE__, "slot %u not done after 20 s", c->next);
    usleep(20);
  }
  epd_comp_t comp = s->comp;
  atomic_store_explicit((_Atomic uint32_t *)&s->state, EPD_SLOT_FREE, memory_order_release);
  c->next = (c->next + 1) % EPD_QUEUE_SLOTS;
  return comp;
}

typedef struct cluster {
  epd_net_t *net[2];
  epd_engine_t *eng[2];
  cl_client_t c[W];
  epd_ref_geom_t g;
} cluster_t;

typedef struct conn_arg {
  epd_net_t *net;
  uint32_t node;
  char (*peers)[EPD_NET_ADDR_MAX];
  epd_result_t rc;
  char err[256];
} conn_arg_t;

/* Options of the next cluster_up (a test sets them and resets them to 0). */
static uint64_t cl_weight_bytes;
static uint32_t cl_slots_pct;
static uint32_t cl_step_timeout_ms;
static uint32_t cl_rehome, cl_on_loss; /* engine.rehome_replicas, the attaches' on_rank_loss */

static void *connect_main(void *arg) {
  conn_arg_t *a = arg;
  static const uint8_t secret[EPD_NET_SECRET_BYTES] = "0123456789abcde";
  a->rc = epd_net_connect(a->net, 2, a->node, (const char(*)[EPD_NET_ADDR_MAX])a->peers, secret, 5000, 0,
                          a->err, sizeof a->err);
  return NULL;
}

/* Attach world rank r's client at its node (and check that the other node refuses it). */
static void cluster_attach(cluster_t *cl, int r, uint32_t E, uint32_t H, uint32_t K, uint32_t M) {
  char err[256] = "";
  epd_attach_req_t req;
  memset(&req, 0, sizeof req);
  snprintf(req.group, sizeof req.group, "g");
  snprintf(req.name, sizeof req.name, "r%d", r);
  req.rank = r;
  req.num_experts = E;
  req.hidden = H;
  req.topk = K;
  req.max_tokens = M;
  req.weight_bytes_per_slot = cl_weight_bytes;
  req.on_rank_loss = cl_on_loss;
  cl_client_t *c = &cl->c[r];
  memset(c, 0, sizeof *c);
  /* A rank of the other node is refused, naming the node. */
  epd_attach_info_t dummy;
  ASSERT_EQ(epd_engine_attach(cl->eng[1 - r / L], &req, &dummy, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "owns world ranks");
  if (epd_engine_attach(cl->eng[r / L], &req, &c->info, err, sizeof err))
    epd_test_fail(__FILE__, __LINE__, "attach %d: %s", r, err);
  c->q = mmap(NULL, c->info.queue_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->info.queue_fd, 0);
  c->arena = mmap(NULL, c->info.arena_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->info.arena_fd, 0);
  ASSERT(c->q != MAP_FAILED && c->arena != MAP_FAILED);
  ASSERT_EQ(c->info.num_ranks, W);
}

static void cluster_up(cluster_t *cl, uint32_t E, uint32_t H, uint32_t K, uint32_t M, uint32_t ht_factor) {
  memset(cl, 0, sizeof *cl);
  char peers[2][EPD_NET_ADDR_MAX], err[256] = "";
  for (int n = 0; n < 2; n++)
    if (epd_net_listen("127.0.0.1:0", &cl->net[n], peers[n], sizeof peers[n], err, sizeof err))
      epd_test_fail(__FILE__, __LINE__, "listen: %s", err);
  conn_arg_t a[2];
  pthread_t th[2];
  for (int n = 0; n < 2; n++) {
    a[n] = (conn_arg_t){cl->net[n], (uint32_t)n, peers, 0, ""};
    pthread_create(&th[n], NULL, connect_main, &a[n]);
  }
  for (int n = 0; n < 2; n++) {
    pthread_join(th[n], NULL);
    if (a[n].rc) epd_test_fail(__FILE__, __LINE__, "node %d connect: %s", n, a[n].err);
  }
  for (int n = 0; n < 2; n++) {
    epd_engine_opts_t o;
    memset(&o, 0, sizeof o);
    o.backend = "host";
    o.num_ranks = L;
    o.max_experts = 256;
    o.max_hidden = 4096;
    o.max_topk = 8;
    o.max_tokens = 256;
    o.max_groups = 4;
    o.max_clients_per_rank = 4;
    o.max_arena_bytes = 1ull << 30;
    o.step_timeout_ms = cl_step_timeout_ms ? cl_step_timeout_ms : 5000;
    o.ht_capacity_factor = ht_factor;
    o.ranks_per_node = L;
    o.slots_factor_pct = cl_slots_pct;
    o.rehome_replicas = cl_rehome;
    o.nodes = 2;
    o.node_rank = (uint32_t)n;
    o.net = cl->net[n];
    if (epd_engine_create(&o, NULL, NULL, &cl->eng[n], err, sizeof err))
      epd_test_fail(__FILE__, __LINE__, "engine %d: %s", n, err);
    ASSERT_EQ(epd_engine_world_ranks(cl->eng[n]), W);
  }
  for (int r = 0; r < W; r++) cluster_attach(cl, r, E, H, K, M);
  /* every node's notice of the group's creation and its reply to the other's are out before a test
   * counts the bytes of its steps */
  for (int n = 0; n < 2; n++) {
    uint64_t tx, rx, tf, rf, end = ms_now() + 5000;
    do {
      epd_net_counters(cl->net[n], &tx, &rx, &tf, &rf);
      if (tf < 2) usleep(1000);
    } while (tf < 2 && ms_now() < end);
    ASSERT_GE(tf, 2u);
  }
  epd_attach_info_t *i = &cl->c[0].info;
  cl->g = (epd_ref_geom_t){i->num_ranks,  i->num_experts,    i->hidden,     i->topk,
                           i->max_tokens, i->slots_per_rank, i->ht_capacity};
}

static void cluster_down(cluster_t *cl) {
  for (int r = 0; r < W; r++) {
    munmap(cl->c[r].q, cl->c[r].info.queue_bytes);
    munmap(cl->c[r].arena, cl->c[r].info.arena_bytes);
  }
  for (int n = 0; n < 2; n++) epd_engine_destroy(cl->eng[n]);
  for (int n = 0; n < 2; n++) epd_net_destroy(cl->net[n]);
}

/* Detach world rank r's client at its node and unmap its queue and arena. */
static void cl_detach(cluster_t *cl, int r, int lost) {
  ASSERT_OK(epd_engine_detach(cl->eng[r / L], cl->c[r].info.client_id, lost));
  munmap(cl->c[r].q, cl->c[r].info.queue_bytes);
  munmap(cl->c[r].arena, cl->c[r].info.arena_bytes);
}

static uint64_t tx_of(epd_net_t *net) {
  uint64_t tx, rx, tf, rf;
  epd_net_counters(net, &tx, &rx, &tf, &rf);
  return tx;
}

EPD_TEST(cluster_two_nodes_equal_ref) {
  cluster_t cl;
  const uint32_t E = 16, H = 256, K = 4, M = 24;
  cluster_up(&cl, E, H, K, M, 0);
  const epd_ref_geom_t *g = &cl.g;
  uint32_t S = g->slots_per_rank, C = g->ht_capacity, nb = epd_ref_scale_blocks(H);
  epd_expert_map_t map;
  ASSERT_OK(epd_engine_get_map(cl.eng[0], "g", &map));
  epd_ref_plan_t plan;
  ASSERT_OK(epd_ref_plan_init(&plan, g));
  uint16_t *xs[W];
  int64_t *is[W];
  float *ws[W];
  epd_ref_in_t in[W];
  epd_ref_out_t want[W], *outs[W];
  size_t rows = (size_t)S * W * M > C ? (size_t)S * W * M : C;
  for (int r = 0; r < W; r++) {
    xs[r] = calloc((size_t)M * H, 2);
    is[r] = calloc((size_t)M * K, 8);
    ws[r] = calloc((size_t)M * K, 4);
    want[r] = (epd_ref_out_t){
        calloc(rows, (size_t)H * 2), calloc(rows, (size_t)nb * 4), calloc(S, 4), calloc(rows, 4),
        calloc(C, (size_t)K * 8),    calloc(C, (size_t)K * 4)};
    outs[r] = &want[r];
  }
  uint16_t *wout[W];
  for (int r = 0; r < W; r++) wout[r] = calloc((size_t)M * H, 2);
  int deduped = 0;
  uint64_t rs = 99;
  for (int step = 0; step < 8; step++) {
    int ht = step % 2, fp8 = (step / 2) % 2, skew = step < 4;
    uint32_t bank = (uint32_t)step % EPD_NUM_BANKS;
    for (int r = 0; r < W; r++) {
      uint32_t T = step == 0 ? M : (uint32_t)((step * 7 + r * 5) % (M + 1));
      epd_ref_gen_input(7, (uint64_t)step, (uint32_t)r, g, T, skew, xs[r], is[r], ws[r]);
      in[r] = (epd_ref_in_t){T, xs[r], is[r], ws[r]};
      memcpy(cbuf(&cl.c[r], EPD_BUF_X, bank), xs[r], (size_t)T * H * 2);
      memcpy(cbuf(&cl.c[r], EPD_BUF_TOPK_IDX, bank), is[r], (size_t)T * K * 8);
      memcpy(cbuf(&cl.c[r], EPD_BUF_TOPK_WEIGHTS, bank), ws[r], (size_t)T * K * 4);
      memset(cbuf(&cl.c[r], EPD_BUF_OUT, bank), 0x5a, (size_t)M * H * 2);
    }
    int bad = -1;
    char err[128];
    ASSERT_OK(epd_ref_plan_build(&plan, &map, in, &bad, err, sizeof err));
    if (ht)
      ASSERT_OK(epd_ref_ht_dispatch(&plan, in, fp8, outs, &bad));
    else
      ASSERT_OK(epd_ref_ll_dispatch(&plan, in, fp8, outs));
    /* What node 0 must send node 1: each of its tokens with an entry on rank 2 or 3, once. */
    uint64_t ntok = 0, pairs = 0;
    for (uint32_t src = 0; src < L; src++)
      for (uint32_t t = 0; t < in[src].num_tokens; t++) {
        int any = 0;
        for (uint32_t d = L; d < W; d++) {
          int hit = 0;
          for (uint32_t k = 0; k < K; k++) hit |= plan.dst_rank[((size_t)src * M + t) * K + k] == (int32_t)d;
          pairs += hit;
          any |= hit;
        }
        ntok += any;
      }
    deduped |= pairs > ntok;
    uint64_t tx0 = tx_of(cl.net[0]);
    for (int r = 0; r < W; r++)
      csubmit(&cl.c[r], ht ? EPD_OP_HT_DISPATCH : EPD_OP_LL_DISPATCH, in[r].num_tokens,
              fp8 ? EPD_DESC_FP8 : 0, bank);
    for (int r = 0; r < W; r++) {
      epd_comp_t comp = cwait(&cl.c[r]);
      ASSERT_EQ(comp.status, EPD_OK);
      ASSERT_EQ(comp.step, (uint64_t)step * 2);
      ASSERT_EQ(comp.num_recv, ht ? plan.ht_recv[r] : plan.ll_recv[r]);
    }
    uint64_t sent = tx_of(cl.net[0]) - tx0;
    ASSERT_EQ(sent, 8 + HDR_BYTES + L * 16 + W * 4 + L * 4 + ntok * (4 + (uint64_t)H * 2 + (uint64_t)K * 12));
    /* Dispatch outputs: byte for byte the 4-rank reference. */
    for (int r = 0; r < W; r++) {
      cl_client_t *c = &cl.c[r];
      int32_t *cnt = cbuf(c, ht ? EPD_BUF_HT_RECV_COUNT : EPD_BUF_LL_RECV_COUNT, bank);
      ASSERT(!memcmp(cnt, want[r].recv_count, (size_t)S * 4));
      uint8_t *rx = cbuf(c, ht ? EPD_BUF_HT_RECV_X : EPD_BUF_LL_RECV_X, bank);
      float *rsc = cbuf(c, ht ? EPD_BUF_HT_RECV_SCALES : EPD_BUF_LL_RECV_SCALES, bank);
      int32_t *src = cbuf(c, ht ? EPD_BUF_HT_RECV_SRC : EPD_BUF_LL_RECV_SRC, bank);
      uint16_t *y = cbuf(c, ht ? EPD_BUF_HT_Y : EPD_BUF_LL_Y, bank);
      size_t rowb = (size_t)H * 2, cmpb = fp8 ? H : rowb;
      for (size_t row = 0; row < (ht ? (size_t)plan.ht_recv[r] : (size_t)S * W * M); row++) {
        if (!ht && (int32_t)(row % ((size_t)W * M)) >= cnt[row / ((size_t)W * M)]) continue;
        ASSERT_EQ(src[row], want[r].recv_src[row]);
        ASSERT(!memcmp(rx + row * rowb, (uint8_t *)want[r].recv_x + row * rowb, cmpb));
        if (fp8) ASSERT(!memcmp(rsc + row * nb, want[r].recv_scales + row * nb, (size_t)nb * 4));
        if (ht) {
          ASSERT(!memcmp((int64_t *)cbuf(c, EPD_BUF_HT_RECV_TOPK_IDX, bank) + row * K,
                         want[r].recv_topk_idx + row * K, (size_t)K * 8));
          ASSERT(!memcmp((float *)cbuf(c, EPD_BUF_HT_RECV_TOPK_WEIGHTS, bank) + row * K,
                         want[r].recv_topk_weights + row * K, (size_t)K * 4));
        }
        for (uint32_t h = 0; h < H; h++) /* the expert: any values; combine is checked against them */
          y[row * H + h] = epd_f32_to_bf16((float)(epd_ref_rand(&rs) >> 40) / (float)(1 << 24) * 4.0f - 2.0f);
      }
    }
    /* Combine against the reference over the same expert outputs. */
    const uint16_t *ys[W];
    for (int r = 0; r < W; r++) ys[r] = cbuf(&cl.c[r], ht ? EPD_BUF_HT_Y : EPD_BUF_LL_Y, bank);
    ASSERT_OK(ht ? epd_ref_ht_combine(&plan, ys, wout) : epd_ref_ll_combine(&plan, ys, wout));
    for (int r = 0; r < W; r++) csubmit(&cl.c[r], ht ? EPD_OP_HT_COMBINE : EPD_OP_LL_COMBINE, 0, 0, bank);
    for (int r = 0; r < W; r++) {
      epd_comp_t comp = cwait(&cl.c[r]);
      ASSERT_EQ(comp.status, EPD_OK);
      const uint16_t *o = cbuf(&cl.c[r], EPD_BUF_OUT, bank);
      for (size_t i = 0; i < (size_t)in[r].num_tokens * H; i++) {
        /* Partials are added per node: the f32 sum may round differently, never by more than BF16 rounding.
         */
        float a = epd_bf16_to_f32(o[i]), b = epd_bf16_to_f32(wout[r][i]);
        if (!(fabsf(a - b) <= fabsf(b) / 128 + 1e-3f))
          epd_test_fail(__FILE__, __LINE__, "step %d rank %d out[%zu] = %g, reference %g", step, r, i, a, b);
      }
    }
  }
  ASSERT(deduped); /* the byte check above saw tokens that go to both ranks of node 1, sent once */
  /* A map set on node 1 only reaches node 0 (node 0 numbers it): both have it staged when the call
   * returns; the next dispatch's frames report it from both nodes, so the dispatch after it switches on
   * every rank at once (never EPD_ERR_MISMATCH). */
  uint32_t v = 0;
  char err[256] = "";
  epd_expert_map_t m2;
  ASSERT_OK(epd_ref_map_copy(&m2, &map));
  epd_replica_t tmp = m2.rep[0][0];
  m2.rep[0][0] = m2.rep[E - 1][0];
  m2.rep[E - 1][0] = tmp;
  ASSERT_OK(epd_engine_set_map(cl.eng[1], "g", &m2, &v, err, sizeof err));
  ASSERT_EQ(v, map.version + 1);
  for (int i = 0; i < 2; i++) {
    for (int r = 0; r < W; r++) csubmit(&cl.c[r], EPD_OP_LL_DISPATCH, 1, 0, 0);
    for (int r = 0; r < W; r++) {
      epd_comp_t comp = cwait(&cl.c[r]);
      ASSERT_EQ(comp.status, EPD_OK);
      ASSERT_EQ(comp.map_version, i == 0 ? map.version : v);
    }
  }
  for (int n = 0; n < 2; n++) { /* GetExpertMap: the same placements and version on both nodes */
    epd_expert_map_t got;
    ASSERT_OK(epd_engine_get_map(cl.eng[n], "g", &got));
    ASSERT_EQ(got.version, v);
    ASSERT(!memcmp(got.nrep, m2.nrep, E) && !memcmp(got.rep, m2.rep, sizeof *m2.rep * E));
    epd_expert_map_free(&got);
  }
  /* Maps set on both nodes in turn, two before any step: versions follow each other and the last one
   * becomes active on every rank at the same step; every step's ranks agree on the version. */
  uint32_t v3 = 0, v4 = 0;
  tmp = m2.rep[1][0];
  m2.rep[1][0] = m2.rep[2][0];
  m2.rep[2][0] = tmp;
  ASSERT_OK(epd_engine_set_map(cl.eng[0], "g", &m2, &v3, err, sizeof err));
  tmp = m2.rep[3][0];
  m2.rep[3][0] = m2.rep[4][0];
  m2.rep[4][0] = tmp;
  ASSERT_OK(epd_engine_set_map(cl.eng[1], "g", &m2, &v4, err, sizeof err));
  ASSERT_EQ(v3, v + 1);
  ASSERT_EQ(v4, v + 2);
  uint32_t last = 0;
  for (int i = 0; i < 3; i++) {
    for (int r = 0; r < W; r++) csubmit(&cl.c[r], EPD_OP_LL_DISPATCH, 1, 0, 0);
    for (int r = 0; r < W; r++) {
      epd_comp_t comp = cwait(&cl.c[r]);
      ASSERT_EQ(comp.status, EPD_OK);
      if (r == 0) last = comp.map_version;
      ASSERT_EQ(comp.map_version, last);
    }
  }
  ASSERT_EQ(last, v4);
  /* Refused on every node, changing nothing: an invalid map (two experts on one slot), and a weight
   * copy in a group without a weights region (asked at node 1, refused by node 0 with its reason). */
  epd_expert_map_t bad;
  ASSERT_OK(epd_ref_map_copy(&bad, &m2));
  bad.rep[1][0] = bad.rep[0][0];
  for (int n = 0; n < 2; n++) {
    ASSERT_EQ(epd_engine_set_map(cl.eng[n], "g", &bad, &v, err, sizeof err), EPD_ERR_INVALID);
    ASSERT_STR_CONTAINS(err, "already used");
  }
  epd_weight_copy_t xc = {0, 0, 2, 0};
  for (int n = 0; n < 2; n++) {
    ASSERT_EQ(epd_engine_set_map_copies(cl.eng[n], "g", &m2, &xc, 1, &v, err, sizeof err), EPD_ERR_INVALID);
    ASSERT_STR_CONTAINS(err, "no expert-weights region");
  }
  for (int r = 0; r < W; r++) csubmit(&cl.c[r], EPD_OP_LL_DISPATCH, 1, 0, 0);
  for (int r = 0; r < W; r++) ASSERT_EQ(cwait(&cl.c[r]).map_version, v4);
  for (int n = 0; n < 2; n++) {
    epd_expert_map_t got;
    ASSERT_OK(epd_engine_get_map(cl.eng[n], "g", &got));
    ASSERT_EQ(got.version, v4);
    epd_expert_map_free(&got);
  }
  epd_expert_map_free(&bad);
  epd_expert_map_free(&m2);
  epd_expert_map_free(&map);
  epd_ref_plan_free(&plan);
  for (int r = 0; r < W; r++) {
    free(xs[r]);
    free(is[r]);
    free(ws[r]);
    free(wout[r]);
    free(want[r].recv_x);
    free(want[r].recv_scales);
    free(want[r].recv_count);
    free(want[r].recv_src);
    free(want[r].recv_topk_idx);
    free(want[r].recv_topk_weights);
  }
  cluster_down(&cl);
}

/* Weight copies across nodes: each node runs the copies into its own ranks when the map switches (the
 * same step everywhere); the other slots keep their bytes. */
/* Byte b of slot sl's weights on rank r before any copy. */
static uint8_t wbyte(int r, uint32_t sl, uint32_t b) {
  return (uint8_t)(r * 16 + (int)sl + (int)(b * 7));
}

static void fill_weights(cluster_t *cl, int r, uint32_t S, uint32_t WB) {
  uint8_t *w = cbuf(&cl->c[r], EPD_BUF_EXPERT_WEIGHTS, 0);
  for (uint32_t sl = 0; sl < S; sl++)
    for (uint32_t b = 0; b < WB; b++) w[sl * WB + b] = wbyte(r, sl, b);
}

/* A cluster whose group has WB bytes of weights per slot and twice the slots its experts need (the
 * default map leaves slots free), every slot filled with wbyte; returns slots per rank. */
static uint32_t cluster_up_weights(cluster_t *cl, uint32_t E, uint32_t WB) {
  cl_weight_bytes = WB;
  cl_slots_pct = 200;
  cluster_up(cl, E, 64, 2, 4, 0);
  cl_weight_bytes = 0;
  cl_slots_pct = 0;
  const uint32_t S = cl->g.slots_per_rank;
  for (int r = 0; r < W; r++) fill_weights(cl, r, S, WB);
  return S;
}

/* Every slot holds its own bytes, or its source's where one of the n copies filled it. */
static void check_weights(cluster_t *cl, uint32_t S, uint32_t WB, const epd_weight_copy_t *cp, uint32_t n) {
  for (int r = 0; r < W; r++) {
    const uint8_t *w = cbuf(&cl->c[r], EPD_BUF_EXPERT_WEIGHTS, 0);
    for (uint32_t sl = 0; sl < S; sl++) {
      int fr = r;
      uint32_t fs = sl;
      for (uint32_t i = 0; i < n; i++)
        if (cp[i].dst_rank == (uint32_t)r && cp[i].dst_slot == sl) {
          fr = (int)cp[i].src_rank;
          fs = cp[i].src_slot;
        }
      for (uint32_t b = 0; b < WB; b++)
        if (w[sl * WB + b] != wbyte(fr, fs, b))
          epd_test_fail(__FILE__, __LINE__, "rank %d slot %u byte %u = %d, want %d (rank %d slot %u)", r, sl,
                        b, w[sl * WB + b], wbyte(fr, fs, b), fr, fs);
    }
  }
}

/* Dispatch steps on every rank until their completions carry map version v (every rank the same version at
 * every step), pausing pause_us between steps, for at most max_ms; returns the steps run before. */
static int steps_until_version(cluster_t *cl, uint32_t v, uint32_t max_ms, uint32_t pause_us) {
  const uint64_t t0 = ms_now();
  uint32_t seen = 0;
  int before = 0;
  while (ms_now() - t0 < max_ms) {
    for (int r = 0; r < W; r++) csubmit(&cl->c[r], EPD_OP_LL_DISPATCH, 1, 0, 0);
    for (int r = 0; r < W; r++) {
      epd_comp_t comp = cwait(&cl->c[r]);
      ASSERT_EQ(comp.status, EPD_OK);
      if (r == 0) seen = comp.map_version;
      ASSERT_EQ(comp.map_version, seen); /* every rank of both nodes switches at the same step */
    }
    if (seen == v) break;
    before++;
    usleep(pause_us);
  }
  ASSERT_EQ(seen, v);
  return before;
}

EPD_TEST(cluster_map_weight_copies_same_node) {
  cluster_t cl;
  const uint32_t E = 8, WB = 64;
  const uint32_t S = cluster_up_weights(&cl, E, WB);
  epd_expert_map_t m;
  ASSERT_OK(epd_engine_get_map(cl.eng[0], "g", &m));
  m.rep[0][1] = (epd_replica_t){1, 3}; /* expert 0 also on rank 1 (node 0) */
  m.nrep[0] = 2;
  m.rep[4][1] = (epd_replica_t){3, 2}; /* expert 4 also on rank 3 (node 1) */
  m.nrep[4] = 2;
  epd_weight_copy_t cp[2] = {{0, 0, 1, 3}, {2, 0, 3, 2}};
  uint32_t v = 0;
  char err[256] = "";
  ASSERT_OK(epd_engine_set_map_copies(cl.eng[1], "g", &m, cp, 2, &v, err, sizeof err));
  for (int i = 0; i < 2; i++) {
    for (int r = 0; r < W; r++) csubmit(&cl.c[r], EPD_OP_LL_DISPATCH, 1, 0, 0);
    for (int r = 0; r < W; r++) {
      epd_comp_t comp = cwait(&cl.c[r]);
      ASSERT_EQ(comp.status, EPD_OK);
      ASSERT_EQ(comp.map_version, i ? v : 1u);
    }
  }
  check_weights(&cl, S, WB, cp, 2);
  epd_expert_map_free(&m);
  cluster_down(&cl);
}

/* Weight copies between the ranks of two nodes: the source's node sends the slot's bytes when it stages
 * the map (its control thread reads them in chunks), the destination's writes them at the switch. Both
 * nodes switch at the same step, and only once the bytes are there; the copy within node 1 runs beside
 * them. Node 1 sends its bytes delay_ms after it staged the map. */
static void weight_copies_across_nodes(uint32_t WB, uint32_t delay_ms) {
  cluster_t cl;
  const uint32_t E = 8;
  const uint32_t S = cluster_up_weights(&cl, E, WB);
  ASSERT_EQ(S, 4u); /* default map: expert e on (e / 2, e % 2); slots 2, 3 free */
  epd_expert_map_t m;
  ASSERT_OK(epd_engine_get_map(cl.eng[0], "g", &m));
  m.rep[0][1] = (epd_replica_t){3, 2}; /* expert 0 (rank 0, node 0) also on rank 3 (node 1) */
  m.nrep[0] = 2;
  m.rep[5][1] = (epd_replica_t){1, 3}; /* expert 5 (rank 2, node 1) also on rank 1 (node 0) */
  m.nrep[5] = 2;
  m.rep[6][1] = (epd_replica_t){2, 3}; /* expert 6 (rank 3, node 1) also on rank 2: within node 1 */
  m.nrep[6] = 2;
  epd_weight_copy_t cp[3] = {{0, 0, 3, 2}, {2, 1, 1, 3}, {3, 0, 2, 3}};
  uint32_t v = 0;
  char err[256] = "";
  if (delay_ms) epd_net_test_weights_delay(cl.net[1], delay_ms);
  ASSERT_OK(epd_engine_set_map_copies(cl.eng[0], "g", &m, cp, 3, &v, err, sizeof err));
  const uint64_t t0 = ms_now();
  const int before = steps_until_version(&cl, v, 10000, 2000);
  if (delay_ms) { /* the steps meanwhile stay on the old map */
    ASSERT_GE(before, 5);
    ASSERT_GE(ms_now() - t0, delay_ms - 50u); /* not before node 1's bytes could be there */
  }
  check_weights(&cl, S, WB, cp, 3);
  epd_expert_map_free(&m);
  cluster_down(&cl);
}

EPD_TEST(cluster_map_weight_copies_across_nodes) {
  weight_copies_across_nodes(4096, 300);
}

/* Slots of several read chunks (4 MiB each) and a partial last one: every byte crosses. */
EPD_TEST(cluster_map_weight_copies_across_nodes_large_slots) {
  weight_copies_across_nodes((9u << 20) + 4096u + 36u, 0);
}

/* A copy whose source rank has no client when its node stages the map: that node reads the slot once the
 * rank is back (at its next step frame) and sends it then; the destination's node waits for the bytes, so
 * the switch finds them. */
/* engine.rehome_replicas across nodes: a masking group with expert weights, rank 3's experts (6, 7) also
 * on rank 1 (node 0). Rank 3's client dies: node 1 masks it and tells node 0, which alone decides: it
 * stages a map giving each of them a new replica on a free slot of the least loaded live rank without one
 * (expert 6: rank 0 slot 2, on node 0; expert 7: rank 2 slot 2, on node 1), the weights copied from rank
 * 1's replicas, across the link for rank 2. Both nodes switch at one step; every copied slot holds expert
 * 6's and 7's bytes. */
EPD_TEST(cluster_rehome_masked_replicas_across_nodes) {
  cluster_t cl;
  cl_rehome = 1;
  cl_on_loss = EPD_RANK_LOSS_MASK;
  const uint32_t WB = 3000;
  const uint32_t S = cluster_up_weights(&cl, 8, WB);
  cl_rehome = cl_on_loss = 0;
  ASSERT_EQ(S, 4u); /* expert e on rank e / 2, slot e % 2 */
  epd_expert_map_t m;
  ASSERT_OK(epd_engine_get_map(cl.eng[0], "g", &m));
  m.nrep[6] = m.nrep[7] = 2;
  m.rep[6][1] = (epd_replica_t){1, 2};
  m.rep[7][1] = (epd_replica_t){1, 3};
  const epd_weight_copy_t cp[2] = {{3, 0, 1, 2}, {3, 1, 1, 3}};
  uint32_t v = 0;
  char err[320] = "";
  ASSERT_OK(epd_engine_set_map_copies(cl.eng[0], "g", &m, cp, 2, &v, err, sizeof err));
  epd_expert_map_free(&m);
  steps_until_version(&cl, v, 5000, 2000);
  check_weights(&cl, S, WB, cp, 2);
  cl_detach(&cl, 3, 1);
  /* ranks 0-2 step on (the first step may fail on the mask) until the re-homed map is active */
  uint32_t seen = 0;
  for (const uint64_t t0 = ms_now(); seen != v + 1 && ms_now() - t0 < 10000;) {
    for (int r = 0; r < 3; r++) csubmit(&cl.c[r], EPD_OP_LL_DISPATCH, 1, 0, 0);
    uint32_t ver[3] = {0};
    for (int r = 0; r < 3; r++) {
      epd_comp_t comp = cwait(&cl.c[r]);
      if (comp.status) continue;
      ASSERT_EQ(comp.masked, 1u << 3);
      ver[r] = comp.map_version;
    }
    ASSERT(ver[0] == ver[1] && ver[1] == ver[2]); /* one switch step on both nodes */
    seen = ver[0];
    usleep(2000);
  }
  ASSERT_EQ(seen, v + 1);
  for (int n = 0; n < 2; n++) {
    ASSERT_OK(epd_engine_get_map(cl.eng[n], "g", &m));
    ASSERT_EQ(m.version, v + 1);
    ASSERT_EQ(m.nrep[6], 3u);
    ASSERT_EQ(m.rep[6][2].rank, 0u);
    ASSERT_EQ(m.rep[6][2].slot, 2u);
    ASSERT_EQ(m.nrep[7], 3u);
    ASSERT_EQ(m.rep[7][2].rank, 2u);
    ASSERT_EQ(m.rep[7][2].slot, 2u);
    epd_expert_map_free(&m);
  }
  const uint8_t *w0 = cbuf(&cl.c[0], EPD_BUF_EXPERT_WEIGHTS, 0),
                *w2 = cbuf(&cl.c[2], EPD_BUF_EXPERT_WEIGHTS, 0);
  for (uint32_t b = 0; b < WB; b++) {
    ASSERT_EQ(w0[2 * WB + b], wbyte(3, 0, b));
    ASSERT_EQ(w2[2 * WB + b], wbyte(3, 1, b));
    ASSERT_EQ(w2[3 * WB + b], wbyte(2, 3, b)); /* the next free slot untouched */
  }
  cluster_down(&cl);
}

EPD_TEST(cluster_map_weight_copy_source_detached) {
  cluster_t cl;
  const uint32_t E = 8, WB = 256;
  const uint32_t S = cluster_up_weights(&cl, E, WB);
  cl_detach(&cl, 2, 0);
  epd_expert_map_t m;
  ASSERT_OK(epd_engine_get_map(cl.eng[0], "g", &m));
  m.rep[4][1] = (epd_replica_t){0, 3}; /* expert 4 (rank 2, node 1) also on rank 0 (node 0) */
  m.nrep[4] = 2;
  epd_weight_copy_t cp = {2, 0, 0, 3};
  uint32_t v = 0;
  char err[256] = "";
  ASSERT_OK(epd_engine_set_map_copies(cl.eng[0], "g", &m, &cp, 1, &v, err, sizeof err));
  usleep(100000); /* node 1 staged it meanwhile, with nothing to read */
  cluster_attach(&cl, 2, E, 64, 2, 4);
  fill_weights(&cl, 2, S, WB);
  steps_until_version(&cl, v, 5000, 2000);
  check_weights(&cl, S, WB, &cp, 1);
  epd_expert_map_free(&m);
  cluster_down(&cl);
}

/* One LL dispatch of T tokens with varied routing (-1 entries too) on the ranks [r0, r1). */
static void cl_submit(cluster_t *cl, int r0, int r1, uint32_t T, uint32_t seed) {
  for (int r = r0; r < r1; r++) {
    int64_t *idx = cbuf(&cl->c[r], EPD_BUF_TOPK_IDX, 0);
    float *w = cbuf(&cl->c[r], EPD_BUF_TOPK_WEIGHTS, 0);
    for (uint32_t i = 0; i < T * cl->g.topk; i++) {
      uint32_t h = (seed + 7u * (uint32_t)r + 13u * i) * 2654435761u;
      idx[i] = h % 5 == 0 ? -1 : (int64_t)(h % cl->g.num_experts);
      w[i] = 0.25f + (float)(h % 3);
    }
    csubmit(&cl->c[r], EPD_OP_LL_DISPATCH, T, 0, 0);
  }
}

/* A cluster of group "g" (8 experts, hidden 64, top-2, 4 tokens) with engine.step_timeout_ms timeout_ms,
 * after one step of every rank. */
static void cluster_up_stepped(cluster_t *cl, uint32_t timeout_ms) {
  cl_step_timeout_ms = timeout_ms;
  cluster_up(cl, 8, 64, 2, 4, 2);
  cl_step_timeout_ms = 0;
  cl_submit(cl, 0, W, 3, 1);
  for (int r = 0; r < W; r++) ASSERT_EQ(cwait(&cl->c[r]).status, EPD_OK);
}

/* A node whose step failed before its part went out (a client detached while the other had submitted) and
 * whose group is then removed: the other node fails that step at once with EPD_ERR_PEER naming the node's
 * first rank (the removal names the first step the node did not send), not after the 10 s step timeout. */
EPD_TEST(cluster_group_removed_after_an_unsent_step_fails_that_step_at_once) {
  cluster_t cl;
  cluster_up_stepped(&cl, 10000);
  /* node 1: rank 2 submits, rank 3's client detaches: the step fails there before its part goes out */
  cl_submit(&cl, 2, 3, 3, 2);
  usleep(50000);
  cl_detach(&cl, 3, 0);
  epd_comp_t comp = cwait(&cl.c[2]);
  ASSERT_EQ(comp.status, EPD_ERR_PEER);
  const uint64_t k = comp.step;
  /* node 0 submits that step; node 1's last client leaves, which removes the group there */
  const uint64_t t0 = ms_now();
  cl_submit(&cl, 0, 2, 3, 2);
  usleep(50000);
  cl_detach(&cl, 2, 0);
  for (int r = 0; r < 2; r++) {
    comp = cwait(&cl.c[r]);
    ASSERT_EQ(comp.status, EPD_ERR_PEER);
    ASSERT_EQ(comp.peer, 2);
    ASSERT_EQ(comp.step, k);
  }
  ASSERT_LT(ms_now() - t0, 3000u);
  cluster_down(&cl);
}

/* A group removed on one node (its last clients there left) fails the other node's next step at once with
 * EPD_ERR_PEER naming the node's first rank (the removal notice), not after the 10 s step timeout; the
 * part of a step that node sent before its clients left is still used. A group removed and created again
 * on a node (its clients restarted), before any step or after many and a map switch, steps with the other
 * node again: it takes the other node's step number and map before its first part goes out. */
EPD_TEST(cluster_group_removed_on_a_node_fails_the_others_at_once_and_rejoins) {
  cluster_t cl;
  cl_step_timeout_ms = 10000;
  cluster_up(&cl, 8, 64, 2, 4, 2);
  cl_step_timeout_ms = 0;
  /* node 1's clients restart before the first step: node 0 submits first and waits for node 1's part */
  cl_detach(&cl, 2, 1);
  cl_detach(&cl, 3, 0);
  cluster_attach(&cl, 2, 8, 64, 2, 4);
  cluster_attach(&cl, 3, 8, 64, 2, 4);
  usleep(100000);
  cl_submit(&cl, 0, 2, 3, 1);
  usleep(200000);
  cl_submit(&cl, 2, 4, 3, 1);
  for (int r = 0; r < W; r++) {
    epd_comp_t comp = cwait(&cl.c[r]);
    ASSERT_EQ(comp.status, EPD_OK);
    ASSERT_EQ(comp.step, 0u);
  }
  /* a new map, active on both nodes */
  epd_expert_map_t m;
  ASSERT_OK(epd_engine_get_map(cl.eng[0], "g", &m));
  const epd_replica_t sw = m.rep[0][0]; /* experts 0 and 5 trade places */
  m.rep[0][0] = m.rep[5][0];
  m.rep[5][0] = sw;
  uint32_t v = 0;
  char err[256] = "";
  ASSERT_OK(epd_engine_set_map(cl.eng[0], "g", &m, &v, err, sizeof err));
  epd_expert_map_free(&m);
  steps_until_version(&cl, v, 5000, 2000);
  /* node 1's ranks submit a step (node 1 sends its part), then both leave: node 0's step still runs */
  cl_submit(&cl, 2, 4, 2, 2);
  usleep(100000);
  cl_detach(&cl, 2, 1);
  cl_detach(&cl, 3, 1);
  cl_submit(&cl, 0, 2, 2, 2);
  uint64_t k = 0;
  for (int r = 0; r < 2; r++) {
    epd_comp_t comp = cwait(&cl.c[r]);
    ASSERT_EQ(comp.status, EPD_OK);
    k = comp.step;
  }
  /* the next step: node 1 has no group any more */
  usleep(100000);
  const uint64_t t0 = ms_now();
  cl_submit(&cl, 0, 2, 2, 3);
  for (int r = 0; r < 2; r++) {
    epd_comp_t comp = cwait(&cl.c[r]);
    ASSERT_EQ(comp.status, EPD_ERR_PEER);
    ASSERT_EQ(comp.peer, 2);
    ASSERT_EQ(comp.step, k + 1);
  }
  ASSERT_LT(ms_now() - t0, 3000u);
  epd_engine_snap_t snap;
  ASSERT_OK(epd_engine_snapshot(cl.eng[0], &snap));
  ASSERT_EQ(snap.ngroups, 1u);
  ASSERT_STR_CONTAINS(snap.groups[0].nodes, "node 1 removed it at step");
  epd_engine_snapshot_free(&snap);
  /* node 1's clients attach again (its workers restarted): the group made again there takes node 0's
   * step and the map both nodes ran, and the four ranks step together again */
  cluster_attach(&cl, 2, 8, 64, 2, 4);
  cluster_attach(&cl, 3, 8, 64, 2, 4);
  usleep(100000); /* node 0 hears of the new group (until then its steps fail at once) */
  for (int i = 0; i < 2; i++) {
    cl_submit(&cl, 0, W, 3, 6 + (uint32_t)i);
    for (int r = 0; r < W; r++) {
      epd_comp_t comp = cwait(&cl.c[r]);
      ASSERT_EQ(comp.status, EPD_OK);
      ASSERT_EQ(comp.step, k + 2 + (uint64_t)i);
      ASSERT_EQ(comp.map_version, v);
    }
  }
  ASSERT_OK(epd_engine_snapshot(cl.eng[0], &snap));
  ASSERT_EQ(snap.groups[0].nodes[0], 0);
  epd_engine_snapshot_free(&snap);
  cl_detach(&cl, 2, 0);
  cl_detach(&cl, 3, 0);
  /* every node's clients attach again: new groups on both, steps from 0 */
  cl_detach(&cl, 0, 0);
  cl_detach(&cl, 1, 0);
  for (int r = 0; r < W; r++) cluster_attach(&cl, r, 8, 64, 2, 4);
  usleep(100000);
  cl_submit(&cl, 0, W, 3, 4);
  for (int r = 0; r < W; r++) {
    epd_comp_t comp = cwait(&cl.c[r]);
    ASSERT_EQ(comp.status, EPD_OK);
    ASSERT_EQ(comp.step, 0u);
  }
  cluster_down(&cl);
}

/* Bytes that do not come: a destination waits max(10 s, 4 x step timeout) from its first step frame after
 * staging, then every node switches and the copy is skipped (the slot keeps what it held); the copy inside
 * the destination's node runs. Node 1 sends its bytes only after 11.5 s, so they come too late. */
EPD_TEST(cluster_map_weight_copy_wait_limit) {
  cluster_t cl;
  const uint32_t E = 8, WB = 64;
  cl_step_timeout_ms = 1000; /* the wait limit is then its floor, 10 s */
  const uint32_t S = cluster_up_weights(&cl, E, WB);
  cl_step_timeout_ms = 0;
  epd_net_test_weights_delay(cl.net[1], 11500);
  epd_expert_map_t m;
  ASSERT_OK(epd_engine_get_map(cl.eng[0], "g", &m));
  m.rep[4][1] = (epd_replica_t){0, 3}; /* expert 4 (rank 2, node 1) also on rank 0 (node 0) */
  m.nrep[4] = 2;
  m.rep[0][1] = (epd_replica_t){1, 2}; /* expert 0 (rank 0) also on rank 1: within node 0 */
  m.nrep[0] = 2;
  epd_weight_copy_t cp[2] = {{2, 0, 0, 3}, {0, 0, 1, 2}};
  uint32_t v = 0;
  char err[256] = "";
  ASSERT_OK(epd_engine_set_map_copies(cl.eng[0], "g", &m, cp, 2, &v, err, sizeof err));
  const uint64_t t0 = ms_now();
  steps_until_version(&cl, v, 20000, 20000);
  const uint64_t took = ms_now() - t0;
  ASSERT_GE(took, 9500u);               /* not before the limit */
  ASSERT_LT(took, 11500u);              /* and not by waiting for the late bytes */
  check_weights(&cl, S, WB, &cp[1], 1); /* (0, 3) keeps its bytes; (1, 2) got (0, 0)'s */
  epd_expert_map_free(&m);
  cluster_down(&cl);
}

/* HT capacity is decided over the world: 5 tokens of every rank go to rank 0, whose capacity is 12
 * (1 x max_tokens): each node's share (10) fits, the world's (20) does not. Node 1 never sees node 0's
 * tokens: it fails the step on every rank only because node 0's frame carries its counts. */
EPD_TEST(cluster_ht_overflow_decided_over_the_world) {
  cluster_t cl;
  const uint32_t E = 8, H = 64, K = 2, M = 12, T = 5;
  cluster_up(&cl, E, H, K, M, 1);
  ASSERT_EQ(cl.g.ht_capacity, M);
  for (int r = 0; r < W; r++) {
    int64_t *idx = cbuf(&cl.c[r], EPD_BUF_TOPK_IDX, 0);
    float *w = cbuf(&cl.c[r], EPD_BUF_TOPK_WEIGHTS, 0);
    for (uint32_t t = 0; t < T; t++) {
      idx[t * K] = 0; /* expert 0: rank 0 */
      idx[t * K + 1] = -1;
      w[t * K] = 1.0f;
    }
  }
  for (int r = 0; r < W; r++) csubmit(&cl.c[r], EPD_OP_HT_DISPATCH, T, 0, 0);
  for (int r = 0; r < W; r++) {
    epd_comp_t comp = cwait(&cl.c[r]);
    ASSERT_EQ(comp.status, EPD_ERR_OVERFLOW);
    ASSERT_EQ(comp.peer, 0);
  }
  /* Within capacity (3 tokens per rank: 12), the same routing runs on every rank. */
  for (int r = 0; r < W; r++) csubmit(&cl.c[r], EPD_OP_HT_DISPATCH, 3, 0, 0);
  for (int r = 0; r < W; r++) {
    epd_comp_t comp = cwait(&cl.c[r]);
    ASSERT_EQ(comp.status, EPD_OK);
    ASSERT_EQ(comp.num_recv, r == 0 ? 12u : 0u);
  }
  cluster_down(&cl);
}

/* A bad input on one node fails the step on every rank of both nodes with the same error and peer; a
 * combine of that bank then fails everywhere with EPD_ERR_STATE; the group then runs again. */
EPD_TEST(cluster_bad_input_fails_every_rank) {
  cluster_t cl;
  const uint32_t E = 8, H = 64, K = 2, M = 12;
  cluster_up(&cl, E, H, K, M, 0);
  for (int r = 0; r < W; r++) {
    int64_t *idx = cbuf(&cl.c[r], EPD_BUF_TOPK_IDX, 1);
    for (uint32_t t = 0; t < M; t++) {
      idx[t * K] = (int64_t)((t + (uint32_t)r) % E);
      idx[t * K + 1] = -1;
    }
  }
  int64_t *bad = cbuf(&cl.c[3], EPD_BUF_TOPK_IDX, 1);
  bad[2 * K + 1] = E; /* rank 3 (node 1), token 2: expert out of range */
  for (int r = 0; r < W; r++) csubmit(&cl.c[r], EPD_OP_LL_DISPATCH, 4, 0, 1);
  for (int r = 0; r < W; r++) {
    epd_comp_t comp = cwait(&cl.c[r]);
    ASSERT_EQ(comp.status, EPD_ERR_BAD_EXPERT);
    ASSERT_EQ(comp.peer, 3);
  }
  for (int r = 0; r < W; r++) csubmit(&cl.c[r], EPD_OP_LL_COMBINE, 0, 0, 1);
  for (int r = 0; r < W; r++) ASSERT_EQ(cwait(&cl.c[r]).status, EPD_ERR_STATE);
  bad[2 * K + 1] = -1;
  for (int r = 0; r < W; r++) csubmit(&cl.c[r], EPD_OP_LL_DISPATCH, 4, 0, 1);
  for (int r = 0; r < W; r++) ASSERT_EQ(cwait(&cl.c[r]).status, EPD_OK);
  for (int r = 0; r < W; r++) csubmit(&cl.c[r], EPD_OP_LL_COMBINE, 0, 0, 1);
  for (int r = 0; r < W; r++) ASSERT_EQ(cwait(&cl.c[r]).status, EPD_OK);
  /* Ranks that disagree on the op, across nodes: EPD_ERR_MISMATCH everywhere. */
  for (int r = 0; r < W; r++) csubmit(&cl.c[r], r == 2 ? EPD_OP_HT_DISPATCH : EPD_OP_LL_DISPATCH, 4, 0, 1);
  for (int r = 0; r < W; r++) {
    epd_comp_t comp = cwait(&cl.c[r]);
    ASSERT_EQ(comp.status, EPD_ERR_MISMATCH);
    ASSERT_EQ(comp.peer, 2);
  }
  cluster_down(&cl);
}

/* ---- rendezvous with backend cuda: the world communicator's id -------------------------------------- */

#include <netinet/in.h>
#include <sys/socket.h>

#include "control/cluster.h"
#include "control/conf.h"

static atomic_int id_calls;
static int fake_comm_id(uint8_t *id, char *err, size_t errlen) {
  (void)err, (void)errlen;
  atomic_fetch_add(&id_calls, 1);
  for (int i = 0; i < EPD_CLUSTER_COMM_ID_BYTES; i++) id[i] = (uint8_t)(i * 7 + 3);
  return 0;
}
static int failing_comm_id(uint8_t *id, char *err, size_t errlen) {
  (void)id;
  snprintf(err, errlen, "no usable CUDA device (test)");
  return -1;
}

typedef struct rv_arg {
  epd_conf_t conf;
  epd_cluster_comm_id_fn fn;
  epd_net_t *net;
  uint8_t id[EPD_CLUSTER_COMM_ID_BYTES];
  int rc;
  char err[512];
} rv_arg_t;

static void *rv_main(void *p) {
  rv_arg_t *a = p;
  a->rc = epd_cluster_init(&a->conf, a->fn, &a->net, a->id, a->err, sizeof a->err);
  return NULL;
}

static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t sl = sizeof sa;
  ASSERT(fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 &&
         getsockname(fd, (struct sockaddr *)&sa, &sl) == 0);
  close(fd);
  return ntohs(sa.sin_port);
}

static void rv_conf(rv_arg_t *a, uint32_t node, int port, epd_cluster_comm_id_fn fn) {
  memset(a, 0, sizeof *a);
  epd_conf_defaults(&a->conf);
  snprintf(a->conf.backend, sizeof a->conf.backend, "cuda");
  a->conf.num_ranks = 1;
  a->conf.nodes = 2;
  a->conf.node_rank = node;
  a->conf.cluster_timeout_ms = 5000;
  snprintf(a->conf.cluster_data_listen, sizeof a->conf.cluster_data_listen, "127.0.0.1:0");
  if (node == 0)
    snprintf(a->conf.cluster_listen, sizeof a->conf.cluster_listen, "127.0.0.1:%d", port);
  else
    snprintf(a->conf.cluster_coordinator, sizeof a->conf.cluster_coordinator, "127.0.0.1:%d", port);
  a->fn = fn;
}

/* The coordinator makes the communicator id once; every node receives the same 128 bytes; a daemon
 * without CUDA refuses backend cuda by name; a coordinator that cannot make the id fails saying why. */
EPD_TEST(cluster_cuda_rendezvous_hands_out_comm_id) {
  static rv_arg_t a[2];
  int port = free_port();
  rv_conf(&a[0], 0, port, fake_comm_id);
  rv_conf(&a[1], 1, port, fake_comm_id);
  pthread_t th[2];
  for (int n = 0; n < 2; n++) pthread_create(&th[n], NULL, rv_main, &a[n]);
  for (int n = 0; n < 2; n++) pthread_join(th[n], NULL);
  for (int n = 0; n < 2; n++)
    if (a[n].rc) epd_test_fail(__FILE__, __LINE__, "node %d: %s", n, a[n].err);
  ASSERT_EQ(atomic_load(&id_calls), 1);
  for (int i = 0; i < EPD_CLUSTER_COMM_ID_BYTES; i++) {
    ASSERT_EQ(a[0].id[i], (uint8_t)(i * 7 + 3));
    ASSERT_EQ(a[1].id[i], a[0].id[i]);
  }
  for (int n = 0; n < 2; n++) epd_cluster_fini(a[n].net);

  rv_conf(&a[0], 0, free_port(), NULL);
  ASSERT_EQ(epd_cluster_init(&a[0].conf, NULL, &a[0].net, a[0].id, a[0].err, sizeof a[0].err), -1);
  ASSERT_STR_CONTAINS(a[0].err, "built without CUDA");
  rv_conf(&a[0], 0, free_port(), failing_comm_id);
  ASSERT_EQ(epd_cluster_init(&a[0].conf, failing_comm_id, &a[0].net, a[0].id, a[0].err, sizeof a[0].err), -1);
  ASSERT_STR_CONTAINS(a[0].err, "no usable CUDA device (test)");
  ASSERT(a[0].net == NULL);
}

/* The GIN status line: one text when every local rank got the same probe result, every rank's when they
 * differ (a NIC per GPU, one of them missing), and the NCCL error text kept, trimmed. */
EPD_TEST(cluster_gin_line_every_local_rank) {
  char out[1024];
  const char *none[4] = {"", "", "", ""};
  int ctx2[4] = {2, 2, 2, 2}, gdaki[4] = {3, 3, 3, 3};
  epd_gin_line(4, ctx2, gdaki, none, out, sizeof out);
  ASSERT_STR_CONTAINS(out, "available (2 contexts, GDAKI backend)");
  ASSERT_STR_CONTAINS(out, "not used: this build has no GIN stage");
  ASSERT(!strstr(out, "differs"));
  ASSERT(!strstr(out, "rank 0"));

  const char *errs[2] = {"no net plugin for GIN.\n", "no net plugin for GIN.\n"};
  int ctx0[2] = {0, 0}, refused[2] = {-1, -1};
  epd_gin_line(2, ctx0, refused, errs, out, sizeof out);
  ASSERT_STR_CONTAINS(
      out, "unavailable (NCCL refused a GIN context on the world communicator: 'no net plugin for GIN')");
  ASSERT_STR_CONTAINS(out, "no InfiniBand/RoCE NIC");

  /* rank 2 of 3 has no GIN context while 0 and 1 have one: each result once, with its ranks */
  int ctxm[3] = {1, 1, 0}, tym[3] = {2, 2, 0};
  const char *e3[3] = {"", "", ""};
  epd_gin_line(3, ctxm, tym, e3, out, sizeof out);
  ASSERT_STR_CONTAINS(
      out,
      "differs between local ranks (2 of 3 available): ranks 0,1 available (1 context, proxy "
      "backend); rank 2 unavailable (NCCL gave the world communicator no GIN context); not used");

  /* 8 GPUs, 6 and 7 refused with a long NCCL text, 3 with another backend: every group named, the text once
   */
  char longerr[300];
  memset(longerr, 'e', sizeof longerr - 1);
  longerr[sizeof longerr - 1] = 0;
  int c8[8] = {2, 2, 2, 1, 2, 2, 0, 0}, t8[8] = {3, 3, 3, 2, 3, 3, -1, -1};
  const char *e8[8] = {"", "", "", "", "", "", longerr, longerr};
  char line[2048];
  epd_gin_line(8, c8, t8, e8, line, sizeof line);
  ASSERT_STR_CONTAINS(
      line,
      "differs between local ranks (6 of 8 available): ranks 0,1,2,4,5 available (2 contexts, "
      "GDAKI backend); rank 3 available (1 context, proxy backend); ranks 6,7 unavailable (NCCL "
      "refused a GIN context on the world communicator: 'eeee");
  ASSERT(strstr(line, "eeee'); not used"));
  ASSERT_EQ(strstr(strstr(line, "eeee") + 4, "refused"), NULL); /* the NCCL text once */
  ASSERT_LT(strlen(line), 1024);

  /* cut inside the list of groups: the buffer ends there, nothing past it is written */
  char mid[120];
  memset(mid, 'x', sizeof mid);
  epd_gin_line(8, c8, t8, e8, mid, 80);
  ASSERT_EQ(strlen(mid), 79);
  ASSERT(!strcmp(mid, "differs between local ranks (6 of 8 available): ranks 0,1,2,4,5 available (2 co"));
  ASSERT_EQ(mid[100], 'x');

  /* a short buffer is cut, never overrun */
  char small[40];
  memset(small, 'x', sizeof small);
  epd_gin_line(3, ctxm, tym, e3, small, 24);
  ASSERT_EQ(strlen(small), 23);
  ASSERT_EQ(small[30], 'x');
}

/* A group removed on node 1 while node 0 steps on (its parts reach node 1, where the group is gone), then
 * node 0's clients leave too; the group made again on both nodes starts at step 0 with node 1 first: the
 * parts of later steps left from its earlier life are not taken as node 0 having skipped step 0 (the rule
 * that fails a step at once when a node's part of a later step is in; found in review). */
EPD_TEST(cluster_group_made_again_everywhere_ignores_an_earlier_lifes_parts) {
  cluster_t cl;
  cluster_up(&cl, 8, 64, 2, 4, 2);
  for (int i = 0; i < 5; i++) {
    cl_submit(&cl, 0, W, 3, 1 + (uint32_t)i);
    for (int r = 0; r < W; r++) ASSERT_EQ(cwait(&cl.c[r]).status, EPD_OK);
  }
  cl_detach(&cl, 2, 1);
  cl_detach(&cl, 3, 1);
  usleep(100000);
  for (int i = 0; i < 3; i++) { /* node 0's parts of steps 5.. go to node 1, which has no group */
    cl_submit(&cl, 0, 2, 3, 9);
    for (int r = 0; r < 2; r++) ASSERT_EQ(cwait(&cl.c[r]).status, EPD_ERR_PEER);
  }
  cl_detach(&cl, 0, 0);
  cl_detach(&cl, 1, 0);
  usleep(100000);
  for (int r = 0; r < W; r++) cluster_attach(&cl, r, 8, 64, 2, 4);
  usleep(200000);
  cl_submit(&cl, 2, 4, 3, 4); /* node 1 first */
  usleep(200000);
  cl_submit(&cl, 0, 2, 3, 4);
  for (int r = 0; r < W; r++) {
    epd_comp_t comp = cwait(&cl.c[r]);
    ASSERT_EQ(comp.status, EPD_OK);
    ASSERT_EQ(comp.step, 0u);
  }
  cluster_down(&cl);
}

/* The client of rank 3 (node 1) dies while rank 2 keeps the group there; node 0's clients then leave and
 * attach again: the group made again on node 0 hears at its creation that rank 3 has no client, and its
 * first step fails at once naming rank 3 (not after the step timeout naming rank 2; review). */
EPD_TEST(cluster_lost_rank_told_to_a_group_made_again_on_another_node) {
  cluster_t cl;
  cluster_up_stepped(&cl, 2000);
  cl_detach(&cl, 3, 1);
  cl_detach(&cl, 0, 0);
  cl_detach(&cl, 1, 0);
  usleep(100000);
  cluster_attach(&cl, 0, 8, 64, 2, 4);
  cluster_attach(&cl, 1, 8, 64, 2, 4);
  usleep(200000);
  const uint64_t t0 = ms_now();
  cl_submit(&cl, 0, 2, 3, 4);
  for (int r = 0; r < 2; r++) {
    epd_comp_t comp = cwait(&cl.c[r]);
    ASSERT_EQ(comp.status, EPD_ERR_PEER);
    ASSERT_EQ(comp.peer, 3);
  }
  ASSERT_LT(ms_now() - t0, 1500u);
  cluster_down(&cl);
}
