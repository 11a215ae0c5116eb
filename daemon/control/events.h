/*
 * events.h - the daemon's event stream: a bounded ring of recent events that the Watch RPC streams and
 * the log records. Thread-safe: publishers are engine threads, the loop and the RPC thread.
 */
#ifndef EPD_EVENTS_H
#define EPD_EVENTS_H

#include <stdint.h>

#include "core/engine.h"

#define EPD_EVENT_TEXT 192

typedef struct epd_event {
  uint64_t seq, time_ns;
  char kind[24];
  char group[EPD_GROUP_NAME_MAX];
  int rank;
  uint64_t client_id;
  uint32_t old_version, new_version;
  uint64_t step;
  char message[EPD_EVENT_TEXT];
} epd_event_t;

int epd_events_init(unsigned capacity);
void epd_events_fini(void);
/* Record an event (also logged at INFO/WARN). */
void epd_events_publish(const char *kind, const char *group, int rank, uint64_t client_id,
                        uint32_t old_version, uint32_t new_version, uint64_t step, const char *fmt, ...)
    __attribute__((format(printf, 8, 9)));
/* Adapter with the engine's event-callback signature. */
void epd_events_from_engine(void *arg, const epd_engine_event_t *ev);
/* Copy the next event with seq > after into *out, waiting up to timeout_ms; 1 if one was copied, 0 on
 * timeout, -1 after epd_events_fini() started (wakes every waiter). Events older than the ring are lost
 * (the caller sees a seq gap). */
int epd_events_next(uint64_t after, epd_event_t *out, int timeout_ms);
/* Sequence number of the latest event (0 if none). */
uint64_t epd_events_last_seq(void);

#endif
