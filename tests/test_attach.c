/* test_attach.c - the attach socket in-process: a host-backend engine, the attach module on a libuv
 * loop pumped by the test, and a client thread that redeems tokens over the real socket. */
#define _GNU_SOURCE
#include <pthread.h>
#include <errno.h>
#include <stdatomic.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "control/access.h"
#include "control/attach.h"
#include "control/conf.h"
#include "core/engine.h"
#include "core/log.h"
#include "test.h"

static uv_loop_t tloop;
static epd_engine_t *teng;

static double mono_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Run the loop for ms milliseconds. */
static void pump(int ms) {
  double end = mono_s() + ms / 1000.0;
  while (mono_s() < end) {
    uv_run(&tloop, UV_RUN_NOWAIT);
    usleep(1000);
  }
}

static void setup(void) {
  epd_conf_t c;
  char err[256];
  epd_log_init(EPD_LOG_DEBUG, EPD_SUB_ALL, 0);
  epd_conf_defaults(&c);
  snprintf(c.control_socket, sizeof c.control_socket, "%s/run/control.sock", epd_test_tmpdir());
  epd_engine_opts_t o = {0};
  o.backend = "host";
  o.num_ranks = 2;
  o.max_experts = 64;
  o.max_hidden = 1024;
  o.max_topk = 8;
  o.max_tokens = 16;
  o.slots_factor_pct = 100;
  o.max_groups = 4;
  o.max_clients_per_rank = 4;
  o.max_arena_bytes = 1ull << 30;
  o.step_timeout_ms = 2000;
  if (epd_engine_create(&o, NULL, NULL, &teng, err, sizeof err) != EPD_OK)
    epd_test_fail(__FILE__, __LINE__, "engine: %s", err);
  ASSERT_OK(uv_loop_init(&tloop));
  if (epd_attach_init(&tloop, &c, teng, err, sizeof err) != 0)
    epd_test_fail(__FILE__, __LINE__, "attach init: %s", err);
  char want[600];
  snprintf(want, sizeof want, "%s/run/attach.sock", epd_test_tmpdir());
  ASSERT(strcmp(epd_attach_path(), want) == 0);
}

static uint64_t attach_client(int rank) {
  epd_attach_req_t r;
  epd_attach_info_t info;
  char err[256];
  memset(&r, 0, sizeof r);
  snprintf(r.group, sizeof r.group, "g");
  snprintf(r.name, sizeof r.name, "t%d", rank);
  r.rank = rank;
  r.num_experts = 8;
  r.hidden = 128;
  r.topk = 2;
  r.max_tokens = 8;
  r.pid = (uint32_t)getpid();
  r.uid = (uint32_t)getuid();
  if (epd_engine_attach(teng, &r, &info, err, sizeof err) != EPD_OK)
    epd_test_fail(__FILE__, __LINE__, "engine attach: %s", err);
  return info.client_id;
}

static unsigned engine_clients(void) {
  epd_engine_snap_t s;
  ASSERT_EQ(epd_engine_snapshot(teng, &s), EPD_OK);
  unsigned n = s.nclients;
  epd_engine_snapshot_free(&s);
  return n;
}

/* The client side, run on a thread while the test pumps the loop. */
typedef struct job {
  epd_redeem_req_t req;
  size_t send_bytes; /* bytes of req to send (short requests) */
  int keep_open;     /* leave the socket open and return it in fd */
  int fd;
  epd_redeem_rep_t rep;
  int got_reply, nfds, fds[2];
  atomic_int done;
} job_t;

static void *client_thread(void *arg) {
  job_t *j = arg;
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", epd_attach_path());
  j->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct timeval tv = {5, 0};
  setsockopt(j->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (connect(j->fd, (struct sockaddr *)&sa, sizeof sa) == 0 &&
      send(j->fd, &j->req, j->send_bytes, MSG_NOSIGNAL) == (ssize_t)j->send_bytes) {
    union {
      char b[CMSG_SPACE(2 * sizeof(int))];
      struct cmsghdr a;
    } ctl;
    struct iovec iov = {&j->rep, sizeof j->rep};
    struct msghdr m = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b, .msg_controllen = sizeof ctl.b};
    ssize_t n = recvmsg(j->fd, &m, MSG_WAITALL | MSG_CMSG_CLOEXEC);
    j->got_reply = n == (ssize_t)sizeof j->rep;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&m); cm; cm = CMSG_NXTHDR(&m, cm))
      if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
        j->nfds = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        memcpy(j->fds, CMSG_DATA(cm), sizeof(int) * (j->nfds > 2 ? 2 : j->nfds));
      }
  }
  if (!j->keep_open) {
    close(j->fd);
    j->fd = -1;
  }
  atomic_store(&j->done, 1);
  return NULL;
}

