/*
 * rpc.h - the control RPC server: service epd.v1.Control and grpc.health.v1.Health on a Unix socket,
 * served by gRPC C core from its own thread (completion queue). Requests are protobuf-c messages; each
 * carries protocol_version, checked first (0, the field left out, means the current version).
 */
#ifndef EPD_RPC_H
#define EPD_RPC_H

#include <stddef.h>

#include "control/conf.h"
#include "core/engine.h"

/* What the server needs from main (called from the RPC thread; must be thread-safe). */
typedef struct epd_rpc_hooks {
  void *arg;
  /* Drain requested (exit_when_idle from DrainRequest.exit). */
  void (*drain)(void *arg, int exit_when_idle);
  /* "starting", "ready", "draining", "failed". */
  const char *(*state)(void *arg);
  /* Effective configuration text ("key = value" lines) for GetStatus/epdctl config. */
  size_t (*config_dump)(void *arg, char *buf, size_t len);
} epd_rpc_hooks_t;

/* Bind the control socket (conf->control_socket, mode and group applied) and start serving. */
/* Control connections open (as counted at the last accept) and refused at the caps so far (out[0]: all uids,
 * out[1]: one uid); any thread. */
unsigned epd_rpc_control_conns(uint64_t refused[2]);
int epd_rpc_init(const epd_conf_t *conf, epd_engine_t *eng, const epd_rpc_hooks_t *hooks, char *err,
                 size_t errlen);
/* Shut down: stop accepting, cancel calls (Watch streams end), join the thread, remove the socket. */
void epd_rpc_fini(void);
/* Resolved path of the control socket. */
const char *epd_rpc_socket_path(void);
/* Decode, check and handle one request of a method ("/epd.v1.Control/Attach") given as bytes, as the
 * server would for this process as the peer, without a server (fuzzing, tests; not while serving:
 * then, and for streaming methods, it only decodes). Returns the gRPC status code, details in details. */
int epd_rpc_handle_bytes(epd_engine_t *eng, const char *method, const uint8_t *data, size_t len,
                         char *details, size_t dlen);
/* Health status of the service ("" and "epd.v1.Control"): serving or not. */
void epd_rpc_set_serving(int serving);

#endif
