/*
 * test_ref.c - properties of the reference dispatch/combine (daemon/ref.c) on random inputs: every
 * valid (t, k) delivered exactly once in contract order, counts, combine = weighted sum, HT dedup and
 * overflow, FP8 round trip, -1 and duplicate entries, skew, zero and max tokens, bad ids, map checks.
 */
#include <math.h>

#include "core/ref.h"
#include "test.h"

#define POISON 0xa5

typedef struct world {
  epd_ref_geom_t g;
  epd_expert_map_t map;
  epd_ref_plan_t plan;
  uint16_t *x[EPD_MAX_RANKS];
  int64_t *idx[EPD_MAX_RANKS];
  float *w[EPD_MAX_RANKS];
  epd_ref_in_t in[EPD_MAX_RANKS];
  epd_ref_out_t outs[EPD_MAX_RANKS];
  epd_ref_out_t *out[EPD_MAX_RANKS];
  uint16_t *y[EPD_MAX_RANKS], *o[EPD_MAX_RANKS];
} world_t;

static void *poisoned(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  ASSERT(p);
  memset(p, POISON, bytes);
  return p;
}

static void world_init(world_t *w, uint32_t R, uint32_t E, uint32_t H, uint32_t K, uint32_t M, uint32_t S,
                       uint32_t C, int ht) {
  memset(w, 0, sizeof *w);
  w->g = (epd_ref_geom_t){R, E, H, K, M, S, C};
  ASSERT_OK(epd_ref_map_default(&w->map, E, R, S));
  ASSERT_OK(epd_ref_plan_init(&w->plan, &w->g));
  size_t nb = epd_ref_scale_blocks(H);
  size_t rows = ht ? C : (size_t)S * R * M;
  for (uint32_t r = 0; r < R; r++) {
    w->x[r] = poisoned((size_t)M * H * 2);
    w->idx[r] = poisoned((size_t)M * K * 8);
    w->w[r] = poisoned((size_t)M * K * 4);
    w->in[r] = (epd_ref_in_t){0, w->x[r], w->idx[r], w->w[r]};
    w->outs[r].recv_x = poisoned(rows * H * 2);
    w->outs[r].recv_scales = poisoned(rows * nb * 4);
    w->outs[r].recv_count = poisoned((size_t)S * 4);
    w->outs[r].recv_src = poisoned(rows * 4);
    if (ht) {
      w->outs[r].recv_topk_idx = poisoned(rows * K * 8);
      w->outs[r].recv_topk_weights = poisoned(rows * K * 4);
    }
    w->out[r] = &w->outs[r];
    w->y[r] = poisoned(rows * H * 2);
    w->o[r] = poisoned((size_t)M * H * 2);
  }
}

static void world_gen(world_t *w, uint64_t seed, const uint32_t *T, int skew) {
  for (uint32_t r = 0; r < w->g.num_ranks; r++) {
    w->in[r].num_tokens = T[r];
    epd_ref_gen_input(seed, 0, r, &w->g, T[r], skew, w->x[r], w->idx[r], w->w[r]);
  }
}

/* Unique valid entries of a token: 1 where (t, k) counts (not -1, not a duplicate of an earlier k). */
static int entry_valid(const int64_t *row, uint32_t k) {
  if (row[k] < 0) return 0;
  for (uint32_t k2 = 0; k2 < k; k2++)
    if (row[k2] == row[k]) return 0;
  return 1;
}

static int bf16_close(uint16_t a, float b, float rel) {
  float fa = epd_bf16_to_f32(a);
  return fabsf(fa - b) <= rel * fabsf(b) + 1e-2f;
}

EPD_TEST(ref_bf16_conversion) {
  ASSERT_EQ(epd_f32_to_bf16(1.0f), 0x3f80);
  ASSERT_EQ(epd_f32_to_bf16(-2.0f), 0xc000);
  /* 1 + 2^-8 is a tie between 1 and 1 + 2^-7: to even (1). 1 + 3*2^-8 ties up to 1 + 2^-6. */
  ASSERT_EQ(epd_f32_to_bf16(1.0f + 1.0f / 256), 0x3f80);
  ASSERT_EQ(epd_f32_to_bf16(1.0f + 3.0f / 256), 0x3f82);
  ASSERT(isnan(epd_bf16_to_f32(epd_f32_to_bf16(NAN))));
  for (uint32_t b = 0; b < 0x10000; b++) {
    float f = epd_bf16_to_f32((uint16_t)b);
    if (!isnan(f)) ASSERT_EQ(epd_f32_to_bf16(f), b);
  }
}

