/*
 * libepd.c - the client library: control connection, attach (RPC + fd redemption on the attach socket +
 * mapping), the synchronous and stream-ordered submission of ops through the queue's slot protocol
 * (include/epd/epd_abi.h), and error reporting.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "epd.pb-c.h"
#include "epd_wire.h"
#include "libepd_internal.h"

#define EPD_EXPORT __attribute__((visibility("default")))

/* ---- errors ------------------------------------------------------------------------------------- */

EPD_EXPORT const char *epd_strerror(int result) {
  switch (result) {
    case EPD_OK:
      return "EPD_OK: success";
    case EPD_ERR_INVALID:
      return "EPD_ERR_INVALID: an argument is out of range";
    case EPD_ERR_NOMEM:
      return "EPD_ERR_NOMEM: out of host or device memory";
    case EPD_ERR_SYSTEM:
      return "EPD_ERR_SYSTEM: a system call failed";
    case EPD_ERR_RPC:
      return "EPD_ERR_RPC: the control RPC failed";
    case EPD_ERR_PROTOCOL:
      return "EPD_ERR_PROTOCOL: protocol or ABI version mismatch";
    case EPD_ERR_NOT_FOUND:
      return "EPD_ERR_NOT_FOUND: unknown group, client or resource";
    case EPD_ERR_BUSY:
      return "EPD_ERR_BUSY: rank already attached, or a limit reached";
    case EPD_ERR_TIMEOUT:
      return "EPD_ERR_TIMEOUT: a wait ran out (the completion names the peer rank)";
    case EPD_ERR_PEER:
      return "EPD_ERR_PEER: a peer rank's client detached or failed mid-step";
    case EPD_ERR_DRAINING:
      return "EPD_ERR_DRAINING: the daemon is draining (with a peer rank: that rank's node is)";
    case EPD_ERR_CUDA:
      return "EPD_ERR_CUDA: a CUDA call failed";
    case EPD_ERR_NCCL:
      return "EPD_ERR_NCCL: an NCCL call failed";
    case EPD_ERR_UNSUPPORTED:
      return "EPD_ERR_UNSUPPORTED: not available in this build, backend or mode";
    case EPD_ERR_BAD_EXPERT:
      return "EPD_ERR_BAD_EXPERT: a top-k entry is outside [-1, num_experts)";
    case EPD_ERR_TOO_MANY_TOKENS:
      return "EPD_ERR_TOO_MANY_TOKENS: num_tokens over the group's max_tokens";
    case EPD_ERR_PERMISSION:
      return "EPD_ERR_PERMISSION: the caller is not allowed to do this";
    case EPD_ERR_OVERFLOW:
      return "EPD_ERR_OVERFLOW: HT receive capacity exceeded";
    case EPD_ERR_MISMATCH:
      return "EPD_ERR_MISMATCH: ranks submitted different ops or banks for one step";
    case EPD_ERR_CLOSED:
      return "EPD_ERR_CLOSED: no daemon listens, or the daemon connection dropped";
    case EPD_ERR_STATE:
      return "EPD_ERR_STATE: call out of order";
    case EPD_ERR_INTERNAL:
      return "EPD_ERR_INTERNAL: internal error";
    default:
      return "EPD_ERR_UNKNOWN: unknown result code";
  }
}

/* Failures of epd_connect, which has no handle yet: per thread. */
static __thread char connect_err[EPD_ERRTEXT];

static epd_result_t fail(char *buf, epd_result_t rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static epd_result_t fail(char *buf, epd_result_t rc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, EPD_ERRTEXT, fmt, ap);
  va_end(ap);
  return rc;
}

EPD_EXPORT const char *epd_conn_last_error(const epd_conn_t *conn) {
  return conn ? conn->err : connect_err;
}
EPD_EXPORT const char *epd_last_error(const epd_ep_t *ep) {
  return ep ? ep->err : "";
}

/* ---- connection --------------------------------------------------------------------------------- */

/* Versioned option structs: the caller's must come from the initializer of this or a later version. */
static int opts_ok(uint32_t size, uint32_t magic, size_t want) {
  return size >= want && magic == EPD_OPTS_MAGIC;
}

EPD_EXPORT epd_result_t epd_connect(const epd_connect_opts_t *opts, epd_conn_t **out) {
  epd_connect_opts_t def = EPD_CONNECT_OPTS_INITIALIZER;
  connect_err[0] = 0;
  if (!out) return fail(connect_err, EPD_ERR_INVALID, "out: must not be NULL");
  *out = NULL;
  if (!opts) opts = &def;
  if (!opts_ok(opts->size, opts->magic, sizeof *opts))
    return fail(connect_err, EPD_ERR_INVALID,
                "opts: not initialised with EPD_CONNECT_OPTS_INITIALIZER (size %u, magic 0x%x)", opts->size,
                opts->magic);
  if (opts->timeout_ms < 0)
    return fail(connect_err, EPD_ERR_INVALID, "timeout_ms %d: must be >= 0", opts->timeout_ms);
  epd_conn_t *c = calloc(1, sizeof *c);
  if (!c) return fail(connect_err, EPD_ERR_NOMEM, "out of memory");
  c->timeout_ms = opts->timeout_ms ? opts->timeout_ms : EPD_DEFAULT_RPC_TIMEOUT_MS;
  epd_result_t rc = epd_rpc_open(opts->socket_path, c->timeout_ms, &c->rpc, connect_err, sizeof connect_err);
  if (rc) {
    free(c);
    return rc;
  }
  /* The daemon answers only requests of a protocol version it speaks. */
  Epd__V1__GetStatusRequest req = EPD__V1__GET_STATUS_REQUEST__INIT;
  req.protocol_version = EPD_PROTOCOL_VERSION;
  ProtobufCMessage *rep = NULL;
  char err[EPD_ERRTEXT] = "";
  rc = epd_rpc_call(c->rpc, "/epd.v1.Control/GetStatus", &req.base, &epd__v1__status_reply__descriptor, &rep,
                    err, sizeof err);
  if (rc == EPD_OK) {
    Epd__V1__StatusReply *st = (Epd__V1__StatusReply *)rep;
    if (st->protocol_version && st->protocol_version != EPD_PROTOCOL_VERSION)
      rc = fail(connect_err, EPD_ERR_PROTOCOL, "daemon speaks protocol %u, libepd %u", st->protocol_version,
                EPD_PROTOCOL_VERSION);
    protobuf_c_message_free_unpacked(rep, NULL);
  } else {
    snprintf(connect_err, sizeof connect_err, "%s", err); /* names the method: "GetStatus: ..." */
  }
  if (rc) {
    epd_rpc_close(c->rpc);
    free(c);
    return rc;
  }
  *out = c;
  return EPD_OK;
}

