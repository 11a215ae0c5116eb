/*
 * rpc_client.c - a blocking client of the epd control RPC over gRPC C core (see rpc_client.h).
 * Each call has its own pluck completion queue, so calls from several threads on one channel do not
 * see each other's completions. gRPC status codes are converted to epd_result_t here, once; the
 * daemon's exact code travels in the trailing metadata "epd-code" and wins when present.
 */
#define _GNU_SOURCE
#include "rpc_client.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>

#include "epd_paths.h"

#define EPD_RPC_MAX_RECV (64 << 20) /* a status of many clients or experts can pass 4 MB */

struct epd_rpc {
  grpc_channel *chan;
  int timeout_ms;
  int unix_socket; /* path is a Unix socket (epd_rpc_open), which a plain connect() can probe */
  char path[256];
};

const char *epd_default_socket_path(char *buf, size_t len) {
  const char *env = getenv("EPD_SOCKET");
  if (env && *env) {
    snprintf(buf, len, "%s", env);
    return buf;
  }
  return epd_paths_control_default(buf, len);
}

/* Create rpc's channel to target and hand rpc out (freed on failure). private_pool: a subchannel pool of
 * the channel's own with a 100 ms first reconnect back-off, so that a peer that starts a little later is
 * found at the next call instead of after gRPC's shared back-off of seconds. */
static epd_result_t channel_open(epd_rpc_t *rpc, const char *target, int timeout_ms, int private_pool,
                                 const epd_rpc_tls_t *tls, epd_rpc_t **out, char *err, size_t errlen) {
  rpc->timeout_ms = timeout_ms ? timeout_ms : 10000;
  grpc_init();
  grpc_arg args[4] = {
      {.type = GRPC_ARG_INTEGER,
       .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
       .value.integer = EPD_RPC_MAX_RECV},
      {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, .value.integer = 1},
      {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, .value.integer = 100},
      {.type = GRPC_ARG_STRING, .key = GRPC_SSL_TARGET_NAME_OVERRIDE_ARG, .value.string = NULL}};
  grpc_channel_args cargs = {.num_args = private_pool ? 3 : 1, .args = args};
  grpc_channel_credentials *creds;
  if (tls) {
    grpc_ssl_pem_key_cert_pair kp = {.private_key = tls->key, .cert_chain = tls->cert};
    creds = grpc_ssl_credentials_create(tls->ca, tls->cert && tls->key ? &kp : NULL, NULL, NULL);
    if (tls->server_name && *tls->server_name) {
      args[cargs.num_args] = args[3];
      args[cargs.num_args++].value.string = (char *)tls->server_name;
    }
  } else {
    creds = grpc_insecure_credentials_create();
  }
  rpc->chan = creds ? grpc_channel_create(target, creds, &cargs) : NULL;
  if (creds) grpc_channel_credentials_release(creds);
  if (!rpc->chan) {
    snprintf(err, errlen, "cannot create a gRPC channel to %s", target);
    grpc_shutdown();
    free(rpc);
    return EPD_ERR_RPC;
  }
  *out = rpc;
  return EPD_OK;
}

