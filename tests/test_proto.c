/*
 * test_proto.c - the control protocol: protobuf round trips of every message (filled by reflection,
 * so a field added to the proto is covered without touching this file), malformed bytes rejected by
 * unpack, and the RPC server (daemon/rpc.c) driven in-process by the C client (client/rpc_client.c)
 * over a real Unix socket with the host engine.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "control/access.h"
#include "control/attach.h"
#include "control/conf.h"
#include "core/engine.h"
#include "epd.pb-c.h"
#include "control/events.h"
#include "health.pb-c.h"
#include "control/rpc.h"
#include "rpc_client.h"
#include "test.h"

static const ProtobufCMessageDescriptor *const all_messages[] = {
    &epd__v1__attach_request__descriptor,
    &epd__v1__buffer_info__descriptor,
    &epd__v1__attach_reply__descriptor,
    &epd__v1__detach_request__descriptor,
    &epd__v1__detach_reply__descriptor,
    &epd__v1__get_status_request__descriptor,
    &epd__v1__group_status__descriptor,
    &epd__v1__client_status__descriptor,
    &epd__v1__rank_status__descriptor,
    &epd__v1__status_reply__descriptor,
    &epd__v1__get_metrics_request__descriptor,
    &epd__v1__metrics_reply__descriptor,
    &epd__v1__replica__descriptor,
    &epd__v1__expert_placement__descriptor,
    &epd__v1__expert_map__descriptor,
    &epd__v1__set_expert_map_request__descriptor,
    &epd__v1__set_expert_map_reply__descriptor,
    &epd__v1__get_expert_map_request__descriptor,
    &epd__v1__watch_request__descriptor,
    &epd__v1__event__descriptor,
    &epd__v1__drain_request__descriptor,
    &epd__v1__drain_reply__descriptor,
    &grpc__health__v1__health_check_request__descriptor,
    &grpc__health__v1__health_check_response__descriptor,
};
#define NMSG (sizeof all_messages / sizeof all_messages[0])

/* ---- reflection filler: every field gets a distinct non-default value ------------------------------- */

static void *allocs[4096];
static int nallocs;
static void *talloc(size_t n) {
  void *p = calloc(1, n ? n : 1);
  ASSERT(p && nallocs < 4096);
  allocs[nallocs++] = p;
  return p;
}
static void tfree_all(void) {
  while (nallocs) free(allocs[--nallocs]);
}

static void fill_msg(ProtobufCMessage *m, const ProtobufCMessageDescriptor *d, unsigned seed, int depth);

/* Store element value number k of field f at dst. */
static void fill_value(const ProtobufCFieldDescriptor *f, void *dst, unsigned v, int depth) {
  switch (f->type) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32:
      *(int32_t *)dst = -(int32_t)v;
      break;
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32:
      *(uint32_t *)dst = v * 7919u;
      break;
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
      *(int64_t *)dst = -(int64_t)v * 1000000007ll;
      break;
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
      *(uint64_t *)dst = (uint64_t)v << 40 | v;
      break;
    case PROTOBUF_C_TYPE_FLOAT:
      *(float *)dst = (float)v + 0.5f;
      break;
    case PROTOBUF_C_TYPE_DOUBLE:
      *(double *)dst = (double)v + 0.25;
      break;
    case PROTOBUF_C_TYPE_BOOL:
      *(protobuf_c_boolean *)dst = 1;
      break;
    case PROTOBUF_C_TYPE_ENUM: {
      const ProtobufCEnumDescriptor *e = f->descriptor;
      *(int *)dst = e->values[e->n_values - 1].value;
      break;
    }
    case PROTOBUF_C_TYPE_STRING: {
      char *s = talloc(32);
      snprintf(s, 32, "%s-%u", f->name, v);
      *(char **)dst = s;
      break;
    }
    case PROTOBUF_C_TYPE_BYTES: {
      ProtobufCBinaryData *b = dst;
      b->len = 5 + v % 7;
      b->data = talloc(b->len);
      for (size_t i = 0; i < b->len; i++) b->data[i] = (uint8_t)(v * 31 + i * 17); /* includes 0 bytes */
      break;
    }
    case PROTOBUF_C_TYPE_MESSAGE: {
      const ProtobufCMessageDescriptor *md = f->descriptor;
      ProtobufCMessage *sub = talloc(md->sizeof_message);
      protobuf_c_message_init(md, sub);
      if (depth < 4) fill_msg(sub, md, v, depth + 1);
      *(ProtobufCMessage **)dst = sub;
      break;
    }
  }
}

static size_t type_size(const ProtobufCFieldDescriptor *f) {
  switch (f->type) {
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
      return 8;
    case PROTOBUF_C_TYPE_DOUBLE:
      return sizeof(double);
    case PROTOBUF_C_TYPE_BOOL:
      return sizeof(protobuf_c_boolean);
    case PROTOBUF_C_TYPE_STRING:
    case PROTOBUF_C_TYPE_MESSAGE:
      return sizeof(void *);
    case PROTOBUF_C_TYPE_BYTES:
      return sizeof(ProtobufCBinaryData);
    default:
      return 4;
  }
}

