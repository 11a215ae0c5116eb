/*
 * epdctl - inspect and control a running epd daemon over its control socket.
 *   epdctl [-s socket] [--json] [--timeout MS] status|metrics|clients|config|experts [group]|
 *          set-map FILE|drain [--exit]|health [service]|watch [--count N]|
 *          top [--iterations N] [--interval-ms MS] (q or Ctrl-C quits)
 * Exit status 0 on success; 1 with the daemon's error text otherwise (health: 1 when not SERVING).
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "epd.h"
#include "epd.pb-c.h"
#include "health.pb-c.h"
#include "rpc_client.h"

#ifndef EPD_VERSION
#define EPD_VERSION "unknown"
#endif

static int json;
static char err[1024];

static void usage(FILE *f) {
  fprintf(f,
          "usage: epdctl [-s SOCKET] [--json] [--timeout MS] COMMAND [ARGS]\n"
          "commands:\n"
          "  status             backend, mode, state, ranks, groups, clients\n"
          "  metrics            Prometheus text format\n"
          "  clients            attached clients\n"
          "  config             effective daemon configuration\n"
          "  experts [GROUP]    active expert map (GROUP default: \"default\")\n"
          "  set-map FILE       stage an expert map (format: the output of `epdctl experts`, plus optional\n"
          "                     \"copy R:S -> R:S\" weight-migration lines; '-' = stdin)\n"
          "  drain [--exit]     refuse new attaches and dispatches (combines still run); --exit: exit when "
          "the last client left\n"
          "  health [SERVICE]   grpc.health.v1 status (exit 1 unless SERVING)\n"
          "  watch [--count N]  print events as they happen (N: stop after N events)\n"
          "  top [--iterations N] [--interval-ms MS]\n"
          "                     live view: per-rank ops, ops/s, clients, op latency p50, last events\n"
          "                     (N: stop after N frames, default: until quit; MS: refresh period, default\n"
          "                     1000); q or Ctrl-C quits\n"
          "socket: -s, else $EPD_SOCKET, else the daemon's default path\n");
}

/* ---- JSON helpers --------------------------------------------------------------------------------- */

static void jstr(const char *s) {
  putchar('"');
  for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
    if (*p == '"' || *p == '\\')
      printf("\\%c", *p);
    else if (*p == '\n')
      printf("\\n");
    else if (*p == '\t')
      printf("\\t");
    else if (*p < 0x20)
      printf("\\u%04x", *p);
    else
      putchar(*p);
  }
  putchar('"');
}

static void jkey(const char *k, int *first) {
  printf("%s", *first ? "" : ",");
  *first = 0;
  jstr(k);
  putchar(':');
}

static void jkv_s(const char *k, const char *v, int *first) {
  jkey(k, first);
  jstr(v);
}

static void jkv_u(const char *k, uint64_t v, int *first) {
  jkey(k, first);
  printf("%" PRIu64, v);
}

static void jkv_i(const char *k, int64_t v, int *first) {
  jkey(k, first);
  printf("%" PRId64, v);
}

/* ---- formatting ----------------------------------------------------------------------------------- */

static const char *human_bytes(uint64_t b, char *buf, size_t len) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)b;
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    u++;
  }
  if (u == 0)
    snprintf(buf, len, "%" PRIu64 " B", b);
  else
    snprintf(buf, len, "%.1f %s", v, units[u]);
  return buf;
}

static void json_client(const Epd__V1__ClientStatus *c) {
  int f = 1;
  putchar('{');
  jkv_u("client_id", c->client_id, &f);
  jkv_s("name", c->name, &f);
  jkv_s("group", c->group, &f);
  jkv_i("rank", c->rank, &f);
  jkv_u("pid", c->pid, &f);
  jkv_u("uid", c->uid, &f);
  jkv_u("ops", c->ops, &f);
  jkv_u("attached_ns", c->attached_ns, &f);
  jkv_u("arena_bytes", c->arena_bytes, &f);
  putchar('}');
}