epd_result_t epd_rpc_open(const char *socket_path, int timeout_ms, epd_rpc_t **out, char *err,
                          size_t errlen) {
  char def[256];
  *out = NULL;
  if (!socket_path || !*socket_path) socket_path = epd_default_socket_path(def, sizeof def);
  if (!strncmp(socket_path, "unix:", 5)) socket_path += 5;
  if (strlen(socket_path) >= sizeof((epd_rpc_t *)0)->path) {
    snprintf(err, errlen, "socket_path: %zu bytes, at most %zu allowed", strlen(socket_path),
             sizeof((epd_rpc_t *)0)->path - 1);
    return EPD_ERR_INVALID;
  }
  if (timeout_ms < 0) {
    snprintf(err, errlen, "timeout_ms: %d, must be >= 0 (0: 10000)", timeout_ms);
    return EPD_ERR_INVALID;
  }
  /* A missing socket would otherwise surface later as a bare UNAVAILABLE; say what is wrong now. */
  struct stat st;
  if (stat(socket_path, &st) != 0) {
    int e = errno;
    if (e == EACCES)
      snprintf(err, errlen, "control socket %s: %s (a directory on the way is closed to this user)",
               socket_path, strerror(e));
    else
      snprintf(err, errlen, "control socket %s: %s: no daemon listens there (is epd running?)", socket_path,
               strerror(e));
    return e == EACCES ? EPD_ERR_PERMISSION : EPD_ERR_CLOSED;
  }
  epd_rpc_t *rpc = calloc(1, sizeof *rpc);
  if (!rpc) {
    snprintf(err, errlen, "out of memory");
    return EPD_ERR_NOMEM;
  }
  snprintf(rpc->path, sizeof rpc->path, "%s", socket_path);
  rpc->unix_socket = 1;
  char target[300];
  snprintf(target, sizeof target, "unix:%s", rpc->path);
  return channel_open(rpc, target, timeout_ms, 0, NULL, out, err, errlen);
}

epd_result_t epd_rpc_open_target(const char *target, int timeout_ms, epd_rpc_t **out, char *err,
                                 size_t errlen) {
  return epd_rpc_open_target_tls(target, timeout_ms, NULL, out, err, errlen);
}

epd_result_t epd_rpc_open_target_tls(const char *target, int timeout_ms, const epd_rpc_tls_t *tls,
                                     epd_rpc_t **out, char *err, size_t errlen) {
  *out = NULL;
  if (!target || !*target || strlen(target) >= sizeof((epd_rpc_t *)0)->path) {
    snprintf(err, errlen, "target: empty or longer than %zu bytes", sizeof((epd_rpc_t *)0)->path - 1);
    return EPD_ERR_INVALID;
  }
  epd_rpc_t *rpc = calloc(1, sizeof *rpc);
  if (!rpc) {
    snprintf(err, errlen, "out of memory");
    return EPD_ERR_NOMEM;
  }
  snprintf(rpc->path, sizeof rpc->path, "%s", target);
  return channel_open(rpc, target, timeout_ms, 1, tls, out, err, errlen);
}

void epd_rpc_close(epd_rpc_t *rpc) {
  if (!rpc) return;
  grpc_channel_destroy(rpc->chan);
  free(rpc);
  grpc_shutdown();
}

static const char *code_name(grpc_status_code c) {
  static const char *const names[] = {
      "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
      "DATA_LOSS", "UNAUTHENTICATED"};
  return (unsigned)c < sizeof names / sizeof names[0] ? names[c] : "UNKNOWN_CODE";
}

/* Convert a call's final status; err gets "<method>: <CODE>: <details>". */
static epd_result_t map_status(const char *method, grpc_status_code st, grpc_slice details,
                               const grpc_metadata_array *trailing, char *err, size_t errlen) {
  if (st == GRPC_STATUS_OK) return EPD_OK;
  const char *m = strrchr(method, '/');
  snprintf(err, errlen, "%s: %s: %.*s", m ? m + 1 : method, code_name(st), (int)GRPC_SLICE_LENGTH(details),
           (const char *)GRPC_SLICE_START_PTR(details));
  for (size_t i = 0; i < trailing->count; i++) {
    const grpc_metadata *md = &trailing->metadata[i];
    if (GRPC_SLICE_LENGTH(md->key) == 8 && !memcmp(GRPC_SLICE_START_PTR(md->key), "epd-code", 8)) {
      char buf[16];
      size_t n =
          GRPC_SLICE_LENGTH(md->value) < sizeof buf - 1 ? GRPC_SLICE_LENGTH(md->value) : sizeof buf - 1;
      memcpy(buf, GRPC_SLICE_START_PTR(md->value), n);
      buf[n] = 0;
      long v = strtol(buf, NULL, 10);
      if (v < 0 && v > EPD_ERR_MIN) return (epd_result_t)v;
    }
  }
  switch (st) {
    case GRPC_STATUS_UNAVAILABLE:
      return EPD_ERR_CLOSED;
    case GRPC_STATUS_INVALID_ARGUMENT:
      return EPD_ERR_INVALID;
    case GRPC_STATUS_FAILED_PRECONDITION:
      return EPD_ERR_PROTOCOL;
    case GRPC_STATUS_NOT_FOUND:
      return EPD_ERR_NOT_FOUND;
    case GRPC_STATUS_RESOURCE_EXHAUSTED:
      return EPD_ERR_BUSY;
    case GRPC_STATUS_PERMISSION_DENIED:
      return EPD_ERR_PERMISSION;
    case GRPC_STATUS_DEADLINE_EXCEEDED:
      return EPD_ERR_TIMEOUT;
    case GRPC_STATUS_UNIMPLEMENTED:
      return EPD_ERR_UNSUPPORTED;
    default:
      return EPD_ERR_RPC;
  }
}