EPD_EXPORT void epd_disconnect(epd_conn_t *conn) {
  if (!conn) return;
  epd_rpc_close(conn->rpc);
  free(conn);
}

/* ---- attach ------------------------------------------------------------------------------------- */

static int now_ms_since(const struct timespec *t0) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int)((t.tv_sec - t0->tv_sec) * 1000 + (t.tv_nsec - t0->tv_nsec) / 1000000);
}

/* Redeem the token on the attach socket: send the request, receive the reply and the queue and arena fds. */
static epd_result_t redeem(epd_ep_t *ep, const char *path, const uint8_t *token, int fds[2], int timeout_ms) {
  fds[0] = fds[1] = -1;
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof sa.sun_path)
    return fail(ep->err, EPD_ERR_PROTOCOL, "attach_socket path too long: %s", path);
  strcpy(sa.sun_path, path);
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return fail(ep->err, EPD_ERR_SYSTEM, "socket: %s", strerror(errno));
  ep->sock = s;
  if (connect(s, (struct sockaddr *)&sa, sizeof sa) < 0)
    return fail(ep->err, EPD_ERR_SYSTEM, "connect to attach socket %s: %s", path, strerror(errno));
  epd_redeem_req_t req;
  memset(&req, 0, sizeof req);
  req.magic = EPD_WIRE_MAGIC;
  req.version = EPD_WIRE_VERSION;
  req.client_id = ep->client_id;
  memcpy(req.token, token, EPD_TOKEN_BYTES);
  if (send(s, &req, sizeof req, MSG_NOSIGNAL) != (ssize_t)sizeof req)
    return fail(ep->err, EPD_ERR_SYSTEM, "send to attach socket %s: %s", path, strerror(errno));
  epd_redeem_rep_t rep;
  size_t got = 0;
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  while (got < sizeof rep) {
    int left = timeout_ms - now_ms_since(&t0);
    struct pollfd p = {.fd = s, .events = POLLIN};
    if (left <= 0 || poll(&p, 1, left) == 0)
      return fail(ep->err, EPD_ERR_TIMEOUT, "no reply on attach socket %s after %d ms", path, timeout_ms);
    union {
      struct cmsghdr h;
      char buf[CMSG_SPACE(2 * sizeof(int))];
    } cm;
    struct iovec iov = {(char *)&rep + got, sizeof rep - got};
    struct msghdr mh = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.buf, .msg_controllen = sizeof cm.buf};
    ssize_t n = recvmsg(s, &mh, MSG_CMSG_CLOEXEC);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) return fail(ep->err, EPD_ERR_SYSTEM, "recvmsg on attach socket: %s", strerror(errno));
    if (n == 0) return fail(ep->err, EPD_ERR_CLOSED, "attach socket closed before the reply");
    for (struct cmsghdr *h = CMSG_FIRSTHDR(&mh); h; h = CMSG_NXTHDR(&mh, h))
      if (h->cmsg_level == SOL_SOCKET && h->cmsg_type == SCM_RIGHTS) {
        size_t nf = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        int tmp[2] = {-1, -1};
        memcpy(tmp, CMSG_DATA(h), (nf > 2 ? 2 : nf) * sizeof(int));
        for (size_t i = 0; i < nf && i < 2; i++) fds[i] = tmp[i];
      }
    got += (size_t)n;
  }
  if (rep.magic != EPD_WIRE_MAGIC || rep.version != EPD_WIRE_VERSION)
    return fail(ep->err, EPD_ERR_PROTOCOL, "attach socket reply magic 0x%x version %u, want 0x%x version %u",
                rep.magic, rep.version, EPD_WIRE_MAGIC, EPD_WIRE_VERSION);
  rep.message[sizeof rep.message - 1] = 0;
  if (rep.status) return fail(ep->err, rep.status, "token redemption: %s", rep.message);
  if (rep.nfds != 2 || fds[0] < 0 || fds[1] < 0)
    return fail(ep->err, EPD_ERR_PROTOCOL, "token redemption gave %u fds, want 2", rep.nfds);
  return EPD_OK;
}

static void detach_rpc(epd_ep_t *ep, char *err, size_t errlen, epd_result_t *rc) {
  Epd__V1__DetachRequest req = EPD__V1__DETACH_REQUEST__INIT;
  req.protocol_version = EPD_PROTOCOL_VERSION;
  req.client_id = ep->client_id;
  req.secret.data = ep->secret;
  req.secret.len = ep->secret_len;
  ProtobufCMessage *rep = NULL;
  *rc = epd_rpc_call(ep->conn->rpc, "/epd.v1.Control/Detach", &req.base, &epd__v1__detach_reply__descriptor,
                     &rep, err, errlen);
  if (rep) protobuf_c_message_free_unpacked(rep, NULL);
}

