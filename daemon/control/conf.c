/*
 * conf.c - the configuration table. Every key is one row (name, type, bounds, default, reloadable,
 * doc, place in epd_conf_t); defaults, parsing, validation, dumping, diffing and reload all walk it.
 */
#define _GNU_SOURCE
#include "control/conf.h"

#include <ctype.h>
#include <errno.h>
#include <grp.h>
#include <pwd.h>
#include <ini.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "epd_paths.h"
#include "core/log.h"

typedef enum conf_type {
  CT_STRING,     /* char[size] */
  CT_UINT,       /* uint32_t, decimal */
  CT_OCTAL,      /* uint32_t, octal (file modes) */
  CT_BYTES,      /* uint32_t or uint64_t, with an optional K/M/G/T (binary) suffix */
  CT_ENUM,       /* char[size], one of choices */
  CT_LOG_LEVEL,  /* int, error|warn|info|debug|trace */
  CT_SUBSYSTEMS, /* uint32_t mask, comma list of subsystem names or "all" */
  CT_IDLIST,     /* char[size], comma list of user (choices "user") or group ids/names, checked on parse */
  CT_INTLIST     /* char[size], comma list of integers in [min, max], checked on parse */
} conf_type_t;

typedef struct conf_key {
  const char *name;
  conf_type_t type;
  uint64_t min, max;
  const char *def; /* default as text, parsed like a file value so that defaults are validated too */
  int reloadable;  /* applied by SIGHUP without a restart */
  size_t off, size;
  const char *choices; /* CT_ENUM: comma list */
  const char *doc;
} conf_key_t;

#define F(field) offsetof(epd_conf_t, field), sizeof(((epd_conf_t *)0)->field)
#define KiB 1024ull
#define MiB (1024ull * KiB)
#define GiB (1024ull * MiB)
#define TiB (1024ull * GiB)

