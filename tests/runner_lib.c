/*
 * runner_lib.c - runs the registered tests and the system scripts, each in a child process with a
 * timeout, printing one line per test and a summary "N passed, N failed, N skipped". Scripts are the
 * executable NN-name.sh / NN-name.py files of $EPD_SYSTEM_TESTS (default tests/system).
 * Usage: epd-tests [substring-filter...]   Exit status 0 iff nothing failed.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test.h"

#define MAX_TESTS 1024
#define EXIT_SKIP 77

typedef struct test_entry {
  char name[128];
  epd_test_fn fn;
  char script[512];
  int timeout_s;
} test_entry_t;

static test_entry_t tests[MAX_TESTS];
static int ntests;
static char tmpdir[256];

void epd_test_register(const char *name, epd_test_fn fn, int timeout_s) {
  if (ntests == MAX_TESTS) abort();
  snprintf(tests[ntests].name, sizeof tests[ntests].name, "%s", name);
  tests[ntests].fn = fn;
  tests[ntests].timeout_s = timeout_s;
  ntests++;
}

void epd_test_skip(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "skip: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  fflush(NULL);
  _exit(EXIT_SKIP);
}

void epd_test_fail(const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%s:%d: ", file, line);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  fflush(NULL);
  _exit(1);
}

const char *epd_test_build_dir(void) {
  const char *b = getenv("EPD_BUILD");
  return b && *b ? b : "build";
}

const char *epd_test_tmpdir(void) {
  return tmpdir;
}

static void add_scripts(const char *dir) {
  struct dirent **names;
  int n = scandir(dir, &names, NULL, alphasort);
  for (int i = 0; i < n; i++) {
    const char *nm = names[i]->d_name;
    size_t len = strlen(nm);
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, nm);
    if (nm[0] >= '0' && nm[0] <= '9' &&
        ((len > 3 && !strcmp(nm + len - 3, ".sh")) || (len > 3 && !strcmp(nm + len - 3, ".py"))) &&
        access(path, X_OK) == 0 && ntests < MAX_TESTS) {
      test_entry_t *t = &tests[ntests++];
      snprintf(t->name, sizeof t->name, "system/%.*s", (int)(len - 3), nm);
      snprintf(t->script, sizeof t->script, "%s", path);
      t->fn = NULL;
      t->timeout_s = 300;
    }
    free(names[i]);
  }
  if (n >= 0) free(names);
}

static int matches(const char *name, int argc, char **argv) {
  if (argc <= 1) return 1;
  for (int i = 1; i < argc; i++)
    if (strstr(name, argv[i])) return 1;
  return 0;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Run one test in a child with its own process group; returns 0 pass, 1 fail, 2 skip. */
static int run_one(test_entry_t *t, char *why, size_t whylen) {
  char logpath[300];
  snprintf(tmpdir, sizeof tmpdir, "/tmp/epd-test-XXXXXX");
  if (!mkdtemp(tmpdir)) {
    snprintf(why, whylen, "mkdtemp: %s", strerror(errno));
    return 1;
  }
  snprintf(logpath, sizeof logpath, "%s.log", tmpdir);
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    int fd = open(logpath, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    setenv("EPD_TEST_TMPDIR", tmpdir, 1);
    if (t->fn) {
      t->fn();
      fflush(NULL);
      _exit(0);
    }
    execl(t->script, t->script, (char *)NULL);
    _exit(127);
  }
  setpgid(pid, pid);
  int status = 0, timed_out = 0;
  double deadline = now_s() + t->timeout_s;
  for (;;) {
    pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (now_s() > deadline) {
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      timed_out = 1;
      break;
    }
    usleep(2000);
  }
  kill(-pid, SIGKILL); /* anything the test left running in its group */
  int rc;
  if (timed_out) {
    snprintf(why, whylen, "timed out after %d s", t->timeout_s);
    rc = 1;
  } else if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    rc = 0;
  } else if (WIFEXITED(status) && WEXITSTATUS(status) == EXIT_SKIP) {
    rc = 2;
  } else if (WIFSIGNALED(status)) {
    snprintf(why, whylen, "killed by signal %d", WTERMSIG(status));
    rc = 1;
  } else {
    snprintf(why, whylen, "exit status %d", WEXITSTATUS(status));
    rc = 1;
  }
  /* Show the tail of the log on failure, and the skip reason. */
  FILE *f = fopen(logpath, "r");
  if (f && rc != 0) {
    char line[1024];
    long n = 0;
    static char tail[40][1024];
    while (fgets(line, sizeof line, f)) snprintf(tail[n++ % 40], sizeof tail[0], "%s", line);
    long from = n > 40 ? n - 40 : 0;
    if (rc == 1)
      for (long i = from; i < n; i++) printf("    | %s", tail[i % 40]);
    else if (n > 0)
      snprintf(why, whylen, "%.*s", (int)strcspn(tail[(n - 1) % 40], "\n"), tail[(n - 1) % 40]);
  }
  if (f) fclose(f);
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s'", tmpdir, logpath);
  if (system(cmd) != 0) { /* nothing to do: a leftover temp dir is harmless */
  }
  return rc;
}

int main(int argc, char **argv) {
  const char *sysdir = getenv("EPD_SYSTEM_TESTS");
  add_scripts(sysdir ? sysdir : "tests/system");
  setvbuf(stdout, NULL, _IOLBF, 0);
  int passed = 0, failed = 0, skipped = 0;
  for (int i = 0; i < ntests; i++) {
    test_entry_t *t = &tests[i];
    if (!matches(t->name, argc, argv)) continue;
    char why[512] = "";
    double t0 = now_s();
    int rc = run_one(t, why, sizeof why);
    double dt = now_s() - t0;
    if (rc == 0) {
      passed++;
      printf("ok      %-48s %7.2fs\n", t->name, dt);
    } else if (rc == 2) {
      skipped++;
      printf("skip    %-48s %s\n", t->name, why);
    } else {
      failed++;
      printf("FAIL    %-48s %s\n", t->name, why);
    }
  }
  printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  return failed ? 1 : 0;
}
