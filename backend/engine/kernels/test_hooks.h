/* test_hooks.h: the thread pool's test hooks (threads.c), off in serving. The tests build the
 * library with them on through group_matmul.build(defines) (-DNAME=VALUE; serving passes none):
 *   FIRST_JOB: the job number the pool starts from (tests of the tags' wrap); default 0.
 *   HELPER_DELAY_NS: a pause where a helper that saw a job word may be preempted, which widens that
 *     window so that a test meets the interleaving on every try; default none. */
#ifndef TEST_HOOKS_H
#define TEST_HOOKS_H

#ifndef FIRST_JOB
#define FIRST_JOB 0L
#endif

#ifdef HELPER_DELAY_NS
#define HELPER_PAUSE() nanosleep(&(struct timespec){0, HELPER_DELAY_NS}, NULL)
#else
#define HELPER_PAUSE() ((void)0)
#endif

#endif
