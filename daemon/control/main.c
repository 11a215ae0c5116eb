/*
 * main.c - the epd daemon: arguments, configuration, then the modules in dependency order
 * (log, conf, events, engine, rpc, http, attach, notify), the libuv loop, and the same in reverse.
 * SIGTERM/SIGINT and the Drain RPC drain (stop new work, wait for clients up to drain_timeout_ms) then
 * exit 0; SIGHUP reloads what can be reloaded. An init failure prints why and exits 1.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "control/access.h"
#include "control/attach.h"
#include "control/cluster.h"
#include "control/state.h"
#include "control/conf.h"
#include "core/engine.h"
#include "control/events.h"
#include "control/http.h"
#include "core/log.h"
#include "control/notify.h"
#include "control/rpc.h"

#define DEFAULT_CONF "/etc/epd/epd.conf"
#define MAX_OVERRIDES 64
#define DRAIN_POLL_MS 50

enum { ST_STARTING, ST_READY, ST_DRAINING, ST_FAILED };
static const char *const state_names[] = {"starting", "ready", "draining", "failed"};

static struct {
  /* arguments */
  const char *conf_path;
  int conf_optional, check_only, foreground;
  const char *socket_override;
  const char *overrides[MAX_OVERRIDES];
  int noverrides;
  /* running state */
  uv_loop_t loop;
  uv_signal_t sig_term, sig_int, sig_hup;
  uv_async_t wake;
  uv_timer_t drain_timer;
  uv_timer_t failure_timer; /* watches for an engine failure */
  int exit_status;          /* of a normal shutdown: 1 after an engine failure */
  epd_engine_t *eng;
  atomic_int state;
  int exit_pending;
  uint64_t drain_deadline_ms;
  /* shared with the RPC thread */
  pthread_mutex_t lock;
  epd_conf_t conf;
  int drain_requested, drain_exit_requested;
  int drain_announced; /* loop thread: the drain event, health and notify were done */
} d = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void usage(FILE *f) {
  fprintf(f,
          "usage: epd [-c FILE] [-s SOCKET] [-o section.key=value]... [--check-config] [-f]\n"
          "  -c FILE          configuration file (default " DEFAULT_CONF
          " if it exists, else built-in defaults)\n"
          "  -s SOCKET        control socket path (overrides daemon.control_socket)\n"
          "  -o KEY=VALUE     set one key after the file (repeatable), e.g. -o engine.backend=host\n"
          "  --check-config   validate the configuration, print the effective values, exit 0 (valid) or 1\n"
          "  --help-config    list every key with its type, default, range and meaning\n"
          "  -f               log to stderr even when started by systemd (epd never forks)\n"
          "  -h, --help       this text;  --version  the version\n");
}

/* Defaults, then the file, then -o and -s; both socket paths are resolved once here so that the RPC
 * server, the attach socket, `epdctl config` and --check-config all show the paths in use, not "". */
static int load_config(epd_conf_t *c, char *err, size_t errlen) {
  char msg[512];
  epd_conf_defaults(c);
  if (d.conf_path && epd_conf_load(c, d.conf_path, d.conf_optional, msg, sizeof msg) != 0) {
    snprintf(err, errlen, "%s: %s", d.conf_path, msg);
    return -1;
  }
  for (int i = 0; i < d.noverrides; i++) {
    char key[128];
    const char *eq = strchr(d.overrides[i], '=');
    if (!eq || eq == d.overrides[i] || (size_t)(eq - d.overrides[i]) >= sizeof key) {
      snprintf(err, errlen, "-o '%s': expected section.key=value", d.overrides[i]);
      return -1;
    }
    snprintf(key, sizeof key, "%.*s", (int)(eq - d.overrides[i]), d.overrides[i]);
    if (epd_conf_set(c, key, eq + 1, msg, sizeof msg) != 0) {
      snprintf(err, errlen, "-o %s: %s", d.overrides[i], msg);
      return -1;
    }
  }
  if (d.socket_override &&
      epd_conf_set(c, "daemon.control_socket", d.socket_override, msg, sizeof msg) != 0) {
    snprintf(err, errlen, "-s: %s", msg);
    return -1;
  }
  char path[sizeof c->control_socket + 64];
  if (epd_conf_control_socket_path(c, path, sizeof path) != 0 || strlen(path) >= sizeof c->control_socket) {
    snprintf(err, errlen, "daemon.control_socket: resolved path is too long");
    return -1;
  }
  snprintf(c->control_socket, sizeof c->control_socket, "%s", path);
  if (epd_conf_attach_socket_path(c, path, sizeof path) != 0 || strlen(path) >= sizeof c->attach_socket) {
    snprintf(err, errlen, "daemon.attach_socket: resolved path is too long");
    return -1;
  }
  snprintf(c->attach_socket, sizeof c->attach_socket, "%s", path);
  return 0;
}

