/*
 * rpc.c - the control RPC server (epd.v1.Control and grpc.health.v1.Health) on gRPC C core.
 *
 * One thread drives one completion queue. Every call is a small state machine (rpc_call_t) whose tags
 * say which batch completed. Unary calls are handled in the thread when they arrive (each handler is
 * short: engine calls are bounded); server-streaming calls (Watch, Health.Watch) stay in a list and
 * are pumped between completion-queue waits, with at most one SEND_MESSAGE in flight each, so a slow
 * or idle stream never blocks other calls. gRPC status codes are the wire errors; the exact
 * epd_result_t also travels in the trailing metadata "epd-code" so that clients need not guess
 * (UNAVAILABLE means both "socket gone" and "draining").
 */
#define _GNU_SOURCE
#include "control/rpc.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <grp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_posix.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "control/access.h"
#include "control/attach.h"
#include "control/state.h"
#include "epd.pb-c.h"
#include "epd_paths.h"
#include "control/events.h"
#include "health.pb-c.h"
#include "core/log.h"
#include "control/metrics.h"
#include "control/refuse.h"

#ifndef EPD_VERSION
#define EPD_VERSION "unknown"
#endif

#define SECRET_BYTES 32
#define CONFIG_TEXT_MAX (64 * 1024)

enum {
  M_ATTACH, M_DETACH, M_STATUS, M_METRICS, M_SETMAP, M_GETMAP, M_WATCH, M_DRAIN, M_HCHECK, M_HWATCH,
  M_COUNT,
  M_UNKNOWN = M_COUNT
};

static const struct {
  const char *path, *name;
  const ProtobufCMessageDescriptor *req;
  int streaming, versioned;
} methods[M_COUNT] = {
    [M_ATTACH] = {"/epd.v1.Control/Attach", "Attach", &epd__v1__attach_request__descriptor, 0, 1},
    [M_DETACH] = {"/epd.v1.Control/Detach", "Detach", &epd__v1__detach_request__descriptor, 0, 1},
    [M_STATUS] = {"/epd.v1.Control/GetStatus", "GetStatus", &epd__v1__get_status_request__descriptor, 0, 1},
    [M_METRICS] = {"/epd.v1.Control/GetMetrics", "GetMetrics", &epd__v1__get_metrics_request__descriptor, 0, 1},
    [M_SETMAP] = {"/epd.v1.Control/SetExpertMap", "SetExpertMap", &epd__v1__set_expert_map_request__descriptor, 0, 1},
    [M_GETMAP] = {"/epd.v1.Control/GetExpertMap", "GetExpertMap", &epd__v1__get_expert_map_request__descriptor, 0, 1},
    [M_WATCH] = {"/epd.v1.Control/Watch", "Watch", &epd__v1__watch_request__descriptor, 1, 1},
    [M_DRAIN] = {"/epd.v1.Control/Drain", "Drain", &epd__v1__drain_request__descriptor, 0, 1},
    [M_HCHECK] = {"/grpc.health.v1.Health/Check", "HealthCheck", &grpc__health__v1__health_check_request__descriptor,
                  0, 0},
    [M_HWATCH] = {"/grpc.health.v1.Health/Watch", "HealthWatch", &grpc__health__v1__health_check_request__descriptor,
                  1, 0},
};

enum { TAG_NEW, TAG_DONE, TAG_META, TAG_SEND, TAG_CLOSE, TAG_COUNT };

struct rpc_call;
typedef struct rpc_tag {
  struct rpc_call *c;
  int kind;
} rpc_tag_t;

typedef struct rpc_call {
  int method;
  grpc_call *call;
  gpr_timespec deadline;
  grpc_metadata_array md;
  grpc_call_details details; /* unregistered methods only */
  grpc_byte_buffer *payload;
  rpc_tag_t tags[TAG_COUNT];
  int pending;   /* batches started and not yet completed */
  int cancelled; /* from RECV_CLOSE_ON_SERVER */
  /* final status */
  grpc_slice status_details;
  int has_details;
  grpc_metadata trailing;
  int has_trailing;
  char code_buf[16];
  grpc_byte_buffer *send_buf;
  /* streaming */
  int meta_done, sending, closed, ending;
  int close_started; /* a RECV_CLOSE_ON_SERVER batch of its own is pending (streams) */
  uint64_t after; /* Watch: last event sequence sent */
  char service[128];
  int health_sent;
  /* the peer (SO_PEERCRED of its connection); known = 0 when the connection is not ours */
  int peer_known;
  uint32_t peer_pid, peer_uid, peer_gid; /* Health.Watch: last status sent, -1 none */
  struct rpc_call *next;
} rpc_call_t;

/* The result of a unary handler: a packed reply, or a gRPC status with details and the epd code. */
typedef struct rpc_reply {
  grpc_status_code code;
  int epd_code;
  char details[512];
  uint8_t *bytes;
  size_t len;
} rpc_reply_t;

typedef struct secret_entry {
  uint64_t client_id;
  uint8_t secret[SECRET_BYTES];
} secret_entry_t;

static struct {
  grpc_server *server;
  grpc_completion_queue *cq;
  void *reg[M_COUNT];
  pthread_t thread;
  int thread_started, grpc_inited;
  atomic_int stop;
  atomic_int serving;
  epd_engine_t *eng;
  epd_rpc_hooks_t hooks;
  char path[EPD_PATH_MAX];
  uint64_t start_ns;
  rpc_call_t *watches;
  uint32_t max_watches; /* daemon.max_watches */
  int live_calls;
  secret_entry_t *secrets;
  size_t nsecrets, capsecrets;
  /* Connections are accepted here, not by gRPC, so that SO_PEERCRED can be read (gRPC gives no peer
   * uid); creds[fd] is the peer of connection fd, looked up by the "fd:N" peer name gRPC reports. */
  int listen_fd, wake_fd[2];
  pthread_t accept_thread;
  int accept_started;
  pthread_mutex_t cred_mu;
  struct ucred creds[1024];
  uint8_t cred_set[1024];
  uint32_t max_ctl, max_ctl_uid; /* daemon.max_control_conns, _per_uid */
  atomic_uint nctl_open;          /* control connections counted at the last accept */
  atomic_ullong ctl_refused[2];   /* refused at the cap: all uids, one uid */
} g = {.listen_fd = -1, .wake_fd = {-1, -1}, .cred_mu = PTHREAD_MUTEX_INITIALIZER};

static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static grpc_status_code status_of(epd_result_t r) {
  switch (r) {
  case EPD_OK: return GRPC_STATUS_OK;
  case EPD_ERR_INVALID:
  case EPD_ERR_BAD_EXPERT:
  case EPD_ERR_TOO_MANY_TOKENS: return GRPC_STATUS_INVALID_ARGUMENT;
  case EPD_ERR_NOT_FOUND: return GRPC_STATUS_NOT_FOUND;
  case EPD_ERR_BUSY:
  case EPD_ERR_NOMEM:
  case EPD_ERR_OVERFLOW: return GRPC_STATUS_RESOURCE_EXHAUSTED;
  case EPD_ERR_DRAINING:
  case EPD_ERR_CLOSED: return GRPC_STATUS_UNAVAILABLE;
  case EPD_ERR_PERMISSION: return GRPC_STATUS_PERMISSION_DENIED;
  case EPD_ERR_PROTOCOL:
  case EPD_ERR_STATE:
  case EPD_ERR_MISMATCH: return GRPC_STATUS_FAILED_PRECONDITION;
  case EPD_ERR_TIMEOUT: return GRPC_STATUS_DEADLINE_EXCEEDED;
  case EPD_ERR_UNSUPPORTED: return GRPC_STATUS_UNIMPLEMENTED;
  default: return GRPC_STATUS_INTERNAL;
  }
}

/* Name of a result code. A copy of the table, because epd_strerror lives in libepd and the daemon
 * does not link it. */
static const char *result_name(int r) {
  static const char *const names[] = {
      "ok", "invalid argument", "out of memory", "system error", "rpc error", "protocol mismatch", "not found",
      "busy", "timeout", "peer failed", "draining", "cuda error", "nccl error", "unsupported", "bad expert",
      "too many tokens", "permission denied", "overflow", "mismatch", "closed", "state", "internal error"};
  return r <= 0 && r > EPD_ERR_MIN ? names[-r] : "unknown error";
}

