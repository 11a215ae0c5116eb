/*
 * attach.c - the attach socket: clients redeem the one-time token from the Attach RPC and receive their
 * queue and arena fds with SCM_RIGHTS (client/epd_wire.h). The connection then stays open; its hang-up
 * detaches the client as lost. Tokens are issued from the RPC thread into a mutex-protected table; all
 * socket work runs on the libuv loop (uv_poll_t, non-blocking fds, sendmsg/recvmsg by hand).
 *
 * Hostile input: anyone who may open the socket can connect without a token. Every connection is
 * admitted in one place (admit): its SO_PEERCRED must pass the allow lists, and the connections that
 * have not sent their token yet are bounded in all and per uid; a connection beyond that is answered and
 * closed at once, counted by reason. Out of fds (or memory), accept fails: the listener then stops
 * polling for ACCEPT_PAUSE_MS instead of spinning on a socket that stays readable, and the error is
 * logged at most once a second with a count.
 */
#define _GNU_SOURCE
#include "control/attach.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "control/access.h"
#include "core/log.h"

#define REQUEST_TIMEOUT_MS 5000 /* a connection must send its redeem request within this */
#define SWEEP_PERIOD_MS 100
#define ACCEPT_PAUSE_MS 100  /* the listener rests this long after accept ran out of fds or memory */
#define ACCEPT_BATCH 64      /* accepts per wake-up, so that a flood cannot hold the loop */
#define LOG_INTERVAL_MS 1000 /* at most one line a second for each kind of refusal or accept error */

typedef struct token_ent {
  uint64_t client_id;
  uint8_t token[EPD_TOKEN_BYTES];
  uint32_t pid, uid;
  uint64_t expires_ns;
} token_ent_t;

enum { CONN_WAIT_REQUEST, CONN_ATTACHED };

typedef struct conn {
  uv_poll_t poll;
  int fd;
  int state;
  int closing;
  uint8_t buf[sizeof(epd_redeem_req_t)];
  size_t got;
  uint64_t client_id;
  struct ucred cred;
  uint64_t deadline_ns;
  struct conn *prev, *next;
} conn_t;

/* Token table: written by the RPC thread (issue) and the loop (redeem, sweep). */
static pthread_mutex_t tok_lock = PTHREAD_MUTEX_INITIALIZER;
static token_ent_t *toks;
static size_t ntoks;
static uint32_t tok_ttl_ms = 10000;
static int tok_open;
static size_t tok_cap; /* daemon.max_pending_tokens */

/* Loop-thread state. */
static uv_loop_t *loop;
static epd_engine_t *engine;
static uv_poll_t listen_poll;
static uv_timer_t sweep_timer;
static int listen_fd = -1;
static int running;
static char sock_path[EPD_PATH_MAX + 64];
static conn_t *conns;
static atomic_uint nconns;
static uv_timer_t resume_timer; /* restarts listen_poll after a pause */
static int paused;

/* Connections that have not sent their token yet (state CONN_WAIT_REQUEST), in all and per uid; the
 * limits are daemon.max_unredeemed_conns and max_unredeemed_per_uid. Loop thread only, except the
 * counters that status and metrics read. */
typedef struct uid_count {
  uint32_t uid, n;
} uid_count_t;
static uint32_t max_unredeemed = 256, max_per_uid = 64;
static uid_count_t *uids;
static size_t nuids, uids_cap;
static atomic_uint nunredeemed;
static atomic_ullong refused[EPD_ATTACH_REFUSED_MAX];
static atomic_ullong accept_errors;
static epd_log_ratelimit_t rl_accept = EPD_LOG_RATELIMIT_INITIALIZER(LOG_INTERVAL_MS);
static epd_log_ratelimit_t rl_cap = EPD_LOG_RATELIMIT_INITIALIZER(LOG_INTERVAL_MS);
static epd_log_ratelimit_t rl_uid = EPD_LOG_RATELIMIT_INITIALIZER(LOG_INTERVAL_MS);
static epd_log_ratelimit_t rl_conn = EPD_LOG_RATELIMIT_INITIALIZER(LOG_INTERVAL_MS);

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- token table ------------------------------------------------------------------------------- */

