/*
 * rpc_internal.h - what the control RPC server's files share: rpc.c (the gRPC call state machine and the
 * module), rpc_handlers.c (the methods) and rpc_conn.c (the socket and its connections, with their
 * SO_PEERCRED). Not for other modules: their interface is rpc.h.
 */
#ifndef EPD_RPC_INTERNAL_H
#define EPD_RPC_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/socket.h>

#include <grpc/grpc.h>

#include "control/rpc.h"
#include "epd.pb-c.h"
#include "epd_paths.h"
#include "health.pb-c.h"

#ifndef EPD_VERSION
#define EPD_VERSION "unknown"
#endif

#define SECRET_BYTES 32
#define CONFIG_TEXT_MAX (64 * 1024)

enum {
  M_ATTACH,
  M_DETACH,
  M_STATUS,
  M_METRICS,
  M_SETMAP,
  M_GETMAP,
  M_WATCH,
  M_DRAIN,
  M_HCHECK,
  M_HWATCH,
  M_COUNT,
  M_UNKNOWN = M_COUNT
};

/* The methods served: path, name for logs, request type; streaming; versioned (carries protocol_version). */
typedef struct rpc_method {
  const char *path, *name;
  const ProtobufCMessageDescriptor *req;
  int streaming, versioned;
} rpc_method_t;
extern const rpc_method_t rpc_methods[M_COUNT];

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
  uint64_t after;    /* Watch: last event sequence sent */
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

/* The server: one per daemon (rpc.c owns its life). */
typedef struct rpc_server {
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
  atomic_uint nctl_open;         /* control connections counted at the last accept */
  atomic_ullong ctl_refused[2];  /* refused at the cap: all uids, one uid */
} rpc_server_t;
extern rpc_server_t rpc_srv;

/* rpc_handlers.c */
uint64_t rpc_mono_ns(void);
/* Fill rep with status r (its gRPC code, the epd code) and a message. */
void rpc_reply_err(rpc_reply_t *rep, epd_result_t r, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Decode c's request (NULL with rep filled on failure). */
ProtobufCMessage *rpc_decode(rpc_call_t *c, rpc_reply_t *rep);
/* Run a unary call: rep gets the packed reply or the status. */
void rpc_handle_unary(rpc_call_t *c, rpc_reply_t *rep);
/* grpc.health.v1 status of a service name ("" or "epd.v1.Control"). */
int rpc_health_status(const char *service);

/* rpc_conn.c */
int rpc_mkdir_parents(const char *path, char *err, size_t errlen);
int rpc_clear_stale(const char *path, char *err, size_t errlen);
int rpc_apply_perms(const epd_conf_t *conf, char *err, size_t errlen);
int rpc_make_listener(char *err, size_t errlen);
int rpc_start_accept(char *err, size_t errlen);
void rpc_stop_accept(void);
/* Forget the connections counted (a server made again). */
void rpc_conn_reset(void);

#endif /* EPD_RPC_INTERNAL_H */