static void fill_msg(ProtobufCMessage *m, const ProtobufCMessageDescriptor *d, unsigned seed, int depth) {
  for (unsigned i = 0; i < d->n_fields; i++) {
    const ProtobufCFieldDescriptor *f = &d->fields[i];
    unsigned v = seed * 100 + i + 1;
    if (f->label == PROTOBUF_C_LABEL_REPEATED) {
      size_t n = 3;
      void *arr = talloc(n * type_size(f));
      for (size_t k = 0; k < n; k++) fill_value(f, (char *)arr + k * type_size(f), v + (unsigned)k, depth);
      *(size_t *)((char *)m + f->quantifier_offset) = n;
      *(void **)((char *)m + f->offset) = arr;
    } else {
      fill_value(f, (char *)m + f->offset, v, depth);
    }
  }
}

static uint8_t *pack_msg(const ProtobufCMessage *m, size_t *len) {
  *len = protobuf_c_message_get_packed_size(m);
  uint8_t *buf = malloc(*len ? *len : 1);
  ASSERT(buf);
  ASSERT_EQ(protobuf_c_message_pack(m, buf), *len);
  return buf;
}

EPD_TEST(proto_roundtrip_every_message) {
  for (size_t i = 0; i < NMSG; i++) {
    const ProtobufCMessageDescriptor *d = all_messages[i];
    ProtobufCMessage *m = talloc(d->sizeof_message);
    protobuf_c_message_init(d, m);
    fill_msg(m, d, (unsigned)i + 1, 0);
    ASSERT(protobuf_c_message_check(m));
    size_t len;
    uint8_t *buf = pack_msg(m, &len);
    if (d->n_fields) ASSERT_GT(len, 0);
    ProtobufCMessage *u = protobuf_c_message_unpack(d, NULL, len, buf);
    if (!u) epd_test_fail(__FILE__, __LINE__, "%s does not unpack its own packing", d->name);
    /* Same bytes again, and every scalar field read back equal. */
    size_t len2;
    uint8_t *buf2 = pack_msg(u, &len2);
    ASSERT_EQ(len2, len);
    if (memcmp(buf, buf2, len)) epd_test_fail(__FILE__, __LINE__, "%s repacks differently", d->name);
    for (unsigned k = 0; k < d->n_fields; k++) {
      const ProtobufCFieldDescriptor *f = &d->fields[k];
      if (f->label == PROTOBUF_C_LABEL_REPEATED) {
        ASSERT_EQ(*(size_t *)((char *)u + f->quantifier_offset), 3);
      } else if (f->type == PROTOBUF_C_TYPE_STRING) {
        if (strcmp(*(char **)((char *)u + f->offset), *(char **)((char *)m + f->offset)))
          epd_test_fail(__FILE__, __LINE__, "%s.%s differs after the round trip", d->name, f->name);
      } else if (f->type != PROTOBUF_C_TYPE_MESSAGE && f->type != PROTOBUF_C_TYPE_BYTES) {
        if (memcmp((char *)u + f->offset, (char *)m + f->offset, type_size(f)))
          epd_test_fail(__FILE__, __LINE__, "%s.%s differs after the round trip", d->name, f->name);
      }
    }
    protobuf_c_message_free_unpacked(u, NULL);
    free(buf);
    free(buf2);
  }
  tfree_all();
}

EPD_TEST(proto_attach_reply_fields) {
  Epd__V1__AttachReply a = EPD__V1__ATTACH_REPLY__INIT;
  Epd__V1__BufferInfo b = EPD__V1__BUFFER_INFO__INIT, *bp = &b;
  uint8_t tok[32], sec[32];
  for (int i = 0; i < 32; i++) tok[i] = (uint8_t)i, sec[i] = (uint8_t)(255 - i);
  b.kind = EPD_BUF_HT_Y;
  b.bank = 1;
  b.offset = 1ull << 33;
  b.bytes = 4096;
  a.client_id = 7;
  a.token = (ProtobufCBinaryData){32, tok};
  a.secret = (ProtobufCBinaryData){32, sec};
  a.attach_socket = "/run/epd/attach.sock";
  a.memory = "cuda";
  a.device = -1;
  a.n_buffers = 1;
  a.buffers = &bp;
  a.map_version = 9;
  size_t len;
  uint8_t *buf = pack_msg(&a.base, &len);
  Epd__V1__AttachReply *u = epd__v1__attach_reply__unpack(NULL, len, buf);
  ASSERT(u);
  ASSERT_EQ(u->client_id, 7);
  ASSERT_EQ(u->token.len, 32);
  ASSERT(!memcmp(u->token.data, tok, 32));
  ASSERT(!memcmp(u->secret.data, sec, 32));
  ASSERT_EQ(u->device, -1);
  ASSERT_EQ(u->n_buffers, 1);
  ASSERT_EQ(u->buffers[0]->kind, EPD_BUF_HT_Y);
  ASSERT_EQ(u->buffers[0]->offset, 1ull << 33);
  ASSERT_EQ(u->map_version, 9);
  ASSERT(!strcmp(u->memory, "cuda"));
  epd__v1__attach_reply__free_unpacked(u, NULL);
  free(buf);
}

