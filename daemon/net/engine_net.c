/*
 * engine_net.c - the host backend across nodes: TCP links between daemons and the two-level step
 * (see engine_net.h for the protocol, README "Scale-out" for what it is for).
 *
 * Wire format: every frame is a uint64 byte length followed by a net_hdr_t, the sender's local
 * descriptors, its HT count per world rank, and the payload of the op. Integers are in host byte order:
 * every node of a world must have the same endianness (all supported targets are little-endian).
 * A receiver thread per peer queues frames under net->mu; the rank threads look them up by (group,
 * step, source node) and drop stale ones. A link that breaks marks its node dead: steps that wait for
 * it fail with EPD_ERR_PEER; a node that is merely slow fails the step with EPD_ERR_TIMEOUT through the
 * host backend's step timeout.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "core/engine_internal.h"
#include "core/log.h"
#include "net/engine_net.h"
#include "net/scaleout.h"

#define NET_MAGIC 0x4e445045u   /* "EPDN" */
#define HELLO_MAGIC 0x4f4c4845u /* "EHLO" */
#define CTL_MAGIC 0x4c435045u   /* "EPCL": a control frame (expert maps), not part of a step */
#define MAX_NODES EPD_MAX_RANKS
#define MAX_FRAME (1ull << 34)

typedef struct net_frame {
  struct net_frame *next;
  char group[EPD_GROUP_NAME_MAX];
  uint64_t step;
  uint32_t src_node;
  int local;    /* made by this daemon (a link's revival), not received */
  uint64_t seq; /* arrival order of the step frames (net->frame_seq) */
  uint8_t *buf; /* whole frame after the length */
  size_t len;
} net_frame_t;

typedef struct net_peer {
  int fd;
  pthread_t th;
  int started;
  atomic_int dead;
  char why[160];
  pthread_mutex_t send_mu;
  struct epd_net *net;
  uint32_t node;
  _Atomic uint32_t epoch; /* times the link was made again (revive) */
} net_peer_t;

/* A SetExpertMap on a node other than 0 waiting for node 0's answer. */
typedef struct ctl_wait {
  struct ctl_wait *next;
  uint64_t req_id;
  int done, status;
  uint32_t version;
  char why[320];
} ctl_wait_t;

struct epd_net {
  int lfd;
  uint32_t nodes, node_rank;
  net_peer_t peer[MAX_NODES];
  pthread_mutex_t mu;
  net_frame_t *frames;
  uint64_t frame_seq;        /* (mu) step frames received so far */
  atomic_int remake_pending; /* node 0: a world communicator id was sent and its remake has not ended here */
  atomic_int stop;
  _Atomic uint64_t tx_bytes, rx_bytes, tx_frames, rx_frames;
  /* Control frames (expert maps, drain notices), served in arrival order by one thread (engine_net.c's
   * ctl_main) that may take the engine lock: the receivers never do, so they always drain the links. */
  pthread_cond_t ctl_cv, wait_cv;
  net_frame_t *ctl_head, *ctl_tail;
  int ctl_on, ctl_stop, ctl_started;
  pthread_t ctl_th;
  epd_engine_t *eng;
  ctl_wait_t *waits;
  uint64_t next_req;
  /* (engine mu) node n drains; a group made here later fails its dispatches at once (a draining node
   * takes no attach, so no step of a group created after its notice) */
  int peer_draining[MAX_NODES];
  /* (engine mu) maps node 0 sent for groups this node did not have yet: staged when one is created */
  struct pending_map *pending;
  /* (engine mu) groups removed here (the newest 64): made again, one waits for the other nodes' step */
  char removed[64][EPD_GROUP_NAME_MAX];
  uint32_t removed_next;
#ifdef EPD_TEST_HOOKS
  _Atomic uint32_t weights_delay_ms; /* epd_net_test_weights_delay (test builds) */
#endif
  /* Restarted nodes: every node accepts a new link from a node whose link is down (accept_main); a node
   * that joined a running world (rejoined) makes every group as one made again (eng_net_group_created). */
  uint8_t secret[EPD_NET_SECRET_BYTES];
  pthread_t acc_th;
  int acc_started, rejoined;
  /* expert weights to send (net->mu): sent in order by the control thread, never under the engine lock */
  struct wq *wq_head, *wq_tail;
};

typedef struct pending_map {
  struct pending_map *next;
  char group[EPD_GROUP_NAME_MAX];
  epd_expert_map_t map; /* without weight copies: a map with copies is not kept */
} pending_map_t;

static void pending_free(pending_map_t *p) {
  epd_expert_map_free(&p->map);
  free(p);
}

typedef struct net_hdr {
  uint32_t magic, src_node;
  int32_t status, bad_rank;
  uint64_t step;
  char group[EPD_GROUP_NAME_MAX];
  uint32_t map_version, nlocal, world, hidden;
  uint32_t num_experts, topk, max_tokens;
  uint32_t staged_version; /* host backend: the staged map the sender reports (0: none), and its hash */
  uint64_t map_hash, staged_hash;
  uint64_t mask; /* the world ranks the sender steps without (groups that mask lost ranks) */
  char why[176]; /* the header keeps its size (320 bytes) */
} net_hdr_t;
_Static_assert(sizeof(net_hdr_t) == 320, "net_hdr_t changed size");

/* Control frames: see "expert maps across nodes" below. */
struct epd_expert_map;
enum {
  CTL_MAP_REQ = 1,
  CTL_MAP_SET = 2,
  CTL_MAP_REP = 3,
  CTL_DRAIN = 4,
  CTL_WEIGHTS = 5,
  CTL_GONE = 6,
  CTL_JOIN = 7,
  CTL_LOST = 8, /* version: a world rank of the sender; req_id: its first step without the rank's client (MAX:
                   back) */
  CTL_LINK_UP = 9, /* local only (revive): the link to src_node is up again */
  CTL_WORLD = 10, /* from node 0 (or local on node 0): make the world communicator again over the id in why */
  CTL_MASK = 11   /* version: a world rank of the sender, status: 1 masked there, 0 back (groups that mask) */
};
typedef struct ctl_msg {
  uint32_t kind, version;
  uint64_t req_id;
  int32_t status;
  uint32_t num_experts, ncopies, pad;
  char why[320];
  uint64_t hash; /* CTL_JOIN: the hash of the sender's active map (its version in version) */
} ctl_msg_t;

typedef struct net_desc {
  uint32_t op, bank, flags, num_tokens;
} net_desc_t;

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

static void peer_dead(net_peer_t *p, const char *fmt, const char *what) {
  if (atomic_exchange(&p->dead, 1)) return;
  snprintf(p->why, sizeof p->why, fmt, what);
  if (!atomic_load(&p->net->stop)) EPD_LOGE(EPD_SUB_ENGINE, "data link to node %u lost: %s", p->node, p->why);
}

