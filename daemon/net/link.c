/*
 * link.c - TCP links between the daemons of a world (see engine_net.h for the protocol, docs/SCALE_OUT.md
 * for what it is for).
 *
 * Wire format: every frame is a uint64 byte length followed by a net_hdr_t, the sender's local
 * descriptors, its HT count per world rank, and the payload of the op. Integers are in host byte order:
 * every node of a world must have the same endianness (all supported targets are little-endian).
 * A receiver thread per peer queues frames under net->mu; the rank threads look them up by (group,
 * step, source node) and drop stale ones; control frames go to the control thread (ctl.c). A link that
 * breaks marks its node dead: steps that wait for it fail with EPD_ERR_PEER; a node that is merely slow
 * fails the step with EPD_ERR_TIMEOUT through the backend's step timeout.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "net/net_internal.h"

/* ---- sockets ------------------------------------------------------------------------------------ */

static int split_addr(const char *addr, char *host, size_t hl, char *port, size_t pl) {
  const char *c = strrchr(addr, ':');
  if (!c || c == addr || !c[1]) return -1;
  const char *h = addr;
  size_t n = (size_t)(c - addr);
  if (h[0] == '[' && n >= 2 && h[n - 1] == ']') h++, n -= 2;
  if (n >= hl || strlen(c + 1) >= pl) return -1;
  memcpy(host, h, n);
  host[n] = 0;
  snprintf(port, pl, "%s", c + 1);
  return 0;
}

static int resolve(const char *addr, struct addrinfo **res, int passive, char *err, size_t errlen) {
  char host[EPD_NET_ADDR_MAX], port[16];
  if (split_addr(addr, host, sizeof host, port, sizeof port)) {
    snprintf(err, errlen, "address \"%s\" is not host:port", addr);
    return -1;
  }
  struct addrinfo hints = {
      .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = passive ? AI_PASSIVE : 0};
  int e = getaddrinfo(host, port, &hints, res);
  if (e) {
    snprintf(err, errlen, "address \"%s\": %s", addr, gai_strerror(e));
    return -1;
  }
  return 0;
}

static int write_all(int fd, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n) {
    ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    b += w;
    n -= (size_t)w;
  }
  return 0;
}

/* Read n bytes; timeout_ms < 0 blocks. 0, or -1 with errno (0 on EOF). */
static int read_all(int fd, void *p, size_t n, int timeout_ms) {
  uint8_t *b = p;
  while (n) {
    if (timeout_ms >= 0) {
      struct pollfd pf = {fd, POLLIN, 0};
      int r = poll(&pf, 1, timeout_ms);
      if (r == 0) {
        errno = ETIMEDOUT;
        return -1;
      }
      if (r < 0 && errno != EINTR) return -1;
      if (r < 0) continue;
    }
    ssize_t got = recv(fd, b, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got == 0) errno = 0;
    if (got <= 0) return -1;
    b += got;
    n -= (size_t)got;
  }
  return 0;
}

static uint64_t mono_ms(void) {
  return eng_now_ns() / 1000000ull;
}

/* A data link: no Nagle, and keepalive probes, so that a peer host that vanished (no FIN) is found dead
 * within ~11 s even on an idle link (a restarted node's new link is then taken: accept_main). */
static void link_opts(int fd) {
  int one = 1, idle = 5, intvl = 2, cnt = 3;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
}

