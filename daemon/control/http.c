/*
 * http.c - the optional Prometheus endpoint. libmicrohttpd runs its own polling thread; each request
 * takes an engine snapshot and renders it with epd_metrics_text, the builder GetMetrics uses, so a
 * scrape and `epdctl metrics` never disagree on names or values.
 */
#define _GNU_SOURCE
#include "control/http.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "control/attach.h"
#include "control/rpc.h"
#include "core/log.h"
#include "control/metrics.h"

#define HTTP_CONFIG_TEXT_MAX 65536
#define HTTP_CONN_LIMIT 16
#define HTTP_PER_IP_CONN_LIMIT 4 /* a scraper needs one; the rest stay for the others */
#define HTTP_TIMEOUT_S 10

#if MHD_VERSION < 0x00097002
typedef int epd_mhd_result;
#else
typedef enum MHD_Result epd_mhd_result;
#endif

static struct {
  struct MHD_Daemon *mhd;
  epd_engine_t *eng;
  epd_rpc_hooks_t hooks;
  uint64_t start_ns;
  char listen[64];
} h;

static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static epd_mhd_result respond(struct MHD_Connection *conn, unsigned code, const char *ctype, char *body,
                              size_t len) {
  /* MUST_FREE hands body to libmicrohttpd, which frees it when the response is gone. */
  struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
  if (!r) {
    free(body);
    return MHD_NO;
  }
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
  epd_mhd_result ret = MHD_queue_response(conn, code, r);
  MHD_destroy_response(r);
  return ret;
}

static epd_mhd_result respond_text(struct MHD_Connection *conn, unsigned code, const char *text) {
  char *body = strdup(text);
  return body ? respond(conn, code, "text/plain; charset=utf-8", body, strlen(body)) : MHD_NO;
}

/* The metrics text of the moment, malloc'ed; NULL on failure (logged). */
static char *metrics_text(size_t *len) {
  epd_engine_snap_t snap;
  epd_daemon_info_t info = {0};
  epd_result_t r = epd_engine_snapshot(h.eng, &snap);
  if (r != EPD_OK) {
    EPD_LOGW(EPD_SUB_METRICS, "http: engine snapshot failed: %d", (int)r);
    return NULL;
  }
  const char *st = h.hooks.state ? h.hooks.state(h.hooks.arg) : NULL;
  char *cfg = h.hooks.config_dump ? malloc(HTTP_CONFIG_TEXT_MAX) : NULL;
  if (cfg) {
    size_t n = h.hooks.config_dump(h.hooks.arg, cfg, HTTP_CONFIG_TEXT_MAX);
    cfg[n < HTTP_CONFIG_TEXT_MAX ? n : HTTP_CONFIG_TEXT_MAX - 1] = 0;
  }
  info.version = EPD_VERSION;
  info.state = st ? st : "ready";
  info.uptime_ms = (mono_ns() - h.start_ns) / 1000000ull;
  info.attach_connections = epd_attach_connections();
  epd_attach_stats(&info.attach);
  info.control_connections = epd_rpc_control_conns(info.control_refused);
  info.config = cfg;
  char *text = NULL;
  r = epd_metrics_text(&snap, &info, &text, len);
  if (r != EPD_OK) EPD_LOGW(EPD_SUB_METRICS, "http: building the metrics failed: %d", (int)r);
  epd_engine_snapshot_free(&snap);
  free(cfg);
  return r == EPD_OK ? text : NULL;
}

static epd_mhd_result on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                 const char *version, const char *upload, size_t *upload_size, void **state) {
  (void)cls;
  (void)version;
  (void)upload;
  /* The first call only announces the request; answer on the second, when any body has been read. */
  if (!*state) {
    *state = conn;
    return MHD_YES;
  }
  if (*upload_size) {
    *upload_size = 0; /* a GET has no body worth reading: drop it */
    return MHD_YES;
  }
  int get = !strcmp(method, MHD_HTTP_METHOD_GET), head = !strcmp(method, MHD_HTTP_METHOD_HEAD);
  if (strcmp(url, "/metrics") != 0)
    return respond_text(conn, MHD_HTTP_NOT_FOUND, "not found: try /metrics\n");
  if (!get && !head) {
    char *body = strdup("method not allowed: GET or HEAD\n");
    if (!body) return MHD_NO;
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
      free(body);
      return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
    epd_mhd_result ret = MHD_queue_response(conn, MHD_HTTP_METHOD_NOT_ALLOWED, r);
    MHD_destroy_response(r);
    return ret;
  }
  size_t len = 0;
  char *text = metrics_text(&len);
  if (!text) return respond_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "metrics unavailable\n");
  return respond(conn, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", text, len);
}

