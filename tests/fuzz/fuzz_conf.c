/* fuzz_conf.c - libFuzzer target: configuration text parsed over the defaults (conf.c, libinih); an
 * accepted configuration must dump to text that parses back to the same dump (or, for a line too long
 * for the INI parser, be refused saying so). Regression inputs: corpus/conf/long-line (a 180-byte path
 * made a dump that libinih split in two), corpus/conf/quoted (a value in quotes of its own). The first line,
 * when it holds '=', is also tried as a command-line override (epd -o key=value). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "control/conf.h"
#include "core/log.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static char dump1[32768], dump2[32768];
  char err[512];
  epd_conf_t c, d;
  epd_log_init(EPD_LOG_ERROR, EPD_SUB_ALL, 0);
  epd_conf_defaults(&c);
  if (epd_conf_load_text(&c, (const char *)data, size, err, sizeof err) == 0) {
    epd_conf_dump(&c, dump1, sizeof dump1);
    epd_conf_defaults(&d);
    if (epd_conf_load_text(&d, dump1, strlen(dump1), err, sizeof err) != 0) {
      /* Only a line too long for the INI parser (a long path set in a section, dumped with the
       * "section.key = " prefix) may make a dump unreadable, and it must say so. */
      size_t longest = 0;
      for (const char *l = dump1; *l;) {
        size_t n = strcspn(l, "\n");
        if (n > longest) longest = n;
        l += n + (l[n] == '\n');
      }
      if (longest < 198 || !strstr(err, "characters (the limit of the INI parser)")) abort();
    } else {
      epd_conf_dump(&d, dump2, sizeof dump2);
      if (strcmp(dump1, dump2)) abort(); /* round trip changed a value */
    }
    char diff[4096];
    epd_conf_defaults(&d);
    epd_conf_diff(&d, &c, diff, sizeof diff);
    epd_conf_apply_reloadable(&d, &c);
  }
  char line[512];
  size_t n = 0;
  while (n < size && n < sizeof line - 1 && data[n] != '\n' && data[n]) {
    line[n] = (char)data[n];
    n++;
  }
  line[n] = 0;
  char *eq = strchr(line, '=');
  if (eq) {
    *eq = 0;
    epd_conf_defaults(&c);
    epd_conf_set(&c, line, eq + 1, err, sizeof err);
  }
  return 0;
}