epd_result_t epd_net_listen(const char *addr, epd_net_t **out, char *adv, size_t advlen, char *err,
                            size_t errlen) {
  *out = NULL;
  struct addrinfo *ai;
  if (!addr || !*addr) {
    snprintf(err, errlen, "cluster.data_listen is empty: set the host:port of this node's data listener");
    return EPD_ERR_INVALID;
  }
  if (resolve(addr, &ai, 1, err, errlen)) return EPD_ERR_INVALID;
  int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (fd < 0 || bind(fd, ai->ai_addr, ai->ai_addrlen) || listen(fd, 64)) {
    snprintf(err, errlen, "data listener %s: %s", addr, strerror(errno));
    if (fd >= 0) close(fd);
    freeaddrinfo(ai);
    return EPD_ERR_SYSTEM;
  }
  freeaddrinfo(ai);
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  getsockname(fd, (struct sockaddr *)&ss, &sl);
  char host[EPD_NET_ADDR_MAX], port[16], nhost[64];
  split_addr(addr, host, sizeof host, port, sizeof port);
  uint16_t p = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                        : ntohs(((struct sockaddr_in *)&ss)->sin_port);
  if (ss.ss_family == AF_INET6 && strchr(host, ':'))
    snprintf(adv, advlen, "[%s]:%u", host, p);
  else
    snprintf(adv, advlen, "%s:%u", host, p);
  (void)nhost;
  epd_net_t *net = calloc(1, sizeof *net);
  if (!net) {
    close(fd);
    return EPD_ERR_NOMEM;
  }
  net->lfd = fd;
  pthread_mutex_init(&net->mu, NULL);
  pthread_cond_init(&net->ctl_cv, NULL);
  pthread_cond_init(&net->wait_cv, NULL);
  for (int i = 0; i < MAX_NODES; i++) {
    net->peer[i].fd = -1;
    net->peer[i].net = net;
    net->peer[i].node = (uint32_t)i;
    pthread_mutex_init(&net->peer[i].send_mu, NULL);
  }
  *out = net;
  return EPD_OK;
}

static void ctl_local(epd_net_t *net, uint32_t src_node, const ctl_msg_t *m);

static void peer_dead(net_peer_t *p, const char *fmt, const char *what) {
  if (atomic_exchange(&p->dead, 1)) return;
  snprintf(p->why, sizeof p->why, fmt, what);
  if (atomic_load(&p->net->stop)) return;
  EPD_LOGE(EPD_SUB_ENGINE, "data link to node %u lost: %s", p->node, p->why);
  /* groups that mask go on without the node (ctl.c, under the engine lock) */
  const ctl_msg_t down = {.kind = CTL_LINK_DOWN};
  ctl_local(p->net, p->node, &down);
}

/* Drop the queued step frames of group (NULL: any) from node (-1: any). */
void net_drop_queued(epd_net_t *net, const char *group, int node) {
  pthread_mutex_lock(&net->mu);
  for (net_frame_t **pp = &net->frames; *pp;) {
    net_frame_t *f = *pp;
    if ((!group || !strcmp(f->group, group)) && (node < 0 || f->src_node == (uint32_t)node)) {
      *pp = f->next;
      free(f->buf);
      free(f);
      continue;
    }
    pp = &f->next;
  }
  pthread_mutex_unlock(&net->mu);
}

/* A control frame, in order, to the control thread: kept until it starts (a node that restarted gets
 * node 0's maps at once), dropped (freed) once it stopped. */
static void ctl_enqueue(epd_net_t *net, net_frame_t *f) {
  pthread_mutex_lock(&net->mu);
  const int keep = !net->ctl_stop;
  if (keep) {
    if (net->ctl_tail)
      net->ctl_tail->next = f;
    else
      net->ctl_head = f;
    net->ctl_tail = f;
    pthread_cond_signal(&net->ctl_cv);
  }
  pthread_mutex_unlock(&net->mu);
  if (!keep) {
    free(f->buf);
    free(f);
  }
}