static void print_status_json(const Epd__V1__StatusReply *s) {
  int f = 1;
  putchar('{');
  jkv_s("version", s->version, &f);
  jkv_s("backend", s->backend, &f);
  jkv_s("engine_mode", s->engine_mode, &f);
  jkv_s("state", s->state, &f);
  jkv_u("num_ranks", s->num_ranks, &f);
  jkv_u("nodes", s->nodes ? s->nodes : 1, &f);
  jkv_u("node_rank", s->node_rank, &f);
  jkv_u("world_ranks", s->world_ranks ? s->world_ranks : s->num_ranks, &f);
  jkv_s("inter_node_transport",
        s->inter_node_transport && *s->inter_node_transport ? s->inter_node_transport : "none", &f);
  jkv_s("gin", s->gin ? s->gin : "", &f);
  jkv_s("rendezvous", s->rendezvous ? s->rendezvous : "", &f);
  jkv_s("links", s->links ? s->links : "", &f);
  jkv_u("uptime_ms", s->uptime_ms, &f);
  jkey("draining", &f);
  printf("%s", s->draining ? "true" : "false");
  jkv_u("protocol_version", s->protocol_version, &f);
  jkey("ranks", &f);
  putchar('[');
  for (size_t i = 0; i < s->n_ranks; i++) {
    const Epd__V1__RankStatus *r = s->ranks[i];
    int g = 1;
    printf("%s{", i ? "," : "");
    jkv_i("rank", r->rank, &g);
    jkv_i("device", r->device, &g);
    jkv_s("device_uuid", r->device_uuid, &g);
    jkv_u("gpu_ranks", r->gpu_ranks, &g);
    jkv_u("buffer_bytes", r->buffer_bytes, &g);
    jkv_u("clients", r->clients, &g);
    jkv_u("ops", r->ops, &g);
    putchar('}');
  }
  putchar(']');
  jkey("groups", &f);
  putchar('[');
  for (size_t i = 0; i < s->n_groups; i++) {
    const Epd__V1__GroupStatus *gr = s->groups[i];
    int g = 1;
    printf("%s{", i ? "," : "");
    jkv_s("name", gr->name, &g);
    jkv_u("num_experts", gr->num_experts, &g);
    jkv_u("hidden", gr->hidden, &g);
    jkv_u("topk", gr->topk, &g);
    jkv_u("max_tokens", gr->max_tokens, &g);
    jkv_u("attached_ranks", gr->attached_ranks, &g);
    jkv_u("steps", gr->steps, &g);
    jkv_u("map_version", gr->map_version, &g);
    jkv_s("mode", gr->mode, &g);
    jkv_s("nodes", gr->nodes ? gr->nodes : "", &g);
    jkv_s("on_rank_loss", gr->on_rank_loss && *gr->on_rank_loss ? gr->on_rank_loss : "fail", &g);
    jkv_u("masked_ranks", gr->masked_ranks, &g);
    jkv_u("masks", gr->masks, &g);
    jkv_u("entries_dropped", gr->entries_dropped, &g);
    putchar('}');
  }
  putchar(']');
  jkey("clients", &f);
  putchar('[');
  for (size_t i = 0; i < s->n_clients; i++) {
    if (i) putchar(',');
    json_client(s->clients[i]);
  }
  printf("]}\n");
}

static void print_clients_table(const Epd__V1__StatusReply *s) {
  printf("%-8s %-20s %-16s %4s %8s %6s %10s %12s\n", "ID", "NAME", "GROUP", "RANK", "PID", "UID", "OPS",
         "ARENA");
  for (size_t i = 0; i < s->n_clients; i++) {
    const Epd__V1__ClientStatus *c = s->clients[i];
    char hb[32];
    printf("%-8" PRIu64 " %-20s %-16s %4d %8u %6u %10" PRIu64 " %12s\n", c->client_id, c->name, c->group,
           c->rank, c->pid, c->uid, c->ops, human_bytes(c->arena_bytes, hb, sizeof hb));
  }
}

static void print_status_human(const Epd__V1__StatusReply *s) {
  printf("epd %s (protocol %u)\n", s->version, s->protocol_version);
  printf("backend:  %s\n", s->backend);
  printf("mode:     %s\n", s->engine_mode);
  printf("state:    %s%s\n", s->state, s->draining ? " (draining)" : "");
  printf("uptime:   %.1f s\n", (double)s->uptime_ms / 1e3);
  printf("ranks:    %u\n", s->num_ranks);
  if (s->nodes > 1)
    printf("cluster:  node %u of %u, %u world ranks, inter-node transport %s%s%s\n", s->node_rank, s->nodes,
           s->world_ranks, s->inter_node_transport, s->rendezvous && *s->rendezvous ? ", rendezvous " : "",
           s->rendezvous ? s->rendezvous : "");
  if (s->links && *s->links) printf("links:    %s\n", s->links);
  if (s->gin && *s->gin) printf("gin:      %s\n", s->gin);
  /* Buffer bytes in one human-readable column; the exact count is in --json and the metrics. */
  printf("  %4s %6s %10s %7s %10s  %s\n", "RANK", "DEVICE", "BUFFERS", "CLIENTS", "OPS", "GPU");
  for (size_t i = 0; i < s->n_ranks; i++) {
    const Epd__V1__RankStatus *r = s->ranks[i];
    char hb[32];
    char shared[40] = "";
    if (r->gpu_ranks > 1) snprintf(shared, sizeof shared, " (shared by %u ranks)", r->gpu_ranks);
    printf("  %4d %6d %10s %7u %10" PRIu64 "  %s%s\n", r->rank, r->device,
           human_bytes(r->buffer_bytes, hb, sizeof hb), r->clients, r->ops,
           r->device_uuid && r->device_uuid[0] ? r->device_uuid : "-", shared);
  }
  printf("groups:   %zu\n", s->n_groups);
  if (s->n_groups)
    printf("  %-16s %7s %6s %4s %10s %5s %10s %4s  %s\n", "NAME", "EXPERTS", "HIDDEN", "TOPK", "MAX_TOKENS",
           "RANKS", "STEPS", "MAP", "MODE");
  for (size_t i = 0; i < s->n_groups; i++) {
    const Epd__V1__GroupStatus *g = s->groups[i];
    printf("  %-16s %7u %6u %4u %10u %5u %10" PRIu64 " %4u  %s\n", g->name, g->num_experts, g->hidden,
           g->topk, g->max_tokens, g->attached_ranks, g->steps, g->map_version,
           g->mode && *g->mode ? g->mode : "-");
    if (g->nodes && *g->nodes) printf("  %-16s across nodes: %s\n", "", g->nodes);
    if (g->on_rank_loss && !strcmp(g->on_rank_loss, "mask")) {
      char list[256] = "none";
      size_t n = 0;
      for (int r = 0; r < 64; r++)
        if (g->masked_ranks >> r & 1 && n < sizeof list)
          n += (size_t)snprintf(list + n, sizeof list - n, "%s%d", n ? "," : "", r);
      printf("  %-16s on rank loss: mask%s; masked now: %s; masked so far: %" PRIu64
             "; entries dropped: %" PRIu64 "\n",
             "", g->renormalize ? " (renormalize)" : "", list, g->masks, g->entries_dropped);
    }
  }
  printf("clients:  %zu\n", s->n_clients);
  if (s->n_clients) {
    for (size_t i = 0; i < s->n_clients; i++) {
      const Epd__V1__ClientStatus *c = s->clients[i];
      printf("  %-8" PRIu64 " %-20s group %-16s rank %d pid %u ops %" PRIu64 "\n", c->client_id, c->name,
             c->group, c->rank, c->pid, c->ops);
    }
  }
}