static void ep_release(epd_ep_t *ep) {
  if (ep->ksub && ep->queue) {
    /* Waits still spinning on this queue (our kernels, or a worker's epd_device.h) give up when they
     * find the host copy FREE; ours are waited for before the memory goes. */
    for (unsigned i = 0; i < EPD_QUEUE_SLOTS; i++)
      if (__atomic_load_n(&ep->queue->slot[i].state, __ATOMIC_ACQUIRE) == EPD_SLOT_SUBMITTED)
        __atomic_store_n(&ep->queue->slot[i].state, EPD_SLOT_FREE, __ATOMIC_RELEASE);
    char e[64];
    if (ep->kstream) epd_cuda_stream_sync(ep->kstream, e, sizeof e);
  }
  if (ep->kstream) epd_cuda_stream_destroy(ep->kstream);
  ep->kstream = NULL;
  if (ep->queue_reg) epd_cuda_unregister_host(ep->queue_reg);
  if (ep->arena_map)
    epd_cuda_unimport(ep->arena_map);
  else if (ep->arena)
    munmap(ep->arena, ep->arena_bytes);
  if (ep->queue) munmap(ep->queue, ep->queue_bytes);
  if (ep->sock >= 0) close(ep->sock);
  ep->queue_reg = NULL;
  ep->arena_map = NULL;
  ep->arena = NULL;
  ep->queue = NULL;
  ep->sock = -1;
}

static epd_result_t map_twin_submit(epd_ep_t *ep);

/* The GPU-side wait of a kernel submission gives up after EPD_OP_TIMEOUT_MS, as the host path does. */
static uint64_t op_timeout_ns(const epd_ep_t *ep) {
  return (uint64_t)ep->op_timeout_ms * 1000000ull;
}

/* Device address of slot i of a queue (host copy or twin) at device address `queue`. */
static uint64_t slot_addr(uint64_t queue, uint32_t i) {
  return queue + offsetof(epd_queue_t, slot) + (uint64_t)i * sizeof(epd_slot_t);
}

/* The queue's device twin (include/epd/epd_abi.h): each twin slot learns where its host copy is, in this
 * process. Submission goes through the twin, with libepd's kernels, where the daemon says its
 * persistent kernels serve the queue (they poll only the twin); EPD_SUBMIT=kernel asks for that anyway,
 * EPD_SUBMIT=memop for stream memory operations on the host copy where the daemon allows it. */
static epd_result_t map_twin(epd_ep_t *ep) {
  uint64_t off = ep->queue->dq_offset;
  if (!off) return EPD_OK;
  if (off % 256 || off + sizeof(epd_queue_t) > ep->arena_bytes)
    return fail(ep->err, EPD_ERR_PROTOCOL, "queue twin at %llu: past the arena's %zu bytes",
                (unsigned long long)off, ep->arena_bytes);
  ep->dq_dev = (uint64_t)(uintptr_t)ep->arena + off;
  /* libepd's own CUDA work runs in the primary context of the attachment's device, whatever context the
   * calling thread has (its private stream, and so the host path, belong to that context) */
  epd_result_t rc = epd_cuda_ctx_enter(ep->device, ep->err, sizeof ep->err);
  if (rc) return rc;
  uint64_t host[EPD_QUEUE_SLOTS];
  for (unsigned i = 0; i < EPD_QUEUE_SLOTS; i++) host[i] = slot_addr(ep->queue_dev, i);
  rc = epd_cuda_write_words(slot_addr(ep->dq_dev, 0) + offsetof(epd_slot_t, twin_host), sizeof(epd_slot_t),
                            host, EPD_QUEUE_SLOTS, ep->err, sizeof ep->err);
  if (!rc) rc = map_twin_submit(ep);
  epd_cuda_ctx_leave();
  return rc;
}

/* (in the attachment's context) whether and how to submit through the twin */
static epd_result_t map_twin_submit(epd_ep_t *ep) {
  const char *env = getenv("EPD_SUBMIT");
  int twin = (ep->queue->qflags & EPD_QF_TWIN) != 0;
  ep->ksub = twin || (env && !strcmp(env, "kernel"));
  if (env && !strcmp(env, "memop") && twin)
    fprintf(stderr,
            "libepd: EPD_SUBMIT=memop ignored: the daemon's persistent kernels serve this queue and see "
            "only submissions through its device twin\n");
  if (!ep->ksub) return EPD_OK;
  epd_result_t rc = epd_cuda_ksub_load(ep->device, ep->err, sizeof ep->err);
  if (!rc) rc = epd_cuda_stream_create(&ep->kstream, ep->err, sizeof ep->err);
  return rc;
}