static const conf_key_t keys[] = {
    {"daemon.control_socket", CT_STRING, 0, 0, "", 0, F(control_socket), NULL,
     "control RPC socket; empty: /run/epd/control.sock (root), $XDG_RUNTIME_DIR/epd/ or /tmp/epd-<uid>/"},
    {"daemon.attach_socket", CT_STRING, 0, 0, "", 0, F(attach_socket), NULL,
     "attach (fd passing) socket; empty: attach.sock beside the control socket"},
    {"daemon.socket_mode", CT_OCTAL, 0, 0777, "0660", 0, F(socket_mode), NULL,
     "file mode of both sockets (who may attach: owner and group by default)"},
    {"daemon.socket_group", CT_STRING, 0, 0, "", 0, F(socket_group), NULL,
     "group owning both sockets; empty: the daemon's primary group"},
    {"daemon.state_dir", CT_STRING, 0, 0, "", 0, F(state_dir), NULL,
     "directory for state that survives a restart (expert maps); empty: none kept"},
    {"daemon.token_ttl_ms", CT_UINT, 100, 3600000, "10000", 1, F(token_ttl_ms), NULL,
     "lifetime of a one-time attach token; an unredeemed client is detached after it"},
    {"daemon.drain_timeout_ms", CT_UINT, 0, 3600000, "10000", 1, F(drain_timeout_ms), NULL,
     "on SIGTERM or Drain, wait this long for clients to detach before exiting"},
    {"daemon.max_message_bytes", CT_BYTES, 4 * KiB, GiB, "4MiB", 0, F(max_message_bytes), NULL,
     "largest control RPC message accepted"},
    {"daemon.max_pending_tokens", CT_UINT, 1, 65536, "4096", 0, F(max_pending_tokens), NULL,
     "issued, not yet redeemed attach tokens at once; an Attach beyond it fails with EPD_ERR_BUSY"},
    {"daemon.max_watches", CT_UINT, 1, 65536, "256", 0, F(max_watches), NULL,
     "Watch and Health.Watch streams open at once; more fail with RESOURCE_EXHAUSTED"},
    {"daemon.max_unredeemed_conns", CT_UINT, 1, 65536, "256", 1, F(max_unredeemed_conns), NULL,
     "attach-socket connections that have not sent their token yet, at once; one more is closed at accept "
     "(epd_attach_refused_total{reason=\"cap\"}); keep it well below the daemon's open-file limit"},
    {"daemon.max_control_conns", CT_UINT, 1, 4096, "512", 0, F(max_control_conns), NULL,
     "control connections (gRPC) open at once, all uids; more are answered RESOURCE_EXHAUSTED and closed"},
    {"daemon.max_control_conns_per_uid", CT_UINT, 1, 4096, "128", 0, F(max_control_conns_per_uid), NULL,
     "control connections open at once from one uid"},
    {"daemon.max_unredeemed_per_uid", CT_UINT, 1, 65536, "64", 1, F(max_unredeemed_per_uid), NULL,
     "the same bound for the connections of one uid (reason=\"uid\"), so that one user cannot hold them all"},
    {"daemon.allow_uids", CT_IDLIST, 0, 0, "", 0, F(allow_uids), "user",
     "comma list of users (uids or names) allowed on both sockets; empty: anyone who can open them"},
    {"daemon.allow_gids", CT_IDLIST, 0, 0, "", 0, F(allow_gids), "group",
     "comma list of groups (gids or names, primary or supplementary) allowed on both sockets; empty: anyone"},
    {"daemon.admin_uids", CT_IDLIST, 0, 0, "", 0, F(admin_uids), "user",
     "users allowed SetExpertMap and Drain besides root and the daemon's uid; this and admin_gid empty: "
     "anyone"},
    {"daemon.admin_gid", CT_IDLIST, 0, 0, "", 0, F(admin_gid), "group",
     "group(s) whose members (primary or supplementary) may call SetExpertMap and Drain"},
    {"log.level", CT_LOG_LEVEL, 0, 0, "info", 1, F(log_level), NULL, "error, warn, info, debug or trace"},
    {"log.subsystems", CT_SUBSYSTEMS, 0, 0, "all", 1, F(log_subsystems), NULL,
     "comma list of main, conf, rpc, attach, engine, cuda, metrics, or all (errors always pass)"},
    {"engine.backend", CT_ENUM, 0, 0, "auto", 0, F(backend), "auto,host,cuda",
     "auto (cuda when GPUs and NCCL are usable, else host), host (threads over shared memory) or cuda"},
    {"engine.num_ranks", CT_UINT, 1, 64, "2", 0, F(num_ranks), NULL,
     "ranks of this node (cuda: on the GPUs engine.devices names, else GPUs 0..n-1; host: threads)"},
    {"engine.devices", CT_INTLIST, 0, EPD_CONF_MAX_LIST - 1, "", 0, F(devices), NULL,
     "cuda: the GPU (CUDA ordinal) of each local rank, a comma list of num_ranks entries, e.g. 0,0 for two "
     "ranks on GPU 0; up to 4 ranks may share a GPU (NCCL 2.30 or later); empty: rank r on GPU r"},
    {"engine.max_experts", CT_UINT, 1, 4096, "256", 0, F(max_experts), NULL,
     "largest num_experts a group may have"},
    {"engine.max_hidden", CT_UINT, 8, 65536, "8192", 0, F(max_hidden), NULL,
     "largest hidden size a group may have"},
    {"engine.max_topk", CT_UINT, 1, 16, "16", 0, F(max_topk), NULL, "largest top-k a group may have"},
    {"engine.max_tokens", CT_UINT, 1, 65536, "256", 0, F(max_tokens), NULL,
     "largest max_tokens (per rank and step) a group may have"},
    {"engine.slots_factor_pct", CT_UINT, 100, 800, "100", 0, F(slots_factor_pct), NULL,
     "expert slots per rank as a percentage of ceil(experts/ranks); above 100 leaves room for replicas"},
    {"engine.ht_capacity_factor", CT_UINT, 0, 1024, "0", 0, F(ht_capacity_factor), NULL,
     "HT receive capacity in units of max_tokens; 0: num_ranks (never overflows)"},
    {"engine.ht_sms", CT_UINT, 1, 132, "24", 0, F(ht_sms), NULL,
     "SMs (one block each) of every HT dispatch/combine kernel of this node's GPUs (cuda; host: unused)"},
    {"engine.ht_ce_split", CT_UINT, 1, 4, "1", 0, F(ht_ce_split), NULL,
     "cuda: copies (copy-engine streams) per destination rank of a dense BF16 HT dispatch"},
    {"engine.cuda_mode", CT_ENUM, 0, 0, "auto", 0, F(cuda_mode), "auto,launch,persistent",
     "cuda: launch (a kernel per op, rank threads poll the queues), persistent (resident kernels serve the "
     "queues; needs CUDA MPS to share the GPU with clients) or auto (persistent under MPS, else launch)"},
    {"engine.ll_blocks", CT_UINT, 0, 256, "0", 0, F(ll_blocks), NULL,
     "cuda: blocks of each LL kernel of a rank; 0: 128 in launch mode, 64 in persistent mode, divided by "
     "the ranks that share a GPU"},
    {"engine.idle_spin_ns", CT_UINT, 0, 1000000000, "0", 0, F(idle_spin_ns), NULL,
     "cuda: rank threads keep polling without sleeping this long after the last op (lower latency for "
     "a busy CPU core)"},
    {"engine.step_timeout_ms", CT_UINT, 1, 3600000, "10000", 0, F(step_timeout_ms), NULL,
     "a rank waiting longer than this for its peers fails the step with EPD_ERR_TIMEOUT"},
    {"engine.rehome_replicas", CT_UINT, 0, 1, "0", 0, F(rehome_replicas), NULL,
     "groups that mask, with expert weights: 1 gives each replica a masked rank held of an expert "
     "that still has a live one a new home, a free slot of a live rank, its weights copied from a live "
     "replica (a staged map that switches once the bytes are there)"},
    {"engine.exit_on_failure", CT_UINT, 0, 1, "1", 1, F(exit_on_failure), NULL,
     "1: after an engine failure (a sticky GPU fault) drain and exit 1 so systemd restarts the daemon; "
     "0: stay up in state failed"},
    {"engine.max_groups", CT_UINT, 1, 256, "8", 0, F(max_groups), NULL, "EP groups served at once"},
    {"engine.max_clients_per_rank", CT_UINT, 1, 256, "8", 0, F(max_clients_per_rank), NULL,
     "clients attached to one rank at once (across groups)"},
    {"engine.max_arena_bytes", CT_BYTES, MiB, TiB, "8GiB", 0, F(max_arena_bytes), NULL,
     "largest IO arena of one client; an attach whose geometry needs more is refused"},
    {"cluster.nodes", CT_UINT, 1, 64, "1", 0, F(nodes), NULL,
     "daemons (nodes) forming one EP world; world ranks = nodes * engine.num_ranks; 1: single node"},
    {"cluster.node_rank", CT_UINT, 0, 63, "0", 0, F(node_rank), NULL,
     "this node in [0, nodes); node 0 is the coordinator; world rank = node_rank * num_ranks + local rank"},
    {"cluster.listen", CT_STRING, 0, 0, "", 0, F(cluster_listen), NULL,
     "coordinator (node 0) only: TCP host:port of the Rendezvous gRPC listener; empty: off"},
    {"cluster.coordinator", CT_STRING, 0, 0, "", 0, F(cluster_coordinator), NULL,
     "nodes 1..nodes-1: host:port of the coordinator's cluster.listen"},
    {"cluster.data_listen", CT_STRING, 0, 0, "", 0, F(cluster_data_listen), NULL,
     "TCP host:port of this node's data-plane listener (port 0: any free port); needed when nodes > 1"},
    {"cluster.timeout_ms", CT_UINT, 100, 3600000, "60000", 0, F(cluster_timeout_ms), NULL,
     "start-up fails when the rendezvous or the data connections are not complete within this"},
    {"cluster.gin_probe", CT_UINT, 0, 1, "1", 0, F(gin_probe), NULL,
     "cuda backend: 1 asks NCCL at start-up for a GIN context on the world communicator and reports what "
     "it offers (epdctl status 'gin:'); a collective call, so the same on every node; 0: not asked"},
    {"cluster.tls_ca", CT_STRING, 0, 0, "", 0, F(cluster_tls_ca), NULL,
     "PEM file of the CA that signs every node's certificate; with tls_cert and tls_key: the rendezvous runs "
     "over mutual TLS (the coordinator requires a client certificate of this CA, the others verify the "
     "coordinator's); all three or none; empty: plaintext"},
    {"cluster.tls_cert", CT_STRING, 0, 0, "", 0, F(cluster_tls_cert), NULL,
     "PEM file of this node's certificate (chain), signed by cluster.tls_ca"},
    {"cluster.tls_key", CT_STRING, 0, 0, "", 0, F(cluster_tls_key), NULL,
     "PEM file of this node's private key (keep it mode 0600)"},
    {"cluster.tls_server_name", CT_STRING, 0, 0, "", 0, F(cluster_tls_server_name), NULL,
     "nodes 1..nodes-1: the name the coordinator's certificate must carry, when it is not the host of "
     "cluster.coordinator (e.g. a DNS name for a coordinator given by IP address); empty: that host"},
    {"metrics.prometheus_listen", CT_STRING, 0, 0, "", 0, F(prometheus_listen), NULL,
     "host:port to serve /metrics over HTTP; empty: off (metrics stay available over the control RPC)"},
};
#define NKEYS (sizeof keys / sizeof keys[0])

