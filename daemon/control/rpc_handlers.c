/*
 * rpc_handlers.c - the methods of the control RPC (epd.v1.Control and grpc.health.v1.Health): each
 * decodes its request, checks who asks (admin methods), calls the engine or the status builder and
 * packs the reply or an error status. Called from the server thread (rpc.c), one call at a time.
 */
#define _GNU_SOURCE
#include "control/rpc_internal.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/random.h>

#include <grpc/byte_buffer_reader.h>

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

uint64_t rpc_mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static grpc_status_code status_of(epd_result_t r) {
  switch (r) {
    case EPD_OK:
      return GRPC_STATUS_OK;
    case EPD_ERR_INVALID:
    case EPD_ERR_BAD_EXPERT:
    case EPD_ERR_TOO_MANY_TOKENS:
      return GRPC_STATUS_INVALID_ARGUMENT;
    case EPD_ERR_NOT_FOUND:
      return GRPC_STATUS_NOT_FOUND;
    case EPD_ERR_BUSY:
    case EPD_ERR_NOMEM:
    case EPD_ERR_OVERFLOW:
      return GRPC_STATUS_RESOURCE_EXHAUSTED;
    case EPD_ERR_DRAINING:
    case EPD_ERR_CLOSED:
      return GRPC_STATUS_UNAVAILABLE;
    case EPD_ERR_PERMISSION:
      return GRPC_STATUS_PERMISSION_DENIED;
    case EPD_ERR_PROTOCOL:
    case EPD_ERR_STATE:
    case EPD_ERR_MISMATCH:
      return GRPC_STATUS_FAILED_PRECONDITION;
    case EPD_ERR_TIMEOUT:
      return GRPC_STATUS_DEADLINE_EXCEEDED;
    case EPD_ERR_UNSUPPORTED:
      return GRPC_STATUS_UNIMPLEMENTED;
    default:
      return GRPC_STATUS_INTERNAL;
  }
}

/* Name of a result code. A copy of the table, because epd_strerror lives in libepd and the daemon
 * does not link it. */
static const char *result_name(int r) {
  static const char *const names[] = {"ok",
                                      "invalid argument",
                                      "out of memory",
                                      "system error",
                                      "rpc error",
                                      "protocol mismatch",
                                      "not found",
                                      "busy",
                                      "timeout",
                                      "peer failed",
                                      "draining",
                                      "cuda error",
                                      "nccl error",
                                      "unsupported",
                                      "bad expert",
                                      "too many tokens",
                                      "permission denied",
                                      "overflow",
                                      "mismatch",
                                      "closed",
                                      "state",
                                      "internal error"};
  return r <= 0 && r > EPD_ERR_MIN ? names[-r] : "unknown error";
}

void rpc_reply_err(rpc_reply_t *rep, epd_result_t r, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void rpc_reply_err(rpc_reply_t *rep, epd_result_t r, const char *fmt, ...) {
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
    rpc_reply_err(rep, EPD_ERR_NOMEM, "out of memory packing a %zu-byte reply", n);
    return;
  }
  rep->len = protobuf_c_message_pack(msg, rep->bytes);
  rep->code = GRPC_STATUS_OK;
  rep->epd_code = EPD_OK;
}

/* ---- daemon info for the status builder ----------------------------------------------------------- */

static const char *daemon_state(void) {
  const char *s = rpc_srv.hooks.state ? rpc_srv.hooks.state(rpc_srv.hooks.arg) : NULL;
  return s ? s : "ready";
}

static int is_serving(void) {
  return atomic_load(&rpc_srv.serving) && !atomic_load(&rpc_srv.stop) && !strcmp(daemon_state(), "ready");
}