static epd_result_t map_memory(epd_ep_t *ep, const Epd__V1__AttachReply *a, int fds[2]) {
  ep->queue_bytes = a->queue_bytes;
  ep->arena_bytes = a->arena_bytes;
  if (ep->queue_bytes < sizeof(epd_queue_t))
    return fail(ep->err, EPD_ERR_PROTOCOL, "queue of %zu bytes, the ABI needs %zu", ep->queue_bytes,
                sizeof(epd_queue_t));
  void *q = mmap(NULL, ep->queue_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
  if (q == MAP_FAILED)
    return fail(ep->err, EPD_ERR_SYSTEM, "mmap queue (%zu bytes): %s", ep->queue_bytes, strerror(errno));
  ep->queue = q;
  if (ep->queue->magic != EPD_QUEUE_MAGIC || ep->queue->abi_version != EPD_ABI_VERSION ||
      ep->queue->nslots != EPD_QUEUE_SLOTS)
    return fail(ep->err, EPD_ERR_PROTOCOL,
                "queue magic 0x%x abi %u slots %u, libepd wants 0x%x abi %u slots %u", ep->queue->magic,
                ep->queue->abi_version, ep->queue->nslots, EPD_QUEUE_MAGIC, EPD_ABI_VERSION, EPD_QUEUE_SLOTS);
  if (!strcmp(a->memory, "host")) {
    void *m = mmap(NULL, ep->arena_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[1], 0);
    if (m == MAP_FAILED)
      return fail(ep->err, EPD_ERR_SYSTEM, "mmap arena (%zu bytes): %s", ep->arena_bytes, strerror(errno));
    ep->arena = m;
    return EPD_OK;
  }
  if (!strcmp(a->memory, "cuda")) {
    void *addr = NULL;
    epd_result_t rc =
        epd_cuda_import(fds[1], ep->arena_bytes, ep->device, &ep->arena_map, &addr, ep->err, sizeof ep->err);
    if (rc) return rc;
    ep->arena = addr;
    ep->on_gpu = 1;
    if ((rc = epd_cuda_register_host(ep->queue, ep->queue_bytes, ep->device, &ep->queue_reg, &ep->queue_dev,
                                     ep->err, sizeof ep->err)))
      return rc;
    return map_twin(ep);
  }
  return fail(ep->err, EPD_ERR_PROTOCOL, "memory kind \"%s\" unknown (host, cuda)", a->memory);
}

EPD_EXPORT epd_result_t epd_attach(epd_conn_t *conn, const epd_attach_opts_t *opts, epd_ep_t **out) {
  if (!conn) return EPD_ERR_INVALID;
  if (!out) return fail(conn->err, EPD_ERR_INVALID, "out: must not be NULL");
  *out = NULL;
  if (!opts || !opts_ok(opts->size, opts->magic, offsetof(epd_attach_opts_t, weight_bytes_per_slot)))
    return fail(conn->err, EPD_ERR_INVALID, "opts: not initialised with EPD_ATTACH_OPTS_INITIALIZER");
    /* fields added after API version 1: an older, shorter struct means 0 */
#define HAS_FIELD(f) (opts->size >= offsetof(epd_attach_opts_t, f) + sizeof opts->f)
  const uint64_t wbytes = HAS_FIELD(weight_bytes_per_slot) ? opts->weight_bytes_per_slot : 0;
  const uint32_t on_loss = HAS_FIELD(on_rank_loss) ? opts->on_rank_loss : 0;
  const uint32_t renorm = HAS_FIELD(renormalize) ? opts->renormalize : 0;
#undef HAS_FIELD
  if (on_loss > EPD_RANK_LOSS_MASK)
    return fail(conn->err, EPD_ERR_INVALID,
                "on_rank_loss %u: must be 0, EPD_RANK_LOSS_FAIL or EPD_RANK_LOSS_MASK", on_loss);
  if (opts->rank < 0) /* the daemon checks the upper bound: it knows num_ranks */
    return fail(conn->err, EPD_ERR_INVALID, "rank %d: must be >= 0", opts->rank);
  char name[64];
  if (!opts->client_name) snprintf(name, sizeof name, "pid:%d", (int)getpid());
  Epd__V1__AttachRequest req = EPD__V1__ATTACH_REQUEST__INIT;
  req.protocol_version = EPD_PROTOCOL_VERSION;
  req.group = (char *)(opts->group ? opts->group : "default");
  req.rank = opts->rank;
  req.num_experts = opts->num_experts;
  req.hidden = opts->hidden;
  req.topk = opts->topk;
  req.max_tokens = opts->max_tokens;
  req.weight_bytes_per_slot = wbytes;
  req.on_rank_loss = on_loss;
  req.renormalize = renorm;
  req.client_name = (char *)(opts->client_name ? opts->client_name : name);
  req.pid = (uint32_t)getpid();
  ProtobufCMessage *msg = NULL;
  epd_result_t rc = epd_rpc_call(conn->rpc, "/epd.v1.Control/Attach", &req.base,
                                 &epd__v1__attach_reply__descriptor, &msg, conn->err, sizeof conn->err);
  if (rc) return rc;
  Epd__V1__AttachReply *a = (Epd__V1__AttachReply *)msg;
  epd_ep_t *ep = calloc(1, sizeof *ep);
  if (!ep) {
    protobuf_c_message_free_unpacked(msg, NULL);
    return fail(conn->err, EPD_ERR_NOMEM, "out of memory");
  }
  ep->conn = conn;
  ep->sock = -1;
  ep->last_slot = -1;
  ep->client_id = a->client_id;
  ep->rank = opts->rank;
  ep->device = a->device;
  ep->num_ranks = a->num_ranks;
  ep->num_experts = a->num_experts;
  ep->hidden = a->hidden;
  ep->topk = a->topk;
  ep->max_tokens = a->max_tokens;
  ep->slots_per_rank = a->slots_per_rank;
  ep->ht_capacity = a->ht_capacity;
  ep->map_version = a->map_version;
  ep->weight_bytes_per_slot = a->weight_bytes_per_slot;
  const char *env = getenv("EPD_OP_TIMEOUT_MS");
  ep->op_timeout_ms = env && atoi(env) > 0 ? atoi(env) : EPD_DEFAULT_OP_TIMEOUT_MS;
  int fds[2] = {-1, -1};
  if (a->secret.len > sizeof ep->secret || a->token.len != EPD_TOKEN_BYTES ||
      a->n_buffers > EPD_MAX_BUFFERS) {
    rc = fail(ep->err, EPD_ERR_PROTOCOL, "attach reply: secret %zu bytes, token %zu bytes, %zu buffers",
              a->secret.len, a->token.len, a->n_buffers);
    goto fail;
  }
  memcpy(ep->secret, a->secret.data, a->secret.len);
  ep->secret_len = a->secret.len;
  /* The daemon's ordinal of the rank's GPU is not ours where our CUDA_VISIBLE_DEVICES differs: ours is
   * the one with its UUID (a daemon before the UUID field: its ordinal).
   * Resolved after the secret is kept: failing here detaches. */
  if (ep->device >= 0 && a->device_uuid.len == 16 &&
      (rc = epd_cuda_find_device(a->device_uuid.data, &ep->device, ep->err, sizeof ep->err)))
    goto fail;
  ep->nbuffers = (uint32_t)a->n_buffers;
  for (size_t i = 0; i < a->n_buffers; i++) {
    const Epd__V1__BufferInfo *b = a->buffers[i];
    if (b->offset + b->bytes > a->arena_bytes) {
      rc = fail(ep->err, EPD_ERR_PROTOCOL, "attach reply: buffer kind %u bank %u past the arena's end",
                b->kind, b->bank);
      goto fail;
    }
    ep->buffers[i].kind = b->kind;
    ep->buffers[i].bank = b->bank;
    ep->buffers[i].offset = b->offset;
    ep->buffers[i].bytes = b->bytes;
  }
  if ((rc = redeem(ep, a->attach_socket, a->token.data, fds, conn->timeout_ms))) goto fail;
  if ((rc = map_memory(ep, a, fds))) goto fail;
  close(fds[0]);
  close(fds[1]);
  protobuf_c_message_free_unpacked(msg, NULL);
  conn->nattached++;
  *out = ep;
  return EPD_OK;
fail:
  snprintf(conn->err, sizeof conn->err, "%s", ep->err);
  for (int i = 0; i < 2; i++)
    if (fds[i] >= 0) close(fds[i]);
  {
    /* Give the rank back: the daemon attached us already. */
    char derr[EPD_ERRTEXT];
    epd_result_t drc;
    detach_rpc(ep, derr, sizeof derr, &drc);
  }
  ep_release(ep);
  free(ep);
  protobuf_c_message_free_unpacked(msg, NULL);
  return rc;
}

EPD_EXPORT epd_result_t epd_detach(epd_ep_t *ep) {
  if (!ep) return EPD_ERR_INVALID;
  epd_result_t rc = EPD_OK;
  char err[EPD_ERRTEXT] = "";
  if (!ep->closed) detach_rpc(ep, err, sizeof err, &rc);
  if (rc) snprintf(ep->conn->err, sizeof ep->conn->err, "Detach: %s", err);
  ep_release(ep);
  ep->conn->nattached--;
  free(ep);
  return rc;
}

EPD_EXPORT int64_t epd_info(const epd_ep_t *ep, epd_info_t key) {
  if (!ep) return -1;
  switch (key) {
    case EPD_INFO_RANK:
      return ep->rank;
    case EPD_INFO_NUM_RANKS:
      return ep->num_ranks;
    case EPD_INFO_NUM_EXPERTS:
      return ep->num_experts;
    case EPD_INFO_HIDDEN:
      return ep->hidden;
    case EPD_INFO_TOPK:
      return ep->topk;
    case EPD_INFO_MAX_TOKENS:
      return ep->max_tokens;
    case EPD_INFO_SLOTS_PER_RANK:
      return ep->slots_per_rank;
    case EPD_INFO_HT_CAPACITY:
      return ep->ht_capacity;
    case EPD_INFO_ON_GPU:
      return ep->on_gpu;
    case EPD_INFO_DEVICE:
      return ep->device;
    /* The daemon keeps the active version in the queue header; before any op it is the attach's. */
    case EPD_INFO_MAP_VERSION:
      return ep->queue && ep->queue->map_version ? ep->queue->map_version : ep->map_version;
    case EPD_INFO_CLIENT_ID:
      return (int64_t)ep->client_id;
    case EPD_INFO_NEXT_SLOT:
      return ep->next_slot;
    case EPD_INFO_WEIGHT_BYTES_PER_SLOT:
      return (int64_t)ep->weight_bytes_per_slot;
    case EPD_INFO_KERNEL_SUBMIT:
      return ep->ksub;
  }
  return -1;
}

EPD_EXPORT void *epd_slot_device_ptr(epd_ep_t *ep, unsigned slot) {
  if (ep && ep->dq_dev && slot < EPD_QUEUE_SLOTS) return (void *)(uintptr_t)slot_addr(ep->dq_dev, slot);
  if (!ep || !ep->queue_reg || !ep->queue_dev) {
    if (ep)
      fail(ep->err, EPD_ERR_UNSUPPORTED, "epd_slot_device_ptr: the queue is not GPU-mapped (host backend)");
    return NULL;
  }
  if (slot >= EPD_QUEUE_SLOTS) {
    fail(ep->err, EPD_ERR_INVALID, "slot %u: out of range [0, %u)", slot, EPD_QUEUE_SLOTS);
    return NULL;
  }
  return (void *)(uintptr_t)slot_addr(ep->queue_dev, slot);
}

EPD_EXPORT void *epd_buffer(const epd_ep_t *ep, int kind, unsigned bank, size_t *bytes) {
  if (bytes) *bytes = 0;
  if (!ep || !ep->arena) return NULL;
  for (uint32_t i = 0; i < ep->nbuffers; i++)
    if ((int)ep->buffers[i].kind == kind && ep->buffers[i].bank == bank) {
      if (bytes) *bytes = ep->buffers[i].bytes;
      return ep->arena + ep->buffers[i].offset;
    }
  return NULL;
}

/* ---- expert map table ----------------------------------------------------------------------------- */

/* The table in the queue mapping, checked against the mapping's size; NULL if there is none. */
static const epd_map_table_t *map_table(const epd_ep_t *ep) {
  if (!ep || !ep->queue) return NULL;
  uint32_t off = ep->queue->map_table_offset;
  if (!off || off % 8 || (size_t)off + sizeof(epd_map_table_t) > ep->queue_bytes) return NULL;
  const epd_map_table_t *t = (const epd_map_table_t *)((const uint8_t *)ep->queue + off);
  if (t->magic != EPD_MAP_TABLE_MAGIC || t->max_replicas == 0 ||
      off + epd_map_table_bytes(t->num_experts, t->max_replicas, t->num_ranks, t->slots_per_rank) >
          ep->queue_bytes)
    return NULL;
  return t;
}

/* Seqlock read: copy what fn wants while the daemon is not writing, retry otherwise (the daemon writes
 * only at step boundaries, for microseconds). Returns the version read, 0 if the table never settled. */
typedef void (*map_read_fn)(const epd_map_table_t *t, void *arg);
static uint32_t map_read(const epd_map_table_t *t, map_read_fn fn, void *arg) {
  const _Atomic uint32_t *seq = (const _Atomic uint32_t *)&t->seq;
  for (int tries = 0; tries < 1000000; tries++) {
    uint32_t s1 = atomic_load_explicit(seq, memory_order_acquire);
    if (s1 & 1u) continue;
    uint32_t v = t->version;
    fn(t, arg);
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(seq, memory_order_relaxed) == s1) return v;
  }
  return 0;
}