/* Drop the queued step frames of group (NULL: any) from node (-1: any). */
static void drop_queued(epd_net_t *net, const char *group, int node) {
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

static int send_ctl(epd_net_t *net, uint32_t node, const char *group, const ctl_msg_t *m,
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

void epd_net_world_remake(epd_net_t *net, uint32_t except, const uint8_t *id) {
  atomic_store(&net->remake_pending, 1);
  ctl_msg_t m = {.kind = CTL_WORLD};
  _Static_assert(sizeof m.why >= EPD_NET_COMM_ID_BYTES, "the id fits");
  memcpy(m.why, id, EPD_NET_COMM_ID_BYTES);
  for (uint32_t n = 1; n < net->nodes; n++)
    if (n != except && !atomic_load(&net->peer[n].dead) && send_ctl(net, n, "", &m, NULL, NULL))
      EPD_LOGW(EPD_SUB_ENGINE, "the new world communicator's id was not sent to node %u (its link is down)",
               n);
  ctl_local(net, net->node_rank, &m);
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
  drop_queued(net, NULL, (int)node); /* the old daemon's parts still queued are not the new one's */
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
    pending_free(p);
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

static int net_send(epd_net_t *net, uint32_t node, const void *buf, size_t len) {
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
static net_frame_t *net_take(epd_net_t *net, const char *group, uint64_t step, uint32_t node, uint64_t since,
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
    if (f->step > step) {
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

static int net_has(epd_net_t *net, const char *group, uint64_t step, uint32_t node) {
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
  drop_queued(net, group, -1);
}

/* ---- the two-level step ------------------------------------------------------------------------- */

/* Per group (grp->net, made with the group on every engine of several nodes): what the other nodes
 * announced, and for the host backend's step what this node sent for the step being collected and the
 * remote ranks' inputs (allocated at its first step). */
typedef struct net_group {
  epd_net_t *net;
  /* Node n drains (its notice): it takes no dispatch of this group numbered >= drain_from[n] (it still
   * runs combines); UINT64_MAX: not draining. */
  uint64_t drain_from[EPD_MAX_RANKS];
  /* Node n has no client of this group since its step gone_from[n] (its notice; the group was removed
   * there): a step numbered >= that whose part from node n is not in fails here at once with
   * EPD_ERR_PEER. UINT64_MAX: the group exists there (or nothing was heard). */
  uint64_t gone_from[EPD_MAX_RANKS];
  /* The client of world rank r (of another node) died there at that node's step lost_from[r] (its
   * notice) and the group stays there for a new attach of the rank: a step numbered >= that whose part
   * from that node is not in fails here at once with EPD_ERR_PEER naming r. UINT64_MAX: none. */
  uint64_t lost_from[EPD_MAX_RANKS];
  uint64_t frames_since; /* the link frames received before this group was made (net_take's later) */
  /* Made while the other nodes may step the group already (a worker restarted): its first part waits
   * for every other node's reply (bit n of join_wait: node n's is due), and it takes the step the others
   * are at (join_step; see eng_net_joining). */
  uint64_t join_wait, join_step, join_ns;
  uint32_t join_map_version; /* the map the node at join_step runs, and its hash */
  uint64_t join_map_hash;
  /* The host backend's step (group_state): */
  int have_bufs;
  uint64_t sent_step; /* UINT64_MAX: nothing sent yet */
  uint64_t sent_mask; /* the masked ranks it was routed with */
  int lstatus, lbad;
  char lwhy[192];
  epd_ref_plan_t lplan;        /* routing of this node's tokens only (dedup, HT counts, statistics) */
  uint16_t *x[EPD_MAX_RANKS];  /* remote ranks' received tokens, [M, H] */
  int64_t *idx[EPD_MAX_RANKS]; /* [M, K], -1 where not received */
  float *w[EPD_MAX_RANKS];
  uint32_t *ht_local;        /* [W] this node's HT tokens per destination rank */
  net_frame_t *f[MAX_NODES]; /* frames of the step, taken when all are in */
  eng_map_vote_t vote;       /* map switches (eng_vote_*) */
} net_group_t;

#define NG(grp) ((net_group_t *)(grp)->net)

static void free_bufs(net_group_t *ng) {
  epd_ref_plan_free(&ng->lplan);
  for (int r = 0; r < EPD_MAX_RANKS; r++) {
    free(ng->x[r]);
    free(ng->idx[r]);
    free(ng->w[r]);
    ng->x[r] = NULL;
    ng->idx[r] = NULL;
    ng->w[r] = NULL;
  }
  free(ng->ht_local);
  ng->ht_local = NULL;
  ng->have_bufs = 0;
}

void eng_net_group_free(eng_group_t *grp) {
  net_group_t *ng = grp->net;
  if (!ng) return;
  /* The group's queued frames belong to this incarnation: a group of the same name created later
   * starts again at step 0 and must not take them. */
  drop_queued(ng->net, grp->name, -1);
  free_bufs(ng);
  eng_vote_reset(&ng->vote);
  for (int n = 0; n < MAX_NODES; n++)
    if (ng->f[n]) {
      free(ng->f[n]->buf);
      free(ng->f[n]);
    }
  free(ng);
  grp->net = NULL;
}

static epd_result_t group_init(epd_engine_t *eng, eng_group_t *grp) {
  net_group_t *ng = calloc(1, sizeof *ng);
  if (!ng) return EPD_ERR_NOMEM;
  ng->sent_step = UINT64_MAX;
  ng->net = eng->o.net;
  for (int n = 0; n < EPD_MAX_RANKS; n++)
    ng->drain_from[n] = ng->gone_from[n] = ng->lost_from[n] = UINT64_MAX;
  grp->net = ng;
  return EPD_OK;
}

uint64_t eng_net_drain_from(const eng_group_t *grp, uint32_t n) {
  return grp->net && n < EPD_MAX_RANKS ? NG(grp)->drain_from[n] : UINT64_MAX;
}
uint64_t eng_net_frames_since(const eng_group_t *grp) {
  return grp->net ? NG(grp)->frames_since : 0;
}

/* The host backend's step state of grp, its buffers allocated at the first call. */
static net_group_t *group_state(epd_engine_t *eng, eng_group_t *grp) {
  net_group_t *ng = grp->net;
  if (!ng || ng->have_bufs) return ng;
  const epd_ref_geom_t *g = &grp->g;
  uint32_t L = (uint32_t)eng->o.num_ranks, me = eng->o.node_rank;
  int ok = epd_ref_plan_init(&ng->lplan, g) == EPD_OK;
  ng->ht_local = calloc(g->num_ranks, sizeof *ng->ht_local);
  ok = ok && ng->ht_local;
  for (uint32_t r = 0; r < g->num_ranks && ok; r++) {
    if (r / L == me) continue;
    ng->x[r] = calloc((size_t)g->max_tokens * g->hidden, 2);
    ng->idx[r] = malloc((size_t)g->max_tokens * g->topk * 8);
    ng->w[r] = calloc((size_t)g->max_tokens * g->topk, 4);
    ok = ng->x[r] && ng->idx[r] && ng->w[r];
  }
  if (!ok) {
    free_bufs(ng);
    return NULL;
  }
  ng->have_bufs = 1;
  return ng;
}

static int op_ok(uint32_t op) {
  return op >= EPD_OP_LL_DISPATCH && op <= EPD_OP_HT_COMBINE;
}

uint64_t epd_net_map_hash(const epd_expert_map_t *m) {
  uint64_t h = 1469598103934665603ull;
#define MIX(v)             \
  do {                     \
    h ^= (uint64_t)(v);    \
    h *= 1099511628211ull; \
  } while (0)
  MIX(m->version);
  for (uint32_t e = 0; e < m->num_experts; e++) {
    MIX(m->nrep[e]);
    for (uint32_t i = 0; i < m->nrep[e]; i++) {
      MIX(m->rep[e][i].rank);
      MIX(m->rep[e][i].slot);
    }
  }
#undef MIX
  return h;
}

/* Does token (src, t) of plan p have an entry on a rank of node n? */
static int goes_to(const epd_ref_plan_t *p, uint32_t L, uint32_t src, uint32_t t, uint32_t n) {
  const epd_ref_geom_t *g = &p->g;
  const int32_t *d = &p->dst_rank[((size_t)src * g->max_tokens + t) * g->topk];
  for (uint32_t k = 0; k < g->topk; k++)
    if (d[k] >= 0 && (uint32_t)d[k] / L == n) return 1;
  return 0;
}

/* acc += this node's part of OUT[src][t]: its ranks' weighted expert outputs (LL) / rows (HT). */
static void add_partial(const epd_ref_plan_t *p, int mode, uint32_t L, uint32_t node,
                        const uint16_t *const *y, uint32_t src, uint32_t t, float *acc) {
  const epd_ref_geom_t *g = &p->g;
  uint32_t R = g->num_ranks, M = g->max_tokens, K = g->topk, H = g->hidden;
  if (mode == EPD_MODE_LL) {
    size_t row = ((size_t)src * M + t) * K;
    for (uint32_t k = 0; k < K; k++) {
      int32_t d = p->dst_rank[row + k];
      if (d < 0 || (uint32_t)d / L != node || !y[d]) continue; /* !y: a rank masked since the dispatch */
      const uint16_t *yr = y[d] + ((size_t)p->dst_slot[row + k] * R * M + p->dst_pos[row + k]) * H;
      float w = p->weight[row + k];
      for (uint32_t h = 0; h < H; h++) acc[h] += w * epd_bf16_to_f32(yr[h]);
    }
  } else {
    const int32_t *hp = &p->ht_pos[((size_t)src * M + t) * R];
    for (uint32_t r = node * L; r < (node + 1) * L; r++) {
      if (hp[r] < 0 || !y[r]) continue;
      const uint16_t *yr = y[r] + (size_t)hp[r] * H;
      for (uint32_t h = 0; h < H; h++) acc[h] += epd_bf16_to_f32(yr[h]);
    }
  }
}

/* A growing byte buffer for frames. */
typedef struct obuf {
  uint8_t *p;
  size_t len, cap;
  int oom;
} obuf_t;
static void *oput(obuf_t *b, const void *src, size_t n) {
  if (b->oom) return NULL;
  if (b->len + n > b->cap) {
    size_t c = b->cap ? b->cap * 2 : 4096;
    while (c < b->len + n) c *= 2;
    uint8_t *q = realloc(b->p, c);
    if (!q) {
      b->oom = 1;
      return NULL;
    }
    b->p = q;
    b->cap = c;
  }
  void *at = b->p + b->len;
  if (src) memcpy(at, src, n);
  b->len += n;
  return at;
}

/* ---- expert-map switches (both backends; engine_internal.h) ---- */

struct wout; /* expert weights owed to other nodes (below) */
static struct wout *weights_retry(epd_engine_t *eng, eng_group_t *grp);
static void weights_queue(epd_net_t *net, const char *group, struct wout *w);

void eng_vote_switch(epd_engine_t *eng, eng_group_t *grp, eng_map_vote_t *v, uint64_t step) {
  if (!v->agree || v->agree_step + 1 != step) return;
  if (v->rep.version != v->agree_version || v->rep_hash != v->agree_hash) return;
  if (eng_apply_staged_version(eng, grp, &v->rep, v->rep_copies))
    EPD_LOGE(EPD_SUB_ENGINE, "group %s: staged map version %u agreed by every node is gone on node %u",
             grp->name, v->rep.version, eng->o.node_rank);
  v->agree = 0;
}

void eng_vote_report(epd_engine_t *eng, eng_group_t *grp, eng_map_vote_t *v) {
  /* weights this node owes other nodes and could not read when it staged their map */
  if (grp->wdefer && eng->o.net) weights_queue(eng->o.net, grp->name, weights_retry(eng, grp));
  eng_weights_clock(grp);
  /* a map whose copies into this node wait for bytes from another node, or whose copies from this node
   * still wait to be read here, is not reported yet, so no node switches to it before every destination
   * holds what it needs; the map reported before stays reported while it is not active (its copies are
   * the first rep_copies staged ones, their bytes are here): a node left behind still catches up */
  uint32_t sv = grp->has_staged ? grp->staged.version : 0;
  int owed = 0;
  for (const eng_wdefer_t *d = grp->wdefer; d && sv; d = d->next) owed |= d->version <= sv;
  if (sv && (owed || !eng_weights_ready(eng, grp))) {
    if (v->rep.version > grp->map.version) return;
    sv = 0;
  }
  if (sv == v->rep.version) return;
  epd_expert_map_free(&v->rep);
  memset(&v->rep, 0, sizeof v->rep);
  v->rep_hash = 0;
  v->rep_copies = 0;
  if (sv && epd_ref_map_copy(&v->rep, &grp->staged) == EPD_OK) {
    v->rep_hash = epd_net_map_hash(&v->rep);
    v->rep_copies = grp->nstaged_copies;
  } else {
    memset(&v->rep, 0, sizeof v->rep); /* out of memory: report none; the map switches later */
  }
}

void eng_vote_agree(eng_map_vote_t *v, const eng_map_peer_t *peers, uint32_t npeers, uint64_t step) {
  uint32_t sv = v->rep.version;
  int all = sv != 0, behind = 0;
  for (uint32_t i = 0; i < npeers; i++) {
    if (peers[i].staged_version != sv || peers[i].staged_hash != v->rep_hash) all = 0;
    if (sv && peers[i].map_version == sv && peers[i].map_hash == v->rep_hash) behind = 1;
  }
  v->agree = all || behind;
  v->agree_step = step;
  v->agree_version = sv;
  v->agree_hash = v->rep_hash;
}

void eng_vote_reset(eng_map_vote_t *v) {
  epd_expert_map_free(&v->rep);
  memset(v, 0, sizeof *v);
}

/* The other nodes' map reports in the frames of the step being run (all in). */
static void net_agree(epd_engine_t *eng, eng_group_t *grp, net_group_t *ng) {
  eng_map_peer_t peers[MAX_NODES] = {{0}};
  uint32_t np = 0;
  for (uint32_t n = 0; n < eng->o.nodes; n++) {
    if (n == eng->o.node_rank) continue;
    const net_hdr_t *h = (const net_hdr_t *)ng->f[n]->buf;
    peers[np++] = (eng_map_peer_t){h->staged_version, h->map_version, h->staged_hash, h->map_hash};
  }
  eng_vote_agree(&ng->vote, peers, np, grp->steps);
}

/* Build and send this node's frame of the step to every other node. */
static void send_step(epd_engine_t *eng, eng_group_t *grp, net_group_t *ng) {
  epd_net_t *net = eng->o.net;
  const epd_ref_geom_t *g = &grp->g;
  uint32_t L = (uint32_t)eng->o.num_ranks, me = eng->o.node_rank, base = me * L, W = g->num_ranks;
  uint32_t M = g->max_tokens, H = g->hidden, K = g->topk;
  /* Masked ranks of this node take no part: their descriptors are the first live rank's, with no tokens
   * (last_live_here in engine_host.c keeps one live). */
  const uint64_t mask = grp->mask;
  uint32_t first = base;
  while (first + 1 < base + L && (mask >> first & 1)) first++;
  const epd_desc_t *d0 = &grp->desc[first];
  int same = 1;
  for (uint32_t r = base; r < base + L; r++) {
    if (mask >> r & 1) {
      grp->desc[r] = *d0;
      grp->desc[r].num_tokens = 0;
      continue;
    }
    const epd_desc_t *d = &grp->desc[r];
    same &= op_ok(d->op) && d->bank < EPD_NUM_BANKS && d->op == d0->op && d->bank == d0->bank &&
            (d->flags & EPD_DESC_FP8) == (d0->flags & EPD_DESC_FP8);
  }
  ng->sent_mask = mask;
  ng->lstatus = EPD_OK;
  ng->lbad = -1;
  ng->lwhy[0] = 0;
  memset(ng->ht_local, 0, sizeof *ng->ht_local * W);
  int dispatch = same && eng_op_dispatch(d0->op),
      mode = d0->op <= EPD_OP_LL_COMBINE ? EPD_MODE_LL : EPD_MODE_HT;
  if (dispatch) {
    eng_vote_switch(eng, grp, &ng->vote, grp->steps);
    epd_ref_in_t in[EPD_MAX_RANKS];
    memset(in, 0, sizeof in);
    for (uint32_t r = base; r < base + L; r++) {
      eng_client_t *c = grp->client[r];
      if (mask >> r & 1) continue;
      in[r] =
          (epd_ref_in_t){grp->desc[r].num_tokens, eng_buf(c, EPD_BUF_X, d0->bank),
                         eng_buf(c, EPD_BUF_TOPK_IDX, d0->bank), eng_buf(c, EPD_BUF_TOPK_WEIGHTS, d0->bank)};
    }
    ng->lplan.renormalize = grp->renormalize;
    ng->lstatus =
        epd_ref_plan_build(&ng->lplan, eng_route_map(grp), in, &ng->lbad, ng->lwhy, sizeof ng->lwhy);
    if (!ng->lstatus) memcpy(ng->ht_local, ng->lplan.ht_recv, sizeof *ng->ht_local * W);
  }
  eng_vote_report(eng, grp, &ng->vote);
  const epd_ref_plan_t *gp = &grp->plan[d0->bank < EPD_NUM_BANKS ? d0->bank : 0];
  int combine = same && !dispatch && grp->plan_valid[d0->bank] && gp->mode == mode;
  if (same && !dispatch && !combine) {
    ng->lstatus = EPD_ERR_STATE;
    snprintf(ng->lwhy, sizeof ng->lwhy,
             "%s combine of bank %u without a successful %s dispatch of that bank "
             "on node %u",
             mode == EPD_MODE_LL ? "LL" : "HT", d0->bank, mode == EPD_MODE_LL ? "LL" : "HT", me);
  }
  const uint16_t *y[EPD_MAX_RANKS] = {0};
  if (combine)
    for (uint32_t r = base; r < base + L; r++)
      if (!(mask >> r & 1))
        y[r] = eng_buf(grp->client[r], mode == EPD_MODE_LL ? EPD_BUF_LL_Y : EPD_BUF_HT_Y, d0->bank);
  for (uint32_t n = 0; n < eng->o.nodes; n++) {
    if (n == me) continue;
    obuf_t b = {0};
    net_hdr_t *h = oput(&b, NULL, sizeof *h);
    if (h) {
      memset(h, 0, sizeof *h);
      h->magic = NET_MAGIC;
      h->src_node = me;
      h->status = ng->lstatus;
      h->bad_rank = ng->lbad;
      h->step = grp->steps;
      snprintf(h->group, sizeof h->group, "%s", grp->name);
      h->map_version = grp->map.version;
      h->map_hash = epd_net_map_hash(&grp->map);
      h->staged_version = ng->vote.rep.version;
      h->staged_hash = ng->vote.rep_hash;
      h->nlocal = L;
      h->world = W;
      h->num_experts = g->num_experts;
      h->hidden = H;
      h->topk = K;
      h->max_tokens = M;
      h->mask = mask;
      snprintf(h->why, sizeof h->why, "%.*s", (int)sizeof h->why - 1, ng->lwhy);
    }
    for (uint32_t r = base; r < base + L; r++) {
      net_desc_t nd = {grp->desc[r].op, grp->desc[r].bank, grp->desc[r].flags, grp->desc[r].num_tokens};
      oput(&b, &nd, sizeof nd);
    }
    oput(&b, ng->ht_local, sizeof *ng->ht_local * W);
    if (dispatch && !ng->lstatus) {
      /* Each token once per destination node, only if it routes to a rank there. */
      for (uint32_t r = base; r < base + L; r++) {
        size_t at = b.len;
        uint32_t cnt = 0;
        oput(&b, &cnt, 4);
        for (uint32_t t = 0; t < ng->lplan.num_tokens[r]; t++) {
          if (!goes_to(&ng->lplan, L, r, t, n)) continue;
          const epd_ref_in_t *ir = NULL;
          (void)ir;
          eng_client_t *c = grp->client[r];
          const uint16_t *x = eng_buf(c, EPD_BUF_X, d0->bank);
          const int64_t *ix = eng_buf(c, EPD_BUF_TOPK_IDX, d0->bank);
          const float *wt = eng_buf(c, EPD_BUF_TOPK_WEIGHTS, d0->bank);
          oput(&b, &t, 4);
          oput(&b, x + (size_t)t * H, (size_t)H * 2);
          oput(&b, ix + (size_t)t * K, (size_t)K * 8);
          oput(&b, wt + (size_t)t * K, (size_t)K * 4);
          cnt++;
        }
        if (!b.oom) memcpy(b.p + at, &cnt, 4);
      }
    } else if (combine) {
      /* One float32 partial per (token of node n, this node). */
      float *acc = malloc(sizeof(float) * H);
      for (uint32_t s = n * L; s < (n + 1) * L && acc; s++) {
        size_t at = b.len;
        uint32_t cnt = 0;
        oput(&b, &cnt, 4);
        for (uint32_t t = 0; t < gp->num_tokens[s]; t++) {
          if (!goes_to(gp, L, s, t, me)) continue;
          for (uint32_t hh = 0; hh < H; hh++) acc[hh] = 0;
          add_partial(gp, mode, L, me, y, s, t, acc);
          oput(&b, &t, 4);
          oput(&b, acc, sizeof(float) * H);
          cnt++;
        }
        if (!b.oom) memcpy(b.p + at, &cnt, 4);
      }
      if (!acc) b.oom = 1;
      free(acc);
    }
    if (b.oom) {
      /* Tell the peer rather than leave it to time out. */
      b.len = 0;
      b.oom = 0;
      net_hdr_t hh = {.magic = NET_MAGIC,
                      .src_node = me,
                      .status = EPD_ERR_NOMEM,
                      .bad_rank = (int32_t)base,
                      .step = grp->steps,
                      .nlocal = 0,
                      .world = W,
                      .map_version = grp->map.version,
                      .map_hash = epd_net_map_hash(&grp->map),
                      .staged_version = ng->vote.rep.version,
                      .staged_hash = ng->vote.rep_hash,
                      .mask = mask};
      snprintf(hh.group, sizeof hh.group, "%s", grp->name);
      snprintf(hh.why, sizeof hh.why, "node %u: out of memory building the step's frame", me);
      oput(&b, &hh, sizeof hh);
      ng->lstatus = EPD_ERR_NOMEM;
      ng->lbad = (int)base;
      snprintf(ng->lwhy, sizeof ng->lwhy, "%s", hh.why);
    }
    if (b.p) net_send(net, n, b.p, b.len);
    free(b.p);
  }
}

int eng_net_missing_rank(epd_engine_t *eng, const eng_group_t *grp, char *why, size_t len) {
  uint32_t L = (uint32_t)eng->o.num_ranks, me = eng->o.node_rank, base = me * L;
  for (uint32_t r = base; r < base + L; r++)
    if (!grp->arrived[r] && !(grp->mask >> r & 1)) {
      snprintf(why, len, "waited %u ms for rank %u", eng->o.step_timeout_ms, r);
      return (int)r;
    }
  const net_group_t *ng = grp->net;
  for (uint32_t n = 0; n < eng->o.nodes; n++)
    if (n != me && !(ng && ng->f[n]) && !net_has(eng->o.net, grp->name, grp->steps, n)) {
      snprintf(why, len, "waited %u ms for rank %u: node %u (ranks %u..%u) did not send its part of the step",
               eng->o.step_timeout_ms, n * L, n, n * L, n * L + L - 1);
      return (int)(n * L);
    }
  snprintf(why, len, "waited %u ms for the step", eng->o.step_timeout_ms);
  return -1;
}

static int fail(eng_net_result_t *res, int status, int peer, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int fail(eng_net_result_t *res, int status, int peer, const char *fmt, ...) {
  res->status = status;
  res->peer = peer;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(res->why, sizeof res->why, fmt, ap);
  va_end(ap);
  return 1;
}

static void drop_frames(net_group_t *ng) {
  for (int n = 0; n < MAX_NODES; n++)
    if (ng->f[n]) {
      free(ng->f[n]->buf);
      free(ng->f[n]);
      ng->f[n] = NULL;
    }
}

static int run_step(epd_engine_t *eng, eng_group_t *grp, net_group_t *ng, eng_net_result_t *res) {
  const epd_ref_geom_t *g = &grp->g;
  uint32_t L = (uint32_t)eng->o.num_ranks, me = eng->o.node_rank, base = me * L, W = g->num_ranks;
  uint32_t nodes = eng->o.nodes, M = g->max_tokens, H = g->hidden, K = g->topk;
  /* The global descriptors, world rank order; and each frame's parts. */
  epd_desc_t d[EPD_MAX_RANKS];
  const uint8_t *pay[MAX_NODES] = {0}, *end[MAX_NODES] = {0};
  const uint32_t *htc[MAX_NODES] = {0};
  net_agree(eng, grp, ng);
  /* A node that could not build its frame (out of memory) fails the step everywhere. */
  if (ng->lstatus == EPD_ERR_NOMEM) return fail(res, EPD_ERR_NOMEM, ng->lbad, "%s", ng->lwhy);
  for (uint32_t n = 0; n < nodes; n++) {
    if (n == me) {
      for (uint32_t r = base; r < base + L; r++) d[r] = grp->desc[r];
      htc[n] = ng->ht_local;
      continue;
    }
    net_frame_t *f = ng->f[n];
    const net_hdr_t *h = (const net_hdr_t *)f->buf;
    if (h->nlocal == 0) return fail(res, h->status ? h->status : EPD_ERR_PEER, h->bad_rank, "%s", h->why);
    if (h->num_experts != g->num_experts || h->hidden != H || h->topk != K || h->max_tokens != M)
      return fail(res, EPD_ERR_MISMATCH, (int)(n * L),
                  "group %s has num_experts %u, hidden %u, topk %u, max_tokens %u "
                  "on node %u but %u, %u, %u, %u on node %u (the first attach on each node fixes it)",
                  grp->name, h->num_experts, h->hidden, h->topk, h->max_tokens, n, g->num_experts, H, K, M,
                  me);
    if (h->nlocal != L || h->world != W ||
        f->len < sizeof *h + (size_t)L * sizeof(net_desc_t) + (size_t)W * 4)
      return fail(res, EPD_ERR_MISMATCH, (int)(n * L),
                  "node %u sent a frame for %u ranks of %u, this node expects %u of %u "
                  "(engine.num_ranks differs?)",
                  n, h->nlocal, h->world, L, W);
    const net_desc_t *nd = (const net_desc_t *)(h + 1);
    for (uint32_t i = 0; i < L; i++) {
      memset(&d[n * L + i], 0, sizeof d[0]);
      d[n * L + i].op = nd[i].op;
      d[n * L + i].bank = nd[i].bank;
      d[n * L + i].flags = nd[i].flags;
      d[n * L + i].num_tokens = nd[i].num_tokens;
    }
    htc[n] = (const uint32_t *)(nd + L);
    pay[n] = (const uint8_t *)(htc[n] + W);
    end[n] = f->buf + f->len;
  }
  /* Groups that mask: every node must have routed with the same masked ranks. Each node masks its own
   * ranks and tells the others (CTL_MASK); a notice that came after a node sent its part fails the step
   * everywhere, and the next step runs with each node's own ranks as it said (taken from the frames). */
  const uint64_t mask = ng->sent_mask;
  res->mask = mask;
  uint64_t differ = 0;
  for (uint32_t n = 0; n < nodes; n++)
    if (n != me) differ |= ((const net_hdr_t *)ng->f[n]->buf)->mask ^ mask;
  if (differ) {
    for (uint32_t n = 0; n < nodes; n++) {
      if (n == me) continue;
      const uint64_t hm = ((const net_hdr_t *)ng->f[n]->buf)->mask;
      for (uint32_t r = n * L; r < (n + 1) * L && r < 64; r++) {
        if ((hm >> r & 1) && !(grp->mask >> r & 1)) eng_mask_rank(eng, grp, (int)r, "masked on its node");
        if (!(hm >> r & 1) && (grp->mask >> r & 1)) eng_unmask_rank(eng, grp, (int)r);
      }
    }
    const int r = __builtin_ctzll(differ);
    return fail(res, EPD_ERR_PEER, r,
                "rank %d is %smasked on node %u but not on every node yet: the step fails, the next one runs "
                "without the ranks each node masked",
                r, (mask >> r & 1) ? "" : "not ", me);
  }
  /* Descriptor checks of engine_host.c's execute_step, over the world (masked ranks' descriptors are their
   * node's first live rank's). */
  for (uint32_t r = 0; r < W; r++) {
    if (!op_ok(d[r].op))
      return fail(res, EPD_ERR_INVALID, (int)r, "rank %u: op %u out of range [1, %u]", r, d[r].op,
                  EPD_OP_MAX - 1);
    if (d[r].bank >= EPD_NUM_BANKS)
      return fail(res, EPD_ERR_INVALID, (int)r, "rank %u: bank %u out of range [0, %u)", r, d[r].bank,
                  EPD_NUM_BANKS);
    char why[160];
    const int fl = eng_check_flags(&d[r], r, 1, why, sizeof why);
    if (fl) return fail(res, fl, (int)r, "%s", why);
  }
  for (uint32_t r = 1; r < W; r++)
    if (d[r].op != d[0].op || d[r].bank != d[0].bank ||
        (eng_op_dispatch(d[r].op) && (d[r].flags & EPD_DESC_FP8) != (d[0].flags & EPD_DESC_FP8)))
      return fail(res, EPD_ERR_MISMATCH, (int)r,
                  "rank %u submitted op %u bank %u flags 0x%x, rank 0 op %u bank %u flags 0x%x", r, d[r].op,
                  d[r].bank, d[r].flags, d[0].op, d[0].bank, d[0].flags);
  uint32_t op = d[0].op, bank = d[0].bank;
  int fp8 = (d[0].flags & EPD_DESC_FP8) != 0, mode = op <= EPD_OP_LL_COMBINE ? EPD_MODE_LL : EPD_MODE_HT;
  epd_ref_plan_t *plan = &grp->plan[bank];
  res->map_version = grp->map.version;
  if (eng_op_dispatch(op)) {
    if (fp8 && H % 128)
      return fail(res, EPD_ERR_INVALID, -1, "FP8 dispatch needs hidden a multiple of 128 (hidden %u)", H);
    uint64_t mh = epd_net_map_hash(&grp->map);
    for (uint32_t n = 0; n < nodes; n++) {
      const net_hdr_t *h = n == me ? NULL : (const net_hdr_t *)ng->f[n]->buf;
      if (h && (h->map_version != grp->map.version || h->map_hash != mh))
        return fail(
            res, EPD_ERR_MISMATCH, (int)(n * L),
            "node %u dispatches with expert map version %u, node %u with version %u%s (set the same map on "
            "every node)",
            n, h->map_version, me, grp->map.version,
            h->map_version == grp->map.version ? " but different placements" : "");
    }
    /* Input errors, the lowest node's first (every node reports the same). */
    for (uint32_t n = 0; n < nodes; n++) {
      if (n == me && ng->lstatus) return fail(res, ng->lstatus, ng->lbad, "%s", ng->lwhy);
      const net_hdr_t *h = n == me ? NULL : (const net_hdr_t *)ng->f[n]->buf;
      if (h && h->status) return fail(res, h->status, h->bad_rank, "%s", h->why);
    }
    /* HT capacity over the world: the sum of every node's counts. */
    if (mode == EPD_MODE_HT)
      for (uint32_t r = 0; r < W; r++) {
        uint64_t sum = 0;
        for (uint32_t n = 0; n < nodes; n++) sum += htc[n][r];
        if (sum > g->ht_capacity)
          return fail(res, EPD_ERR_OVERFLOW, (int)r, "rank %u would receive %llu tokens, HT capacity %u", r,
                      (unsigned long long)sum, g->ht_capacity);
      }
    /* The global view: own ranks' arenas, the other ranks' received tokens (the rest routes nowhere). */
    epd_ref_in_t in[EPD_MAX_RANKS];
    epd_ref_out_t outs[EPD_MAX_RANKS], *out[EPD_MAX_RANKS];
    memset(outs, 0, sizeof outs);
    for (uint32_t r = 0; r < W; r++) {
      out[r] = NULL;
      if (r / L == me && (mask >> r & 1)) {
        memset(&in[r], 0, sizeof in[r]);
        continue;
      }
      if (r / L == me) {
        eng_ref_io(grp->client[r], mode, bank, d[r].num_tokens, &in[r], &outs[r]);
        out[r] = &outs[r];
        continue;
      }
      uint32_t T = d[r].num_tokens > M ? M : d[r].num_tokens;
      for (size_t i = 0; i < (size_t)T * K; i++) ng->idx[r][i] = -1;
      in[r] = (epd_ref_in_t){T, ng->x[r], ng->idx[r], ng->w[r]};
    }
    for (uint32_t n = 0; n < nodes; n++) {
      if (n == me) continue;
      const uint8_t *p = pay[n];
      size_t ent = 4 + (size_t)H * 2 + (size_t)K * 12;
      for (uint32_t r = n * L; r < (n + 1) * L; r++) {
        uint32_t cnt;
        if (p + 4 > end[n])
          return fail(res, EPD_ERR_PEER, (int)r, "node %u sent a truncated dispatch frame", n);
        memcpy(&cnt, p, 4);
        p += 4;
        if (cnt > in[r].num_tokens || (size_t)(end[n] - p) < cnt * ent)
          return fail(res, EPD_ERR_PEER, (int)r, "node %u sent a malformed dispatch frame", n);
        for (uint32_t i = 0; i < cnt; i++, p += ent) {
          uint32_t t;
          memcpy(&t, p, 4);
          if (t >= in[r].num_tokens)
            return fail(res, EPD_ERR_PEER, (int)r, "node %u sent token %u of %u", n, t, in[r].num_tokens);
          memcpy(ng->x[r] + (size_t)t * H, p + 4, (size_t)H * 2);
          memcpy(ng->idx[r] + (size_t)t * K, p + 4 + (size_t)H * 2, (size_t)K * 8);
          memcpy(ng->w[r] + (size_t)t * K, p + 4 + (size_t)H * 2 + (size_t)K * 8, (size_t)K * 4);
        }
      }
    }
    char why[256] = "";
    int bad = -1;
    grp->plan_valid[bank] = 0;
    plan->renormalize = grp->renormalize;
    /* route with the mask every node sent: a notice may have changed grp->mask since */
    const epd_expert_map_t *route = eng_route_map(grp);
    epd_expert_map_t sent_map;
    memset(&sent_map, 0, sizeof sent_map);
    if (mask != grp->mask) {
      if (mask && epd_ref_map_mask(&sent_map, &grp->map, mask))
        return fail(res, EPD_ERR_NOMEM, -1, "out of memory for the step's masked map");
      route = mask ? &sent_map : &grp->map;
    }
    epd_result_t rc = epd_ref_plan_build(plan, route, in, &bad, why, sizeof why);
    epd_expert_map_free(&sent_map);
    if (rc) return fail(res, rc, bad, "%s", why);
    rc = mode == EPD_MODE_LL ? epd_ref_ll_dispatch(plan, in, fp8, out)
                             : epd_ref_ht_dispatch(plan, in, fp8, out, &bad);
    if (rc) return fail(res, rc, bad, "dispatch failed (rank %d)", bad);
    grp->plan_valid[bank] = 1;
    grp->plan_mask[bank] = mask;
    grp->open_banks |= 1u << bank;
    res->map_version = plan->map_version;
    uint64_t row = (uint64_t)H * (fp8 ? 1 : 2) + (fp8 ? epd_ref_scale_blocks(H) * 4 : 0);
    for (uint32_t r = base; r < base + L; r++) {
      res->num_recv[r] = mode == EPD_MODE_LL ? plan->ll_recv[r] : plan->ht_recv[r];
      grp->step_dropped[r] = plan->dropped[r];
      grp->entries_dropped += plan->dropped[r];
      uint64_t rows = 0;
      for (uint32_t t = 0; t < plan->num_tokens[r]; t++)
        for (uint32_t k = 0; k < K; k++) rows += plan->dst_rank[((size_t)r * M + t) * K + k] >= 0;
      res->bytes[r] = rows * row;
    }
    /* Statistics count the tokens of this node's ranks (each node counts its own). */
    for (uint32_t e = 0; e < g->num_experts; e++) grp->expert_tokens[e] += ng->lplan.expert_tokens[e];
    for (size_t i = 0; i < (size_t)W * g->slots_per_rank; i++)
      grp->slot_tokens[i] += ng->lplan.slot_tokens[i];
    res->status = EPD_OK;
    return 1;
  }
  /* Combine: own partials plus every other node's, added in node order, rounded once. A node that
   * could not combine (no valid dispatch of the bank there) says so in its frame. */
  for (uint32_t n = 0; n < nodes; n++) {
    if (n == me && ng->lstatus) return fail(res, ng->lstatus, ng->lbad, "%s", ng->lwhy);
    const net_hdr_t *h = n == me ? NULL : (const net_hdr_t *)ng->f[n]->buf;
    if (h && h->status) return fail(res, h->status, h->bad_rank, "%s", h->why);
  }
  if (!grp->plan_valid[bank] || plan->mode != mode)
    return fail(res, EPD_ERR_STATE, -1, "%s combine of bank %u without a successful %s dispatch of that bank",
                mode == EPD_MODE_LL ? "LL" : "HT", bank, mode == EPD_MODE_LL ? "LL" : "HT");
  const uint16_t *y[EPD_MAX_RANKS] = {0};
  for (uint32_t r = base; r < base + L; r++)
    if (!(mask >> r & 1))
      y[r] = eng_buf(grp->client[r], mode == EPD_MODE_LL ? EPD_BUF_LL_Y : EPD_BUF_HT_Y, bank);
  /* Ranks masked since the dispatch: their expert outputs are gone, their entries dropped (as on one node).
   */
  const uint64_t gone = mask & ~grp->plan_mask[bank];
  grp->open_banks &= ~(1u << bank);
  /* Index the partial rows: part[n][(r - base) * M + t]. */
  const float **part = calloc((size_t)nodes * L * M, sizeof *part);
  float *acc = malloc(sizeof(float) * H);
  if (!part || !acc) {
    free(part);
    free(acc);
    return fail(res, EPD_ERR_NOMEM, -1, "out of memory combining");
  }
  int bad_frame = -1;
  for (uint32_t n = 0; n < nodes && bad_frame < 0; n++) {
    if (n == me) continue;
    const uint8_t *p = pay[n];
    size_t ent = 4 + (size_t)H * 4;
    for (uint32_t r = base; r < base + L && bad_frame < 0; r++) {
      uint32_t cnt;
      if (p + 4 > end[n]) {
        bad_frame = (int)n;
        break;
      }
      memcpy(&cnt, p, 4);
      p += 4;
      if ((size_t)(end[n] - p) < cnt * ent) bad_frame = (int)n;
      for (uint32_t i = 0; i < cnt && bad_frame < 0; i++, p += ent) {
        uint32_t t;
        memcpy(&t, p, 4);
        if (t >= M)
          bad_frame = (int)n;
        else
          part[((size_t)n * L + (r - base)) * M + t] = (const float *)(p + 4);
      }
    }
  }
  if (bad_frame >= 0) {
    free(part);
    free(acc);
    return fail(res, EPD_ERR_PEER, bad_frame * (int)L, "node %d sent a malformed combine frame", bad_frame);
  }
  for (uint32_t r = base; r < base + L; r++) {
    if (mask >> r & 1) continue;
    grp->step_dropped[r] = plan->dropped[r];
    if (gone) {
      const uint32_t nd = epd_ref_plan_routed_to(plan, r, gone);
      grp->step_dropped[r] += nd;
      grp->entries_dropped += nd;
    }
    uint16_t *o = eng_buf(grp->client[r], EPD_BUF_OUT, bank);
    for (uint32_t t = 0; t < plan->num_tokens[r]; t++) {
      for (uint32_t h = 0; h < H; h++) acc[h] = 0;
      for (uint32_t n = 0; n < nodes; n++) {
        if (n == me) {
          add_partial(plan, mode, L, me, y, r, t, acc);
          continue;
        }
        const float *pr = part[((size_t)n * L + (r - base)) * M + t];
        if (pr)
          for (uint32_t h = 0; h < H; h++) acc[h] += pr[h];
      }
      for (uint32_t h = 0; h < H; h++) o[(size_t)t * H + h] = epd_f32_to_bf16(acc[h]);
    }
    res->num_recv[r] = mode == EPD_MODE_LL ? plan->ll_recv[r] : plan->ht_recv[r];
    res->bytes[r] = (uint64_t)res->num_recv[r] * H * 2;
  }
  free(part);
  free(acc);
  res->status = EPD_OK;
  return 1;
}

int eng_net_step(epd_engine_t *eng, eng_group_t *grp, eng_net_result_t *res) {
  epd_net_t *net = eng->o.net;
  uint32_t L = (uint32_t)eng->o.num_ranks, me = eng->o.node_rank, base = me * L;
  memset(res, 0, sizeof *res);
  res->peer = -1;
  for (uint32_t r = base; r < base + L; r++)
    if (!grp->arrived[r] && !(grp->mask >> r & 1)) return 0; /* masked ranks take no part */
  net_group_t *ng = group_state(eng, grp);
  if (!ng) return fail(res, EPD_ERR_NOMEM, -1, "out of memory for the group's scale-out state");
  if (ng->sent_step != grp->steps) {
    if (eng_net_joining(eng, grp)) return 0; /* made just now: the step number comes with the replies */
    drop_frames(ng);
    send_step(eng, grp, ng);
    ng->sent_step = grp->steps;
  }
  for (uint32_t n = 0; n < eng->o.nodes; n++) {
    if (n == me || ng->f[n]) continue;
    uint64_t later; /* node n's part of a later step, came with none of this one's: it skipped this step */
    ng->f[n] = net_take(net, grp->name, grp->steps, n, NG(grp)->frames_since, &later);
    if (ng->f[n]) continue;
    net_peer_t *p = &net->peer[n];
    if (atomic_load(&p->dead)) {
      drop_frames(ng);
      return fail(res, EPD_ERR_PEER, (int)(n * L), "the data link to node %u (ranks %u..%u) is down: %s", n,
                  n * L, n * L + L - 1, p->why);
    }
    /* the local ranks' op (desc[base]'s; run_step checks that they agree) */
    if (NG(grp)->drain_from[n] <= grp->steps && eng_op_dispatch(grp->desc[base].op)) {
      /* its notice came after every frame it sent (one link, in order): this dispatch's part will not
       * come (a draining node still runs combines: their parts come as usual) */
      drop_frames(ng);
      return fail(res, EPD_ERR_DRAINING, (int)(n * L),
                  "node %u (ranks %u..%u) is draining: it takes no dispatch of group %s from step %llu on", n,
                  n * L, n * L + L - 1, grp->name, (unsigned long long)NG(grp)->drain_from[n]);
    }
    char why[256];
    const int gone = eng_net_gone(grp, n, L, grp->steps, why, sizeof why);
    if (gone >= 0) {
      drop_frames(ng);
      return fail(res, EPD_ERR_PEER, gone, "%s", why);
    }
    if (later) {
      drop_frames(ng);
      return fail(res, EPD_ERR_PEER, (int)(n * L), "%s",
                  eng_net_skipped(grp->name, n, L, grp->steps, later, why, sizeof why));
    }
    return 0;
  }
  int done = run_step(eng, grp, ng, res);
  drop_frames(ng);
  return done;
}

/* ---- expert maps across nodes (host backend) ---------------------------------------------------- */

/* A control frame: net_hdr_t (CTL_MAGIC, the group), then ctl_msg_t, then for MAP_REQ and MAP_SET the
 * map (nrep[E], rep[E][EPD_MAX_REPLICAS]) and the weight copies. Node 0 numbers and stages every map
 * (its own SetExpertMap calls and the MAP_REQs of the other nodes, one at a time under its engine
 * lock) and sends each staged map as MAP_SET to every other node, in version order on every link; a
 * MAP_REQ is answered with MAP_REP after the MAP_SET to the asking node, so a SetExpertMap that
 * returns a version has that map staged on its node. */

/* A map in a control frame: nrep[E], zero padding to 8 bytes, rep[E], copies[ncopies], so that rep and the
 * copies lie at aligned offsets of the frame (parse_map points into it). */
#define MAP_NREP_BYTES(E) (((size_t)(E) + 7u) & ~(size_t)7u)
_Static_assert((sizeof(net_hdr_t) + sizeof(ctl_msg_t)) % 8 == 0, "a map's arrays start at an 8-byte offset");

static int send_ctl(epd_net_t *net, uint32_t node, const char *group, const ctl_msg_t *m,
                    const epd_expert_map_t *map, const epd_weight_copy_t *cp) {
  uint32_t E = map ? m->num_experts : 0, nc = map ? m->ncopies : 0;
  size_t len = sizeof(net_hdr_t) + sizeof *m + MAP_NREP_BYTES(E) + (size_t)E * sizeof *map->rep +
               (size_t)nc * sizeof *cp;
  uint8_t *b = calloc(1, len);
  if (!b) return -1;
  net_hdr_t h = {.magic = CTL_MAGIC, .src_node = net->node_rank};
  snprintf(h.group, sizeof h.group, "%s", group);
  uint8_t *p = b;
  memcpy(p, &h, sizeof h);
  p += sizeof h;
  memcpy(p, m, sizeof *m);
  p += sizeof *m;
  if (E) {
    memcpy(p, map->nrep, E);
    p += MAP_NREP_BYTES(E); /* the padding stays zero (calloc) */
    memcpy(p, map->rep, (size_t)E * sizeof *map->rep);
    p += (size_t)E * sizeof *map->rep;
  }
  if (nc) memcpy(p, cp, (size_t)nc * sizeof *cp);
  int rc = net_send(net, node, b, len);
  free(b);
  return rc;
}

/* ---- expert weights between nodes ----
 * A node that stages a map (node 0 first, then every other node as its MAP_SET comes) reads, for each of
 * the map's copies whose source rank is its own and whose destination is on another node, the source
 * slot's weights (they are final: the source holds its expert in the active map and no staged copy
 * fills it; its control thread reads them, weights_read) and sends them to the destination's node as a
 * CTL_WEIGHTS frame: ctl_msg_t (version: the map's; req_id: the copy, 16 bits each of src rank, src slot, dst
 * rank, dst slot; status and why: a source that could not be read), then the bytes. The destination keeps
 * them (eng_wblob_put) and reports the map in its step frames only once every copy into it has its bytes
 * (eng_vote_report), so every node switches when every destination can write its slots; the switch writes
 * them. */
typedef struct wout {
  struct wout *next;
  uint32_t node;
  ctl_msg_t m;
  uint8_t *frame; /* net_hdr_t and ctl_msg_t (written when sent), then the bytes: read in place */
  uint64_t bytes;
  /* the source slot, read by the control thread (weights_read) from this group incarnation's client */
  epd_weight_copy_t cp;
  uint64_t gserial, client_id;
} wout_t;
#define WREAD_CHUNK (4ull << 20) /* bytes read under one hold of the engine lock */
#define WOUT_HDR (sizeof(net_hdr_t) + sizeof(ctl_msg_t))

/* A group's frames queued for the control thread. */
typedef struct wq {
  struct wq *next;
  char group[EPD_GROUP_NAME_MAX];
  wout_t *w;
} wq_t;

static uint64_t copy_id(const epd_weight_copy_t *cp) {
  return (uint64_t)(cp->src_rank & 0xffffu) << 48 | (uint64_t)(cp->src_slot & 0xffffu) << 32 |
         (uint64_t)(cp->dst_rank & 0xffffu) << 16 | (cp->dst_slot & 0xffffu);
}
_Static_assert(EPD_MAX_RANKS <= 0x10000, "copy_id packs ranks in 16 bits");

static int copy_out(const epd_engine_t *eng, const epd_weight_copy_t *cp) {
  return eng_rank_local(eng, cp->src_rank) && !eng_rank_local(eng, cp->dst_rank);
}

/* (mu) The frame of one copy: its source slot's bytes (read later, by the control thread), or (status != 0)
 * why there are none. */
static wout_t *wout_make(epd_engine_t *eng, eng_group_t *grp, const epd_weight_copy_t *cp, uint32_t version,
                         int status, const char *why) {
  wout_t *w = calloc(1, sizeof *w);
  if (!w) return NULL;
  w->node = cp->dst_rank / (uint32_t)eng->o.num_ranks;
  w->m = (ctl_msg_t){.kind = CTL_WEIGHTS, .version = version, .req_id = copy_id(cp), .status = status};
  if (status) {
    snprintf(w->m.why, sizeof w->m.why, "%s", why);
    return w;
  }
  w->bytes = grp->weight_bytes_per_slot;
  w->frame = w->bytes ? malloc(WOUT_HDR + w->bytes) : NULL;
  w->cp = *cp;
  w->gserial = grp->serial;
  eng_client_t *c = cp->src_rank < grp->g.num_ranks ? grp->client[cp->src_rank] : NULL;
  w->client_id = c ? c->id : 0;
  if (!w->bytes) {
    w->m.status = EPD_ERR_INVALID;
    snprintf(w->m.why, sizeof w->m.why, "group %s has no expert-weights region", grp->name);
  } else if (!w->frame) {
    w->m.status = EPD_ERR_NOMEM;
    snprintf(w->m.why, sizeof w->m.why, "out of memory for %llu bytes", (unsigned long long)w->bytes);
    w->bytes = 0;
  }
  return w;
}

/* (mu) Whether this node can read the source of a copy of map `version` now: its client is attached and no
 * older staged copy still fills the slot. */
static int source_ready(const eng_group_t *grp, const epd_weight_copy_t *cp, uint32_t version) {
  return cp->src_rank < grp->g.num_ranks && grp->client[cp->src_rank] &&
         !eng_slot_being_filled(grp, cp->src_rank, cp->src_slot, version);
}

/* (mu) After this node staged `version` with these copies (grp NULL or status != 0: it could not stage it,
 * so the destinations learn why at once instead of waiting): the frames it owes other nodes. A source it
 * cannot read yet is kept in grp->wdefer and read at a later step frame (weights_retry). */
static wout_t *weights_out(epd_engine_t *eng, eng_group_t *grp, const epd_weight_copy_t *cp, uint32_t n,
                           uint32_t version, int status, const char *why) {
  wout_t *head = NULL, **tail = &head;
  for (uint32_t i = 0; i < n; i++) {
    if (!copy_out(eng, &cp[i])) continue;
    int st = status ? status : !grp ? EPD_ERR_NOT_FOUND : 0;
    const char *wy = status ? why : "the group does not exist on the source's node";
    if (!st && !source_ready(grp, &cp[i], version)) {
      eng_wdefer_t *d = calloc(1, sizeof *d);
      if (d) {
        *d = (eng_wdefer_t){grp->wdefer, cp[i], version};
        grp->wdefer = d;
        continue;
      }
      st = EPD_ERR_NOMEM;
      wy = "out of memory";
    }
    wout_t *w = wout_make(eng, grp, &cp[i], version, st, wy);
    if (!w) break; /* the destination waits eng_weights_wait_ms, then skips the copy */
    *tail = w;
    tail = &w->next;
  }
  return head;
}

/* (mu) The deferred sources that can be read now (those of maps already active are dropped: their switch
 * skipped the copy). */
static wout_t *weights_retry(epd_engine_t *eng, eng_group_t *grp) {
  wout_t *head = NULL, **tail = &head;
  for (eng_wdefer_t **pp = &grp->wdefer; *pp;) {
    eng_wdefer_t *d = *pp;
    if (d->version <= grp->map.version) {
      *pp = d->next;
      free(d);
      continue;
    }
    if (!source_ready(grp, &d->cp, d->version)) {
      pp = &d->next;
      continue;
    }
    wout_t *w = wout_make(eng, grp, &d->cp, d->version, 0, NULL);
    if (!w) break;
    *tail = w;
    tail = &w->next;
    *pp = d->next;
    free(d);
  }
  return head;
}

#ifdef EPD_TEST_HOOKS
void epd_net_test_weights_delay(epd_net_t *net, uint32_t ms) {
  atomic_store(&net->weights_delay_ms, ms);
}
#endif

static void wout_free(wout_t *w) {
  while (w) {
    wout_t *next = w->next;
    free(w->frame);
    free(w);
    w = next;
  }
}

/* Hand the frames to the control thread (any thread, engine lock held or not). */
static void weights_queue(epd_net_t *net, const char *group, wout_t *w) {
  if (!w) return;
  wq_t *q = calloc(1, sizeof *q);
  if (!q) { /* the destinations wait eng_weights_wait_ms, then skip the copies */
    wout_free(w);
    return;
  }
  snprintf(q->group, sizeof q->group, "%s", group);
  q->w = w;
  pthread_mutex_lock(&net->mu);
  if (!net->ctl_on) { /* stopping: nothing sends any more */
    pthread_mutex_unlock(&net->mu);
    wout_free(w);
    free(q);
    return;
  }
  if (net->wq_tail)
    net->wq_tail->next = q;
  else
    net->wq_head = q;
  net->wq_tail = q;
  pthread_cond_signal(&net->ctl_cv);
  pthread_mutex_unlock(&net->mu);
}

/* Read a frame's source slot (the control thread): WREAD_CHUNK bytes per hold of the engine lock, so the
 * node's steps wait at most one chunk's copy (from the GPU on cuda), not the whole slot's. Every chunk
 * comes from the same client of the same group incarnation; else the frame says why there are no bytes.
 * The bytes cannot change meanwhile: no node switches to the map (so no copy can fill this slot) before
 * the destination has them. */
static void weights_read(epd_net_t *net, const char *group, wout_t *w) {
  epd_engine_t *eng = net->eng;
  for (uint64_t off = 0; off < w->bytes && !w->m.status; off += WREAD_CHUNK) {
    const uint64_t n = w->bytes - off < WREAD_CHUNK ? w->bytes - off : WREAD_CHUNK;
    pthread_mutex_lock(&eng->mu);
    eng_group_t *grp = eng_find_group(eng, group);
    eng_client_t *c = grp && w->cp.src_rank < grp->g.num_ranks ? grp->client[w->cp.src_rank] : NULL;
    if (!grp || grp->serial != w->gserial) {
      w->m.status = EPD_ERR_NOT_FOUND;
      snprintf(w->m.why, sizeof w->m.why, "group %s was removed on node %u before the slot was read", group,
               net->node_rank);
    } else if (!c || c->id != w->client_id) {
      w->m.status = EPD_ERR_PEER;
      snprintf(w->m.why, sizeof w->m.why, "the client of rank %u %s while its slot was read", w->cp.src_rank,
               c ? "was replaced" : "left");
    } else {
      w->m.status = eng_slot_weights_io(eng, grp, w->cp.src_rank, w->cp.src_slot, off, n,
                                        w->frame + WOUT_HDR + off, 0, w->m.why, sizeof w->m.why);
    }
    pthread_mutex_unlock(&eng->mu);
  }
  if (w->m.status) {
    free(w->frame);
    w->frame = NULL;
    w->bytes = 0;
  }
}

/* Read, send and free (the control thread). */
static void weights_send(epd_net_t *net, const char *group, wout_t *w) {
#ifdef EPD_TEST_HOOKS
  const uint32_t delay = atomic_load(&net->weights_delay_ms);
  if (w && delay) usleep(delay * 1000u);
#endif
  while (w) {
    wout_t *next = w->next;
    if (!w->m.status) weights_read(net, group, w);
    /* an error frame has no bytes: its header alone */
    uint8_t *b = w->frame ? w->frame : malloc(WOUT_HDR);
    net_hdr_t h = {.magic = CTL_MAGIC, .src_node = net->node_rank};
    snprintf(h.group, sizeof h.group, "%s", group);
    int rc = -1;
    if (b) {
      memcpy(b, &h, sizeof h);
      memcpy(b + sizeof h, &w->m, sizeof w->m);
      rc = net_send(net, w->node, b, WOUT_HDR + w->bytes);
    }
    if (rc)
      EPD_LOGE(EPD_SUB_ENGINE,
               "group %s: the weights of a copy for map version %u not sent to node %u (%s): it "
               "waits %u ms for them, then skips the copy",
               group, w->m.version, w->node, b ? "link down" : "out of memory",
               eng_weights_wait_ms(net->eng));
    free(b);
    free(w);
    w = next;
  }
}

/* A CTL_WEIGHTS frame (the control thread). */
static void weights_in(epd_engine_t *eng, const net_frame_t *f, const ctl_msg_t *c, const char *group) {
  const size_t hl = sizeof(net_hdr_t) + sizeof *c;
  const uint64_t bytes = f->len - hl;
  const epd_weight_copy_t cp = {(uint32_t)(c->req_id >> 48), (uint32_t)(c->req_id >> 32) & 0xffffu,
                                (uint32_t)(c->req_id >> 16) & 0xffffu, (uint32_t)c->req_id & 0xffffu};
  pthread_mutex_lock(&eng->mu);
  eng_group_t *grp = eng_find_group(eng, group);
  const char *bad =
      !grp ? "the group does not exist here"
      : cp.dst_rank >= grp->g.num_ranks || !eng_rank_local(eng, cp.dst_rank) ||
              cp.src_rank >= grp->g.num_ranks || cp.src_rank / (uint32_t)eng->o.num_ranks != f->src_node
          ? "its ranks are not a copy from that node into this one"
      : cp.dst_slot >= grp->g.slots_per_rank || cp.src_slot >= grp->g.slots_per_rank
          ? "a slot is out of range"
      : !c->status && bytes != grp->weight_bytes_per_slot ? "its size is not the group's weights per slot"
                                                          : NULL;
  if (!bad && c->version <= grp->map.version) bad = "its map version is already active here";
  uint8_t *data = NULL;
  if (!bad && !c->status && bytes && !(data = malloc(bytes))) bad = "out of memory";
  if (!bad) {
    if (data) memcpy(data, f->buf + hl, bytes);
    eng_wblob_put(grp, &cp, c->version, c->status, c->why, data, c->status ? 0 : bytes);
  }
  pthread_mutex_unlock(&eng->mu);
  if (bad)
    EPD_LOGW(EPD_SUB_ENGINE,
             "group %s: weights of copy (%u,%u) -> (%u,%u) for map version %u from node %u "
             "dropped: %s",
             group, cp.src_rank, cp.src_slot, cp.dst_rank, cp.dst_slot, c->version, f->src_node, bad);
  else if (c->status)
    EPD_LOGW(EPD_SUB_ENGINE,
             "group %s: weights of copy (%u,%u) -> (%u,%u) for map version %u: node %u could not "
             "read them (%s); the copy is skipped at the switch",
             group, cp.src_rank, cp.src_slot, cp.dst_rank, cp.dst_slot, c->version, f->src_node, c->why);
  else
    EPD_LOGI(EPD_SUB_ENGINE,
             "group %s: weights of copy (%u,%u) -> (%u,%u) for map version %u received from node %u "
             "(%llu bytes)",
             group, cp.src_rank, cp.src_slot, cp.dst_rank, cp.dst_slot, c->version, f->src_node,
             (unsigned long long)bytes);
}

/* Parse a MAP_REQ / MAP_SET body into m (its arrays point into the frame; free nothing); -1 if
 * malformed. */
static int parse_map(const net_frame_t *f, const ctl_msg_t *c, epd_expert_map_t *m,
                     const epd_weight_copy_t **cp) {
  size_t E = c->num_experts, need = sizeof(net_hdr_t) + sizeof *c + MAP_NREP_BYTES(E) + E * sizeof *m->rep +
                                    (size_t)c->ncopies * sizeof **cp;
  if (!E || E > (1u << 20) || c->ncopies > (1u << 16) || f->len != need) return -1;
  memset(m, 0, sizeof *m);
  m->num_experts = c->num_experts;
  m->version = c->version;
  uint8_t *p = f->buf + sizeof(net_hdr_t) + sizeof *c;
  m->nrep = p;
  m->rep = (epd_replica_t(*)[EPD_MAX_REPLICAS])(void *)(p + MAP_NREP_BYTES(E));
  *cp = c->ncopies ? (const epd_weight_copy_t *)(void *)(p + MAP_NREP_BYTES(E) + E * sizeof *m->rep) : NULL;
  return 0;
}

/* (eng->mu, node 0) Stage a map with the next version and send it to every other node. */
static epd_result_t stage_and_send(epd_engine_t *eng, const char *group, const epd_expert_map_t *map,
                                   const epd_weight_copy_t *cp, uint32_t ncopies, uint32_t *version,
                                   wout_t **wo, char *err, size_t errlen) {
  epd_net_t *net = eng->o.net;
  eng_group_t *grp = eng_find_group(eng, group);
  if (!grp) {
    snprintf(err, errlen, "group \"%s\" not found on node 0 (attach it on every node before SetExpertMap)",
             group);
    return EPD_ERR_NOT_FOUND;
  }
  epd_result_t rc = eng_stage_map(eng, grp, map, cp, ncopies, 0, 1, version, err, errlen);
  if (rc) return rc;
  ctl_msg_t m = {
      .kind = CTL_MAP_SET, .version = *version, .num_experts = map->num_experts, .ncopies = ncopies};
  for (uint32_t n = 1; n < net->nodes; n++)
    if (send_ctl(net, n, group, &m, map, cp))
      EPD_LOGE(EPD_SUB_ENGINE,
               "group %s: expert map version %u not sent to node %u (link down): no node "
               "switches to it",
               group, *version, n);
  EPD_LOGI(EPD_SUB_ENGINE, "group %s: expert map version %u staged and sent to every node (%u weight copies)",
           group, *version, ncopies);
  *wo = weights_out(eng, grp, cp, ncopies, *version, 0, NULL); /* queued by the caller */
  return EPD_OK;
}

/* (engine mu) Keep a map for a group this node does not have yet: the last one node 0 sent per group
 * (node 0 sends them in staging order over one link; a lower version than a kept one means the group
 * was re-created on node 0, whose numbering restarted). At most engine.max_groups are kept, the oldest
 * dropped first. A map with weight copies is not kept (-2): copies staged on one incarnation of a group
 * must not run on another. */
static int pending_put(epd_engine_t *eng, epd_net_t *net, const char *group, const epd_expert_map_t *m,
                       uint32_t ncopies) {
  if (ncopies) return -2;
  pending_map_t **pp = &net->pending;
  uint32_t n = 0;
  for (; *pp; pp = &(*pp)->next, n++)
    if (!strcmp((*pp)->group, group)) break;
  if (!*pp && n >= (eng->o.max_groups ? eng->o.max_groups : 8) && net->pending) {
    pending_map_t *old = net->pending; /* the oldest: entries are appended */
    net->pending = old->next;
    if (pp == &old->next) pp = &net->pending;
    pending_free(old);
  }
  pending_map_t *p = calloc(1, sizeof *p);
  if (!p || epd_ref_map_copy(&p->map, m) != EPD_OK) {
    free(p);
    return -1;
  }
  snprintf(p->group, sizeof p->group, "%s", group);
  if (*pp) { /* replace the kept one in place */
    p->next = (*pp)->next;
    pending_free(*pp);
  }
  *pp = p;
  return 0;
}

/* (mu) To every other node: group grp is gone here from step `from` on (UINT64_MAX: it exists again). */
static void send_gone(epd_engine_t *eng, const eng_group_t *grp, uint64_t from) {
  epd_net_t *net = eng->o.net;
  ctl_msg_t m = {.kind = CTL_GONE, .req_id = from};
  for (uint32_t n = 0; n < eng->o.nodes; n++)
    if (n != eng->o.node_rank && send_ctl(net, n, grp->name, &m, NULL, NULL) && from != UINT64_MAX)
      EPD_LOGW(EPD_SUB_ENGINE,
               "group %s: the notice of its removal to node %u was not sent (its link is down)", grp->name,
               n);
}

/* (engine mu) name was removed here (and forget it: take), or remember that it was (put). */
static int removed_take(epd_net_t *net, const char *name) {
  for (uint32_t i = 0; i < 64; i++)
    if (net->removed[i][0] && !strcmp(net->removed[i], name)) {
      net->removed[i][0] = 0;
      return 1;
    }
  return 0;
}

void eng_net_group_removed(epd_engine_t *eng, eng_group_t *grp) {
  epd_net_t *net = eng->o.net;
  if (eng->o.nodes <= 1 || !net) return;
  send_gone(eng, grp, grp->steps);
  removed_take(net, grp->name); /* one entry per name */
  net->removed_next = (net->removed_next + 1) % 64;
  snprintf(net->removed[net->removed_next], sizeof net->removed[0], "%s", grp->name);
  /* made again here later, the group stages the newest map it had (the other nodes run it, or have it
   * staged): the maps then agree again through the frames' votes (a map with weight copies is not kept) */
  const epd_expert_map_t *m = grp->has_staged && !grp->nstaged_copies ? &grp->staged : &grp->map;
  if (m->version > 1 && pending_put(eng, eng->o.net, grp->name, m, 0))
    EPD_LOGW(EPD_SUB_ENGINE, "group %s: its expert map version %u is not kept for its next creation here",
             grp->name, m->version);
}

/* To node n, which made grp (or attached a lost rank of it) again: the step grp collects here (UINT64_MAX:
 * no such group here) and the map it runs (their version and hash, read under the engine lock). */
static void send_join(epd_net_t *net, uint32_t n, const char *group, uint64_t steps, uint32_t version,
                      uint64_t hash) {
  ctl_msg_t r = {.kind = CTL_JOIN, .req_id = steps, .version = version, .hash = hash};
  send_ctl(net, n, group, &r, NULL, NULL);
}

/* (mu) Node n's reply to this node's creation notice: the step it is at (UINT64_MAX: none). */
static void join_reply(eng_group_t *grp, uint32_t n, const ctl_msg_t *c) {
  if (!(NG(grp)->join_wait >> n & 1)) return;
  NG(grp)->join_wait &= ~(1ull << n);
  if (c->req_id == UINT64_MAX || c->req_id < NG(grp)->join_step) return;
  NG(grp)->join_step = c->req_id;
  NG(grp)->join_map_version = c->version;
  NG(grp)->join_map_hash = c->hash;
}

int eng_net_joining(epd_engine_t *eng, eng_group_t *grp) {
  epd_net_t *net = eng->o.net;
  if (NG(grp)->join_wait) {
    char why[160];
    for (uint32_t n = 0; n < eng->o.nodes && n < 64; n++)
      if (NG(grp)->join_wait >> n & 1 && epd_net_node_dead(net, n, why, sizeof why))
        NG(grp)->join_wait &= ~(1ull << n);
    if (NG(grp)->join_wait &&
        eng_now_ns() - NG(grp)->join_ns > (uint64_t)eng->o.step_timeout_ms * 1000000ull) {
      EPD_LOGW(EPD_SUB_ENGINE,
               "group %s: no reply to its creation notice from every node within %u ms: it "
               "steps on from step %llu",
               grp->name, eng->o.step_timeout_ms, (unsigned long long)grp->steps);
      NG(grp)->join_wait = 0;
    }
    if (NG(grp)->join_wait) return 1;
  }
  if (!NG(grp)->join_step) return 0;
  if (grp->steps == 0) {
    grp->steps = NG(grp)->join_step;
    /* the map they run, kept here when the group went (eng_net_group_removed) and staged at its
     * creation: active at once, so that the first dispatch's maps agree */
    if (grp->has_staged && !grp->nstaged_copies && grp->staged.version == NG(grp)->join_map_version &&
        epd_net_map_hash(&grp->staged) == NG(grp)->join_map_hash)
      eng_apply_staged_map(eng, grp);
    EPD_LOGI(EPD_SUB_ENGINE,
             "group %s: made again here while the other nodes step it: it runs from their "
             "step %llu, expert map version %u",
             grp->name, (unsigned long long)grp->steps, grp->map.version);
  } else if (NG(grp)->join_step > grp->steps) {
    /* a rank attached again after its client died: the others stepped on (failing) meanwhile */
    EPD_LOGI(EPD_SUB_ENGINE,
             "group %s: a rank attached again here; the other nodes are at step %llu: it runs "
             "from there (was at %llu)",
             grp->name, (unsigned long long)NG(grp)->join_step, (unsigned long long)grp->steps);
    grp->steps = NG(grp)->join_step;
  }
  NG(grp)->join_step = 0;
  return 0;
}

int eng_net_gone(const eng_group_t *grp, uint32_t n, uint32_t L, uint64_t step, char *why, size_t len) {
  if (n >= EPD_MAX_RANKS) return -1;
  /* a rank's dead client first: the group's removal there (its other clients leaving) may follow it */
  for (uint32_t r = n * L; r < n * L + L && r < EPD_MAX_RANKS; r++)
    if (NG(grp)->lost_from[r] <= step) {
      snprintf(why, len,
               "the client of rank %u died on node %u at its step %llu of group %s and has not been replaced",
               r, n, (unsigned long long)NG(grp)->lost_from[r], grp->name);
      return (int)r;
    }
  if (NG(grp)->gone_from[n] > step) return -1;
  snprintf(
      why, len,
      "node %u (ranks %u..%u) has no client of group %s since its step %llu (the group was removed there): "
      "its clients there must attach again",
      n, n * L, n * L + L - 1, grp->name, (unsigned long long)NG(grp)->gone_from[n]);
  return (int)(n * L);
}

const char *eng_net_skipped(const char *group, uint32_t n, uint32_t L, uint64_t step, uint64_t later,
                            char *why, size_t len) {
  snprintf(
      why, len,
      "node %u (ranks %u..%u) sent its part of step %llu of group %s but none of step %llu (the step failed "
      "there)",
      n, n * L, n * L + L - 1, (unsigned long long)later, group, (unsigned long long)step);
  return why;
}

/* (mu) To every other node: the client of local rank `rank` of grp is gone from step `from` on (UINT64_MAX:
 * the rank has a client again). */
static void send_lost(epd_engine_t *eng, const eng_group_t *grp, int rank, uint64_t from) {
  ctl_msg_t m = {.kind = CTL_LOST, .req_id = from, .version = (uint32_t)rank};
  for (uint32_t n = 0; n < eng->o.nodes; n++)
    if (n != eng->o.node_rank && send_ctl(eng->o.net, n, grp->name, &m, NULL, NULL))
      EPD_LOGW(EPD_SUB_ENGINE,
               "group %s: the notice that rank %d %s to node %u was not sent (its link is down)", grp->name,
               rank, from == UINT64_MAX ? "has a client again" : "lost its client", n);
}

void eng_net_rank_lost(epd_engine_t *eng, eng_group_t *grp, int rank, uint64_t from) {
  if (eng->o.nodes <= 1 || !eng->o.net) return;
  EPD_LOGW(EPD_SUB_ENGINE,
           "group %s: the client of rank %d died at step %llu: the other nodes fail the group's "
           "steps at once until the rank is attached again",
           grp->name, rank, (unsigned long long)from);
  send_lost(eng, grp, rank, from);
}

void eng_net_rank_back(epd_engine_t *eng, eng_group_t *grp, int rank) {
  epd_net_t *net = eng->o.net;
  if (eng->o.nodes <= 1 || !net) return;
  /* as at a creation: the others reply with the step they are at, taken here if it is ahead (replies to
   * the creation notice still due serve as well: they carry the same) */
  char why[160];
  if (!NG(grp)->join_wait) {
    NG(grp)->join_step = 0;
    NG(grp)->join_ns = eng_now_ns();
    for (uint32_t n = 0; n < eng->o.nodes && n < 64; n++)
      if (n != eng->o.node_rank && !epd_net_node_dead(net, n, why, sizeof why))
        NG(grp)->join_wait |= 1ull << n;
  }
  send_lost(eng, grp, rank, UINT64_MAX);
}

/* A rank of this node was masked or is back (groups that mask): the other nodes route without it, or
 * with it again, from the first step whose part they send after this notice (run_step fails a step
 * they sent before it). */
static void rank_masked(epd_engine_t *eng, eng_group_t *grp, int rank, int masked) {
  ctl_msg_t m = {.kind = CTL_MASK, .version = (uint32_t)rank, .status = masked, .req_id = grp->steps};
  for (uint32_t n = 0; n < eng->o.nodes; n++)
    if (n != eng->o.node_rank && send_ctl(eng->o.net, n, grp->name, &m, NULL, NULL))
      EPD_LOGW(EPD_SUB_ENGINE,
               "group %s: the notice that rank %d is %s to node %u was not sent (its link is down)",
               grp->name, rank, masked ? "masked" : "back", n);
}

uint64_t eng_net_first_unsent(const eng_group_t *grp) {
  const net_group_t *ng = grp->net; /* none yet: nothing sent */
  return ng && ng->sent_step == grp->steps ? grp->steps + 1 : grp->steps;
}

void eng_net_group_created(epd_engine_t *eng, eng_group_t *grp) {
  epd_net_t *net = eng->o.net;
  if (eng->o.nodes <= 1 || !net) return;
  /* the other nodes forget an earlier removal here and reply with the step they are at; made again
   * here (its workers restarted), the first part of the group waits for their replies and takes that
   * step (eng_net_joining); made for the first time, every node starts at step 0 */
  NG(grp)->join_wait = 0;
  NG(grp)->join_step = 0;
  NG(grp)->join_ns = eng_now_ns();
  /* parts of a later step that came before this creation are an earlier life's (net_take's later) */
  NG(grp)->frames_since = epd_net_frame_seq(net);
  char why[160];
  if (removed_take(net, grp->name) || net->rejoined) /* made again here, or this daemon restarted */
    for (uint32_t n = 0; n < eng->o.nodes && n < 64; n++)
      if (n != eng->o.node_rank && !epd_net_node_dead(net, n, why, sizeof why))
        NG(grp)->join_wait |= 1ull << n;
  send_gone(eng, grp, UINT64_MAX);
  /* a node that drains takes no step of a group made here after its notice */
  for (uint32_t n = 0; n < eng->o.nodes && n < MAX_NODES && n < EPD_MAX_RANKS; n++)
    if (net->peer_draining[n]) NG(grp)->drain_from[n] = 0;
  for (pending_map_t **pp = &net->pending; *pp; pp = &(*pp)->next) {
    pending_map_t *p = *pp;
    if (strcmp(p->group, grp->name)) continue;
    *pp = p->next;
    char err[320] = "";
    epd_result_t rc = eng_stage_map(eng, grp, &p->map, NULL, 0, p->map.version, 0, NULL, err, sizeof err);
    if (rc)
      EPD_LOGE(EPD_SUB_ENGINE,
               "group %s: expert map version %u kept from node 0 refused at the group's creation on "
               "node %u: %s (no node switches to it)",
               grp->name, p->map.version, net->node_rank, err);
    else
      EPD_LOGI(EPD_SUB_ENGINE,
               "group %s: expert map version %u kept from node 0 staged at the group's creation", grp->name,
               p->map.version);
    pending_free(p);
    return;
  }
}

/* (control thread) The link to node n is up again: its daemon restarted and joined the running world.
 * What this node knew of node n's groups (removed, draining, lost clients) is void; node 0 sends node n
 * the map each group runs, kept there until the group is made (a made group asks the others for their
 * step, as one made again: eng_net_group_created, and makes that map active if they run it). */
static void link_up(epd_engine_t *eng, uint32_t n) {
  epd_net_t *net = eng->o.net;
  const uint32_t L = (uint32_t)eng->o.num_ranks;
  uint32_t maps = 0;
  pthread_mutex_lock(&eng->mu);
  net->peer_draining[n] = 0;
  for (eng_group_t *g = eng->groups; g; g = g->next) {
    NG(g)->gone_from[n] = NG(g)->drain_from[n] = UINT64_MAX;
    for (uint32_t r = n * L; r < n * L + L && r < EPD_MAX_RANKS; r++) NG(g)->lost_from[r] = UINT64_MAX;
    if (net->node_rank != 0 || g->map.version <= 1) continue;
    ctl_msg_t m = {.kind = CTL_MAP_SET, .version = g->map.version, .num_experts = g->map.num_experts};
    if (!send_ctl(net, n, g->name, &m, &g->map, NULL)) maps++;
  }
  pthread_mutex_unlock(&eng->mu);
  EPD_LOGI(EPD_SUB_ENGINE, "node %u joined the running world again%s", n,
           net->node_rank == 0 ? "" : " (node 0 sends it the groups' expert maps)");
  if (net->node_rank == 0)
    EPD_LOGI(EPD_SUB_ENGINE, "node %u: the expert maps of %u groups sent to it", n, maps);
}

static void ctl_handle(epd_engine_t *eng, net_frame_t *f) {
  epd_net_t *net = eng->o.net;
  const net_hdr_t *h = (const net_hdr_t *)f->buf;
  ctl_msg_t c;
  if (f->len < sizeof *h + sizeof c) {
    EPD_LOGW(EPD_SUB_ENGINE, "node %u sent a truncated control frame", f->src_node);
    return;
  }
  memcpy(&c, f->buf + sizeof *h, sizeof c);
  c.why[sizeof c.why - 1] = 0;
  char group[EPD_GROUP_NAME_MAX];
  snprintf(group, sizeof group, "%s", f->group);
  const uint32_t L = (uint32_t)eng->o.num_ranks; /* ranks per node */
  if (c.kind == CTL_LINK_UP) {
    if (f->local && f->src_node < MAX_NODES) link_up(eng, f->src_node);
    return;
  }
  if (c.kind == CTL_WORLD) { /* why: the new world communicator's id (EPD_NET_COMM_ID_BYTES) */
    if (!f->local && f->src_node != 0) {
      EPD_LOGW(EPD_SUB_ENGINE, "node %u sent a world communicator id (only node 0 may): ignored",
               f->src_node);
      return;
    }
    pthread_mutex_lock(&eng->mu);
    if (eng->ops->world_remake) eng->ops->world_remake(eng, (const uint8_t *)c.why);
    pthread_mutex_unlock(&eng->mu);
    return;
  }
  if (c.kind == CTL_MAP_REP) {
    pthread_mutex_lock(&net->mu);
    for (ctl_wait_t *w = net->waits; w; w = w->next)
      if (w->req_id == c.req_id) {
        w->done = 1;
        w->status = c.status;
        w->version = c.version;
        snprintf(w->why, sizeof w->why, "%s", c.why);
      }
    pthread_cond_broadcast(&net->wait_cv);
    pthread_mutex_unlock(&net->mu);
    return;
  }
  if (c.kind == CTL_DRAIN) { /* req_id = the group's first step from which the sender takes no dispatch */
    if (f->src_node >= MAX_NODES || f->src_node >= EPD_MAX_RANKS) return;
    pthread_mutex_lock(&eng->mu);
    eng_group_t *grp = group[0] ? eng_find_group(eng, group) : NULL;
    if (grp) NG(grp)->drain_from[f->src_node] = c.req_id;
    if (!group[0]) {
      /* the last notice of a drain (after one per group of the sender): a group of this node that the
       * sender has not has no step it would take; nor has a group made here later */
      net->peer_draining[f->src_node] = c.req_id != UINT64_MAX;
      for (eng_group_t *g = eng->groups; g; g = g->next)
        if (c.req_id == UINT64_MAX || NG(g)->drain_from[f->src_node] == UINT64_MAX)
          NG(g)->drain_from[f->src_node] = c.req_id;
    }
    pthread_mutex_unlock(&eng->mu);
    if (!group[0]) {
      if (c.req_id != UINT64_MAX)
        EPD_LOGI(EPD_SUB_ENGINE,
                 "node %u is draining: the dispatches of groups it does not have fail here "
                 "with EPD_ERR_DRAINING",
                 f->src_node);
      return;
    }
    if (grp && c.req_id != UINT64_MAX)
      EPD_LOGI(EPD_SUB_ENGINE,
               "group %s: node %u is draining: its dispatches from step %llu on fail here "
               "with EPD_ERR_DRAINING",
               group, f->src_node, (unsigned long long)c.req_id);
    else if (grp)
      EPD_LOGI(EPD_SUB_ENGINE, "group %s: node %u takes steps again", group, f->src_node);
    return;
  }
  if (c.kind == CTL_WEIGHTS) {
    weights_in(eng, f, &c, group);
    return;
  }
  if (c.kind ==
      CTL_GONE) { /* req_id: the sender's first step without the group; UINT64_MAX: it exists again */
    if (f->src_node >= MAX_NODES || f->src_node >= EPD_MAX_RANKS) return;
    pthread_mutex_lock(&eng->mu);
    eng_group_t *grp = eng_find_group(eng, group);
    const uint64_t was = grp ? NG(grp)->gone_from[f->src_node] : UINT64_MAX, steps = grp ? grp->steps : 0;
    /* a creation notice is answered with the map this node runs (a removal needs nothing back) */
    const int made = c.req_id == UINT64_MAX;
    const uint32_t version = grp && made ? grp->map.version : 0;
    const uint64_t hash = grp && made ? epd_net_map_hash(&grp->map) : 0;
    int lost_r[EPD_MAX_RANKS], nlost = 0;
    const uint32_t me0 = net->node_rank * L;
    for (uint32_t r = me0; grp && made && r < me0 + L && r < EPD_MAX_RANKS; r++)
      if (grp->lost[r] && !grp->client[r]) lost_r[nlost++] = (int)r;
    if (grp) NG(grp)->gone_from[f->src_node] = c.req_id;
    if (grp && made) /* a group made there has none of its ranks' clients lost */
      for (uint32_t r = f->src_node * L; r < f->src_node * L + L && r < EPD_MAX_RANKS; r++)
        NG(grp)->lost_from[r] = UINT64_MAX;
    pthread_mutex_unlock(&eng->mu);
    if (made) {
      /* made there (again): tell it the step this node's group collects, which from now on waits for
       * its part (it takes this number before its first part goes out) */
      send_join(net, f->src_node, group, grp ? steps : UINT64_MAX, version, hash);
      /* and which of this node's ranks lost their client (its parts do not come until they attach again) */
      for (int k = 0; k < nlost; k++) {
        ctl_msg_t m = {.kind = CTL_LOST, .req_id = steps, .version = lost_r[k]};
        send_ctl(net, f->src_node, group, &m, NULL, NULL);
      }
    }
    if (grp && !made)
      EPD_LOGW(EPD_SUB_ENGINE,
               "group %s: removed on node %u at its step %llu (its last client there left): its "
               "steps from then on fail here with EPD_ERR_PEER",
               group, f->src_node, (unsigned long long)c.req_id);
    else if (grp && was != UINT64_MAX)
      EPD_LOGI(EPD_SUB_ENGINE,
               "group %s: made again on node %u; its steps wait for that node again from step %llu", group,
               f->src_node, (unsigned long long)steps);
    return;
  }
  if (c.kind == CTL_MASK) {
    const uint32_t r = c.version, n = f->src_node;
    if (n >= MAX_NODES || r >= EPD_MAX_RANKS || r / L != n) {
      EPD_LOGW(EPD_SUB_ENGINE, "node %u sent a notice about rank %u, not one of its ranks: ignored", n, r);
      return;
    }
    pthread_mutex_lock(&eng->mu);
    eng_group_t *grp = eng_find_group(eng, group);
    if (grp && c.status)
      eng_mask_rank(eng, grp, (int)r, "masked on its node");
    else if (grp)
      eng_unmask_rank(eng, grp, (int)r);
    pthread_mutex_unlock(&eng->mu);
    return;
  }
  if (c.kind == CTL_LOST) {
    const uint32_t r = c.version, n = f->src_node;
    if (n >= MAX_NODES || r >= EPD_MAX_RANKS || r / L != n) {
      EPD_LOGW(EPD_SUB_ENGINE, "node %u sent a notice about rank %u, not one of its ranks: ignored", n, r);
      return;
    }
    const int back = c.req_id == UINT64_MAX;
    pthread_mutex_lock(&eng->mu);
    eng_group_t *grp = eng_find_group(eng, group);
    const uint64_t steps = grp ? grp->steps : UINT64_MAX;
    const uint32_t version = grp && back ? grp->map.version : 0;
    const uint64_t hash = grp && back ? epd_net_map_hash(&grp->map) : 0;
    if (grp) NG(grp)->lost_from[r] = c.req_id;
    pthread_mutex_unlock(&eng->mu);
    if (back) send_join(net, n, group, steps, version, hash); /* taken there if it is ahead */
    if (grp && !back)
      EPD_LOGW(EPD_SUB_ENGINE,
               "group %s: the client of rank %u died on node %u at its step %llu: the group's steps "
               "from then on fail here with EPD_ERR_PEER until the rank is attached again",
               group, r, n, (unsigned long long)c.req_id);
    else if (grp)
      EPD_LOGI(EPD_SUB_ENGINE, "group %s: rank %u has a client again on node %u", group, r, n);
    return;
  }
  if (c.kind == CTL_JOIN) { /* req_id: the step the sender's group is at (UINT64_MAX: none there) */
    if (f->src_node >= MAX_NODES || f->src_node >= 64) return;
    pthread_mutex_lock(&eng->mu);
    eng_group_t *grp = eng_find_group(eng, group);
    if (grp) join_reply(grp, f->src_node, &c);
    pthread_mutex_unlock(&eng->mu);
    return;
  }
  epd_expert_map_t m;
  const epd_weight_copy_t *cp = NULL;
  if ((c.kind != CTL_MAP_REQ && c.kind != CTL_MAP_SET) || parse_map(f, &c, &m, &cp)) {
    EPD_LOGW(EPD_SUB_ENGINE, "node %u sent a malformed control frame (kind %u)", f->src_node, c.kind);
    return;
  }
  if (c.kind == CTL_MAP_REQ) {
    ctl_msg_t r = {.kind = CTL_MAP_REP, .req_id = c.req_id};
    if (net->node_rank != 0) {
      r.status = EPD_ERR_PROTOCOL;
      snprintf(r.why, sizeof r.why, "node %u is not node 0", net->node_rank);
    } else {
      wout_t *wo = NULL;
      pthread_mutex_lock(&eng->mu);
      r.status = stage_and_send(eng, group, &m, cp, c.ncopies, &r.version, &wo, r.why, sizeof r.why);
      pthread_mutex_unlock(&eng->mu);
      weights_queue(net, group, wo);
    }
    send_ctl(net, f->src_node, group, &r, NULL, NULL);
    return;
  }
  /* MAP_SET from node 0. */
  char err[320] = "";
  pthread_mutex_lock(&eng->mu);
  eng_group_t *grp = eng_find_group(eng, group);
  epd_result_t rc = grp ? eng_stage_map(eng, grp, &m, cp, c.ncopies, c.version, 0, NULL, err, sizeof err)
                        : EPD_ERR_NOT_FOUND;
  const int kept = grp ? 1 : pending_put(eng, net, group, &m, c.ncopies);
  /* the copies whose source is here: their bytes, or why this node cannot give them */
  wout_t *wo =
      weights_out(eng, grp, cp, c.ncopies, c.version, rc == EPD_ERR_NOT_FOUND ? 0 : (int)rc, rc ? err : NULL);
  pthread_mutex_unlock(&eng->mu);
  weights_queue(net, group, wo);
  if (rc == EPD_ERR_NOT_FOUND && kept == 0)
    EPD_LOGI(EPD_SUB_ENGINE,
             "group %s: expert map version %u from node 0 kept: the group does not exist on node "
             "%u yet; it is staged when the group is created here",
             group, c.version, net->node_rank);
  else if (rc == EPD_ERR_NOT_FOUND)
    EPD_LOGW(
        EPD_SUB_ENGINE,
        "group %s: expert map version %u from node 0 ignored: the group does not exist on "
        "node %u, and the map %s (no node switches to it; set it again once the group exists on every node)",
        group, c.version, net->node_rank,
        kept == -2 ? "carries weight copies, which are not kept" : "could not be kept (out of memory)");
  else if (rc)
    EPD_LOGE(EPD_SUB_ENGINE,
             "group %s: expert map version %u from node 0 refused on node %u: %s (no node "
             "switches to it)",
             group, c.version, net->node_rank, err);
  else
    EPD_LOGI(EPD_SUB_ENGINE, "group %s: expert map version %u staged from node 0 (%u weight copies)", group,
             c.version, c.ncopies);
}

static void *ctl_main(void *arg) {
  epd_engine_t *eng = arg;
  epd_net_t *net = eng->o.net;
  pthread_setname_np(pthread_self(), "epd-netctl");
  pthread_mutex_lock(&net->mu);
  for (;;) {
    while (!net->ctl_head && !net->wq_head && !net->ctl_stop) pthread_cond_wait(&net->ctl_cv, &net->mu);
    if (net->ctl_stop) break;
    if (!net->ctl_head && net->wq_head) { /* expert weights out once the incoming frames are handled (a
                                           * MAP_REP must not wait behind a large transfer) */
      wq_t *q = net->wq_head;
      net->wq_head = q->next;
      if (!net->wq_head) net->wq_tail = NULL;
      pthread_mutex_unlock(&net->mu);
      weights_send(net, q->group, q->w);
      free(q);
      pthread_mutex_lock(&net->mu);
      continue;
    }
    net_frame_t *f = net->ctl_head;
    net->ctl_head = f->next;
    if (!net->ctl_head) net->ctl_tail = NULL;
    pthread_mutex_unlock(&net->mu);
    ctl_handle(eng, f);
    free(f->buf);
    free(f);
    pthread_mutex_lock(&net->mu);
  }
  pthread_mutex_unlock(&net->mu);
  return NULL;
}

void eng_net_notify_drain(epd_engine_t *eng, int drain) {
  epd_net_t *net = eng->o.net;
  if (eng->o.nodes <= 1 || !net) return;
  for (eng_group_t *g = eng->groups; g; g = g->next) {
    /* both backends refuse dispatches only (combines still run), from the step the backend says: the
     * host backend still runs a step some local rank already joined (engine_host.c refuses only a first
     * arrival); cuda fails every dispatch from the group's next step on (its frame says
     * EPD_ERR_DRAINING, and a frame sent before the drain reaches the peers before this notice) */
    ctl_msg_t m = {.kind = CTL_DRAIN,
                   .req_id = !drain                 ? UINT64_MAX
                             : eng->ops->drain_step ? eng->ops->drain_step(g)
                                                    : g->steps};
    for (uint32_t n = 0; n < eng->o.nodes; n++)
      if (n != eng->o.node_rank && send_ctl(net, n, g->name, &m, NULL, NULL))
        EPD_LOGW(EPD_SUB_ENGINE, "group %s: the drain notice to node %u was not sent (its link is down)",
                 g->name, n);
  }
  /* then one for every group, those that do not exist here included (group ""; step 0: all of them) */
  ctl_msg_t m = {.kind = CTL_DRAIN, .req_id = drain ? 0 : UINT64_MAX};
  for (uint32_t n = 0; n < eng->o.nodes; n++)
    if (n != eng->o.node_rank) send_ctl(net, n, "", &m, NULL, NULL);
}

epd_result_t eng_net_ctl_start(epd_engine_t *eng, char *err, size_t errlen) {
  epd_net_t *net = eng->o.net;
  if (!net) return EPD_OK;
  pthread_mutex_lock(&net->mu);
  net->eng = eng;
  net->ctl_on = 1;
  net->ctl_stop = 0;
  pthread_mutex_unlock(&net->mu);
  int e = pthread_create(&net->ctl_th, NULL, ctl_main, eng);
  if (e) {
    snprintf(err, errlen, "pthread_create for the map control thread: %s", strerror(e));
    return EPD_ERR_SYSTEM;
  }
  net->ctl_started = 1;
  return EPD_OK;
}

void eng_net_ctl_stop(epd_engine_t *eng) {
  epd_net_t *net = eng->o.net;
  if (!net) return;
  pthread_mutex_lock(&net->mu);
  net->ctl_stop = 1;
  net->ctl_on = 0;
  pthread_cond_broadcast(&net->ctl_cv);
  pthread_mutex_unlock(&net->mu);
  if (net->ctl_started) pthread_join(net->ctl_th, NULL);
  net->ctl_started = 0;
  pthread_mutex_lock(&net->mu);
  while (net->ctl_head) {
    net_frame_t *f = net->ctl_head;
    net->ctl_head = f->next;
    free(f->buf);
    free(f);
  }
  net->ctl_tail = NULL;
  wq_t *q = net->wq_head;
  net->wq_head = net->wq_tail = NULL;
  net->eng = NULL;
  pthread_mutex_unlock(&net->mu);
  while (q) {
    wq_t *next = q->next;
    wout_free(q->w);
    free(q);
    q = next;
  }
}

epd_result_t eng_net_set_map(epd_engine_t *eng, const char *group, const epd_expert_map_t *map,
                             const epd_weight_copy_t *copies, uint32_t ncopies, uint32_t *version_out,
                             char *errbuf, size_t errlen) {
  epd_net_t *net = eng->o.net;
  uint32_t version = 0;
  epd_result_t rc;
  if (net->node_rank == 0) {
    wout_t *wo = NULL;
    pthread_mutex_lock(&eng->mu);
    rc = stage_and_send(eng, group, map, copies, ncopies, &version, &wo, errbuf, errlen);
    pthread_mutex_unlock(&eng->mu);
    weights_queue(net, group, wo);
    if (!rc && version_out) *version_out = version;
    return rc;
  }
  /* Refuse what this node can tell is wrong without asking node 0. */
  pthread_mutex_lock(&eng->mu);
  eng_group_t *grp = eng_find_group(eng, group);
  if (!grp) {
    snprintf(errbuf, errlen, "group \"%s\" not found", group);
    rc = EPD_ERR_NOT_FOUND;
  } else {
    rc = epd_ref_map_validate(map, grp->g.num_experts, grp->g.num_ranks, grp->g.slots_per_rank, errbuf,
                              errlen);
  }
  pthread_mutex_unlock(&eng->mu);
  if (rc) return rc;
  ctl_wait_t w = {.status = EPD_ERR_TIMEOUT};
  pthread_mutex_lock(&net->mu);
  w.req_id = ++net->next_req;
  w.next = net->waits;
  net->waits = &w;
  pthread_mutex_unlock(&net->mu);
  ctl_msg_t m = {
      .kind = CTL_MAP_REQ, .req_id = w.req_id, .num_experts = map->num_experts, .ncopies = ncopies};
  int sent = send_ctl(net, 0, group, &m, map, copies) == 0;
  uint32_t wait_ms = eng->o.step_timeout_ms > 10000 ? eng->o.step_timeout_ms : 10000;
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += wait_ms / 1000;
  dl.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
  if (dl.tv_nsec >= 1000000000L) dl.tv_sec++, dl.tv_nsec -= 1000000000L;
  pthread_mutex_lock(&net->mu);
  while (sent && !w.done && !atomic_load(&net->peer[0].dead))
    if (pthread_cond_timedwait(&net->wait_cv, &net->mu, &dl) == ETIMEDOUT) break;
  for (ctl_wait_t **pp = &net->waits; *pp; pp = &(*pp)->next)
    if (*pp == &w) {
      *pp = w.next;
      break;
    }
  pthread_mutex_unlock(&net->mu);
  if (!w.done) {
    char why[160] = "";
    if (epd_net_node_dead(net, 0, why, sizeof why)) {
      snprintf(errbuf, errlen, "SetExpertMap goes through node 0, and the data link to node 0 is down: %s",
               why);
      return EPD_ERR_PEER;
    }
    snprintf(errbuf, errlen,
             "node 0 did not answer this SetExpertMap within %u ms (if it staged the map, every "
             "node still switches to it together)",
             wait_ms);
    return EPD_ERR_TIMEOUT;
  }
  if (w.status) {
    snprintf(errbuf, errlen, "%s", w.why[0] ? w.why : eng_result_name(w.status));
    return w.status;
  }
  if (version_out) *version_out = w.version;
  return EPD_OK;
}

/* ---- the table the core calls ------------------------------------------------------------------ */

static void group_note(const eng_group_t *grp, uint32_t nodes, char *out, size_t len) {
  size_t nl = 0;
  if (len) out[0] = 0;
  const net_group_t *ng = grp->net;
  for (uint32_t n = 0; ng && n < nodes && n < EPD_MAX_RANKS; n++) {
    char one[64] = "";
    if (ng->gone_from[n] != UINT64_MAX)
      snprintf(one, sizeof one, "node %u removed it at step %llu", n, (unsigned long long)ng->gone_from[n]);
    else if (ng->drain_from[n] != UINT64_MAX)
      snprintf(one, sizeof one, "node %u drains from step %llu", n, (unsigned long long)ng->drain_from[n]);
    if (one[0] && nl < len) nl += (size_t)snprintf(out + nl, len - nl, "%s%s", nl ? "; " : "", one);
  }
}

static void links(const epd_engine_t *eng, char *out, size_t len, uint64_t *down, uint64_t *tx_bytes,
                  uint64_t *rx_bytes, uint64_t *tx_frames, uint64_t *rx_frames) {
  epd_net_links(eng->o.net, out, len, down);
  epd_net_counters(eng->o.net, tx_bytes, rx_bytes, tx_frames, rx_frames);
}

const eng_scaleout_t eng_net_scaleout = {
    .group_init = group_init,
    .group_created = eng_net_group_created,
    .rank_back = eng_net_rank_back,
    .rank_masked = rank_masked,
    .group_removed = eng_net_group_removed,
    .group_free = eng_net_group_free,
    .notify_drain = eng_net_notify_drain,
    .set_map = eng_net_set_map,
    .group_note = group_note,
    .links = links,
};