/* Snapshot the engine and fill info; *cfg is malloc'ed config text (or NULL). */
static epd_result_t take_snapshot(epd_engine_snap_t *snap, epd_daemon_info_t *info, char **cfg) {
  memset(snap, 0, sizeof *snap);
  memset(info, 0, sizeof *info);
  *cfg = NULL;
  epd_result_t r = epd_engine_snapshot(rpc_srv.eng, snap);
  if (r != EPD_OK) return r;
  info->version = EPD_VERSION;
  info->state = daemon_state();
  info->uptime_ms = (rpc_mono_ns() - rpc_srv.start_ns) / 1000000ull;
  info->attach_connections = epd_attach_connections();
  epd_attach_stats(&info->attach);
  info->control_connections = epd_rpc_control_conns(info->control_refused);
  if (rpc_srv.hooks.config_dump) {
    *cfg = malloc(CONFIG_TEXT_MAX);
    if (*cfg) {
      size_t n = rpc_srv.hooks.config_dump(rpc_srv.hooks.arg, *cfg, CONFIG_TEXT_MAX);
      (*cfg)[n < CONFIG_TEXT_MAX ? n : CONFIG_TEXT_MAX - 1] = 0;
    }
  }
  info->config = *cfg;
  return EPD_OK;
}

/* ---- secrets (client_id -> secret, proves ownership on Detach) ------------------------------------ */

static void secrets_prune(void) {
  epd_engine_snap_t snap;
  if (epd_engine_snapshot(rpc_srv.eng, &snap) != EPD_OK) return;
  size_t w = 0;
  for (size_t i = 0; i < rpc_srv.nsecrets; i++) {
    int live = 0;
    for (uint32_t c = 0; c < snap.nclients && !live; c++)
      live = snap.clients[c].client_id == rpc_srv.secrets[i].client_id;
    if (live) rpc_srv.secrets[w++] = rpc_srv.secrets[i];
  }
  rpc_srv.nsecrets = w;
  epd_engine_snapshot_free(&snap);
}

static int secrets_add(uint64_t id, const uint8_t *secret) {
  /* Clients that died without Detach leave entries behind; drop them before growing. */
  if (rpc_srv.nsecrets == rpc_srv.capsecrets && rpc_srv.nsecrets >= 64) secrets_prune();
  if (rpc_srv.nsecrets == rpc_srv.capsecrets) {
    size_t ncap = rpc_srv.capsecrets ? rpc_srv.capsecrets * 2 : 64;
    secret_entry_t *n = realloc(rpc_srv.secrets, ncap * sizeof *n);
    if (!n) return -1;
    rpc_srv.secrets = n;
    rpc_srv.capsecrets = ncap;
  }
  rpc_srv.secrets[rpc_srv.nsecrets].client_id = id;
  memcpy(rpc_srv.secrets[rpc_srv.nsecrets].secret, secret, SECRET_BYTES);
  rpc_srv.nsecrets++;
  return 0;
}

static secret_entry_t *secrets_find(uint64_t id) {
  for (size_t i = 0; i < rpc_srv.nsecrets; i++)
    if (rpc_srv.secrets[i].client_id == id) return &rpc_srv.secrets[i];
  return NULL;
}

static void secrets_remove(uint64_t id) {
  for (size_t i = 0; i < rpc_srv.nsecrets; i++)
    if (rpc_srv.secrets[i].client_id == id) {
      rpc_srv.secrets[i] = rpc_srv.secrets[--rpc_srv.nsecrets];
      return;
    }
}

/* ---- handlers ------------------------------------------------------------------------------------- */