EPD_EXPORT uint64_t epd_masked_ranks(const epd_ep_t *ep) {
  return ep && ep->queue
             ? atomic_load_explicit((const _Atomic uint64_t *)&ep->queue->masked_ranks, memory_order_acquire)
             : 0;
}

EPD_EXPORT uint32_t epd_map_version(const epd_ep_t *ep) {
  const epd_map_table_t *t = map_table(ep);
  return t ? atomic_load_explicit((const _Atomic uint32_t *)&t->version, memory_order_acquire) : 0;
}

typedef struct slots_arg {
  uint32_t logical, max, n;
  epd_replica_t *reps;
} slots_arg_t;
static void read_slots(const epd_map_table_t *t, void *arg) {
  slots_arg_t *a = arg;
  const uint32_t *nrep = (const uint32_t *)(t + 1), *rep = nrep + t->num_experts;
  a->n = nrep[a->logical] <= t->max_replicas ? nrep[a->logical] : t->max_replicas;
  for (uint32_t i = 0; i < a->n && i < a->max; i++) {
    a->reps[i].rank = rep[((size_t)a->logical * t->max_replicas + i) * 2];
    a->reps[i].slot = rep[((size_t)a->logical * t->max_replicas + i) * 2 + 1];
  }
}

EPD_EXPORT epd_result_t epd_expert_slots(const epd_ep_t *ep, uint32_t logical, epd_replica_t *reps,
                                         uint32_t max, uint32_t *nrep, uint32_t *version) {
  if (!ep) return EPD_ERR_INVALID;
  char *err = (char *)ep->err; /* the per-handle error text is not part of the const contract */
  const epd_map_table_t *t = map_table(ep);
  if (!t) return fail(err, EPD_ERR_UNSUPPORTED, "the daemon publishes no expert map table");
  if (logical >= t->num_experts)
    return fail(err, EPD_ERR_INVALID, "logical %u: out of range [0, %u)", logical, t->num_experts);
  if (max && !reps) return fail(err, EPD_ERR_INVALID, "reps: NULL with max %u", max);
  slots_arg_t a = {logical, max, 0, reps};
  uint32_t v = map_read(t, read_slots, &a);
  if (!v) return fail(err, EPD_ERR_TIMEOUT, "the expert map table did not settle");
  if (nrep) *nrep = a.n;
  if (version) *version = v;
  return EPD_OK;
}

