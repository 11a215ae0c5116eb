/*
 * test_cnet.c - the CUDA inter-node stage's step programs (daemon/cnet_plan.c) run on the CPU: the
 * kernels emulated over host memory, ncclSend/ncclRecv emulated by copies between the rail peers of
 * every node pair. For 2 and 3 nodes of 1 and 2 ranks, LL and HT, BF16 and FP8, skewed routing, an
 * empty rank, a node out of the step (its ranks masked: no rows to or from it): every receive buffer
 * must equal the single-world reference byte for byte, OUT within BF16 rounding of it, each token must
 * cross to a node exactly once however many of its ranks it goes to, and an FP8 dispatch must cross as
 * FP8 (quantised before the exchange).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cnet_plan.h"
#include "core/ref.h"
#include "test.h"

#define MAXW 8

typedef struct rank_mem {
  uint16_t *x, *y, *out, *ref_out;
  int64_t *idx;
  float *w;
  epd_ref_out_t got, want; /* LL or HT receive buffers */
  uint8_t *xsend[MAXW], *xrecv[MAXW], *psend[MAXW], *precv[MAXW];
} rank_mem_t;

static void *zalloc(size_t n) {
  void *p = calloc(1, n ? n : 1);
  ASSERT(p);
  return p;
}

static void alloc_out(epd_ref_out_t *o, const epd_ref_geom_t *g, int mode) {
  size_t W = g->num_ranks, M = g->max_tokens, H = g->hidden, S = g->slots_per_rank, C = g->ht_capacity,
         K = g->topk, nb = epd_ref_scale_blocks(g->hidden);
  size_t rows = mode == EPD_MODE_LL ? S * W * M : C;
  o->recv_x = zalloc(rows * H * 2);
  o->recv_scales = zalloc(rows * nb * 4);
  o->recv_count = zalloc(S * 4);
  o->recv_src = zalloc(rows * 4);
  if (mode == EPD_MODE_HT) {
    o->recv_topk_idx = zalloc(C * K * 8);
    o->recv_topk_weights = zalloc(C * K * 4);
  }
}

static void free_out(epd_ref_out_t *o) {
  free(o->recv_x);
  free(o->recv_scales);
  free(o->recv_count);
  free(o->recv_src);
  free(o->recv_topk_idx);
  free(o->recv_topk_weights);
}

/* Every rank of node n is in mask. */
static int node_out(uint64_t mask, uint32_t n, uint32_t L) {
  const uint64_t all = (1ull << L) - 1;
  return (mask >> (n * L) & all) == all;
}

/* mask: world ranks out of the step (masked): no tokens of theirs, their experts' entries dropped; a node
 * whose ranks are all masked gets no rows and sends none (its place on the world communicator may be
 * gone: a world made again without it). */
