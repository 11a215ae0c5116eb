/*
 * test.h - the epd test framework. A test is a function registered once with EPD_TEST(name); the
 * runner runs each in its own child process with a timeout and prints one line per test, then
 * "N passed, N failed, N skipped". Scripts in tests/system/ (executable, NN-name.sh) run as tests too.
 */
#ifndef EPD_TEST_H
#define EPD_TEST_H

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void (*epd_test_fn)(void);
void epd_test_register(const char *name, epd_test_fn fn, int timeout_s);
/* Skip the current test with a reason (exits the child). */
void epd_test_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
/* Fail the current test with a message (exits the child). */
void epd_test_fail(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4), noreturn));
/* Directory of the build (for binaries the tests start): $EPD_BUILD or "build". */
const char *epd_test_build_dir(void);
/* A fresh scratch directory for this test (removed by the runner). */
const char *epd_test_tmpdir(void);

#define EPD_TEST_T(name, timeout_s)                                \
  static void test_##name(void);                                   \
  __attribute__((constructor)) static void register_##name(void) { \
    epd_test_register(#name, test_##name, timeout_s);              \
  }                                                                \
  static void test_##name(void)
#define EPD_TEST(name) EPD_TEST_T(name, 60)

#define ASSERT(c)                                                    \
  do {                                                               \
    if (!(c)) epd_test_fail(__FILE__, __LINE__, "assertion %s", #c); \
  } while (0)
#define ASSERT_INT_OP(a, op, b)                                                                        \
  do {                                                                                                 \
    long long a_ = (long long)(a), b_ = (long long)(b);                                                \
    if (!(a_ op b_)) epd_test_fail(__FILE__, __LINE__, "%s %s %s: %lld vs %lld", #a, #op, #b, a_, b_); \
  } while (0)
#define ASSERT_EQ(a, b) ASSERT_INT_OP(a, ==, b)
#define ASSERT_NE(a, b) ASSERT_INT_OP(a, !=, b)
#define ASSERT_LT(a, b) ASSERT_INT_OP(a, <, b)
#define ASSERT_LE(a, b) ASSERT_INT_OP(a, <=, b)
#define ASSERT_GT(a, b) ASSERT_INT_OP(a, >, b)
#define ASSERT_GE(a, b) ASSERT_INT_OP(a, >=, b)
#define ASSERT_OK(e)                                                          \
  do {                                                                        \
    int r_ = (int)(e);                                                        \
    if (r_ != 0) epd_test_fail(__FILE__, __LINE__, "%s returned %d", #e, r_); \
  } while (0)
#define ASSERT_STR_CONTAINS(hay, needle)                                                           \
  do {                                                                                             \
    const char *h_ = (hay), *n_ = (needle);                                                        \
    if (!h_ || !strstr(h_, n_))                                                                    \
      epd_test_fail(__FILE__, __LINE__, "\"%s\" does not contain \"%s\"", h_ ? h_ : "(null)", n_); \
  } while (0)
#define ASSERT_NEAR(a, b, tol)                                                                        \
  do {                                                                                                \
    double a_ = (double)(a), b_ = (double)(b);                                                        \
    if (!(a_ - b_ <= (tol) && b_ - a_ <= (tol)))                                                      \
      epd_test_fail(__FILE__, __LINE__, "%s ~ %s: %g vs %g (tol %g)", #a, #b, a_, b_, (double)(tol)); \
  } while (0)

#endif