/* ---- commands ------------------------------------------------------------------------------------- */

static Epd__V1__StatusReply *get_status(epd_rpc_t *rpc) {
  Epd__V1__GetStatusRequest q = EPD__V1__GET_STATUS_REQUEST__INIT;
  q.protocol_version = EPD_PROTOCOL_VERSION;
  ProtobufCMessage *rep = NULL;
  if (epd_rpc_call(rpc, "/epd.v1.Control/GetStatus", &q.base, &epd__v1__status_reply__descriptor, &rep, err,
                   sizeof err) != EPD_OK)
    return NULL;
  return (Epd__V1__StatusReply *)rep;
}

static int cmd_status(epd_rpc_t *rpc, const char *what) {
  Epd__V1__StatusReply *s = get_status(rpc);
  if (!s) return 1;
  if (!strcmp(what, "config")) {
    if (json) {
      /* "key = value" lines as a JSON object. */
      int f = 1;
      putchar('{');
      char *text = strdup(s->config), *save = NULL;
      for (char *line = text ? strtok_r(text, "\n", &save) : NULL; line; line = strtok_r(NULL, "\n", &save)) {
        char *eq = strstr(line, " = ");
        if (!eq) continue;
        *eq = 0;
        jkv_s(line, eq + 3, &f);
      }
      free(text);
      printf("}\n");
    } else {
      fputs(s->config, stdout);
      if (s->config[0] && s->config[strlen(s->config) - 1] != '\n') putchar('\n');
    }
  } else if (!strcmp(what, "clients")) {
    if (json) {
      putchar('[');
      for (size_t i = 0; i < s->n_clients; i++) {
        if (i) putchar(',');
        json_client(s->clients[i]);
      }
      printf("]\n");
    } else {
      print_clients_table(s);
    }
  } else if (json) {
    print_status_json(s);
  } else {
    print_status_human(s);
  }
  protobuf_c_message_free_unpacked(&s->base, NULL);
  return 0;
}

static int cmd_metrics(epd_rpc_t *rpc) {
  Epd__V1__GetMetricsRequest q = EPD__V1__GET_METRICS_REQUEST__INIT;
  q.protocol_version = EPD_PROTOCOL_VERSION;
  ProtobufCMessage *rep = NULL;
  if (epd_rpc_call(rpc, "/epd.v1.Control/GetMetrics", &q.base, &epd__v1__metrics_reply__descriptor, &rep, err,
                   sizeof err) != EPD_OK)
    return 1;
  fputs(((Epd__V1__MetricsReply *)rep)->text, stdout);
  protobuf_c_message_free_unpacked(rep, NULL);
  return 0;
}

static int cmd_experts(epd_rpc_t *rpc, const char *group) {
  Epd__V1__GetExpertMapRequest q = EPD__V1__GET_EXPERT_MAP_REQUEST__INIT;
  q.protocol_version = EPD_PROTOCOL_VERSION;
  q.group = (char *)(group ? group : "");
  ProtobufCMessage *rep = NULL;
  if (epd_rpc_call(rpc, "/epd.v1.Control/GetExpertMap", &q.base, &epd__v1__expert_map__descriptor, &rep, err,
                   sizeof err) != EPD_OK)
    return 1;
  const Epd__V1__ExpertMap *m = (const Epd__V1__ExpertMap *)rep;
  if (json) {
    int f = 1;
    putchar('{');
    jkv_s("group", m->group, &f);
    jkv_u("version", m->version, &f);
    jkv_u("num_ranks", m->num_ranks, &f);
    jkv_u("slots_per_rank", m->slots_per_rank, &f);
    jkey("experts", &f);
    putchar('[');
    for (size_t i = 0; i < m->n_experts; i++) {
      printf("%s{\"expert\":%u,\"replicas\":[", i ? "," : "", m->experts[i]->expert);
      for (size_t k = 0; k < m->experts[i]->n_replicas; k++)
        printf("%s{\"rank\":%u,\"slot\":%u}", k ? "," : "", m->experts[i]->replicas[k]->rank,
               m->experts[i]->replicas[k]->slot);
      printf("]}");
    }
    printf("]}\n");
  } else {
    printf("group %s version %u num_ranks %u slots_per_rank %u\n", m->group, m->version, m->num_ranks,
           m->slots_per_rank);
    for (size_t i = 0; i < m->n_experts; i++) {
      printf("expert %u:", m->experts[i]->expert);
      for (size_t k = 0; k < m->experts[i]->n_replicas; k++)
        printf(" %u:%u", m->experts[i]->replicas[k]->rank, m->experts[i]->replicas[k]->slot);
      putchar('\n');
    }
  }
  protobuf_c_message_free_unpacked(rep, NULL);
  return 0;
}