static void reply_err(rpc_reply_t *rep, epd_result_t r, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void reply_err(rpc_reply_t *rep, epd_result_t r, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(rep->details, sizeof rep->details, fmt, ap);
  va_end(ap);
  rep->code = status_of(r);
  rep->epd_code = r;
}

/* Pack msg as the reply; NOMEM becomes RESOURCE_EXHAUSTED. */
static void reply_msg(rpc_reply_t *rep, const ProtobufCMessage *msg) {
  size_t n = protobuf_c_message_get_packed_size(msg);
  rep->bytes = malloc(n ? n : 1);
  if (!rep->bytes) {
    reply_err(rep, EPD_ERR_NOMEM, "out of memory packing a %zu-byte reply", n);
    return;
  }
  rep->len = protobuf_c_message_pack(msg, rep->bytes);
  rep->code = GRPC_STATUS_OK;
  rep->epd_code = EPD_OK;
}

/* ---- daemon info for the status builder ----------------------------------------------------------- */

static const char *daemon_state(void) {
  const char *s = g.hooks.state ? g.hooks.state(g.hooks.arg) : NULL;
  return s ? s : "ready";
}

static int is_serving(void) {
  return atomic_load(&g.serving) && !atomic_load(&g.stop) && !strcmp(daemon_state(), "ready");
}

/* Snapshot the engine and fill info; *cfg is malloc'ed config text (or NULL). */
static epd_result_t take_snapshot(epd_engine_snap_t *snap, epd_daemon_info_t *info, char **cfg) {
  memset(snap, 0, sizeof *snap);
  memset(info, 0, sizeof *info);
  *cfg = NULL;
  epd_result_t r = epd_engine_snapshot(g.eng, snap);
  if (r != EPD_OK) return r;
  info->version = EPD_VERSION;
  info->state = daemon_state();
  info->uptime_ms = (mono_ns() - g.start_ns) / 1000000ull;
  info->attach_connections = epd_attach_connections();
  epd_attach_stats(&info->attach);
  info->control_connections = epd_rpc_control_conns(info->control_refused);
  if (g.hooks.config_dump) {
    *cfg = malloc(CONFIG_TEXT_MAX);
    if (*cfg) {
      size_t n = g.hooks.config_dump(g.hooks.arg, *cfg, CONFIG_TEXT_MAX);
      (*cfg)[n < CONFIG_TEXT_MAX ? n : CONFIG_TEXT_MAX - 1] = 0;
    }
  }
  info->config = *cfg;
  return EPD_OK;
}

/* ---- secrets (client_id -> secret, proves ownership on Detach) ------------------------------------ */

static void secrets_prune(void) {
  epd_engine_snap_t snap;
  if (epd_engine_snapshot(g.eng, &snap) != EPD_OK) return;
  size_t w = 0;
  for (size_t i = 0; i < g.nsecrets; i++) {
    int live = 0;
    for (uint32_t c = 0; c < snap.nclients && !live; c++) live = snap.clients[c].client_id == g.secrets[i].client_id;
    if (live) g.secrets[w++] = g.secrets[i];
  }
  g.nsecrets = w;
  epd_engine_snapshot_free(&snap);
}

static int secrets_add(uint64_t id, const uint8_t *secret) {
  /* Clients that died without Detach leave entries behind; drop them before growing. */
  if (g.nsecrets == g.capsecrets && g.nsecrets >= 64) secrets_prune();
  if (g.nsecrets == g.capsecrets) {
    size_t ncap = g.capsecrets ? g.capsecrets * 2 : 64;
    secret_entry_t *n = realloc(g.secrets, ncap * sizeof *n);
    if (!n) return -1;
    g.secrets = n;
    g.capsecrets = ncap;
  }
  g.secrets[g.nsecrets].client_id = id;
  memcpy(g.secrets[g.nsecrets].secret, secret, SECRET_BYTES);
  g.nsecrets++;
  return 0;
}

static secret_entry_t *secrets_find(uint64_t id) {
  for (size_t i = 0; i < g.nsecrets; i++)
    if (g.secrets[i].client_id == id) return &g.secrets[i];
  return NULL;
}

static void secrets_remove(uint64_t id) {
  for (size_t i = 0; i < g.nsecrets; i++)
    if (g.secrets[i].client_id == id) {
      g.secrets[i] = g.secrets[--g.nsecrets];
      return;
    }
}

/* ---- handlers ------------------------------------------------------------------------------------- */

static int copy_name(rpc_reply_t *rep, const char *field, char *dst, size_t len, const char *src, const char *dflt) {
  if (!src || !*src) src = dflt;
  size_t n = strlen(src);
  if (n >= len) {
    reply_err(rep, EPD_ERR_INVALID, "%s: %zu bytes, at most %zu allowed", field, n, len - 1);
    return -1;
  }
  memcpy(dst, src, n + 1);
  return 0;
}

/* A group that starts from the default map (new, or first attach after a restart) takes the map saved in
 * daemon.state_dir, if any and if it fits the group's geometry. */
static void restore_map(const char *group, epd_attach_info_t *info) {
  epd_expert_map_t m;
  if (epd_state_load_map(group, &m) != 1) return;
  char err[256] = "";
  epd_result_t r = m.version > 1 ? epd_engine_restore_map(g.eng, group, &m, err, sizeof err) : EPD_OK;
  if (r == EPD_OK && m.version > 1) {
    info->map_version = m.version;
    epd_log_msg(EPD_LOG_INFO, EPD_SUB_RPC, -1, 0, "group %s: expert map version %u restored from the state dir",
                group, m.version);
  } else if (r != EPD_OK) {
    EPD_LOGW(EPD_SUB_RPC, "group %s: saved expert map version %u not restored: %s", group, m.version, err);
  }
  epd_expert_map_free(&m);
}

static void h_attach(const rpc_call_t *c, const Epd__V1__AttachRequest *q, rpc_reply_t *rep) {
  epd_attach_req_t ar;
  memset(&ar, 0, sizeof ar);
  char dflt_name[32];
  snprintf(dflt_name, sizeof dflt_name, "pid:%u", q->pid);
  if (copy_name(rep, "group", ar.group, sizeof ar.group, q->group, "default") ||
      copy_name(rep, "client_name", ar.name, sizeof ar.name, q->client_name, dflt_name))
    return;
  int nranks = epd_engine_world_ranks(g.eng); /* the engine checks the rank is on this node */
  if (q->rank < 0 || q->rank >= nranks) {
    reply_err(rep, EPD_ERR_INVALID, "rank: %d out of range [0, %d)", q->rank, nranks);
    return;
  }
  ar.rank = q->rank;
  ar.num_experts = q->num_experts;
  ar.hidden = q->hidden;
  ar.topk = q->topk;
  ar.max_tokens = q->max_tokens;
  ar.weight_bytes_per_slot = q->weight_bytes_per_slot;
  /* The kernel's word (SO_PEERCRED) over the client's: AttachRequest.pid is only a fallback. */
  ar.pid = c->peer_known ? c->peer_pid : q->pid;
  ar.uid = c->peer_known ? c->peer_uid : 0;
  ar.gid = c->peer_known ? c->peer_gid : 0;
  epd_attach_info_t info;
  memset(&info, 0, sizeof info);
  char err[256] = "";
  epd_result_t r = epd_engine_attach(g.eng, &ar, &info, err, sizeof err);
  if (r != EPD_OK) {
    reply_err(rep, r, "%s", err[0] ? err : result_name(r));
    return;
  }
  if (info.map_version == 1) restore_map(ar.group, &info);
  uint8_t token[EPD_TOKEN_BYTES], secret[SECRET_BYTES];
  if (getrandom(secret, sizeof secret, 0) != (ssize_t)sizeof secret) {
    epd_engine_detach(g.eng, info.client_id, 0);
    reply_err(rep, EPD_ERR_SYSTEM, "getrandom: %s", strerror(errno));
    return;
  }
  if (epd_attach_issue_token(info.client_id, ar.pid, ar.uid, token) != 0) {
    epd_engine_detach(g.eng, info.client_id, 0);
    reply_err(rep, EPD_ERR_BUSY, "cannot issue an attach token for client %llu (too many pending attaches)",
              (unsigned long long)info.client_id);
    return;
  }
  if (secrets_add(info.client_id, secret) != 0) {
    epd_engine_detach(g.eng, info.client_id, 0);
    reply_err(rep, EPD_ERR_NOMEM, "out of memory recording the client secret");
    return;
  }

  Epd__V1__AttachReply a = EPD__V1__ATTACH_REPLY__INIT;
  Epd__V1__BufferInfo bufs[EPD_MAX_BUFFERS], *bufp[EPD_MAX_BUFFERS];
  uint32_t nb = info.nbuffers < EPD_MAX_BUFFERS ? info.nbuffers : EPD_MAX_BUFFERS;
  for (uint32_t i = 0; i < nb; i++) {
    epd__v1__buffer_info__init(&bufs[i]);
    bufs[i].kind = info.buffers[i].kind;
    bufs[i].bank = info.buffers[i].bank;
    bufs[i].offset = info.buffers[i].offset;
    bufs[i].bytes = info.buffers[i].bytes;
    bufp[i] = &bufs[i];
  }
  a.client_id = info.client_id;
  a.token.data = token;
  a.token.len = sizeof token;
  a.attach_socket = (char *)epd_attach_path();
  a.memory = info.on_gpu ? "cuda" : "host";
  a.device = info.on_gpu ? info.device : -1;
  if (info.on_gpu && info.has_uuid) {
    a.device_uuid.data = info.device_uuid;
    a.device_uuid.len = sizeof info.device_uuid;
  }
  a.queue_bytes = info.queue_bytes;
  a.arena_bytes = info.arena_bytes;
  a.n_buffers = nb;
  a.buffers = bufp;
  a.num_ranks = info.num_ranks;
  a.num_experts = info.num_experts;
  a.hidden = info.hidden;
  a.topk = info.topk;
  a.max_tokens = info.max_tokens;
  a.slots_per_rank = info.slots_per_rank;
  a.ht_capacity = info.ht_capacity;
  a.map_version = info.map_version;
  a.weight_bytes_per_slot = info.weight_bytes_per_slot;
  a.secret.data = secret;
  a.secret.len = sizeof secret;
  reply_msg(rep, &a.base);
  epd_events_publish("attach", ar.group, ar.rank, info.client_id, 0, info.map_version, 0,
                     "client %s (pid %u uid %u) attached to group %s rank %d", ar.name, ar.pid, ar.uid, ar.group,
                     ar.rank);
}

static void h_detach(const Epd__V1__DetachRequest *q, rpc_reply_t *rep) {
  secret_entry_t *s = secrets_find(q->client_id);
  if (!s) {
    reply_err(rep, EPD_ERR_NOT_FOUND, "client_id: %llu is not attached", (unsigned long long)q->client_id);
    return;
  }
  /* Constant-time compare: the secret is the only proof of ownership. */
  uint8_t diff = q->secret.len == SECRET_BYTES ? 0 : 1;
  for (size_t i = 0; i < SECRET_BYTES; i++) diff |= (uint8_t)((i < q->secret.len ? q->secret.data[i] : 0) ^ s->secret[i]);
  if (diff) {
    reply_err(rep, EPD_ERR_PERMISSION, "secret: does not match client %llu's (from its AttachReply)",
              (unsigned long long)q->client_id);
    return;
  }
  epd_result_t r = epd_engine_detach(g.eng, q->client_id, 0);
  if (r != EPD_OK && r != EPD_ERR_NOT_FOUND) {
    reply_err(rep, r, "detach of client %llu failed: %s", (unsigned long long)q->client_id, result_name(r));
    return;
  }
  secrets_remove(q->client_id);
  /* A client that detaches before redeeming its token (libepd failed after Attach) leaves no pending
   * token to hold a max_pending_tokens place until it expires */
  epd_attach_forget_token(q->client_id);
  if (r == EPD_ERR_NOT_FOUND) {
    reply_err(rep, r, "client_id: %llu is not attached (lost before Detach)", (unsigned long long)q->client_id);
    return;
  }
  Epd__V1__DetachReply d = EPD__V1__DETACH_REPLY__INIT;
  reply_msg(rep, &d.base);
  epd_events_publish("detach", "", -1, q->client_id, 0, 0, 0, "client %llu detached",
                     (unsigned long long)q->client_id);
}

static void h_status(rpc_reply_t *rep, int metrics) {
  epd_engine_snap_t snap;
  epd_daemon_info_t info;
  char *cfg;
  epd_result_t r = take_snapshot(&snap, &info, &cfg);
  if (r != EPD_OK) {
    reply_err(rep, r, "engine snapshot failed: %s", result_name(r));
    free(cfg);
    return;
  }
  if (metrics) {
    char *text = NULL;
    r = epd_metrics_text(&snap, &info, &text, NULL);
    if (r == EPD_OK) {
      Epd__V1__MetricsReply m = EPD__V1__METRICS_REPLY__INIT;
      m.text = text;
      reply_msg(rep, &m.base);
    }
    free(text);
  } else {
    Epd__V1__StatusReply *st = NULL;
    r = epd_metrics_status(&snap, &info, &st);
    if (r == EPD_OK) reply_msg(rep, &st->base);
    epd_metrics_status_free(st);
  }
  if (r != EPD_OK) reply_err(rep, r, "building the %s failed: %s", metrics ? "metrics" : "status", result_name(r));
  epd_engine_snapshot_free(&snap);
  free(cfg);
}

static void h_setmap(const Epd__V1__SetExpertMapRequest *q, rpc_reply_t *rep) {
  const Epd__V1__ExpertMap *m = q->map;
  if (!m) {
    reply_err(rep, EPD_ERR_INVALID, "map: missing");
    return;
  }
  char group[EPD_GROUP_NAME_MAX];
  if (copy_name(rep, "map.group", group, sizeof group, m->group, "default")) return;
  size_t n = m->n_experts;
  if (n == 0 || n > (1u << 20)) {
    reply_err(rep, EPD_ERR_INVALID, "map.experts: %zu entries, expected one per logical expert (1..%u)", n,
              1u << 20);
    return;
  }
  epd_expert_map_t cur;
  memset(&cur, 0, sizeof cur);
  epd_result_t r = epd_engine_get_map(g.eng, group, &cur);
  if (r != EPD_OK) {
    reply_err(rep, r, "map.group: %s: %s", group, r == EPD_ERR_NOT_FOUND ? "no such group" : result_name(r));
    return;
  }
  epd_expert_map_t em;
  memset(&em, 0, sizeof em);
  em.num_experts = (uint32_t)n;
  em.num_ranks = m->num_ranks ? m->num_ranks : cur.num_ranks;
  em.slots_per_rank = m->slots_per_rank ? m->slots_per_rank : cur.slots_per_rank;
  epd_expert_map_free(&cur);
  em.nrep = calloc(n, sizeof *em.nrep);
  em.rep = calloc(n, sizeof *em.rep);
  if (!em.nrep || !em.rep) {
    reply_err(rep, EPD_ERR_NOMEM, "out of memory for a %zu-expert map", n);
    goto out;
  }
  for (size_t i = 0; i < n; i++) {
    const Epd__V1__ExpertPlacement *p = m->experts[i];
    if (p->expert >= n) {
      reply_err(rep, EPD_ERR_INVALID, "map.experts[%zu].expert: %u out of range [0, %zu)", i, p->expert, n);
      goto out;
    }
    if (em.nrep[p->expert]) {
      reply_err(rep, EPD_ERR_INVALID, "map.experts[%zu].expert: %u listed twice", i, p->expert);
      goto out;
    }
    if (p->n_replicas < 1 || p->n_replicas > EPD_MAX_REPLICAS) {
      reply_err(rep, EPD_ERR_INVALID, "map.experts[%zu].replicas: %zu replicas of expert %u, allowed 1..%d", i,
                p->n_replicas, p->expert, EPD_MAX_REPLICAS);
      goto out;
    }
    em.nrep[p->expert] = (uint8_t)p->n_replicas;
    for (size_t k = 0; k < p->n_replicas; k++) {
      em.rep[p->expert][k].rank = p->replicas[k]->rank;
      em.rep[p->expert][k].slot = p->replicas[k]->slot;
    }
  }
  uint32_t version = 0;
  char err[320] = "";
  epd_weight_copy_t *cps = NULL;
  if (q->n_copies > (1u << 16)) {
    reply_err(rep, EPD_ERR_INVALID, "copies: %zu entries, at most %u", q->n_copies, 1u << 16);
    goto out;
  }
  if (q->n_copies && !(cps = calloc(q->n_copies, sizeof *cps))) {
    reply_err(rep, EPD_ERR_NOMEM, "out of memory for %zu copies", q->n_copies);
    goto out;
  }
  for (size_t i = 0; i < q->n_copies; i++)
    cps[i] = (epd_weight_copy_t){q->copies[i]->src_rank, q->copies[i]->src_slot, q->copies[i]->dst_rank,
                                 q->copies[i]->dst_slot};
  r = epd_engine_set_map_copies(g.eng, group, &em, cps, (uint32_t)q->n_copies, &version, err, sizeof err);
  free(cps);
  if (r != EPD_OK) {
    reply_err(rep, r, "%s", err[0] ? err : result_name(r));
    goto out;
  }
  em.version = version;
  epd_state_save_map(group, &em); /* the last accepted map survives a restart */
  Epd__V1__SetExpertMapReply sr = EPD__V1__SET_EXPERT_MAP_REPLY__INIT;
  sr.version = version;
  reply_msg(rep, &sr.base);
  epd_log_msg(EPD_LOG_INFO, EPD_SUB_RPC, -1, 0, "expert map version %u staged for group %s (%zu experts)", version,
              group, n);
out:
  free(em.nrep);
  free(em.rep);
}

static void h_getmap(const Epd__V1__GetExpertMapRequest *q, rpc_reply_t *rep) {
  char group[EPD_GROUP_NAME_MAX];
  if (copy_name(rep, "group", group, sizeof group, q->group, "default")) return;
  epd_expert_map_t em;
  memset(&em, 0, sizeof em);
  epd_result_t r = epd_engine_get_map(g.eng, group, &em);
  if (r != EPD_OK) {
    reply_err(rep, r, "group: %s: %s", group, r == EPD_ERR_NOT_FOUND ? "no such group" : result_name(r));
    return;
  }
  size_t n = em.num_experts, nrep = 0;
  for (size_t e = 0; e < n; e++) nrep += em.nrep[e] <= EPD_MAX_REPLICAS ? em.nrep[e] : EPD_MAX_REPLICAS;
  Epd__V1__ExpertPlacement *pl = calloc(n ? n : 1, sizeof *pl);
  Epd__V1__ExpertPlacement **plp = calloc(n ? n : 1, sizeof *plp);
  Epd__V1__Replica *rp = calloc(nrep ? nrep : 1, sizeof *rp);
  Epd__V1__Replica **rpp = calloc(nrep ? nrep : 1, sizeof *rpp);
  if (!pl || !plp || !rp || !rpp) {
    reply_err(rep, EPD_ERR_NOMEM, "out of memory for a %zu-expert map", n);
  } else {
    size_t k = 0;
    for (size_t e = 0; e < n; e++) {
      epd__v1__expert_placement__init(&pl[e]);
      pl[e].expert = (uint32_t)e;
      pl[e].replicas = &rpp[k];
      for (size_t i = 0; i < em.nrep[e] && i < EPD_MAX_REPLICAS; i++, k++) {
        epd__v1__replica__init(&rp[k]);
        rp[k].rank = em.rep[e][i].rank;
        rp[k].slot = em.rep[e][i].slot;
        rpp[k] = &rp[k];
        pl[e].n_replicas++;
      }
      plp[e] = &pl[e];
    }
    Epd__V1__ExpertMap m = EPD__V1__EXPERT_MAP__INIT;
    m.group = group;
    m.version = em.version;
    m.n_experts = n;
    m.experts = plp;
    m.slots_per_rank = em.slots_per_rank;
    m.num_ranks = em.num_ranks;
    reply_msg(rep, &m.base);
  }
  free(pl);
  free(plp);
  free(rp);
  free(rpp);
  epd_expert_map_free(&em);
}

static void h_drain(const Epd__V1__DrainRequest *q, rpc_reply_t *rep) {
  if (g.hooks.drain)
    g.hooks.drain(g.hooks.arg, q->exit ? 1 : 0);
  else
    epd_engine_set_draining(g.eng, 1);
  epd_engine_snap_t snap;
  Epd__V1__DrainReply d = EPD__V1__DRAIN_REPLY__INIT;
  if (epd_engine_snapshot(g.eng, &snap) == EPD_OK) {
    d.clients = snap.nclients;
    epd_engine_snapshot_free(&snap);
  }
  epd_log_msg(EPD_LOG_INFO, EPD_SUB_RPC, -1, 0, "drain requested over RPC (exit when idle: %s), %u clients attached",
              q->exit ? "yes" : "no", d.clients);
  reply_msg(rep, &d.base);
}

/* Serving status of a Health service name; SERVICE_UNKNOWN for names we do not serve. */
static int health_status(const char *service) {
  if (service[0] && strcmp(service, "epd.v1.Control"))
    return GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN;
  return is_serving() ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                      : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
}

static void h_hcheck(const Grpc__Health__V1__HealthCheckRequest *q, rpc_reply_t *rep) {
  int st = health_status(q->service ? q->service : "");
  /* health.proto: Check fails with NOT_FOUND for an unknown service (SERVICE_UNKNOWN is Watch-only). */
  if (st == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN) {
    reply_err(rep, EPD_ERR_NOT_FOUND, "service: unknown service \"%s\" (served: \"\", \"epd.v1.Control\")", q->service);
    return;
  }
  Grpc__Health__V1__HealthCheckResponse hr = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
  hr.status = st;
  reply_msg(rep, &hr.base);
}

/* Decode and check a request of method m from bytes: NULL with rep filled on failure. */
static ProtobufCMessage *decode_bytes(int m, const uint8_t *data, size_t len, rpc_reply_t *rep) {
  const char *name = methods[m].name;
  ProtobufCMessage *msg = protobuf_c_message_unpack(methods[m].req, NULL, len, data);
  if (!msg) {
    reply_err(rep, EPD_ERR_INVALID, "malformed %sRequest", name);
    return NULL;
  }
  if (methods[m].versioned) {
    const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field_by_name(methods[m].req, "protocol_version");
    uint32_t v = f ? *(const uint32_t *)((const char *)msg + f->offset) : 0;
    /* proto3 does not send a zero field: generic clients (grpcurl, health checkers built from the proto)
     * leave protocol_version out, so 0 means "the current version"; only a version we do not speak fails. */
    if (v != 0 && v != EPD_PROTOCOL_VERSION) {
      reply_err(rep, EPD_ERR_PROTOCOL, "protocol_version: client speaks %u, daemon speaks %u", v,
                EPD_PROTOCOL_VERSION);
      protobuf_c_message_free_unpacked(msg, NULL);
      return NULL;
    }
  }
  return msg;
}

/* Decode and check a request: NULL with rep filled on failure. */
static ProtobufCMessage *decode(rpc_call_t *c, rpc_reply_t *rep) {
  const char *name = methods[c->method].name;
  ProtobufCMessage *msg = NULL;
  if (c->payload) {
    grpc_byte_buffer_reader rd;
    if (!grpc_byte_buffer_reader_init(&rd, c->payload)) {
      reply_err(rep, EPD_ERR_INVALID, "malformed %sRequest (cannot read the payload)", name);
      return NULL;
    }
    grpc_slice s = grpc_byte_buffer_reader_readall(&rd);
    msg = decode_bytes(c->method, GRPC_SLICE_START_PTR(s), GRPC_SLICE_LENGTH(s), rep);
    grpc_slice_unref(s);
    grpc_byte_buffer_reader_destroy(&rd);
  } else {
    msg = decode_bytes(c->method, (const uint8_t *)"", 0, rep);
  }
  return msg;
}

static void handle_unary(rpc_call_t *c, rpc_reply_t *rep) {
  ProtobufCMessage *msg = decode(c, rep);
  if (!msg) return;
  /* State-changing calls: root, the daemon's uid, daemon.admin_uids or members of daemon.admin_gid. */
  if ((c->method == M_SETMAP || c->method == M_DRAIN) &&
      !epd_access_is_admin(c->peer_known, (int32_t)c->peer_pid, c->peer_uid, c->peer_gid)) {
    EPD_LOGW(EPD_SUB_RPC, "%s refused: pid %u uid %u gid %u is not an admin", methods[c->method].name, c->peer_pid,
             c->peer_uid, c->peer_gid);
    reply_err(rep, EPD_ERR_PERMISSION,
              "%s needs admin rights: root, the daemon's uid, daemon.admin_uids or group daemon.admin_gid "
              "(caller uid %u gid %u)", methods[c->method].name, c->peer_uid, c->peer_gid);
    protobuf_c_message_free_unpacked(msg, NULL);
    return;
  }
  switch (c->method) {
  case M_ATTACH: h_attach(c, (const Epd__V1__AttachRequest *)msg, rep); break;
  case M_DETACH: h_detach((const Epd__V1__DetachRequest *)msg, rep); break;
  case M_STATUS: h_status(rep, 0); break;
  case M_METRICS: h_status(rep, 1); break;
  case M_SETMAP: h_setmap((const Epd__V1__SetExpertMapRequest *)msg, rep); break;
  case M_GETMAP: h_getmap((const Epd__V1__GetExpertMapRequest *)msg, rep); break;
  case M_DRAIN: h_drain((const Epd__V1__DrainRequest *)msg, rep); break;
  case M_HCHECK: h_hcheck((const Grpc__Health__V1__HealthCheckRequest *)msg, rep); break;
  default: reply_err(rep, EPD_ERR_INTERNAL, "no handler for %s", methods[c->method].name); break;
  }
  protobuf_c_message_free_unpacked(msg, NULL);
}

int epd_rpc_handle_bytes(epd_engine_t *eng, const char *method, const uint8_t *data, size_t len, char *details,
                         size_t dlen) {
  int m;
  for (m = 0; m < M_COUNT; m++)
    if (!strcmp(methods[m].path, method)) break;
  rpc_reply_t rep;
  memset(&rep, 0, sizeof rep);
  if (m == M_COUNT) {
    rep.code = GRPC_STATUS_UNIMPLEMENTED;
    snprintf(rep.details, sizeof rep.details, "unknown method %s", method);
  } else if (methods[m].streaming || g.server || !eng) {
    /* Streams, or a running server (whose state must not be touched from another thread): decode only. */
    ProtobufCMessage *msg = decode_bytes(m, data, len, &rep);
    if (msg) protobuf_c_message_free_unpacked(msg, NULL);
  } else {
    rpc_call_t c;
    memset(&c, 0, sizeof c);
    c.method = m;
    c.peer_known = 1;
    c.peer_pid = (uint32_t)getpid();
    c.peer_uid = (uint32_t)getuid();
    c.peer_gid = (uint32_t)getgid();
    g.eng = eng;
    rep.code = GRPC_STATUS_OK;
    ProtobufCMessage *msg = decode_bytes(m, data, len, &rep);
    if (msg) {
      protobuf_c_message_free_unpacked(msg, NULL);
      c.payload = NULL;
      /* handle_unary decodes again from a byte buffer: give it one. */
      grpc_slice sl = grpc_slice_from_copied_buffer((const char *)data, len);
      c.payload = grpc_raw_byte_buffer_create(&sl, 1);
      grpc_slice_unref(sl);
      handle_unary(&c, &rep);
      grpc_byte_buffer_destroy(c.payload);
    }
    g.eng = NULL;
  }
  if (details && dlen) snprintf(details, dlen, "%s", rep.details);
  free(rep.bytes);
  return (int)rep.code;
}

/* ---- call state machine --------------------------------------------------------------------------- */

static void call_free(rpc_call_t *c) {
  if (c->call) grpc_call_unref(c->call);
  grpc_metadata_array_destroy(&c->md);
  if (c->method == M_UNKNOWN) grpc_call_details_destroy(&c->details);
  if (c->payload) grpc_byte_buffer_destroy(c->payload);
  if (c->send_buf) grpc_byte_buffer_destroy(c->send_buf);
  if (c->has_details) grpc_slice_unref(c->status_details);
  if (c->has_trailing) grpc_slice_unref(c->trailing.value);
  for (rpc_call_t **p = &g.watches; *p; p = &(*p)->next)
    if (*p == c) {
      *p = c->next;
      break;
    }
  free(c);
  g.live_calls--;
}

/* Ask gRPC for the next call of a method (or of any unregistered method). */
static void request_call(int method) {
  rpc_call_t *c = calloc(1, sizeof *c);
  if (!c) {
    EPD_LOGE(EPD_SUB_RPC, "out of memory: method %s will not be served", method < M_COUNT ? methods[method].path : "*");
    return;
  }
  c->method = method;
  c->health_sent = -1;
  for (int i = 0; i < TAG_COUNT; i++) c->tags[i] = (rpc_tag_t){c, i};
  grpc_metadata_array_init(&c->md);
  grpc_call_error e;
  if (method == M_UNKNOWN) {
    grpc_call_details_init(&c->details);
    e = grpc_server_request_call(g.server, &c->call, &c->details, &c->md, g.cq, g.cq, &c->tags[TAG_NEW]);
  } else {
    e = grpc_server_request_registered_call(g.server, g.reg[method], &c->call, &c->deadline, &c->md, &c->payload,
                                            g.cq, g.cq, &c->tags[TAG_NEW]);
  }
  g.live_calls++;
  if (e != GRPC_CALL_OK) {
    EPD_LOGE(EPD_SUB_RPC, "request_call(%s) failed: %d", method < M_COUNT ? methods[method].path : "*", (int)e);
    call_free(c);
    return;
  }
  c->pending = 1;
}

static int start_batch(rpc_call_t *c, const grpc_op *ops, size_t n, int tag) {
  grpc_call_error e = grpc_call_start_batch(c->call, ops, n, &c->tags[tag], NULL);
  if (e != GRPC_CALL_OK) {
    EPD_LOGE(EPD_SUB_RPC, "start_batch(%s, tag %d) failed: %d", c->method < M_COUNT ? methods[c->method].name : "?",
             tag, (int)e);
    return -1;
  }
  c->pending++;
  return 0;
}

static void set_status(rpc_call_t *c, grpc_op *op, const rpc_reply_t *rep) {
  memset(op, 0, sizeof *op);
  op->op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  op->data.send_status_from_server.status = rep->code;
  if (rep->code != GRPC_STATUS_OK) {
    c->status_details = grpc_slice_from_copied_string(rep->details);
    c->has_details = 1;
    op->data.send_status_from_server.status_details = &c->status_details;
    snprintf(c->code_buf, sizeof c->code_buf, "%d", rep->epd_code);
    c->trailing.key = grpc_slice_from_static_string("epd-code");
    c->trailing.value = grpc_slice_from_copied_string(c->code_buf);
    c->has_trailing = 1;
    op->data.send_status_from_server.trailing_metadata_count = 1;
    op->data.send_status_from_server.trailing_metadata = &c->trailing;
  }
}

/* Send the final status (with initial metadata unless already sent) and the reply, if any. */
static void finish_call(rpc_call_t *c, const rpc_reply_t *rep) {
  grpc_op ops[4];
  size_t n = 0;
  memset(ops, 0, sizeof ops);
  if (!c->meta_done) ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
  if (rep->code == GRPC_STATUS_OK && rep->bytes) {
    grpc_slice s = grpc_slice_from_copied_buffer((const char *)rep->bytes, rep->len);
    c->send_buf = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = c->send_buf;
  }
  set_status(c, &ops[n++], rep);
  if (!c->close_started) {
    ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[n++].data.recv_close_on_server.cancelled = &c->cancelled;
  }
  c->ending = 1;
  if (start_batch(c, ops, n, TAG_DONE) != 0 && c->pending == 0) call_free(c);
}

static void start_stream(rpc_call_t *c) {
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_SEND_INITIAL_METADATA;
  if (start_batch(c, &op, 1, TAG_META) != 0) {
    call_free(c);
    return;
  }
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  op.data.recv_close_on_server.cancelled = &c->cancelled;
  if (start_batch(c, &op, 1, TAG_CLOSE) != 0) {
    grpc_call_cancel(c->call, NULL);
    c->closed = 1; /* freed when META completes */
  } else {
    c->close_started = 1;
  }
  c->next = g.watches;
  g.watches = c;
}

static void stream_send(rpc_call_t *c, const ProtobufCMessage *msg) {
  size_t n = protobuf_c_message_get_packed_size(msg);
  uint8_t *buf = malloc(n ? n : 1);
  if (!buf) return; /* retried on the next pump */
  protobuf_c_message_pack(msg, buf);
  grpc_slice s = grpc_slice_from_copied_buffer((const char *)buf, n);
  free(buf);
  if (c->send_buf) grpc_byte_buffer_destroy(c->send_buf);
  c->send_buf = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_SEND_MESSAGE;
  op.data.send_message.send_message = c->send_buf;
  if (start_batch(c, &op, 1, TAG_SEND) == 0) c->sending = 1;
}

/* Give every idle stream its next message: the next event, or a changed health status. */
static void pump_streams(void) {
  for (rpc_call_t *c = g.watches, *next; c; c = next) {
    next = c->next;
    if (!c->meta_done || c->sending || c->closed || c->ending) continue;
    if (c->method == M_WATCH) {
      epd_event_t ev;
      int r = epd_events_next(c->after, &ev, 0);
      if (r < 0) {
        rpc_reply_t rep = {0};
        reply_err(&rep, EPD_ERR_CLOSED, "the daemon is shutting down");
        finish_call(c, &rep);
        continue;
      }
      if (r == 0) continue;
      c->after = ev.seq;
      Epd__V1__Event m = EPD__V1__EVENT__INIT;
      m.seq = ev.seq;
      m.time_ns = ev.time_ns;
      m.kind = ev.kind;
      m.group = ev.group;
      m.rank = ev.rank;
      m.client_id = ev.client_id;
      m.message = ev.message;
      m.old_version = ev.old_version;
      m.new_version = ev.new_version;
      m.step = ev.step;
      stream_send(c, &m.base);
    } else {
      int st = health_status(c->service);
      if (st == c->health_sent) continue;
      Grpc__Health__V1__HealthCheckResponse hr = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
      hr.status = st;
      stream_send(c, &hr.base);
      if (c->sending) c->health_sent = st;
    }
  }
}

/* Fill c's peer credentials from the connection it came on. */
static void peer_lookup(rpc_call_t *c) {
  char *peer = grpc_call_get_peer(c->call);
  int fd = -1;
  if (peer && sscanf(peer, "fd:%d", &fd) == 1 && fd >= 0 && fd < (int)(sizeof g.cred_set)) {
    pthread_mutex_lock(&g.cred_mu);
    if (g.cred_set[fd]) {
      c->peer_known = 1;
      c->peer_pid = (uint32_t)g.creds[fd].pid;
      c->peer_uid = (uint32_t)g.creds[fd].uid;
      c->peer_gid = (uint32_t)g.creds[fd].gid;
    }
    pthread_mutex_unlock(&g.cred_mu);
  }
  gpr_free(peer);
}

static void on_new(rpc_call_t *c, int ok) {
  if (!ok) { /* the server is shutting down: the request was never matched with a call */
    call_free(c);
    return;
  }
  if (!atomic_load(&g.stop)) request_call(c->method);
  peer_lookup(c);
  rpc_reply_t rep;
  memset(&rep, 0, sizeof rep);
  if (c->method == M_UNKNOWN) {
    char *m = grpc_slice_to_c_string(c->details.method);
    rep.code = GRPC_STATUS_UNIMPLEMENTED;
    rep.epd_code = EPD_ERR_UNSUPPORTED;
    snprintf(rep.details, sizeof rep.details, "unknown method %s", m);
    gpr_free(m);
    finish_call(c, &rep);
    return;
  }
  if (!methods[c->method].streaming) {
    handle_unary(c, &rep);
    finish_call(c, &rep);
    free(rep.bytes);
    return;
  }
  ProtobufCMessage *msg = decode(c, &rep);
  if (!msg) {
    finish_call(c, &rep);
    return;
  }
  size_t nwatch = 0;
  for (rpc_call_t *w = g.watches; w; w = w->next) nwatch++;
  if (nwatch >= g.max_watches) { /* each stream holds a call and its buffers: bounded, not per client */
    reply_err(&rep, EPD_ERR_BUSY, "%s: %zu streams open, daemon.max_watches is %u", methods[c->method].name, nwatch,
              g.max_watches);
    protobuf_c_message_free_unpacked(msg, NULL);
    finish_call(c, &rep);
    return;
  }
  if (c->method == M_HWATCH) {
    const Grpc__Health__V1__HealthCheckRequest *q = (const Grpc__Health__V1__HealthCheckRequest *)msg;
    snprintf(c->service, sizeof c->service, "%s", q->service ? q->service : "");
  }
  protobuf_c_message_free_unpacked(msg, NULL);
  /* A Watch sees events published after it started; the initial metadata tells the client when. */
  c->after = epd_events_last_seq();
  start_stream(c);
}

static void on_event(grpc_event ev) {
  rpc_tag_t *t = ev.tag;
  rpc_call_t *c = t->c;
  c->pending--;
  switch (t->kind) {
  case TAG_NEW: on_new(c, ev.success); return;
  case TAG_DONE:
    if (!c->close_started) c->closed = 1; /* the batch carried RECV_CLOSE_ON_SERVER */
    break;
  case TAG_META:
    c->meta_done = 1;
    if (!ev.success) c->closed = 1;
    break;
  case TAG_SEND:
    c->sending = 0;
    if (!ev.success) { /* the stream broke: stop sending and let RECV_CLOSE finish it */
      c->ending = 1;
      grpc_call_cancel(c->call, NULL);
    }
    break;
  case TAG_CLOSE: c->closed = 1; break;
  }
  if (c->closed && c->pending == 0) call_free(c);
}

static void *rpc_thread(void *arg) {
  (void)arg;
  for (int m = 0; m < M_COUNT; m++) request_call(m);
  request_call(M_UNKNOWN);
  while (!atomic_load(&g.stop)) {
    /* Streams are pumped between waits, so wake often only while one is open. */
    gpr_timespec dl = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                   gpr_time_from_millis(g.watches ? 10 : 100, GPR_TIMESPAN));
    grpc_event ev = grpc_completion_queue_next(g.cq, dl, NULL);
    if (ev.type == GRPC_OP_COMPLETE) on_event(ev);
    pump_streams();
  }
  /* Shutdown order (DESIGN.md §10): notify, cancel, drain to the tag and every call freed. */
  static int shutdown_tag;
  grpc_server_shutdown_and_notify(g.server, g.cq, &shutdown_tag);
  grpc_server_cancel_all_calls(g.server);
  int got_shutdown = 0;
  uint64_t give_up = mono_ns() + 5000000000ull;
  while ((!got_shutdown || g.live_calls > 0) && mono_ns() < give_up) {
    grpc_event ev = grpc_completion_queue_next(
        g.cq, gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(100, GPR_TIMESPAN)), NULL);
    if (ev.type != GRPC_OP_COMPLETE) continue;
    if (ev.tag == &shutdown_tag)
      got_shutdown = 1;
    else
      on_event(ev);
  }
  if (g.live_calls > 0) EPD_LOGW(EPD_SUB_RPC, "%d calls still open at shutdown", g.live_calls);
  return NULL;
}

