/*
 * log.c - levels, subsystem filter, stderr lines "YYYY-mm-ddTHH:MM:SS.mmm LEVEL subsys: message" or
 * journald records with PRIORITY, EPD_SUBSYSTEM, EPD_RANK, EPD_CLIENT and EPD_GROUP fields.
 */
#define _GNU_SOURCE
#include "core/log.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/time.h>
#include <syslog.h>
#include <time.h>
#define SD_JOURNAL_SUPPRESS_LOCATION
#include <systemd/sd-journal.h>

static const char *const level_names[] = {"error", "warn", "info", "debug", "trace"};
static const char *const level_upper[] = {"ERROR", "WARN", "INFO", "DEBUG", "TRACE"};
static const int level_prio[] = {LOG_ERR, LOG_WARNING, LOG_INFO, LOG_DEBUG, LOG_DEBUG};
static const char *const sub_names[] = {"main", "conf", "rpc", "attach", "engine", "cuda", "metrics"};
#define NSUBS (sizeof sub_names / sizeof sub_names[0])
#define KNOWN_SUBS ((1u << NSUBS) - 1u)

static atomic_int cur_level = EPD_LOG_INFO;
static atomic_uint cur_mask = EPD_SUB_ALL;
static atomic_int journal;
/* One lock so that lines from several threads never interleave. */
static pthread_mutex_t out_lock = PTHREAD_MUTEX_INITIALIZER;

void epd_log_init(int level, uint32_t subsystems, int to_journal) {
  epd_log_set(level, subsystems);
  atomic_store(&journal, to_journal != 0);
}

void epd_log_fini(void) {
  fflush(stderr);
}

void epd_log_set(int level, uint32_t subsystems) {
  if (level < EPD_LOG_ERROR) level = EPD_LOG_ERROR;
  if (level > EPD_LOG_TRACE) level = EPD_LOG_TRACE;
  atomic_store(&cur_level, level);
  atomic_store(&cur_mask, subsystems);
}

int epd_log_level(void) {
  return atomic_load(&cur_level);
}
uint32_t epd_log_subsystems(void) {
  return atomic_load(&cur_mask);
}

int epd_log_level_parse(const char *s) {
  for (int i = 0; i <= EPD_LOG_TRACE; i++)
    if (!strcasecmp(s, level_names[i])) return i;
  if (!strcasecmp(s, "warning")) return EPD_LOG_WARN;
  return -1;
}

const char *epd_log_level_name(int level) {
  return level >= EPD_LOG_ERROR && level <= EPD_LOG_TRACE ? level_names[level] : "?";
}

int epd_log_subsystems_parse(const char *s, uint32_t *mask) {
  uint32_t m = 0;
  const char *p = s;
  while (*p) {
    size_t n = strcspn(p, ", ");
    if (n > 0) {
      size_t i;
      if (n == 3 && !strncasecmp(p, "all", 3)) {
        m = EPD_SUB_ALL;
      } else {
        for (i = 0; i < NSUBS; i++)
          if (strlen(sub_names[i]) == n && !strncasecmp(p, sub_names[i], n)) break;
        if (i == NSUBS) return -1;
        m |= 1u << i;
      }
    }
    p += n;
    while (*p == ',' || *p == ' ') p++;
  }
  if (m == 0) return -1; /* an empty list would silence everything: say "error" level instead */
  *mask = m;
  return 0;
}

void epd_log_subsystems_format(uint32_t mask, char *buf, size_t len) {
  size_t off = 0;
  if (len == 0) return;
  buf[0] = '\0';
  if ((mask & KNOWN_SUBS) == KNOWN_SUBS) {
    snprintf(buf, len, "all");
    return;
  }
  for (size_t i = 0; i < NSUBS; i++) {
    if (!(mask & (1u << i))) continue;
    int n = snprintf(buf + off, len - off, "%s%s", off ? "," : "", sub_names[i]);
    if (n < 0 || (size_t)n >= len - off) break;
    off += (size_t)n;
  }
}