static void *recv_main(void *arg) {
  net_peer_t *p = arg;
  epd_net_t *net = p->net;
  char name[16];
  snprintf(name, sizeof name, "epd-net%u", p->node);
  pthread_setname_np(pthread_self(), name);
  for (;;) {
    uint64_t len;
    if (read_all(p->fd, &len, sizeof len, -1)) {
      peer_dead(p, "%s", errno ? strerror(errno) : "connection closed by the peer");
      return NULL;
    }
    if (len < sizeof(net_hdr_t) || len > MAX_FRAME) {
      peer_dead(p, "%s", "malformed frame length");
      return NULL;
    }
    net_frame_t *f = calloc(1, sizeof *f);
    uint8_t *buf = malloc(len);
    if (!f || !buf || read_all(p->fd, buf, len, -1)) {
      free(f);
      free(buf);
      peer_dead(p, "%s",
                !f || !buf ? "out of memory"
                : errno    ? strerror(errno)
                           : "connection closed mid-frame");
      return NULL;
    }
    net_hdr_t *h = (net_hdr_t *)buf;
    if ((h->magic != NET_MAGIC && h->magic != CTL_MAGIC) || h->src_node != p->node) {
      free(f);
      free(buf);
      peer_dead(p, "%s", "frame with a bad magic or source node");
      return NULL;
    }
    memcpy(f->group, h->group, sizeof f->group);
    f->group[sizeof f->group - 1] = 0;
    f->step = h->step;
    f->src_node = p->node;
    f->buf = buf;
    f->len = len;
    atomic_fetch_add(&net->rx_bytes, len + 8);
    atomic_fetch_add(&net->rx_frames, 1);
    if (h->magic == CTL_MAGIC) {
      ctl_enqueue(net, f);
      continue;
    }
    pthread_mutex_lock(&net->mu);
    f->seq = ++net->frame_seq;
    f->next = net->frames;
    net->frames = f;
    pthread_mutex_unlock(&net->mu);
  }
}

static void *accept_main(void *arg);

