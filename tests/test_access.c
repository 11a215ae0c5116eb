/* test_access.c - id lists in the configuration (daemon.allow_uids/allow_gids/admin_uids/admin_gid),
 * the allow and admin checks of access.c, supplementary groups from /proc, max_pending_tokens. */
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "control/access.h"
#include "control/conf.h"
#include "test.h"

EPD_TEST(conf_id_lists) {
  uint32_t ids[EPD_CONF_MAX_IDS];
  char err[256] = "";
  ASSERT_EQ(epd_conf_parse_ids("", 0, ids, EPD_CONF_MAX_IDS, err, sizeof err), 0);
  ASSERT_EQ(epd_conf_parse_ids(" 0, 12345 ,root", 0, ids, EPD_CONF_MAX_IDS, err, sizeof err), 3);
  ASSERT_EQ(ids[0], 0);
  ASSERT_EQ(ids[1], 12345);
  ASSERT_EQ(ids[2], 0); /* root */
  ASSERT_EQ(epd_conf_parse_ids("root,5", 1, ids, EPD_CONF_MAX_IDS, err, sizeof err), 2);
  ASSERT_EQ(epd_conf_parse_ids("no-such-user-xyz", 0, ids, EPD_CONF_MAX_IDS, err, sizeof err), -1);
  ASSERT_STR_CONTAINS(err, "unknown user 'no-such-user-xyz'");
  ASSERT_EQ(epd_conf_parse_ids("1,,2", 0, ids, EPD_CONF_MAX_IDS, err, sizeof err), -1);
  ASSERT_EQ(epd_conf_parse_ids("4294967295", 0, ids, EPD_CONF_MAX_IDS, err, sizeof err), -1);
  ASSERT_STR_CONTAINS(err, "is not a user id");
  ASSERT_EQ(epd_conf_parse_ids("1,2,3", 0, ids, 2, err, sizeof err), -1);
  ASSERT_STR_CONTAINS(err, "more than 2 entries");

  epd_conf_t c;
  epd_conf_defaults(&c);
  ASSERT_EQ(c.max_pending_tokens, 4096);
  ASSERT_EQ(c.max_watches, 256);
  ASSERT_EQ(c.allow_uids[0], 0);
  ASSERT_EQ(epd_conf_set(&c, "daemon.allow_uids", "12345,root", err, sizeof err), 0);
  ASSERT_STR_CONTAINS(c.allow_uids, "12345,root");
  ASSERT(epd_conf_set(&c, "daemon.admin_gid", "no-such-group-xyz", err, sizeof err) != 0);
  ASSERT_STR_CONTAINS(err, "daemon.admin_gid: unknown group 'no-such-group-xyz'");
  ASSERT(epd_conf_set(&c, "daemon.max_pending_tokens", "0", err, sizeof err) != 0);
  ASSERT_STR_CONTAINS(err, "daemon.max_pending_tokens: 0 is out of range [1, 65536]");
  char dump[16384];
  epd_conf_dump(&c, dump, sizeof dump);
  ASSERT_STR_CONTAINS(dump, "daemon.allow_uids = 12345,root\n");
}

EPD_TEST(access_allow_and_admin) {
  epd_conf_t c;
  char err[256] = "";
  epd_conf_defaults(&c);
  ASSERT_EQ(epd_access_init(&c, err, sizeof err), 0);
  /* No lists: everyone may connect and everyone is admin. */
  ASSERT_EQ(epd_access_allowed("test", 1, 777, 777), 1);
  ASSERT_EQ(epd_access_is_admin(0, 0, 777, 777), 1);

  uint32_t me = (uint32_t)getuid(), mygid = (uint32_t)getgid();
  snprintf(c.allow_uids, sizeof c.allow_uids, "12345");
  snprintf(c.allow_gids, sizeof c.allow_gids, "23456");
  snprintf(c.admin_uids, sizeof c.admin_uids, "4242");
  snprintf(c.admin_gid, sizeof c.admin_gid, "%u", mygid == 0 ? 5555u : mygid);
  ASSERT_EQ(epd_access_init(&c, err, sizeof err), 0);
  ASSERT_EQ(epd_access_allowed("test", 1, 12345, 1), 1);
  ASSERT_EQ(epd_access_allowed("test", 0, 1, 23456), 1); /* primary gid */
  ASSERT_EQ(epd_access_allowed("test", getpid(), me == 12345 ? 1 : me, mygid == 23456 ? 1 : mygid), 0);
  ASSERT_EQ(epd_access_is_admin(1, 0, 0, 1), 1);    /* root */
  ASSERT_EQ(epd_access_is_admin(1, 0, me, 1), 1);   /* the daemon's own uid */
  ASSERT_EQ(epd_access_is_admin(1, 0, 4242, 1), 1); /* admin_uids */
  ASSERT_EQ(epd_access_is_admin(0, 0, 4242, 1), 0); /* unknown credentials */
  ASSERT_EQ(epd_access_is_admin(1, 0, 999999, 1), 0);
  ASSERT_EQ(epd_access_is_admin(1, 0, 999999, mygid == 0 ? 5555u : mygid), 1); /* admin_gid as primary */

  /* Supplementary groups come from /proc/<pid>/status. */
  FILE *f = fopen("/proc/self/status", "r");
  ASSERT(f != NULL);
  char line[4096];
  unsigned long sup = 0;
  int have_sup = 0;
  while (fgets(line, sizeof line, f))
    if (!strncmp(line, "Groups:", 7)) have_sup = sscanf(line + 7, "%lu", &sup) == 1;
  fclose(f);
  if (have_sup) {
    ASSERT_EQ(epd_access_in_group(getpid(), 999999, (uint32_t)sup), 1);
  }
  ASSERT_EQ(epd_access_in_group(getpid(), 999999, 999998), 0);
  ASSERT_EQ(epd_access_in_group(0, 999999, 999998), 0);
  epd_access_fini();
  ASSERT_EQ(epd_access_allowed("test", 1, 1, 1), 1);
}