/* "host:port" -> sockaddr; host "*" or empty = any IPv4 address, "[addr]" = IPv6. */
static int parse_listen(const char *s, struct sockaddr_storage *ss, int *v6, char *err, size_t errlen) {
  char host[64];
  const char *colon = strrchr(s, ':');
  if (!colon || !colon[1]) {
    snprintf(err, errlen, "metrics.prometheus_listen '%s': expected host:port", s);
    return -1;
  }
  char *end;
  long port = strtol(colon + 1, &end, 10);
  if (*end || port < 1 || port > 65535) {
    snprintf(err, errlen, "metrics.prometheus_listen '%s': port must be 1..65535", s);
    return -1;
  }
  size_t hl = (size_t)(colon - s);
  if (hl >= sizeof host) {
    snprintf(err, errlen, "metrics.prometheus_listen '%s': host too long", s);
    return -1;
  }
  memcpy(host, s, hl);
  host[hl] = 0;
  if (hl >= 2 && host[0] == '[' && host[hl - 1] == ']') {
    memmove(host, host + 1, hl - 2);
    host[hl - 2] = 0;
  }
  if (!host[0] || !strcmp(host, "*")) snprintf(host, sizeof host, "0.0.0.0");
  struct addrinfo hints = {.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV, .ai_socktype = SOCK_STREAM},
                  *ai = NULL;
  int rc = getaddrinfo(host, colon + 1, &hints, &ai);
  if (rc != 0 || !ai) {
    snprintf(err, errlen,
             "metrics.prometheus_listen '%s': host must be a numeric IPv4 or [IPv6] address (%s)", s,
             gai_strerror(rc));
    return -1;
  }
  memcpy(ss, ai->ai_addr, ai->ai_addrlen);
  *v6 = ai->ai_family == AF_INET6;
  freeaddrinfo(ai);
  return 0;
}

/* libmicrohttpd logs once per refused connection at its limits, and on every failed accept when out of
 * fds with no connection open (it then busy-waits): at most one line a second, with a count. */
static void mhd_log(void *cls, const char *fmt, va_list ap) {
  static epd_log_ratelimit_t rl = EPD_LOG_RATELIMIT_INITIALIZER(1000);
  (void)cls;
  char msg[512];
  vsnprintf(msg, sizeof msg, fmt, ap);
  size_t n = strlen(msg);
  if (n && msg[n - 1] == '\n') msg[n - 1] = 0;
  epd_log_ratelimited(&rl, EPD_LOG_WARN, EPD_SUB_METRICS, "http: %s", msg);
}

int epd_http_init(const epd_conf_t *conf, epd_engine_t *eng, const epd_rpc_hooks_t *hooks, char *err,
                  size_t errlen) {
  if (h.mhd) {
    snprintf(err, errlen, "prometheus endpoint already serving %s", h.listen);
    return -1;
  }
  if (!conf->prometheus_listen[0]) return 0;
  struct sockaddr_storage ss;
  int v6 = 0;
  if (parse_listen(conf->prometheus_listen, &ss, &v6, err, errlen) != 0) return -1;
  h.eng = eng;
  if (hooks) h.hooks = *hooks;
  h.start_ns = mono_ns();
  snprintf(h.listen, sizeof h.listen, "%s", conf->prometheus_listen);
  unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG | (v6 ? MHD_USE_IPv6 : 0);
  h.mhd = MHD_start_daemon(flags, 0, NULL, NULL, on_request, NULL, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
                           MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss, MHD_OPTION_CONNECTION_LIMIT,
                           (unsigned)HTTP_CONN_LIMIT, MHD_OPTION_PER_IP_CONNECTION_LIMIT,
                           (unsigned)HTTP_PER_IP_CONN_LIMIT, MHD_OPTION_CONNECTION_TIMEOUT,
                           (unsigned)HTTP_TIMEOUT_S, MHD_OPTION_END);
  if (!h.mhd) {
    snprintf(err, errlen, "metrics.prometheus_listen %s: cannot listen (address in use or not local?)",
             h.listen);
    return -1;
  }
  EPD_LOGI(EPD_SUB_METRICS, "prometheus endpoint: http://%s/metrics", h.listen);
  return 0;
}

void epd_http_fini(void) {
  if (!h.mhd) return;
  MHD_stop_daemon(h.mhd);
  h.mhd = NULL;
  EPD_LOGD(EPD_SUB_METRICS, "prometheus endpoint stopped");
}