/* ---- socket --------------------------------------------------------------------------------------- */

static int mkdir_parents(const char *path, char *err, size_t errlen) {
  char dir[EPD_PATH_MAX];
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (!slash || slash == dir) return 0;
  *slash = 0;
  for (char *p = dir + 1; *p; p++) {
    if (*p != '/') continue;
    *p = 0;
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) goto fail;
    *p = '/';
  }
  if (mkdir(dir, 0755) != 0 && errno != EEXIST) goto fail;
  return 0;
fail:
  snprintf(err, errlen, "daemon.control_socket: cannot create directory %s: %s", dir, strerror(errno));
  return -1;
}

/* Remove a stale socket file, refusing to steal the socket of a live daemon. */
static int clear_stale(const char *path, char *err, size_t errlen) {
  struct stat st;
  if (lstat(path, &st) != 0) return 0;
  if (!S_ISSOCK(st.st_mode)) {
    snprintf(err, errlen, "daemon.control_socket: %s exists and is not a socket", path);
    return -1;
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    int live = connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    close(fd);
    if (live) {
      snprintf(err, errlen, "daemon.control_socket: %s: another daemon is listening there", path);
      return -1;
    }
  }
  if (unlink(path) != 0) {
    snprintf(err, errlen, "daemon.control_socket: cannot remove stale %s: %s", path, strerror(errno));
    return -1;
  }
  return 0;
}