/* gRPC says UNAVAILABLE alike for a daemon that is gone and one that dropped the connection; on a Unix
 * socket a plain connect() tells them apart: ENOENT (no socket) or ECONNREFUSED (a socket file whose
 * daemon exited) mean nobody listens there, EACCES that the socket's mode shuts this user out. Rewrites
 * err (and *r for EACCES) in those cases; a probe that connects leaves both alone. Only for a bare
 * UNAVAILABLE (no epd-code from the daemon: it never answered). */
static void explain_unavailable(const epd_rpc_t *rpc, const char *method, epd_result_t *r, char *err,
                                size_t errlen) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  if (!rpc->unix_socket || strlen(rpc->path) >= sizeof sa.sun_path) return;
  memcpy(sa.sun_path, rpc->path, strlen(rpc->path) + 1);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  int rc = connect(fd, (struct sockaddr *)&sa, sizeof sa), e = errno;
  close(fd);
  if (rc == 0) return;
  const char *m = strrchr(method, '/');
  m = m ? m + 1 : method;
  struct stat st;
  if (e == ECONNREFUSED && stat(rpc->path, &st) == 0 && !S_ISSOCK(st.st_mode)) {
    snprintf(err, errlen, "%s: no daemon listens at %s (it is not a socket)", m, rpc->path);
    *r = EPD_ERR_CLOSED;
  } else if (e == ENOENT || e == ECONNREFUSED) {
    snprintf(err, errlen, "%s: no daemon listens at %s (%s%s; is epd running?)", m, rpc->path, strerror(e),
             e == ECONNREFUSED ? ": a socket file left by a daemon that exited" : "");
    *r = EPD_ERR_CLOSED;
  } else if (e == EACCES || e == EPERM) {
    snprintf(err, errlen, "%s: cannot connect to %s: %s (daemon.socket_mode and socket_group decide who may)",
             m, rpc->path, strerror(e));
    *r = EPD_ERR_PERMISSION;
  }
}