EPD_TEST(ref_e4m3_conversion) {
  /* Every finite encoding decodes and re-encodes to itself. */
  for (int b = 0; b < 256; b++) {
    if ((b & 0x7f) == 0x7f) {
      ASSERT(isnan(epd_e4m3_to_f32((uint8_t)b)));
      continue;
    }
    float f = epd_e4m3_to_f32((uint8_t)b);
    if (b == 0x80) continue; /* -0 encodes as 0x80 too, checked below */
    ASSERT_EQ(epd_f32_to_e4m3(f), b);
  }
  ASSERT_EQ(epd_f32_to_e4m3(-0.0f), 0x80);
  ASSERT_NEAR(epd_e4m3_to_f32(0x7e), 448.0, 0);
  ASSERT_NEAR(epd_e4m3_to_f32(0x01), 1.0 / 512, 0);
  ASSERT_EQ(epd_f32_to_e4m3(1000.0f), 0x7e); /* satfinite */
  ASSERT_EQ(epd_f32_to_e4m3(-INFINITY), 0xfe);
  ASSERT_EQ(epd_f32_to_e4m3(NAN), 0x7f);
  ASSERT_EQ(epd_f32_to_e4m3(464.0f), 0x7e); /* rounds to 480 without saturation */
  /* Ties to even: 1.0625 is between 1 (mantissa 0) and 1.125 (mantissa 1) -> 1. */
  ASSERT_EQ(epd_f32_to_e4m3(1.0625f), 0x38);
  ASSERT_EQ(epd_f32_to_e4m3(1.1875f), 0x3a);     /* between 1.125 and 1.25 -> 1.25 (even) */
  ASSERT_EQ(epd_f32_to_e4m3(3.0f / 1024), 0x02); /* subnormal tie 1.5 * 2^-9 -> 2 * 2^-9 */
  /* Round trip error of quantised rows stays within half an e4m3 ulp (relative 2^-4) of the scale. */
  uint64_t st = 7;
  uint16_t x[256];
  uint8_t q[256];
  float sc[2];
  for (int it = 0; it < 50; it++) {
    float mag = (float)ldexp(1.0, (int)(epd_ref_rand(&st) % 20) - 10);
    for (int i = 0; i < 256; i++)
      x[i] = epd_f32_to_bf16(mag * ((float)(epd_ref_rand(&st) % 20001) / 10000.0f - 1.0f));
    epd_ref_quant_row(x, 256, q, sc);
    for (int i = 0; i < 256; i++) {
      float v = epd_bf16_to_f32(x[i]), d = epd_e4m3_to_f32(q[i]) * sc[i / 128];
      ASSERT(fabsf(d - v) <= fabsf(v) / 16 + sc[i / 128] / 1024 + 1e-30f);
    }
  }
}

/* NaN values do not take part in a group's amax, signalling ones included (glibc's fmaxf returns NaN for
 * those, after which the next value would replace the max), as in the kernels; a group of NaNs alone gets
 * the smallest scale. */
EPD_TEST(ref_quant_nan_in_group) {
  uint16_t x[256];
  uint8_t q[256];
  float sc[2];
  for (int i = 0; i < 256; i++) x[i] = epd_f32_to_bf16(i < 128 ? 1.0f : 2.0f);
  x[0] = epd_f32_to_bf16(1000.0f);
  x[1] = 0x7f81;                                 /* signalling NaN */
  x[2] = 0xffc0;                                 /* quiet NaN, negative */
  for (int i = 128; i < 256; i++) x[i] = 0x7fa0; /* second group: signalling NaNs only */
  epd_ref_quant_row(x, 256, q, sc);
  const float want[2] = {1000.0f / 448.0f, 1e-4f / 448.0f};
  ASSERT(memcmp(sc, want, sizeof want) == 0);
  ASSERT_EQ(q[0], 0x7e);
  ASSERT_EQ(q[1], 0x7f);
  ASSERT_EQ(q[2], 0x7f);
  ASSERT_EQ(q[128], 0x7f);
}

/* The special-value groups the FP8 tests feed the kernels: every pattern occurs, and the reference
 * quantises each as SEMANTICS.md says (NaN -> 0x7f, an infinite amax -> infinite scale and signed zeros,
 * the 1e-4 floor, every finite byte within half an e4m3 step of x / scale). */