/* A parsed map file: placements allocated in one array each. */
typedef struct map_file {
  Epd__V1__ExpertMap map;
  Epd__V1__ExpertPlacement *pl, **plp;
  Epd__V1__Replica *rp, **rpp;
  size_t npl, nrp, cappl, caprp;
  Epd__V1__WeightCopy *wc, **wcp; /* "copy R:S -> R:S" lines (weight migration) */
  size_t nwc, capwc;
  char group[128];
} map_file_t;

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap) return 0;
  size_t n = *cap ? *cap * 2 : 64;
  while (n < need) n *= 2;
  void *q = realloc(*p, n * elem);
  if (!q) return -1;
  *p = q;
  *cap = n;
  return 0;
}

/* Parse the `epdctl experts` format: "group NAME [num_ranks N] [slots_per_rank N] [version V]" and
 * "expert E: R:S [R:S...]" lines ("expert" and the colon after E are optional; '#' starts a comment),
 * plus "copy R:S -> R:S" lines: expert weights the daemon copies before the map takes effect. */
static int parse_map(FILE *f, const char *fname, map_file_t *mf) {
  char line[8192];
  int ln = 0;
  epd__v1__expert_map__init(&mf->map);
  while (fgets(line, sizeof line, f)) {
    ln++;
    char *hash = strchr(line, '#');
    if (hash) *hash = 0;
    char *save = NULL, *tok = strtok_r(line, " \t\r\n", &save);
    if (!tok) continue;
    if (!strcmp(tok, "group")) {
      char *name = strtok_r(NULL, " \t\r\n", &save);
      if (!name) {
        snprintf(err, sizeof err, "%s:%d: group: missing name", fname, ln);
        return -1;
      }
      snprintf(mf->group, sizeof mf->group, "%s", name);
      for (char *k; (k = strtok_r(NULL, " \t\r\n", &save));) {
        char *v = strtok_r(NULL, " \t\r\n", &save);
        if (!v) {
          snprintf(err, sizeof err, "%s:%d: %s: missing value", fname, ln, k);
          return -1;
        }
        if (!strcmp(k, "num_ranks"))
          mf->map.num_ranks = (uint32_t)strtoul(v, NULL, 10);
        else if (!strcmp(k, "slots_per_rank"))
          mf->map.slots_per_rank = (uint32_t)strtoul(v, NULL, 10);
        else if (strcmp(k, "version")) {
          snprintf(err, sizeof err, "%s:%d: unknown key %s (num_ranks, slots_per_rank, version)", fname, ln,
                   k);
          return -1;
        }
      }
      continue;
    }
    if (!strcmp(tok, "copy")) {
      char *a = strtok_r(NULL, " \t\r\n", &save), *arrow = strtok_r(NULL, " \t\r\n", &save);
      char *b = strtok_r(NULL, " \t\r\n", &save);
      unsigned sr, ss, dr, ds;
      char extra;
      if (!a || !arrow || !b || strcmp(arrow, "->") || sscanf(a, "%u:%u%c", &sr, &ss, &extra) != 2 ||
          sscanf(b, "%u:%u%c", &dr, &ds, &extra) != 2) {
        snprintf(err, sizeof err, "%s:%d: expected \"copy RANK:SLOT -> RANK:SLOT\"", fname, ln);
        return -1;
      }
      if (grow((void **)&mf->wc, &mf->capwc, mf->nwc + 1, sizeof *mf->wc)) goto nomem;
      Epd__V1__WeightCopy *w = &mf->wc[mf->nwc++];
      epd__v1__weight_copy__init(w);
      w->src_rank = sr, w->src_slot = ss, w->dst_rank = dr, w->dst_slot = ds;
      continue;
    }
    if (!strcmp(tok, "expert")) tok = strtok_r(NULL, " \t\r\n", &save);
    char *end;
    errno = 0;
    unsigned long e = tok ? strtoul(tok, &end, 10) : 0;
    if (!tok || end == tok || (*end && strcmp(end, ":")) || errno || e > UINT32_MAX) {
      snprintf(err, sizeof err, "%s:%d: expected \"expert E: RANK:SLOT ...\"", fname, ln);
      return -1;
    }
    if (grow((void **)&mf->pl, &mf->cappl, mf->npl + 1, sizeof *mf->pl)) goto nomem;
    Epd__V1__ExpertPlacement *p = &mf->pl[mf->npl++];
    epd__v1__expert_placement__init(p);
    p->expert = (uint32_t)e;
    p->replicas = (Epd__V1__Replica **)(uintptr_t)mf->nrp; /* an index until the arrays stop moving */
    for (char *r; (r = strtok_r(NULL, " \t\r\n", &save));) {
      unsigned rank, slot;
      char extra;
      if (sscanf(r, "%u:%u%c", &rank, &slot, &extra) != 2) {
        snprintf(err, sizeof err, "%s:%d: replica \"%s\": expected RANK:SLOT", fname, ln, r);
        return -1;
      }
      if (grow((void **)&mf->rp, &mf->caprp, mf->nrp + 1, sizeof *mf->rp)) goto nomem;
      epd__v1__replica__init(&mf->rp[mf->nrp]);
      mf->rp[mf->nrp].rank = rank;
      mf->rp[mf->nrp].slot = slot;
      mf->nrp++;
      p->n_replicas++;
    }
  }
  mf->plp = calloc(mf->npl + 1, sizeof *mf->plp);
  mf->rpp = calloc(mf->nrp + 1, sizeof *mf->rpp);
  mf->wcp = calloc(mf->nwc + 1, sizeof *mf->wcp);
  if (!mf->plp || !mf->rpp || !mf->wcp) goto nomem;
  for (size_t i = 0; i < mf->nwc; i++) mf->wcp[i] = &mf->wc[i];
  for (size_t i = 0; i < mf->nrp; i++) mf->rpp[i] = &mf->rp[i];
  for (size_t i = 0; i < mf->npl; i++) {
    mf->pl[i].replicas = &mf->rpp[(size_t)(uintptr_t)mf->pl[i].replicas];
    mf->plp[i] = &mf->pl[i];
  }
  mf->map.group = mf->group;
  mf->map.n_experts = mf->npl;
  mf->map.experts = mf->plp;
  return 0;
nomem:
  snprintf(err, sizeof err, "%s: out of memory", fname);
  return -1;
}