int epd_attach_issue_token(uint64_t client_id, uint32_t pid, uint32_t uid, uint8_t token[EPD_TOKEN_BYTES]) {
  uint8_t t[EPD_TOKEN_BYTES];
  size_t off = 0;
  while (off < sizeof t) {
    ssize_t n = getrandom(t + off, sizeof t - off, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return -1;
    off += (size_t)n;
  }
  pthread_mutex_lock(&tok_lock);
  if (!tok_open || ntoks >= tok_cap) {
    pthread_mutex_unlock(&tok_lock);
    return -1;
  }
  token_ent_t *e = &toks[ntoks++];
  e->client_id = client_id;
  memcpy(e->token, t, sizeof t);
  e->pid = pid;
  e->uid = uid;
  e->expires_ns = now_ns() + (uint64_t)tok_ttl_ms * 1000000ull;
  pthread_mutex_unlock(&tok_lock);
  memcpy(token, t, sizeof t);
  return 0;
}

unsigned epd_attach_forget_token(uint64_t client_id) {
  unsigned n = 0;
  pthread_mutex_lock(&tok_lock);
  for (size_t i = 0; i < ntoks;) {
    if (toks[i].client_id == client_id) {
      toks[i] = toks[--ntoks];
      n++;
    } else {
      i++;
    }
  }
  pthread_mutex_unlock(&tok_lock);
  return n;
}

void epd_attach_set_token_ttl(uint32_t ttl_ms) {
  pthread_mutex_lock(&tok_lock);
  tok_ttl_ms = ttl_ms;
  pthread_mutex_unlock(&tok_lock);
}

unsigned epd_attach_pending_tokens(void) {
  pthread_mutex_lock(&tok_lock);
  unsigned n = (unsigned)ntoks;
  pthread_mutex_unlock(&tok_lock);
  return n;
}

/* Find and remove the entry of (client_id, token), comparing every token in full so that the time
 * taken does not tell how many bytes matched. Returns 1 and copies the entry out if found. */
static int token_take(uint64_t client_id, const uint8_t token[EPD_TOKEN_BYTES], token_ent_t *out) {
  int found = -1;
  pthread_mutex_lock(&tok_lock);
  for (size_t i = 0; i < ntoks; i++) {
    volatile uint8_t diff = 0;
    for (size_t b = 0; b < EPD_TOKEN_BYTES; b++) diff |= (uint8_t)(toks[i].token[b] ^ token[b]);
    if (diff == 0 && toks[i].client_id == client_id && found < 0) found = (int)i;
  }
  if (found >= 0) {
    *out = toks[found];
    toks[found] = toks[--ntoks]; /* one-time: removed at redemption */
  }
  pthread_mutex_unlock(&tok_lock);
  return found >= 0;
}

/* ---- unredeemed connections ------------------------------------------------------------------ */

static uid_count_t *uid_find(uint32_t uid) {
  for (size_t i = 0; i < nuids; i++)
    if (uids[i].uid == uid) return &uids[i];
  return NULL;
}

/* Count a new unredeemed connection of uid; -1 (nothing counted) when the table cannot grow. */
static int unredeemed_add(uint32_t uid) {
  uid_count_t *u = uid_find(uid);
  if (!u) {
    if (nuids == uids_cap) {
      size_t ncap = uids_cap ? uids_cap * 2 : 16;
      uid_count_t *nu = realloc(uids, ncap * sizeof *nu);
      if (!nu) return -1;
      uids = nu;
      uids_cap = ncap;
    }
    u = &uids[nuids++];
    u->uid = uid;
    u->n = 0;
  }
  u->n++;
  atomic_fetch_add(&nunredeemed, 1);
  return 0;
}

static void unredeemed_drop(uint32_t uid) {
  uid_count_t *u = uid_find(uid);
  if (!u) return;
  atomic_fetch_sub(&nunredeemed, 1);
  if (--u->n == 0) *u = uids[--nuids];
}

/* ---- connections ------------------------------------------------------------------------------- */

static void conn_closed(uv_handle_t *h) {
  conn_t *c = h->data;
  close(c->fd);
  free(c);
}

static void conn_close(conn_t *c) {
  if (c->closing) return;
  c->closing = 1;
  if (c->prev)
    c->prev->next = c->next;
  else
    conns = c->next;
  if (c->next) c->next->prev = c->prev;
  atomic_fetch_sub(&nconns, 1);
  if (c->state == CONN_WAIT_REQUEST) unredeemed_drop(c->cred.uid);
  uv_poll_stop(&c->poll);
  uv_close((uv_handle_t *)&c->poll, conn_closed);
}

/* Send a reply, with the two fds when queue_fd >= 0; 0 or -errno. */
static int send_reply(int fd, int32_t status, int queue_fd, int arena_fd, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int send_reply(int fd, int32_t status, int queue_fd, int arena_fd, const char *fmt, ...) {
  epd_redeem_rep_t rep;
  memset(&rep, 0, sizeof rep);
  rep.magic = EPD_WIRE_MAGIC;
  rep.version = EPD_WIRE_VERSION;
  rep.status = status;
  rep.nfds = queue_fd >= 0 ? 2 : 0;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(rep.message, sizeof rep.message, fmt, ap);
  va_end(ap);
  struct iovec iov = {&rep, sizeof rep};
  union {
    char buf[CMSG_SPACE(2 * sizeof(int))];
    struct cmsghdr align;
  } ctl;
  struct msghdr msg;
  memset(&msg, 0, sizeof msg);
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (queue_fd >= 0) {
    memset(&ctl, 0, sizeof ctl);
    msg.msg_control = ctl.buf;
    msg.msg_controllen = sizeof ctl.buf;
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(2 * sizeof(int));
    int fds[2] = {queue_fd, arena_fd};
    memcpy(CMSG_DATA(cm), fds, sizeof fds);
  }
  /* A fresh socket has room for one 256-byte reply; EAGAIN here means a peer that does not read. */
  ssize_t n;
  do n = sendmsg(fd, &msg, MSG_NOSIGNAL);
  while (n < 0 && errno == EINTR);
  if (n < 0) return -errno;
  return n == (ssize_t)sizeof rep ? 0 : -EIO;
}

static void redeem(conn_t *c) {
  epd_redeem_req_t req;
  token_ent_t ent;
  memcpy(&req, c->buf, sizeof req);
  if (req.magic != EPD_WIRE_MAGIC || req.version != EPD_WIRE_VERSION) {
    EPD_LOGW(EPD_SUB_ATTACH, "attach socket: bad request from pid %d (magic 0x%08x, version %u)",
             (int)c->cred.pid, req.magic, req.version);
    send_reply(c->fd, EPD_ERR_PROTOCOL, -1, -1,
               "bad request: magic 0x%08x version %u (expected magic 0x%08x version %u)", req.magic,
               req.version, EPD_WIRE_MAGIC, EPD_WIRE_VERSION);
    conn_close(c);
    return;
  }
  if (!token_take(req.client_id, req.token, &ent)) {
    EPD_LOGW(EPD_SUB_ATTACH,
             "attach socket: pid %d uid %u presented an unknown or expired token for client %llu",
             (int)c->cred.pid, (unsigned)c->cred.uid, (unsigned long long)req.client_id);
    send_reply(c->fd, EPD_ERR_PERMISSION, -1, -1, "unknown or expired attach token");
    conn_close(c);
    return;
  }
  if (ent.expires_ns <= now_ns()) {
    send_reply(c->fd, EPD_ERR_PERMISSION, -1, -1, "unknown or expired attach token");
    conn_close(c);
    epd_log_msg(EPD_LOG_WARN, EPD_SUB_ATTACH, -1, ent.client_id,
                "attach token expired before redemption: detaching");
    epd_engine_detach(engine, ent.client_id, 1);
    return;
  }
  /* The token is spent either way: a process other than the one that attached must not get the fds,
   * and the attachment it was for is given up. */
  if ((ent.pid && ent.pid != (uint32_t)c->cred.pid) || (ent.uid && ent.uid != (uint32_t)c->cred.uid)) {
    epd_log_msg(EPD_LOG_WARN, EPD_SUB_ATTACH, -1, ent.client_id,
                "attach token presented by pid %d uid %u, issued to pid %u uid %u: refused, detaching",
                (int)c->cred.pid, (unsigned)c->cred.uid, ent.pid, ent.uid);
    send_reply(c->fd, EPD_ERR_PERMISSION, -1, -1, "token was issued to pid %u uid %u, not to pid %d uid %u",
               ent.pid, ent.uid, (int)c->cred.pid, (unsigned)c->cred.uid);
    conn_close(c);
    epd_engine_detach(engine, ent.client_id, 1);
    return;
  }
  int qfd = -1, afd = -1;
  epd_result_t r = epd_engine_client_fds(engine, ent.client_id, &qfd, &afd);
  if (r != EPD_OK || qfd < 0 || afd < 0) {
    send_reply(c->fd, r != EPD_OK ? r : EPD_ERR_INTERNAL, -1, -1, "client %llu has no attachment (error %d)",
               (unsigned long long)ent.client_id, (int)r);
    conn_close(c);
    return;
  }
  int rc = send_reply(c->fd, EPD_OK, qfd, afd, "ok");
  if (rc != 0) {
    epd_log_msg(EPD_LOG_WARN, EPD_SUB_ATTACH, -1, ent.client_id, "attach reply failed: %s; detaching",
                strerror(-rc));
    conn_close(c);
    epd_engine_detach(engine, ent.client_id, 1);
    return;
  }
  unredeemed_drop(c->cred.uid);
  c->state = CONN_ATTACHED;
  c->client_id = ent.client_id;
  epd_log_msg(EPD_LOG_DEBUG, EPD_SUB_ATTACH, -1, ent.client_id, "fds handed to pid %d uid %u",
              (int)c->cred.pid, (unsigned)c->cred.uid);
}

static void conn_event(uv_poll_t *p, int status, int events) {
  conn_t *c = p->data;
  if (c->closing) return;
  if (c->state == CONN_WAIT_REQUEST) {
    while (c->got < sizeof c->buf) {
      ssize_t n = recv(c->fd, c->buf + c->got, sizeof c->buf - c->got, 0);
      if (n > 0) {
        c->got += (size_t)n;
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) break;
      /* EOF or error before a whole request: nothing was handed out, just drop the connection. */
      if (c->got)
        EPD_LOGW(EPD_SUB_ATTACH, "attach socket: pid %d hung up after %zu of %zu request bytes",
                 (int)c->cred.pid, c->got, sizeof c->buf);
      conn_close(c);
      return;
    }
    if (c->got == sizeof c->buf) {
      redeem(c);
      return;
    }
    if (status < 0 || (events & UV_DISCONNECT)) conn_close(c);
    return;
  }
  /* Attached: the client sends nothing more; readable means hang-up (or stray bytes, ignored). */
  char scratch[256];
  for (;;) {
    ssize_t n = recv(c->fd, scratch, sizeof scratch, 0);
    if (n > 0) continue;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN && status == 0 && !(events & UV_DISCONNECT)) return;
    break;
  }
  uint64_t id = c->client_id;
  epd_log_msg(EPD_LOG_DEBUG, EPD_SUB_ATTACH, -1, id, "attach connection closed by pid %d: detaching",
              (int)c->cred.pid);
  conn_close(c);
  /* NOT_FOUND here is normal: the client detached through the RPC before closing its socket. */
  epd_engine_detach(engine, id, 1);
}

/* Answer and close a connection refused at accept, counted under reason. */
static void refuse(int fd, int reason, int32_t status, const char *text) {
  atomic_fetch_add(&refused[reason], 1);
  send_reply(fd, status, -1, -1, "%s", text);
  close(fd);
}

/* Admit an accepted connection or close it at once: the one place where a new attach connection's
 * credentials and the bounds on unredeemed connections are checked. */
static void admit(int fd) {
  struct ucred cred;
  socklen_t cl = sizeof cred;
  char text[200];
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0) {
    epd_log_ratelimited(&rl_conn, EPD_LOG_WARN, EPD_SUB_ATTACH, "attach socket: no peer credentials: %s",
                        strerror(errno));
    refuse(fd, EPD_ATTACH_REFUSED_PEER, EPD_ERR_PERMISSION, "peer credentials unknown");
    return;
  }
  /* epd_access_allowed logs the refusal (rate-limited) with pid, uid and gid. */
  if (!epd_access_allowed("attach", cred.pid, cred.uid, cred.gid)) {
    snprintf(text, sizeof text, "uid %u gid %u is not allowed on this daemon (daemon.allow_uids/allow_gids)",
             (unsigned)cred.uid, (unsigned)cred.gid);
    refuse(fd, EPD_ATTACH_REFUSED_PEER, EPD_ERR_PERMISSION, text);
    return;
  }
  /* The uid's own bound first: when both are reached, it is the one this peer ran into. */
  const uid_count_t *u = uid_find(cred.uid);
  if (u && u->n >= max_per_uid) {
    epd_log_ratelimited(&rl_uid, EPD_LOG_WARN, EPD_SUB_ATTACH,
                        "attach socket: refused a connection from pid %d uid %u: %u connections of that uid "
                        "have sent no token yet (daemon.max_unredeemed_per_uid)",
                        (int)cred.pid, (unsigned)cred.uid, u->n);
    snprintf(text, sizeof text,
             "uid %u has %u attach connections without a token (daemon.max_unredeemed_per_uid)",
             (unsigned)cred.uid, u->n);
    refuse(fd, EPD_ATTACH_REFUSED_UID, EPD_ERR_BUSY, text);
    return;
  }
  unsigned all = atomic_load(&nunredeemed);
  if (all >= max_unredeemed) {
    epd_log_ratelimited(&rl_cap, EPD_LOG_WARN, EPD_SUB_ATTACH,
                        "attach socket: refused a connection from pid %d uid %u: %u connections have sent no "
                        "token yet (daemon.max_unredeemed_conns)",
                        (int)cred.pid, (unsigned)cred.uid, all);
    snprintf(text, sizeof text, "%u attach connections without a token (daemon.max_unredeemed_conns)", all);
    refuse(fd, EPD_ATTACH_REFUSED_CAP, EPD_ERR_BUSY, text);
    return;
  }
  if (unredeemed_add(cred.uid) != 0) {
    epd_log_ratelimited(&rl_conn, EPD_LOG_WARN, EPD_SUB_ATTACH,
                        "attach socket: cannot take a connection: out of memory");
    close(fd);
    return;
  }
  conn_t *c = calloc(1, sizeof *c);
  int rc = c ? uv_poll_init(loop, &c->poll, fd) : UV_ENOMEM;
  if (rc != 0) {
    unredeemed_drop(cred.uid);
    epd_log_ratelimited(&rl_conn, EPD_LOG_WARN, EPD_SUB_ATTACH, "attach socket: cannot take a connection: %s",
                        uv_strerror(rc));
    free(c);
    close(fd);
    return;
  }
  c->fd = fd;
  c->cred = cred;
  c->poll.data = c;
  c->deadline_ns = now_ns() + REQUEST_TIMEOUT_MS * 1000000ull;
  c->next = conns;
  if (conns) conns->prev = c;
  conns = c;
  atomic_fetch_add(&nconns, 1);
  uv_poll_start(&c->poll, UV_READABLE | UV_DISCONNECT, conn_event);
  EPD_LOGD(EPD_SUB_ATTACH, "attach connection from pid %d uid %u", (int)c->cred.pid, (unsigned)c->cred.uid);
}