EPD_TEST(ref_specials_patterns) {
  enum { T = 900, H = 512 };
  epd_ref_geom_t g = {
      .num_ranks = 2, .num_experts = 16, .hidden = H, .topk = 4, .max_tokens = T, .slots_per_rank = 8};
  uint16_t *x0 = malloc((size_t)T * H * 2), *x = malloc((size_t)T * H * 2);
  int64_t *idx = malloc((size_t)T * 4 * 8);
  float *w = malloc((size_t)T * 4 * 4);
  epd_ref_gen_input(3, 1, 1, &g, T, 0, x0, idx, w);
  memcpy(x, x0, (size_t)T * H * 2);
  epd_ref_gen_specials(3, 1, 1, T, H, x);
  int seen[EPD_REF_SPECIALS] = {0}, changed_tokens = 0;
  const float floor_scale = 1e-4f / 448.0f;
  for (uint32_t t = 0; t < T; t++) {
    int groups = 0;
    for (uint32_t b = 0; b < H / 128; b++) {
      const uint16_t *v = x + (size_t)t * H + b * 128;
      if (!memcmp(v, x0 + (size_t)t * H + b * 128, 256)) continue;
      groups++;
      uint8_t q[128];
      float sc;
      epd_ref_quant_row(v, 128, q, &sc);
      int nan = 0, pinf = 0, ninf = 0, zero = 0, sub = 0, one = 0;
      float amax = 0;
      for (int i = 0; i < 128; i++) {
        float f = epd_bf16_to_f32(v[i]);
        if (isnan(f))
          nan++;
        else if (isinf(f))
          f > 0 ? pinf++ : ninf++;
        else {
          amax = fmaxf(amax, fabsf(f));
          zero += f == 0;
          sub += f != 0 && (v[i] & 0x7f80) == 0;
          one += fabsf(f) == 1.0f;
        }
      }
      if (nan == 128)
        seen[5]++;
      else if (pinf && ninf)
        seen[3]++;
      else if (pinf)
        seen[2]++;
      else if (nan)
        seen[4]++;
      else if (zero == 128)
        seen[0]++;
      else if (zero + sub == 128)
        seen[1]++;
      else if (amax >= 0x1p100f)
        seen[7]++;
      else if (one == 1 && amax == 1.0f)
        seen[8]++;
      else if (amax < 2e-4f)
        seen[6]++;
      else
        epd_test_fail(__FILE__, __LINE__, "token %u group %u: a changed group of no pattern", t, b);
      if (pinf || ninf)
        ASSERT(isinf(sc) && sc > 0);
      else
        ASSERT(memcmp(&sc, &(float){fmaxf(amax, 1e-4f) / 448.0f}, 4) == 0);
      if (amax < 1e-4f && !pinf && !ninf) ASSERT(memcmp(&sc, &floor_scale, 4) == 0);
      for (int i = 0; i < 128; i++) {
        float f = epd_bf16_to_f32(v[i]);
        if (isnan(f) || isinf(f)) {
          if (q[i] != 0x7f)
            epd_test_fail(__FILE__, __LINE__, "token %u group %u value %04x: byte %02x, want 0x7f", t, b,
                          v[i], q[i]);
        } else if (isinf(sc)) {
          ASSERT_EQ(q[i], signbit(f) ? 0x80 : 0x00);
        } else {
          float got = epd_e4m3_to_f32(q[i]) * sc, step = fmaxf(ldexpf(fabsf(f), -4), ldexpf(sc, -10));
          if (!(fabsf(got - f) <= step * 1.0001f) || (f != 0 && signbit(got) != signbit(f) && got != 0))
            epd_test_fail(__FILE__, __LINE__, "token %u group %u value %g: byte %02x gives %g", t, b, f, q[i],
                          got);
        }
      }
    }
    ASSERT(groups <= 1);
    changed_tokens += groups;
  }
  ASSERT(changed_tokens > T / 4 && changed_tokens < T / 2);
  for (int p = 0; p < EPD_REF_SPECIALS; p++)
    if (!seen[p]) epd_test_fail(__FILE__, __LINE__, "pattern %d never generated", p);
  free(x0);
  free(x);
  free(idx);
  free(w);
}