epd_result_t epd_net_connect(epd_net_t *net, uint32_t nodes, uint32_t node_rank,
                             const char (*peers)[EPD_NET_ADDR_MAX], const uint8_t *secret,
                             uint32_t timeout_ms, int rejoin, char *err, size_t errlen) {
  net->nodes = nodes;
  net->node_rank = node_rank;
  net->rejoined = rejoin;
  memcpy(net->secret, secret, EPD_NET_SECRET_BYTES);
  uint64_t deadline = mono_ms() + timeout_ms;
  struct {
    uint32_t magic, node;
    uint8_t secret[EPD_NET_SECRET_BYTES];
  } hello = {HELLO_MAGIC, node_rank, {0}}, got;
  memcpy(hello.secret, secret, EPD_NET_SECRET_BYTES);
  /* Connect to the lower nodes (their listeners exist: they bound before the rendezvous); a node joining
   * a running world connects to every other one (their accept_main takes it) */
  for (uint32_t n = 0; n < (rejoin ? nodes : node_rank); n++) {
    if (n == node_rank) continue;
    struct addrinfo *ai;
    if (resolve(peers[n], &ai, 0, err, errlen)) return EPD_ERR_INVALID;
    int fd = -1;
    const uint64_t t_node = mono_ms();
    while (fd < 0) {
      fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) break;
      int e = errno;
      if (fd >= 0) close(fd);
      fd = -1;
      if (rejoin && n != 0 && mono_ms() - t_node >= 2000) {
        /* joining a running world, a node not there (it is down too): its link is down here; once it
         * restarts it links to this node (accept_main) */
        net_peer_t *p = &net->peer[n];
        atomic_store(&p->dead, 1);
        snprintf(p->why, sizeof p->why, "not reachable at %s when this daemon joined (%s)", peers[n],
                 strerror(e));
        EPD_LOGW(EPD_SUB_ENGINE, "data link to node %u: %s", n, p->why);
        break;
      }
      if (mono_ms() >= deadline) {
        snprintf(err, errlen, "data link to node %u at %s: %s (cluster.timeout_ms %u)", n, peers[n],
                 strerror(e), timeout_ms);
        freeaddrinfo(ai);
        return EPD_ERR_TIMEOUT;
      }
      usleep(50000);
    }
    if (fd < 0) {
      freeaddrinfo(ai);
      continue;
    }
    link_opts(fd);
    if (write_all(fd, &hello, sizeof hello)) {
      snprintf(err, errlen, "data link to node %u: %s", n, strerror(errno));
      close(fd);
      freeaddrinfo(ai);
      return EPD_ERR_PEER;
    }
    /* joining a running world: node n says whether it took the link (it refuses while its old link to
     * this node still looks up: asked again until the timeout) */
    uint8_t verdict = 0;
    if (rejoin && (read_all(fd, &verdict, 1, 2000) || verdict != 1)) {
      close(fd);
      fd = -1;
      if (mono_ms() >= deadline) {
        snprintf(err, errlen,
                 "data link to node %u at %s: refused (its link to this node still up?) within "
                 "cluster.timeout_ms %u",
                 n, peers[n], timeout_ms);
        freeaddrinfo(ai);
        return EPD_ERR_TIMEOUT;
      }
      usleep(200000);
      n--; /* again */
      freeaddrinfo(ai);
      continue;
    }
    freeaddrinfo(ai);
    net->peer[n].fd = fd;
  }
  /* Accept the higher nodes. */
  uint32_t want = rejoin ? 0 : nodes - 1 - node_rank;
  while (want) {
    int left = (int)(deadline > mono_ms() ? deadline - mono_ms() : 0);
    struct pollfd pf = {net->lfd, POLLIN, 0};
    if (poll(&pf, 1, left) <= 0) {
      char missing[128] = "";
      for (uint32_t n = node_rank + 1; n < nodes; n++)
        if (net->peer[n].fd < 0)
          snprintf(missing + strlen(missing), sizeof missing - strlen(missing), "%s%u", *missing ? ", " : "",
                   n);
      snprintf(err, errlen, "data links from node(s) %s not made within cluster.timeout_ms %u", missing,
               timeout_ms);
      return EPD_ERR_TIMEOUT;
    }
    int fd = accept4(net->lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) continue;
    if (read_all(fd, &got, sizeof got, 2000) || got.magic != HELLO_MAGIC ||
        memcmp(got.secret, secret, EPD_NET_SECRET_BYTES) || got.node <= node_rank || got.node >= nodes ||
        net->peer[got.node].fd >= 0) {
      EPD_LOGW(EPD_SUB_ENGINE, "data listener: refused a connection (bad hello, secret or node)");
      close(fd);
      continue;
    }
    link_opts(fd);
    net->peer[got.node].fd = fd;
    want--;
  }
  for (uint32_t n = 0; n < nodes; n++) {
    if (n == node_rank || net->peer[n].fd < 0) continue; /* (a node down when this one joined) */
    net_peer_t *p = &net->peer[n];
    struct timeval tv = {30, 0}; /* a peer that stops reading fails our sends instead of hanging them */
    setsockopt(p->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (pthread_create(&p->th, NULL, recv_main, p)) {
      snprintf(err, errlen, "pthread_create: %s", strerror(errno));
      return EPD_ERR_SYSTEM;
    }
    p->started = 1;
  }
  if (pthread_create(&net->acc_th, NULL, accept_main, net)) {
    snprintf(err, errlen, "pthread_create: %s", strerror(errno));
    return EPD_ERR_SYSTEM;
  }
  net->acc_started = 1;
  EPD_LOGI(EPD_SUB_ENGINE, "data links up: node %u of %u%s", node_rank, nodes,
           rejoin ? " (joined a running world)" : "");
  return EPD_OK;
}

int net_send_ctl(epd_net_t *net, uint32_t node, const char *group, const ctl_msg_t *m,
                 const epd_expert_map_t *map, const epd_weight_copy_t *cp);

uint32_t epd_net_link_epoch(epd_net_t *net, uint32_t node) {
  return node < MAX_NODES ? atomic_load(&net->peer[node].epoch) : 0;
}

int epd_net_remake_pending(epd_net_t *net) {
  return atomic_load(&net->remake_pending);
}
void epd_net_world_made(epd_net_t *net) {
  if (net) atomic_store(&net->remake_pending, 0);
}

/* A control frame made here (not received) for this node's control thread, as if from src_node. */
static void ctl_local(epd_net_t *net, uint32_t src_node, const ctl_msg_t *m) {
  net_frame_t *f = calloc(1, sizeof *f);
  uint8_t *b = calloc(1, sizeof(net_hdr_t) + sizeof *m);
  if (!f || !b) {
    free(f);
    free(b);
    return;
  }
  net_hdr_t h = {.magic = CTL_MAGIC, .src_node = src_node};
  memcpy(b, &h, sizeof h);
  memcpy(b + sizeof h, m, sizeof *m);
  f->src_node = src_node;
  f->local = 1;
  f->buf = b;
  f->len = sizeof h + sizeof *m;
  ctl_enqueue(net, f);
}

