/* fuzz_attach.c - libFuzzer target: the attach socket protocol (client/epd_wire.h) against the real
 * attach module (attach.c) on a libuv loop with an in-process host engine. Input byte 0: bit 0 attach a
 * client for real and issue a token first, bit 1 put the valid client_id, bit 2 the valid token, bit 3
 * the right magic/version into the request, bit 4 half-close after sending; the rest is the request
 * (any length, sent as is; bytes after the first 48 are ignored by the daemon). The daemon must answer with a
 * well-formed reply or close, never crash, and hand out fds only for a valid token. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "control/attach.h"
#include "control/conf.h"
#include "core/engine.h"
#include "control/events.h"
#include "core/log.h"

static epd_engine_t *eng;
static uv_loop_t loop;

static char dir[] = "/tmp/epd-fuzz-attach.XXXXXX";

/* The sockets and their directory go when the fuzzer exits (it ends with exit() after -max_total_time). */
static void remove_dir(void) {
  char p[sizeof dir + 32];
  snprintf(p, sizeof p, "%s/control.sock", dir);
  unlink(p);
  snprintf(p, sizeof p, "%s/attach.sock", dir);
  unlink(p);
  rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  char err[256];
  epd_log_init(EPD_LOG_ERROR, EPD_SUB_ALL, 0);
  epd_events_init(64);
  epd_engine_opts_t o = {0};
  o.backend = "host";
  o.num_ranks = 2;
  o.max_experts = 64;
  o.max_hidden = 256;
  o.max_topk = 8;
  o.max_tokens = 16;
  o.slots_factor_pct = 100;
  o.max_groups = 4;
  o.max_clients_per_rank = 8;
  o.max_arena_bytes = 64ull << 20;
  o.step_timeout_ms = 1000;
  if (epd_engine_create(&o, NULL, NULL, &eng, err, sizeof err) != EPD_OK || !mkdtemp(dir)) abort();
  atexit(remove_dir);
  epd_conf_t c;
  epd_conf_defaults(&c);
  snprintf(c.control_socket, sizeof c.control_socket, "%s/control.sock", dir);
  c.token_ttl_ms = 200; /* unredeemed tokens of the fuzzer expire fast: the table never fills */
  if (uv_loop_init(&loop) != 0 || epd_attach_init(&loop, &c, eng, err, sizeof err) != 0) {
    fprintf(stderr, "attach: %s\n", err);
    abort();
  }
  return 0;
}

static void pump(int n) {
  for (int i = 0; i < n; i++) uv_run(&loop, UV_RUN_NOWAIT);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1 || size > 4096) return 0;
  uint8_t mode = data[0];
  uint8_t req[4096];
  size_t len = size - 1;
  memcpy(req, data + 1, len);
  uint64_t id = 0;
  uint8_t token[EPD_TOKEN_BYTES];
  int attached = 0;
  if (mode & 1) {
    epd_attach_req_t r;
    epd_attach_info_t info;
    char err[256];
    memset(&r, 0, sizeof r);
    snprintf(r.group, sizeof r.group, "fz");
    snprintf(r.name, sizeof r.name, "fz");
    r.rank = 0;
    r.num_experts = 8;
    r.hidden = 128;
    r.topk = 2;
    r.max_tokens = 8;
    r.pid = (uint32_t)getpid();
    r.uid = (uint32_t)getuid();
    if (epd_engine_attach(eng, &r, &info, err, sizeof err) == EPD_OK) {
      id = info.client_id;
      if (epd_attach_issue_token(id, r.pid, r.uid, token) == 0)
        attached = 1;
      else
        epd_engine_detach(eng, id, 0);
    }
  }
  epd_redeem_req_t *q = (epd_redeem_req_t *)req;
  if (len >= sizeof *q) {
    if (mode & 8) {
      q->magic = EPD_WIRE_MAGIC;
      q->version = EPD_WIRE_VERSION;
    }
    if (attached && (mode & 2)) q->client_id = id;
    if (attached && (mode & 4)) memcpy(q->token, token, sizeof token);
  }
  int valid = attached && len >= sizeof *q && q->magic == EPD_WIRE_MAGIC && q->version == EPD_WIRE_VERSION &&
              q->client_id == id && !memcmp(q->token, token, sizeof token);

  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", epd_attach_path());
  if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) abort();
  pump(2);
  if (len && send(fd, req, len, MSG_NOSIGNAL) < 0 && errno != EPIPE && errno != ECONNRESET) abort();
  if (mode & 16) shutdown(fd, SHUT_WR);
  uint8_t rep[512];
  size_t got = 0;
  int nfds = 0, eof = 0;
  for (int i = 0; i < 400 && got < sizeof(epd_redeem_rep_t) && !eof; i++) {
    pump(1);
    if (len < sizeof *q && !(mode & 16) && i > 2) break; /* the daemon waits for the rest: give up */
    struct pollfd pf[2] = {{.fd = fd, .events = POLLIN}, {.fd = uv_backend_fd(&loop), .events = POLLIN}};
    if (poll(pf, 2, 5) <= 0 || !pf[0].revents) continue;
    union {
      char buf[CMSG_SPACE(4 * sizeof(int))];
      struct cmsghdr align;
    } ctl;
    struct iovec iov = {rep + got, sizeof rep - got};
    struct msghdr m = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
    ssize_t n = recvmsg(fd, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n == 0) eof = 1;
    if (n <= 0) continue;
    got += (size_t)n;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&m); cm; cm = CMSG_NXTHDR(&m, cm))
      if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
        int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        int fds[4];
        memcpy(fds, CMSG_DATA(cm), (size_t)k * sizeof(int));
        for (int j = 0; j < k; j++) close(fds[j]);
        nfds += k;
      }
  }
  if (got) {
    epd_redeem_rep_t r;
    if (got != sizeof r) abort(); /* replies are whole */
    memcpy(&r, rep, sizeof r);
    if (r.magic != EPD_WIRE_MAGIC || r.version != EPD_WIRE_VERSION) abort();
    if ((r.status == 0) != valid || (int)r.nfds != nfds || (nfds != 0) != valid)
      abort(); /* fds only for a valid token */
    if (memchr(r.message, 0, sizeof r.message) == NULL) abort();
  }
  close(fd);
  pump(4);
  /* A client whose token was not spent (a partial or mismatched request) is detached by hand, so that
   * the engine does not fill up; a redeemed one was detached by the hang-up just pumped. */
  if (attached) epd_engine_detach(eng, id, 1);
  pump(1);
  return 0;
}