static void listen_event(uv_poll_t *p, int status, int events);

static void listen_resume(uv_timer_t *t) {
  (void)t;
  if (!paused || !running) return;
  paused = 0;
  uv_poll_start(&listen_poll, UV_READABLE, listen_event);
}

/* Stop polling the listening socket for ACCEPT_PAUSE_MS: it stays readable while connections wait in
 * the backlog, so polling it without fds to accept them would spin. */
static void listen_pause(void) {
  if (paused) return;
  paused = 1;
  uv_poll_stop(&listen_poll);
  uv_timer_start(&resume_timer, listen_resume, ACCEPT_PAUSE_MS, 0);
}

static void listen_event(uv_poll_t *p, int status, int events) {
  (void)p;
  (void)events;
  if (status < 0) {
    epd_log_ratelimited(&rl_accept, EPD_LOG_ERROR, EPD_SUB_ATTACH, "attach socket poll error: %s",
                        uv_strerror(status));
    listen_pause();
    return;
  }
  for (int i = 0; i < ACCEPT_BATCH; i++) {
    int fd = accept4(listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      int e = errno;
      if (e == EINTR || e == ECONNABORTED) continue;
      if (e == EAGAIN) return;
      /* EMFILE, ENFILE, ENOBUFS, ENOMEM: resources run out and the backlog waits until some come back;
       * anything else would as likely repeat at once. Either way: rest, and say so once a second. */
      atomic_fetch_add(&accept_errors, 1);
      epd_log_ratelimited(&rl_accept, EPD_LOG_WARN, EPD_SUB_ATTACH, "attach socket accept: %s; pausing %d ms",
                          strerror(e), ACCEPT_PAUSE_MS);
      listen_pause();
      return;
    }
    admit(fd);
  }
}

