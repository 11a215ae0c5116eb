/*
 * rpc_conn.c - the control socket: made with its permissions, its connections accepted here (not by
 * gRPC) so that SO_PEERCRED can be read and the caps on connections applied, then handed to gRPC.
 */
#define _GNU_SOURCE
#include "control/rpc_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <grpc/grpc_posix.h>
#include <grpc/grpc_security.h>

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

/* ---- socket --------------------------------------------------------------------------------------- */

int rpc_mkdir_parents(const char *path, char *err, size_t errlen) {
  char dir[EPD_PATH_MAX];
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (!slash || slash == dir) return 0;
  *slash = 0;
  for (char *p = dir + 1; *p; p++) {
    if (*p != '/') continue;
    *p = 0;
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) goto fail;
    *p = '/';
  }
  if (mkdir(dir, 0755) != 0 && errno != EEXIST) goto fail;
  return 0;
fail:
  snprintf(err, errlen, "daemon.control_socket: cannot create directory %s: %s", dir, strerror(errno));
  return -1;
}

/* Remove a stale socket file, refusing to steal the socket of a live daemon. */
int rpc_clear_stale(const char *path, char *err, size_t errlen) {
  struct stat st;
  if (lstat(path, &st) != 0) return 0;
  if (!S_ISSOCK(st.st_mode)) {
    snprintf(err, errlen, "daemon.control_socket: %s exists and is not a socket", path);
    return -1;
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    int live = connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    close(fd);
    if (live) {
      snprintf(err, errlen, "daemon.control_socket: %s: another daemon is listening there", path);
      return -1;
    }
  }
  if (unlink(path) != 0) {
    snprintf(err, errlen, "daemon.control_socket: cannot remove stale %s: %s", path, strerror(errno));
    return -1;
  }
  return 0;
}

int rpc_apply_perms(const epd_conf_t *conf, char *err, size_t errlen) {
  if (chmod(rpc_srv.path, conf->socket_mode & 07777) != 0) {
    snprintf(err, errlen, "daemon.socket_mode: chmod %s %o: %s", rpc_srv.path, conf->socket_mode,
             strerror(errno));
    return -1;
  }
  if (conf->socket_group[0]) {
    struct group gr, *res = NULL;
    char buf[4096];
    if (getgrnam_r(conf->socket_group, &gr, buf, sizeof buf, &res) != 0 || !res) {
      snprintf(err, errlen, "daemon.socket_group: no group named \"%s\"", conf->socket_group);
      return -1;
    }
    if (chown(rpc_srv.path, (uid_t)-1, gr.gr_gid) != 0) {
      snprintf(err, errlen, "daemon.socket_group: chgrp %s %s: %s", conf->socket_group, rpc_srv.path,
               strerror(errno));
      return -1;
    }
  }
  return 0;
}

/* ---- connections: accepted here for SO_PEERCRED, then handed to gRPC ----------------------------- */

int rpc_make_listener(char *err, size_t errlen) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  size_t n = strlen(rpc_srv.path);
  if (n >= sizeof sa.sun_path) { /* checked by epd_rpc_init; kept so this function stands alone */
    snprintf(err, errlen, "daemon.control_socket: %s is too long", rpc_srv.path);
    return -1;
  }
  memcpy(sa.sun_path, rpc_srv.path, n + 1);
  rpc_srv.listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (rpc_srv.listen_fd < 0 || bind(rpc_srv.listen_fd, (struct sockaddr *)&sa, sizeof sa) != 0 ||
      listen(rpc_srv.listen_fd, 128) != 0) {
    snprintf(err, errlen, "daemon.control_socket: cannot listen on %s: %s", rpc_srv.path, strerror(errno));
    if (rpc_srv.listen_fd >= 0) close(rpc_srv.listen_fd);
    rpc_srv.listen_fd = -1;
    return -1;
  }
  return 0;
}

/* The control connections handed to gRPC, to bound them (daemon.max_control_conns, per uid). gRPC closes
 * a connection's fd without telling: an entry counts while its fd is still open on the same socket (the
 * same inode), checked at each accept. Accept thread only. */
