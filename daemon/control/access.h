/*
 * access.h - who may talk to the daemon: the allow lists (daemon.allow_uids / allow_gids) checked for
 * every control and attach connection from its SO_PEERCRED, and the admin set (root, the daemon's own
 * uid, daemon.admin_uids, members of daemon.admin_gid) for the state-changing RPCs SetExpertMap and
 * Drain. Group membership counts the primary gid and the supplementary groups of the peer process
 * (/proc/<pid>/status "Groups:"). Read-only after epd_access_init, so any thread may call the checks.
 */
#ifndef EPD_ACCESS_H
#define EPD_ACCESS_H

#include <stddef.h>
#include <stdint.h>

#include "control/conf.h"

/* Load the lists from conf (empty lists: no restriction); 0, or -1 with err naming the key. */
int epd_access_init(const epd_conf_t *conf, char *err, size_t errlen);
/* Forget the lists (everyone allowed, everyone admin). */
void epd_access_fini(void);
/* 1 if a peer (from SO_PEERCRED) may use a socket; a refusal is logged with pid/uid/gid and what (at
 * most once a second for each of "control" and "attach", with a count). */
int epd_access_allowed(const char *what, int32_t pid, uint32_t uid, uint32_t gid);
/* 1 if a peer may call the admin RPCs; known = 0 (credentials unknown) is refused when an admin set is
 * configured. */
int epd_access_is_admin(int known, int32_t pid, uint32_t uid, uint32_t gid);
/* 1 if the process pid (or its primary gid) is in group gid, reading /proc/<pid>/status. */
int epd_access_in_group(int32_t pid, uint32_t primary_gid, uint32_t gid);

#endif