static void run_job(job_t *j) {
  pthread_t th;
  ASSERT_OK(pthread_create(&th, NULL, client_thread, j));
  double end = mono_s() + 10;
  while (!atomic_load(&j->done) && mono_s() < end) pump(1);
  ASSERT(atomic_load(&j->done));
  pthread_join(th, NULL);
}

static job_t *make_job(uint64_t id, const uint8_t *token) {
  job_t *j = calloc(1, sizeof *j);
  j->req.magic = EPD_WIRE_MAGIC;
  j->req.version = EPD_WIRE_VERSION;
  j->req.client_id = id;
  memcpy(j->req.token, token, EPD_TOKEN_BYTES);
  j->send_bytes = sizeof j->req;
  j->fd = -1;
  return j;
}

EPD_TEST(attach_redeem_once_and_hangup_detaches) {
  setup();
  struct stat st;
  ASSERT_OK(stat(epd_attach_path(), &st));
  ASSERT(S_ISSOCK(st.st_mode));
  ASSERT_EQ(st.st_mode & 0777, 0660);
  uint64_t id = attach_client(0);
  uint8_t tok[EPD_TOKEN_BYTES];
  ASSERT_OK(epd_attach_issue_token(id, (uint32_t)getpid(), (uint32_t)getuid(), tok));
  ASSERT_EQ(epd_attach_pending_tokens(), 1);
  job_t *j = make_job(id, tok);
  j->keep_open = 1;
  run_job(j);
  ASSERT(j->got_reply);
  ASSERT_EQ(j->rep.magic, EPD_WIRE_MAGIC);
  ASSERT_EQ(j->rep.status, EPD_OK);
  ASSERT_EQ(j->rep.nfds, 2);
  ASSERT_EQ(j->nfds, 2);
  struct stat q, a;
  ASSERT_OK(fstat(j->fds[0], &q));
  ASSERT_OK(fstat(j->fds[1], &a));
  ASSERT_GT(q.st_size, 0);
  ASSERT_GT(a.st_size, 0);
  ASSERT_EQ(epd_attach_pending_tokens(), 0);
  ASSERT_EQ(epd_attach_connections(), 1);
  /* The same token again: one-time. */
  job_t *j2 = make_job(id, tok);
  run_job(j2);
  ASSERT(j2->got_reply);
  ASSERT_EQ(j2->rep.status, EPD_ERR_PERMISSION);
  ASSERT_STR_CONTAINS(j2->rep.message, "unknown or expired attach token");
  ASSERT_EQ(j2->nfds, 0);
  pump(20);
  ASSERT_EQ(epd_attach_connections(), 1);
  ASSERT_EQ(engine_clients(), 1);
  /* Closing the kept connection is the client's death: detached. */
  close(j->fd);
  double end = mono_s() + 5;
  while (engine_clients() != 0 && mono_s() < end) pump(5);
  ASSERT_EQ(engine_clients(), 0);
  ASSERT_EQ(epd_attach_connections(), 0);
  epd_attach_fini();
  pump(5);
  ASSERT(access(epd_attach_path(), F_OK) != 0); /* unlinked */
  epd_engine_destroy(teng);
}

EPD_TEST(attach_wrong_token_keeps_the_right_one) {
  setup();
  uint64_t id = attach_client(1);
  uint8_t tok[EPD_TOKEN_BYTES], bad[EPD_TOKEN_BYTES];
  ASSERT_OK(epd_attach_issue_token(id, 0, 0, tok));
  memcpy(bad, tok, sizeof bad);
  bad[EPD_TOKEN_BYTES - 1] ^= 1;
  job_t *j = make_job(id, bad);
  run_job(j);
  ASSERT_EQ(j->rep.status, EPD_ERR_PERMISSION);
  ASSERT_STR_CONTAINS(j->rep.message, "unknown or expired attach token");
  /* Right token, wrong client id. */
  j = make_job(id + 1000, tok);
  run_job(j);
  ASSERT_EQ(j->rep.status, EPD_ERR_PERMISSION);
  j = make_job(id, tok);
  run_job(j);
  ASSERT_EQ(j->rep.status, EPD_OK);
  ASSERT_EQ(j->nfds, 2);
  epd_attach_fini();
  pump(5);
  epd_engine_destroy(teng);
}