static int parse_args(int argc, char **argv) {
  static const struct option lo[] = {{"check-config", no_argument, NULL, 'C'},
                                     {"help-config", no_argument, NULL, 'H'},
                                     {"help", no_argument, NULL, 'h'},
                                     {"version", no_argument, NULL, 'V'},
                                     {NULL, 0, NULL, 0}};
  int ch;
  while ((ch = getopt_long(argc, argv, "c:s:o:fhV", lo, NULL)) != -1) {
    switch (ch) {
      case 'c':
        d.conf_path = optarg;
        break;
      case 's':
        d.socket_override = optarg;
        break;
      case 'o':
        if (d.noverrides == MAX_OVERRIDES) {
          fprintf(stderr, "epd: more than %d -o options\n", MAX_OVERRIDES);
          return 1;
        }
        d.overrides[d.noverrides++] = optarg;
        break;
      case 'f':
        d.foreground = 1;
        break;
      case 'C':
        d.check_only = 1;
        break;
      case 'H': {
        static char buf[16384];
        epd_conf_describe(buf, sizeof buf);
        fputs(buf, stdout);
        exit(0);
      }
      case 'V':
        printf("epd %s\n", EPD_VERSION);
        exit(0);
      case 'h':
        usage(stdout);
        exit(0);
      default:
        usage(stderr);
        return 1;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "epd: unexpected argument '%s'\n", argv[optind]);
    usage(stderr);
    return 1;
  }
  if (!d.conf_path) {
    d.conf_path = DEFAULT_CONF;
    d.conf_optional = 1; /* the packaged default may be absent: built-in defaults then */
  }
  return 0;
}

/* ---- RPC hooks (RPC thread) --------------------------------------------------------------------- */

static void hook_drain(void *arg, int exit_when_idle) {
  (void)arg;
  /* uv_async_send coalesces, so the request itself travels in fields under the lock. */
  pthread_mutex_lock(&d.lock);
  d.drain_requested = 1;
  d.drain_exit_requested |= exit_when_idle != 0;
  pthread_mutex_unlock(&d.lock);
  /* Visible before the RPC returns (a GetStatus right after a Drain says "draining" and no step starts);
   * the loop does the rest (event, health, notify, exit timer). */
  epd_engine_set_draining(d.eng, 1);
  atomic_store(&d.state, ST_DRAINING);
  uv_async_send(&d.wake);
}

static const char *hook_state(void *arg) {
  (void)arg;
  /* An engine that cannot run steps any more makes the daemon "failed" (health NOT_SERVING). */
  if (d.eng && epd_engine_failure(d.eng)) return "failed";
  return state_names[atomic_load(&d.state)];
}

static size_t hook_config_dump(void *arg, char *buf, size_t len) {
  (void)arg;
  pthread_mutex_lock(&d.lock);
  size_t n = epd_conf_dump(&d.conf, buf, len);
  pthread_mutex_unlock(&d.lock);
  return n;
}

/* ---- drain and exit (loop thread) --------------------------------------------------------------- */