/* CTL_WORLD over id to every node of `to` (bit k: node k) whose link is up, and to this node's own
 * control thread; mask: the nodes of that world (0: every node). */
static void world_send(epd_net_t *net, uint64_t to, uint64_t mask, const uint8_t *id, const char *what) {
  ctl_msg_t m = {.kind = CTL_WORLD, .mask = mask};
  _Static_assert(sizeof m.why >= EPD_NET_COMM_ID_BYTES, "the id fits");
  memcpy(m.why, id, EPD_NET_COMM_ID_BYTES);
  for (uint32_t n = 0; n < net->nodes && n < 64; n++)
    if (n != net->node_rank && (to >> n & 1) && !atomic_load(&net->peer[n].dead) &&
        net_send_ctl(net, n, "", &m, NULL, NULL))
      EPD_LOGW(EPD_SUB_ENGINE, "the id of %s was not sent to node %u (its link is down)", what, n);
  ctl_local(net, net->node_rank, &m);
}

void epd_net_world_remake(epd_net_t *net, uint32_t except, const uint8_t *id) {
  atomic_store(&net->remake_pending, 1);
  world_send(net, ~(except < 64 ? 1ull << except : 0), 0, id, "the new world communicator");
}

void epd_net_world_without(epd_net_t *net, uint64_t live, const uint8_t *id) {
  world_send(net, live, live, id, "the world communicator without the lost nodes");
}

/* A restarted node connects to this one again: the link to it must be down (its old daemon is gone); the
 * old receiver is stopped and joined, the new connection takes its place, and the control thread is
 * told (a local frame: link_up) so that the engine forgets what it knew of that node's groups. */
static void revive(epd_net_t *net, uint32_t node, int fd) {
  net_peer_t *p = &net->peer[node];
  if (p->fd >= 0) shutdown(p->fd, SHUT_RDWR); /* a receiver still blocked on the old connection returns */
  if (p->started) pthread_join(p->th, NULL);
  p->started = 0;
  pthread_mutex_lock(&p->send_mu);
  if (p->fd >= 0) close(p->fd);
  p->fd = fd;
  p->why[0] = 0;
  struct timeval tv = {30, 0};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  link_opts(fd);
  atomic_fetch_add(&p->epoch, 1);
  atomic_store(&p->dead, 0);
  pthread_mutex_unlock(&p->send_mu);
  net_drop_queued(net, NULL, (int)node); /* the old daemon's parts still queued are not the new one's */
  EPD_LOGI(EPD_SUB_ENGINE, "data link to node %u up again (its daemon restarted)", node);
  const ctl_msg_t up = {.kind = CTL_LINK_UP};
  ctl_local(net, node, &up); /* before its first frame: what that sets must not be wiped by link_up */
  if (pthread_create(&p->th, NULL, recv_main, p)) {
    peer_dead(p, "%s", "pthread_create failed");
    return;
  }
  p->started = 1;
}

static void *accept_main(void *arg) {
  epd_net_t *net = arg;
  pthread_setname_np(pthread_self(), "epd-netacc");
  struct {
    uint32_t magic, node;
    uint8_t secret[EPD_NET_SECRET_BYTES];
  } got;
  while (!atomic_load(&net->stop)) {
    struct pollfd pf = {net->lfd, POLLIN, 0};
    if (poll(&pf, 1, 200) <= 0) continue;
    int fd = accept4(net->lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) continue;
    const uint8_t no = 0, yes = 1;
    /* node 0 never joins again (a restart of node 0 makes a new world) */
    if (read_all(fd, &got, sizeof got, 2000) || got.magic != HELLO_MAGIC ||
        memcmp(got.secret, net->secret, EPD_NET_SECRET_BYTES) || got.node >= net->nodes ||
        got.node == net->node_rank || got.node == 0) {
      EPD_LOGW(EPD_SUB_ENGINE, "data listener: refused a connection (bad hello, secret or node)");
      close(fd);
      continue;
    }
    if (!atomic_load(&net->peer[got.node].dead)) {
      EPD_LOGW(EPD_SUB_ENGINE,
               "data listener: refused node %u: its link is up (two daemons with that node rank, "
               "or its old link not yet found dead: it asks again)",
               got.node);
      write_all(fd, &no, 1);
      close(fd);
      continue;
    }
    if (write_all(fd, &yes, 1)) {
      close(fd);
      continue;
    }
    revive(net, got.node, fd);
  }
  return NULL;
}

