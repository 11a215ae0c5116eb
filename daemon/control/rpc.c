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
#include "control/rpc_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/un.h>

#include <grpc/support/alloc.h>

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

const rpc_method_t rpc_methods[M_COUNT] = {
    [M_ATTACH] = {"/epd.v1.Control/Attach", "Attach", &epd__v1__attach_request__descriptor, 0, 1},
    [M_DETACH] = {"/epd.v1.Control/Detach", "Detach", &epd__v1__detach_request__descriptor, 0, 1},
    [M_STATUS] = {"/epd.v1.Control/GetStatus", "GetStatus", &epd__v1__get_status_request__descriptor, 0, 1},
    [M_METRICS] = {"/epd.v1.Control/GetMetrics", "GetMetrics", &epd__v1__get_metrics_request__descriptor, 0,
                   1},
    [M_SETMAP] = {"/epd.v1.Control/SetExpertMap", "SetExpertMap",
                  &epd__v1__set_expert_map_request__descriptor, 0, 1},
    [M_GETMAP] = {"/epd.v1.Control/GetExpertMap", "GetExpertMap",
                  &epd__v1__get_expert_map_request__descriptor, 0, 1},
    [M_WATCH] = {"/epd.v1.Control/Watch", "Watch", &epd__v1__watch_request__descriptor, 1, 1},
    [M_DRAIN] = {"/epd.v1.Control/Drain", "Drain", &epd__v1__drain_request__descriptor, 0, 1},
    [M_HCHECK] = {"/grpc.health.v1.Health/Check", "HealthCheck",
                  &grpc__health__v1__health_check_request__descriptor, 0, 0},
    [M_HWATCH] = {"/grpc.health.v1.Health/Watch", "HealthWatch",
                  &grpc__health__v1__health_check_request__descriptor, 1, 0},
};

rpc_server_t rpc_srv = {.listen_fd = -1, .wake_fd = {-1, -1}, .cred_mu = PTHREAD_MUTEX_INITIALIZER};

/* ---- call state machine --------------------------------------------------------------------------- */

static void call_free(rpc_call_t *c) {
  if (c->call) grpc_call_unref(c->call);
  grpc_metadata_array_destroy(&c->md);
  if (c->method == M_UNKNOWN) grpc_call_details_destroy(&c->details);
  if (c->payload) grpc_byte_buffer_destroy(c->payload);
  if (c->send_buf) grpc_byte_buffer_destroy(c->send_buf);
  if (c->has_details) grpc_slice_unref(c->status_details);
  if (c->has_trailing) grpc_slice_unref(c->trailing.value);
  for (rpc_call_t **p = &rpc_srv.watches; *p; p = &(*p)->next)
    if (*p == c) {
      *p = c->next;
      break;
    }
  free(c);
  rpc_srv.live_calls--;
}

/* Ask gRPC for the next call of a method (or of any unregistered method). */
static void request_call(int method) {
  rpc_call_t *c = calloc(1, sizeof *c);
  if (!c) {
    EPD_LOGE(EPD_SUB_RPC, "out of memory: method %s will not be served",
             method < M_COUNT ? rpc_methods[method].path : "*");
    return;
  }
  c->method = method;
  c->health_sent = -1;
  for (int i = 0; i < TAG_COUNT; i++) c->tags[i] = (rpc_tag_t){c, i};
  grpc_metadata_array_init(&c->md);
  grpc_call_error e;
  if (method == M_UNKNOWN) {
    grpc_call_details_init(&c->details);
    e = grpc_server_request_call(rpc_srv.server, &c->call, &c->details, &c->md, rpc_srv.cq, rpc_srv.cq,
                                 &c->tags[TAG_NEW]);
  } else {
    e = grpc_server_request_registered_call(rpc_srv.server, rpc_srv.reg[method], &c->call, &c->deadline,
                                            &c->md, &c->payload, rpc_srv.cq, rpc_srv.cq, &c->tags[TAG_NEW]);
  }
  rpc_srv.live_calls++;
  if (e != GRPC_CALL_OK) {
    EPD_LOGE(EPD_SUB_RPC, "request_call(%s) failed: %d", method < M_COUNT ? rpc_methods[method].path : "*",
             (int)e);
    call_free(c);
    return;
  }
  c->pending = 1;
}