EPD_TEST(attach_malformed_requests) {
  setup();
  uint64_t id = attach_client(0);
  uint8_t tok[EPD_TOKEN_BYTES];
  ASSERT_OK(epd_attach_issue_token(id, 0, 0, tok));
  job_t *j = make_job(id, tok);
  j->req.magic = 0xdeadbeef;
  run_job(j);
  ASSERT(j->got_reply);
  ASSERT_EQ(j->rep.status, EPD_ERR_PROTOCOL);
  ASSERT_STR_CONTAINS(j->rep.message, "bad request");
  j = make_job(id, tok);
  j->req.version = 99;
  run_job(j);
  ASSERT_EQ(j->rep.status, EPD_ERR_PROTOCOL);
  /* A short request then hang-up: no reply, nothing breaks. */
  j = make_job(id, tok);
  j->send_bytes = 10;
  j->keep_open = 1;
  pthread_t th;
  ASSERT_OK(pthread_create(&th, NULL, client_thread, j));
  /* The client thread waits for a reply that never comes; closing its socket from here ends it. */
  pump(50);
  shutdown(j->fd, SHUT_RDWR);
  double end = mono_s() + 10;
  while (!atomic_load(&j->done) && mono_s() < end) pump(1);
  pthread_join(th, NULL);
  ASSERT(!j->got_reply);
  close(j->fd);
  pump(50);
  ASSERT_EQ(epd_attach_connections(), 0);
  /* The token is still good after all that. */
  j = make_job(id, tok);
  run_job(j);
  ASSERT_EQ(j->rep.status, EPD_OK);
  epd_attach_fini();
  pump(5);
  epd_engine_destroy(teng);
}

EPD_TEST(attach_peer_credentials_checked) {
  setup();
  uint64_t id = attach_client(0);
  uint8_t tok[EPD_TOKEN_BYTES];
  ASSERT_OK(epd_attach_issue_token(id, (uint32_t)getpid() + 1, 0, tok));
  job_t *j = make_job(id, tok);
  run_job(j);
  ASSERT_EQ(j->rep.status, EPD_ERR_PERMISSION);
  ASSERT_STR_CONTAINS(j->rep.message, "token was issued to pid");
  ASSERT_EQ(j->nfds, 0);
  ASSERT_EQ(engine_clients(), 0); /* the attachment is given up */
  id = attach_client(0);
  ASSERT_OK(epd_attach_issue_token(id, 0, (uint32_t)getuid() + 1, tok));
  j = make_job(id, tok);
  run_job(j);
  ASSERT_EQ(j->rep.status, EPD_ERR_PERMISSION);
  epd_attach_fini();
  pump(5);
  epd_engine_destroy(teng);
}

EPD_TEST(attach_expired_token_detaches) {
  setup();
  epd_attach_set_token_ttl(100);
  uint64_t id = attach_client(0);
  uint8_t tok[EPD_TOKEN_BYTES];
  ASSERT_OK(epd_attach_issue_token(id, 0, 0, tok));
  ASSERT_EQ(engine_clients(), 1);
  double end = mono_s() + 5;
  while ((engine_clients() != 0 || epd_attach_pending_tokens() != 0) && mono_s() < end) pump(10);
  ASSERT_EQ(epd_attach_pending_tokens(), 0);
  ASSERT_EQ(engine_clients(), 0);
  job_t *j = make_job(id, tok);
  run_job(j);
  ASSERT_EQ(j->rep.status, EPD_ERR_PERMISSION);
  ASSERT_STR_CONTAINS(j->rep.message, "unknown or expired attach token");
  epd_attach_fini();
  pump(5);
  /* After fini no token can be issued. */
  ASSERT_EQ(epd_attach_issue_token(id, 0, 0, tok), -1);
  epd_engine_destroy(teng);
}

/* A client detached before redeeming (libepd failed after Attach) leaves no pending token. */
EPD_TEST(attach_forget_token_of_a_detached_client) {
  setup();
  uint64_t id = attach_client(0), other = attach_client(1);
  uint8_t tok[EPD_TOKEN_BYTES], tok2[EPD_TOKEN_BYTES];
  ASSERT_OK(epd_attach_issue_token(id, 0, 0, tok));
  ASSERT_OK(epd_attach_issue_token(other, 0, 0, tok2));
  ASSERT_EQ(epd_attach_pending_tokens(), 2);
  ASSERT_EQ(epd_attach_forget_token(id), 1);
  ASSERT_EQ(epd_attach_forget_token(id), 0);
  ASSERT_EQ(epd_attach_pending_tokens(), 1);
  /* the forgotten token no longer redeems; the other client's still does */
  job_t *j = make_job(id, tok);
  run_job(j);
  ASSERT_EQ(j->rep.status, EPD_ERR_PERMISSION);
  job_t *j2 = make_job(other, tok2);
  run_job(j2);
  ASSERT_EQ(j2->rep.status, 0);
  ASSERT_EQ(epd_attach_pending_tokens(), 0);
  epd_attach_fini();
  pump(5);
  epd_engine_destroy(teng);
}

