/*
 * test_metrics.c - the status/metrics builder (daemon/metrics.c) on a synthetic engine snapshot: the
 * Prometheus text passes promtool and carries the snapshot's values; the StatusReply round-trips.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "control/metrics.h"
#include "test.h"

/* A snapshot with two ranks, one group of 4 experts, one client, and a few ops in the histogram. */
typedef struct synth {
  epd_engine_snap_t snap;
  epd_group_snap_t group;
  epd_client_snap_t client;
  epd_rank_snap_t ranks[2];
  uint64_t expert_tokens[4];
} synth_t;

static void synth_init(synth_t *s) {
  memset(s, 0, sizeof *s);
  s->snap.backend = "host";
  s->snap.mode = "host-threads";
  s->snap.num_ranks = 2;
  s->snap.ngroups = 1;
  s->snap.nclients = 1;
  s->snap.groups = &s->group;
  s->snap.clients = &s->client;
  s->snap.ranks = s->ranks;
  snprintf(s->group.name, sizeof s->group.name, "model\"a\\b");
  s->group.num_experts = 4;
  s->group.hidden = 256;
  s->group.topk = 2;
  s->group.max_tokens = 64;
  s->group.slots_per_rank = 2;
  s->group.attached_ranks = 1;
  s->group.map_version = 3;
  s->group.steps = 17;
  for (int e = 0; e < 4; e++) s->expert_tokens[e] = 100u * (unsigned)(e + 1);
  s->group.expert_tokens = s->expert_tokens;
  s->client.client_id = 42;
  snprintf(s->client.name, sizeof s->client.name, "worker-0");
  snprintf(s->client.group, sizeof s->client.group, "model\"a\\b");
  s->client.rank = 1;
  s->client.pid = 1234;
  s->client.uid = 1000;
  s->client.ops = 9;
  s->client.arena_bytes = 1 << 20;
  for (int r = 0; r < 2; r++) {
    s->ranks[r].rank = r;
    s->ranks[r].device = -1;
    s->ranks[r].buffer_bytes = (uint64_t)(r + 1) << 24;
    s->ranks[r].clients = (uint32_t)r;
    s->ranks[r].ops = 5u + (unsigned)r;
    s->ranks[r].timeouts = (uint64_t)r;
    s->ranks[r].wait_ns_by_peer[1 - r] = 1500000000ull; /* 1.5 s */
  }
  epd_op_snap_t *o = &s->snap.ops[EPD_OP_LL_DISPATCH];
  o->count = 6;
  o->errors = 1;
  o->bytes = 123456;
  o->lat_bucket[0] = 1;                   /* <= 1 us */
  o->lat_bucket[3] = 2;                   /* <= 8 us */
  o->lat_bucket[EPD_LAT_BUCKETS - 1] = 3; /* +Inf */
  o->lat_sum_s = 0.25;
}

/* The value of the first sample line that starts with prefix (name and labels), or -1. */
static double sample(const char *text, const char *prefix) {
  size_t n = strlen(prefix);
  for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
    if (!strncmp(p, prefix, n) && p[n] == ' ') return strtod(p + n + 1, NULL);
  }
  return -1;
}