static int start_batch(rpc_call_t *c, const grpc_op *ops, size_t n, int tag) {
  grpc_call_error e = grpc_call_start_batch(c->call, ops, n, &c->tags[tag], NULL);
  if (e != GRPC_CALL_OK) {
    EPD_LOGE(EPD_SUB_RPC, "start_batch(%s, tag %d) failed: %d",
             c->method < M_COUNT ? rpc_methods[c->method].name : "?", tag, (int)e);
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
  c->next = rpc_srv.watches;
  rpc_srv.watches = c;
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
  for (rpc_call_t *c = rpc_srv.watches, *next; c; c = next) {
    next = c->next;
    if (!c->meta_done || c->sending || c->closed || c->ending) continue;
    if (c->method == M_WATCH) {
      epd_event_t ev;
      int r = epd_events_next(c->after, &ev, 0);
      if (r < 0) {
        rpc_reply_t rep = {0};
        rpc_reply_err(&rep, EPD_ERR_CLOSED, "the daemon is shutting down");
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
      int st = rpc_health_status(c->service);
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
  if (peer && sscanf(peer, "fd:%d", &fd) == 1 && fd >= 0 && fd < (int)(sizeof rpc_srv.cred_set)) {
    pthread_mutex_lock(&rpc_srv.cred_mu);
    if (rpc_srv.cred_set[fd]) {
      c->peer_known = 1;
      c->peer_pid = (uint32_t)rpc_srv.creds[fd].pid;
      c->peer_uid = (uint32_t)rpc_srv.creds[fd].uid;
      c->peer_gid = (uint32_t)rpc_srv.creds[fd].gid;
    }
    pthread_mutex_unlock(&rpc_srv.cred_mu);
  }
  gpr_free(peer);
}

static void on_new(rpc_call_t *c, int ok) {
  if (!ok) { /* the server is shutting down: the request was never matched with a call */
    call_free(c);
    return;
  }
  if (!atomic_load(&rpc_srv.stop)) request_call(c->method);
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
  if (!rpc_methods[c->method].streaming) {
    rpc_handle_unary(c, &rep);
    finish_call(c, &rep);
    free(rep.bytes);
    return;
  }
  ProtobufCMessage *msg = rpc_decode(c, &rep);
  if (!msg) {
    finish_call(c, &rep);
    return;
  }
  size_t nwatch = 0;
  for (rpc_call_t *w = rpc_srv.watches; w; w = w->next) nwatch++;
  if (nwatch >= rpc_srv.max_watches) { /* each stream holds a call and its buffers: bounded, not per client */
    rpc_reply_err(&rep, EPD_ERR_BUSY, "%s: %zu streams open, daemon.max_watches is %u",
                  rpc_methods[c->method].name, nwatch, rpc_srv.max_watches);
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
    case TAG_NEW:
      on_new(c, ev.success);
      return;
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
    case TAG_CLOSE:
      c->closed = 1;
      break;
  }
  if (c->closed && c->pending == 0) call_free(c);
}

static void *rpc_thread(void *arg) {
  (void)arg;
  for (int m = 0; m < M_COUNT; m++) request_call(m);
  request_call(M_UNKNOWN);
  while (!atomic_load(&rpc_srv.stop)) {
    /* Streams are pumped between waits, so wake often only while one is open. */
    gpr_timespec dl = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                   gpr_time_from_millis(rpc_srv.watches ? 10 : 100, GPR_TIMESPAN));
    grpc_event ev = grpc_completion_queue_next(rpc_srv.cq, dl, NULL);
    if (ev.type == GRPC_OP_COMPLETE) on_event(ev);
    pump_streams();
  }
  /* Shutdown order (DESIGN.md §10): notify, cancel, drain to the tag and every call freed. */
  static int shutdown_tag;
  grpc_server_shutdown_and_notify(rpc_srv.server, rpc_srv.cq, &shutdown_tag);
  grpc_server_cancel_all_calls(rpc_srv.server);
  int got_shutdown = 0;
  uint64_t give_up = rpc_mono_ns() + 5000000000ull;
  while ((!got_shutdown || rpc_srv.live_calls > 0) && rpc_mono_ns() < give_up) {
    grpc_event ev = grpc_completion_queue_next(
        rpc_srv.cq, gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(100, GPR_TIMESPAN)),
        NULL);
    if (ev.type != GRPC_OP_COMPLETE) continue;
    if (ev.tag == &shutdown_tag)
      got_shutdown = 1;
    else
      on_event(ev);
  }
  if (rpc_srv.live_calls > 0) EPD_LOGW(EPD_SUB_RPC, "%d calls still open at shutdown", rpc_srv.live_calls);
  return NULL;
}

/* ---- module --------------------------------------------------------------------------------------- */

/* Shut the server down and wait for its tag (used where no call was ever requested). */
static void server_shutdown_idle(void) {
  static int tag;
  grpc_server_shutdown_and_notify(rpc_srv.server, rpc_srv.cq, &tag);
  grpc_server_cancel_all_calls(rpc_srv.server);
  for (int i = 0; i < 50; i++) {
    grpc_event ev = grpc_completion_queue_next(
        rpc_srv.cq, gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(100, GPR_TIMESPAN)),
        NULL);
    if (ev.type == GRPC_OP_COMPLETE && ev.tag == &tag) break;
  }
}

static void teardown(void) {
  if (rpc_srv.server) grpc_server_destroy(rpc_srv.server);
  rpc_srv.server = NULL;
  if (rpc_srv.cq) {
    grpc_completion_queue_shutdown(rpc_srv.cq);
    for (;;) {
      grpc_event ev = grpc_completion_queue_next(rpc_srv.cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
      if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    }
    grpc_completion_queue_destroy(rpc_srv.cq);
    rpc_srv.cq = NULL;
  }
  if (rpc_srv.grpc_inited) grpc_shutdown();
  rpc_srv.grpc_inited = 0;
  free(rpc_srv.secrets);
  rpc_srv.secrets = NULL;
  rpc_srv.nsecrets = rpc_srv.capsecrets = 0;
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
  if (rpc_mkdir_parents(path, err, errlen) || rpc_clear_stale(path, err, errlen)) return -1;
  if (rpc_srv.thread_started) {
    snprintf(err, errlen, "control RPC already serving %s", rpc_srv.path);
    return -1;
  }
  snprintf(rpc_srv.path, sizeof rpc_srv.path, "%s", path);
  memset(&rpc_srv.reg, 0, sizeof rpc_srv.reg);
  rpc_srv.eng = eng;
  if (hooks)
    rpc_srv.hooks = *hooks;
  else
    memset(&rpc_srv.hooks, 0, sizeof rpc_srv.hooks);
  atomic_store(&rpc_srv.stop, 0);
  atomic_store(&rpc_srv.serving, 1);
  rpc_srv.start_ns = rpc_mono_ns();
  rpc_srv.watches = NULL;
  rpc_srv.max_watches = conf->max_watches ? conf->max_watches : 256;
  rpc_srv.max_ctl = conf->max_control_conns ? conf->max_control_conns : 512;
  rpc_srv.max_ctl_uid = conf->max_control_conns_per_uid ? conf->max_control_conns_per_uid : 128;
  rpc_conn_reset(); /* a server made again in this process starts its counts afresh */
  atomic_store(&rpc_srv.nctl_open, 0);
  for (int i = 0; i < 2; i++) atomic_store(&rpc_srv.ctl_refused[i], 0);
  rpc_srv.live_calls = 0;

  grpc_init();
  rpc_srv.grpc_inited = 1;
  grpc_arg arg = {.type = GRPC_ARG_INTEGER,
                  .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
                  .value.integer = (int)(conf->max_message_bytes ? conf->max_message_bytes : 4u << 20)};
  grpc_channel_args args = {.num_args = 1, .args = &arg};
  rpc_srv.server = grpc_server_create(&args, NULL);
  rpc_srv.cq = grpc_completion_queue_create_for_next(NULL);
  grpc_server_register_completion_queue(rpc_srv.server, rpc_srv.cq, NULL);
  for (int m = 0; m < M_COUNT; m++) {
    rpc_srv.reg[m] = grpc_server_register_method(rpc_srv.server, rpc_methods[m].path, NULL,
                                                 GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    if (!rpc_srv.reg[m]) {
      snprintf(err, errlen, "cannot register method %s", rpc_methods[m].path);
      server_shutdown_idle();
      teardown();
      return -1;
    }
  }
  if (rpc_make_listener(err, errlen) != 0) {
    server_shutdown_idle();
    teardown();
    return -1;
  }
  grpc_server_start(rpc_srv.server);
  if (rpc_apply_perms(conf, err, errlen) != 0 || rpc_start_accept(err, errlen) != 0) {
    rpc_stop_accept();
    server_shutdown_idle();
    teardown();
    unlink(rpc_srv.path);
    return -1;
  }
  if (pthread_create(&rpc_srv.thread, NULL, rpc_thread, NULL) != 0) {
    snprintf(err, errlen, "cannot start the RPC thread: %s", strerror(errno));
    rpc_stop_accept();
    server_shutdown_idle();
    teardown();
    unlink(rpc_srv.path);
    return -1;
  }
  rpc_srv.thread_started = 1;
  EPD_LOGI(EPD_SUB_RPC, "control RPC listening on %s (mode %04o%s%s)", rpc_srv.path, conf->socket_mode,
           conf->socket_group[0] ? ", group " : "", conf->socket_group);
  return 0;
}

void epd_rpc_fini(void) {
  if (!rpc_srv.thread_started) return;
  rpc_stop_accept(); /* no new connection while the server shuts down */
  atomic_store(&rpc_srv.stop, 1);
  pthread_join(rpc_srv.thread, NULL);
  rpc_srv.thread_started = 0;
  teardown();
  unlink(rpc_srv.path);
  EPD_LOGI(EPD_SUB_RPC, "control RPC stopped");
}

const char *epd_rpc_socket_path(void) {
  return rpc_srv.path;
}

void epd_rpc_set_serving(int serving) {
  atomic_store(&rpc_srv.serving, serving ? 1 : 0);
}
