/*
 * attach.h - the attach side channel: a Unix stream socket (path from config) where a client redeems
 * the one-time token issued by the Attach RPC and receives its queue and arena fds with SCM_RIGHTS
 * (protocol: client/epd_wire.h). Runs on the libuv loop (uv_poll_t; sendmsg/recvmsg by hand). The
 * connection then stays open; its hang-up detaches the client as lost.
 */
#ifndef EPD_ATTACH_H
#define EPD_ATTACH_H

#include <stdint.h>
#include <uv.h>

#include "control/conf.h"
#include "core/engine.h"
#include "epd_wire.h"

/* Start listening on conf->attach_socket, or attach.sock beside the control socket (see
 * epd_conf_attach_socket_path; the path is then given by epd_attach_path()); 0, or -1 with err set. */
int epd_attach_init(uv_loop_t *loop, const epd_conf_t *conf, epd_engine_t *eng, char *err, size_t errlen);
/* Close the socket and every client connection (without detaching: the engine is destroyed next). */
void epd_attach_fini(void);
/* Resolved path of the attach socket. */
const char *epd_attach_path(void);
/* Issue a one-time token for a client just attached in the engine (thread-safe; any thread). The
 * token expires after conf->token_ttl_ms; an unredeemed, expired token detaches the client. The
 * peer's pid/uid from the Attach call (0 if unknown) are checked against SO_PEERCRED at redemption
 * when non-zero. */
int epd_attach_issue_token(uint64_t client_id, uint32_t pid, uint32_t uid, uint8_t token[EPD_TOKEN_BYTES]);
/* Drop a client's unredeemed tokens (the client detached before redeeming: e.g. libepd could not use the
 * rank's GPU); 0 when it had none. Thread-safe. */
unsigned epd_attach_forget_token(uint64_t client_id);
/* Change the lifetime of tokens issued from now on (SIGHUP reload of daemon.token_ttl_ms; any thread). */
void epd_attach_set_token_ttl(uint32_t ttl_ms);
/* Number of issued, not yet redeemed tokens (for status and tests). */
unsigned epd_attach_pending_tokens(void);
/* Number of live attach connections (for status). */
unsigned epd_attach_connections(void);

/* Why a connection was closed at accept: the bound on unredeemed connections in all
 * (daemon.max_unredeemed_conns) or of its uid (max_unredeemed_per_uid), or its peer (not in the allow
 * lists, or no credentials). Also the order of the metric's reason labels. */
enum { EPD_ATTACH_REFUSED_CAP, EPD_ATTACH_REFUSED_UID, EPD_ATTACH_REFUSED_PEER, EPD_ATTACH_REFUSED_MAX };
typedef struct epd_attach_stats {
  unsigned unredeemed;                      /* open connections that have not sent their token yet */
  uint64_t refused[EPD_ATTACH_REFUSED_MAX]; /* connections closed at accept, by reason, since start */
  uint64_t accept_errors;                   /* accept() failures (out of fds or memory), since start */
} epd_attach_stats_t;
/* The attach socket's counters (any thread). */
void epd_attach_stats(epd_attach_stats_t *out);
/* Set the bounds on unredeemed connections, in all and per uid (init and SIGHUP reload; loop thread). */
void epd_attach_set_limits(uint32_t total, uint32_t per_uid);

#endif
