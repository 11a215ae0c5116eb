/*
 * notify.h - the systemd side: sd_notify READY/STATUS/RELOADING/STOPPING and the watchdog, a libuv timer
 * that sends WATCHDOG=1 at half the interval systemd asked for (WATCHDOG_USEC). Every call is a no-op
 * when the daemon was not started by systemd (no NOTIFY_SOCKET). Loop thread only.
 */
#ifndef EPD_NOTIFY_H
#define EPD_NOTIFY_H

#include <stdint.h>
#include <uv.h>

/* Start the watchdog timer on loop if systemd enabled it; returns 0 (or a negative libuv error). */
int epd_notify_init(uv_loop_t *loop);
/* Stop the watchdog timer (closing its handle). */
void epd_notify_fini(void);
/* READY=1 with a STATUS= line. */
void epd_notify_ready(const char *status);
/* STATUS= line only. */
void epd_notify_status(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* RELOADING=1 (with MONOTONIC_USEC) before a reload; follow with epd_notify_ready(). */
void epd_notify_reloading(void);
/* STOPPING=1 with a STATUS= line. */
void epd_notify_stopping(const char *status);
/* Watchdog interval systemd asked for in microseconds (0 = no watchdog). */
uint64_t epd_notify_watchdog_usec(void);

#endif