/* LL: every valid (src, t, k) delivered once to dest(t, k), in (src, t) order, rows intact. */
static void check_ll(world_t *w, int fp8) {
  const epd_ref_geom_t *g = &w->g;
  uint32_t R = g->num_ranks, M = g->max_tokens, K = g->topk, S = g->slots_per_rank, H = g->hidden;
  uint32_t nb = epd_ref_scale_blocks(H);
  ASSERT_OK(epd_ref_plan_build(&w->plan, &w->map, w->in, &(int){0}, (char[128]){0}, 128));
  ASSERT_OK(epd_ref_ll_dispatch(&w->plan, w->in, fp8, w->out));
  uint64_t expected = 0, seen = 0;
  int *found = calloc((size_t)R * M * K, sizeof(int));
  for (uint32_t src = 0; src < R; src++)
    for (uint32_t t = 0; t < w->in[src].num_tokens; t++)
      for (uint32_t k = 0; k < K; k++) expected += entry_valid(w->idx[src] + (size_t)t * K, k);
  for (uint32_t r = 0; r < R; r++) {
    for (uint32_t s = 0; s < S; s++) {
      int32_t cnt = w->outs[r].recv_count[s];
      ASSERT_GE(cnt, 0);
      ASSERT_LE(cnt, (int32_t)(R * M));
      int32_t prev = -1;
      for (int32_t j = 0; j < cnt; j++) {
        size_t row = (size_t)s * R * M + j;
        int32_t v = w->outs[r].recv_src[row];
        uint32_t src = (uint32_t)EPD_SRC_RANK(v), t = (uint32_t)EPD_SRC_TOKEN(v);
        ASSERT_LT(src, R);
        ASSERT_LT(t, w->in[src].num_tokens);
        ASSERT_GT(v, prev); /* strictly increasing (src, t): one entry per token and slot */
        prev = v;
        int hits = 0;
        for (uint32_t k = 0; k < K; k++) {
          const int64_t *ir = w->idx[src] + (size_t)t * K;
          if (!entry_valid(ir, k)) continue;
          epd_replica_t d = epd_ref_map_dest(&w->map, M, src, t, (uint32_t)ir[k]);
          if (d.rank == r && d.slot == s) {
            hits++;
            found[((size_t)src * M + t) * K + k]++;
          }
        }
        ASSERT_EQ(hits, 1);
        seen++;
        const uint16_t *xr = w->x[src] + (size_t)t * H;
        if (!fp8) {
          ASSERT(!memcmp((uint8_t *)w->outs[r].recv_x + row * H * 2, xr, (size_t)H * 2));
        } else {
          const uint8_t *q = (uint8_t *)w->outs[r].recv_x + row * H * 2;
          for (uint32_t h = 0; h < H; h++) {
            float sc = w->outs[r].recv_scales[row * nb + h / 128], xv = epd_bf16_to_f32(xr[h]);
            ASSERT(fabsf(epd_e4m3_to_f32(q[h]) * sc - xv) <= fabsf(xv) / 16 + sc / 1024);
          }
        }
      }
      /* Rows past the count stay untouched. */
      if ((uint32_t)cnt < R * M)
        ASSERT_EQ(((uint8_t *)w->outs[r].recv_src)[((size_t)s * R * M + cnt) * 4], POISON);
    }
  }
  ASSERT_EQ(seen, expected);
  for (uint32_t src = 0; src < R; src++)
    for (uint32_t t = 0; t < w->in[src].num_tokens; t++)
      for (uint32_t k = 0; k < K; k++)
        ASSERT_EQ(found[((size_t)src * M + t) * K + k], entry_valid(w->idx[src] + (size_t)t * K, k));
  free(found);
}

/* LL combine with experts y = scale(slot) * x: out[t] = sum of w * scale * x over valid entries. */
static void check_ll_combine(world_t *w) {
  const epd_ref_geom_t *g = &w->g;
  uint32_t R = g->num_ranks, M = g->max_tokens, K = g->topk, S = g->slots_per_rank, H = g->hidden;
  for (uint32_t r = 0; r < R; r++)
    for (uint32_t s = 0; s < S; s++)
      for (int32_t j = 0; j < w->outs[r].recv_count[s]; j++) {
        size_t row = (size_t)s * R * M + j;
        const uint16_t *xr = (const uint16_t *)w->outs[r].recv_x + row * H;
        for (uint32_t h = 0; h < H; h++)
          w->y[r][row * H + h] = epd_f32_to_bf16(epd_bf16_to_f32(xr[h]) * (1.0f + 0.25f * (float)(s % 4)));
      }
  ASSERT_OK(epd_ref_ll_combine(&w->plan, (const uint16_t *const *)w->y, w->o));
  for (uint32_t src = 0; src < R; src++)
    for (uint32_t t = 0; t < w->in[src].num_tokens; t++)
      for (uint32_t h = 0; h < H; h++) {
        float want = 0;
        const int64_t *ir = w->idx[src] + (size_t)t * K;
        for (uint32_t k = 0; k < K; k++) {
          if (!entry_valid(ir, k)) continue;
          epd_replica_t d = epd_ref_map_dest(&w->map, M, src, t, (uint32_t)ir[k]);
          want += w->w[src][(size_t)t * K + k] * (1.0f + 0.25f * (float)(d.slot % 4)) *
                  epd_bf16_to_f32(w->x[src][(size_t)t * H + h]);
        }
        ASSERT(bf16_close(w->o[src][(size_t)t * H + h], want, 1.0f / 64));
      }
}