static void run_case(uint32_t nodes, uint32_t L, int mode, int fp8, int skew, uint64_t seed, uint64_t mask) {
  uint32_t W = nodes * L;
  ASSERT(W <= MAXW);
  epd_ref_geom_t g = {.num_ranks = W,
                      .num_experts = 16,
                      .hidden = 256,
                      .topk = 4,
                      .max_tokens = 24,
                      .slots_per_rank = (16 + W - 1) / W,
                      .ht_capacity = W * 24};
  uint32_t M = g.max_tokens, H = g.hidden, K = g.topk, S = g.slots_per_rank, nb = epd_ref_scale_blocks(H);
  epd_expert_map_t map;
  ASSERT_OK(epd_ref_map_default(&map, g.num_experts, W, S));
  map.ranks_per_node = L;
  if (mask) {
    epd_expert_map_t full = map;
    ASSERT_OK(epd_ref_map_mask(&map, &full, mask));
    epd_expert_map_free(&full);
  }
  rank_mem_t m[MAXW];
  epd_ref_in_t in[MAXW];
  memset(m, 0, sizeof m);
  uint64_t rs = seed;
  for (uint32_t r = 0; r < W; r++) {
    uint32_t T = r == 1 ? 0 : M - (uint32_t)(epd_ref_rand(&rs) % 5); /* rank 1 sends nothing */
    if (mask >> r & 1) T = 0;
    m[r].x = zalloc((size_t)M * H * 2);
    m[r].idx = zalloc((size_t)M * K * 8);
    m[r].w = zalloc((size_t)M * K * 4);
    epd_ref_gen_input(seed, 0, r, &g, T, skew, m[r].x, m[r].idx, m[r].w);
    in[r] = (epd_ref_in_t){T, m[r].x, m[r].idx, m[r].w};
    alloc_out(&m[r].got, &g, mode);
    alloc_out(&m[r].want, &g, mode);
    /* poison: a row the stage forgets to write shows */
    size_t rows = mode == EPD_MODE_LL ? (size_t)S * W * M : g.ht_capacity;
    memset(m[r].got.recv_x, 0xa5, rows * H * 2);
    memset(m[r].got.recv_src, 0xa5, rows * 4);
    for (uint32_t n = 0; n < nodes; n++) {
      m[r].xsend[n] = zalloc((size_t)M * H * 2);
      m[r].xrecv[n] = zalloc((size_t)M * H * 2);
      m[r].psend[n] = zalloc((size_t)M * H * 4);
      m[r].precv[n] = zalloc((size_t)M * H * 4);
    }
    size_t yrows = mode == EPD_MODE_LL ? (size_t)S * W * M : g.ht_capacity;
    m[r].y = zalloc(yrows * H * 2);
    m[r].out = zalloc((size_t)M * H * 2);
    m[r].ref_out = zalloc((size_t)M * H * 2);
    memset(m[r].out, 0xa5, (size_t)M * H * 2);
  }
  epd_ref_plan_t plan, rplan;
  ASSERT_OK(epd_ref_plan_init(&plan, &g));
  ASSERT_OK(epd_ref_plan_init(&rplan, &g));
  int bad = -1;
  char why[256];
  ASSERT_OK(epd_ref_plan_build(&plan, &map, in, &bad, why, sizeof why));
  ASSERT_OK(epd_ref_plan_build(&rplan, &map, in, &bad, why, sizeof why));
  epd_ref_out_t *wo[MAXW];
  for (uint32_t r = 0; r < W; r++) wo[r] = &m[r].want;
  if (mode == EPD_MODE_LL)
    ASSERT_OK(epd_ref_ll_dispatch(&rplan, in, fp8, wo));
  else
    ASSERT_OK(epd_ref_ht_dispatch(&rplan, in, fp8, wo, &bad));

  /* addresses of each node's ranks */
  static cnet_addr_t addr[MAXW][MAXW]; /* [node][l] */
  memset(addr, 0, sizeof addr);
  for (uint32_t n = 0; n < nodes; n++)
    for (uint32_t l = 0; l < L; l++) {
      rank_mem_t *rm = &m[n * L + l];
      cnet_addr_t *a = &addr[n][l];
      a->buf[EPD_BUF_X] = (uintptr_t)rm->x;
      a->buf[EPD_BUF_OUT] = (uintptr_t)rm->out;
      if (mode == EPD_MODE_LL) {
        a->buf[EPD_BUF_LL_RECV_X] = (uintptr_t)rm->got.recv_x;
        a->buf[EPD_BUF_LL_RECV_SCALES] = (uintptr_t)rm->got.recv_scales;
        a->buf[EPD_BUF_LL_RECV_COUNT] = (uintptr_t)rm->got.recv_count;
        a->buf[EPD_BUF_LL_RECV_SRC] = (uintptr_t)rm->got.recv_src;
        a->buf[EPD_BUF_LL_Y] = (uintptr_t)rm->y;
      } else {
        a->buf[EPD_BUF_HT_RECV_X] = (uintptr_t)rm->got.recv_x;
        a->buf[EPD_BUF_HT_RECV_SCALES] = (uintptr_t)rm->got.recv_scales;
        a->buf[EPD_BUF_HT_RECV_COUNT] = (uintptr_t)rm->got.recv_count;
        a->buf[EPD_BUF_HT_RECV_SRC] = (uintptr_t)rm->got.recv_src;
        a->buf[EPD_BUF_HT_RECV_TOPK_IDX] = (uintptr_t)rm->got.recv_topk_idx;
        a->buf[EPD_BUF_HT_RECV_TOPK_WEIGHTS] = (uintptr_t)rm->got.recv_topk_weights;
        a->buf[EPD_BUF_HT_Y] = (uintptr_t)rm->y;
      }
      for (uint32_t p = 0; p < nodes; p++) {
        a->xsend[p] = (uintptr_t)rm->xsend[p];
        a->xrecv[p] = (uintptr_t)rm->xrecv[p];
        a->psend[p] = (uintptr_t)rm->psend[p];
        a->precv[p] = (uintptr_t)rm->precv[p];
      }
    }
  static cnet_prog_t pg[MAXW];
  memset(pg, 0, sizeof pg);

  /* ---- dispatch ---- */
  for (uint32_t n = 0; n < nodes; n++) {
    ASSERT_OK(cnet_build_dispatch(&pg[n], &plan, nodes, n, L, mode, fp8, addr[n]));
    for (uint32_t l = 0; l < L; l++) cnet_exec_rows(&pg[n].side[l].pre_rows, H, fp8);
  }
  /* once per (token, remote node): count the distinct pairs independently */
  uint64_t pairs = 0, sent = 0;
  for (uint32_t src = 0; src < W; src++)
    for (uint32_t t = 0; t < in[src].num_tokens; t++)
      for (uint32_t n = 0; n < nodes; n++) {
        if (n == src / L) continue;
        int hit = 0;
        for (uint32_t k = 0; k < K; k++) {
          int32_t d = plan.dst_rank[((size_t)src * M + t) * K + k];
          hit |= d >= 0 && (uint32_t)d / L == n;
        }
        pairs += hit;
      }
  for (uint32_t n = 0; n < nodes; n++)
    for (uint32_t l = 0; l < L; l++)
      for (uint32_t p = 0; p < nodes; p++) {
        if (p == n) continue;
        uint32_t cnt = pg[n].side[l].send_rows[p];
        ASSERT_EQ(cnt, pg[p].side[l].recv_rows[n]);
        if (node_out(mask, p, L) || node_out(mask, n, L)) ASSERT_EQ(cnt, 0u); /* no rows to or from it */
        memcpy(m[p * L + l].xrecv[n], m[n * L + l].xsend[p], (size_t)cnt * pg[n].row_bytes);
        sent += cnt;
      }
  ASSERT_EQ(sent, pairs);
  /* FP8 crosses as FP8: H bytes and H/128 scales per row instead of 2H bytes */
  ASSERT_EQ(pg[0].row_bytes, fp8 ? cnet_fp8_row_bytes(H) : (size_t)H * 2);
  if (fp8) ASSERT_LT(pg[0].row_bytes * 10, (size_t)H * 2 * 6);
  ASSERT_GT(pairs, 0);
  for (uint32_t n = 0; n < nodes; n++)
    for (uint32_t l = 0; l < L; l++) {
      cnet_exec_rows(&pg[n].side[l].post_rows, H, fp8);
      cnet_exec_puts(&pg[n].side[l].puts);
    }
  size_t xb = fp8 ? H : (size_t)H * 2;
  for (uint32_t r = 0; r < W; r++) {
    const epd_ref_out_t *a = &m[r].got, *b = &m[r].want;
    ASSERT_EQ(memcmp(a->recv_count, b->recv_count, (size_t)S * 4), 0);
    uint32_t nrecv = mode == EPD_MODE_LL ? plan.ll_recv[r] : plan.ht_recv[r];
    ASSERT_EQ(pg[r / L].side[r % L].num_recv, nrecv);
    for (uint32_t s = 0; s < (mode == EPD_MODE_LL ? S : 1); s++) {
      uint32_t cnt = mode == EPD_MODE_LL ? (uint32_t)b->recv_count[s] : nrecv;
      for (uint32_t j = 0; j < cnt; j++) {
        size_t row = mode == EPD_MODE_LL ? (size_t)s * W * M + j : j;
        if (memcmp((uint8_t *)a->recv_x + row * H * 2, (uint8_t *)b->recv_x + row * H * 2, xb))
          epd_test_fail(__FILE__, __LINE__, "rank %u slot %u row %u: recv_x differs", r, s, j);
        if (fp8) ASSERT_EQ(memcmp(a->recv_scales + row * nb, b->recv_scales + row * nb, (size_t)nb * 4), 0);
        ASSERT_EQ(a->recv_src[row], b->recv_src[row]);
        if (mode == EPD_MODE_HT) {
          ASSERT_EQ(memcmp(a->recv_topk_idx + row * K, b->recv_topk_idx + row * K, (size_t)K * 8), 0);
          ASSERT_EQ(memcmp(a->recv_topk_weights + row * K, b->recv_topk_weights + row * K, (size_t)K * 4), 0);
        }
      }
    }
  }

  /* ---- combine: the expert outputs are random BF16 rows ---- */
  for (uint32_t r = 0; r < W; r++) {
    size_t yrows = mode == EPD_MODE_LL ? (size_t)S * W * M : g.ht_capacity;
    for (size_t i = 0; i < yrows * H; i++)
      m[r].y[i] = epd_f32_to_bf16((float)(epd_ref_rand(&rs) >> 40) / (float)(1 << 24) * 4.0f - 2.0f);
  }
  const uint16_t *ys[MAXW];
  uint16_t *ro[MAXW];
  for (uint32_t r = 0; r < W; r++) {
    ys[r] = m[r].y;
    ro[r] = m[r].ref_out;
  }
  if (mode == EPD_MODE_LL)
    ASSERT_OK(epd_ref_ll_combine(&rplan, ys, ro));
  else
    ASSERT_OK(epd_ref_ht_combine(&rplan, ys, ro));
  for (uint32_t n = 0; n < nodes; n++) {
    ASSERT_OK(cnet_build_combine(&pg[n], &plan, nodes, n, L, mode, addr[n]));
    for (uint32_t l = 0; l < L; l++)
      cnet_exec_wsum(&pg[n].side[l].pre_off, &pg[n].side[l].pre_terms, &pg[n].side[l].pre_out, H, 1);
  }
  for (uint32_t n = 0; n < nodes; n++)
    for (uint32_t l = 0; l < L; l++)
      for (uint32_t p = 0; p < nodes; p++) {
        if (p == n) continue;
        uint32_t cnt = pg[n].side[l].send_rows[p];
        ASSERT_EQ(cnt, pg[p].side[l].recv_rows[n]);
        if (node_out(mask, p, L) || node_out(mask, n, L)) ASSERT_EQ(cnt, 0u); /* no rows to or from it */
        memcpy(m[p * L + l].precv[n], m[n * L + l].psend[p], (size_t)cnt * pg[n].row_bytes);
      }
  for (uint32_t n = 0; n < nodes; n++)
    for (uint32_t l = 0; l < L; l++)
      cnet_exec_wsum(&pg[n].side[l].post_off, &pg[n].side[l].post_terms, &pg[n].side[l].post_out, H, 0);
  for (uint32_t r = 0; r < W; r++)
    for (size_t i = 0; i < (size_t)in[r].num_tokens * H; i++) {
      float a = epd_bf16_to_f32(m[r].out[i]), b = epd_bf16_to_f32(m[r].ref_out[i]);
      if (!(fabsf(a - b) <= 0.01f * fabsf(b) + 0.02f))
        epd_test_fail(__FILE__, __LINE__, "rank %u OUT[%zu][%zu] = %g, reference %g", r, i / H, i % H, a, b);
    }

  for (uint32_t n = 0; n < nodes; n++) cnet_prog_free(&pg[n]);
  for (uint32_t r = 0; r < W; r++) {
    free(m[r].x), free(m[r].idx), free(m[r].w), free(m[r].y), free(m[r].out), free(m[r].ref_out);
    free_out(&m[r].got);
    free_out(&m[r].want);
    for (uint32_t n = 0; n < nodes; n++)
      free(m[r].xsend[n]), free(m[r].xrecv[n]), free(m[r].psend[n]), free(m[r].precv[n]);
  }
  epd_ref_plan_free(&plan);
  epd_ref_plan_free(&rplan);
  epd_expert_map_free(&map);
}