EPD_TEST(attach_refuses_a_live_socket) {
  setup();
  epd_conf_t c;
  char err[256] = "";
  uv_loop_t l2;
  epd_conf_defaults(&c);
  snprintf(c.control_socket, sizeof c.control_socket, "%s/run/control.sock", epd_test_tmpdir());
  ASSERT_OK(uv_loop_init(&l2));
  /* A second instance in the same process shares the module's state, so only probe via a fresh
   * listener: fini the first, re-init, and check a stale socket file is replaced. */
  epd_attach_fini();
  pump(5);
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", epd_attach_path());
  ASSERT_OK(bind(fd, (struct sockaddr *)&sa, sizeof sa));
  ASSERT_OK(listen(fd, 1));
  ASSERT_EQ(epd_attach_init(&l2, &c, teng, err, sizeof err), -1);
  ASSERT_STR_CONTAINS(err, "in use by another running daemon");
  close(fd); /* now stale: the file stays, nobody listens */
  ASSERT_OK(epd_attach_init(&l2, &c, teng, err, sizeof err));
  epd_attach_fini();
  uv_run(&l2, UV_RUN_NOWAIT);
  epd_engine_destroy(teng);
}

/* A connection to the attach socket that sends nothing (the loop accepts it at the next pump). */
static int idle_conn(void) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", epd_attach_path());
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT(fd >= 0);
  ASSERT_OK(connect(fd, (struct sockaddr *)&sa, sizeof sa));
  return fd;
}