/* Detach the clients of expired, unredeemed tokens, and drop connections that never sent a request. */
static void sweep(uv_timer_t *t) {
  (void)t;
  uint64_t now = now_ns();
  uint64_t expired[64];
  size_t nexp;
  do {
    nexp = 0;
    pthread_mutex_lock(&tok_lock);
    for (size_t i = 0; i < ntoks && nexp < sizeof expired / sizeof expired[0];) {
      if (toks[i].expires_ns <= now) {
        expired[nexp++] = toks[i].client_id;
        toks[i] = toks[--ntoks];
      } else {
        i++;
      }
    }
    pthread_mutex_unlock(&tok_lock);
    for (size_t i = 0; i < nexp; i++) {
      epd_log_msg(EPD_LOG_WARN, EPD_SUB_ATTACH, -1, expired[i], "attach token expired unredeemed: detaching");
      epd_engine_detach(engine, expired[i], 1);
    }
  } while (nexp == sizeof expired / sizeof expired[0]);
  for (conn_t *c = conns, *next; c; c = next) {
    next = c->next;
    if (c->state == CONN_WAIT_REQUEST && c->deadline_ns <= now) {
      send_reply(c->fd, EPD_ERR_TIMEOUT, -1, -1, "no redeem request within %d ms", REQUEST_TIMEOUT_MS);
      conn_close(c);
    } else if (c->state == CONN_ATTACHED) {
      /* The engine let go of this client (replaced after it hung): hang up, so that its process sees
       * EPD_ERR_CLOSED at its next wait instead of waiting out its own timeout. */
      int qfd, afd;
      if (epd_engine_client_fds(engine, c->client_id, &qfd, &afd) == EPD_ERR_NOT_FOUND) {
        epd_log_msg(EPD_LOG_INFO, EPD_SUB_ATTACH, -1, c->client_id,
                    "attachment gone from the engine: hanging up");
        conn_close(c);
      }
    }
  }
}