EPD_TEST(ref_ll_dispatch_combine_random) {
  for (uint64_t seed = 1; seed <= 4; seed++) {
    world_t w;
    world_init(&w, 4, 16, 64, 4, 24, 4, 96, 0);
    uint32_t T[4] = {24, 7, 0, 19};
    world_gen(&w, seed, T, 0);
    check_ll(&w, 0);
    check_ll_combine(&w);
  }
}

EPD_TEST(ref_ll_fp8) {
  world_t w;
  world_init(&w, 2, 8, 256, 3, 16, 4, 32, 0);
  uint32_t T[2] = {16, 11};
  world_gen(&w, 42, T, 0);
  check_ll(&w, 1);
  ASSERT_EQ(epd_ref_ll_dispatch(&w.plan, w.in, 1, w.out), EPD_OK);
  /* FP8 needs hidden % 128 == 0. */
  world_t v;
  world_init(&v, 2, 8, 64, 3, 16, 4, 32, 0);
  world_gen(&v, 1, T, 0);
  ASSERT_OK(epd_ref_plan_build(&v.plan, &v.map, v.in, &(int){0}, (char[128]){0}, 128));
  ASSERT_EQ(epd_ref_ll_dispatch(&v.plan, v.in, 1, v.out), EPD_ERR_INVALID);
}

EPD_TEST(ref_ll_skew_all_to_one_rank) {
  world_t w;
  world_init(&w, 4, 16, 32, 4, 20, 4, 80, 0);
  uint32_t T[4] = {20, 20, 20, 20};
  world_gen(&w, 5, T, 1);
  /* Force every entry to rank 0's experts (0..3), keeping -1s and duplicates. */
  for (uint32_t r = 0; r < 4; r++)
    for (uint32_t i = 0; i < 20 * 4; i++)
      if (w.idx[r][i] >= 0) w.idx[r][i] %= 4;
  check_ll(&w, 0);
  for (uint32_t r = 1; r < 4; r++)
    for (uint32_t s = 0; s < 4; s++) ASSERT_EQ(w.outs[r].recv_count[s], 0);
  ASSERT_GT(w.plan.ll_recv[0], 80u);
  check_ll_combine(&w);
}

EPD_TEST(ref_replicas_spread) {
  world_t w;
  world_init(&w, 2, 4, 16, 2, 8, 4, 16, 0);
  /* Expert 0 on (0,0) and (1,2); expert 1 on (0,1); 2 on (1,0); 3 on (1,1); slot (0,2),(0,3),(1,3) idle. */
  w.map.nrep[0] = 2;
  w.map.rep[0][0] = (epd_replica_t){0, 0};
  w.map.rep[0][1] = (epd_replica_t){1, 2};
  w.map.rep[1][0] = (epd_replica_t){0, 1};
  w.map.rep[2][0] = (epd_replica_t){1, 0};
  w.map.rep[3][0] = (epd_replica_t){1, 1};
  ASSERT_OK(epd_ref_map_validate(&w.map, 4, 2, 4, (char[128]){0}, 128));
  uint32_t T[2] = {8, 8};
  world_gen(&w, 9, T, 0);
  for (uint32_t r = 0; r < 2; r++)
    for (uint32_t t = 0; t < 8; t++) {
      w.idx[r][t * 2] = 0;
      w.idx[r][t * 2 + 1] = -1;
    }
  check_ll(&w, 0);
  /* (src * M + t) % 2 alternates: half the tokens on each replica. */
  ASSERT_EQ(w.outs[0].recv_count[0], 8);
  ASSERT_EQ(w.outs[1].recv_count[2], 8);
  ASSERT_EQ(w.plan.expert_tokens[0], 16u);
  check_ll_combine(&w);
}

