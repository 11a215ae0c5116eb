/*
 * state.c - expert maps kept across restarts (see state.h). The file is text, one line per expert:
 *   epd-map 1
 *   version V experts E ranks R slots S
 *   e nrep rank slot [rank slot ...]
 * It is parsed strictly and bounded (E <= 1<<20, replicas <= EPD_MAX_REPLICAS); the engine validates the
 * map again before it is installed.
 */
#define _GNU_SOURCE
#include "control/state.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "control/conf.h"
#include "core/log.h"

static char state_dir[EPD_PATH_MAX];

int epd_state_init(const char *dir, char *err, size_t errlen) {
  snprintf(state_dir, sizeof state_dir, "%s", dir ? dir : "");
  if (!state_dir[0]) return 0;
  char p[EPD_PATH_MAX];
  snprintf(p, sizeof p, "%s", state_dir);
  for (char *s = p + 1; *s; s++)
    if (*s == '/') {
      *s = 0;
      if (mkdir(p, 0750) != 0 && errno != EEXIST) break;
      *s = '/';
    }
  if (mkdir(p, 0750) != 0 && errno != EEXIST) {
    snprintf(err, errlen, "daemon.state_dir: cannot create %s: %s", state_dir, strerror(errno));
    state_dir[0] = 0;
    return -1;
  }
  if (access(state_dir, W_OK | X_OK) != 0) {
    snprintf(err, errlen, "daemon.state_dir: %s is not writable: %s", state_dir, strerror(errno));
    state_dir[0] = 0;
    return -1;
  }
  EPD_LOGI(EPD_SUB_MAIN, "state kept in %s (expert maps)", state_dir);
  return 0;
}

void epd_state_fini(void) {
  state_dir[0] = 0;
}

static int map_path(const char *group, char *buf, size_t len, const char *suffix) {
  size_t off = (size_t)snprintf(buf, len, "%s/map-", state_dir);
  for (const unsigned char *g = (const unsigned char *)group; *g && off + 3 < len; g++)
    off += (size_t)snprintf(buf + off, len - off, "%02x", *g);
  int n = snprintf(buf + off, len > off ? len - off : 0, "%s", suffix);
  return n < 0 || off + (size_t)n >= len ? -1 : 0;
}

int epd_state_save_map(const char *group, const epd_expert_map_t *m) {
  if (!state_dir[0]) return 0;
  char path[EPD_PATH_MAX + 300], tmp[EPD_PATH_MAX + 320];
  if (map_path(group, path, sizeof path, "") || map_path(group, tmp, sizeof tmp, ".tmp")) {
    EPD_LOGW(EPD_SUB_MAIN, "state: path for group %s too long: map not saved", group);
    return -1;
  }
  FILE *f = fopen(tmp, "we");
  if (!f) {
    EPD_LOGW(EPD_SUB_MAIN, "state: cannot write %s: %s", tmp, strerror(errno));
    return -1;
  }
  fprintf(f, "epd-map 1\nversion %u experts %u ranks %u slots %u\n", m->version, m->num_experts, m->num_ranks,
          m->slots_per_rank);
  for (uint32_t e = 0; e < m->num_experts; e++) {
    fprintf(f, "%u %u", e, (unsigned)m->nrep[e]);
    for (uint32_t i = 0; i < m->nrep[e] && i < EPD_MAX_REPLICAS; i++)
      fprintf(f, " %u %u", (unsigned)m->rep[e][i].rank, (unsigned)m->rep[e][i].slot);
    fputc('\n', f);
  }
  int bad = fflush(f) != 0 || fsync(fileno(f)) != 0;
  bad |= fclose(f) != 0;
  if (bad || rename(tmp, path) != 0) {
    EPD_LOGW(EPD_SUB_MAIN, "state: cannot save the map of group %s in %s: %s", group, path, strerror(errno));
    unlink(tmp);
    return -1;
  }
  int dfd = open(state_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) { /* the rename itself survives a crash only once the directory is synced */
    fsync(dfd);
    close(dfd);
  }
  return 0;
}

int epd_state_load_map(const char *group, epd_expert_map_t *out) {
  memset(out, 0, sizeof *out);
  if (!state_dir[0]) return 0;
  char path[EPD_PATH_MAX + 300];
  if (map_path(group, path, sizeof path, "")) return 0;
  FILE *f = fopen(path, "re");
  if (!f) return errno == ENOENT ? 0 : -1;
  unsigned v, E, R, S;
  int ok = fscanf(f, "epd-map 1 version %u experts %u ranks %u slots %u", &v, &E, &R, &S) == 4 && v >= 1 &&
           E >= 1 && E <= (1u << 20) && R >= 1 && R <= 4096 && S >= 1 && S <= (1u << 20);
  if (ok) {
    out->version = v;
    out->num_experts = E;
    out->num_ranks = R;
    out->slots_per_rank = S;
    out->nrep = calloc(E, sizeof *out->nrep);
    out->rep = calloc(E, sizeof *out->rep);
    ok = out->nrep && out->rep;
  }
  for (unsigned e = 0; ok && e < E; e++) {
    unsigned idx, n;
    ok = fscanf(f, "%u %u", &idx, &n) == 2 && idx == e && n >= 1 && n <= EPD_MAX_REPLICAS;
    for (unsigned i = 0; ok && i < n; i++) {
      unsigned r, s;
      ok = fscanf(f, "%u %u", &r, &s) == 2 && r < R && s < S;
      if (ok) {
        out->rep[e][i].rank = r;
        out->rep[e][i].slot = s;
      }
    }
    if (ok) out->nrep[e] = (uint8_t)n;
  }
  fclose(f);
  if (!ok) {
    EPD_LOGW(EPD_SUB_MAIN, "state: %s is corrupt: group %s starts from the default map", path, group);
    epd_expert_map_free(out);
    memset(out, 0, sizeof *out);
    return -1;
  }
  return 1;
}
