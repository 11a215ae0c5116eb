/*
 * cluster.c - scale-out start-up: rendezvous over gRPC (TCP) and the data links (see cluster.h).
 *
 * The Rendezvous RPC answers at once: every node polls it (every 100 ms) until the reply says the world
 * is complete. That keeps the coordinator stateless per call and lets a waiting node name the nodes
 * still missing when its own timeout expires. The coordinator keeps serving until every node has
 * received the complete reply, then shuts its server down; a fatal disagreement is answered to every
 * caller for a short grace period so that all nodes fail with the same message.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "control/cluster.h"
#include "rpc_client.h"
#include "core/engine.h"
#include "epd.pb-c.h"
#include "core/log.h"

#define METHOD "/epd.v1.Cluster/Rendezvous"
#define ID_BYTES 128
#define MAX_NODES EPD_MAX_RANKS
#define FATAL_GRACE_MS 1500

/* The world id: ID_BYTES random bytes (they authenticate the data links), followed with backend cuda by
 * the world communicator's ncclUniqueId (EPD_CLUSTER_COMM_ID_BYTES). */
typedef struct world {
  uint32_t nodes, node_rank, ranks_per_node;
  char addr[MAX_NODES][EPD_NET_ADDR_MAX];
  uint8_t id[ID_BYTES + EPD_CLUSTER_COMM_ID_BYTES];
  size_t id_len;
} world_t;

/* cluster.tls_*: the PEM files, read once at start-up (all three or none). */
typedef struct tls_files {
  char *ca, *cert, *key;
} tls_files_t;
#define PEM_MAX (1u << 20)

static char *read_pem(const char *key, const char *path, char *err, size_t errlen) {
  FILE *f = fopen(path, "r");
  if (!f) {
    snprintf(err, errlen, "%s %s: %s", key, path, strerror(errno));
    return NULL;
  }
  char *buf = malloc(PEM_MAX + 1);
  size_t n = buf ? fread(buf, 1, PEM_MAX + 1, f) : 0;
  int bad = !buf || ferror(f);
  fclose(f);
  if (bad) {
    snprintf(err, errlen, "%s %s: %s", key, path, buf ? "read error" : "out of memory");
  } else if (n > PEM_MAX) {
    snprintf(err, errlen, "%s %s: larger than %u bytes", key, path, PEM_MAX);
    bad = 1;
  } else {
    buf[n] = 0;
    if (!strstr(buf, "-----BEGIN ")) {
      snprintf(err, errlen, "%s %s: not a PEM file (no \"-----BEGIN\" line)", key, path);
      bad = 1;
    }
  }
  if (bad) {
    free(buf);
    return NULL;
  }
  return buf;
}

static void tls_free(tls_files_t *t) {
  free(t->ca);
  free(t->cert);
  if (t->key) explicit_bzero(t->key, strlen(t->key));
  free(t->key);
  memset(t, 0, sizeof *t);
}

/* 0 with t filled (all NULL: plaintext), -1 with err. */
static int tls_load(const epd_conf_t *c, tls_files_t *t, char *err, size_t errlen) {
  memset(t, 0, sizeof *t);
  const int set = !!c->cluster_tls_ca[0] + !!c->cluster_tls_cert[0] + !!c->cluster_tls_key[0];
  if (!set) return 0;
  if (set != 3) {
    snprintf(err, errlen,
             "cluster.tls_ca, cluster.tls_cert and cluster.tls_key: set all three or none (%s%s%sempty)",
             c->cluster_tls_ca[0] ? "" : "tls_ca ", c->cluster_tls_cert[0] ? "" : "tls_cert ",
             c->cluster_tls_key[0] ? "" : "tls_key ");
    return -1;
  }
  if (!(t->ca = read_pem("cluster.tls_ca", c->cluster_tls_ca, err, errlen)) ||
      !(t->cert = read_pem("cluster.tls_cert", c->cluster_tls_cert, err, errlen)) ||
      !(t->key = read_pem("cluster.tls_key", c->cluster_tls_key, err, errlen))) {
    tls_free(t);
    return -1;
  }
  return 0;
}

int epd_cluster_check_tls(const epd_conf_t *c, char *err, size_t errlen) {
  if (c->nodes <= 1) return 0;
  tls_files_t t;
  if (tls_load(c, &t, err, errlen)) return -1;
  tls_free(&t);
  return 0;
}

int epd_cluster_tls(const epd_conf_t *c) {
  return c->nodes > 1 && c->cluster_tls_ca[0] && c->cluster_tls_cert[0] && c->cluster_tls_key[0];
}

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

size_t epd_cluster_agreed_config(const epd_conf_t *c, char *buf, size_t len) {
  return (size_t)snprintf(
      buf, len,
      "protocol_version = %u\ncluster.nodes = %u\nengine.num_ranks = %u\nengine.backend = %s\n"
      "engine.max_experts = %u\nengine.max_hidden = %u\nengine.max_topk = %u\n"
      "engine.max_tokens = %u\nengine.slots_factor_pct = %u\nengine.ht_capacity_factor = %u\n"
      "cluster.gin_probe = %u\nlink_format = %u\n",
      EPD_PROTOCOL_VERSION, c->nodes, c->num_ranks, c->backend, c->max_experts, c->max_hidden, c->max_topk,
      c->max_tokens, c->slots_factor_pct, c->ht_capacity_factor, c->gin_probe, EPD_CLUSTER_LINK_FORMAT);
}

