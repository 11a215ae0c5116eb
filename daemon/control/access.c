/*
 * access.c - allow lists and the admin set (see access.h). The lists are parsed once from the
 * configuration (conf.c already validated them) into small arrays; checks are linear scans.
 */
#define _GNU_SOURCE
#include "control/access.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/log.h"

typedef struct id_list {
  uint32_t ids[EPD_CONF_MAX_IDS];
  int n;
} id_list_t;

static struct {
  id_list_t allow_uids, allow_gids, admin_uids, admin_gids;
  uint32_t self_uid;
} A;

static int load(id_list_t *l, const char *key, const char *text, int groups, char *err, size_t errlen) {
  char msg[192];
  l->n = epd_conf_parse_ids(text, groups, l->ids, EPD_CONF_MAX_IDS, msg, sizeof msg);
  if (l->n < 0) {
    snprintf(err, errlen, "%s: %s", key, msg);
    l->n = 0;
    return -1;
  }
  return 0;
}

int epd_access_init(const epd_conf_t *conf, char *err, size_t errlen) {
  memset(&A, 0, sizeof A);
  A.self_uid = (uint32_t)getuid();
  if (load(&A.allow_uids, "daemon.allow_uids", conf->allow_uids, 0, err, errlen) ||
      load(&A.allow_gids, "daemon.allow_gids", conf->allow_gids, 1, err, errlen) ||
      load(&A.admin_uids, "daemon.admin_uids", conf->admin_uids, 0, err, errlen) ||
      load(&A.admin_gids, "daemon.admin_gid", conf->admin_gid, 1, err, errlen)) {
    memset(&A, 0, sizeof A);
    return -1;
  }
  if (A.allow_uids.n || A.allow_gids.n)
    EPD_LOGI(EPD_SUB_MAIN, "access: %d allowed uid(s), %d allowed gid(s)", A.allow_uids.n, A.allow_gids.n);
  if (A.admin_uids.n || A.admin_gids.n)
    EPD_LOGI(EPD_SUB_MAIN, "access: SetExpertMap and Drain limited to root, uid %u, %d uid(s), %d group(s)",
             A.self_uid, A.admin_uids.n, A.admin_gids.n);
  return 0;
}

void epd_access_fini(void) {
  memset(&A, 0, sizeof A);
}

static int has(const id_list_t *l, uint32_t id) {
  for (int i = 0; i < l->n; i++)
    if (l->ids[i] == id) return 1;
  return 0;
}

int epd_access_in_group(int32_t pid, uint32_t primary_gid, uint32_t gid) {
  if (primary_gid == gid) return 1;
  if (pid <= 0) return 0;
  char path[64], line[4096];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "re");
  if (!f) return 0;
  int found = 0;
  while (!found && fgets(line, sizeof line, f)) {
    if (strncmp(line, "Groups:", 7)) continue;
    char *p = line + 7, *end;
    for (;;) {
      unsigned long v = strtoul(p, &end, 10);
      if (end == p) break;
      if (v == gid) found = 1;
      p = end;
    }
    break;
  }
  fclose(f);
  return found;
}

static int in_any_group(const id_list_t *l, int32_t pid, uint32_t gid) {
  for (int i = 0; i < l->n; i++)
    if (epd_access_in_group(pid, gid, l->ids[i])) return 1;
  return 0;
}

int epd_access_allowed(const char *what, int32_t pid, uint32_t uid, uint32_t gid) {
  /* One line a second per socket at most: a refused user may connect in a loop. */
  static epd_log_ratelimit_t rl_control = EPD_LOG_RATELIMIT_INITIALIZER(1000),
                             rl_attach = EPD_LOG_RATELIMIT_INITIALIZER(1000),
                             rl_other = EPD_LOG_RATELIMIT_INITIALIZER(1000);
  if (!A.allow_uids.n && !A.allow_gids.n) return 1;
  if (has(&A.allow_uids, uid) || in_any_group(&A.allow_gids, pid, gid)) return 1;
  epd_log_ratelimit_t *rl = !strcmp(what, "control")  ? &rl_control
                            : !strcmp(what, "attach") ? &rl_attach
                                                      : &rl_other;
  epd_log_ratelimited(rl, EPD_LOG_WARN, EPD_SUB_MAIN,
                      "%s connection refused: pid %d uid %u gid %u is not in daemon.allow_uids/allow_gids",
                      what, (int)pid, (unsigned)uid, (unsigned)gid);
  return 0;
}

int epd_access_is_admin(int known, int32_t pid, uint32_t uid, uint32_t gid) {
  if (!A.admin_uids.n && !A.admin_gids.n) return 1;
  if (!known) return 0;
  return uid == 0 || uid == A.self_uid || has(&A.admin_uids, uid) || in_any_group(&A.admin_gids, pid, gid);
}
