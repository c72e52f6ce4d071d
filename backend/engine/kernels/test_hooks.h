/* test_hooks.h: the thread pool's test hooks (threads.c), compiled only into the tests' build
 * (group_matmul.build(("-DTEST_HOOKS",)); serving's build has none). One build serves every hook:
 * a test sets them at run time with test_hooks_set(first_job, helper_delay_ns):
 *   first_job: the job number the pool starts from (tests of the tags' wrap); only before the
 *     first job (after it the call returns -1, unless first_job is the current number);
 *   helper_delay_ns: a pause where a helper that saw a job word may be preempted, which widens
 *     that window so that a test meets the interleaving on every try; 0: none. */
#ifndef TEST_HOOKS_H
#define TEST_HOOKS_H

#ifdef TEST_HOOKS
static volatile long helper_delay_ns; /* set by the test's thread, read by the helpers */
#define HELPER_PAUSE()                                                                      \
    do {                                                                                    \
        if (helper_delay_ns) nanosleep(&(struct timespec){0, helper_delay_ns}, NULL);       \
    } while (0)
int test_hooks_set(long first_job, long delay_ns);
#else
#define HELPER_PAUSE() ((void)0)
#endif

#endif