static int cmd_set_map(epd_rpc_t *rpc, const char *fname, const char *group) {
  FILE *f = strcmp(fname, "-") ? fopen(fname, "r") : stdin;
  if (!f) {
    snprintf(err, sizeof err, "%s: %s", fname, strerror(errno));
    return 1;
  }
  map_file_t mf;
  memset(&mf, 0, sizeof mf);
  int rc = parse_map(f, fname, &mf);
  if (f != stdin) fclose(f);
  if (rc == 0) {
    if (group) snprintf(mf.group, sizeof mf.group, "%s", group);
    Epd__V1__SetExpertMapRequest q = EPD__V1__SET_EXPERT_MAP_REQUEST__INIT;
    q.protocol_version = EPD_PROTOCOL_VERSION;
    q.map = &mf.map;
    q.n_copies = mf.nwc;
    q.copies = mf.wcp;
    ProtobufCMessage *rep = NULL;
    if (epd_rpc_call(rpc, "/epd.v1.Control/SetExpertMap", &q.base, &epd__v1__set_expert_map_reply__descriptor,
                     &rep, err, sizeof err) != EPD_OK) {
      rc = -1;
    } else {
      uint32_t v = ((Epd__V1__SetExpertMapReply *)rep)->version;
      if (json)
        printf("{\"group\":\"%s\",\"version\":%u}\n", mf.group[0] ? mf.group : "default", v);
      else if (mf.nwc)
        printf("staged expert map version %u for group %s (%zu experts, %zu weight copies)\n", v,
               mf.group[0] ? mf.group : "default", mf.npl, mf.nwc);
      else
        printf("staged expert map version %u for group %s (%zu experts)\n", v,
               mf.group[0] ? mf.group : "default", mf.npl);
      protobuf_c_message_free_unpacked(rep, NULL);
    }
  }
  free(mf.pl);
  free(mf.plp);
  free(mf.rp);
  free(mf.rpp);
  free(mf.wc);
  free(mf.wcp);
  return rc ? 1 : 0;
}

static int cmd_drain(epd_rpc_t *rpc, int exit_when_idle) {
  Epd__V1__DrainRequest q = EPD__V1__DRAIN_REQUEST__INIT;
  q.protocol_version = EPD_PROTOCOL_VERSION;
  q.exit = exit_when_idle;
  ProtobufCMessage *rep = NULL;
  if (epd_rpc_call(rpc, "/epd.v1.Control/Drain", &q.base, &epd__v1__drain_reply__descriptor, &rep, err,
                   sizeof err) != EPD_OK)
    return 1;
  uint32_t n = ((Epd__V1__DrainReply *)rep)->clients;
  if (json)
    printf("{\"draining\":true,\"exit\":%s,\"clients\":%u}\n", exit_when_idle ? "true" : "false", n);
  else
    printf("draining; %u client%s still attached%s\n", n, n == 1 ? "" : "s",
           exit_when_idle ? "; the daemon exits when the last one detaches" : "");
  protobuf_c_message_free_unpacked(rep, NULL);
  return 0;
}

static int cmd_health(epd_rpc_t *rpc, const char *service) {
  Grpc__Health__V1__HealthCheckRequest q = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  q.service = (char *)(service ? service : "");
  ProtobufCMessage *rep = NULL;
  if (epd_rpc_call(rpc, "/grpc.health.v1.Health/Check", &q.base,
                   &grpc__health__v1__health_check_response__descriptor, &rep, err, sizeof err) != EPD_OK)
    return 1;
  int st = ((Grpc__Health__V1__HealthCheckResponse *)rep)->status;
  const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(
      &grpc__health__v1__health_check_response__serving_status__descriptor, st);
  const char *name = v ? v->name : "UNKNOWN";
  if (json)
    printf("{\"status\":\"%s\"}\n", name);
  else
    printf("%s\n", name);
  protobuf_c_message_free_unpacked(rep, NULL);
  if (st != GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING) {
    snprintf(err, sizeof err, "not serving (%s)", name);
    return 1;
  }
  return 0;
}

typedef struct watch_ctx {
  long count, seen;
} watch_ctx_t;

