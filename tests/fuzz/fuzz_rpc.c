/* fuzz_rpc.c - libFuzzer target: every Control/Health request decoded, checked and handled as the RPC
 * server does (rpc.c epd_rpc_handle_bytes) against an in-process host engine. Input: one byte picks the
 * method, the rest is the request. Attach requests that pass validation attach for real (then detach,
 * since no attach socket issues a token); Drain is undone after each input so later inputs still run. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/engine.h"
#include "control/events.h"
#include "core/log.h"
#include "control/rpc.h"

static epd_engine_t *eng;

static const char *const paths[] = {
    "/epd.v1.Control/Attach",       "/epd.v1.Control/Detach",       "/epd.v1.Control/GetStatus",
    "/epd.v1.Control/GetMetrics",   "/epd.v1.Control/SetExpertMap", "/epd.v1.Control/GetExpertMap",
    "/epd.v1.Control/Watch",        "/epd.v1.Control/Drain",        "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch", "/epd.v1.Control/NoSuchMethod"};

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  char err[256];
  epd_log_init(EPD_LOG_ERROR, EPD_SUB_ALL, 0);
  epd_events_init(64);
  epd_engine_opts_t o = {0};
  o.backend = "host";
  o.num_ranks = 2;
  o.max_experts = 64;
  o.max_hidden = 256;
  o.max_topk = 8;
  o.max_tokens = 16;
  o.slots_factor_pct = 200;
  o.max_groups = 4;
  o.max_clients_per_rank = 4;
  o.max_arena_bytes = 64ull << 20;
  o.step_timeout_ms = 1000;
  if (epd_engine_create(&o, NULL, NULL, &eng, err, sizeof err) != EPD_OK) {
    fprintf(stderr, "engine: %s\n", err);
    abort();
  }
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  const char *m = paths[data[0] % (sizeof paths / sizeof paths[0])];
  char details[512];
  int code = epd_rpc_handle_bytes(eng, m, data + 1, size - 1, details, sizeof details);
  if (code < 0 || code > 16) abort(); /* not a gRPC status */
  epd_engine_set_draining(eng, 0);
  return 0;
}