static int apply_perms(const epd_conf_t *conf, char *err, size_t errlen) {
  if (chmod(g.path, conf->socket_mode & 07777) != 0) {
    snprintf(err, errlen, "daemon.socket_mode: chmod %s %o: %s", g.path, conf->socket_mode, strerror(errno));
    return -1;
  }
  if (conf->socket_group[0]) {
    struct group gr, *res = NULL;
    char buf[4096];
    if (getgrnam_r(conf->socket_group, &gr, buf, sizeof buf, &res) != 0 || !res) {
      snprintf(err, errlen, "daemon.socket_group: no group named \"%s\"", conf->socket_group);
      return -1;
    }
    if (chown(g.path, (uid_t)-1, gr.gr_gid) != 0) {
      snprintf(err, errlen, "daemon.socket_group: chgrp %s %s: %s", conf->socket_group, g.path, strerror(errno));
      return -1;
    }
  }
  return 0;
}

/* ---- connections: accepted here for SO_PEERCRED, then handed to gRPC ----------------------------- */

static int make_listener(char *err, size_t errlen) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  size_t n = strlen(g.path);
  if (n >= sizeof sa.sun_path) { /* checked by epd_rpc_init; kept so this function stands alone */
    snprintf(err, errlen, "daemon.control_socket: %s is too long", g.path);
    return -1;
  }
  memcpy(sa.sun_path, g.path, n + 1);
  g.listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (g.listen_fd < 0 || bind(g.listen_fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(g.listen_fd, 128) != 0) {
    snprintf(err, errlen, "daemon.control_socket: cannot listen on %s: %s", g.path, strerror(errno));
    if (g.listen_fd >= 0) close(g.listen_fd);
    g.listen_fd = -1;
    return -1;
  }
  return 0;
}

