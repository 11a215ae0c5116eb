/*
 * test_client.c - libepd against a real daemon (host backend) started by the test: argument checks
 * with messages naming the argument, attach errors, info and buffers, a two-rank step from two
 * threads, EPD_ERR_CLOSED when the daemon dies mid-wait or none listens, EPD_ERR_PERMISSION naming the
 * uid when daemon.allow_uids leaves it out. Skips if the daemon is not built.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "epd.h"
#include "core/ref.h"
#include "test.h"

static char sock_path[300];

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Start epd with the host backend, 2 ranks and one more "-o KEY=VALUE" (NULL: none); returns its pid
 * once both sockets exist. */
static pid_t daemon_up_with(const char *extra) {
  char epd[300], attach[300], logp[300];
  snprintf(epd, sizeof epd, "%s/bin/epd", epd_test_build_dir());
  if (access(epd, X_OK)) epd_test_skip("%s is not built", epd);
  snprintf(sock_path, sizeof sock_path, "%s/control.sock", epd_test_tmpdir());
  snprintf(attach, sizeof attach, "daemon.attach_socket=%s/attach.sock", epd_test_tmpdir());
  snprintf(logp, sizeof logp, "%s/epd.log", epd_test_tmpdir());
  pid_t pid = fork();
  if (pid == 0) {
    freopen(logp, "w", stderr);
    execl(epd, epd, "-f", "-s", sock_path, "-o", "engine.backend=host", "-o", "engine.num_ranks=2", "-o",
          "engine.step_timeout_ms=3000", "-o", attach, extra ? "-o" : (char *)NULL, extra, (char *)NULL);
    _exit(127);
  }
  ASSERT_GT(pid, 0);
  char ap[300];
  snprintf(ap, sizeof ap, "%s/attach.sock", epd_test_tmpdir());
  double end = now_s() + 15;
  struct stat st;
  while (stat(sock_path, &st) || stat(ap, &st)) {
    if (now_s() > end) epd_test_fail(__FILE__, __LINE__, "daemon sockets not there after 15 s");
    if (waitpid(pid, NULL, WNOHANG) == pid) epd_test_fail(__FILE__, __LINE__, "daemon exited at start");
    usleep(20000);
  }
  return pid;
}

static pid_t daemon_up(void) {
  return daemon_up_with(NULL);
}

static epd_conn_t *conn_up(void) {
  epd_connect_opts_t co = EPD_CONNECT_OPTS_INITIALIZER;
  co.socket_path = sock_path;
  epd_conn_t *c = NULL;
  epd_result_t rc = epd_connect(&co, &c);
  if (rc) epd_test_fail(__FILE__, __LINE__, "connect: %d %s", rc, epd_conn_last_error(NULL));
  return c;
}

static epd_ep_t *attach_rank(epd_conn_t *c, const char *group, int rank, uint32_t H) {
  epd_attach_opts_t ao = EPD_ATTACH_OPTS_INITIALIZER;
  ao.group = group;
  ao.rank = rank;
  ao.num_experts = 8;
  ao.hidden = H;
  ao.topk = 2;
  ao.max_tokens = 16;
  epd_ep_t *ep = NULL;
  epd_result_t rc = epd_attach(c, &ao, &ep);
  if (rc) epd_test_fail(__FILE__, __LINE__, "attach rank %d: %d %s", rank, rc, epd_conn_last_error(c));
  return ep;
}

EPD_TEST(client_strerror_covers_every_code) {
  const char *names[] = {"EPD_OK",
                         "EPD_ERR_INVALID",
                         "EPD_ERR_NOMEM",
                         "EPD_ERR_SYSTEM",
                         "EPD_ERR_RPC",
                         "EPD_ERR_PROTOCOL",
                         "EPD_ERR_NOT_FOUND",
                         "EPD_ERR_BUSY",
                         "EPD_ERR_TIMEOUT",
                         "EPD_ERR_PEER",
                         "EPD_ERR_DRAINING",
                         "EPD_ERR_CUDA",
                         "EPD_ERR_NCCL",
                         "EPD_ERR_UNSUPPORTED",
                         "EPD_ERR_BAD_EXPERT",
                         "EPD_ERR_TOO_MANY_TOKENS",
                         "EPD_ERR_PERMISSION",
                         "EPD_ERR_OVERFLOW",
                         "EPD_ERR_MISMATCH",
                         "EPD_ERR_CLOSED",
                         "EPD_ERR_STATE",
                         "EPD_ERR_INTERNAL"};
  ASSERT_EQ(sizeof names / sizeof names[0], (size_t)-EPD_ERR_MIN);
  for (int i = 0; i > EPD_ERR_MIN; i--) {
    const char *s = epd_strerror(i);
    ASSERT(!strncmp(s, names[-i], strlen(names[-i])) && s[strlen(names[-i])] == ':');
  }
  ASSERT_STR_CONTAINS(epd_strerror(EPD_ERR_MIN), "UNKNOWN");
  ASSERT_STR_CONTAINS(epd_strerror(5), "UNKNOWN");
}