static int copy_name(rpc_reply_t *rep, const char *field, char *dst, size_t len, const char *src,
                     const char *dflt) {
  if (!src || !*src) src = dflt;
  size_t n = strlen(src);
  if (n >= len) {
    rpc_reply_err(rep, EPD_ERR_INVALID, "%s: %zu bytes, at most %zu allowed", field, n, len - 1);
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
  epd_result_t r = m.version > 1 ? epd_engine_restore_map(rpc_srv.eng, group, &m, err, sizeof err) : EPD_OK;
  if (r == EPD_OK && m.version > 1) {
    info->map_version = m.version;
    epd_log_msg(EPD_LOG_INFO, EPD_SUB_RPC, -1, 0,
                "group %s: expert map version %u restored from the state dir", group, m.version);
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
  int nranks = epd_engine_world_ranks(rpc_srv.eng); /* the engine checks the rank is on this node */
  if (q->rank < 0 || q->rank >= nranks) {
    rpc_reply_err(rep, EPD_ERR_INVALID, "rank: %d out of range [0, %d)", q->rank, nranks);
    return;
  }
  ar.rank = q->rank;
  ar.num_experts = q->num_experts;
  ar.hidden = q->hidden;
  ar.topk = q->topk;
  ar.max_tokens = q->max_tokens;
  ar.weight_bytes_per_slot = q->weight_bytes_per_slot;
  ar.on_rank_loss = q->on_rank_loss;
  ar.renormalize = q->renormalize;
  /* The kernel's word (SO_PEERCRED) over the client's: AttachRequest.pid is only a fallback. */
  ar.pid = c->peer_known ? c->peer_pid : q->pid;
  ar.uid = c->peer_known ? c->peer_uid : 0;
  ar.gid = c->peer_known ? c->peer_gid : 0;
  epd_attach_info_t info;
  memset(&info, 0, sizeof info);
  char err[256] = "";
  epd_result_t r = epd_engine_attach(rpc_srv.eng, &ar, &info, err, sizeof err);
  if (r != EPD_OK) {
    rpc_reply_err(rep, r, "%s", err[0] ? err : result_name(r));
    return;
  }
  if (info.map_version == 1) restore_map(ar.group, &info);
  uint8_t token[EPD_TOKEN_BYTES], secret[SECRET_BYTES];
  if (getrandom(secret, sizeof secret, 0) != (ssize_t)sizeof secret) {
    epd_engine_detach(rpc_srv.eng, info.client_id, 0);
    rpc_reply_err(rep, EPD_ERR_SYSTEM, "getrandom: %s", strerror(errno));
    return;
  }
  if (epd_attach_issue_token(info.client_id, ar.pid, ar.uid, token) != 0) {
    epd_engine_detach(rpc_srv.eng, info.client_id, 0);
    rpc_reply_err(rep, EPD_ERR_BUSY,
                  "cannot issue an attach token for client %llu (too many pending attaches)",
                  (unsigned long long)info.client_id);
    return;
  }
  if (secrets_add(info.client_id, secret) != 0) {
    epd_engine_detach(rpc_srv.eng, info.client_id, 0);
    rpc_reply_err(rep, EPD_ERR_NOMEM, "out of memory recording the client secret");
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
                     "client %s (pid %u uid %u) attached to group %s rank %d", ar.name, ar.pid, ar.uid,
                     ar.group, ar.rank);
}

static void h_detach(const Epd__V1__DetachRequest *q, rpc_reply_t *rep) {
  secret_entry_t *s = secrets_find(q->client_id);
  if (!s) {
    rpc_reply_err(rep, EPD_ERR_NOT_FOUND, "client_id: %llu is not attached",
                  (unsigned long long)q->client_id);
    return;
  }
  /* Constant-time compare: the secret is the only proof of ownership. */
  uint8_t diff = q->secret.len == SECRET_BYTES ? 0 : 1;
  for (size_t i = 0; i < SECRET_BYTES; i++)
    diff |= (uint8_t)((i < q->secret.len ? q->secret.data[i] : 0) ^ s->secret[i]);
  if (diff) {
    rpc_reply_err(rep, EPD_ERR_PERMISSION, "secret: does not match client %llu's (from its AttachReply)",
                  (unsigned long long)q->client_id);
    return;
  }
  epd_result_t r = epd_engine_detach(rpc_srv.eng, q->client_id, 0);
  if (r != EPD_OK && r != EPD_ERR_NOT_FOUND) {
    rpc_reply_err(rep, r, "detach of client %llu failed: %s", (unsigned long long)q->client_id,
                  result_name(r));
    return;
  }
  secrets_remove(q->client_id);
  /* A client that detaches before redeeming its token (libepd failed after Attach) leaves no pending
   * token to hold a max_pending_tokens place until it expires */
  epd_attach_forget_token(q->client_id);
  if (r == EPD_ERR_NOT_FOUND) {
    rpc_reply_err(rep, r, "client_id: %llu is not attached (lost before Detach)",
                  (unsigned long long)q->client_id);
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
    rpc_reply_err(rep, r, "engine snapshot failed: %s", result_name(r));
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
  if (r != EPD_OK)
    rpc_reply_err(rep, r, "building the %s failed: %s", metrics ? "metrics" : "status", result_name(r));
  epd_engine_snapshot_free(&snap);
  free(cfg);
}

static void h_setmap(const Epd__V1__SetExpertMapRequest *q, rpc_reply_t *rep) {
  const Epd__V1__ExpertMap *m = q->map;
  if (!m) {
    rpc_reply_err(rep, EPD_ERR_INVALID, "map: missing");
    return;
  }
  char group[EPD_GROUP_NAME_MAX];
  if (copy_name(rep, "map.group", group, sizeof group, m->group, "default")) return;
  size_t n = m->n_experts;
  if (n == 0 || n > (1u << 20)) {
    rpc_reply_err(rep, EPD_ERR_INVALID, "map.experts: %zu entries, expected one per logical expert (1..%u)",
                  n, 1u << 20);
    return;
  }
  epd_expert_map_t cur;
  memset(&cur, 0, sizeof cur);
  epd_result_t r = epd_engine_get_map(rpc_srv.eng, group, &cur);
  if (r != EPD_OK) {
    rpc_reply_err(rep, r, "map.group: %s: %s", group,
                  r == EPD_ERR_NOT_FOUND ? "no such group" : result_name(r));
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
    rpc_reply_err(rep, EPD_ERR_NOMEM, "out of memory for a %zu-expert map", n);
    goto out;
  }
  for (size_t i = 0; i < n; i++) {
    const Epd__V1__ExpertPlacement *p = m->experts[i];
    if (p->expert >= n) {
      rpc_reply_err(rep, EPD_ERR_INVALID, "map.experts[%zu].expert: %u out of range [0, %zu)", i, p->expert,
                    n);
      goto out;
    }
    if (em.nrep[p->expert]) {
      rpc_reply_err(rep, EPD_ERR_INVALID, "map.experts[%zu].expert: %u listed twice", i, p->expert);
      goto out;
    }
    if (p->n_replicas < 1 || p->n_replicas > EPD_MAX_REPLICAS) {
      rpc_reply_err(rep, EPD_ERR_INVALID,
                    "map.experts[%zu].replicas: %zu replicas of expert %u, allowed 1..%d", i, p->n_replicas,
                    p->expert, EPD_MAX_REPLICAS);
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
    rpc_reply_err(rep, EPD_ERR_INVALID, "copies: %zu entries, at most %u", q->n_copies, 1u << 16);
    goto out;
  }
  if (q->n_copies && !(cps = calloc(q->n_copies, sizeof *cps))) {
    rpc_reply_err(rep, EPD_ERR_NOMEM, "out of memory for %zu copies", q->n_copies);
    goto out;
  }
  for (size_t i = 0; i < q->n_copies; i++)
    cps[i] = (epd_weight_copy_t){q->copies[i]->src_rank, q->copies[i]->src_slot, q->copies[i]->dst_rank,
                                 q->copies[i]->dst_slot};
  r = epd_engine_set_map_copies(rpc_srv.eng, group, &em, cps, (uint32_t)q->n_copies, &version, err,
                                sizeof err);
  free(cps);
  if (r != EPD_OK) {
    rpc_reply_err(rep, r, "%s", err[0] ? err : result_name(r));
    goto out;
  }
  em.version = version;
  epd_state_save_map(group, &em); /* the last accepted map survives a restart */
  Epd__V1__SetExpertMapReply sr = EPD__V1__SET_EXPERT_MAP_REPLY__INIT;
  sr.version = version;
  reply_msg(rep, &sr.base);
  epd_log_msg(EPD_LOG_INFO, EPD_SUB_RPC, -1, 0, "expert map version %u staged for group %s (%zu experts)",
              version, group, n);
out:
  free(em.nrep);
  free(em.rep);
}

static void h_getmap(const Epd__V1__GetExpertMapRequest *q, rpc_reply_t *rep) {
  char group[EPD_GROUP_NAME_MAX];
  if (copy_name(rep, "group", group, sizeof group, q->group, "default")) return;
  epd_expert_map_t em;
  memset(&em, 0, sizeof em);
  epd_result_t r = epd_engine_get_map(rpc_srv.eng, group, &em);
  if (r != EPD_OK) {
    rpc_reply_err(rep, r, "group: %s: %s", group, r == EPD_ERR_NOT_FOUND ? "no such group" : result_name(r));
    return;
  }
  size_t n = em.num_experts, nrep = 0;
  for (size_t e = 0; e < n; e++) nrep += em.nrep[e] <= EPD_MAX_REPLICAS ? em.nrep[e] : EPD_MAX_REPLICAS;
  Epd__V1__ExpertPlacement *pl = calloc(n ? n : 1, sizeof *pl);
  Epd__V1__ExpertPlacement **plp = calloc(n ? n : 1, sizeof *plp);
  Epd__V1__Replica *rp = calloc(nrep ? nrep : 1, sizeof *rp);
  Epd__V1__Replica **rpp = calloc(nrep ? nrep : 1, sizeof *rpp);
  if (!pl || !plp || !rp || !rpp) {
    rpc_reply_err(rep, EPD_ERR_NOMEM, "out of memory for a %zu-expert map", n);
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
  if (rpc_srv.hooks.drain)
    rpc_srv.hooks.drain(rpc_srv.hooks.arg, q->exit ? 1 : 0);
  else
    epd_engine_set_draining(rpc_srv.eng, 1);
  epd_engine_snap_t snap;
  Epd__V1__DrainReply d = EPD__V1__DRAIN_REPLY__INIT;
  if (epd_engine_snapshot(rpc_srv.eng, &snap) == EPD_OK) {
    d.clients = snap.nclients;
    epd_engine_snapshot_free(&snap);
  }
  epd_log_msg(EPD_LOG_INFO, EPD_SUB_RPC, -1, 0,
              "drain requested over RPC (exit when idle: %s), %u clients attached", q->exit ? "yes" : "no",
              d.clients);
  reply_msg(rep, &d.base);
}

/* Serving status of a Health service name; SERVICE_UNKNOWN for names we do not serve. */
int rpc_health_status(const char *service) {
  if (service[0] && strcmp(service, "epd.v1.Control"))
    return GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN;
  return is_serving() ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                      : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
}

static void h_hcheck(const Grpc__Health__V1__HealthCheckRequest *q, rpc_reply_t *rep) {
  int st = rpc_health_status(q->service ? q->service : "");
  /* health.proto: Check fails with NOT_FOUND for an unknown service (SERVICE_UNKNOWN is Watch-only). */
  if (st == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN) {
    rpc_reply_err(rep, EPD_ERR_NOT_FOUND,
                  "service: unknown service \"%s\" (served: \"\", \"epd.v1.Control\")", q->service);
    return;
  }
  Grpc__Health__V1__HealthCheckResponse hr = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
  hr.status = st;
  reply_msg(rep, &hr.base);
}

/* Decode and check a request of method m from bytes: NULL with rep filled on failure. */
static ProtobufCMessage *decode_bytes(int m, const uint8_t *data, size_t len, rpc_reply_t *rep) {
  const char *name = rpc_methods[m].name;
  ProtobufCMessage *msg = protobuf_c_message_unpack(rpc_methods[m].req, NULL, len, data);
  if (!msg) {
    rpc_reply_err(rep, EPD_ERR_INVALID, "malformed %sRequest", name);
    return NULL;
  }
  if (rpc_methods[m].versioned) {
    const ProtobufCFieldDescriptor *f =
        protobuf_c_message_descriptor_get_field_by_name(rpc_methods[m].req, "protocol_version");
    uint32_t v = f ? *(const uint32_t *)((const char *)msg + f->offset) : 0;
    /* proto3 does not send a zero field: generic clients (grpcurl, health checkers built from the proto)
     * leave protocol_version out, so 0 means "the current version"; only a version we do not speak fails. */
    if (v != 0 && v != EPD_PROTOCOL_VERSION) {
      rpc_reply_err(rep, EPD_ERR_PROTOCOL, "protocol_version: client speaks %u, daemon speaks %u", v,
                    EPD_PROTOCOL_VERSION);
      protobuf_c_message_free_unpacked(msg, NULL);
      return NULL;
    }
  }
  return msg;
}

/* Decode and check a request: NULL with rep filled on failure. */
ProtobufCMessage *rpc_decode(rpc_call_t *c, rpc_reply_t *rep) {
  const char *name = rpc_methods[c->method].name;
  ProtobufCMessage *msg = NULL;
  if (c->payload) {
    grpc_byte_buffer_reader rd;
    if (!grpc_byte_buffer_reader_init(&rd, c->payload)) {
      rpc_reply_err(rep, EPD_ERR_INVALID, "malformed %sRequest (cannot read the payload)", name);
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

void rpc_handle_unary(rpc_call_t *c, rpc_reply_t *rep) {
  ProtobufCMessage *msg = rpc_decode(c, rep);
  if (!msg) return;
  /* State-changing calls: root, the daemon's uid, daemon.admin_uids or members of daemon.admin_gid. */
  if ((c->method == M_SETMAP || c->method == M_DRAIN) &&
      !epd_access_is_admin(c->peer_known, (int32_t)c->peer_pid, c->peer_uid, c->peer_gid)) {
    EPD_LOGW(EPD_SUB_RPC, "%s refused: pid %u uid %u gid %u is not an admin", rpc_methods[c->method].name,
             c->peer_pid, c->peer_uid, c->peer_gid);
    rpc_reply_err(
        rep, EPD_ERR_PERMISSION,
        "%s needs admin rights: root, the daemon's uid, daemon.admin_uids or group daemon.admin_gid "
        "(caller uid %u gid %u)",
        rpc_methods[c->method].name, c->peer_uid, c->peer_gid);
    protobuf_c_message_free_unpacked(msg, NULL);
    return;
  }
  switch (c->method) {
    case M_ATTACH:
      h_attach(c, (const Epd__V1__AttachRequest *)msg, rep);
      break;
    case M_DETACH:
      h_detach((const Epd__V1__DetachRequest *)msg, rep);
      break;
    case M_STATUS:
      h_status(rep, 0);
      break;
    case M_METRICS:
      h_status(rep, 1);
      break;
    case M_SETMAP:
      h_setmap((const Epd__V1__SetExpertMapRequest *)msg, rep);
      break;
    case M_GETMAP:
      h_getmap((const Epd__V1__GetExpertMapRequest *)msg, rep);
      break;
    case M_DRAIN:
      h_drain((const Epd__V1__DrainRequest *)msg, rep);
      break;
    case M_HCHECK:
      h_hcheck((const Grpc__Health__V1__HealthCheckRequest *)msg, rep);
      break;
    default:
      rpc_reply_err(rep, EPD_ERR_INTERNAL, "no handler for %s", rpc_methods[c->method].name);
      break;
  }
  protobuf_c_message_free_unpacked(msg, NULL);
}

int epd_rpc_handle_bytes(epd_engine_t *eng, const char *method, const uint8_t *data, size_t len,
                         char *details, size_t dlen) {
  int m;
  for (m = 0; m < M_COUNT; m++)
    if (!strcmp(rpc_methods[m].path, method)) break;
  rpc_reply_t rep;
  memset(&rep, 0, sizeof rep);
  if (m == M_COUNT) {
    rep.code = GRPC_STATUS_UNIMPLEMENTED;
    snprintf(rep.details, sizeof rep.details, "unknown method %s", method);
  } else if (rpc_methods[m].streaming || rpc_srv.server || !eng) {
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
    rpc_srv.eng = eng;
    rep.code = GRPC_STATUS_OK;
    ProtobufCMessage *msg = decode_bytes(m, data, len, &rep);
    if (msg) {
      protobuf_c_message_free_unpacked(msg, NULL);
      c.payload = NULL;
      /* handle_unary decodes again from a byte buffer: give it one. */
      grpc_slice sl = grpc_slice_from_copied_buffer((const char *)data, len);
      c.payload = grpc_raw_byte_buffer_create(&sl, 1);
      grpc_slice_unref(sl);
      rpc_handle_unary(&c, &rep);
      grpc_byte_buffer_destroy(c.payload);
    }
    rpc_srv.eng = NULL;
  }
  if (details && dlen) snprintf(details, dlen, "%s", rep.details);
  free(rep.bytes);
  return (int)rep.code;
}
