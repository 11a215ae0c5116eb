/*
 * epd_paths.h - the default control socket path, shared by the daemon (daemon/rpc.c) and the client
 * (client/rpc_client.c). Header-only because the daemon and libepd link disjoint object sets.
 */
#ifndef EPD_PATHS_H
#define EPD_PATHS_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* Default control socket path (no environment override): /run/epd/control.sock for root, else
 * $XDG_RUNTIME_DIR/epd/control.sock, else /tmp/epd-<uid>/control.sock. Returns buf. */
static inline const char *epd_paths_control_default(char *buf, size_t len) {
  const char *xdg = getenv("XDG_RUNTIME_DIR");
  if (geteuid() == 0)
    snprintf(buf, len, "/run/epd/control.sock");
  else if (xdg && *xdg)
    snprintf(buf, len, "%s/epd/control.sock", xdg);
  else
    snprintf(buf, len, "/tmp/epd-%u/control.sock", (unsigned)geteuid());
  return buf;
}

#endif
