/* test_conf.c - the configuration table: defaults, parsing, errors naming the key and range, dump and
 * re-parse, reload. */
#define _GNU_SOURCE
#include <stdio.h>
#include <unistd.h>

#include "control/conf.h"
#include "core/log.h"
#include "test.h"

static const char *write_file(const char *name, const char *text) {
  static char path[512];
  snprintf(path, sizeof path, "%s/%s", epd_test_tmpdir(), name);
  FILE *f = fopen(path, "w");
  ASSERT(f != NULL);
  fputs(text, f);
  fclose(f);
  return path;
}

EPD_TEST(conf_defaults) {
  epd_conf_t c;
  epd_conf_defaults(&c);
  ASSERT_STR_CONTAINS(c.backend, "auto");
  ASSERT_EQ(c.num_ranks, 2);
  ASSERT_EQ(c.max_experts, 256);
  ASSERT_EQ(c.max_hidden, 8192);
  ASSERT_EQ(c.max_topk, 16);
  ASSERT_EQ(c.max_tokens, 256);
  ASSERT_EQ(c.step_timeout_ms, 10000);
  ASSERT_EQ(c.token_ttl_ms, 10000);
  ASSERT_EQ(c.socket_mode, 0660);
  ASSERT_EQ(c.max_message_bytes, 4u << 20);
  ASSERT_EQ(c.max_clients_per_rank, 8);
  ASSERT_EQ(c.max_groups, 8);
  ASSERT(c.max_arena_bytes == 8ull << 30);
  ASSERT_EQ(c.slots_factor_pct, 100);
  ASSERT_EQ(c.ht_capacity_factor, 0);
  ASSERT_EQ(c.ht_sms, 24);
  ASSERT_EQ(c.gin_probe, 1);
  ASSERT_EQ(c.drain_timeout_ms, 10000);
  ASSERT_EQ(c.log_level, EPD_LOG_INFO);
  ASSERT_EQ(c.log_subsystems, EPD_SUB_ALL);
  ASSERT_EQ(c.control_socket[0], 0);
}

