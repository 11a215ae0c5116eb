/*
 * metrics.h - the one status/metrics builder. From an engine snapshot plus what the daemon knows
 * (uptime, state, attach connections, effective config) it builds the Prometheus text exposition
 * (format 0.0.4) and the StatusReply message. Used by GetStatus, GetMetrics and the crash log; it
 * has no transport of its own. Histogram buckets in epd_op_snap_t are per-bucket (not cumulative)
 * counts; the text output makes them cumulative as Prometheus requires.
 */
#ifndef EPD_METRICS_H
#define EPD_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "control/attach.h"
#include "core/engine.h"
#include "epd.pb-c.h"

/* What the daemon adds to the engine snapshot. Strings may be NULL (shown as empty). */
typedef struct epd_daemon_info {
  const char *version; /* EPD_VERSION */
  const char *state;   /* "starting", "ready", "draining", "failed" */
  uint64_t uptime_ms;
  unsigned attach_connections; /* live attach-socket connections */
  const char *config;          /* effective configuration text, or NULL */
  epd_attach_stats_t attach;   /* attach-socket refusals and accept errors (epd_attach_stats) */
  uint64_t
      control_refused[2]; /* control connections refused at the cap: all uids, one uid (epd_rpc_refused) */
  unsigned control_connections; /* control connections open (as last counted at an accept) */
} epd_daemon_info_t;

/* Name of an EPD_OP_* for labels ("ll_dispatch", ...); "none" for anything else. */
const char *epd_metrics_op_name(int op);
/* Prometheus text exposition of the snapshot into a malloc'ed NUL-terminated string (*out, length in
 * *len if len != NULL); EPD_ERR_NOMEM on allocation failure. */
epd_result_t epd_metrics_text(const epd_engine_snap_t *snap, const epd_daemon_info_t *info, char **out,
                              size_t *len);
/* Build a StatusReply (strings and arrays malloc'ed, a RankStatus's device_uuid inside its own allocation;
 * free with epd_metrics_status_free). */
epd_result_t epd_metrics_status(const epd_engine_snap_t *snap, const epd_daemon_info_t *info,
                                Epd__V1__StatusReply **out);
/* Free a StatusReply built by epd_metrics_status (not one from protobuf unpack). */
void epd_metrics_status_free(Epd__V1__StatusReply *st);

#endif