static unsigned attached_clients(void) {
  epd_engine_snap_t s;
  if (epd_engine_snapshot(d.eng, &s) != EPD_OK) return 0;
  unsigned n = s.nclients;
  epd_engine_snapshot_free(&s);
  return n;
}

static void drain_tick(uv_timer_t *t) {
  unsigned n = attached_clients();
  if (n == 0) {
    EPD_LOGI(EPD_SUB_MAIN, "drained: no client attached, exiting");
  } else if (uv_now(&d.loop) >= d.drain_deadline_ms) {
    EPD_LOGW(EPD_SUB_MAIN, "drain timeout: %u client(s) still attached, exiting anyway", n);
  } else {
    epd_notify_status("draining: waiting for %u client(s)", n);
    return;
  }
  uv_timer_stop(t);
  uv_stop(&d.loop);
}

static void begin_drain(int exit_when_idle, const char *why) {
  if (!d.drain_announced) {
    d.drain_announced = 1;
    atomic_store(&d.state, ST_DRAINING);
    epd_engine_set_draining(d.eng, 1);
    epd_rpc_set_serving(0);
    epd_events_publish("drain", "", -1, 0, 0, 0, 0, "draining (%s)", why);
    EPD_LOGI(EPD_SUB_MAIN, "draining (%s): no new attach or dispatch", why);
    epd_notify_status("draining: no new attach or dispatch");
  }
  if (!exit_when_idle || d.exit_pending) return;
  d.exit_pending = 1;
  pthread_mutex_lock(&d.lock);
  uint32_t timeout = d.conf.drain_timeout_ms;
  pthread_mutex_unlock(&d.lock);
  d.drain_deadline_ms = uv_now(&d.loop) + timeout;
  epd_notify_stopping("stopping: draining clients");
  EPD_LOGI(EPD_SUB_MAIN, "exiting when no client is attached, at most %u ms from now", timeout);
  uv_timer_start(&d.drain_timer, drain_tick, 0, DRAIN_POLL_MS);
}

/* Engine failure: with engine.exit_on_failure, drain and exit 1 (systemd restarts a fresh engine). */
static void failure_tick(uv_timer_t *t) {
  const char *why = epd_engine_failure(d.eng);
  if (!why) return;
  pthread_mutex_lock(&d.lock);
  int do_exit = d.conf.exit_on_failure != 0;
  pthread_mutex_unlock(&d.lock);
  epd_notify_status("failed: %s", why);
  if (!do_exit) return;
  uv_timer_stop(t);
  EPD_LOGE(EPD_SUB_MAIN, "engine failed (%s): draining, then exiting with status 1 for a restart", why);
  d.exit_status = 1;
  begin_drain(1, "engine failed");
}

static void on_wake(uv_async_t *a) {
  (void)a;
  pthread_mutex_lock(&d.lock);
  int req = d.drain_requested, ex = d.drain_exit_requested;
  d.drain_requested = d.drain_exit_requested = 0;
  pthread_mutex_unlock(&d.lock);
  if (req) begin_drain(ex, "Drain RPC");
}

static void ready_status(void) {
  char st[160];
  snprintf(st, sizeof st, "ready: %d rank(s), backend %s, mode %s", epd_engine_num_ranks(d.eng),
           epd_engine_backend(d.eng), epd_engine_mode(d.eng));
  epd_notify_ready(st);
}