EPD_TEST(ref_zero_and_max_tokens) {
  world_t w;
  world_init(&w, 2, 8, 16, 2, 12, 4, 24, 0);
  uint32_t T0[2] = {0, 0};
  world_gen(&w, 3, T0, 0);
  check_ll(&w, 0);
  for (uint32_t s = 0; s < 4; s++) ASSERT_EQ(w.outs[0].recv_count[s], 0);
  ASSERT_OK(epd_ref_ll_combine(&w.plan, (const uint16_t *const *)w.y, w.o));
  ASSERT_EQ(((uint8_t *)w.o[0])[0], POISON); /* no token: nothing written */
  uint32_t Tm[2] = {12, 12};
  world_gen(&w, 4, Tm, 0);
  check_ll(&w, 0);
  check_ll_combine(&w);
  uint32_t Tb[2] = {12, 13};
  world_gen(&w, 4, Tm, 0);
  w.in[1].num_tokens = Tb[1];
  int bad = -2;
  char err[128];
  ASSERT_EQ(epd_ref_plan_build(&w.plan, &w.map, w.in, &bad, err, sizeof err), EPD_ERR_TOO_MANY_TOKENS);
  ASSERT_EQ(bad, 1);
  ASSERT_STR_CONTAINS(err, "max_tokens 12");
}

EPD_TEST(ref_bad_expert) {
  world_t w;
  world_init(&w, 3, 6, 16, 2, 8, 2, 24, 0);
  uint32_t T[3] = {8, 8, 8};
  int64_t bad_vals[] = {6, -2, 1000};
  for (size_t i = 0; i < 3; i++) {
    world_gen(&w, 11, T, 0);
    w.idx[2][5 * 2 + 1] = bad_vals[i];
    int bad = -2;
    char err[128];
    ASSERT_EQ(epd_ref_plan_build(&w.plan, &w.map, w.in, &bad, err, sizeof err), EPD_ERR_BAD_EXPERT);
    ASSERT_EQ(bad, 2);
    ASSERT_STR_CONTAINS(err, "topk_idx[5][1]");
  }
  /* An out-of-range id past num_tokens is not looked at. */
  world_gen(&w, 11, T, 0);
  w.in[2].num_tokens = 5;
  w.idx[2][5 * 2 + 1] = 99;
  check_ll(&w, 0);
}

static void check_ht(world_t *w, int fp8) {
  const epd_ref_geom_t *g = &w->g;
  uint32_t R = g->num_ranks, M = g->max_tokens, K = g->topk, S = g->slots_per_rank, H = g->hidden;
  int bad = -2;
  ASSERT_OK(epd_ref_plan_build(&w->plan, &w->map, w->in, &bad, (char[128]){0}, 128));
  ASSERT_OK(epd_ref_ht_dispatch(&w->plan, w->in, fp8, w->out, &bad));
  for (uint32_t r = 0; r < R; r++) {
    /* Expected: tokens with some entry on r, in (src, t) order. */
    uint32_t j = 0;
    int32_t cnt[64] = {0};
    for (uint32_t src = 0; src < R; src++)
      for (uint32_t t = 0; t < w->in[src].num_tokens; t++) {
        const int64_t *ir = w->idx[src] + (size_t)t * K;
        int here = 0;
        for (uint32_t k = 0; k < K; k++)
          if (entry_valid(ir, k) && epd_ref_map_dest(&w->map, M, src, t, (uint32_t)ir[k]).rank == r) here = 1;
        if (!here) continue;
        ASSERT_EQ(w->outs[r].recv_src[j], EPD_SRC_PACK(src, t));
        if (!fp8)
          ASSERT(!memcmp((uint16_t *)w->outs[r].recv_x + (size_t)j * H, w->x[src] + (size_t)t * H, H * 2));
        for (uint32_t k = 0; k < K; k++) {
          int64_t got = w->outs[r].recv_topk_idx[(size_t)j * K + k];
          float gw = w->outs[r].recv_topk_weights[(size_t)j * K + k];
          if (entry_valid(ir, k) && epd_ref_map_dest(&w->map, M, src, t, (uint32_t)ir[k]).rank == r) {
            epd_replica_t d = epd_ref_map_dest(&w->map, M, src, t, (uint32_t)ir[k]);
            ASSERT_EQ(got, d.slot);
            ASSERT_NEAR(gw, w->w[src][(size_t)t * K + k], 0);
            cnt[d.slot]++;
          } else {
            ASSERT_EQ(got, -1);
            ASSERT_NEAR(gw, 0, 0);
          }
        }
        j++;
      }
    ASSERT_EQ(w->plan.ht_recv[r], j);
    for (uint32_t s = 0; s < S; s++) ASSERT_EQ(w->outs[r].recv_count[s], cnt[s]);
    if (j < g->ht_capacity) ASSERT_EQ(((uint8_t *)w->outs[r].recv_src)[j * 4], POISON);
  }
}