static ProtobufCMessage *unpack_bb(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *desc) {
  grpc_byte_buffer_reader rd;
  if (!grpc_byte_buffer_reader_init(&rd, bb)) return NULL;
  grpc_slice s = grpc_byte_buffer_reader_readall(&rd);
  ProtobufCMessage *m = protobuf_c_message_unpack(desc, NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
  grpc_slice_unref(s);
  grpc_byte_buffer_reader_destroy(&rd);
  return m;
}

static gpr_timespec deadline_of(int timeout_ms) {
  if (timeout_ms <= 0) return gpr_inf_future(GPR_CLOCK_REALTIME);
  return gpr_time_add(gpr_now(GPR_CLOCK_REALTIME), gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
}

/* Wait for a batch's tag; the call's own deadline bounds the wait. */
static int wait_tag(grpc_completion_queue *cq, void *tag) {
  grpc_event ev = grpc_completion_queue_pluck(cq, tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  return ev.type == GRPC_OP_COMPLETE && ev.success;
}

static void drain_cq(grpc_completion_queue *cq) {
  grpc_completion_queue_shutdown(cq);
  while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
         GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(cq);
}

static grpc_call *new_call(epd_rpc_t *rpc, grpc_completion_queue *cq, const char *method, int timeout_ms) {
  grpc_slice m = grpc_slice_from_copied_string(method);
  grpc_call *call = grpc_channel_create_call(rpc->chan, NULL, GRPC_PROPAGATE_DEFAULTS, cq, m, NULL,
                                             deadline_of(timeout_ms), NULL);
  grpc_slice_unref(m);
  return call;
}

epd_result_t epd_rpc_call_raw(epd_rpc_t *rpc, const char *method, const void *req, size_t len,
                              const ProtobufCMessageDescriptor *reply_desc, ProtobufCMessage **reply,
                              char *err, size_t errlen) {
  if (reply) *reply = NULL;
  if (err && errlen) err[0] = 0;
  grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
  grpc_call *call = new_call(rpc, cq, method, rpc->timeout_ms);
  if (!call) {
    drain_cq(cq);
    snprintf(err, errlen, "%s: cannot create the call", method);
    return EPD_ERR_RPC;
  }
  grpc_slice s = grpc_slice_from_copied_buffer(req, len);
  grpc_byte_buffer *send = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  grpc_byte_buffer *recv = NULL;
  grpc_metadata_array init_md, trailing;
  grpc_metadata_array_init(&init_md);
  grpc_metadata_array_init(&trailing);
  grpc_status_code st = GRPC_STATUS_UNKNOWN;
  grpc_slice details = grpc_empty_slice();
  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = send;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &init_md;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &recv;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &trailing;
  ops[5].data.recv_status_on_client.status = &st;
  ops[5].data.recv_status_on_client.status_details = &details;
  epd_result_t r;
  static int tag;
  if (grpc_call_start_batch(call, ops, 6, &tag, NULL) != GRPC_CALL_OK) {
    snprintf(err, errlen, "%s: cannot start the call", method);
    r = EPD_ERR_RPC;
  } else {
    wait_tag(cq, &tag);
    r = map_status(method, st, details, &trailing, err, errlen);
    if (st == GRPC_STATUS_UNAVAILABLE && r == EPD_ERR_CLOSED) /* the daemon never answered */
      explain_unavailable(rpc, method, &r, err, errlen);
    if (r == EPD_OK && reply_desc && reply) {
      ProtobufCMessage *m = recv ? unpack_bb(recv, reply_desc) : NULL;
      if (!m) {
        snprintf(err, errlen, "%s: malformed %s from the daemon", method, reply_desc->short_name);
        r = EPD_ERR_RPC;
      }
      *reply = m;
    }
  }
  grpc_byte_buffer_destroy(send);
  if (recv) grpc_byte_buffer_destroy(recv);
  grpc_slice_unref(details);
  grpc_metadata_array_destroy(&init_md);
  grpc_metadata_array_destroy(&trailing);
  grpc_call_unref(call);
  drain_cq(cq);
  return r;
}

static uint8_t *pack(const ProtobufCMessage *req, size_t *len) {
  *len = protobuf_c_message_get_packed_size(req);
  uint8_t *buf = malloc(*len ? *len : 1);
  if (buf) protobuf_c_message_pack(req, buf);
  return buf;
}

epd_result_t epd_rpc_call(epd_rpc_t *rpc, const char *method, const ProtobufCMessage *req,
                          const ProtobufCMessageDescriptor *reply_desc, ProtobufCMessage **reply, char *err,
                          size_t errlen) {
  size_t len;
  uint8_t *buf = pack(req, &len);
  if (!buf) {
    snprintf(err, errlen, "out of memory packing the request");
    return EPD_ERR_NOMEM;
  }
  epd_result_t r = epd_rpc_call_raw(rpc, method, buf, len, reply_desc, reply, err, errlen);
  free(buf);
  return r;
}

epd_result_t epd_rpc_stream(epd_rpc_t *rpc, const char *method, const ProtobufCMessage *req,
                            const ProtobufCMessageDescriptor *reply_desc, epd_rpc_stream_fn on_msg, void *arg,
                            int timeout_ms, char *err, size_t errlen) {
  if (err && errlen) err[0] = 0;
  size_t len;
  uint8_t *buf = pack(req, &len);
  if (!buf) {
    snprintf(err, errlen, "out of memory packing the request");
    return EPD_ERR_NOMEM;
  }
  grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
  grpc_call *call = new_call(rpc, cq, method, timeout_ms);
  if (!call) {
    free(buf);
    drain_cq(cq);
    snprintf(err, errlen, "%s: cannot create the call", method);
    return EPD_ERR_RPC;
  }
  grpc_slice s = grpc_slice_from_copied_buffer((const char *)buf, len);
  free(buf);
  grpc_byte_buffer *send = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  grpc_metadata_array init_md, trailing;
  grpc_metadata_array_init(&init_md);
  grpc_metadata_array_init(&trailing);
  grpc_status_code st = GRPC_STATUS_UNKNOWN;
  grpc_slice details = grpc_empty_slice();
  int stopped = 0, bad = 0;
  static int tag_start, tag_msg, tag_status;
  grpc_op ops[4];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = send;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &init_md;
  if (grpc_call_start_batch(call, ops, 4, &tag_start, NULL) == GRPC_CALL_OK && wait_tag(cq, &tag_start)) {
    for (;;) {
      grpc_byte_buffer *recv = NULL;
      grpc_op op;
      memset(&op, 0, sizeof op);
      op.op = GRPC_OP_RECV_MESSAGE;
      op.data.recv_message.recv_message = &recv;
      if (grpc_call_start_batch(call, &op, 1, &tag_msg, NULL) != GRPC_CALL_OK) break;
      int ok = wait_tag(cq, &tag_msg);
      if (!ok || !recv) break; /* end of stream or failure: the status says which */
      ProtobufCMessage *m = unpack_bb(recv, reply_desc);
      grpc_byte_buffer_destroy(recv);
      if (!m) {
        bad = 1;
        grpc_call_cancel(call, NULL);
        break;
      }
      int stop = on_msg(arg, m);
      protobuf_c_message_free_unpacked(m, NULL);
      if (stop) {
        stopped = 1;
        grpc_call_cancel(call, NULL);
        break;
      }
    }
  }
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  op.data.recv_status_on_client.trailing_metadata = &trailing;
  op.data.recv_status_on_client.status = &st;
  op.data.recv_status_on_client.status_details = &details;
  epd_result_t r;
  if (grpc_call_start_batch(call, &op, 1, &tag_status, NULL) != GRPC_CALL_OK) {
    snprintf(err, errlen, "%s: cannot read the call status", method);
    r = EPD_ERR_RPC;
  } else {
    wait_tag(cq, &tag_status);
    if (bad) {
      snprintf(err, errlen, "%s: malformed %s from the daemon", method, reply_desc->short_name);
      r = EPD_ERR_RPC;
    } else if (stopped) {
      r = EPD_OK; /* we cancelled it ourselves */
    } else {
      r = map_status(method, st, details, &trailing, err, errlen);
      if (st == GRPC_STATUS_UNAVAILABLE && r == EPD_ERR_CLOSED) /* the daemon never answered */
        explain_unavailable(rpc, method, &r, err, errlen);
    }
  }
  grpc_byte_buffer_destroy(send);
  grpc_slice_unref(details);
  grpc_metadata_array_destroy(&init_md);
  grpc_metadata_array_destroy(&trailing);
  grpc_call_unref(call);
  drain_cq(cq);
  return r;
}