/* The control connections handed to gRPC, to bound them (daemon.max_control_conns, per uid). gRPC closes
 * a connection's fd without telling: an entry counts while its fd is still open on the same socket (the
 * same inode), checked at each accept. Accept thread only. */
#define CTL_TRACK_MAX 4096
typedef struct ctl_conn {
  int fd;
  ino_t ino;
  uint32_t uid;
} ctl_conn_t;
static ctl_conn_t ctl_track[CTL_TRACK_MAX];
static uint32_t nctl_track;

/* Drop the entries whose fd gRPC closed; return how many are left from uid (all of them in *total). */
static uint32_t ctl_count(uint32_t uid, uint32_t *total) {
  uint32_t n = 0, mine = 0;
  for (uint32_t i = 0; i < nctl_track; i++) {
    struct stat st;
    if (fstat(ctl_track[i].fd, &st) != 0 || st.st_ino != ctl_track[i].ino) continue;
    mine += ctl_track[i].uid == uid;
    ctl_track[n++] = ctl_track[i];
  }
  nctl_track = n;
  *total = n;
  return mine;
}

unsigned epd_rpc_control_conns(uint64_t refused[2]) {
  for (int i = 0; i < 2; i++) refused[i] = atomic_load(&g.ctl_refused[i]);
  return atomic_load(&g.nctl_open);
}