EPD_TEST(ref_ht_dedup_and_combine) {
  for (uint64_t seed = 1; seed <= 3; seed++) {
    world_t w;
    uint32_t R = 3, M = 20, K = 6, H = 32;
    world_init(&w, R, 12, H, K, M, 4, R * M, 1);
    uint32_t T[3] = {20, 13, 1};
    world_gen(&w, seed, T, seed == 3);
    check_ht(&w, 0);
    /* Worker: y = bf16(sum of local weights * x), so the combine gives sum over all weights * x. */
    for (uint32_t r = 0; r < R; r++)
      for (uint32_t j = 0; j < w.plan.ht_recv[r]; j++) {
        float sw = 0;
        for (uint32_t k = 0; k < K; k++) sw += w.outs[r].recv_topk_weights[j * K + k];
        for (uint32_t h = 0; h < H; h++)
          w.y[r][(size_t)j * H + h] =
              epd_f32_to_bf16(sw * epd_bf16_to_f32(((uint16_t *)w.outs[r].recv_x)[(size_t)j * H + h]));
      }
    ASSERT_OK(epd_ref_ht_combine(&w.plan, (const uint16_t *const *)w.y, w.o));
    for (uint32_t src = 0; src < R; src++)
      for (uint32_t t = 0; t < T[src]; t++) {
        float sw = 0;
        for (uint32_t k = 0; k < K; k++)
          if (entry_valid(w.idx[src] + (size_t)t * K, k)) sw += w.w[src][(size_t)t * K + k];
        for (uint32_t h = 0; h < H; h++)
          ASSERT(bf16_close(w.o[src][(size_t)t * H + h], sw * epd_bf16_to_f32(w.x[src][(size_t)t * H + h]),
                            1.0f / 32));
      }
  }
}

EPD_TEST(ref_ht_fp8) {
  world_t w;
  world_init(&w, 2, 8, 128, 4, 10, 4, 20, 1);
  uint32_t T[2] = {10, 9};
  world_gen(&w, 77, T, 0);
  check_ht(&w, 1);
  for (uint32_t r = 0; r < 2; r++)
    for (uint32_t j = 0; j < w.plan.ht_recv[r]; j++) {
      int32_t v = w.outs[r].recv_src[j];
      const uint16_t *xr = w.x[EPD_SRC_RANK(v)] + (size_t)EPD_SRC_TOKEN(v) * 128;
      const uint8_t *q = (uint8_t *)w.outs[r].recv_x + (size_t)j * 256;
      for (int h = 0; h < 128; h++) {
        float v2 = epd_bf16_to_f32(xr[h]), sc = w.outs[r].recv_scales[j];
        ASSERT(fabsf(epd_e4m3_to_f32(q[h]) * sc - v2) <= fabsf(v2) / 16 + sc / 1024);
      }
    }
}