static void reload(void) {
  epd_conf_t next;
  char err[512], diff[4096];
  epd_notify_reloading();
  EPD_LOGI(EPD_SUB_CONF, "SIGHUP: reloading %s", d.conf_path);
  if (load_config(&next, err, sizeof err) != 0) {
    EPD_LOGE(EPD_SUB_CONF, "reload failed, keeping the running configuration: %s", err);
  } else {
    pthread_mutex_lock(&d.lock);
    int n = epd_conf_diff(&d.conf, &next, diff, sizeof diff);
    int applied = epd_conf_apply_reloadable(&d.conf, &next);
    epd_conf_t now = d.conf;
    pthread_mutex_unlock(&d.lock);
    for (char *line = strtok(diff, "\n"); line; line = strtok(NULL, "\n"))
      EPD_LOGI(EPD_SUB_CONF, "reload: %s", line);
    epd_log_set(now.log_level, now.log_subsystems);
    epd_attach_set_token_ttl(now.token_ttl_ms);
    epd_attach_set_limits(now.max_unredeemed_conns, now.max_unredeemed_per_uid);
    EPD_LOGI(EPD_SUB_CONF, "reload done: %d key(s) changed, %d applied, %d need a restart", n, applied,
             n - applied);
    EPD_LOGD(EPD_SUB_CONF, "log level is now %s", epd_log_level_name(now.log_level));
  }
  if (atomic_load(&d.state) == ST_DRAINING)
    epd_notify_ready("draining: no new attach or dispatch");
  else
    ready_status();
}

static void on_signal(uv_signal_t *s, int signum) {
  (void)s;
  if (signum == SIGHUP && d.exit_pending) {
    EPD_LOGW(EPD_SUB_CONF, "SIGHUP ignored: the daemon is stopping");
  } else if (signum == SIGHUP) {
    reload();
  } else if (d.exit_pending) {
    EPD_LOGW(EPD_SUB_MAIN, "%s again while draining: exiting now", strsignal(signum));
    uv_stop(&d.loop);
  } else {
    begin_drain(1, strsignal(signum));
  }
}

static void close_walk(uv_handle_t *h, void *arg) {
  (void)arg;
  if (!uv_is_closing(h)) uv_close(h, NULL);
}

static int make_socket_dir(const char *sock, char *err, size_t errlen) {
  char dir[EPD_PATH_MAX];
  snprintf(dir, sizeof dir, "%s", sock);
  char *slash = strrchr(dir, '/');
  if (!slash || slash == dir) return 0;
  *slash = '\0';
  /* systemd's RuntimeDirectory= makes /run/epd; for a user daemon make the last level only. */
  if (mkdir(dir, 0750) != 0 && errno != EEXIST) {
    snprintf(err, errlen, "cannot create socket directory '%s': %s", dir, strerror(errno));
    return -1;
  }
  return 0;
}

static epd_net_t *cluster_net; /* scale-out data links (cluster.h), NULL on one node */
/* The coordinator's id of the CUDA world communicator: it fails before the rendezvous where backend cuda
 * cannot start anyway. */
static int make_comm_id(uint8_t *id, char *err, size_t errlen) {
  return epd_engine_world_id("cuda", id, err, errlen) == EPD_OK ? 0 : -1;
}