static void *accept_main(void *arg) {
  (void)arg;
  grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
  /* Refused peers are answered here (refuse.h), never handed to gRPC. */
  epd_refuse_set_t refused;
  epd_refuse_init(&refused);
  /* After an accept that failed (out of fds or memory) the listener leaves the poll set until resume_ns,
   * as the attach socket's does: it stays readable while connections wait, so polling it would spin. */
  static epd_log_ratelimit_t accept_rl = EPD_LOG_RATELIMIT_INITIALIZER(1000);
  static epd_log_ratelimit_t refuse_rl = EPD_LOG_RATELIMIT_INITIALIZER(1000);
  uint64_t resume_ns = 0;
  for (;;) {
    const uint64_t now = mono_ns();
    const int paused = resume_ns > now;
    struct pollfd pf[2 + EPD_REFUSE_MAX] = {{.fd = paused ? -1 : g.listen_fd, .events = POLLIN},
                                            {.fd = g.wake_fd[0], .events = POLLIN}};
    int nref = epd_refuse_pollfds(&refused, pf + 2);
    int timeout = epd_refuse_timeout_ms(&refused);
    const int rest_ms = paused ? (int)((resume_ns - now + 999999) / 1000000) : -1;
    if (paused && (timeout < 0 || rest_ms < timeout)) timeout = rest_ms;
    if (poll(pf, (nfds_t)(2 + nref), timeout) < 0) {
      if (errno == EINTR) continue;
      EPD_LOGE(EPD_SUB_RPC, "control socket poll: %s", strerror(errno));
      break;
    }
    if (pf[1].revents) break;
    epd_refuse_service(&refused, pf + 2, nref);
    if (!(pf[0].revents & POLLIN)) continue;
    /* gRPC needs a non-blocking fd: a blocking one hangs its event engine. */
    int fd = accept4(g.listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int e = errno; /* before anything else can change it */
      if (e == EAGAIN || e == EINTR || e == ECONNABORTED) continue;
      /* EMFILE, ENFILE, ENOBUFS, ENOMEM (or worse): rest 100 ms, and say so at most once a second */
      epd_log_ratelimited(&accept_rl, EPD_LOG_WARN, EPD_SUB_RPC, "control socket accept: %s; pausing 100 ms",
                          strerror(e));
      resume_ns = mono_ns() + 100 * 1000000ull;
      continue;
    }
    struct ucred cr;
    socklen_t len = sizeof cr;
    int have = getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) == 0;
    /* Unknown credentials pass only when no allow list is set (uid/gid -1 match no list entry). */
    if (!epd_access_allowed("control", have ? cr.pid : 0, have ? cr.uid : (uint32_t)-1,
                            have ? cr.gid : (uint32_t)-1)) {
      /* A bare hang-up reads as "no daemon" (UNAVAILABLE) to every gRPC client: say why instead, in the
       * words the attach socket uses. */
      char msg[EPD_REFUSE_MSG_MAX];
      if (have)
        snprintf(msg, sizeof msg, "uid %u gid %u is not allowed on this daemon (daemon.allow_uids/allow_gids)",
                 (unsigned)cr.uid, (unsigned)cr.gid);
      else
        snprintf(msg, sizeof msg, "the daemon cannot read this connection's credentials (SO_PEERCRED), and "
                 "daemon.allow_uids/allow_gids are set");
      epd_refuse_add(&refused, fd, GRPC_STATUS_PERMISSION_DENIED, EPD_ERR_PERMISSION, msg);
      continue;
    }
    {
      uint32_t total, mine = ctl_count(have ? cr.uid : (uint32_t)-1, &total);
      const int by_uid = mine >= g.max_ctl_uid, full = total >= g.max_ctl || total >= CTL_TRACK_MAX;
      struct stat st;
      if (by_uid || full || fstat(fd, &st) != 0) {
        char msg[EPD_REFUSE_MSG_MAX];
        if (by_uid)
          snprintf(msg, sizeof msg, "uid %u has %u control connections open (daemon.max_control_conns_per_uid)",
                   have ? (unsigned)cr.uid : 0u, mine);
        else
          snprintf(msg, sizeof msg, "%u control connections are open (daemon.max_control_conns)", total);
        atomic_fetch_add(&g.ctl_refused[by_uid ? 1 : 0], 1);
        epd_log_ratelimited(&refuse_rl, EPD_LOG_WARN, EPD_SUB_RPC, "control connection refused: %s", msg);
        epd_refuse_add(&refused, fd, GRPC_STATUS_RESOURCE_EXHAUSTED, EPD_ERR_BUSY, msg);
        atomic_store(&g.nctl_open, total);
        continue;
      }
      ctl_track[nctl_track++] = (ctl_conn_t){fd, st.st_ino, have ? cr.uid : (uint32_t)-1};
      atomic_store(&g.nctl_open, total + 1);
    }
    pthread_mutex_lock(&g.cred_mu);
    if (fd < (int)sizeof g.cred_set) {
      g.cred_set[fd] = (uint8_t)have;
      if (have) g.creds[fd] = cr;
    }
    pthread_mutex_unlock(&g.cred_mu);
    if (have)
      epd_log_msg(EPD_LOG_DEBUG, EPD_SUB_RPC, -1, 0, "control connection fd %d from pid %d uid %u gid %u", fd,
                  (int)cr.pid, (unsigned)cr.uid, (unsigned)cr.gid);
    grpc_server_add_channel_from_fd(g.server, fd, creds);
  }
  epd_refuse_close_all(&refused);
  grpc_server_credentials_release(creds);
  return NULL;
}