typedef struct slot_experts_arg {
  uint32_t rank, n;
  int32_t *logical;
} slot_experts_arg_t;
static void read_slot_experts(const epd_map_table_t *t, void *arg) {
  slot_experts_arg_t *a = arg;
  const int32_t *se = (const int32_t *)((const uint32_t *)(t + 1) + t->num_experts +
                                        (size_t)t->num_experts * t->max_replicas * 2);
  memcpy(a->logical, se + (size_t)a->rank * t->slots_per_rank, sizeof *a->logical * a->n);
}

EPD_EXPORT epd_result_t epd_slot_experts(const epd_ep_t *ep, int32_t *logical, uint32_t n,
                                         uint32_t *version) {
  if (!ep) return EPD_ERR_INVALID;
  char *err = (char *)ep->err;
  const epd_map_table_t *t = map_table(ep);
  if (!t) return fail(err, EPD_ERR_UNSUPPORTED, "the daemon publishes no expert map table");
  if (n > t->slots_per_rank || (n && !logical) || (uint32_t)ep->rank >= t->num_ranks)
    return fail(err, EPD_ERR_INVALID, "n %u: out of range [0, %u] (slots per rank), logical %s", n,
                t->slots_per_rank, logical ? "set" : "NULL");
  slot_experts_arg_t a = {(uint32_t)ep->rank, n, logical};
  uint32_t v = map_read(t, read_slot_experts, &a);
  if (!v) return fail(err, EPD_ERR_TIMEOUT, "the expert map table did not settle");
  if (version) *version = v;
  return EPD_OK;
}