EPD_TEST(client_connect_errors) {
  epd_connect_opts_t co = EPD_CONNECT_OPTS_INITIALIZER;
  char p[300];
  snprintf(p, sizeof p, "%s/nobody.sock", epd_test_tmpdir());
  co.socket_path = p;
  co.timeout_ms = 500;
  epd_conn_t *c = (epd_conn_t *)1;
  epd_result_t rc = epd_connect(&co, &c);
  ASSERT_EQ(rc, EPD_ERR_CLOSED);
  ASSERT(c == NULL);
  ASSERT_STR_CONTAINS(epd_conn_last_error(NULL), "no daemon listens there");
  ASSERT_STR_CONTAINS(epd_conn_last_error(NULL), p);
  epd_connect_opts_t bad = co;
  bad.magic = 0;
  ASSERT_EQ(epd_connect(&bad, &c), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(epd_conn_last_error(NULL), "EPD_CONNECT_OPTS_INITIALIZER");
}

EPD_TEST(client_argument_checks) {
  pid_t d = daemon_up();
  epd_conn_t *c = conn_up();
  epd_ep_t *ep = attach_rank(c, "args", 0, 64);
  ASSERT_EQ(epd_info(ep, EPD_INFO_RANK), 0);
  ASSERT_EQ(epd_info(ep, EPD_INFO_NUM_RANKS), 2);
  ASSERT_EQ(epd_info(ep, EPD_INFO_HIDDEN), 64);
  ASSERT_EQ(epd_info(ep, EPD_INFO_SLOTS_PER_RANK), 4);
  ASSERT_EQ(epd_info(ep, EPD_INFO_HT_CAPACITY), 32);
  ASSERT_EQ(epd_info(ep, EPD_INFO_ON_GPU), 0);
  ASSERT_EQ(epd_info(ep, EPD_INFO_MAP_VERSION), 1);
  ASSERT_GT(epd_info(ep, EPD_INFO_CLIENT_ID), 0);
  ASSERT_EQ(epd_info(ep, (epd_info_t)99), -1);
  size_t bytes = 0;
  uint16_t *x = epd_buffer(ep, EPD_BUF_X, 1, &bytes);
  ASSERT(x != NULL);
  ASSERT_EQ(bytes, 16 * 64 * 2);
  x[16 * 64 - 1] = 0x1234; /* mapped read/write, whole buffer */
  ASSERT(epd_buffer(ep, EPD_BUF_KINDS, 0, &bytes) == NULL);
  ASSERT(epd_buffer(ep, EPD_BUF_X, 2, NULL) == NULL);
  ASSERT_EQ(epd_op_status(ep, NULL), EPD_ERR_STATE);
  ASSERT_EQ(epd_dispatch(ep, (epd_mode_t)3, 1, 0, 0, NULL), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(epd_last_error(ep), "mode 3");
  ASSERT_EQ(epd_dispatch(ep, EPD_MODE_LL, 1, 0, 2, NULL), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(epd_last_error(ep), "bank 2");
  ASSERT_EQ(epd_dispatch(ep, EPD_MODE_HT, 17, 0, 0, NULL), EPD_ERR_TOO_MANY_TOKENS);
  ASSERT_STR_CONTAINS(epd_last_error(ep), "num_tokens 17");
  ASSERT_EQ(epd_dispatch(ep, EPD_MODE_HT, 1, 0x10, 0, NULL), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(epd_last_error(ep), "flags 0x10");
  ASSERT_EQ(epd_dispatch(ep, EPD_MODE_HT, 1, EPD_DESC_FP8, 0, NULL), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(epd_last_error(ep), "hidden a multiple of 128");
  ASSERT_EQ(epd_combine(ep, EPD_MODE_LL, 7, NULL), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(epd_last_error(ep), "bank 7");
  ASSERT_EQ(epd_dispatch(ep, EPD_MODE_LL, 1, 0, 0, (void *)1), EPD_ERR_UNSUPPORTED);
  ASSERT_STR_CONTAINS(epd_last_error(ep), "stream");
  /* Attach errors: same rank twice, geometry mismatch, rank out of range. */
  epd_attach_opts_t ao = EPD_ATTACH_OPTS_INITIALIZER;
  ao.group = "args";
  ao.rank = 0;
  epd_ep_t *e2 = NULL;
  ASSERT_EQ(epd_attach(c, &ao, &e2), EPD_ERR_BUSY);
  ASSERT_STR_CONTAINS(epd_conn_last_error(c), "already attached");
  ao.rank = 1;
  ao.hidden = 128;
  ASSERT_EQ(epd_attach(c, &ao, &e2), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(epd_conn_last_error(c), "hidden 128 does not match");
  ao.hidden = 0;
  ao.rank = 5;
  ASSERT_EQ(epd_attach(c, &ao, &e2), EPD_ERR_INVALID);
  ASSERT_STR_CONTAINS(epd_conn_last_error(c), "5 out of range [0, 2)");
  ASSERT_OK(epd_detach(ep));
  epd_disconnect(c);
  kill(d, SIGTERM);
  waitpid(d, NULL, 0);
}

typedef struct rank_job {
  epd_conn_t *c;
  int rank;
  epd_result_t rc_dispatch, rc_combine;
  epd_comp_t comp;
  uint16_t out[16 * 128];
  uint32_t T;
} rank_job_t;

static void *rank_thread(void *arg) {
  rank_job_t *j = arg;
  epd_ep_t *ep = attach_rank(j->c, "pair", j->rank, 128);
  epd_ref_geom_t g = {2, 8, 128, 2, 16, 4, 32};
  uint16_t *x = epd_buffer(ep, EPD_BUF_X, 0, NULL);
  int64_t *idx = epd_buffer(ep, EPD_BUF_TOPK_IDX, 0, NULL);
  float *w = epd_buffer(ep, EPD_BUF_TOPK_WEIGHTS, 0, NULL);
  epd_ref_gen_input(21, 0, (uint32_t)j->rank, &g, j->T, 0, x, idx, w);
  j->rc_dispatch = epd_dispatch(ep, EPD_MODE_HT, j->T, EPD_DESC_FP8, 0, NULL);
  epd_op_status(ep, &j->comp);
  /* Identity expert on the dequantised rows: y = (sum of local weights) * x. */
  uint8_t *rx = epd_buffer(ep, EPD_BUF_HT_RECV_X, 0, NULL);
  float *rs = epd_buffer(ep, EPD_BUF_HT_RECV_SCALES, 0, NULL);
  float *tw = epd_buffer(ep, EPD_BUF_HT_RECV_TOPK_WEIGHTS, 0, NULL);
  uint16_t *y = epd_buffer(ep, EPD_BUF_HT_Y, 0, NULL);
  for (uint32_t r = 0; r < j->comp.num_recv; r++) {
    float sw = tw[r * 2] + tw[r * 2 + 1];
    for (int h = 0; h < 128; h++)
      y[r * 128 + h] = epd_f32_to_bf16(sw * epd_e4m3_to_f32(rx[r * 256 + h]) * rs[r]);
  }
  j->rc_combine = epd_combine(ep, EPD_MODE_HT, 0, NULL);
  memcpy(j->out, epd_buffer(ep, EPD_BUF_OUT, 0, NULL), sizeof j->out);
  epd_detach(ep);
  return NULL;
}

EPD_TEST(client_two_rank_step_fp8) {
  pid_t d = daemon_up();
  rank_job_t j[2];
  pthread_t th[2];
  for (int r = 0; r < 2; r++) {
    memset(&j[r], 0, sizeof j[r]);
    j[r].c = conn_up();
    j[r].rank = r;
    j[r].T = r ? 9 : 16;
    pthread_create(&th[r], NULL, rank_thread, &j[r]);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  epd_ref_geom_t g = {2, 8, 128, 2, 16, 4, 32};
  for (int r = 0; r < 2; r++) {
    ASSERT_EQ(j[r].rc_dispatch, EPD_OK);
    ASSERT_EQ(j[r].rc_combine, EPD_OK);
    ASSERT_GT(j[r].comp.num_recv, 0u);
    uint16_t x[16 * 128];
    int64_t idx[32];
    float w[32];
    epd_ref_gen_input(21, 0, (uint32_t)r, &g, j[r].T, 0, x, idx, w);
    for (uint32_t t = 0; t < j[r].T; t++) {
      float sw = 0;
      for (int k = 0; k < 2; k++)
        if (idx[t * 2 + k] >= 0 && !(k == 1 && idx[t * 2] == idx[t * 2 + 1])) sw += w[t * 2 + k];
      uint8_t q[128];
      float sc;
      epd_ref_quant_row(x + t * 128, 128, q, &sc);
      for (int h = 0; h < 128; h++) {
        float want = sw * epd_e4m3_to_f32(q[h]) * sc, got = epd_bf16_to_f32(j[r].out[t * 128 + h]);
        ASSERT_NEAR(got, want, fabsf(want) / 64 + 1e-6);
      }
    }
    epd_disconnect(j[r].c);
  }
  kill(d, SIGTERM);
  waitpid(d, NULL, 0);
}

EPD_TEST(client_daemon_death_is_closed) {
  pid_t d = daemon_up();
  epd_conn_t *c = conn_up();
  epd_ep_t *ep = attach_rank(c, "dead", 0, 64);
  memset(epd_buffer(ep, EPD_BUF_TOPK_IDX, 0, NULL), 0xff, 16 * 2 * 8);
  /* Rank 1 never comes; the daemon is killed while rank 0 waits. */
  pid_t killer = fork();
  if (killer == 0) {
    usleep(300000);
    kill(d, SIGKILL);
    _exit(0);
  }
  double t0 = now_s();
  epd_result_t rc = epd_dispatch(ep, EPD_MODE_LL, 4, 0, 0, NULL);
  double dt = now_s() - t0;
  ASSERT_EQ(rc, EPD_ERR_CLOSED);
  ASSERT_STR_CONTAINS(epd_last_error(ep), "daemon connection dropped");
  ASSERT_LT(dt, 2.0);
  ASSERT_EQ(epd_dispatch(ep, EPD_MODE_LL, 4, 0, 0, NULL), EPD_ERR_CLOSED);
  waitpid(killer, NULL, 0);
  waitpid(d, NULL, 0);
  epd_detach(ep); /* no daemon: local resources are still released */
  /* The killed daemon left its socket file: a new connect says that nobody listens there. */
  epd_connect_opts_t co = EPD_CONNECT_OPTS_INITIALIZER;
  co.socket_path = sock_path;
  epd_conn_t *c2 = NULL;
  ASSERT_EQ(epd_connect(&co, &c2), EPD_ERR_CLOSED);
  ASSERT_STR_CONTAINS(epd_conn_last_error(NULL), "no daemon listens at");
  ASSERT_STR_CONTAINS(epd_conn_last_error(NULL), sock_path);
  ASSERT_STR_CONTAINS(epd_conn_last_error(NULL), "Connection refused");
}

/* A uid outside daemon.allow_uids gets EPD_ERR_PERMISSION naming it, not a dropped connection. */
EPD_TEST(client_refused_uid_is_permission) {
  char extra[64];
  snprintf(extra, sizeof extra, "daemon.allow_uids=%u", getuid() == 12345 ? 12346u : 12345u);
  pid_t d = daemon_up_with(extra);
  epd_connect_opts_t co = EPD_CONNECT_OPTS_INITIALIZER;
  co.socket_path = sock_path;
  epd_conn_t *c = NULL;
  ASSERT_EQ(epd_connect(&co, &c), EPD_ERR_PERMISSION);
  ASSERT(c == NULL);
  char want[96];
  snprintf(want, sizeof want, "uid %u gid %u is not allowed on this daemon", (unsigned)getuid(),
           (unsigned)getgid());
  ASSERT_STR_CONTAINS(epd_conn_last_error(NULL), want);
  ASSERT_STR_CONTAINS(epd_conn_last_error(NULL), "PERMISSION_DENIED");
  kill(d, SIGTERM);
  waitpid(d, NULL, 0);
}