static int start_accept(char *err, size_t errlen) {
  if (pipe2(g.wake_fd, O_CLOEXEC) != 0) {
    snprintf(err, errlen, "pipe: %s", strerror(errno));
    return -1;
  }
  if (pthread_create(&g.accept_thread, NULL, accept_main, NULL) != 0) {
    snprintf(err, errlen, "cannot start the accept thread: %s", strerror(errno));
    return -1;
  }
  g.accept_started = 1;
  return 0;
}

static void stop_accept(void) {
  if (g.accept_started) {
    ssize_t w = write(g.wake_fd[1], "x", 1);
    (void)w; /* a full pipe still wakes the thread */
    pthread_join(g.accept_thread, NULL);
    g.accept_started = 0;
  }
  for (int i = 0; i < 2; i++)
    if (g.wake_fd[i] >= 0) {
      close(g.wake_fd[i]);
      g.wake_fd[i] = -1;
    }
  if (g.listen_fd >= 0) {
    close(g.listen_fd);
    g.listen_fd = -1;
  }
}

/* ---- module --------------------------------------------------------------------------------------- */

/* Shut the server down and wait for its tag (used where no call was ever requested). */
static void server_shutdown_idle(void) {
  static int tag;
  grpc_server_shutdown_and_notify(g.server, g.cq, &tag);
  grpc_server_cancel_all_calls(g.server);
  for (int i = 0; i < 50; i++) {
    grpc_event ev = grpc_completion_queue_next(
        g.cq, gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(100, GPR_TIMESPAN)), NULL);
    if (ev.type == GRPC_OP_COMPLETE && ev.tag == &tag) break;
  }
}