static int on_event(void *arg, ProtobufCMessage *msg) {
  watch_ctx_t *w = arg;
  const Epd__V1__Event *e = (const Epd__V1__Event *)msg;
  if (json) {
    int f = 1;
    putchar('{');
    jkv_u("seq", e->seq, &f);
    jkv_u("time_ns", e->time_ns, &f);
    jkv_s("kind", e->kind, &f);
    jkv_s("group", e->group, &f);
    jkv_i("rank", e->rank, &f);
    jkv_u("client_id", e->client_id, &f);
    jkv_s("message", e->message, &f);
    jkv_u("old_version", e->old_version, &f);
    jkv_u("new_version", e->new_version, &f);
    jkv_u("step", e->step, &f);
    printf("}\n");
  } else {
    time_t t = (time_t)(e->time_ns / 1000000000ull);
    struct tm tm;
    char ts[32];
    localtime_r(&t, &tm);
    strftime(ts, sizeof ts, "%H:%M:%S", &tm);
    printf("%s.%03u #%" PRIu64 " %-11s group=%s rank=%d client=%" PRIu64 " %s\n", ts,
           (unsigned)(e->time_ns / 1000000ull % 1000), e->seq, e->kind, e->group[0] ? e->group : "-", e->rank,
           e->client_id, e->message);
  }
  fflush(stdout);
  return w->count > 0 && ++w->seen >= w->count;
}

static int cmd_watch(epd_rpc_t *rpc, long count, int timeout_ms) {
  Epd__V1__WatchRequest q = EPD__V1__WATCH_REQUEST__INIT;
  q.protocol_version = EPD_PROTOCOL_VERSION;
  watch_ctx_t w = {count, 0};
  epd_result_t r = epd_rpc_stream(rpc, "/epd.v1.Control/Watch", &q.base, &epd__v1__event__descriptor,
                                  on_event, &w, timeout_ms, err, sizeof err);
  return r == EPD_OK ? 0 : 1;
}

/* ---- top: a live view from Watch (a thread on its own channel) and periodic GetStatus/GetMetrics --- */

#define TOP_EVENTS 8
#define TOP_MAX_RANKS 64

static struct {
  pthread_mutex_t lock;
  char lines[TOP_EVENTS][256];
  unsigned n; /* events seen in all */
  int ended;  /* the Watch stream ended (the daemon went away) */
  const char *sock;
} top = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int top_on_event(void *arg, ProtobufCMessage *msg) {
  (void)arg;
  const Epd__V1__Event *e = (const Epd__V1__Event *)msg;
  time_t t = (time_t)(e->time_ns / 1000000000ull);
  struct tm tm;
  char ts[32];
  localtime_r(&t, &tm);
  strftime(ts, sizeof ts, "%H:%M:%S", &tm);
  pthread_mutex_lock(&top.lock);
  snprintf(top.lines[top.n % TOP_EVENTS], sizeof top.lines[0], "%s.%03u %-11s group=%s rank=%d %s", ts,
           (unsigned)(e->time_ns / 1000000ull % 1000), e->kind, e->group[0] ? e->group : "-", e->rank,
           e->message);
  top.n++;
  pthread_mutex_unlock(&top.lock);
  return 0;
}

static void *top_watch(void *arg) {
  (void)arg;
  char werr[512];
  epd_rpc_t *w = NULL;
  if (epd_rpc_open(top.sock, 10000, &w, werr, sizeof werr) == EPD_OK) {
    Epd__V1__WatchRequest q = EPD__V1__WATCH_REQUEST__INIT;
    q.protocol_version = EPD_PROTOCOL_VERSION;
    epd_rpc_stream(w, "/epd.v1.Control/Watch", &q.base, &epd__v1__event__descriptor, top_on_event, NULL, 0,
                   werr, sizeof werr);
    epd_rpc_close(w);
  }
  pthread_mutex_lock(&top.lock);
  top.ended = 1;
  pthread_mutex_unlock(&top.lock);
  return NULL;
}

/* Value of the sample whose name and labels are exactly key (e.g. `epd_rank_ops_total{rank="0"}`); -1 if
 * absent. The text is the builder's own output, one sample a line. */
static double metric_value(const char *text, const char *key) {
  size_t kl = strlen(key);
  for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
    if (!strncmp(p, key, kl) && p[kl] == ' ') return strtod(p + kl + 1, NULL);
  return -1;
}

/* Median of an op's latency histogram: the upper bound of the first bucket holding half the samples
 * (Prometheus buckets are cumulative). Returns -1 without samples, INFINITY when past the last bound. */
static double metric_p50(const char *text, const char *op, double *count) {
  char key[160];
  snprintf(key, sizeof key, "epd_op_latency_seconds_count{op=\"%s\",", op);
  *count = 0;
  for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
    if (!strncmp(p, key, strlen(key))) *count += strtod(strchr(p, ' ') + 1, NULL);
  if (*count <= 0) return -1;
  snprintf(key, sizeof key, "epd_op_latency_seconds_bucket{op=\"%s\",", op);
  for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
    if (strncmp(p, key, strlen(key))) continue;
    const char *le = strstr(p, "le=\""), *sp = strchr(p, ' ');
    if (!le || !sp || strtod(sp + 1, NULL) < *count / 2) continue;
    return strncmp(le + 4, "+Inf", 4) ? strtod(le + 4, NULL) : INFINITY;
  }
  return INFINITY;
}