EPD_TEST(metrics_text_values) {
  synth_t s;
  synth_init(&s);
  epd_daemon_info_t info = {"0.1.0", "ready", 12345, 1, "daemon.x = 1\n", {2, {3, 4, 5}, 6}, {7, 8}, 9};
  char *text = NULL;
  size_t len = 0;
  ASSERT_OK(epd_metrics_text(&s.snap, &info, &text, &len));
  ASSERT_EQ(len, strlen(text));
  ASSERT_STR_CONTAINS(text, "# TYPE epd_op_latency_seconds histogram\n");
  ASSERT_STR_CONTAINS(text, "# TYPE epd_ops_total counter\n");
  ASSERT_STR_CONTAINS(text, "epd_info{backend=\"host\",mode=\"host-threads\",version=\"0.1.0\"} 1\n");
  ASSERT_NEAR(sample(text, "epd_state{state=\"ready\"}"), 1, 0);
  ASSERT_NEAR(sample(text, "epd_state{state=\"draining\"}"), 0, 0);
  ASSERT_NEAR(sample(text, "epd_ops_total{op=\"ll_dispatch\",mode=\"ll\"}"), 6, 0);
  ASSERT_NEAR(sample(text, "epd_ops_total{op=\"ht_combine\",mode=\"ht\"}"), 0, 0);
  ASSERT_NEAR(sample(text, "epd_op_errors_total{op=\"ll_dispatch\",mode=\"ll\"}"), 1, 0);
  ASSERT_NEAR(sample(text, "epd_bytes_total{op=\"ll_dispatch\",mode=\"ll\"}"), 123456, 0);
  /* Buckets are cumulative in the output: 1, 1, 1, 3, ..., 6 at +Inf; _count equals +Inf. */
  ASSERT_NEAR(sample(text, "epd_op_latency_seconds_bucket{op=\"ll_dispatch\",mode=\"ll\",le=\"1e-06\"}"), 1,
              0);
  ASSERT_NEAR(sample(text, "epd_op_latency_seconds_bucket{op=\"ll_dispatch\",mode=\"ll\",le=\"4e-06\"}"), 1,
              0);
  ASSERT_NEAR(sample(text, "epd_op_latency_seconds_bucket{op=\"ll_dispatch\",mode=\"ll\",le=\"8e-06\"}"), 3,
              0);
  ASSERT_NEAR(sample(text, "epd_op_latency_seconds_bucket{op=\"ll_dispatch\",mode=\"ll\",le=\"+Inf\"}"), 6,
              0);
  ASSERT_NEAR(sample(text, "epd_op_latency_seconds_count{op=\"ll_dispatch\",mode=\"ll\"}"), 6, 0);
  ASSERT_NEAR(sample(text, "epd_op_latency_seconds_sum{op=\"ll_dispatch\",mode=\"ll\"}"), 0.25, 1e-9);
  ASSERT_NEAR(sample(text, "epd_clients"), 1, 0);
  ASSERT_NEAR(sample(text, "epd_draining"), 0, 0);
  ASSERT_NEAR(sample(text, "epd_uptime_seconds"), 12.345, 1e-6);
  ASSERT_NEAR(sample(text, "epd_attach_unredeemed_connections"), 2, 0);
  ASSERT_NEAR(sample(text, "epd_attach_refused_total{reason=\"cap\"}"), 3, 0);
  ASSERT_NEAR(sample(text, "epd_attach_refused_total{reason=\"uid\"}"), 4, 0);
  ASSERT_NEAR(sample(text, "epd_attach_refused_total{reason=\"peer\"}"), 5, 0);
  ASSERT_NEAR(sample(text, "epd_control_refused_total{reason=\"cap\"}"), 7, 0);
  ASSERT_NEAR(sample(text, "epd_control_refused_total{reason=\"uid\"}"), 8, 0);
  ASSERT_NEAR(sample(text, "epd_control_connections"), 9, 0);
  ASSERT_NEAR(sample(text, "epd_attach_accept_errors_total"), 6, 0);
  ASSERT_NEAR(sample(text, "epd_rank_buffer_bytes{rank=\"1\",device=\"-1\"}"), 1 << 25, 0);
  ASSERT_NEAR(sample(text, "epd_timeouts_total{rank=\"1\"}"), 1, 0);
  ASSERT_NEAR(sample(text, "epd_peer_wait_seconds_total{rank=\"0\",peer=\"1\"}"), 1.5, 1e-9);
  ASSERT_NEAR(sample(text, "epd_peer_wait_seconds_total{rank=\"0\",peer=\"0\"}"), 0, 0);
  /* Label values are escaped: the group is model"a\b. */
  ASSERT_NEAR(sample(text, "epd_expert_tokens_total{group=\"model\\\"a\\\\b\",expert=\"3\"}"), 400, 0);
  ASSERT_NEAR(sample(text, "epd_group_map_version{group=\"model\\\"a\\\\b\"}"), 3, 0);
  /* Every sample has HELP and TYPE. */
  int types = 0, helps = 0;
  for (const char *p = text; (p = strstr(p, "# TYPE ")); p++) types++;
  for (const char *p = text; (p = strstr(p, "# HELP ")); p++) helps++;
  ASSERT_GE(helps, 20);
  ASSERT_EQ(helps, types);
  free(text);
}