static void teardown(void) {
  if (g.server) grpc_server_destroy(g.server);
  g.server = NULL;
  if (g.cq) {
    grpc_completion_queue_shutdown(g.cq);
    for (;;) {
      grpc_event ev = grpc_completion_queue_next(g.cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
      if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    }
    grpc_completion_queue_destroy(g.cq);
    g.cq = NULL;
  }
  if (g.grpc_inited) grpc_shutdown();
  g.grpc_inited = 0;
  free(g.secrets);
  g.secrets = NULL;
  g.nsecrets = g.capsecrets = 0;
}

int epd_rpc_init(const epd_conf_t *conf, epd_engine_t *eng, const epd_rpc_hooks_t *hooks, char *err,
                 size_t errlen) {
  /* Checks first, on a local path: a failed init must not disturb a server that is running. */
  char path[EPD_PATH_MAX];
  if (conf->control_socket[0])
    snprintf(path, sizeof path, "%s", conf->control_socket);
  else
    epd_paths_control_default(path, sizeof path);
  if (strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
    snprintf(err, errlen, "daemon.control_socket: %s is %zu bytes, at most %zu allowed", path, strlen(path),
             sizeof(((struct sockaddr_un *)0)->sun_path) - 1);
    return -1;
  }
  if (mkdir_parents(path, err, errlen) || clear_stale(path, err, errlen)) return -1;
  if (g.thread_started) {
    snprintf(err, errlen, "control RPC already serving %s", g.path);
    return -1;
  }
  snprintf(g.path, sizeof g.path, "%s", path);
  memset(&g.reg, 0, sizeof g.reg);
  g.eng = eng;
  if (hooks)
    g.hooks = *hooks;
  else
    memset(&g.hooks, 0, sizeof g.hooks);
  atomic_store(&g.stop, 0);
  atomic_store(&g.serving, 1);
  g.start_ns = mono_ns();
  g.watches = NULL;
  g.max_watches = conf->max_watches ? conf->max_watches : 256;
  g.max_ctl = conf->max_control_conns ? conf->max_control_conns : 512;
  g.max_ctl_uid = conf->max_control_conns_per_uid ? conf->max_control_conns_per_uid : 128;
  nctl_track = 0; /* a server made again in this process starts its counts afresh */
  atomic_store(&g.nctl_open, 0);
  for (int i = 0; i < 2; i++) atomic_store(&g.ctl_refused[i], 0);
  g.live_calls = 0;

  grpc_init();
  g.grpc_inited = 1;
  grpc_arg arg = {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
                  .value.integer = (int)(conf->max_message_bytes ? conf->max_message_bytes : 4u << 20)};
  grpc_channel_args args = {.num_args = 1, .args = &arg};
  g.server = grpc_server_create(&args, NULL);
  g.cq = grpc_completion_queue_create_for_next(NULL);
  grpc_server_register_completion_queue(g.server, g.cq, NULL);
  for (int m = 0; m < M_COUNT; m++) {
    g.reg[m] = grpc_server_register_method(g.server, methods[m].path, NULL,
                                           GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    if (!g.reg[m]) {
      snprintf(err, errlen, "cannot register method %s", methods[m].path);
      server_shutdown_idle();
      teardown();
      return -1;
    }
  }
  if (make_listener(err, errlen) != 0) {
    server_shutdown_idle();
    teardown();
    return -1;
  }
  grpc_server_start(g.server);
  if (apply_perms(conf, err, errlen) != 0 || start_accept(err, errlen) != 0) {
    stop_accept();
    server_shutdown_idle();
    teardown();
    unlink(g.path);
    return -1;
  }
  if (pthread_create(&g.thread, NULL, rpc_thread, NULL) != 0) {
    snprintf(err, errlen, "cannot start the RPC thread: %s", strerror(errno));
    stop_accept();
    server_shutdown_idle();
    teardown();
    unlink(g.path);
    return -1;
  }
  g.thread_started = 1;
  EPD_LOGI(EPD_SUB_RPC, "control RPC listening on %s (mode %04o%s%s)", g.path, conf->socket_mode,
           conf->socket_group[0] ? ", group " : "", conf->socket_group);
  return 0;
}

void epd_rpc_fini(void) {
  if (!g.thread_started) return;
  stop_accept(); /* no new connection while the server shuts down */
  atomic_store(&g.stop, 1);
  pthread_join(g.thread, NULL);
  g.thread_started = 0;
  teardown();
  unlink(g.path);
  EPD_LOGI(EPD_SUB_RPC, "control RPC stopped");
}

const char *epd_rpc_socket_path(void) { return g.path; }

void epd_rpc_set_serving(int serving) { atomic_store(&g.serving, serving ? 1 : 0); }