/* Byte strings that are not valid protobuf for any message. */
static const struct {
  const char *what;
  const char *bytes;
  size_t len;
} malformed[] = {
    {"truncated varint", "\x08\xff", 2},
    {"varint longer than 10 bytes", "\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 13},
    {"length past the end",
     "\x12\x05"
     "ab",
     4},
    {"field number 0", "\x00\x01", 2},
    {"wire type 7", "\x0f\x01", 2},
    {"unterminated group", "\x0b", 1},
    {"truncated fixed64", "\x09\x01\x02", 3},
};
#define NMALFORMED (sizeof malformed / sizeof malformed[0])

EPD_TEST(proto_malformed_rejected) {
  for (size_t i = 0; i < NMSG; i++)
    for (size_t k = 0; k < NMALFORMED; k++) {
      ProtobufCMessage *u = protobuf_c_message_unpack(all_messages[i], NULL, malformed[k].len,
                                                      (const uint8_t *)malformed[k].bytes);
      if (u)
        epd_test_fail(__FILE__, __LINE__, "%s accepted malformed input (%s)", all_messages[i]->name,
                      malformed[k].what);
    }
  /* A wire-type mismatch on a known field (protocol_version sent as a string) is rejected too. */
  const uint8_t wrong_type[] = {0x0a, 0x01, 'x'};
  ProtobufCMessage *u =
      protobuf_c_message_unpack(&epd__v1__get_status_request__descriptor, NULL, 3, wrong_type);
  ASSERT(u == NULL);
  /* An empty message is valid: every field takes its default (protocol_version 0). */
  Epd__V1__GetStatusRequest *e = epd__v1__get_status_request__unpack(NULL, 0, (const uint8_t *)"");
  ASSERT(e);
  ASSERT_EQ(e->protocol_version, 0);
  epd__v1__get_status_request__free_unpacked(e, NULL);
}

/* ---- in-process server ---------------------------------------------------------------------------- */

static struct {
  epd_engine_t *eng;
  uv_loop_t loop;
  epd_conf_t conf;
  char sock[256];
  int drained, drain_exit;
} srv;

static void hook_drain(void *arg, int exit_when_idle) {
  (void)arg;
  srv.drained = 1;
  srv.drain_exit = exit_when_idle;
  epd_engine_set_draining(srv.eng, 1);
}
static const char *hook_state(void *arg) {
  (void)arg;
  return srv.drained ? "draining" : "ready";
}
static size_t hook_config(void *arg, char *buf, size_t len) {
  (void)arg;
  return epd_conf_dump(&srv.conf, buf, len);
}

static uint32_t srv_ctl_per_uid; /* daemon.max_control_conns_per_uid of the next server_start (0: default) */

static void server_start(void) {
  char err[512] = "";
  epd_conf_defaults(&srv.conf);
  if (srv_ctl_per_uid) srv.conf.max_control_conns_per_uid = srv_ctl_per_uid;
  snprintf(srv.sock, sizeof srv.sock, "%s/ctl/control.sock", epd_test_tmpdir());
  snprintf(srv.conf.control_socket, sizeof srv.conf.control_socket, "%s", srv.sock);
  snprintf(srv.conf.attach_socket, sizeof srv.conf.attach_socket, "%s/attach.sock", epd_test_tmpdir());
  srv.conf.socket_mode = 0660;
  ASSERT_OK(epd_events_init(64));
  epd_engine_opts_t o;
  memset(&o, 0, sizeof o);
  o.backend = "host";
  o.num_ranks = 2;
  o.max_experts = 64;
  o.max_hidden = 1024;
  o.max_topk = 8;
  o.max_tokens = 64;
  o.slots_factor_pct = 100;
  o.max_arena_bytes = 64u << 20;
  o.step_timeout_ms = 2000;
  if (epd_engine_create(&o, epd_events_from_engine, NULL, &srv.eng, err, sizeof err) != EPD_OK)
    epd_test_fail(__FILE__, __LINE__, "engine: %s", err);
  ASSERT_OK(uv_loop_init(&srv.loop));
  if (epd_attach_init(&srv.loop, &srv.conf, srv.eng, err, sizeof err) != 0)
    epd_test_fail(__FILE__, __LINE__, "attach: %s", err);
  epd_rpc_hooks_t hooks = {NULL, hook_drain, hook_state, hook_config};
  if (epd_rpc_init(&srv.conf, srv.eng, &hooks, err, sizeof err) != 0)
    epd_test_fail(__FILE__, __LINE__, "rpc: %s", err);
  ASSERT(!strcmp(epd_rpc_socket_path(), srv.sock));
}

static void server_stop(void) {
  epd_rpc_fini();
  epd_attach_fini();
  uv_run(&srv.loop, UV_RUN_NOWAIT);
  epd_engine_destroy(srv.eng);
  epd_events_fini();
  struct stat st;
  ASSERT(stat(srv.sock, &st) != 0); /* the socket is removed */
}

static epd_rpc_t *client(void) {
  epd_rpc_t *rpc = NULL;
  char err[512];
  if (epd_rpc_open(srv.sock, 5000, &rpc, err, sizeof err) != EPD_OK)
    epd_test_fail(__FILE__, __LINE__, "open: %s", err);
  return rpc;
}

static Epd__V1__StatusReply *status(epd_rpc_t *rpc) {
  Epd__V1__GetStatusRequest q = EPD__V1__GET_STATUS_REQUEST__INIT;
  q.protocol_version = EPD_PROTOCOL_VERSION;
  ProtobufCMessage *rep = NULL;
  char err[512];
  epd_result_t r = epd_rpc_call(rpc, "/epd.v1.Control/GetStatus", &q.base, &epd__v1__status_reply__descriptor,
                                &rep, err, sizeof err);
  if (r != EPD_OK) epd_test_fail(__FILE__, __LINE__, "GetStatus: %d %s", r, err);
  return (Epd__V1__StatusReply *)rep;
}

static Epd__V1__AttachReply *attach(epd_rpc_t *rpc, int rank, epd_result_t want, char *err, size_t errlen) {
  Epd__V1__AttachRequest q = EPD__V1__ATTACH_REQUEST__INIT;
  q.protocol_version = EPD_PROTOCOL_VERSION;
  q.rank = rank;
  q.num_experts = 8;
  q.hidden = 128;
  q.topk = 2;
  q.max_tokens = 16;
  q.client_name = "proto-test";
  q.pid = 1; /* a lie: the daemon takes the pid from SO_PEERCRED */
  ProtobufCMessage *rep = NULL;
  epd_result_t r = epd_rpc_call(rpc, "/epd.v1.Control/Attach", &q.base, &epd__v1__attach_reply__descriptor,
                                &rep, err, errlen);
  if (r != want) epd_test_fail(__FILE__, __LINE__, "Attach rank %d: got %d want %d (%s)", rank, r, want, err);
  return (Epd__V1__AttachReply *)rep;
}

EPD_TEST(rpc_status_metrics_socket) {
  server_start();
  struct stat st;
  ASSERT_OK(stat(srv.sock, &st));
  ASSERT(S_ISSOCK(st.st_mode));
  ASSERT_EQ(st.st_mode & 0777, 0660);
  epd_rpc_t *rpc = client();
  Epd__V1__StatusReply *s = status(rpc);
  ASSERT(!strcmp(s->backend, "host"));
  ASSERT_EQ(s->num_ranks, 2);
  ASSERT_EQ(s->n_ranks, 2);
  ASSERT(!strcmp(s->state, "ready"));
  ASSERT_EQ(s->protocol_version, EPD_PROTOCOL_VERSION);
  ASSERT_STR_CONTAINS(s->config, "daemon.control_socket = ");
  ASSERT_STR_CONTAINS(s->config, srv.sock);
  protobuf_c_message_free_unpacked(&s->base, NULL);

  Epd__V1__GetMetricsRequest mq = EPD__V1__GET_METRICS_REQUEST__INIT;
  mq.protocol_version = EPD_PROTOCOL_VERSION;
  ProtobufCMessage *rep = NULL;
  char err[512];
  ASSERT_OK(epd_rpc_call(rpc, "/epd.v1.Control/GetMetrics", &mq.base, &epd__v1__metrics_reply__descriptor,
                         &rep, err, sizeof err));
  ASSERT_STR_CONTAINS(((Epd__V1__MetricsReply *)rep)->text, "\nepd_clients 0\n");
  ASSERT_STR_CONTAINS(((Epd__V1__MetricsReply *)rep)->text, "epd_info{backend=\"host\"");
  protobuf_c_message_free_unpacked(rep, NULL);

  /* A second daemon may not steal the socket of a live one. */
  char err2[512] = "";
  epd_rpc_hooks_t hooks = {0};
  ASSERT_EQ(epd_rpc_init(&srv.conf, srv.eng, &hooks, err2, sizeof err2), -1);
  ASSERT_STR_CONTAINS(err2, "another daemon is listening");

  epd_rpc_close(rpc);
  server_stop();
  /* Without a socket the client says so at open. */
  epd_rpc_t *none = NULL;
  ASSERT_EQ(epd_rpc_open(srv.sock, 1000, &none, err, sizeof err), EPD_ERR_CLOSED);
  ASSERT_STR_CONTAINS(err, srv.sock);
}

EPD_TEST(rpc_bad_requests) {
  server_start();
  epd_rpc_t *rpc = client();
  static const char *const methods[] = {"Attach",       "Detach",       "GetStatus", "GetMetrics",
                                        "SetExpertMap", "GetExpertMap", "Drain"};
  char err[512], path[128];
  for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++) {
    snprintf(path, sizeof path, "/epd.v1.Control/%s", methods[i]);
    for (size_t k = 0; k < NMALFORMED; k++) {
      epd_result_t r =
          epd_rpc_call_raw(rpc, path, malformed[k].bytes, malformed[k].len, NULL, NULL, err, sizeof err);
      if (r != EPD_ERR_INVALID)
        epd_test_fail(__FILE__, __LINE__, "%s with %s: %d (%s)", methods[i], malformed[k].what, r, err);
      char want[128];
      snprintf(want, sizeof want, "malformed %sRequest", methods[i]);
      ASSERT_STR_CONTAINS(err, want);
      ASSERT_STR_CONTAINS(err, "INVALID_ARGUMENT");
    }
    /* protocol_version 2 (field 1 = 2) */
    const char v2[] = {0x08, 0x02};
    epd_result_t r = epd_rpc_call_raw(rpc, path, v2, 2, NULL, NULL, err, sizeof err);
    ASSERT_EQ(r, EPD_ERR_PROTOCOL);
    ASSERT_STR_CONTAINS(err, "FAILED_PRECONDITION");
    ASSERT_STR_CONTAINS(err, "client speaks 2, daemon speaks 1");
    /* An empty request means protocol_version 0, read as the current version: whatever the method then
     * says, it is not a protocol refusal. */
    r = epd_rpc_call_raw(rpc, path, "", 0, NULL, NULL, err, sizeof err);
    if (r == EPD_ERR_PROTOCOL)
      epd_test_fail(__FILE__, __LINE__, "%s with protocol_version 0: %s", methods[i], err);
  }
  /* Watch checks its request the same way before it streams anything. */
  Epd__V1__WatchRequest wq = EPD__V1__WATCH_REQUEST__INIT;
  wq.protocol_version = 99;
  ASSERT_EQ(epd_rpc_stream(rpc, "/epd.v1.Control/Watch", &wq.base, &epd__v1__event__descriptor, NULL, NULL,
                           2000, err, sizeof err),
            EPD_ERR_PROTOCOL);
  ASSERT_STR_CONTAINS(err, "client speaks 99");
  epd_result_t r = epd_rpc_call_raw(rpc, "/epd.v1.Control/Nope", "", 0, NULL, NULL, err, sizeof err);
  ASSERT_EQ(r, EPD_ERR_UNSUPPORTED);
  ASSERT_STR_CONTAINS(err, "UNIMPLEMENTED");
  r = epd_rpc_call_raw(rpc, "/grpc.health.v1.Health/Check",
                       "\x0a\x05"
                       "ab",
                       4, NULL, NULL, err, sizeof err);
  ASSERT_EQ(r, EPD_ERR_INVALID);
  /* Still serving afterwards. */
  Epd__V1__StatusReply *s = status(rpc);
  ASSERT_EQ(s->num_ranks, 2);
  protobuf_c_message_free_unpacked(&s->base, NULL);
  epd_rpc_close(rpc);
  server_stop();
}