int main(int argc, char **argv) {
  char err[1536];
  int stage = 0, rc;
  if (parse_args(argc, argv) != 0) return 1;
  signal(SIGPIPE, SIG_IGN);
  /* Under systemd (JOURNAL_STREAM set) records go to journald with their fields, unless -f. */
  epd_log_init(EPD_LOG_INFO, EPD_SUB_ALL, !d.foreground && getenv("JOURNAL_STREAM") != NULL);
  if (load_config(&d.conf, err, sizeof err) != 0) {
    fprintf(stderr, "epd: invalid configuration: %s\n", err);
    return 1;
  }
  if (d.check_only) {
    static char buf[16384];
    if (epd_cluster_check_tls(&d.conf, err, sizeof err) != 0) {
      fprintf(stderr, "epd: invalid configuration: %s\n", err);
      return 1;
    }
    epd_conf_dump(&d.conf, buf, sizeof buf);
    fputs(buf, stdout);
    return 0;
  }
  epd_log_set(d.conf.log_level, d.conf.log_subsystems);
  EPD_LOGI(EPD_SUB_MAIN, "epd %s starting (config %s%s)", EPD_VERSION, d.conf_path,
           d.conf_optional && access(d.conf_path, F_OK) != 0 ? ", absent: built-in defaults" : "");

  if ((rc = uv_loop_init(&d.loop)) != 0) {
    snprintf(err, sizeof err, "event loop: %s", uv_strerror(rc));
    goto fail;
  }
  stage = 1;
  if (epd_events_init(1024) != 0) {
    snprintf(err, sizeof err, "event ring: out of memory");
    goto fail;
  }
  stage = 2;
  epd_engine_opts_t eo = {.backend = d.conf.backend,
                          .num_ranks = (int)d.conf.num_ranks,
                          .max_experts = d.conf.max_experts,
                          .max_hidden = d.conf.max_hidden,
                          .max_topk = d.conf.max_topk,
                          .max_tokens = d.conf.max_tokens,
                          .slots_factor_pct = d.conf.slots_factor_pct,
                          .ht_capacity_factor = d.conf.ht_capacity_factor,
                          .ht_sms = d.conf.ht_sms,
                          .ht_ce_split = d.conf.ht_ce_split,
                          .cuda_mode = d.conf.cuda_mode,
                          .ll_blocks = d.conf.ll_blocks,
                          .idle_spin_ns = d.conf.idle_spin_ns,
                          .gin_probe = d.conf.gin_probe,
                          .max_groups = d.conf.max_groups,
                          .max_clients_per_rank = d.conf.max_clients_per_rank,
                          .max_arena_bytes = d.conf.max_arena_bytes,
                          .step_timeout_ms = d.conf.step_timeout_ms,
                          .rehome_replicas = d.conf.rehome_replicas};
  char eerr[1280] = "";
  static int devices[EPD_CONF_MAX_LIST];
  const int ndevices = epd_conf_parse_list(d.conf.devices, EPD_CONF_MAX_LIST - 1, devices, EPD_CONF_MAX_LIST,
                                           eerr, sizeof eerr);
  if (ndevices > 0 && ndevices != (int)d.conf.num_ranks) {
    snprintf(err, sizeof err,
             "engine.devices names %d GPU(s) for engine.num_ranks = %u ranks: give one per rank", ndevices,
             d.conf.num_ranks);
    goto fail;
  }
  if (ndevices > 0) eo.devices = devices;
  /* Scale-out: rendezvous and data links before the engine, so that READY means the world is formed. */
  static uint8_t comm_id[EPD_CLUSTER_COMM_ID_BYTES];
  if (epd_cluster_init(&d.conf, make_comm_id, &cluster_net, comm_id, eerr, sizeof eerr) != 0) {
    snprintf(err, sizeof err, "cluster (node %u of %u): %s", d.conf.node_rank, d.conf.nodes, eerr);
    goto fail;
  }
  if (cluster_net) {
    eo.nodes = d.conf.nodes;
    eo.node_rank = d.conf.node_rank;
    eo.rendezvous_tls = (uint32_t)epd_cluster_tls(&d.conf);
    eo.net = cluster_net;
    eo.ranks_per_node = d.conf.num_ranks; /* replicas on the source's node are preferred */
    /* auto stays host across nodes: every node must pick the same backend (it is an agreed key). */
    if (!strcmp(eo.backend, "auto")) eo.backend = "host";
    if (!strcmp(eo.backend, "cuda")) eo.comm_id = comm_id;
    eo.rejoined = (uint32_t)epd_cluster_rejoined();
  }
  if (epd_engine_create(&eo, epd_events_from_engine, NULL, &d.eng, eerr, sizeof eerr) != EPD_OK) {
    snprintf(err, sizeof err, "engine (backend %s, %u ranks): %s", d.conf.backend, d.conf.num_ranks, eerr);
    goto fail;
  }
  stage = 3;
  /* The wake-up handle exists before the RPC server so that a Drain call always has somewhere to go. */
  uv_async_init(&d.loop, &d.wake, on_wake);
  uv_timer_init(&d.loop, &d.drain_timer);
  uv_timer_init(&d.loop, &d.failure_timer);
  uv_signal_init(&d.loop, &d.sig_term);
  uv_signal_init(&d.loop, &d.sig_int);
  uv_signal_init(&d.loop, &d.sig_hup);
  uv_signal_start(&d.sig_term, on_signal, SIGTERM);
  uv_signal_start(&d.sig_int, on_signal, SIGINT);
  uv_signal_start(&d.sig_hup, on_signal, SIGHUP);
  if (epd_state_init(d.conf.state_dir, eerr, sizeof eerr) != 0) {
    snprintf(err, sizeof err, "%s", eerr);
    goto fail;
  }
  if (epd_access_init(&d.conf, eerr, sizeof eerr) != 0) {
    snprintf(err, sizeof err, "%s", eerr);
    goto fail;
  }
  if (make_socket_dir(d.conf.control_socket, eerr, sizeof eerr) != 0) {
    snprintf(err, sizeof err, "%s", eerr);
    goto fail;
  }
  epd_rpc_hooks_t hooks = {NULL, hook_drain, hook_state, hook_config_dump};
  if (epd_rpc_init(&d.conf, d.eng, &hooks, eerr, sizeof eerr) != 0) {
    snprintf(err, sizeof err, "control socket %s: %s", d.conf.control_socket, eerr);
    goto fail;
  }
  stage = 4;
  if (epd_http_init(&d.conf, d.eng, &hooks, eerr, sizeof eerr) != 0) {
    snprintf(err, sizeof err, "prometheus endpoint: %s", eerr);
    goto fail;
  }
  stage = 5;
  if (epd_attach_init(&d.loop, &d.conf, d.eng, eerr, sizeof eerr) != 0) {
    snprintf(err, sizeof err, "attach socket: %s", eerr);
    goto fail;
  }
  stage = 6;
  if ((rc = epd_notify_init(&d.loop)) != 0) {
    snprintf(err, sizeof err, "watchdog timer: %s", uv_strerror(rc));
    goto fail;
  }
  stage = 7;

  atomic_store(&d.state, ST_READY);
  epd_rpc_set_serving(1);
  epd_events_publish("ready", "", -1, 0, 0, 0, 0, "epd ready");
  EPD_LOGI(EPD_SUB_MAIN, "ready: control %s, attach %s, %d rank(s), backend %s, mode %s",
           d.conf.control_socket, epd_attach_path(), epd_engine_num_ranks(d.eng), epd_engine_backend(d.eng),
           epd_engine_mode(d.eng));
  ready_status();

  uv_timer_start(&d.failure_timer, failure_tick, 200, 200);
  uv_run(&d.loop, UV_RUN_DEFAULT);

  EPD_LOGI(EPD_SUB_MAIN, "shutting down");
  epd_notify_stopping("stopping");
  rc = d.exit_status;
  goto out;
fail:
  atomic_store(&d.state, ST_FAILED);
  EPD_LOGE(EPD_SUB_MAIN, "start-up failed: %s", err);
  /* The log line went to the journal under systemd; say it on stderr too for whoever started us. */
  if (!d.foreground && getenv("JOURNAL_STREAM")) fprintf(stderr, "epd: %s\n", err);
  epd_notify_status("failed: %s", err);
  rc = 1;
out:
  if (stage >= 7) epd_notify_fini();
  if (stage >= 6) epd_attach_fini();
  if (stage >= 5) epd_http_fini();
  /* The RPC thread goes before the loop's handles: its Drain hook sends to the wake-up handle. */
  if (stage >= 4) epd_rpc_fini();
  if (stage >= 1) {
    /* Close every handle and let the close callbacks run (attach connections close their fds). */
    uv_walk(&d.loop, close_walk, NULL);
    uv_run(&d.loop, UV_RUN_DEFAULT);
    uv_loop_close(&d.loop);
  }
  if (stage >= 3) epd_engine_destroy(d.eng);
  epd_cluster_fini(cluster_net);
  if (stage >= 2) epd_events_fini();
  EPD_LOGI(EPD_SUB_MAIN, "exit %d", rc);
  epd_log_fini();
  return rc;
}