#define CTL_TRACK_MAX 4096
typedef struct ctl_conn {
  int fd;
  ino_t ino;
  uint32_t uid;
} ctl_conn_t;
static ctl_conn_t ctl_track[CTL_TRACK_MAX];
static uint32_t nctl_track;

/* Drop the entries whose fd gRPC closed; return how many are left from uid (all of them in *total). */
static uint32_t ctl_count(uint32_t uid, uint32_t *total) {
  uint32_t n = 0, mine = 0;
  for (uint32_t i = 0; i < nctl_track; i++) {
    struct stat st;
    if (fstat(ctl_track[i].fd, &st) != 0 || st.st_ino != ctl_track[i].ino) continue;
    mine += ctl_track[i].uid == uid;
    ctl_track[n++] = ctl_track[i];
  }
  nctl_track = n;
  *total = n;
  return mine;
}

void rpc_conn_reset(void) {
  nctl_track = 0;
}

unsigned epd_rpc_control_conns(uint64_t refused[2]) {
  for (int i = 0; i < 2; i++) refused[i] = atomic_load(&rpc_srv.ctl_refused[i]);
  return atomic_load(&rpc_srv.nctl_open);
}

static void *accept_main(void *arg) {
  (void)arg;
  grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
  /* Refused peers are answered here (refuse.h), never handed to gRPC. */
  epd_refuse_set_t refused;
  epd_refuse_init(&refused);
  /* After an accept that failed (out of fds or memory) the listener leaves the poll set until resume_ns,
   * as the attach socket's does: it stays readable while connections wait, so polling it would spin. */
  static epd_log_ratelimit_t accept_rl = EPD_LOG_RATELIMIT_INITIALIZER(1000);
  static epd_log_ratelimit_t refuse_rl = EPD_LOG_RATELIMIT_INITIALIZER(1000);
  uint64_t resume_ns = 0;
  for (;;) {
    const uint64_t now = rpc_mono_ns();
    const int paused = resume_ns > now;
    struct pollfd pf[2 + EPD_REFUSE_MAX] = {{.fd = paused ? -1 : rpc_srv.listen_fd, .events = POLLIN},
                                            {.fd = rpc_srv.wake_fd[0], .events = POLLIN}};
    int nref = epd_refuse_pollfds(&refused, pf + 2);
    int timeout = epd_refuse_timeout_ms(&refused);
    const int rest_ms = paused ? (int)((resume_ns - now + 999999) / 1000000) : -1;
    if (paused && (timeout < 0 || rest_ms < timeout)) timeout = rest_ms;
    if (poll(pf, (nfds_t)(2 + nref), timeout) < 0) {
      if (errno == EINTR) continue;
      EPD_LOGE(EPD_SUB_RPC, "control socket poll: %s", strerror(errno));
      break;
    }
    if (pf[1].revents) break;
    epd_refuse_service(&refused, pf + 2, nref);
    if (!(pf[0].revents & POLLIN)) continue;
    /* gRPC needs a non-blocking fd: a blocking one hangs its event engine. */
    int fd = accept4(rpc_srv.listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int e = errno; /* before anything else can change it */
      if (e == EAGAIN || e == EINTR || e == ECONNABORTED) continue;
      /* EMFILE, ENFILE, ENOBUFS, ENOMEM (or worse): rest 100 ms, and say so at most once a second */
      epd_log_ratelimited(&accept_rl, EPD_LOG_WARN, EPD_SUB_RPC, "control socket accept: %s; pausing 100 ms",
                          strerror(e));
      resume_ns = rpc_mono_ns() + 100 * 1000000ull;
      continue;
    }
    struct ucred cr;
    socklen_t len = sizeof cr;
    int have = getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) == 0;
    /* Unknown credentials pass only when no allow list is set (uid/gid -1 match no list entry). */
    if (!epd_access_allowed("control", have ? cr.pid : 0, have ? cr.uid : (uint32_t)-1,
                            have ? cr.gid : (uint32_t)-1)) {
      /* A bare hang-up reads as "no daemon" (UNAVAILABLE) to every gRPC client: say why instead, in the
       * words the attach socket uses. */
      char msg[EPD_REFUSE_MSG_MAX];
      if (have)
        snprintf(msg, sizeof msg,
                 "uid %u gid %u is not allowed on this daemon (daemon.allow_uids/allow_gids)",
                 (unsigned)cr.uid, (unsigned)cr.gid);
      else
        snprintf(msg, sizeof msg,
                 "the daemon cannot read this connection's credentials (SO_PEERCRED), and "
                 "daemon.allow_uids/allow_gids are set");
      epd_refuse_add(&refused, fd, GRPC_STATUS_PERMISSION_DENIED, EPD_ERR_PERMISSION, msg);
      continue;
    }
    {
      uint32_t total, mine = ctl_count(have ? cr.uid : (uint32_t)-1, &total);
      const int by_uid = mine >= rpc_srv.max_ctl_uid,
                full = total >= rpc_srv.max_ctl || total >= CTL_TRACK_MAX;
      struct stat st;
      if (by_uid || full || fstat(fd, &st) != 0) {
        char msg[EPD_REFUSE_MSG_MAX];
        if (by_uid)
          snprintf(msg, sizeof msg,
                   "uid %u has %u control connections open (daemon.max_control_conns_per_uid)",
                   have ? (unsigned)cr.uid : 0u, mine);
        else
          snprintf(msg, sizeof msg, "%u control connections are open (daemon.max_control_conns)", total);
        atomic_fetch_add(&rpc_srv.ctl_refused[by_uid ? 1 : 0], 1);
        epd_log_ratelimited(&refuse_rl, EPD_LOG_WARN, EPD_SUB_RPC, "control connection refused: %s", msg);
        epd_refuse_add(&refused, fd, GRPC_STATUS_RESOURCE_EXHAUSTED, EPD_ERR_BUSY, msg);
        atomic_store(&rpc_srv.nctl_open, total);
        continue;
      }
      ctl_track[nctl_track++] = (ctl_conn_t){fd, st.st_ino, have ? cr.uid : (uint32_t)-1};
      atomic_store(&rpc_srv.nctl_open, total + 1);
    }
    pthread_mutex_lock(&rpc_srv.cred_mu);
    if (fd < (int)sizeof rpc_srv.cred_set) {
      rpc_srv.cred_set[fd] = (uint8_t)have;
      if (have) rpc_srv.creds[fd] = cr;
    }
    pthread_mutex_unlock(&rpc_srv.cred_mu);
    if (have)
      epd_log_msg(EPD_LOG_DEBUG, EPD_SUB_RPC, -1, 0, "control connection fd %d from pid %d uid %u gid %u", fd,
                  (int)cr.pid, (unsigned)cr.uid, (unsigned)cr.gid);
    grpc_server_add_channel_from_fd(rpc_srv.server, fd, creds);
  }
  epd_refuse_close_all(&refused);
  grpc_server_credentials_release(creds);
  return NULL;
}

int rpc_start_accept(char *err, size_t errlen) {
  if (pipe2(rpc_srv.wake_fd, O_CLOEXEC) != 0) {
    snprintf(err, errlen, "pipe: %s", strerror(errno));
    return -1;
  }
  if (pthread_create(&rpc_srv.accept_thread, NULL, accept_main, NULL) != 0) {
    snprintf(err, errlen, "cannot start the accept thread: %s", strerror(errno));
    return -1;
  }
  rpc_srv.accept_started = 1;
  return 0;
}

void rpc_stop_accept(void) {
  if (rpc_srv.accept_started) {
    ssize_t w = write(rpc_srv.wake_fd[1], "x", 1);
    (void)w; /* a full pipe still wakes the thread */
    pthread_join(rpc_srv.accept_thread, NULL);
    rpc_srv.accept_started = 0;
  }
  for (int i = 0; i < 2; i++)
    if (rpc_srv.wake_fd[i] >= 0) {
      close(rpc_srv.wake_fd[i]);
      rpc_srv.wake_fd[i] = -1;
    }
  if (rpc_srv.listen_fd >= 0) {
    close(rpc_srv.listen_fd);
    rpc_srv.listen_fd = -1;
  }
}