void epd_net_destroy(epd_net_t *net) {
  if (!net) return;
  atomic_store(&net->stop, 1);
  if (net->acc_started) pthread_join(net->acc_th, NULL); /* before the receivers: it may start one */
  for (int n = 0; n < MAX_NODES; n++) {
    net_peer_t *p = &net->peer[n];
    if (p->fd >= 0) shutdown(p->fd, SHUT_RDWR);
    if (p->started) pthread_join(p->th, NULL);
    if (p->fd >= 0) close(p->fd);
    pthread_mutex_destroy(&p->send_mu);
  }
  if (net->lfd >= 0) close(net->lfd);
  while (net->frames) {
    net_frame_t *f = net->frames;
    net->frames = f->next;
    free(f->buf);
    free(f);
  }
  while (net->ctl_head) {
    net_frame_t *f = net->ctl_head;
    net->ctl_head = f->next;
    free(f->buf);
    free(f);
  }
  while (net->pending) {
    pending_map_t *p = net->pending;
    net->pending = p->next;
    net_pending_free(p);
  }
  pthread_cond_destroy(&net->ctl_cv);
  pthread_cond_destroy(&net->wait_cv);
  pthread_mutex_destroy(&net->mu);
  free(net);
}

uint32_t epd_net_nodes(const epd_net_t *net) {
  return net ? net->nodes : 1;
}
uint32_t epd_net_node_rank(const epd_net_t *net) {
  return net ? net->node_rank : 0;
}
void epd_net_counters(const epd_net_t *net, uint64_t *tx_bytes, uint64_t *rx_bytes, uint64_t *tx_frames,
                      uint64_t *rx_frames) {
  *tx_bytes = net ? atomic_load(&net->tx_bytes) : 0;
  *rx_bytes = net ? atomic_load(&net->rx_bytes) : 0;
  *tx_frames = net ? atomic_load(&net->tx_frames) : 0;
  *rx_frames = net ? atomic_load(&net->rx_frames) : 0;
}

int net_send(epd_net_t *net, uint32_t node, const void *buf, size_t len) {
  net_peer_t *p = &net->peer[node];
  if (atomic_load(&p->dead)) return -1;
  uint64_t l = len;
  pthread_mutex_lock(&p->send_mu);
  int rc = write_all(p->fd, &l, sizeof l) || write_all(p->fd, buf, len) ? -1 : 0;
  if (rc) peer_dead(p, "send: %s", strerror(errno)); /* under send_mu: never a link revived meanwhile */
  pthread_mutex_unlock(&p->send_mu);
  if (rc) return -1;
  atomic_fetch_add(&net->tx_bytes, len + 8);
  atomic_fetch_add(&net->tx_frames, 1);
  return 0;
}

/* Take the frame of (group, step) from node, dropping that node's stale frames of the group. later (may be
 * NULL): in the same pass, the smallest later step of that node's frames of the group received after frame
 * number `since` (0: none). One pass under one lock: a part of `step` sent before such a later one (one
 * link, in order) is then found, so a later part with none of `step` means node skipped `step`. */
net_frame_t *net_take(epd_net_t *net, const char *group, uint64_t step, uint32_t node, uint64_t since,
                      uint64_t *later) {
  net_frame_t *found = NULL;
  if (later) *later = 0;
  pthread_mutex_lock(&net->mu);
  for (net_frame_t **pp = &net->frames; *pp;) {
    net_frame_t *f = *pp;
    if (f->src_node != node || strcmp(f->group, group)) {
      pp = &f->next;
      continue;
    }
    if (f->step > step || (since == EPD_NET_TAKE_ONLY && f->step != step)) {
      if (later && f->seq > since && (!*later || f->step < *later)) *later = f->step;
      pp = &f->next;
      continue;
    }
    *pp = f->next;
    if (f->step == step && !found) {
      found = f;
    } else {
      free(f->buf);
      free(f);
    }
  }
  pthread_mutex_unlock(&net->mu);
  return found;
}

