/*
 * log.h - structured logging by level and subsystem. To journald (with RANK/CLIENT/GROUP fields) when
 * run by systemd, else to stderr as "time level subsystem: message key=value". Thread-safe.
 */
#ifndef EPD_LOG_H
#define EPD_LOG_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

enum { EPD_LOG_ERROR = 0, EPD_LOG_WARN = 1, EPD_LOG_INFO = 2, EPD_LOG_DEBUG = 3, EPD_LOG_TRACE = 4 };

/* Subsystem bits (for the subsystem filter). */
enum {
  EPD_SUB_MAIN = 1u << 0,
  EPD_SUB_CONF = 1u << 1,
  EPD_SUB_RPC = 1u << 2,
  EPD_SUB_ATTACH = 1u << 3,
  EPD_SUB_ENGINE = 1u << 4,
  EPD_SUB_CUDA = 1u << 5,
  EPD_SUB_METRICS = 1u << 6,
  EPD_SUB_ALL = 0xffffffffu
};

/* Set the level and subsystem mask; to_journal != 0 sends records to journald. */
void epd_log_init(int level, uint32_t subsystems, int to_journal);
void epd_log_fini(void);
/* Change level/mask at runtime (SIGHUP reload). */
void epd_log_set(int level, uint32_t subsystems);
/* Parse "error|warn|info|debug|trace"; -1 if unknown. */
int epd_log_level_parse(const char *s);
/* Parse a comma list of subsystem names ("all", "main,rpc,..."); returns 0 and sets *mask, or -1. */
int epd_log_subsystems_parse(const char *s, uint32_t *mask);
/* Name of a level ("info"); "?" if out of range. */
const char *epd_log_level_name(int level);
/* Format a subsystem mask as the comma list epd_log_subsystems_parse() reads ("all" for every bit). */
void epd_log_subsystems_format(uint32_t mask, char *buf, size_t len);
/* Current level and mask. */
int epd_log_level(void);
uint32_t epd_log_subsystems(void);
/* Log one record; rank/client may be -1/0 when not applicable. */
void epd_log_msg(int level, uint32_t sub, int rank, uint64_t client, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

#define EPD_LOG_GROUP_MAX 64
/* Same, for a record about an EP group (journald field EPD_GROUP, " group=" on stderr). */
void epd_log_group_msg(int level, uint32_t sub, int rank, uint64_t client, const char *group, const char *fmt,
                       ...) __attribute__((format(printf, 6, 7)));

/* A rate limit for one recurring record (an accept error under a flood): at most one record per
 * interval_ms, which counts the events it stands for. Keep one per message site, e.g. a static
 * initialised with EPD_LOG_RATELIMIT_INITIALIZER(1000); any thread may use it (log.c locks). */
typedef struct epd_log_ratelimit {
  uint32_t interval_ms;
  uint64_t next_ns;    /* CLOCK_MONOTONIC time before which nothing more is logged */
  uint64_t suppressed; /* events not logged since the last record */
} epd_log_ratelimit_t;
#define EPD_LOG_RATELIMIT_INITIALIZER(ms) \
  { (ms), 0, 0 }
/* Count one event and log it, unless a record of rl went out less than interval_ms ago; a record that
 * follows suppressed events ends with "(N times since the last report)". Returns 1 if it logged. */
int epd_log_ratelimited(epd_log_ratelimit_t *rl, int level, uint32_t sub, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define EPD_LOGE(sub, ...) epd_log_msg(EPD_LOG_ERROR, sub, -1, 0, __VA_ARGS__)
#define EPD_LOGW(sub, ...) epd_log_msg(EPD_LOG_WARN, sub, -1, 0, __VA_ARGS__)
#define EPD_LOGI(sub, ...) epd_log_msg(EPD_LOG_INFO, sub, -1, 0, __VA_ARGS__)
#define EPD_LOGD(sub, ...) epd_log_msg(EPD_LOG_DEBUG, sub, -1, 0, __VA_ARGS__)

#endif
