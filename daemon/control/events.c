/*
 * events.c - the daemon's event stream: a bounded ring of the most recent events, guarded by a mutex,
 * with a condition variable that wakes Watch streams waiting for the next sequence number.
 */
#define _GNU_SOURCE
#include "control/events.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/log.h"

static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  epd_event_t *ring; /* ring[seq % cap] holds event seq */
  unsigned cap;
  uint64_t last_seq;
  int closed;
  int ready;
} g_ev = {.mu = PTHREAD_MUTEX_INITIALIZER};

int epd_events_init(unsigned capacity) {
  if (capacity == 0) capacity = 1024;
  epd_event_t *ring = calloc(capacity, sizeof *ring);
  if (!ring) return -1;
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  /* Waits use CLOCK_MONOTONIC so that a wall-clock step cannot stretch a Watch timeout. */
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_mutex_lock(&g_ev.mu);
  free(g_ev.ring);
  g_ev.ring = ring;
  g_ev.cap = capacity;
  g_ev.last_seq = 0;
  g_ev.closed = 0;
  if (!g_ev.ready) pthread_cond_init(&g_ev.cv, &ca);
  g_ev.ready = 1;
  pthread_mutex_unlock(&g_ev.mu);
  pthread_condattr_destroy(&ca);
  return 0;
}

void epd_events_fini(void) {
  pthread_mutex_lock(&g_ev.mu);
  g_ev.closed = 1;
  if (g_ev.ready) pthread_cond_broadcast(&g_ev.cv);
  pthread_mutex_unlock(&g_ev.mu);
  /* The ring stays allocated: a waiter woken above may still be reading it under the mutex. It is
   * freed by the next init or at process exit. */
}

static void copy_str(char *dst, size_t len, const char *src) {
  snprintf(dst, len, "%s", src ? src : "");
}

static void publish_v(const char *kind, const char *group, int rank, uint64_t client_id, uint32_t old_version,
                      uint32_t new_version, uint64_t step, const char *fmt, va_list ap) {
  epd_event_t ev;
  memset(&ev, 0, sizeof ev);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ev.time_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
  copy_str(ev.kind, sizeof ev.kind, kind);
  copy_str(ev.group, sizeof ev.group, group);
  ev.rank = rank;
  ev.client_id = client_id;
  ev.old_version = old_version;
  ev.new_version = new_version;
  ev.step = step;
  if (fmt) vsnprintf(ev.message, sizeof ev.message, fmt, ap);

  /* Problems are logged as warnings so that they stand out in the journal, map switches as information;
   * the other events repeat what their module logged already (attach, detach, drain, ready): debug. Only
   * the fields that say something: the versions of a switch, a step where there is one. */
  const int warn = !strcmp(ev.kind, "timeout") || !strcmp(ev.kind, "error") ||
                   !strcmp(ev.kind, "client_lost") || !strcmp(ev.kind, "rank_masked") ||
                   !strcmp(ev.kind, "experts_lost");
  const int map = !strcmp(ev.kind, "map_switch") || !strcmp(ev.kind, "rank_unmasked");
  char versions[48] = "", at[32] = "";
  if (map) snprintf(versions, sizeof versions, " (map v%u -> v%u)", old_version, new_version);
  if (step) snprintf(at, sizeof at, " at step %llu", (unsigned long long)step);
  epd_log_group_msg(warn  ? EPD_LOG_WARN
                    : map ? EPD_LOG_INFO
                          : EPD_LOG_DEBUG,
                    EPD_SUB_MAIN, rank, client_id, ev.group, "event %s: %s%s%s", ev.kind, ev.message,
                    versions, at);

  pthread_mutex_lock(&g_ev.mu);
  if (g_ev.ring && !g_ev.closed) {
    ev.seq = ++g_ev.last_seq;
    g_ev.ring[ev.seq % g_ev.cap] = ev;
    pthread_cond_broadcast(&g_ev.cv);
  }
  pthread_mutex_unlock(&g_ev.mu);
}

void epd_events_publish(const char *kind, const char *group, int rank, uint64_t client_id,
                        uint32_t old_version, uint32_t new_version, uint64_t step, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  publish_v(kind, group, rank, client_id, old_version, new_version, step, fmt, ap);
  va_end(ap);
}

void epd_events_from_engine(void *arg, const epd_engine_event_t *ev) {
  (void)arg;
  epd_events_publish(ev->kind, ev->group, ev->rank, ev->client_id, ev->old_version, ev->new_version, ev->step,
                     "%s", ev->message ? ev->message : "");
}

int epd_events_next(uint64_t after, epd_event_t *out, int timeout_ms) {
  struct timespec dl;
  clock_gettime(CLOCK_MONOTONIC, &dl);
  if (timeout_ms > 0) {
    dl.tv_sec += timeout_ms / 1000;
    dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
      dl.tv_sec++;
      dl.tv_nsec -= 1000000000L;
    }
  }
  int rc = 0;
  pthread_mutex_lock(&g_ev.mu);
  for (;;) {
    if (g_ev.closed || !g_ev.ring) {
      rc = -1;
      break;
    }
    if (g_ev.last_seq > after) {
      /* The oldest event still in the ring; anything before it was overwritten (a seq gap). */
      uint64_t oldest = g_ev.last_seq >= g_ev.cap ? g_ev.last_seq - g_ev.cap + 1 : 1;
      uint64_t want = after + 1 > oldest ? after + 1 : oldest;
      *out = g_ev.ring[want % g_ev.cap];
      rc = 1;
      break;
    }
    if (timeout_ms <= 0) break;
    int e = pthread_cond_timedwait(&g_ev.cv, &g_ev.mu, &dl);
    if (e == ETIMEDOUT && g_ev.last_seq <= after && !g_ev.closed) break;
  }
  pthread_mutex_unlock(&g_ev.mu);
  return rc;
}

uint64_t epd_events_last_seq(void) {
  pthread_mutex_lock(&g_ev.mu);
  uint64_t s = g_ev.last_seq;
  pthread_mutex_unlock(&g_ev.mu);
  return s;
}
