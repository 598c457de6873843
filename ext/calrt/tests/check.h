/* CHECK for the harnesses of the runtime's internals (no calrt_last_error: they call no API). */
#ifndef CALRT_TEST_CHECK_H
#define CALRT_TEST_CHECK_H
#include <stdio.h>
#include <stdlib.h>

#define CHECK(cond)                                                             \
  do {                                                                          \
    if (!(cond)) {                                                              \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);  \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)
#endif