uint64_t epd_net_frame_seq(epd_net_t *net) {
  pthread_mutex_lock(&net->mu);
  uint64_t s = net->frame_seq;
  pthread_mutex_unlock(&net->mu);
  return s;
}

uint64_t epd_net_later_part(epd_net_t *net, const char *group, uint64_t step, uint32_t node, uint64_t since) {
  uint64_t later = 0;
  pthread_mutex_lock(&net->mu);
  for (net_frame_t *f = net->frames; f; f = f->next)
    if (f->src_node == node && f->step > step && f->seq > since && (!later || f->step < later) &&
        !strcmp(f->group, group))
      later = f->step;
  pthread_mutex_unlock(&net->mu);
  return later;
}

int net_has(epd_net_t *net, const char *group, uint64_t step, uint32_t node) {
  int has = 0;
  pthread_mutex_lock(&net->mu);
  for (net_frame_t *f = net->frames; f && !has; f = f->next)
    has = f->src_node == node && f->step == step && !strcmp(f->group, group);
  pthread_mutex_unlock(&net->mu);
  return has;
}

/* ---- frames for another backend's step protocol (engine_cuda_net.c) ------------------------------- */

int epd_net_send_payload(epd_net_t *net, uint32_t node, const char *group, uint64_t step, const void *payload,
                         size_t len) {
  uint8_t *b = malloc(sizeof(net_hdr_t) + len);
  if (!b) return -1;
  net_hdr_t h = {.magic = NET_MAGIC, .src_node = net->node_rank, .step = step};
  snprintf(h.group, sizeof h.group, "%s", group);
  memcpy(b, &h, sizeof h);
  if (len) memcpy(b + sizeof h, payload, len);
  int rc = net_send(net, node, b, sizeof h + len);
  free(b);
  return rc;
}

uint8_t *epd_net_take_payload(epd_net_t *net, const char *group, uint64_t step, uint32_t node, uint64_t since,
                              uint64_t *later, size_t *len) {
  net_frame_t *f = net_take(net, group, step, node, since, later);
  if (!f) return NULL;
  uint8_t *b = f->buf;
  *len = f->len - sizeof(net_hdr_t);
  memmove(b, b + sizeof(net_hdr_t), *len);
  free(f);
  return b;
}

void epd_net_add_bytes(epd_net_t *net, uint64_t tx, uint64_t rx) {
  atomic_fetch_add(&net->tx_bytes, tx);
  atomic_fetch_add(&net->rx_bytes, rx);
}

int epd_net_node_dead(epd_net_t *net, uint32_t node, char *why, size_t len) {
  net_peer_t *p = &net->peer[node];
  if (!atomic_load(&p->dead)) return 0;
  snprintf(why, len, "%s", p->why);
  return 1;
}

void epd_net_links(epd_net_t *net, char *out, size_t len, uint64_t *down) {
  size_t n = 0;
  *down = 0;
  if (len) out[0] = 0;
  for (uint32_t i = 0; net && i < net->nodes && i < MAX_NODES && i < 64; i++) {
    if (i == net->node_rank) continue;
    char why[160] = "";
    const int dead = epd_net_node_dead(net, i, why, sizeof why);
    if (dead) *down |= 1ull << i;
    if (n < len)
      n += (size_t)snprintf(out + n, len - n, "%snode %u %s%s%s", n ? "; " : "", i, dead ? "down" : "up",
                            dead                    ? ": "
                            : net->peer_draining[i] ? ", draining"
                                                    : "",
                            dead ? why : "");
  }
}

void epd_net_drop_group(epd_net_t *net, const char *group) {
  net_drop_queued(net, group, -1);
}