/* The reply to a refused connection: its status, and the message in msg. */
static int refusal(int fd, char *msg, size_t len) {
  epd_redeem_rep_t rep;
  struct timeval tv = {2, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ASSERT_EQ(recv(fd, &rep, sizeof rep, MSG_WAITALL), (long)sizeof rep);
  ASSERT_EQ(recv(fd, &rep, 1, 0), 0); /* then closed */
  snprintf(msg, len, "%s", rep.message);
  return rep.status;
}

EPD_TEST(attach_unredeemed_connections_bounded) {
  setup();
  epd_attach_stats_t st;
  char msg[256];
  epd_attach_set_limits(3, 2);
  int a = idle_conn(), b = idle_conn();
  pump(20);
  epd_attach_stats(&st);
  ASSERT_EQ(st.unredeemed, 2);
  ASSERT_EQ(epd_attach_connections(), 2);
  /* The uid's bound: its third connection is answered and closed at once. */
  int c = idle_conn();
  pump(20);
  ASSERT_EQ(refusal(c, msg, sizeof msg), EPD_ERR_BUSY);
  ASSERT_STR_CONTAINS(msg, "daemon.max_unredeemed_per_uid");
  close(c);
  epd_attach_stats(&st);
  ASSERT_EQ(st.refused[EPD_ATTACH_REFUSED_UID], 1);
  ASSERT_EQ(st.refused[EPD_ATTACH_REFUSED_CAP], 0);
  ASSERT_EQ(st.unredeemed, 2);
  /* The bound in all (a reload lowering it below the uid's). */
  epd_attach_set_limits(2, 10);
  c = idle_conn();
  pump(20);
  ASSERT_EQ(refusal(c, msg, sizeof msg), EPD_ERR_BUSY);
  ASSERT_STR_CONTAINS(msg, "daemon.max_unredeemed_conns");
  close(c);
  epd_attach_stats(&st);
  ASSERT_EQ(st.refused[EPD_ATTACH_REFUSED_CAP], 1);
  /* A client with a token is refused too while idle connections hold the slots; once one goes, it
   * redeems, and a redeemed connection no longer counts. */
  uint64_t id = attach_client(0);
  uint8_t tok[EPD_TOKEN_BYTES];
  ASSERT_OK(epd_attach_issue_token(id, 0, 0, tok));
  job_t *j = make_job(id, tok);
  run_job(j);
  ASSERT_EQ(j->rep.status, EPD_ERR_BUSY);
  close(a);
  double end = mono_s() + 5;
  do pump(5);
  while (epd_attach_connections() != 1 && mono_s() < end);
  j = make_job(id, tok);
  j->keep_open = 1;
  run_job(j);
  ASSERT_EQ(j->rep.status, EPD_OK);
  epd_attach_stats(&st);
  ASSERT_EQ(st.unredeemed, 1);
  ASSERT_EQ(epd_attach_connections(), 2);
  int d = idle_conn();
  pump(20);
  epd_attach_stats(&st);
  ASSERT_EQ(st.unredeemed, 2);
  ASSERT_EQ(st.refused[EPD_ATTACH_REFUSED_CAP] + st.refused[EPD_ATTACH_REFUSED_UID], 3);
  close(b);
  close(d);
  close(j->fd);
  end = mono_s() + 5;
  do pump(5);
  while (epd_attach_connections() != 0 && mono_s() < end);
  epd_attach_stats(&st);
  ASSERT_EQ(st.unredeemed, 0);
  epd_attach_fini();
  pump(5);
  epd_engine_destroy(teng);
}

EPD_TEST(attach_peer_not_allowed_refused_at_accept) {
  setup();
  epd_conf_t c;
  char err[256], msg[256];
  epd_conf_defaults(&c);
  snprintf(c.allow_uids, sizeof c.allow_uids, "%u", (unsigned)getuid() + 12345);
  ASSERT_OK(epd_access_init(&c, err, sizeof err));
  for (int i = 0; i < 3; i++) {
    int fd = idle_conn();
    pump(20);
    ASSERT_EQ(refusal(fd, msg, sizeof msg), EPD_ERR_PERMISSION);
    ASSERT_STR_CONTAINS(msg, "is not allowed on this daemon");
    close(fd);
  }
  epd_attach_stats_t st;
  epd_attach_stats(&st);
  ASSERT_EQ(st.refused[EPD_ATTACH_REFUSED_PEER], 3);
  ASSERT_EQ(st.unredeemed, 0);
  ASSERT_EQ(epd_attach_connections(), 0);
  epd_access_fini();
  epd_attach_fini();
  pump(5);
  epd_engine_destroy(teng);
}

/* Out of fds, the listener rests ACCEPT_PAUSE_MS (100 ms) between tries instead of spinning on a socket
 * that stays readable, and takes the waiting connections once fds are back. */
EPD_TEST(attach_out_of_fds_pauses_the_listener) {
  setup();
  enum { N = 12 };
  int fds[N];
  for (int i = 0; i < N; i++) fds[i] = idle_conn(); /* in the backlog: not accepted before the pump */
  struct rlimit old, low;
  ASSERT_OK(getrlimit(RLIMIT_NOFILE, &old));
  int probe = dup(0); /* the lowest free fd: the limit leaves room for two more */
  ASSERT(probe >= 0);
  close(probe);
  low = old;
  low.rlim_cur = (rlim_t)probe + 2;
  ASSERT_OK(setrlimit(RLIMIT_NOFILE, &low));
  pump(350);
  epd_attach_stats_t st;
  epd_attach_stats(&st);
  ASSERT_OK(setrlimit(RLIMIT_NOFILE, &old));
  ASSERT_EQ(epd_attach_connections(), 2);
  /* About one failed accept per 100 ms: 4 in 350 ms (a spinning loop would fail thousands of times). */
  ASSERT_GE(st.accept_errors, 2);
  ASSERT_LE(st.accept_errors, 6);
  double end = mono_s() + 5;
  do pump(5);
  while (epd_attach_connections() != N && mono_s() < end);
  ASSERT_EQ(epd_attach_connections(), N);
  for (int i = 0; i < N; i++) close(fds[i]);
  epd_attach_fini();
  pump(5);
  epd_engine_destroy(teng);
}

EPD_TEST(log_ratelimit_counts_and_paces) {
  epd_log_init(EPD_LOG_INFO, EPD_SUB_ALL, 0);
  epd_log_ratelimit_t rl = EPD_LOG_RATELIMIT_INITIALIZER(100);
  int logged = 0;
  for (int i = 0; i < 1000; i++)
    logged += epd_log_ratelimited(&rl, EPD_LOG_INFO, EPD_SUB_ATTACH, "event %d", i);
  ASSERT_EQ(logged, 1);
  ASSERT_EQ(rl.suppressed, 999);
  usleep(120 * 1000);
  /* This one says "(1000 times since the last report)". */
  ASSERT_EQ(epd_log_ratelimited(&rl, EPD_LOG_INFO, EPD_SUB_ATTACH, "event again"), 1);
  ASSERT_EQ(rl.suppressed, 0);
  ASSERT_EQ(epd_log_ratelimited(&rl, EPD_LOG_INFO, EPD_SUB_ATTACH, "event again"), 0);
}