static const char *fmt_secs(double s, char *buf, size_t len) {
  if (s < 0)
    snprintf(buf, len, "-");
  else if (isinf(s))
    snprintf(buf, len, ">max");
  else if (s < 1e-3)
    snprintf(buf, len, "%.1f us", s * 1e6);
  else if (s < 1)
    snprintf(buf, len, "%.2f ms", s * 1e3);
  else
    snprintf(buf, len, "%.2f s", s);
  return buf;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static char *get_metrics_text(epd_rpc_t *rpc) {
  Epd__V1__GetMetricsRequest q = EPD__V1__GET_METRICS_REQUEST__INIT;
  q.protocol_version = EPD_PROTOCOL_VERSION;
  ProtobufCMessage *rep = NULL;
  if (epd_rpc_call(rpc, "/epd.v1.Control/GetMetrics", &q.base, &epd__v1__metrics_reply__descriptor, &rep, err,
                   sizeof err) != EPD_OK)
    return NULL;
  char *t = strdup(((Epd__V1__MetricsReply *)rep)->text);
  protobuf_c_message_free_unpacked(rep, NULL);
  return t;
}

/* The terminal's settings before top turned off line buffering and echo; restored on every way out. */
static struct termios top_tty_saved;
static volatile sig_atomic_t top_tty_raw;

static void top_tty_restore(void) {
  if (top_tty_raw) tcsetattr(STDIN_FILENO, TCSANOW, &top_tty_saved);
  top_tty_raw = 0;
}

/* Ctrl-C (and SIGTERM, SIGHUP) end top at once, as they did before q existed, but with the terminal
 * restored: tcsetattr and _exit are async-signal-safe. */
static void top_on_signal(int sig) {
  top_tty_restore();
  _exit(128 + sig);
}

/* On a terminal, read keys one at a time without echo (ISIG stays on, so Ctrl-C still signals). */
static void top_tty_raw_mode(void) {
  struct termios t;
  if (!isatty(STDIN_FILENO) || tcgetattr(STDIN_FILENO, &top_tty_saved) != 0) return;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = top_on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGHUP, &sa, NULL);
  t = top_tty_saved;
  t.c_lflag &= ~(tcflag_t)(ICANON | ECHO);
  t.c_cc[VMIN] = 0;
  t.c_cc[VTIME] = 0;
  if (tcsetattr(STDIN_FILENO, TCSANOW, &t) == 0) top_tty_raw = 1;
}

/* Wait interval_ms, watching the terminal for q; returns 1 when the user asked to quit. */
static int top_wait(long interval_ms) {
  double end = now_s() + (double)interval_ms / 1e3;
  for (;;) {
    double left = end - now_s();
    if (left <= 0) return 0;
    if (!top_tty_raw) {
      struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
      nanosleep(&ts, NULL);
      return 0;
    }
    struct pollfd pf = {STDIN_FILENO, POLLIN, 0};
    int n = poll(&pf, 1, (int)(left * 1e3) + 1);
    if (n <= 0) continue; /* timeout (the loop ends it) or EINTR */
    char keys[64];
    ssize_t got = read(STDIN_FILENO, keys, sizeof keys);
    if (got == 0 || (got < 0 && errno != EINTR && errno != EAGAIN)) {
      /* The terminal went away (hang-up): no more keys; keep refreshing until the count or a signal. */
      top_tty_restore();
      continue;
    }
    for (ssize_t k = 0; k < got; k++)
      if (keys[k] == 'q' || keys[k] == 'Q') return 1;
  }
}

/* iterations 0: until q or Ctrl-C. The screen is cleared between frames only on a terminal. */
static int cmd_top(epd_rpc_t *rpc, const char *sock, long iterations, long interval_ms) {
  static const char *const ops[] = {"ll_dispatch", "ll_combine", "ht_dispatch", "ht_combine"};
  uint64_t prev_ops[TOP_MAX_RANKS] = {0};
  double prev_t = 0;
  int clear = isatty(STDOUT_FILENO) && !json;
  pthread_t th;
  top.sock = sock;
  /* The Watch thread blocks in its stream; it is never joined: the process leaves with _exit below. */
  if (pthread_create(&th, NULL, top_watch, NULL) != 0) {
    snprintf(err, sizeof err, "cannot start the Watch thread");
    return 1;
  }
  pthread_detach(th);
  top_tty_raw_mode();
  int rc = 0;
  for (long it = 0; iterations <= 0 || it < iterations; it++) {
    if (it && top_wait(interval_ms)) break;
    Epd__V1__StatusReply *s = get_status(rpc);
    char *m = s ? get_metrics_text(rpc) : NULL;
    if (!s || !m) {
      if (s) protobuf_c_message_free_unpacked(&s->base, NULL);
      rc = 1;
      break;
    }
    double t = now_s(), dt = it ? t - prev_t : 0;
    if (clear) printf("\033[H\033[2J");
    printf("epd %s  backend %s  mode %s  state %s%s  uptime %.1f s  clients %zu  groups %zu  [%ld]\n",
           s->version, s->backend, s->engine_mode, s->state, s->draining ? " (draining)" : "",
           (double)s->uptime_ms / 1e3, s->n_clients, s->n_groups, it + 1);
    printf("%4s %7s %12s %10s %10s %8s %7s\n", "RANK", "CLIENTS", "OPS", "OPS/S", "BUFFERS", "TIMEOUTS",
           "ERRORS");
    for (size_t i = 0; i < s->n_ranks; i++) {
      const Epd__V1__RankStatus *r = s->ranks[i];
      char key[96], hb[32], rate[32] = "-";
      snprintf(key, sizeof key, "epd_timeouts_total{rank=\"%d\"}", r->rank);
      double to = metric_value(m, key);
      snprintf(key, sizeof key, "epd_rank_errors_total{rank=\"%d\"}", r->rank);
      double er = metric_value(m, key);
      if (i < TOP_MAX_RANKS) {
        if (dt > 0) snprintf(rate, sizeof rate, "%.1f", (double)(r->ops - prev_ops[i]) / dt);
        prev_ops[i] = r->ops;
      }
      printf("%4d %7u %12" PRIu64 " %10s %10s %8.0f %7.0f\n", r->rank, r->clients, r->ops, rate,
             human_bytes(r->buffer_bytes, hb, sizeof hb), to, er);
    }
    printf("%-12s %10s %10s\n", "OP", "COUNT", "P50");
    for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++) {
      double cnt, p50 = metric_p50(m, ops[k], &cnt);
      char b[32];
      printf("%-12s %10.0f %10s\n", ops[k], cnt, fmt_secs(p50, b, sizeof b));
    }
    pthread_mutex_lock(&top.lock);
    unsigned n = top.n, first = n > TOP_EVENTS ? n - TOP_EVENTS : 0;
    printf("events: %u%s\n", n, top.ended ? " (watch stream ended)" : "");
    for (unsigned e = first; e < n; e++) printf("  %s\n", top.lines[e % TOP_EVENTS]);
    pthread_mutex_unlock(&top.lock);
    if (!clear) printf("\n");
    fflush(stdout);
    prev_t = t;
    free(m);
    protobuf_c_message_free_unpacked(&s->base, NULL);
  }
  top_tty_restore();
  if (rc) fprintf(stderr, "epdctl: %s\n", err);
  fflush(stdout);
  fflush(stderr);
  _exit(rc);
}