EPD_TEST(ref_ht_overflow) {
  world_t w;
  uint32_t R = 2, M = 16, K = 2, H = 16, C = 10;
  world_init(&w, R, 4, H, K, M, 2, C, 1);
  uint32_t T[2] = {16, 16};
  world_gen(&w, 8, T, 0);
  for (uint32_t r = 0; r < R; r++)
    for (uint32_t t = 0; t < M; t++) {
      w.idx[r][t * K] = 3;                       /* expert 3 lives on rank 1: rank 1 gets all 32 tokens */
      w.idx[r][t * K + 1] = t % 5 == 0 ? 0 : -1; /* rank 0 gets 8: fits */
    }
  int bad = -2;
  ASSERT_OK(epd_ref_plan_build(&w.plan, &w.map, w.in, &bad, (char[128]){0}, 128));
  ASSERT_EQ(epd_ref_ht_dispatch(&w.plan, w.in, 0, w.out, &bad), EPD_ERR_OVERFLOW);
  ASSERT_EQ(bad, 1);
  ASSERT_EQ(w.plan.ht_recv[1], 32u);
  for (uint32_t r = 0; r < R; r++) { /* nothing written at all */
    ASSERT_EQ(((uint8_t *)w.outs[r].recv_src)[0], POISON);
    ASSERT_EQ(((uint8_t *)w.outs[r].recv_count)[0], POISON);
    ASSERT_EQ(((uint8_t *)w.outs[r].recv_x)[(C - 1) * H * 2], POISON);
  }
  /* With fewer tokens it fits exactly at capacity. */
  w.in[0].num_tokens = 5;
  w.in[1].num_tokens = 5;
  check_ht(&w, 0);
  ASSERT_EQ(w.plan.ht_recv[1], 10u);
}

EPD_TEST(ref_map_validation) {
  epd_expert_map_t m;
  char err[200];
  ASSERT_OK(epd_ref_map_default(&m, 10, 4, 3));
  ASSERT_EQ(m.rep[9][0].rank, 3u);
  ASSERT_EQ(m.rep[9][0].slot, 0u);
  ASSERT_EQ(m.rep[5][0].rank, 1u);
  ASSERT_EQ(m.rep[5][0].slot, 2u);
  ASSERT_OK(epd_ref_map_validate(&m, 10, 4, 3, err, sizeof err));
  ASSERT_EQ(epd_ref_map_default(&(epd_expert_map_t){0}, 10, 4, 2), EPD_ERR_INVALID);
  ASSERT_EQ(epd_ref_map_validate(&m, 11, 4, 3, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "10 experts");
  m.rep[4][0] = (epd_replica_t){0, 1}; /* expert 1's place */
  ASSERT_EQ(epd_ref_map_validate(&m, 10, 4, 3, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "expert 4 replica 0: (rank 0, slot 1) is already used by expert 1");
  m.rep[4][0] = (epd_replica_t){4, 0};
  ASSERT_EQ(epd_ref_map_validate(&m, 10, 4, 3, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "rank 4 out of range [0, 4)");
  m.rep[4][0] = (epd_replica_t){1, 3};
  ASSERT_EQ(epd_ref_map_validate(&m, 10, 4, 3, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "slot 3 out of range [0, 3)");
  m.rep[4][0] = (epd_replica_t){1, 1};
  m.nrep[7] = 0;
  ASSERT_EQ(epd_ref_map_validate(&m, 10, 4, 3, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "expert 7 has 0 replicas");
  m.nrep[7] = EPD_MAX_REPLICAS + 1;
  ASSERT_EQ(epd_ref_map_validate(&m, 10, 4, 3, err, sizeof err), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "expert 7 has 9 replicas");
  m.nrep[7] = 1;
  epd_expert_map_t c;
  ASSERT_OK(epd_ref_map_copy(&c, &m));
  ASSERT_OK(epd_ref_map_validate(&c, 10, 4, 3, err, sizeof err));
  epd_expert_map_free(&m);
  epd_expert_map_free(&c);
}

EPD_TEST(ref_gen_is_deterministic) {
  epd_ref_geom_t g = {2, 16, 16, 4, 32, 8, 64};
  uint16_t x1[32 * 16], x2[32 * 16];
  int64_t i1[32 * 4], i2[32 * 4];
  float w1[32 * 4], w2[32 * 4];
  epd_ref_gen_input(5, 3, 1, &g, 32, 0, x1, i1, w1);
  epd_ref_gen_input(5, 3, 1, &g, 32, 0, x2, i2, w2);
  ASSERT(!memcmp(x1, x2, sizeof x1) && !memcmp(i1, i2, sizeof i1) && !memcmp(w1, w2, sizeof w1));
  epd_ref_gen_input(5, 4, 1, &g, 32, 0, x2, i2, w2);
  ASSERT(memcmp(i1, i2, sizeof i1));
  int neg = 0, dup = 0;
  for (int t = 0; t < 32; t++)
    for (int k = 0; k < 4; k++) {
      neg += i1[t * 4 + k] == -1;
      for (int k2 = 0; k2 < k; k2++) dup += i1[t * 4 + k] >= 0 && i1[t * 4 + k] == i1[t * 4 + k2];
    }
  ASSERT_GT(neg, 0);
  ASSERT_GT(dup, 0);
}