/* ---- init / fini ------------------------------------------------------------------------------- */

static int make_listener(const epd_conf_t *conf, char *err, size_t errlen) {
  struct sockaddr_un sa;
  struct stat st;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  if (strlen(sock_path) >= sizeof sa.sun_path) {
    snprintf(err, errlen, "attach socket path '%s' is longer than %zu bytes", sock_path,
             sizeof sa.sun_path - 1);
    return -1;
  }
  memcpy(sa.sun_path, sock_path, strlen(sock_path) + 1);
  /* The directory: systemd's RuntimeDirectory= makes /run/epd; elsewhere make it (owner and group). */
  char dir[sizeof sock_path];
  snprintf(dir, sizeof dir, "%s", sock_path);
  char *slash = strrchr(dir, '/');
  if (slash && slash != dir) {
    *slash = '\0';
    if (mkdir(dir, 0750) != 0 && errno != EEXIST) {
      snprintf(err, errlen, "cannot create directory '%s' for the attach socket: %s", dir, strerror(errno));
      return -1;
    }
  }
  listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (listen_fd < 0) {
    snprintf(err, errlen, "attach socket: %s", strerror(errno));
    return -1;
  }
  if (lstat(sock_path, &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      snprintf(err, errlen, "attach socket path '%s' exists and is not a socket", sock_path);
      return -1;
    }
    /* A socket nobody listens on is left over from a crash; one that answers belongs to a live daemon. */
    int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int live = probe >= 0 && connect(probe, (struct sockaddr *)&sa, sizeof sa) == 0;
    if (probe >= 0) close(probe);
    if (live) {
      snprintf(err, errlen, "attach socket '%s' is in use by another running daemon", sock_path);
      return -1;
    }
    unlink(sock_path);
  }
  if (bind(listen_fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    snprintf(err, errlen, "cannot bind attach socket '%s': %s", sock_path, strerror(errno));
    return -1;
  }
  if (chmod(sock_path, conf->socket_mode) != 0) {
    snprintf(err, errlen, "chmod %04o '%s': %s", conf->socket_mode, sock_path, strerror(errno));
    return -1;
  }
  if (conf->socket_group[0]) {
    struct group gr, *res = NULL;
    char gbuf[4096];
    if (getgrnam_r(conf->socket_group, &gr, gbuf, sizeof gbuf, &res) != 0 || !res) {
      snprintf(err, errlen, "daemon.socket_group: unknown group '%s'", conf->socket_group);
      return -1;
    }
    if (chown(sock_path, (uid_t)-1, res->gr_gid) != 0) {
      snprintf(err, errlen, "chown :%s '%s': %s", conf->socket_group, sock_path, strerror(errno));
      return -1;
    }
  }
  if (listen(listen_fd, 128) != 0) {
    snprintf(err, errlen, "listen on attach socket '%s': %s", sock_path, strerror(errno));
    return -1;
  }
  return 0;
}

int epd_attach_init(uv_loop_t *lp, const epd_conf_t *conf, epd_engine_t *eng, char *err, size_t errlen) {
  int rc;
  loop = lp;
  engine = eng;
  if (epd_conf_attach_socket_path(conf, sock_path, sizeof sock_path) != 0) {
    snprintf(err, errlen, "daemon.attach_socket: path too long");
    return -1;
  }
  if (make_listener(conf, err, errlen) != 0) goto fail;
  pthread_mutex_lock(&tok_lock);
  tok_cap = conf->max_pending_tokens ? conf->max_pending_tokens : 4096;
  toks = calloc(tok_cap, sizeof *toks);
  ntoks = 0;
  tok_ttl_ms = conf->token_ttl_ms;
  tok_open = toks != NULL;
  pthread_mutex_unlock(&tok_lock);
  if (!toks) {
    snprintf(err, errlen, "attach: out of memory");
    goto fail;
  }
  if ((rc = uv_poll_init(loop, &listen_poll, listen_fd)) != 0 ||
      (rc = uv_poll_start(&listen_poll, UV_READABLE, listen_event)) != 0) {
    snprintf(err, errlen, "attach socket poll: %s", uv_strerror(rc));
    goto fail;
  }
  uv_timer_init(loop, &sweep_timer);
  uv_timer_start(&sweep_timer, sweep, SWEEP_PERIOD_MS, SWEEP_PERIOD_MS);
  uv_timer_init(loop, &resume_timer);
  paused = 0;
  running = 1;
  epd_attach_set_limits(conf->max_unredeemed_conns, conf->max_unredeemed_per_uid);
  EPD_LOGI(EPD_SUB_ATTACH, "attach socket %s (mode %04o)", sock_path, conf->socket_mode);
  return 0;
fail:
  if (listen_fd >= 0) {
    close(listen_fd);
    listen_fd = -1;
  }
  pthread_mutex_lock(&tok_lock);
  tok_open = 0;
  free(toks);
  toks = NULL;
  pthread_mutex_unlock(&tok_lock);
  return -1;
}

void epd_attach_fini(void) {
  if (!running) return;
  running = 0;
  pthread_mutex_lock(&tok_lock);
  tok_open = 0;
  free(toks);
  toks = NULL;
  ntoks = 0;
  pthread_mutex_unlock(&tok_lock);
  while (conns) conn_close(conns);
  uv_timer_stop(&sweep_timer);
  uv_close((uv_handle_t *)&sweep_timer, NULL);
  uv_timer_stop(&resume_timer);
  uv_close((uv_handle_t *)&resume_timer, NULL);
  paused = 0;
  free(uids);
  uids = NULL;
  nuids = uids_cap = 0;
  uv_poll_stop(&listen_poll);
  uv_close((uv_handle_t *)&listen_poll, NULL);
  /* The listening fd is closed now (not in a close callback): uv_poll_stop already removed it from
   * the loop's poll set, and the path is unlinked so no new client can connect. */
  close(listen_fd);
  listen_fd = -1;
  unlink(sock_path);
}

const char *epd_attach_path(void) {
  return sock_path;
}

unsigned epd_attach_connections(void) {
  return atomic_load(&nconns);
}

void epd_attach_set_limits(uint32_t total, uint32_t per_uid) {
  max_unredeemed = total ? total : 1;
  max_per_uid = per_uid ? per_uid : 1;
  /* A bound near the open-file limit does not protect the fds that clients and the control socket need. */
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
      (rlim_t)max_unredeemed + 64 > rl.rlim_cur)
    EPD_LOGW(EPD_SUB_ATTACH,
             "daemon.max_unredeemed_conns %u is close to the open-file limit %llu: idle attach "
             "connections can use up the daemon's fds (lower it or raise LimitNOFILE=)",
             max_unredeemed, (unsigned long long)rl.rlim_cur);
}

void epd_attach_stats(epd_attach_stats_t *out) {
  memset(out, 0, sizeof *out);
  out->unredeemed = atomic_load(&nunredeemed);
  for (int i = 0; i < EPD_ATTACH_REFUSED_MAX; i++) out->refused[i] = atomic_load(&refused[i]);
  out->accept_errors = atomic_load(&accept_errors);
}