/* Every bad value names the key and what is allowed. */
EPD_TEST(conf_bad_values) {
  static const struct {
    const char *key, *value, *want;
  } cases[] = {
      {"engine.num_ranks", "0", "engine.num_ranks: 0 is out of range [1, 64]"},
      {"engine.num_ranks", "65", "engine.num_ranks: 65 is out of range [1, 64]"},
      {"engine.num_ranks", "-1", "engine.num_ranks: '-1' is not an unsigned integer in range [1, 64]"},
      {"engine.num_ranks", "2x", "engine.num_ranks: '2x' is not an unsigned integer"},
      {"engine.num_ranks", "", "engine.num_ranks: '' is not"},
      {"engine.num_ranks", "99999999999999999999999", "is not an unsigned integer"},
      {"engine.max_topk", "17", "engine.max_topk: 17 is out of range [1, 16]"},
      {"engine.slots_factor_pct", "99", "engine.slots_factor_pct: 99 is out of range [100, 800]"},
      {"engine.ht_sms", "0", "engine.ht_sms: 0 is out of range [1, 132]"},
      {"engine.ht_sms", "133", "engine.ht_sms: 133 is out of range [1, 132]"},
      {"cluster.gin_probe", "2", "cluster.gin_probe: 2 is out of range [0, 1]"},
      {"daemon.token_ttl_ms", "5", "daemon.token_ttl_ms: 5 is out of range [100, 3600000]"},
      {"daemon.socket_mode", "0999", "daemon.socket_mode: '0999' is not an octal mode in range [0, 0777]"},
      {"daemon.socket_mode", "01777", "daemon.socket_mode: 01777 is out of range [0, 0777]"},
      {"daemon.max_message_bytes", "2K", "daemon.max_message_bytes: 2KiB is out of range [4KiB, 1GiB]"},
      {"daemon.max_message_bytes", "4Q", "daemon.max_message_bytes: '4Q' is not a size"},
      {"engine.max_arena_bytes", "2T", "engine.max_arena_bytes: 2TiB is out of range [1MiB, 1TiB]"},
      {"engine.backend", "gpu", "engine.backend: 'gpu' is not one of auto/host/cuda"},
      {"log.level", "loud", "log.level: 'loud' is not one of error, warn, info, debug, trace"},
      {"log.subsystems", "rpc,bogus", "log.subsystems: 'rpc,bogus' is not a comma list"},
      {"engine.devices", "0,x", "engine.devices: entry 2 'x' is not an integer in [0, 63]"},
      {"engine.devices", "0,,1", "engine.devices: entry 2 '' is not an integer"},
      {"engine.devices", "0,64", "engine.devices: entry 2 '64' is not an integer in [0, 63]"},
      {"engine.devices", "-1", "engine.devices: entry 1 '-1' is not an integer"},
      {"foo.bar", "1", "unknown key 'foo.bar'"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    epd_conf_t c, before;
    char err[256] = "";
    epd_conf_defaults(&c);
    before = c;
    if (epd_conf_set(&c, cases[i].key, cases[i].value, err, sizeof err) == 0)
      epd_test_fail(__FILE__, __LINE__, "%s = '%s' was accepted", cases[i].key, cases[i].value);
    ASSERT_STR_CONTAINS(err, cases[i].want);
    ASSERT(memcmp(&c, &before, sizeof c) == 0); /* a rejected value changes nothing */
  }
  char long_path[400];
  memset(long_path, 'a', sizeof long_path - 1);
  long_path[sizeof long_path - 1] = 0;
  epd_conf_t c;
  char err[256];
  epd_conf_defaults(&c);
  ASSERT_EQ(epd_conf_set(&c, "daemon.control_socket", long_path, err, sizeof err), -1);
  ASSERT_STR_CONTAINS(err, "daemon.control_socket: value is 399 bytes long, the limit is 255");
}

EPD_TEST(conf_good_values) {
  epd_conf_t c;
  char err[256];
  epd_conf_defaults(&c);
  ASSERT_OK(epd_conf_set(&c, "engine.max_arena_bytes", "512MiB", err, sizeof err));
  ASSERT(c.max_arena_bytes == 512ull << 20);
  ASSERT_OK(epd_conf_set(&c, "engine.max_arena_bytes", "2g", err, sizeof err));
  ASSERT(c.max_arena_bytes == 2ull << 30);
  ASSERT_OK(epd_conf_set(&c, "daemon.max_message_bytes", "1048576", err, sizeof err));
  ASSERT_EQ(c.max_message_bytes, 1 << 20);
  ASSERT_OK(epd_conf_set(&c, "daemon.socket_mode", "0600", err, sizeof err));
  ASSERT_EQ(c.socket_mode, 0600);
  ASSERT_OK(epd_conf_set(&c, "log.subsystems", "rpc,attach", err, sizeof err));
  ASSERT_EQ(c.log_subsystems, EPD_SUB_RPC | EPD_SUB_ATTACH);
  ASSERT_OK(epd_conf_set(&c, "log.level", "DEBUG", err, sizeof err));
  ASSERT_EQ(c.log_level, EPD_LOG_DEBUG);
  ASSERT_OK(epd_conf_set(&c, "engine.ht_sms", "132", err, sizeof err));
  ASSERT_EQ(c.ht_sms, 132);
  ASSERT_OK(epd_conf_set(&c, "engine.backend", "host", err, sizeof err));
  ASSERT_STR_CONTAINS(c.backend, "host");
  int dev[EPD_CONF_MAX_LIST];
  ASSERT_OK(epd_conf_set(&c, "engine.devices", "0, 0,1 ,1", err, sizeof err));
  ASSERT_EQ(epd_conf_parse_list(c.devices, 63, dev, EPD_CONF_MAX_LIST, err, sizeof err), 4);
  ASSERT(dev[0] == 0 && dev[1] == 0 && dev[2] == 1 && dev[3] == 1);
  ASSERT_OK(epd_conf_set(&c, "engine.devices", "", err, sizeof err));
  ASSERT_EQ(epd_conf_parse_list(c.devices, 63, dev, EPD_CONF_MAX_LIST, err, sizeof err), 0);
  ASSERT_EQ(epd_conf_parse_list("1,2,3", 63, dev, 2, err, sizeof err), -1); /* more entries than room */
  ASSERT_STR_CONTAINS(err, "more than 2 entries");
  ASSERT_OK(epd_conf_set(&c, "daemon.control_socket", "\"/tmp/x y;z.sock\"", err, sizeof err));
  ASSERT_STR_CONTAINS(c.control_socket, "/tmp/x y;z.sock");
}

EPD_TEST(conf_file_errors_name_line) {
  epd_conf_t c;
  char err[256] = "";
  epd_conf_defaults(&c);
  const char *p = write_file("a.conf", "[engine]\nnum_ranks = 4\n[foo]\nbar = 1\n");
  ASSERT_EQ(epd_conf_load(&c, p, 0, err, sizeof err), -1);
  ASSERT_STR_CONTAINS(err, "unknown key 'foo.bar' at line 4");
  ASSERT_EQ(c.num_ranks, 2); /* a failed load leaves the config as it was */

  p = write_file("b.conf", "# comment\n[engine]\n\nnum_ranks = 0\n");
  ASSERT_EQ(epd_conf_load(&c, p, 0, err, sizeof err), -1);
  ASSERT_STR_CONTAINS(err, "engine.num_ranks: 0 is out of range [1, 64] at line 4");

  p = write_file("c.conf", "[engine]\nnum_ranks\n");
  ASSERT_EQ(epd_conf_load(&c, p, 0, err, sizeof err), -1);
  ASSERT_STR_CONTAINS(err, "syntax error at line 2");

  /* A broken section header is the error, not the key after it that it leaves outside [engine]. */
  p = write_file("c2.conf", "[engine\nnum_ranks = 2\n");
  ASSERT_EQ(epd_conf_load(&c, p, 0, err, sizeof err), -1);
  ASSERT_STR_CONTAINS(err, "syntax error at line 1");
  ASSERT_EQ(epd_conf_load_text(&c, "[log]\nlevel = info\n[engine\nnum_ranks = 2\n", 41, err, sizeof err), -1);
  ASSERT_STR_CONTAINS(err, "syntax error at line 3");
  /* The handler's refusal stays the error when it comes first. */
  ASSERT_EQ(epd_conf_load_text(&c, "[engine]\nbogus = 1\n[log\n", 24, err, sizeof err), -1);
  ASSERT_STR_CONTAINS(err, "unknown key 'engine.bogus' at line 2");

  p = write_file("d.conf", "[engine]\nbogus = 3\n");
  ASSERT_EQ(epd_conf_load(&c, p, 0, err, sizeof err), -1);
  ASSERT_STR_CONTAINS(err, "unknown key 'engine.bogus' at line 2");

  char missing[512];
  snprintf(missing, sizeof missing, "%s/none.conf", epd_test_tmpdir());
  ASSERT_EQ(epd_conf_load(&c, missing, 0, err, sizeof err), -1);
  ASSERT_STR_CONTAINS(err, "cannot open config file");
  ASSERT_OK(epd_conf_load(&c, missing, 1, err, sizeof err));

  p = write_file("e.conf", "[engine]\nnum_ranks = 4 ; four GPUs\nbackend = host\n[log]\nlevel = debug\n");
  ASSERT_OK(epd_conf_load(&c, p, 0, err, sizeof err));
  ASSERT_EQ(c.num_ranks, 4);
  ASSERT_EQ(c.log_level, EPD_LOG_DEBUG);
}

EPD_TEST(conf_dump_reparse) {
  epd_conf_t a, b;
  char err[256], buf[8192], buf2[8192];
  epd_conf_defaults(&a);
  ASSERT_OK(epd_conf_set(&a, "engine.num_ranks", "8", err, sizeof err));
  ASSERT_OK(epd_conf_set(&a, "engine.max_arena_bytes", "3GiB", err, sizeof err));
  ASSERT_OK(epd_conf_set(&a, "daemon.socket_mode", "0640", err, sizeof err));
  ASSERT_OK(epd_conf_set(&a, "log.subsystems", "main,engine", err, sizeof err));
  ASSERT_OK(epd_conf_set(&a, "log.level", "trace", err, sizeof err));
  ASSERT_OK(epd_conf_set(&a, "daemon.control_socket", "/tmp/epd-x/control.sock", err, sizeof err));
  size_t n = epd_conf_dump(&a, buf, sizeof buf);
  ASSERT_LT(n, sizeof buf);
  ASSERT_STR_CONTAINS(buf, "engine.num_ranks = 8\n");
  ASSERT_STR_CONTAINS(buf, "engine.max_arena_bytes = 3GiB\n");
  ASSERT_STR_CONTAINS(buf, "daemon.socket_mode = 0640\n");
  ASSERT_STR_CONTAINS(buf, "log.subsystems = main,engine\n");
  const char *p = write_file("dump.conf", buf);
  epd_conf_defaults(&b);
  ASSERT_OK(epd_conf_load(&b, p, 0, err, sizeof err));
  epd_conf_dump(&b, buf2, sizeof buf2);
  ASSERT(strcmp(buf, buf2) == 0);
  ASSERT_EQ(epd_conf_diff(&a, &b, buf2, sizeof buf2), 0);
  /* A small buffer truncates but reports the full length. */
  char small[16];
  ASSERT_EQ(epd_conf_dump(&a, small, sizeof small), n);
  ASSERT_EQ(strlen(small), sizeof small - 1);
}

EPD_TEST(conf_reloadable) {
  epd_conf_t cur, next;
  char err[256], diff[2048];
  epd_conf_defaults(&cur);
  next = cur;
  ASSERT_OK(epd_conf_set(&next, "log.level", "debug", err, sizeof err));
  ASSERT_OK(epd_conf_set(&next, "daemon.token_ttl_ms", "2000", err, sizeof err));
  ASSERT_OK(epd_conf_set(&next, "engine.num_ranks", "4", err, sizeof err));
  ASSERT_EQ(epd_conf_diff(&cur, &next, diff, sizeof diff), 3);
  ASSERT_STR_CONTAINS(diff, "log.level: info -> debug (applied)");
  ASSERT_STR_CONTAINS(diff, "daemon.token_ttl_ms: 10000 -> 2000 (applied)");
  ASSERT_STR_CONTAINS(diff, "engine.num_ranks: 2 -> 4 (needs restart)");
  ASSERT_EQ(epd_conf_apply_reloadable(&cur, &next), 2);
  ASSERT_EQ(cur.log_level, EPD_LOG_DEBUG);
  ASSERT_EQ(cur.token_ttl_ms, 2000);
  ASSERT_EQ(cur.num_ranks, 2);
  ASSERT_EQ(epd_conf_apply_reloadable(&cur, &next), 0);
}

EPD_TEST(conf_socket_paths) {
  epd_conf_t c;
  char err[256], p[512];
  epd_conf_defaults(&c);
  ASSERT_OK(epd_conf_set(&c, "daemon.control_socket", "/x/y/ctl.sock", err, sizeof err));
  ASSERT_OK(epd_conf_attach_socket_path(&c, p, sizeof p));
  ASSERT(strcmp(p, "/x/y/attach.sock") == 0);
  ASSERT_OK(epd_conf_set(&c, "daemon.attach_socket", "/z/a.sock", err, sizeof err));
  ASSERT_OK(epd_conf_attach_socket_path(&c, p, sizeof p));
  ASSERT(strcmp(p, "/z/a.sock") == 0);
  epd_conf_defaults(&c);
  if (geteuid() != 0) {
    setenv("XDG_RUNTIME_DIR", "/run/user/4242", 1);
    ASSERT_OK(epd_conf_control_socket_path(&c, p, sizeof p));
    ASSERT(strcmp(p, "/run/user/4242/epd/control.sock") == 0);
    unsetenv("XDG_RUNTIME_DIR");
    ASSERT_OK(epd_conf_control_socket_path(&c, p, sizeof p));
    char want[64];
    snprintf(want, sizeof want, "/tmp/epd-%u/control.sock", (unsigned)geteuid());
    ASSERT(strcmp(p, want) == 0);
  } else {
    ASSERT_OK(epd_conf_control_socket_path(&c, p, sizeof p));
    ASSERT(strcmp(p, "/run/epd/control.sock") == 0);
  }
}

/* config/epd.conf documents every key, with the defaults. */
EPD_TEST(conf_example_file_complete) {
  epd_conf_t d, c;
  char err[256], dump[8192];
  FILE *f = fopen("config/epd.conf", "r");
  if (!f) epd_test_skip("config/epd.conf not found from %s", getcwd(dump, sizeof dump));
  char text[32768];
  size_t n = fread(text, 1, sizeof text - 1, f);
  text[n] = 0;
  fclose(f);
  epd_conf_defaults(&d);
  c = d;
  ASSERT_OK(epd_conf_load(&c, "config/epd.conf", 0, err, sizeof err));
  ASSERT_EQ(epd_conf_diff(&d, &c, dump, sizeof dump), 0);
  epd_conf_dump(&d, dump, sizeof dump);
  for (char *line = strtok(dump, "\n"); line; line = strtok(NULL, "\n")) {
    char key[128], name[96];
    sscanf(line, "%127s", key);
    const char *dot = strchr(key, '.');
    ASSERT(dot != NULL);
    snprintf(name, sizeof name, "\n%s =", dot + 1);
    if (!strstr(text, name)) epd_test_fail(__FILE__, __LINE__, "config/epd.conf lacks %s", key);
  }
}

/* log.c: the stderr line format, the level and subsystem filters, and the name tables conf relies on. */
EPD_TEST(log_format_and_filters) {
  char path[512], text[4096];
  snprintf(path, sizeof path, "%s/log.txt", epd_test_tmpdir());
  ASSERT(freopen(path, "w", stderr) != NULL);
  epd_log_init(EPD_LOG_INFO, EPD_SUB_ALL, 0);
  EPD_LOGI(EPD_SUB_ATTACH, "hello %d", 42);
  EPD_LOGD(EPD_SUB_ATTACH, "hidden at info");
  epd_log_msg(EPD_LOG_WARN, EPD_SUB_ENGINE, 3, 77, "with fields");
  epd_log_group_msg(EPD_LOG_INFO, EPD_SUB_ENGINE, 1, 0, "llama", "about a group");
  epd_log_set(EPD_LOG_DEBUG, EPD_SUB_RPC);
  EPD_LOGD(EPD_SUB_RPC, "rpc debug shown");
  EPD_LOGI(EPD_SUB_ENGINE, "engine filtered out");
  EPD_LOGE(EPD_SUB_ENGINE, "errors always pass");
  fflush(stderr);
  FILE *f = fopen(path, "r");
  ASSERT(f != NULL);
  size_t n = fread(text, 1, sizeof text - 1, f);
  text[n] = 0;
  fclose(f);
  /* "YYYY-mm-ddTHH:MM:SS.mmm LEVEL subsys: message" */
  int y, mo, da, h, mi, se, ms;
  char lvl[8], sub[16];
  ASSERT_EQ(sscanf(text, "%4d-%2d-%2dT%2d:%2d:%2d.%3d %7s %15s", &y, &mo, &da, &h, &mi, &se, &ms, lvl, sub),
            9);
  ASSERT(strcmp(lvl, "INFO") == 0);
  ASSERT(strcmp(sub, "attach:") == 0);
  ASSERT_STR_CONTAINS(text, " INFO attach: hello 42\n");
  ASSERT_STR_CONTAINS(text, " WARN engine: with fields rank=3 client=77\n");
  ASSERT_STR_CONTAINS(text, " INFO engine: about a group rank=1 group=llama\n");
  ASSERT_STR_CONTAINS(text, " DEBUG rpc: rpc debug shown\n");
  ASSERT_STR_CONTAINS(text, " ERROR engine: errors always pass\n");
  ASSERT(!strstr(text, "hidden at info"));
  ASSERT(!strstr(text, "engine filtered out"));
  ASSERT_EQ(epd_log_level_parse("warn"), EPD_LOG_WARN);
  ASSERT_EQ(epd_log_level_parse("nope"), -1);
  uint32_t m = 0;
  ASSERT_EQ(epd_log_subsystems_parse("", &m), -1);
  ASSERT_OK(epd_log_subsystems_parse("all", &m));
  ASSERT_EQ(m, EPD_SUB_ALL);
  char buf[128];
  epd_log_subsystems_format(EPD_SUB_MAIN | EPD_SUB_CUDA, buf, sizeof buf);
  ASSERT(strcmp(buf, "main,cuda") == 0);
}