uint64_t epd_cluster_hash(const char *text) {
  uint64_t h = 1469598103934665603ull;
  for (const unsigned char *p = (const unsigned char *)text; *p; p++) {
    h ^= *p;
    h *= 1099511628211ull;
  }
  return h;
}

/* "key (node a: x, node b: y); ..." for every line of mine that theirs lacks or sets differently. */
static void config_diff(const char *mine, const char *theirs, uint32_t me, uint32_t them, char *out,
                        size_t len) {
  out[0] = 0;
  char *m = strdup(mine);
  if (!m) return;
  for (char *save = NULL, *line = strtok_r(m, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
    char key[96];
    const char *eq = strstr(line, " = ");
    if (!eq || (size_t)(eq - line) >= sizeof key) continue;
    snprintf(key, sizeof key, "%.*s", (int)(eq - line), line);
    const char *tv = "(absent)";
    char tbuf[96];
    for (const char *p = theirs; p && *p;) {
      const char *nl = strchr(p, '\n');
      size_t n = nl ? (size_t)(nl - p) : strlen(p);
      if (n > strlen(key) + 3 && !strncmp(p, key, strlen(key)) && !strncmp(p + strlen(key), " = ", 3)) {
        snprintf(tbuf, sizeof tbuf, "%.*s", (int)(n - strlen(key) - 3), p + strlen(key) + 3);
        tv = tbuf;
        break;
      }
      p = nl ? nl + 1 : NULL;
    }
    if (!strcmp(tv, eq + 3)) continue;
    size_t l = strlen(out);
    snprintf(out + l, len - l, "%s%s (node %u: %s, node %u: %s)", l ? "; " : "", key, me, eq + 3, them, tv);
  }
  free(m);
}

static const char *agreed_keys =
    "protocol version, cluster.nodes, engine.num_ranks, engine.backend, engine.max_experts, "
    "engine.max_hidden, "
    "engine.max_topk, engine.max_tokens, engine.slots_factor_pct, engine.ht_capacity_factor, "
    "cluster.gin_probe, "
    "link_format (the data links' frame layout: the same epd build on every node)";

/* ---- coordinator ------------------------------------------------------------------------------------ */

typedef struct rv_call {
  struct rv_call *next;
  grpc_call *call;
  gpr_timespec deadline;
  grpc_metadata_array md;
  grpc_byte_buffer *payload, *reply;
  grpc_slice details;
  int cancelled;
  int node_complete; /* the reply sent was the complete world to this node (-1: not) */
  char reply_tag;    /* its address is the tag of the reply batch */
} rv_call_t;

static void rv_free(rv_call_t *c) {
  if (c->call) grpc_call_unref(c->call);
  grpc_metadata_array_destroy(&c->md);
  if (c->payload) grpc_byte_buffer_destroy(c->payload);
  if (c->reply) grpc_byte_buffer_destroy(c->reply);
  grpc_slice_unref(c->details);
  free(c);
}

static void rv_reply(rv_call_t *c, grpc_status_code code, const char *msg, const ProtobufCMessage *body) {
  grpc_op ops[4];
  memset(ops, 0, sizeof ops);
  int n = 0;
  ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
  if (code == GRPC_STATUS_OK && body) {
    size_t len = protobuf_c_message_get_packed_size(body);
    uint8_t *buf = malloc(len ? len : 1);
    if (buf) {
      protobuf_c_message_pack(body, buf);
      grpc_slice s = grpc_slice_from_copied_buffer((const char *)buf, len);
      c->reply = grpc_raw_byte_buffer_create(&s, 1);
      grpc_slice_unref(s);
      free(buf);
      ops[n].op = GRPC_OP_SEND_MESSAGE;
      ops[n++].data.send_message.send_message = c->reply;
    } else {
      code = GRPC_STATUS_RESOURCE_EXHAUSTED;
      msg = "out of memory";
    }
  }
  grpc_slice_unref(c->details);
  c->details = grpc_slice_from_copied_string(msg ? msg : "");
  ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[n].data.send_status_from_server.status = code;
  ops[n++].data.send_status_from_server.status_details = &c->details;
  ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  ops[n++].data.recv_close_on_server.cancelled = &c->cancelled;
  if (grpc_call_start_batch(c->call, ops, (size_t)n, &c->reply_tag, NULL) != GRPC_CALL_OK)
    c->node_complete = -2; /* never completes: freed by the caller */
}

static Epd__V1__RendezvousRequest *rv_unpack(grpc_byte_buffer *bb) {
  if (!bb) return NULL;
  grpc_byte_buffer_reader r;
  if (!grpc_byte_buffer_reader_init(&r, bb)) return NULL;
  grpc_slice s = grpc_byte_buffer_reader_readall(&r);
  grpc_byte_buffer_reader_destroy(&r);
  Epd__V1__RendezvousRequest *m =
      epd__v1__rendezvous_request__unpack(NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
  grpc_slice_unref(s);
  return m;
}

static void missing_list(const int *joined, uint32_t nodes, char *out, size_t len) {
  out[0] = 0;
  for (uint32_t n = 0; n < nodes; n++)
    if (!joined[n]) {
      size_t l = strlen(out);
      snprintf(out + l, len - l, "%s%u", l ? ", " : "", n);
    }
}

/* A call of the Rendezvous method asked for on srv (its completion tag: the call), or NULL. */
static rv_call_t *rv_request(grpc_server *srv, void *method, grpc_completion_queue *cq) {
  rv_call_t *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  grpc_metadata_array_init(&c->md);
  c->details = grpc_empty_slice();
  c->node_complete = -1;
  if (grpc_server_request_registered_call(srv, method, &c->call, &c->deadline, &c->md, &c->payload, cq, cq,
                                          c) != GRPC_CALL_OK) {
    rv_free(c);
    return NULL;
  }
  return c;
}

/* The call of *live whose reply batch has this tag, unlinked (NULL: none). */
static rv_call_t *rv_unlink(rv_call_t **live, void *tag) {
  for (rv_call_t **p = live; *p; p = &(*p)->next)
    if (tag == &(*p)->reply_tag) {
      rv_call_t *c = *p;
      *p = c->next;
      return c;
    }
  return NULL;
}

/* 1 (why in msg) if rq's protocol, world shape or agreed configuration differs from w's (`whose`: the
 * coordinator's, the running world's). */
static int config_mismatch(const Epd__V1__RendezvousRequest *rq, const world_t *w, const char *agreed,
                           const char *whose, char *msg, size_t len) {
  if (rq->protocol_version == EPD_PROTOCOL_VERSION && rq->nodes == w->nodes &&
      rq->ranks_per_node == w->ranks_per_node && rq->config_hash == epd_cluster_hash(agreed) &&
      !strcmp(rq->agreed_config ? rq->agreed_config : "", agreed))
    return 0;
  char diff[700];
  config_diff(agreed, rq->agreed_config ? rq->agreed_config : "", 0, rq->node_rank, diff, sizeof diff);
  snprintf(msg, len,
           "node %u's configuration disagrees with the %s: %s (these keys must be equal on every node: %s)",
           rq->node_rank, whose, *diff ? diff : "config hash differs", agreed_keys);
  return 1;
}

/* rep gets the complete world: every node's data address (in peers / pp) and the world id. */
static void world_reply(const world_t *w, Epd__V1__ClusterPeer *peers, Epd__V1__ClusterPeer **pp,
                        Epd__V1__RendezvousReply *rep) {
  for (uint32_t i = 0; i < w->nodes; i++) {
    epd__v1__cluster_peer__init(&peers[i]);
    peers[i].node_rank = i;
    peers[i].data_addr = (char *)w->addr[i];
    pp[i] = &peers[i];
  }
  rep->n_peers = w->nodes;
  rep->peers = pp;
  rep->unique_id.data = (uint8_t *)w->id;
  rep->unique_id.len = w->id_len;
}

/* The coordinator's gRPC server, kept after the world formed to answer restarted nodes (rejoin_main). */
typedef struct rv_server {
  grpc_server *srv;
  grpc_completion_queue *cq;
  void *method;
  rv_call_t *live, *pending;
} rv_server_t;

/* Shutdown order of DESIGN.md §10; then gRPC is released (grpc_init was called by its creator). */
static void rv_shutdown(rv_server_t *s) {
  static int shutdown_tag;
  grpc_server_shutdown_and_notify(s->srv, s->cq, &shutdown_tag);
  grpc_server_cancel_all_calls(s->srv);
  for (int got = 0; !got;) {
    grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type != GRPC_OP_COMPLETE) continue;
    if (ev.tag == &shutdown_tag)
      got = 1;
    else if (ev.tag == s->pending) {
      rv_free(s->pending);
      s->pending = NULL;
    } else {
      rv_call_t *c = rv_unlink(&s->live, ev.tag);
      if (c) rv_free(c);
    }
  }
  grpc_server_destroy(s->srv);
  grpc_completion_queue_shutdown(s->cq);
  while (grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
         GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(s->cq);
  while (s->live) {
    rv_call_t *c = s->live;
    s->live = c->next;
    rv_free(c);
  }
  if (s->pending) rv_free(s->pending);
  s->pending = NULL;
  grpc_shutdown();
}

static int coordinator(const epd_conf_t *conf, const tls_files_t *tls, world_t *w, const char *agreed,
                       rv_server_t *keep, char *err, size_t errlen) {
  grpc_init();
  grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
  grpc_server *srv = grpc_server_create(NULL, NULL);
  void *method = grpc_server_register_method(srv, METHOD, NULL, GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
  grpc_server_credentials *cr;
  if (tls->ca) {
    /* mutual TLS: a node joins only with a certificate of cluster.tls_ca */
    grpc_ssl_pem_key_cert_pair kp = {.private_key = tls->key, .cert_chain = tls->cert};
    cr = grpc_ssl_server_credentials_create_ex(
        tls->ca, &kp, 1, GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY, NULL);
  } else {
    cr = grpc_insecure_server_credentials_create();
  }
  int port = cr ? grpc_server_add_http2_port(srv, conf->cluster_listen, cr) : 0;
  if (cr) grpc_server_credentials_release(cr);
  grpc_server_register_completion_queue(srv, cq, NULL);
  int rc = -1;
  if (!port) {
    snprintf(err, errlen, "cluster.listen %s: cannot listen there (address in use or invalid%s)",
             conf->cluster_listen,
             tls->ca ? ", or the cluster.tls_* PEM files are invalid or do not match" : "");
    grpc_server_destroy(srv);
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
    grpc_shutdown();
    return -1;
  }
  grpc_server_start(srv);
  EPD_LOGI(EPD_SUB_MAIN, "cluster: coordinator of %u nodes, rendezvous on %s", w->nodes,
           conf->cluster_listen);
  int joined[MAX_NODES] = {0}, got_complete[MAX_NODES] = {0};
  joined[0] = got_complete[0] = 1;
  uint32_t njoined = 1, ncomplete = 1;
  uint64_t deadline = now_ms() + conf->cluster_timeout_ms, fatal_until = 0;
  char fatal[2048] = "", missing[256];
  rv_call_t *live = NULL, *pending = NULL;
  Epd__V1__ClusterPeer peers[MAX_NODES], *pp[MAX_NODES];
  for (;;) {
    if (!pending && !(pending = rv_request(srv, method, cq))) break;
    uint64_t t = now_ms();
    if (*fatal && t >= fatal_until) break;
    if (!*fatal && ncomplete == w->nodes) {
      rc = 0;
      break;
    }
    if (!*fatal && t >= deadline) {
      missing_list(joined, w->nodes, missing, sizeof missing);
      if (njoined < w->nodes)
        snprintf(fatal, sizeof fatal,
                 "rendezvous incomplete after cluster.timeout_ms %u: node(s) %s did not join "
                 "(coordinator listening on %s%s)",
                 conf->cluster_timeout_ms, missing, conf->cluster_listen,
                 tls->ca ? " over mutual TLS: a node without cluster.tls_* or with a certificate that "
                           "cluster.tls_ca did not sign cannot connect"
                         : "");
      else
        snprintf(fatal, sizeof fatal,
                 "rendezvous incomplete after cluster.timeout_ms %u: every node joined but "
                 "not all fetched the peer list",
                 conf->cluster_timeout_ms);
      fatal_until = t + FATAL_GRACE_MS;
      continue;
    }
    grpc_event ev = grpc_completion_queue_next(
        cq, gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(50, GPR_TIMESPAN)), NULL);
    if (ev.type != GRPC_OP_COMPLETE) continue;
    if (ev.tag == pending) {
      rv_call_t *c = pending;
      pending = NULL;
      c->next = live;
      live = c;
      if (!ev.success) continue;
      Epd__V1__RendezvousRequest *rq = rv_unpack(c->payload);
      char msg[1024];
      if (*fatal) {
        rv_reply(c, GRPC_STATUS_FAILED_PRECONDITION, fatal, NULL);
      } else if (!rq) {
        rv_reply(c, GRPC_STATUS_INVALID_ARGUMENT, "malformed RendezvousRequest", NULL);
      } else if (config_mismatch(rq, w, agreed, "coordinator's", fatal, sizeof fatal)) {
        fatal_until = now_ms() + FATAL_GRACE_MS;
        rv_reply(c, GRPC_STATUS_FAILED_PRECONDITION, fatal, NULL);
      } else if (rq->node_rank == 0 || rq->node_rank >= w->nodes) {
        if (rq->node_rank)
          snprintf(msg, sizeof msg, "node_rank %u out of range [1, %u)", rq->node_rank, w->nodes);
        else
          snprintf(msg, sizeof msg,
                   "duplicate node_rank 0: that is the coordinator's (%s); two daemons have "
                   "cluster.node_rank = 0",
                   conf->cluster_listen);
        EPD_LOGW(EPD_SUB_MAIN, "cluster: refused a node: %s", msg);
        rv_reply(c, GRPC_STATUS_ALREADY_EXISTS, msg, NULL);
      } else if (joined[rq->node_rank] &&
                 strcmp(w->addr[rq->node_rank], rq->data_addr ? rq->data_addr : "")) {
        snprintf(msg, sizeof msg,
                 "duplicate node_rank %u: already joined with data address %s (this caller: %s); "
                 "two daemons have cluster.node_rank = %u",
                 rq->node_rank, w->addr[rq->node_rank], rq->data_addr ? rq->data_addr : "", rq->node_rank);
        EPD_LOGW(EPD_SUB_MAIN, "cluster: refused a node: %s", msg);
        rv_reply(c, GRPC_STATUS_ALREADY_EXISTS, msg, NULL);
      } else {
        uint32_t n = rq->node_rank;
        if (!joined[n]) {
          joined[n] = 1;
          njoined++;
          snprintf(w->addr[n], sizeof w->addr[n], "%s", rq->data_addr ? rq->data_addr : "");
          EPD_LOGI(EPD_SUB_MAIN, "cluster: node %u joined (data %s), %u of %u", n, w->addr[n], njoined,
                   w->nodes);
        }
        Epd__V1__RendezvousReply rep = EPD__V1__RENDEZVOUS_REPLY__INIT;
        uint32_t miss[MAX_NODES], nm = 0;
        for (uint32_t i = 0; i < w->nodes; i++)
          if (!joined[i]) miss[nm++] = i;
        rep.complete = nm == 0;
        rep.n_missing = nm;
        rep.missing = miss;
        if (rep.complete) {
          world_reply(w, peers, pp, &rep);
          c->node_complete = (int)n;
        }
        rv_reply(c, GRPC_STATUS_OK, "", &rep.base);
      }
      if (rq) epd__v1__rendezvous_request__free_unpacked(rq, NULL);
      if (c->node_complete == -2) c->node_complete = -1;
      continue;
    }
    /* A reply batch finished: a complete world delivered counts once per node. */
    rv_call_t *c = rv_unlink(&live, ev.tag);
    if (!c) continue;
    if (ev.success && !c->cancelled && c->node_complete > 0 && !got_complete[c->node_complete]) {
      got_complete[c->node_complete] = 1;
      ncomplete++;
    }
    rv_free(c);
  }
  if (*fatal)
    snprintf(err, errlen, "%s", fatal);
  else if (rc)
    snprintf(err, errlen, "rendezvous: out of memory or the gRPC server failed");
  rv_server_t st = {srv, cq, method, live, pending};
  if (rc == 0 && keep) { /* served on for restarted nodes (rejoin_main) */
    *keep = st;
    return 0;
  }
  rv_shutdown(&st);
  return rc;
}

/* ---- restarted nodes ------------------------------------------------------------------------------ */

/* Node 0 keeps its Rendezvous server after the world formed: a node whose daemon restarted (its data link
 * down here) calls it again and gets the world as it is (same id, every node's data address, running =
 * true), then links to every node (their accept threads take it: epd_net_connect). Backend cuda: the
 * reply carries a new NCCL world communicator id, which node 0 also sends every other node: they make
 * their world communicator again over it (epd_net_world_remake) while the restarted node makes its own. */
typedef struct rejoin_srv {
  rv_server_t s;
  world_t w;
  char agreed[1024], listen[EPD_NET_ADDR_MAX];
  int cuda;
  epd_cluster_comm_id_fn make_comm_id;
  /* backend cuda: the id handed to node n for the world communicator made again, while its link is down
   * (a Rendezvous asked again gets the same one: every other node is already making it) */
  uint8_t issued[MAX_NODES][EPD_CLUSTER_COMM_ID_BYTES];
  uint32_t issued_epoch[MAX_NODES];
  int has_issued[MAX_NODES];
  uint8_t cur[EPD_CLUSTER_COMM_ID_BYTES]; /* the id last sent to every node */
  int has_cur;
  epd_net_t *net;
  atomic_int stop;
  pthread_t th;
} rejoin_srv_t;
static rejoin_srv_t *g_rejoin; /* one cluster per daemon */
static int g_rejoined;         /* this daemon joined a running world (epd_cluster_rejoined) */

static void rejoin_answer(rejoin_srv_t *r, rv_call_t *c, const Epd__V1__RendezvousRequest *rq) {
  world_t *w = &r->w;
  char msg[2048], why[160];
  if (!rq) {
    rv_reply(c, GRPC_STATUS_INVALID_ARGUMENT, "malformed RendezvousRequest", NULL);
    return;
  }
  if (config_mismatch(rq, w, r->agreed, "running world's", msg, sizeof msg)) {
    EPD_LOGW(EPD_SUB_MAIN, "cluster: refused a restarted node: %s", msg);
    rv_reply(c, GRPC_STATUS_FAILED_PRECONDITION, msg, NULL);
    return;
  }
  const uint32_t n = rq->node_rank;
  if (n == 0 || n >= w->nodes) {
    snprintf(msg, sizeof msg,
             "node_rank %u: not a node that can join the running world (1..%u; 0 is the coordinator at %s)",
             n, w->nodes - 1, r->listen);
    rv_reply(c, GRPC_STATUS_ALREADY_EXISTS, msg, NULL);
    return;
  }
  if (!epd_net_node_dead(r->net, n, why, sizeof why)) {
    /* UNAVAILABLE: the caller asks again (its old daemon's link may not be found gone yet) until its
     * cluster.timeout_ms, then fails with this */
    snprintf(msg, sizeof msg,
             "node %u is part of the running world and its data link is up (its old daemon "
             "not yet found gone, or two daemons with cluster.node_rank = %u)",
             n, n);
    EPD_LOGW(EPD_SUB_MAIN, "cluster: a node asked to join again: %s", msg);
    rv_reply(c, GRPC_STATUS_UNAVAILABLE, msg, NULL);
    return;
  }
  int fresh = 0;
  if (r->cuda) { /* a new world communicator: every node makes it again with the restarted one */
    const uint32_t ep = epd_net_link_epoch(r->net, n);
    if ((!r->has_issued[n] || r->issued_epoch[n] != ep) && r->has_cur && epd_net_remake_pending(r->net)) {
      /* another node's restart is under way: that world communicator has this node's ranks too */
      memcpy(r->issued[n], r->cur, EPD_CLUSTER_COMM_ID_BYTES);
      r->has_issued[n] = 1;
      r->issued_epoch[n] = ep;
      EPD_LOGI(EPD_SUB_MAIN,
               "cluster: node %u restarted while the world communicator is being made again: it "
               "gets the same id",
               n);
    } else if (!r->has_issued[n] || r->issued_epoch[n] != ep) {
      char e[256] = "";
      if (!r->make_comm_id || r->make_comm_id(r->issued[n], e, sizeof e)) {
        snprintf(msg, sizeof msg,
                 "node %u restarted, but no new NCCL world communicator id could be made: %s", n, e);
        EPD_LOGW(EPD_SUB_MAIN, "cluster: refused a restarted node: %s", msg);
        rv_reply(c, GRPC_STATUS_UNAVAILABLE, msg, NULL);
        return;
      }
      r->has_issued[n] = 1;
      r->issued_epoch[n] = ep;
      memcpy(r->cur, r->issued[n], EPD_CLUSTER_COMM_ID_BYTES);
      r->has_cur = 1;
      fresh = 1;
    }
    memcpy(w->id + ID_BYTES, r->issued[n], EPD_CLUSTER_COMM_ID_BYTES);
  }
  snprintf(w->addr[n], sizeof w->addr[n], "%s", rq->data_addr ? rq->data_addr : "");
  Epd__V1__RendezvousReply rep = EPD__V1__RENDEZVOUS_REPLY__INIT;
  Epd__V1__ClusterPeer peers[MAX_NODES], *pp[MAX_NODES];
  world_reply(w, peers, pp, &rep);
  rep.complete = 1;
  rep.running = 1;
  EPD_LOGI(EPD_SUB_MAIN, "cluster: node %u joins the running world again (its daemon restarted; data %s)%s",
           n, w->addr[n], fresh ? "; every node makes the NCCL world communicator again with it" : "");
  rv_reply(c, GRPC_STATUS_OK, "", &rep.base);
  if (fresh) epd_net_world_remake(r->net, n, r->issued[n]);
}

static void *rejoin_main(void *arg) {
  rejoin_srv_t *r = arg;
  rv_server_t *s = &r->s;
  pthread_setname_np(pthread_self(), "epd-rejoin");
  while (!atomic_load(&r->stop)) {
    if (!s->pending && !(s->pending = rv_request(s->srv, s->method, s->cq))) break;
    grpc_event ev = grpc_completion_queue_next(
        s->cq, gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(200, GPR_TIMESPAN)), NULL);
    if (ev.type != GRPC_OP_COMPLETE) continue;
    if (ev.tag == s->pending) {
      rv_call_t *c = s->pending;
      s->pending = NULL;
      c->next = s->live;
      s->live = c;
      if (!ev.success) continue;
      Epd__V1__RendezvousRequest *rq = rv_unpack(c->payload);
      rejoin_answer(r, c, rq);
      if (rq) epd__v1__rendezvous_request__free_unpacked(rq, NULL);
      continue;
    }
    rv_call_t *c = rv_unlink(&s->live, ev.tag); /* its reply went */
    if (c) rv_free(c);
  }
  return NULL;
}

/* ---- the other nodes -------------------------------------------------------------------------------- */

/* Ask the coordinator until every node has joined (or a final refusal, or cluster.timeout_ms). The
 * channel is reopened after UNAVAILABLE: gRPC backs a refused connection off for seconds, and a
 * coordinator that starts a little after this node must be found at the next poll. */
static int joiner(const epd_conf_t *conf, const tls_files_t *tls, world_t *w, const char *agreed,
                  const char *data_addr, int *running, char *err, size_t errlen) {
  const epd_rpc_tls_t rt = {tls->ca, tls->cert, tls->key, conf->cluster_tls_server_name};
  Epd__V1__RendezvousRequest rq = EPD__V1__RENDEZVOUS_REQUEST__INIT;
  rq.protocol_version = EPD_PROTOCOL_VERSION;
  rq.node_rank = w->node_rank;
  rq.nodes = w->nodes;
  rq.ranks_per_node = w->ranks_per_node;
  rq.config_hash = epd_cluster_hash(agreed);
  rq.data_addr = (char *)data_addr;
  rq.agreed_config = (char *)agreed;
  uint64_t deadline = now_ms() + conf->cluster_timeout_ms;
  char last[1024] = "never reached", why[320];
  int rc = -1, reached = 0;
  epd_rpc_t *rpc = NULL;
  grpc_init(); /* held across the channel reopenings, so gRPC is not torn down between polls */
  EPD_LOGI(EPD_SUB_MAIN, "cluster: node %u of %u joining the coordinator at %s", w->node_rank, w->nodes,
           conf->cluster_coordinator);
  while (rc < 0) {
    ProtobufCMessage *m = NULL;
    epd_result_t r = rpc ? EPD_OK
                         : epd_rpc_open_target_tls(conf->cluster_coordinator, 2000, tls->ca ? &rt : NULL,
                                                   &rpc, why, sizeof why);
    if (r == EPD_OK)
      r = epd_rpc_call(rpc, METHOD, &rq.base, &epd__v1__rendezvous_reply__descriptor, &m, why, sizeof why);
    if (r == EPD_OK) {
      Epd__V1__RendezvousReply *rep = (Epd__V1__RendezvousReply *)m;
      reached = 1;
      if (rep->complete) {
        if (rep->n_peers != w->nodes || rep->unique_id.len != w->id_len) {
          snprintf(err, errlen, "coordinator %s: reply with %zu peers and a %zu-byte id (want %u, %zu)",
                   conf->cluster_coordinator, rep->n_peers, rep->unique_id.len, w->nodes, w->id_len);
          protobuf_c_message_free_unpacked(m, NULL);
          break;
        }
        for (size_t i = 0; i < rep->n_peers; i++)
          if (rep->peers[i]->node_rank < w->nodes)
            snprintf(w->addr[rep->peers[i]->node_rank], EPD_NET_ADDR_MAX, "%s",
                     rep->peers[i]->data_addr ? rep->peers[i]->data_addr : "");
        memcpy(w->id, rep->unique_id.data, w->id_len);
        *running = rep->running;
        rc = 0;
      } else {
        size_t l = (size_t)snprintf(last, sizeof last, "node(s) ");
        for (size_t i = 0; i < rep->n_missing && l < sizeof last; i++)
          l += (size_t)snprintf(last + l, sizeof last - l, "%s%u", i ? ", " : "", rep->missing[i]);
        if (l < sizeof last) snprintf(last + l, sizeof last - l, " did not join");
      }
      protobuf_c_message_free_unpacked(m, NULL);
    } else if (r == EPD_ERR_CLOSED || r == EPD_ERR_TIMEOUT) {
      if (strstr(why, "is part of the running world")) /* node 0's answer: asked again */
        snprintf(last, sizeof last, "coordinator (node 0) at %s: %s", conf->cluster_coordinator, why);
      else if (!reached)
        snprintf(last, sizeof last, "coordinator (node 0) at %s not reachable: %s (%s)",
                 conf->cluster_coordinator, why,
                 tls->ca
                     ? "mutual TLS: is the coordinator on TLS, with a certificate of cluster.tls_ca for this "
                       "host name or cluster.tls_server_name? are this node's cluster.tls_* files valid?"
                     : "plaintext; a coordinator with cluster.tls_* set refuses it");
      epd_rpc_close(rpc);
      rpc = NULL;
    } else {
      snprintf(err, errlen, "rendezvous with the coordinator at %s refused: %s", conf->cluster_coordinator,
               why);
      break;
    }
    if (rc < 0 && now_ms() >= deadline) {
      snprintf(err, errlen, "rendezvous incomplete after cluster.timeout_ms %u: %s", conf->cluster_timeout_ms,
               last);
      break;
    }
    if (rc < 0) usleep(100000);
  }
  epd_rpc_close(rpc);
  grpc_shutdown();
  return rc;
}

int epd_cluster_init(const epd_conf_t *conf, epd_cluster_comm_id_fn make_comm_id, epd_net_t **net,
                     uint8_t *comm_id, char *err, size_t errlen) {
  *net = NULL;
  if (conf->nodes <= 1) {
    if (conf->cluster_tls_ca[0] || conf->cluster_tls_cert[0] || conf->cluster_tls_key[0])
      EPD_LOGW(EPD_SUB_MAIN, "cluster.tls_*: ignored with cluster.nodes 1 (no rendezvous)");
    return 0;
  }
  if (conf->cluster_tls_server_name[0] && !conf->cluster_tls_ca[0])
    EPD_LOGW(EPD_SUB_MAIN, "cluster.tls_server_name: ignored without cluster.tls_ca, tls_cert and tls_key");
  if (conf->node_rank >= conf->nodes) {
    snprintf(err, errlen, "cluster.node_rank %u out of range [0, %u) (cluster.nodes %u)", conf->node_rank,
             conf->nodes, conf->nodes);
    return -1;
  }
  if ((uint64_t)conf->nodes * conf->num_ranks > EPD_MAX_RANKS) {
    snprintf(err, errlen, "cluster.nodes %u x engine.num_ranks %u = %u world ranks, at most %d", conf->nodes,
             conf->num_ranks, conf->nodes * conf->num_ranks, EPD_MAX_RANKS);
    return -1;
  }
  int cuda = !strcmp(conf->backend, "cuda");
  if (cuda && !make_comm_id) {
    snprintf(err, errlen,
             "cluster.nodes %u with engine.backend cuda: this daemon was built without CUDA (no NCCL world "
             "communicator); use engine.backend = host",
             conf->nodes);
    return -1;
  }
  if (conf->node_rank == 0 && !conf->cluster_listen[0]) {
    snprintf(err, errlen,
             "cluster.listen is empty: node 0 (the coordinator) needs a TCP host:port for the rendezvous");
    return -1;
  }
  if (conf->node_rank > 0 && !conf->cluster_coordinator[0]) {
    snprintf(err, errlen, "cluster.coordinator is empty: node %u needs the coordinator's host:port",
             conf->node_rank);
    return -1;
  }
  char adv[EPD_NET_ADDR_MAX], agreed[1024];
  rejoin_srv_t *r = NULL;
  int running = 0; /* the world already ran: this daemon restarted */
  tls_files_t tls;
  if (tls_load(conf, &tls, err, errlen)) return -1;
  if (epd_net_listen(conf->cluster_data_listen, net, adv, sizeof adv, err, errlen)) {
    tls_free(&tls);
    return -1;
  }
  epd_cluster_agreed_config(conf, agreed, sizeof agreed);
  world_t *w = calloc(1, sizeof *w);
  if (!w) {
    snprintf(err, errlen, "out of memory");
    goto fail;
  }
  w->nodes = conf->nodes;
  w->node_rank = conf->node_rank;
  w->ranks_per_node = conf->num_ranks;
  w->id_len = ID_BYTES + (cuda ? EPD_CLUSTER_COMM_ID_BYTES : 0);
  snprintf(w->addr[conf->node_rank], EPD_NET_ADDR_MAX, "%s", adv);
  if (conf->node_rank == 0) {
    if (getrandom(w->id, ID_BYTES, 0) != ID_BYTES) {
      snprintf(err, errlen, "getrandom: %s", strerror(errno));
      goto fail;
    }
    /* backend cuda: the world communicator's id is made here, once, and handed to every node. */
    if (cuda && make_comm_id(w->id + ID_BYTES, err, errlen)) goto fail;
    if (!(r = calloc(1, sizeof *r))) {
      snprintf(err, errlen, "out of memory");
      goto fail;
    }
    if (coordinator(conf, &tls, w, agreed, &r->s, err, errlen)) {
      free(r);
      r = NULL;
      goto fail;
    }
  } else if (joiner(conf, &tls, w, agreed, adv, &running, err, errlen)) {
    goto fail;
  }
  tls_free(&tls);
  uint64_t left = conf->cluster_timeout_ms; /* the links get a full timeout of their own */
  if (epd_net_connect(*net, w->nodes, w->node_rank, (const char(*)[EPD_NET_ADDR_MAX])w->addr, w->id,
                      (uint32_t)left, running, err, errlen))
    goto fail;
  if (cuda && comm_id) memcpy(comm_id, w->id + ID_BYTES, EPD_CLUSTER_COMM_ID_BYTES);
  g_rejoined = running;
  if (r) { /* node 0 answers restarted nodes from now on */
    r->w = *w;
    snprintf(r->agreed, sizeof r->agreed, "%s", agreed);
    snprintf(r->listen, sizeof r->listen, "%s", conf->cluster_listen);
    r->cuda = cuda;
    r->make_comm_id = make_comm_id;
    r->net = *net;
    if (pthread_create(&r->th, NULL, rejoin_main, r)) {
      snprintf(err, errlen, "pthread_create: %s", strerror(errno));
      goto fail;
    }
    g_rejoin = r;
  }
  EPD_LOGI(
      EPD_SUB_MAIN, "cluster: node %u of %u, %u world ranks, rendezvous %s, %s%s", w->node_rank, w->nodes,
      w->nodes * w->ranks_per_node, epd_cluster_tls(conf) ? "over mutual TLS" : "plaintext",
      cuda
          ? "NCCL world communicator id received; inter-node transport nccl-p2p (control over the data links)"
          : "inter-node transport host-tcp",
      running ? "; joined the running world again (this daemon restarted)" : "");
  free(w);
  return 0;
fail:
  if (r) {
    rv_shutdown(&r->s);
    free(r);
  }
  tls_free(&tls);
  free(w);
  epd_net_destroy(*net);
  *net = NULL;
  return -1;
}

int epd_cluster_rejoined(void) {
  return g_rejoined;
}

void epd_cluster_fini(epd_net_t *net) {
  rejoin_srv_t *r = g_rejoin;
  if (r && r->net == net) { /* before the links: it asks them */
    atomic_store(&r->stop, 1);
    pthread_join(r->th, NULL);
    rv_shutdown(&r->s);
    free(r);
    g_rejoin = NULL;
  }
  epd_net_destroy(net);
}