EPD_TEST(cnet_ll_two_nodes_one_gpu) {
  run_case(2, 1, EPD_MODE_LL, 0, 0, 1, 0);
  run_case(2, 1, EPD_MODE_LL, 1, 1, 2, 0);
}
EPD_TEST(cnet_ll_two_nodes_two_gpus) {
  run_case(2, 2, EPD_MODE_LL, 0, 1, 3, 0);
  run_case(2, 2, EPD_MODE_LL, 1, 0, 4, 0);
}
EPD_TEST(cnet_ll_three_nodes) {
  run_case(3, 1, EPD_MODE_LL, 1, 1, 5, 0);
  run_case(3, 2, EPD_MODE_LL, 0, 0, 6, 0);
}
EPD_TEST(cnet_ht_nodes) {
  run_case(2, 1, EPD_MODE_HT, 0, 1, 7, 0);
  run_case(2, 2, EPD_MODE_HT, 1, 0, 8, 0);
  run_case(3, 2, EPD_MODE_HT, 0, 1, 9, 0);
}
EPD_TEST(cnet_node_out_of_the_step) {
  run_case(3, 1, EPD_MODE_LL, 0, 1, 10, 1ull << 2);             /* node 2 lost */
  run_case(3, 2, EPD_MODE_LL, 1, 0, 11, 3ull << 4);             /* node 2's two ranks */
  run_case(3, 2, EPD_MODE_HT, 0, 1, 12, 3ull << 2);             /* node 1, between the others */
  run_case(3, 2, EPD_MODE_HT, 1, 1, 13, 1ull << 1 | 3ull << 4); /* node 2, and one rank of node 0 */
}
EPD_TEST(cnet_refuses_bad_geometry) {
  epd_ref_geom_t g = {.num_ranks = 4,
                      .num_experts = 8,
                      .hidden = 256,
                      .topk = 2,
                      .max_tokens = 4,
                      .slots_per_rank = 2,
                      .ht_capacity = 16};
  epd_ref_plan_t p;
  ASSERT_OK(epd_ref_plan_init(&p, &g));
  cnet_prog_t pg;
  memset(&pg, 0, sizeof pg);
  cnet_addr_t a[4];
  memset(a, 0, sizeof a);
  ASSERT_EQ(cnet_build_dispatch(&pg, &p, 3, 0, 1, EPD_MODE_LL, 0, a), EPD_ERR_INVALID); /* 3 x 1 != 4 ranks */
  ASSERT_EQ(cnet_build_dispatch(&pg, &p, 2, 2, 2, EPD_MODE_LL, 0, a),
            EPD_ERR_INVALID);                                                       /* node out of range */
  ASSERT_EQ(cnet_build_combine(&pg, &p, 1, 0, 4, EPD_MODE_LL, a), EPD_ERR_INVALID); /* one node */
  cnet_prog_free(&pg);
  epd_ref_plan_free(&p);
}