int main(int argc, char **argv) {
  const char *sock = NULL;
  int timeout_ms = 10000, timeout_set = 0, i = 1;
  for (; i < argc && argv[i][0] == '-'; i++) {
    if (!strcmp(argv[i], "-s") && i + 1 < argc)
      sock = argv[++i];
    else if (!strcmp(argv[i], "--json"))
      json = 1;
    else if (!strcmp(argv[i], "--timeout") && i + 1 < argc) {
      timeout_ms = atoi(argv[++i]);
      timeout_set = 1;
    } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
      usage(stdout);
      return 0;
    } else if (!strcmp(argv[i], "--version")) {
      printf("epdctl %s (protocol %u)\n", EPD_VERSION, EPD_PROTOCOL_VERSION);
      return 0;
    } else {
      fprintf(stderr, "epdctl: unknown option %s\n", argv[i]);
      usage(stderr);
      return 2;
    }
  }
  if (i >= argc) {
    usage(stderr);
    return 2;
  }
  const char *cmd = argv[i++];
  /* Command options may follow the command too (`epdctl status --json`). */
  const char *pos[4] = {0};
  int npos = 0, exit_flag = 0;
  long count = 0, iterations = 0, interval_ms = 1000;
  for (; i < argc; i++) {
    if (!strcmp(argv[i], "--json"))
      json = 1;
    else if (!strcmp(argv[i], "--exit"))
      exit_flag = 1;
    else if (!strcmp(argv[i], "--count") && i + 1 < argc)
      count = atol(argv[++i]);
    else if (!strcmp(argv[i], "--iterations") && i + 1 < argc)
      iterations = atol(argv[++i]);
    else if (!strcmp(argv[i], "--interval-ms") && i + 1 < argc) {
      interval_ms = atol(argv[++i]);
      if (interval_ms < 10 || interval_ms > 3600000) {
        fprintf(stderr, "epdctl: --interval-ms must be 10..3600000\n");
        return 2;
      }
    } else if (!strcmp(argv[i], "--group") && i + 1 < argc)
      pos[3] = argv[++i];
    else if (npos < 2)
      pos[npos++] = argv[i];
    else {
      fprintf(stderr, "epdctl: unexpected argument %s\n", argv[i]);
      return 2;
    }
  }
  static const char *const known[] = {"status",  "metrics", "clients", "config", "experts",
                                      "set-map", "drain",   "health",  "watch",  "top"};
  int ok = 0;
  for (size_t k = 0; k < sizeof known / sizeof known[0]; k++) ok |= !strcmp(cmd, known[k]);
  if (!ok) {
    fprintf(stderr, "epdctl: unknown command %s\n", cmd);
    usage(stderr);
    return 2;
  }
  if (!strcmp(cmd, "set-map") && !pos[0]) {
    fprintf(stderr, "epdctl: set-map needs a FILE\n");
    return 2;
  }
  epd_rpc_t *rpc = NULL;
  if (epd_rpc_open(sock, timeout_ms, &rpc, err, sizeof err) != EPD_OK) {
    fprintf(stderr, "epdctl: %s\n", err);
    return 1;
  }
  int rc;
  if (!strcmp(cmd, "status") || !strcmp(cmd, "clients") || !strcmp(cmd, "config"))
    rc = cmd_status(rpc, cmd);
  else if (!strcmp(cmd, "metrics"))
    rc = cmd_metrics(rpc);
  else if (!strcmp(cmd, "experts"))
    rc = cmd_experts(rpc, pos[0] ? pos[0] : pos[3]);
  else if (!strcmp(cmd, "set-map"))
    rc = cmd_set_map(rpc, pos[0], pos[3]);
  else if (!strcmp(cmd, "drain"))
    rc = cmd_drain(rpc, exit_flag);
  else if (!strcmp(cmd, "health"))
    rc = cmd_health(rpc, pos[0]);
  else if (!strcmp(cmd, "top"))
    rc = cmd_top(rpc, sock, iterations, interval_ms);
  else
    rc = cmd_watch(rpc, count, timeout_set ? timeout_ms : 0);
  if (rc) fprintf(stderr, "epdctl: %s\n", err);
  epd_rpc_close(rpc);
  return rc;
}