/* A peer outside daemon.allow_uids is told why (PERMISSION_DENIED naming its uid, answered by the accept
 * thread in HTTP/2), not dropped as if no daemon listened; a peer that does not speak HTTP/2 gets a line. */
EPD_TEST(rpc_refused_peer_told_why) {
  epd_conf_t ac;
  char err[512], want[128];
  epd_conf_defaults(&ac);
  snprintf(ac.allow_uids, sizeof ac.allow_uids, "%u", getuid() == 12345 ? 12346u : 12345u);
  ASSERT_OK(epd_access_init(&ac, err, sizeof err));
  server_start();
  epd_rpc_t *rpc = client();
  snprintf(want, sizeof want, "uid %u gid %u is not allowed on this daemon (daemon.allow_uids/allow_gids)",
           (unsigned)getuid(), (unsigned)getgid());
  /* Each answer ends its connection (GOAWAY): the next call is refused on a new one, told the same. */
  for (int i = 0; i < 3; i++) {
    Epd__V1__GetStatusRequest q = EPD__V1__GET_STATUS_REQUEST__INIT;
    q.protocol_version = EPD_PROTOCOL_VERSION;
    ProtobufCMessage *rep = NULL;
    ASSERT_EQ(epd_rpc_call(rpc, "/epd.v1.Control/GetStatus", &q.base, &epd__v1__status_reply__descriptor,
                           &rep, err, sizeof err),
              EPD_ERR_PERMISSION);
    ASSERT(rep == NULL);
    ASSERT_STR_CONTAINS(err, "GetStatus: PERMISSION_DENIED: ");
    ASSERT_STR_CONTAINS(err, want);
  }
  Epd__V1__WatchRequest wq = EPD__V1__WATCH_REQUEST__INIT;
  wq.protocol_version = EPD_PROTOCOL_VERSION;
  ASSERT_EQ(epd_rpc_stream(rpc, "/epd.v1.Control/Watch", &wq.base, &epd__v1__event__descriptor, NULL, NULL,
                           5000, err, sizeof err),
            EPD_ERR_PERMISSION);
  ASSERT_STR_CONTAINS(err, want);
  epd_rpc_close(rpc);
  /* Not HTTP/2: the reason as one text line, then the hang-up. */
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  ASSERT(strlen(srv.sock) < sizeof sa.sun_path);
  memcpy(sa.sun_path, srv.sock, strlen(srv.sock) + 1);
  struct timeval tv = {5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ASSERT_OK(connect(fd, (struct sockaddr *)&sa, sizeof sa));
  ASSERT_EQ(send(fd, "hello\n", 6, MSG_NOSIGNAL), 6);
  char line[512] = "";
  size_t got = 0;
  for (ssize_t n; got < sizeof line - 1 && (n = recv(fd, line + got, sizeof line - 1 - got, 0)) > 0;)
    got += (size_t)n;
  line[got] = 0;
  close(fd);
  ASSERT_STR_CONTAINS(line, "epd: ");
  ASSERT_STR_CONTAINS(line, want);
  server_stop();
  epd_access_fini();
}

/* A plain connection to the control socket (it counts as a control connection once accepted). */
static int raw_connect(void) {
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  memcpy(sa.sun_path, srv.sock, strlen(srv.sock) + 1);
  ASSERT_OK(connect(fd, (struct sockaddr *)&sa, sizeof sa));
  return fd;
}

EPD_TEST(rpc_control_connections_bounded_per_uid) {
  srv_ctl_per_uid = 3;
  server_start();
  srv_ctl_per_uid = 0;
  char err[512];
  int held[3];
  for (int i = 0; i < 3; i++) held[i] = raw_connect();
  usleep(200 * 1000); /* the accept thread takes them */
  epd_rpc_t *rpc = client();
  Epd__V1__GetStatusRequest q = EPD__V1__GET_STATUS_REQUEST__INIT;
  ProtobufCMessage *rep = NULL;
  ASSERT_EQ(epd_rpc_call(rpc, "/epd.v1.Control/GetStatus", &q.base, &epd__v1__status_reply__descriptor, &rep,
                         err, sizeof err),
            EPD_ERR_BUSY);
  ASSERT_STR_CONTAINS(err, "RESOURCE_EXHAUSTED");
  ASSERT_STR_CONTAINS(err, "control connections open (daemon.max_control_conns_per_uid)");
  epd_rpc_close(rpc);
  uint64_t refused[2];
  epd_rpc_control_conns(refused);
  ASSERT(refused[1] >= 1 && refused[0] == 0);
  /* Once they are gone (gRPC closes its side when the peer hangs up), a new client is served. */
  for (int i = 0; i < 3; i++) close(held[i]);
  int ok = 0;
  for (int t = 0; t < 50 && !ok; t++) {
    usleep(100 * 1000);
    rpc = client();
    rep = NULL;
    ok = epd_rpc_call(rpc, "/epd.v1.Control/GetStatus", &q.base, &epd__v1__status_reply__descriptor, &rep,
                      err, sizeof err) == EPD_OK;
    if (rep) protobuf_c_message_free_unpacked(rep, NULL);
    epd_rpc_close(rpc);
  }
  if (!ok) epd_test_fail(__FILE__, __LINE__, "still refused after the held connections closed: %s", err);
  server_stop();
}

typedef struct watch_arg {
  epd_rpc_t *rpc;
  int want; /* stop after this many events */
  int got;
  char kinds[8][24];
  uint64_t client_id[8];
  epd_result_t rc;
  char err[512];
} watch_arg_t;

static int on_watch(void *arg, ProtobufCMessage *msg) {
  watch_arg_t *w = arg;
  const Epd__V1__Event *e = (const Epd__V1__Event *)msg;
  if (w->got < 8) {
    snprintf(w->kinds[w->got], sizeof w->kinds[0], "%s", e->kind);
    w->client_id[w->got] = e->client_id;
  }
  return ++w->got >= w->want;
}

static void *watch_thread(void *p) {
  watch_arg_t *w = p;
  Epd__V1__WatchRequest q = EPD__V1__WATCH_REQUEST__INIT;
  q.protocol_version = EPD_PROTOCOL_VERSION;
  w->rc = epd_rpc_stream(w->rpc, "/epd.v1.Control/Watch", &q.base, &epd__v1__event__descriptor, on_watch, w,
                         10000, w->err, sizeof w->err);
  return NULL;
}

EPD_TEST(rpc_attach_detach_watch_map) {
  server_start();
  epd_rpc_t *rpc = client();
  char err[512];
  /* A Watch open before the attach sees attach and detach; an idle one does not block other calls. */
  watch_arg_t w = {.rpc = rpc, .want = 2};
  watch_arg_t idle = {.rpc = client(), .want = 100};
  pthread_t th, th_idle;
  ASSERT_OK(pthread_create(&th, NULL, watch_thread, &w));
  ASSERT_OK(pthread_create(&th_idle, NULL, watch_thread, &idle));
  usleep(300 * 1000);

  attach(rpc, 2, EPD_ERR_INVALID, err, sizeof err);
  ASSERT_STR_CONTAINS(err, "rank: 2 out of range [0, 2)");
  Epd__V1__AttachReply *a = attach(rpc, 1, EPD_OK, err, sizeof err);
  ASSERT_GT(a->client_id, 0);
  ASSERT_EQ(a->token.len, EPD_TOKEN_BYTES);
  ASSERT_EQ(a->secret.len, 32);
  ASSERT(!strcmp(a->memory, "host"));
  ASSERT_EQ(a->device, -1);
  ASSERT_EQ(a->num_ranks, 2);
  ASSERT_EQ(a->num_experts, 8);
  ASSERT_EQ(a->max_tokens, 16);
  ASSERT_GT(a->n_buffers, 0);
  ASSERT_GT(a->arena_bytes, 0);
  ASSERT_STR_CONTAINS(a->attach_socket, "attach.sock");

  Epd__V1__StatusReply *s = status(rpc);
  ASSERT_EQ(s->n_clients, 1);
  ASSERT_EQ(s->clients[0]->client_id, a->client_id);
  ASSERT(!strcmp(s->clients[0]->name, "proto-test"));
  ASSERT_EQ(s->clients[0]->rank, 1);
  ASSERT_EQ(s->clients[0]->pid, getpid());
  ASSERT_EQ(s->clients[0]->uid, getuid());
  ASSERT_EQ(s->n_groups, 1);
  ASSERT(!strcmp(s->groups[0]->name, "default"));
  protobuf_c_message_free_unpacked(&s->base, NULL);

  /* Expert map: read it, stage it again (a new version), and reject an invalid one. */
  Epd__V1__GetExpertMapRequest gq = EPD__V1__GET_EXPERT_MAP_REQUEST__INIT;
  gq.protocol_version = EPD_PROTOCOL_VERSION;
  ProtobufCMessage *rep = NULL;
  ASSERT_OK(epd_rpc_call(rpc, "/epd.v1.Control/GetExpertMap", &gq.base, &epd__v1__expert_map__descriptor,
                         &rep, err, sizeof err));
  Epd__V1__ExpertMap *m = (Epd__V1__ExpertMap *)rep;
  ASSERT_EQ(m->n_experts, 8);
  ASSERT_EQ(m->version, 1);
  /* Default map (SEMANTICS.md): expert e on rank e / ceil(E/R), slot e % ceil(E/R). */
  for (size_t e = 0; e < 8; e++) {
    ASSERT_EQ(m->experts[e]->expert, e);
    ASSERT_EQ(m->experts[e]->n_replicas, 1);
    ASSERT_EQ(m->experts[e]->replicas[0]->rank, e / 4);
    ASSERT_EQ(m->experts[e]->replicas[0]->slot, e % 4);
  }
  Epd__V1__SetExpertMapRequest sq = EPD__V1__SET_EXPERT_MAP_REQUEST__INIT;
  sq.protocol_version = EPD_PROTOCOL_VERSION;
  sq.map = m;
  ProtobufCMessage *srep = NULL;
  ASSERT_OK(epd_rpc_call(rpc, "/epd.v1.Control/SetExpertMap", &sq.base,
                         &epd__v1__set_expert_map_reply__descriptor, &srep, err, sizeof err));
  ASSERT_EQ(((Epd__V1__SetExpertMapReply *)srep)->version, 2);
  protobuf_c_message_free_unpacked(srep, NULL);
  m->experts[3]->expert = 2; /* expert 2 twice, 3 missing */
  ASSERT_EQ(epd_rpc_call(rpc, "/epd.v1.Control/SetExpertMap", &sq.base,
                         &epd__v1__set_expert_map_reply__descriptor, &srep, err, sizeof err),
            EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(err, "map.experts[3].expert: 2 listed twice");
  m->experts[3]->expert = 3;
  m->experts[5]->replicas[0]->rank = 7;
  ASSERT_EQ(epd_rpc_call(rpc, "/epd.v1.Control/SetExpertMap", &sq.base,
                         &epd__v1__set_expert_map_reply__descriptor, &srep, err, sizeof err),
            EPD_ERR_INVALID);
  m->group = "nosuch";
  ASSERT_EQ(epd_rpc_call(rpc, "/epd.v1.Control/SetExpertMap", &sq.base,
                         &epd__v1__set_expert_map_reply__descriptor, &srep, err, sizeof err),
            EPD_ERR_NOT_FOUND);
  m->group = NULL;
  protobuf_c_message_free_unpacked(rep, NULL);

  /* Detach: a wrong secret is refused, the right one works once and drops the unredeemed token. */
  const unsigned pend = epd_attach_pending_tokens();
  ASSERT_GT(pend, 0);
  Epd__V1__DetachRequest dq = EPD__V1__DETACH_REQUEST__INIT;
  dq.protocol_version = EPD_PROTOCOL_VERSION;
  dq.client_id = a->client_id;
  uint8_t bad[32];
  memcpy(bad, a->secret.data, 32);
  bad[31] ^= 1;
  dq.secret = (ProtobufCBinaryData){32, bad};
  ASSERT_EQ(epd_rpc_call(rpc, "/epd.v1.Control/Detach", &dq.base, &epd__v1__detach_reply__descriptor, &rep,
                         err, sizeof err),
            EPD_ERR_PERMISSION);
  ASSERT_STR_CONTAINS(err, "PERMISSION_DENIED");
  dq.secret = a->secret;
  ASSERT_EQ(epd_attach_pending_tokens(), pend);
  ASSERT_OK(epd_rpc_call(rpc, "/epd.v1.Control/Detach", &dq.base, &epd__v1__detach_reply__descriptor, &rep,
                         err, sizeof err));
  protobuf_c_message_free_unpacked(rep, NULL);
  ASSERT_EQ(epd_attach_pending_tokens(), pend - 1);
  ASSERT_EQ(epd_rpc_call(rpc, "/epd.v1.Control/Detach", &dq.base, &epd__v1__detach_reply__descriptor, &rep,
                         err, sizeof err),
            EPD_ERR_NOT_FOUND);

  pthread_join(th, NULL);
  ASSERT_EQ(w.rc, EPD_OK);
  ASSERT_EQ(w.got, 2);
  ASSERT(!strcmp(w.kinds[0], "attach"));
  ASSERT_EQ(w.client_id[0], a->client_id);
  /* Events between attach and detach (a map_switch, if the engine reports one) may come first. */
  ASSERT_GE(w.got, 2);
  epd__v1__attach_reply__free_unpacked(a, NULL);

  /* Health: SERVING, NOT_FOUND for an unknown service, NOT_SERVING after Drain; Attach refused. */
  Grpc__Health__V1__HealthCheckRequest hq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  ASSERT_OK(epd_rpc_call(rpc, "/grpc.health.v1.Health/Check", &hq.base,
                         &grpc__health__v1__health_check_response__descriptor, &rep, err, sizeof err));
  ASSERT_EQ(((Grpc__Health__V1__HealthCheckResponse *)rep)->status,
            GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING);
  protobuf_c_message_free_unpacked(rep, NULL);
  hq.service = "nope.Service";
  ASSERT_EQ(epd_rpc_call(rpc, "/grpc.health.v1.Health/Check", &hq.base,
                         &grpc__health__v1__health_check_response__descriptor, &rep, err, sizeof err),
            EPD_ERR_NOT_FOUND);
  Epd__V1__DrainRequest drq = EPD__V1__DRAIN_REQUEST__INIT;
  drq.protocol_version = EPD_PROTOCOL_VERSION;
  drq.exit = 1;
  ASSERT_OK(epd_rpc_call(rpc, "/epd.v1.Control/Drain", &drq.base, &epd__v1__drain_reply__descriptor, &rep,
                         err, sizeof err));
  ASSERT_EQ(((Epd__V1__DrainReply *)rep)->clients, 0);
  protobuf_c_message_free_unpacked(rep, NULL);
  ASSERT(srv.drained && srv.drain_exit);
  hq.service = "epd.v1.Control";
  ASSERT_OK(epd_rpc_call(rpc, "/grpc.health.v1.Health/Check", &hq.base,
                         &grpc__health__v1__health_check_response__descriptor, &rep, err, sizeof err));
  ASSERT_EQ(((Grpc__Health__V1__HealthCheckResponse *)rep)->status,
            GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING);
  protobuf_c_message_free_unpacked(rep, NULL);
  attach(rpc, 0, EPD_ERR_DRAINING, err, sizeof err);
  ASSERT_STR_CONTAINS(err, "UNAVAILABLE");

  /* Shutting down ends the idle Watch stream instead of hanging it. */
  epd_rpc_close(rpc);
  server_stop();
  pthread_join(th_idle, NULL);
  epd_rpc_close(idle.rpc);
  ASSERT_GE(idle.got, 2);
  ASSERT_EQ(idle.rc, EPD_ERR_CLOSED);
}
