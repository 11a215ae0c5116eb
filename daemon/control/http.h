/*
 * http.h - the optional Prometheus endpoint (metrics.prometheus_listen, off when empty): GET or HEAD
 * /metrics returns the text exposition (format 0.0.4) from the same builder as GetMetrics; every other
 * path is 404 and every other method 405. Served by libmicrohttpd from its own thread.
 */
#ifndef EPD_HTTP_H
#define EPD_HTTP_H

#include <stddef.h>

#include "control/conf.h"
#include "core/engine.h"
#include "control/rpc.h"

/* Start serving on conf->prometheus_listen ("host:port", host numeric IPv4/IPv6 or "*"); nothing when
 * it is empty. hooks->state and hooks->config_dump feed the builder as they do for the RPC.
 * 0, or -1 with err set (bad address, port in use). */
int epd_http_init(const epd_conf_t *conf, epd_engine_t *eng, const epd_rpc_hooks_t *hooks, char *err,
                  size_t errlen);
/* Stop the server and join its thread; safe when it was never started. */
void epd_http_fini(void);

#endif