static const char *const level_list = "error, warn, info, debug, trace";

static void seterr(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void seterr(char *err, size_t errlen, const char *fmt, ...) {
  va_list ap;
  if (!err || errlen == 0) return;
  va_start(ap, fmt);
  vsnprintf(err, errlen, fmt, ap);
  va_end(ap);
}

static const conf_key_t *find_key(const char *name) {
  for (size_t i = 0; i < NKEYS; i++)
    if (!strcmp(keys[i].name, name)) return &keys[i];
  return NULL;
}

static uint64_t get_uint(const epd_conf_t *c, const conf_key_t *k) {
  const char *p = (const char *)c + k->off;
  if (k->size == sizeof(uint64_t)) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
  }
  uint32_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

static void put_uint(epd_conf_t *c, const conf_key_t *k, uint64_t v) {
  char *p = (char *)c + k->off;
  if (k->size == sizeof(uint64_t)) {
    memcpy(p, &v, sizeof v);
  } else {
    uint32_t w = (uint32_t)v;
    memcpy(p, &w, sizeof w);
  }
}

/* Bytes as the largest binary unit that divides them exactly ("4MiB", "8GiB", "1000"). */
static void fmt_bytes(uint64_t v, char *buf, size_t len) {
  static const struct {
    const char *sfx;
    uint64_t mul;
  } u[] = {{"TiB", TiB}, {"GiB", GiB}, {"MiB", MiB}, {"KiB", KiB}};
  for (size_t i = 0; i < sizeof u / sizeof u[0]; i++)
    if (v >= u[i].mul && v % u[i].mul == 0) {
      snprintf(buf, len, "%" PRIu64 "%s", v / u[i].mul, u[i].sfx);
      return;
    }
  snprintf(buf, len, "%" PRIu64, v);
}

static void fmt_range(const conf_key_t *k, char *buf, size_t len) {
  char a[32], b[32];
  if (k->type == CT_BYTES) {
    fmt_bytes(k->min, a, sizeof a);
    fmt_bytes(k->max, b, sizeof b);
  } else if (k->type == CT_OCTAL) {
    snprintf(a, sizeof a, "%s%" PRIo64, k->min ? "0" : "", k->min);
    snprintf(b, sizeof b, "%s%" PRIo64, k->max ? "0" : "", k->max);
  } else {
    snprintf(a, sizeof a, "%" PRIu64, k->min);
    snprintf(b, sizeof b, "%" PRIu64, k->max);
  }
  snprintf(buf, len, "[%s, %s]", a, b);
}

/* Format a key's value as text that parse_value() reads back to the same value. */
static void fmt_value(const epd_conf_t *c, const conf_key_t *k, char *buf, size_t len) {
  const char *p = (const char *)c + k->off;
  switch (k->type) {
    case CT_STRING:
    case CT_IDLIST:
    case CT_INTLIST:
    case CT_ENUM: {
      /* Quoted where the parser would otherwise change it: outer quotes or white space (any isspace
       * character, e.g. a form feed) are stripped, and a ';' after the blank of "key = " starts an inline
       * comment (found by fuzz_conf). */
      size_t n = strnlen(p, k->size);
      int q = n && (p[0] == '"' || p[n - 1] == '"' || isspace((unsigned char)p[0]) ||
                    isspace((unsigned char)p[n - 1]) || p[0] == ';');
      snprintf(buf, len, q ? "\"%.*s\"" : "%.*s", (int)n, p);
      break;
    }
    case CT_UINT:
      snprintf(buf, len, "%" PRIu64, get_uint(c, k));
      break;
    case CT_OCTAL:
      snprintf(buf, len, "%s%" PRIo64, get_uint(c, k) ? "0" : "", get_uint(c, k));
      break;
    case CT_BYTES:
      fmt_bytes(get_uint(c, k), buf, len);
      break;
    case CT_LOG_LEVEL: {
      int lv;
      memcpy(&lv, p, sizeof lv);
      snprintf(buf, len, "%s", epd_log_level_name(lv));
      break;
    }
    case CT_SUBSYSTEMS:
      epd_log_subsystems_format((uint32_t)get_uint(c, k), buf, len);
      break;
  }
}

/* Parse an unsigned number in base (10 or 8), with a binary unit suffix when bytes != 0. */
static int parse_number(const char *s, int base, int bytes, uint64_t *out) {
  char *end;
  while (*s == ' ' || *s == '\t') s++;
  if (*s < '0' || *s > '9') return -1; /* no sign, no empty value */
  errno = 0;
  unsigned long long v = strtoull(s, &end, base);
  if (errno || end == s) return -1;
  while (*end == ' ') end++;
  uint64_t mul = 1;
  if (bytes && *end) {
    static const struct {
      const char *sfx;
      uint64_t mul;
    } u[] = {{"k", KiB},  {"kb", KiB},  {"kib", KiB}, {"m", MiB},  {"mb", MiB},  {"mib", MiB}, {"g", GiB},
             {"gb", GiB}, {"gib", GiB}, {"t", TiB},   {"tb", TiB}, {"tib", TiB}, {"b", 1}};
    size_t i;
    for (i = 0; i < sizeof u / sizeof u[0]; i++)
      if (!strcasecmp(end, u[i].sfx)) break;
    if (i == sizeof u / sizeof u[0]) return -1;
    mul = u[i].mul;
    end += strlen(end);
  }
  if (*end) return -1;
  if (v > UINT64_MAX / mul) return -1;
  *out = (uint64_t)v * mul;
  return 0;
}

/* Parse and validate one value into c; the message names the key and the allowed values. */
static int parse_value(epd_conf_t *c, const conf_key_t *k, const char *value, char *err, size_t errlen) {
  char *p = (char *)c + k->off;
  char range[80];
  size_t vlen = strlen(value);
  char v[1024];
  /* Accept "..." around a value (paths with a ';' or leading spaces). */
  if (vlen >= 2 && value[0] == '"' && value[vlen - 1] == '"') {
    value++;
    vlen -= 2;
  }
  if (vlen >= sizeof v) {
    seterr(err, errlen, "%s: value is %zu bytes long, more than this key allows", k->name, vlen);
    return -1;
  }
  memcpy(v, value, vlen);
  v[vlen] = '\0';
  /* A ';' after a blank starts an inline comment wherever the INI parser reads a key line, quotes or
   * not: such a value (reachable through a continuation line or -o) could not be written back to a
   * config file (found by fuzz_conf). */
  if (k->type == CT_STRING || k->type == CT_IDLIST || k->type == CT_INTLIST || k->type == CT_ENUM)
    for (size_t i = 1; i < vlen; i++)
      if (v[i] == ';' && isspace((unsigned char)v[i - 1])) {
        seterr(err, errlen,
               "%s: a ';' after a blank (offset %zu) would be read as a comment in a config file; "
               "remove the blank",
               k->name, i);
        return -1;
      }
  switch (k->type) {
    case CT_STRING:
      if (vlen >= k->size) {
        seterr(err, errlen, "%s: value is %zu bytes long, the limit is %zu", k->name, vlen, k->size - 1);
        return -1;
      }
      memcpy(p, v, vlen + 1);
      return 0;
    case CT_IDLIST: {
      uint32_t ids[EPD_CONF_MAX_IDS];
      char msg[192];
      if (vlen >= k->size) {
        seterr(err, errlen, "%s: value is %zu bytes long, the limit is %zu", k->name, vlen, k->size - 1);
        return -1;
      }
      if (epd_conf_parse_ids(v, !strcmp(k->choices, "group"), ids, EPD_CONF_MAX_IDS, msg, sizeof msg) < 0) {
        seterr(err, errlen, "%s: %s", k->name, msg);
        return -1;
      }
      memcpy(p, v, vlen + 1);
      return 0;
    }
    case CT_INTLIST: {
      int vals[EPD_CONF_MAX_LIST];
      char msg[160];
      if (vlen >= k->size) {
        seterr(err, errlen, "%s: value is %zu bytes long, the limit is %zu", k->name, vlen, k->size - 1);
        return -1;
      }
      if (epd_conf_parse_list(v, (uint32_t)k->max, vals, EPD_CONF_MAX_LIST, msg, sizeof msg) < 0) {
        seterr(err, errlen, "%s: %s", k->name, msg);
        return -1;
      }
      memcpy(p, v, vlen + 1);
      return 0;
    }
    case CT_ENUM: {
      const char *ch = k->choices;
      while (*ch) {
        size_t n = strcspn(ch, ",");
        if (n == vlen && !strncmp(ch, v, n) && n < k->size) {
          memcpy(p, v, vlen + 1);
          return 0;
        }
        ch += n + (ch[n] == ',');
      }
      char list[128];
      snprintf(list, sizeof list, "%s", k->choices);
      for (char *q = list; *q; q++)
        if (*q == ',') *q = '/';
      seterr(err, errlen, "%s: '%s' is not one of %s", k->name, v, list);
      return -1;
    }
    case CT_LOG_LEVEL: {
      int lv = epd_log_level_parse(v);
      if (lv < 0) {
        seterr(err, errlen, "%s: '%s' is not one of %s", k->name, v, level_list);
        return -1;
      }
      memcpy(p, &lv, sizeof lv);
      return 0;
    }
    case CT_SUBSYSTEMS: {
      uint32_t m;
      if (epd_log_subsystems_parse(v, &m) != 0) {
        seterr(err, errlen,
               "%s: '%s' is not a comma list of main, conf, rpc, attach, engine, cuda, metrics or all",
               k->name, v);
        return -1;
      }
      put_uint(c, k, m);
      return 0;
    }
    case CT_UINT:
    case CT_OCTAL:
    case CT_BYTES: {
      uint64_t n;
      fmt_range(k, range, sizeof range);
      if (parse_number(v, k->type == CT_OCTAL ? 8 : 10, k->type == CT_BYTES, &n) != 0) {
        seterr(err, errlen, "%s: '%s' is not %s in range %s", k->name, v,
               k->type == CT_OCTAL   ? "an octal mode"
               : k->type == CT_BYTES ? "a size (K/M/G/T suffix)"
                                     : "an unsigned integer",
               range);
        return -1;
      }
      if (n < k->min || n > k->max) {
        char shown[32];
        if (k->type == CT_OCTAL)
          snprintf(shown, sizeof shown, "0%" PRIo64, n);
        else if (k->type == CT_BYTES)
          fmt_bytes(n, shown, sizeof shown);
        else
          snprintf(shown, sizeof shown, "%" PRIu64, n);
        seterr(err, errlen, "%s: %s is out of range %s", k->name, shown, range);
        return -1;
      }
      put_uint(c, k, n);
      return 0;
    }
  }
  return -1;
}

void epd_conf_defaults(epd_conf_t *c) {
  memset(c, 0, sizeof *c);
  for (size_t i = 0; i < NKEYS; i++) {
    char err[256];
    if (parse_value(c, &keys[i], keys[i].def, err, sizeof err) != 0) {
      /* A bad default is a programming error caught by the first test run. */
      fprintf(stderr, "epd: bad built-in default: %s\n", err);
      abort();
    }
  }
}

int epd_conf_set(epd_conf_t *c, const char *key, const char *value, char *err, size_t errlen) {
  const conf_key_t *k = find_key(key);
  if (!k) {
    seterr(err, errlen, "unknown key '%s'", key);
    return -1;
  }
  epd_conf_t tmp = *c;
  if (parse_value(&tmp, k, value, err, errlen) != 0) return -1;
  *c = tmp;
  return 0;
}

/* inih calls the reader once per physical line, so counting calls gives the handler's line number
 * (the Debian libinih is built without INI_HANDLER_LINENO). */
typedef struct parse_ctx {
  FILE *f;
  int line;
  epd_conf_t *conf;
  int failed; /* the line of the first value refused by the handler, 0 while none */
  char *err;
  size_t errlen;
  int long_line, max_len; /* first line longer than libinih takes (it would split it), and the limit */
} parse_ctx_t;

static char *count_reader(char *str, int num, void *stream) {
  parse_ctx_t *ctx = stream;
  char *r = fgets(str, num, ctx->f);
  if (!r) return r;
  ctx->line++;
  size_t n = strlen(r);
  if (n == (size_t)num - 1 && r[n - 1] != '\n') {
    /* libinih reads lines of at most num - 1 bytes and would parse the rest as a line of its own: refuse
     * the file instead (skip the rest of the physical line so that later line numbers stay right). */
    int ch;
    while ((ch = fgetc(ctx->f)) != EOF && ch != '\n') {
    }
    if (!ctx->long_line) {
      ctx->long_line = ctx->line;
      ctx->max_len = num - 2;
    }
    str[0] = '\0';
  }
  return r;
}

static int ini_handler_fn(void *user, const char *section, const char *name, const char *value) {
  parse_ctx_t *ctx = user;
  char key[192], msg[384];
  if (ctx->failed) return 1; /* report the first error only */
  /* A key outside any section may be written in full ("log.level = debug"), as epd_conf_dump does. */
  if (!section[0])
    snprintf(key, sizeof key, "%s", name);
  else
    snprintf(key, sizeof key, "%s.%s", section, name);
  if (epd_conf_set(ctx->conf, key, value, msg, sizeof msg) != 0) {
    seterr(ctx->err, ctx->errlen, "%s at line %d", msg, ctx->line);
    ctx->failed = ctx->line > 0 ? ctx->line : 1;
    return 0;
  }
  return 1;
}

static int parse_stream(epd_conf_t *c, FILE *f, char *err, size_t errlen) {
  epd_conf_t tmp = *c;
  parse_ctx_t ctx = {f, 0, &tmp, 0, err, errlen, 0, 0};
  int rc = ini_parse_stream(count_reader, &ctx, ini_handler_fn, &ctx);
  /* inih goes on after a syntax error and returns the line of the first error of either kind, so a
   * syntax error before the handler's refusal is the one to report: "[engine" on line 1 makes the
   * "num_ranks" of line 2 an unknown key, and that is not what the user has to fix. */
  if (rc > 0 && ctx.failed && rc < ctx.failed) ctx.failed = 0;
  /* A line too long comes first unless an error stands on an earlier line. */
  int first = ctx.failed ? ctx.failed : rc > 0 ? rc : 0;
  if (ctx.long_line && (!first || ctx.long_line <= first)) {
    seterr(err, errlen, "line %d is longer than %d characters (the limit of the INI parser)", ctx.long_line,
           ctx.max_len);
    return -1;
  }
  if (ctx.failed) return -1;
  if (rc > 0) {
    seterr(err, errlen, "syntax error at line %d (expected '[section]' or 'name = value')", rc);
    return -1;
  }
  if (rc < 0) {
    seterr(err, errlen, "cannot parse the configuration (error %d)", rc);
    return -1;
  }
  *c = tmp;
  return 0;
}

int epd_conf_load(epd_conf_t *c, const char *path, int optional, char *err, size_t errlen) {
  FILE *f = fopen(path, "r");
  if (!f) {
    if (optional && errno == ENOENT) return 0;
    seterr(err, errlen, "cannot open config file '%s': %s", path, strerror(errno));
    return -1;
  }
  int rc = parse_stream(c, f, err, errlen);
  fclose(f);
  return rc;
}

int epd_conf_load_text(epd_conf_t *c, const char *text, size_t len, char *err, size_t errlen) {
  FILE *f = fmemopen((void *)text, len, "r");
  if (!f) {
    seterr(err, errlen, "cannot read the configuration text: %s", strerror(errno));
    return -1;
  }
  int rc = parse_stream(c, f, err, errlen);
  fclose(f);
  return rc;
}

size_t epd_conf_dump(const epd_conf_t *c, char *buf, size_t len) {
  size_t off = 0;
  if (len) buf[0] = '\0';
  for (size_t i = 0; i < NKEYS; i++) {
    char v[EPD_PATH_MAX + 8];
    fmt_value(c, &keys[i], v, sizeof v);
    int n = snprintf(buf + off, off < len ? len - off : 0, "%s = %s\n", keys[i].name, v);
    if (n < 0) break;
    off += (size_t)n;
  }
  if (off >= len && len) buf[len - 1] = '\0';
  return off;
}

static int key_differs(const epd_conf_t *a, const epd_conf_t *b, const conf_key_t *k) {
  if (k->type == CT_STRING || k->type == CT_ENUM || k->type == CT_IDLIST || k->type == CT_INTLIST)
    return strncmp((const char *)a + k->off, (const char *)b + k->off, k->size) != 0;
  return memcmp((const char *)a + k->off, (const char *)b + k->off, k->size) != 0;
}

int epd_conf_apply_reloadable(epd_conf_t *dst, const epd_conf_t *src) {
  int changed = 0;
  for (size_t i = 0; i < NKEYS; i++) {
    const conf_key_t *k = &keys[i];
    if (!k->reloadable || !key_differs(dst, src, k)) continue;
    memcpy((char *)dst + k->off, (const char *)src + k->off, k->size);
    changed++;
  }
  return changed;
}

int epd_conf_diff(const epd_conf_t *cur, const epd_conf_t *next, char *buf, size_t len) {
  int n = 0;
  size_t off = 0;
  if (len) buf[0] = '\0';
  for (size_t i = 0; i < NKEYS; i++) {
    const conf_key_t *k = &keys[i];
    if (!key_differs(cur, next, k)) continue;
    char a[EPD_PATH_MAX + 8], b[EPD_PATH_MAX + 8];
    fmt_value(cur, k, a, sizeof a);
    fmt_value(next, k, b, sizeof b);
    int w = snprintf(buf + off, off < len ? len - off : 0, "%s: %s -> %s (%s)\n", k->name, a, b,
                     k->reloadable ? "applied" : "needs restart");
    if (w > 0) off += (size_t)w;
    n++;
  }
  if (off >= len && len) buf[len - 1] = '\0';
  return n;
}

size_t epd_conf_describe(char *buf, size_t len) {
  size_t off = 0;
  static const char *const tnames[] = {"string",    "uint",       "octal",   "bytes",   "enum",
                                       "log-level", "subsystems", "id-list", "int-list"};
  if (len) buf[0] = '\0';
  for (size_t i = 0; i < NKEYS; i++) {
    const conf_key_t *k = &keys[i];
    char range[80] = "";
    if (k->type == CT_UINT || k->type == CT_OCTAL || k->type == CT_BYTES) fmt_range(k, range, sizeof range);
    if (k->type == CT_ENUM) snprintf(range, sizeof range, "{%s}", k->choices);
    if (k->type == CT_INTLIST) snprintf(range, sizeof range, "entries in [0, %u]", (unsigned)k->max);
    int w = snprintf(buf + off, off < len ? len - off : 0, "%-28s %-10s default '%s' %s%s\n    %s\n", k->name,
                     tnames[k->type], k->def, range, k->reloadable ? " (reloadable)" : "", k->doc);
    if (w > 0) off += (size_t)w;
  }
  if (off >= len && len) buf[len - 1] = '\0';
  return off;
}

int epd_conf_control_socket_path(const epd_conf_t *c, char *buf, size_t len) {
  /* The default rule lives in epd_paths.h so that the daemon, rpc.c and libepd agree. */
  char def[EPD_PATH_MAX + 64];
  int n = snprintf(buf, len, "%s",
                   c->control_socket[0] ? c->control_socket : epd_paths_control_default(def, sizeof def));
  return n < 0 || (size_t)n >= len ? -1 : 0;
}

int epd_conf_attach_socket_path(const epd_conf_t *c, char *buf, size_t len) {
  if (c->attach_socket[0]) {
    int n = snprintf(buf, len, "%s", c->attach_socket);
    return n < 0 || (size_t)n >= len ? -1 : 0;
  }
  char ctl[EPD_PATH_MAX + 64];
  if (epd_conf_control_socket_path(c, ctl, sizeof ctl) != 0) return -1;
  char *slash = strrchr(ctl, '/');
  int n = slash ? snprintf(buf, len, "%.*s/attach.sock", (int)(slash - ctl), ctl)
                : snprintf(buf, len, "attach.sock");
  return n < 0 || (size_t)n >= len ? -1 : 0;
}

int epd_conf_parse_list(const char *text, uint32_t max_value, int *out, size_t max, char *err,
                        size_t errlen) {
  size_t n = 0;
  const char *q = text;
  while (*q == ' ' || *q == '\t') q++;
  if (!*q) return 0;
  for (;;) {
    uint64_t v;
    char item[24];
    size_t len = strcspn(q, ",");
    while (len && (q[len - 1] == ' ' || q[len - 1] == '\t')) len--;
    if (len >= sizeof item) len = sizeof item - 1;
    memcpy(item, q, len);
    item[len] = '\0';
    if (parse_number(item, 10, 0, &v) != 0 || v > max_value) {
      seterr(err, errlen, "entry %zu '%s' is not an integer in [0, %u]", n + 1, item, max_value);
      return -1;
    }
    if (n == max) {
      seterr(err, errlen, "more than %zu entries", max);
      return -1;
    }
    out[n++] = (int)v;
    q += strcspn(q, ",");
    if (!*q) return (int)n;
    q++;
    while (*q == ' ' || *q == '\t') q++;
  }
}

int epd_conf_parse_ids(const char *text, int groups, uint32_t *out, size_t max, char *err, size_t errlen) {
  size_t n = 0;
  const char *p = text;
  for (;;) {
    while (*p == ' ' || *p == '\t') p++;
    if (!*p) break;
    size_t len = strcspn(p, ",");
    char item[64];
    size_t l = len;
    while (l && (p[l - 1] == ' ' || p[l - 1] == '\t')) l--;
    if (l == 0 || l >= sizeof item) {
      seterr(err, errlen, "'%.*s' is not a %s id or name", (int)(l < 40 ? l : 40), p,
             groups ? "group" : "user");
      return -1;
    }
    memcpy(item, p, l);
    item[l] = '\0';
    uint64_t id;
    if (item[0] >= '0' && item[0] <= '9') {
      if (parse_number(item, 10, 0, &id) != 0 || id >= UINT32_MAX) {
        seterr(err, errlen, "'%s' is not a %s id (0..%u)", item, groups ? "group" : "user", UINT32_MAX - 1);
        return -1;
      }
    } else {
      char buf[4096];
      if (groups) {
        struct group gr, *res = NULL;
        if (getgrnam_r(item, &gr, buf, sizeof buf, &res) != 0 || !res) {
          seterr(err, errlen, "unknown group '%s'", item);
          return -1;
        }
        id = res->gr_gid;
      } else {
        struct passwd pw, *res = NULL;
        if (getpwnam_r(item, &pw, buf, sizeof buf, &res) != 0 || !res) {
          seterr(err, errlen, "unknown user '%s'", item);
          return -1;
        }
        id = res->pw_uid;
      }
    }
    if (n >= max) {
      seterr(err, errlen, "more than %zu entries", max);
      return -1;
    }
    out[n++] = (uint32_t)id;
    p += len;
    if (*p == ',') p++;
  }
  return (int)n;
}