static const char *sub_name(uint32_t sub) {
  for (size_t i = 0; i < NSUBS; i++)
    if (sub & (1u << i)) return sub_names[i];
  return "epd";
}

static void log_va(int level, uint32_t sub, int rank, uint64_t client, const char *group, const char *fmt,
                   va_list ap) __attribute__((format(printf, 6, 0)));

void epd_log_msg(int level, uint32_t sub, int rank, uint64_t client, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  log_va(level, sub, rank, client, NULL, fmt, ap);
  va_end(ap);
}

void epd_log_group_msg(int level, uint32_t sub, int rank, uint64_t client, const char *group, const char *fmt,
                       ...) {
  va_list ap;
  va_start(ap, fmt);
  log_va(level, sub, rank, client, group, fmt, ap);
  va_end(ap);
}

static void log_va(int level, uint32_t sub, int rank, uint64_t client, const char *group, const char *fmt,
                   va_list ap) {
  if (level > atomic_load(&cur_level)) return;
  /* Errors always pass the subsystem filter: a filter must never hide why the daemon failed. */
  if (level > EPD_LOG_ERROR && !(sub & atomic_load(&cur_mask))) return;
  if (level < EPD_LOG_ERROR) level = EPD_LOG_ERROR;
  if (level > EPD_LOG_TRACE) level = EPD_LOG_TRACE;
  char msg[1024];
  vsnprintf(msg, sizeof msg, fmt, ap);
  if (!group) group = "";
  const char *sn = sub_name(sub);
  if (atomic_load(&journal)) {
    char rs[16] = "", cs[24] = "";
    snprintf(rs, sizeof rs, "%d", rank);
    snprintf(cs, sizeof cs, "%llu", (unsigned long long)client);
    sd_journal_send("MESSAGE=%s: %s", sn, msg, "PRIORITY=%d", level_prio[level], "SYSLOG_IDENTIFIER=epd",
                    "EPD_SUBSYSTEM=%s", sn, "EPD_RANK=%s", rank >= 0 ? rs : "", "EPD_CLIENT=%s",
                    client ? cs : "", "EPD_GROUP=%s", group, NULL);
    return;
  }
  struct timeval tv;
  struct tm tm;
  char ts[32], extra[64] = "", gx[EPD_LOG_GROUP_MAX + 8] = "";
  gettimeofday(&tv, NULL);
  localtime_r(&tv.tv_sec, &tm);
  strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
  if (rank >= 0 && client)
    snprintf(extra, sizeof extra, " rank=%d client=%llu", rank, (unsigned long long)client);
  else if (rank >= 0)
    snprintf(extra, sizeof extra, " rank=%d", rank);
  else if (client)
    snprintf(extra, sizeof extra, " client=%llu", (unsigned long long)client);
  if (*group) snprintf(gx, sizeof gx, " group=%.*s", EPD_LOG_GROUP_MAX, group);
  pthread_mutex_lock(&out_lock);
  fprintf(stderr, "%s.%03d %s %s: %s%s%s\n", ts, (int)(tv.tv_usec / 1000), level_upper[level], sn, msg, extra,
          gx);
  fflush(stderr);
  pthread_mutex_unlock(&out_lock);
}

/* One lock for every rate limit: they are touched once per event, never on a hot path. */
static pthread_mutex_t rl_lock = PTHREAD_MUTEX_INITIALIZER;

int epd_log_ratelimited(epd_log_ratelimit_t *rl, int level, uint32_t sub, const char *fmt, ...) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
  pthread_mutex_lock(&rl_lock);
  if (rl->next_ns && now < rl->next_ns) {
    rl->suppressed++;
    pthread_mutex_unlock(&rl_lock);
    return 0;
  }
  uint64_t times = rl->suppressed + 1;
  rl->suppressed = 0;
  rl->next_ns = now + (uint64_t)rl->interval_ms * 1000000ull;
  pthread_mutex_unlock(&rl_lock);
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (times > 1)
    epd_log_msg(level, sub, -1, 0, "%s (%llu times since the last report)", msg, (unsigned long long)times);
  else
    epd_log_msg(level, sub, -1, 0, "%s", msg);
  return 1;
}
