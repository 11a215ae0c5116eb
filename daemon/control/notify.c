/*
 * notify.c - sd_notify state changes and the watchdog timer. The timer runs on the daemon's libuv loop,
 * so a loop that stops turning (a stuck handler) stops the pings and systemd restarts the daemon.
 */
#define _GNU_SOURCE
#include "control/notify.h"

#include <stdarg.h>
#include <stdio.h>
#include <systemd/sd-daemon.h>
#include <time.h>

#include "core/log.h"

static uv_timer_t wd_timer;
static int wd_active;
static uint64_t wd_usec;

static void wd_tick(uv_timer_t *t) {
  (void)t;
  sd_notify(0, "WATCHDOG=1");
}

int epd_notify_init(uv_loop_t *loop) {
  uint64_t usec = 0;
  /* > 0 only when WATCHDOG_USEC is set and WATCHDOG_PID is unset or ours. */
  int r = sd_watchdog_enabled(0, &usec);
  if (r <= 0 || usec == 0) return 0;
  wd_usec = usec;
  uint64_t period_ms = usec / 2000;
  if (period_ms == 0) period_ms = 1;
  int rc = uv_timer_init(loop, &wd_timer);
  if (rc != 0) return rc;
  wd_active = 1;
  sd_notify(0, "WATCHDOG=1");
  rc = uv_timer_start(&wd_timer, wd_tick, period_ms, period_ms);
  if (rc != 0) return rc;
  EPD_LOGI(EPD_SUB_MAIN, "systemd watchdog: %llu ms, pinging every %llu ms",
           (unsigned long long)(usec / 1000), (unsigned long long)period_ms);
  return 0;
}

void epd_notify_fini(void) {
  if (!wd_active) return;
  uv_timer_stop(&wd_timer);
  uv_close((uv_handle_t *)&wd_timer, NULL);
  wd_active = 0;
}

uint64_t epd_notify_watchdog_usec(void) {
  return wd_usec;
}

void epd_notify_ready(const char *status) {
  sd_notifyf(0, "READY=1\nSTATUS=%s", status ? status : "ready");
}

void epd_notify_status(const char *fmt, ...) {
  char buf[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  sd_notifyf(0, "STATUS=%s", buf);
}

void epd_notify_reloading(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  /* MONOTONIC_USEC is what newer systemd (Type=notify-reload) wants with RELOADING=1; 252 ignores it. */
  sd_notifyf(0, "RELOADING=1\nSTATUS=reloading configuration\nMONOTONIC_USEC=%llu",
             (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000ull);
}

void epd_notify_stopping(const char *status) {
  sd_notifyf(0, "STOPPING=1\nSTATUS=%s", status ? status : "stopping");
}