EPD_TEST(metrics_promtool_check) {
  if (access("/usr/bin/promtool", X_OK) != 0) epd_test_skip("promtool not installed");
  synth_t s;
  synth_init(&s);
  epd_daemon_info_t info = {"0.1.0", "draining", 1, 0, NULL, {1, {1, 2, 3}, 4}, {1, 2}, 3};
  s.snap.draining = 1;
  char *text = NULL;
  ASSERT_OK(epd_metrics_text(&s.snap, &info, &text, NULL));
  char path[512];
  snprintf(path, sizeof path, "%s/metrics.txt", epd_test_tmpdir());
  FILE *f = fopen(path, "w");
  ASSERT(f != NULL);
  fputs(text, f);
  fclose(f);
  char cmd[1200];
  snprintf(cmd, sizeof cmd, "promtool check metrics < %s > %s.out 2>&1", path, path);
  int rc = system(cmd);
  if (rc != 0) {
    snprintf(cmd, sizeof cmd, "cat %s.out >&2", path);
    if (system(cmd)) { /* the failure below says enough */
    }
  }
  ASSERT(WIFEXITED(rc));
  ASSERT_EQ(WEXITSTATUS(rc), 0);
  ASSERT_NEAR(sample(text, "epd_draining"), 1, 0);
  ASSERT_NEAR(sample(text, "epd_state{state=\"draining\"}"), 1, 0);
  free(text);
}

EPD_TEST(metrics_empty_snapshot) {
  epd_engine_snap_t snap;
  memset(&snap, 0, sizeof snap);
  snap.backend = "cuda";
  snap.mode = "persistent";
  char *text = NULL;
  ASSERT_OK(epd_metrics_text(&snap, NULL, &text, NULL));
  ASSERT_STR_CONTAINS(text, "epd_info{backend=\"cuda\",mode=\"persistent\",version=\"\"} 1\n");
  ASSERT_NEAR(sample(text, "epd_clients"), 0, 0);
  free(text);
  Epd__V1__StatusReply *st = NULL;
  ASSERT_OK(epd_metrics_status(&snap, NULL, &st));
  ASSERT_EQ(st->n_groups, 0);
  ASSERT_EQ(st->n_ranks, 0);
  ASSERT(!strcmp(st->engine_mode, "persistent"));
  epd_metrics_status_free(st);
}

EPD_TEST(metrics_status_roundtrip) {
  synth_t s;
  synth_init(&s);
  epd_daemon_info_t info = {"0.1.0",           "ready", 777, 1, "engine.backend = host\n",
                            {0, {0, 0, 0}, 0}, {0, 0},  0};
  Epd__V1__StatusReply *st = NULL;
  ASSERT_OK(epd_metrics_status(&s.snap, &info, &st));
  size_t n = protobuf_c_message_get_packed_size(&st->base);
  uint8_t *buf = malloc(n);
  ASSERT_EQ(protobuf_c_message_pack(&st->base, buf), n);
  epd_metrics_status_free(st);
  Epd__V1__StatusReply *u = epd__v1__status_reply__unpack(NULL, n, buf);
  free(buf);
  ASSERT(u != NULL);
  ASSERT(!strcmp(u->version, "0.1.0"));
  ASSERT(!strcmp(u->backend, "host"));
  ASSERT(!strcmp(u->engine_mode, "host-threads"));
  ASSERT(!strcmp(u->state, "ready"));
  ASSERT(!strcmp(u->config, "engine.backend = host\n"));
  ASSERT_EQ(u->uptime_ms, 777);
  ASSERT_EQ(u->protocol_version, EPD_PROTOCOL_VERSION);
  ASSERT_EQ(u->num_ranks, 2);
  ASSERT_EQ(u->n_ranks, 2);
  ASSERT_EQ(u->ranks[1]->buffer_bytes, 1ull << 25);
  ASSERT_EQ(u->ranks[1]->ops, 6);
  ASSERT_EQ(u->ranks[0]->device, -1);
  ASSERT_EQ(u->n_groups, 1);
  ASSERT(!strcmp(u->groups[0]->name, "model\"a\\b"));
  ASSERT_EQ(u->groups[0]->steps, 17);
  ASSERT_EQ(u->groups[0]->map_version, 3);
  ASSERT_EQ(u->n_clients, 1);
  ASSERT_EQ(u->clients[0]->client_id, 42);
  ASSERT(!strcmp(u->clients[0]->name, "worker-0"));
  ASSERT_EQ(u->clients[0]->rank, 1);
  ASSERT_EQ(u->clients[0]->arena_bytes, 1 << 20);
  ASSERT(!u->draining);
  epd__v1__status_reply__free_unpacked(u, NULL);
}