/* ---- ops ---------------------------------------------------------------------------------------- */

static uint32_t load_state(epd_slot_t *s) {
  return atomic_load_explicit((_Atomic uint32_t *)&s->state, memory_order_acquire);
}
static void store_state(epd_slot_t *s, uint32_t v) {
  atomic_store_explicit((_Atomic uint32_t *)&s->state, v, memory_order_release);
}

/* Has the daemon hung up the attach connection? */
static int daemon_gone(epd_ep_t *ep) {
  struct pollfd p = {.fd = ep->sock, .events = POLLIN};
  if (poll(&p, 1, 0) <= 0) return 0;
  if (p.revents & (POLLHUP | POLLERR)) return 1;
  char c;
  return recv(ep->sock, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

static const char *op_name(uint32_t op) {
  switch (op) {
    case EPD_OP_LL_DISPATCH:
      return "LL dispatch";
    case EPD_OP_LL_COMBINE:
      return "LL combine";
    case EPD_OP_HT_DISPATCH:
      return "HT dispatch";
    case EPD_OP_HT_COMBINE:
      return "HT combine";
  }
  return "op";
}

/* Whether the synchronous op in slot s is over: DONE in the host copy, or (submitted through the twin
 * by libepd's kernel on its own stream) that kernel has returned; < 0 on a CUDA error. */
static int sync_done(epd_ep_t *ep, epd_slot_t *s) {
  if (!ep->ksub) return load_state(s) == EPD_SLOT_DONE;
  return epd_cuda_stream_done(ep->kstream, ep->err, sizeof ep->err);
}

static epd_result_t submit_sync(epd_ep_t *ep, const epd_desc_t *d) {
  epd_slot_t *s = &ep->queue->slot[ep->next_slot];
  if (load_state(s) != EPD_SLOT_FREE)
    return fail(ep->err, EPD_ERR_STATE, "slot %u is still in use (a stream op not yet synchronised?)",
                ep->next_slot);
  if (ep->ksub) {
    /* through the twin: the kernel submits, waits and frees; the CPU waits for the kernel */
    epd_result_t rc = epd_cuda_ksubmit(ep->kstream, slot_addr(ep->dq_dev, ep->next_slot), d, EPD_KSUB_RUN,
                                       op_timeout_ns(ep), ep->err, sizeof ep->err);
    if (rc) return rc;
  } else {
    s->desc = *d;
    store_state(s, EPD_SLOT_SUBMITTED);
  }
  ep->last_slot = (int)ep->next_slot;
  ep->last_async = 0;
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  /* Spin briefly (a step takes microseconds), then sleep a little longer each time, checking that the
   * daemon is still there about every millisecond. */
  unsigned polls = 0;
  long sleep_ns = 1000;
  int last_check = 0;
  int done;
  while ((done = sync_done(ep, s)) == 0) {
    if (++polls < 2000) continue;
    struct timespec ts = {0, sleep_ns};
    nanosleep(&ts, NULL);
    if (sleep_ns < 50000) sleep_ns += sleep_ns / 2;
    int el = now_ms_since(&t0);
    if (el - last_check >= 1) {
      last_check = el;
      if ((done = sync_done(ep, s)) != 0) break;
      if (daemon_gone(ep)) {
        ep->closed = 1;
        return fail(ep->err, EPD_ERR_CLOSED, "%s: the daemon connection dropped while waiting for slot %u",
                    op_name(d->op), ep->next_slot);
      }
      if (el > ep->op_timeout_ms) {
        ep->stuck = 1;
        return fail(ep->err, EPD_ERR_TIMEOUT, "%s: no completion after %d ms (EPD_OP_TIMEOUT_MS)",
                    op_name(d->op), ep->op_timeout_ms);
      }
    }
  }
  if (done < 0) {
    ep->stuck = 1;
    return EPD_ERR_CUDA;
  }
  if (ep->ksub && load_state(s) != EPD_SLOT_FREE) {
    ep->stuck = 1;
    return fail(ep->err, EPD_ERR_TIMEOUT, "%s: no completion after %d ms (EPD_OP_TIMEOUT_MS)", op_name(d->op),
                ep->op_timeout_ms);
  }
  ep->last_comp = s->comp;
  if (!ep->ksub) store_state(s, EPD_SLOT_FREE);
  ep->next_slot = (ep->next_slot + 1) % EPD_QUEUE_SLOTS;
  const epd_comp_t *c = &ep->last_comp;
  if (c->status) {
    if (c->peer >= 0)
      fail(ep->err, c->status, "%s (step %llu): %s; peer rank %d", op_name(d->op),
           (unsigned long long)c->step, epd_strerror(c->status), c->peer);
    else
      fail(ep->err, c->status, "%s (step %llu): %s", op_name(d->op), (unsigned long long)c->step,
           epd_strerror(c->status));
  }
  return c->status;
}

static epd_result_t submit(epd_ep_t *ep, const epd_desc_t *d, void *stream) {
  if (ep->closed) return fail(ep->err, EPD_ERR_CLOSED, "the daemon connection dropped earlier; attach again");
  if (ep->stuck)
    return fail(ep->err, EPD_ERR_STATE, "an earlier op never completed; detach and attach again");
  if (!stream) return submit_sync(ep, d);
  if (!ep->queue_reg)
    return fail(ep->err, EPD_ERR_UNSUPPORTED,
                "stream: stream-ordered ops need the CUDA backend (this attachment "
                "has host memory); pass stream = NULL");
  epd_result_t rc;
  if (ep->ksub) {
    rc = epd_cuda_ksubmit(stream, slot_addr(ep->dq_dev, ep->next_slot), d, EPD_KSUB_RUN, op_timeout_ns(ep),
                          ep->err, sizeof ep->err);
  } else {
    rc = epd_cuda_submit(stream, slot_addr(ep->queue_dev, ep->next_slot), d, ep->err, sizeof ep->err);
  }
  if (rc) return rc;
  ep->last_slot = (int)ep->next_slot;
  ep->last_async = 1;
  ep->next_slot = (ep->next_slot + 1) % EPD_QUEUE_SLOTS;
  return EPD_OK;
}

static epd_result_t check_common(epd_ep_t *ep, epd_mode_t mode, unsigned bank) {
  if (mode != EPD_MODE_LL && mode != EPD_MODE_HT)
    return fail(ep->err, EPD_ERR_INVALID, "mode %d: allowed EPD_MODE_LL (0) or EPD_MODE_HT (1)", (int)mode);
  if (bank >= EPD_NUM_BANKS)
    return fail(ep->err, EPD_ERR_INVALID, "bank %u: out of range [0, %u)", bank, EPD_NUM_BANKS);
  return EPD_OK;
}

EPD_EXPORT epd_result_t epd_dispatch(epd_ep_t *ep, epd_mode_t mode, uint32_t num_tokens, uint32_t flags,
                                     unsigned bank, void *stream) {
  if (!ep) return EPD_ERR_INVALID;
  epd_result_t rc = check_common(ep, mode, bank);
  if (rc) return rc;
  if (num_tokens > ep->max_tokens)
    return fail(ep->err, EPD_ERR_TOO_MANY_TOKENS,
                "num_tokens %u: out of range [0, %u] (the group's max_tokens)", num_tokens, ep->max_tokens);
  if (flags & ~(uint32_t)(EPD_DESC_FP8 | EPD_DESC_HT_DENSE))
    return fail(ep->err, EPD_ERR_INVALID,
                "flags 0x%x: only EPD_DESC_FP8 (0x%x) and EPD_DESC_HT_DENSE (0x%x) are defined", flags,
                EPD_DESC_FP8, EPD_DESC_HT_DENSE);
  if ((flags & EPD_DESC_HT_DENSE) && mode != EPD_MODE_HT)
    return fail(ep->err, EPD_ERR_INVALID, "flags: EPD_DESC_HT_DENSE is for HT dispatches (mode %d)",
                (int)mode);
  if ((flags & EPD_DESC_FP8) && ep->hidden % 128)
    return fail(ep->err, EPD_ERR_INVALID, "flags: EPD_DESC_FP8 needs hidden a multiple of 128 (hidden %u)",
                ep->hidden);
  epd_desc_t d;
  memset(&d, 0, sizeof d);
  d.op = mode == EPD_MODE_LL ? EPD_OP_LL_DISPATCH : EPD_OP_HT_DISPATCH;
  d.flags = flags;
  d.num_tokens = num_tokens;
  d.bank = bank;
  d.user_tag = ((uint64_t)ep->rank << 56) | ep->queue->steps_done;
  return submit(ep, &d, stream);
}

EPD_EXPORT epd_result_t epd_combine(epd_ep_t *ep, epd_mode_t mode, unsigned bank, void *stream) {
  if (!ep) return EPD_ERR_INVALID;
  epd_result_t rc = check_common(ep, mode, bank);
  if (rc) return rc;
  epd_desc_t d;
  memset(&d, 0, sizeof d);
  d.op = mode == EPD_MODE_LL ? EPD_OP_LL_COMBINE : EPD_OP_HT_COMBINE;
  d.bank = bank;
  d.user_tag = ((uint64_t)ep->rank << 56) | ep->queue->steps_done;
  return submit(ep, &d, stream);
}

EPD_EXPORT epd_result_t epd_slot_status(epd_ep_t *ep, unsigned slot, epd_comp_t *comp_out) {
  if (!ep) return EPD_ERR_INVALID;
  if (slot >= EPD_QUEUE_SLOTS)
    return fail(ep->err, EPD_ERR_INVALID, "slot %u: out of range [0, %u)", slot, EPD_QUEUE_SLOTS);
  /* Host memory on both backends, written by every completer (the twin only by the persistent kernels). */
  epd_slot_t *s = &ep->queue->slot[slot];
  atomic_thread_fence(memory_order_acquire);
  epd_comp_t c = s->comp;
  if (comp_out) *comp_out = c;
  return c.status;
}

EPD_EXPORT epd_result_t epd_op_status(epd_ep_t *ep, epd_comp_t *comp_out) {
  if (!ep) return EPD_ERR_INVALID;
  if (ep->last_slot < 0) return fail(ep->err, EPD_ERR_STATE, "no op submitted yet");
  epd_comp_t c = ep->last_comp;
  if (ep->last_async) {
    /* The queue is host memory on both backends: after the stream is synchronised the record is here. */
    epd_slot_t *s = &ep->queue->slot[ep->last_slot];
    if (ep->ksub && load_state(s) != EPD_SLOT_FREE) {
      /* the stream's wait gave up (the stream went on without the op's outputs): the ring is out of step */
      ep->stuck = 1;
      return fail(ep->err, EPD_ERR_TIMEOUT,
                  "slot %d: no completion (its stream's wait gave up after "
                  "EPD_OP_TIMEOUT_MS = %d ms, or the stream was not synchronised); detach and attach again",
                  ep->last_slot, ep->op_timeout_ms);
    }
    atomic_thread_fence(memory_order_acquire);
    c = s->comp;
    ep->last_comp = c;
  }
  if (comp_out) *comp_out = c;
  return c.status;
}
