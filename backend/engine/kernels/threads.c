/* threads.c: the library's pool of helper threads, which every product and the decode step's
 * attention split their work with (run_job). Its test hooks are in test_hooks.h. */
#include "group_matmul.h"
#include "test_hooks.h"

/* ---------------------------------------------------------------- a pool of helper threads
 * A job's units (a product's tiles, an attention's (sequence, head) pairs) are split into one part
 * per thread, the calling thread's and up to threads - 1 helpers'. Each thread takes units of its
 * own part from the front, a shrinking share at a time (a quarter of what is left), then units of
 * the other parts the same way: a thread the system preempts holds up only the units it holds, and
 * the other threads do the rest of its part. A helper spins on the job word for a while after
 * each job (the next product of a step follows within microseconds), then sleeps on a condition
 * variable until the next job. Jobs are posted by one thread at a time (an engine's step thread);
 * the caller's lock makes that so. */
#define SPIN_NS 200000L

/* a job for the pool: fn(ctx, u0, u1, thread) for units [u0, u1), run by thread 0 (the caller) to
 * threads - 1 */
typedef struct {
    void (*fn)(const void *ctx, long u0, long u1, long thread);
    const void *ctx;
} Job;

/* The job's word: (job number << PARTS_BITS) | parts (the threads it may use); a helper whose
 * index + 1 is below that takes units. Part p's cursor: CURSOR(tag, end, next), tag the job number
 * mod 2^19, units [next, end) of part p not taken yet. A thread takes units by advancing a cursor
 * (compare and swap) while its tag is the job's it saw and units are left; only after that does it
 * read `job`, which cannot change before the job completes, and the job cannot complete before
 * those units are done. A helper late to a job (preempted after it saw the word) finds another tag
 * or no unit left and takes nothing; units_done counts each unit of the current job exactly once. */
#define PARTS_BITS 5
#define UNIT_BITS 22 /* at most 4M units a job */
#define TAG(number) ((number) & 0x7FFFFL) /* 19 bits: a cursor (tag << 44) stays positive */
#define CURSOR(tag, end, next) ((tag) << (2 * UNIT_BITS) | (end) << UNIT_BITS | (next))
#define UNIT_MASK ((1L << UNIT_BITS) - 1)
typedef struct {
    _Alignas(64) atomic_long word; /* a cache line each: a part's owner takes from it alone until others steal */
} Cursor;
static Job job;
static atomic_long posted, units_done;
static Cursor cursors[MAX_HELPERS + 1];
static atomic_int sleeping;
static int helpers_started;
static long first_seen[MAX_HELPERS]; /* the word when helper i was started (before the job that needs it) */
static pthread_mutex_t wake_lock = PTHREAD_MUTEX_INITIALIZER, post_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;

/* takes units of part p of job `tag`: 1 and [*u0, *u1), or 0 when none is left */
static int take(long p, long tag, long *u0, long *u1) {
    long c = atomic_load(&cursors[p].word);
    for (;;) {
        const long next = c & UNIT_MASK, end = (c >> UNIT_BITS) & UNIT_MASK;
        if ((c >> (2 * UNIT_BITS)) != tag || next >= end) return 0;
        const long step = (end - next + 3) / 4;
        if (atomic_compare_exchange_weak(&cursors[p].word, &c, CURSOR(tag, end, next + step))) {
            *u0 = next, *u1 = next + step;
            return 1;
        }
    }
}

/* thread `me`'s share of job `tag` of `parts` parts: its own part, then whatever is left of the others */
static void take_units(long tag, long me, long parts) {
    long done = 0, u0, u1;
    for (long k = 0; k < parts; k++)
        while (take((me + k) % parts, tag, &u0, &u1)) {
            job.fn(job.ctx, u0, u1, me);
            done += u1 - u0;
        }
    if (done) atomic_fetch_add(&units_done, done);
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void *helper(void *arg) {
    const long index = (long)arg; /* thread index + 1 of the jobs that use it */
    long seen = first_seen[index];
    for (;;) {
        long word, start = now_ns();
        while ((word = atomic_load_explicit(&posted, memory_order_acquire)) == seen) {
            if (now_ns() - start > SPIN_NS) {
                pthread_mutex_lock(&wake_lock);
                atomic_fetch_add(&sleeping, 1);
                while ((word = atomic_load(&posted)) == seen) pthread_cond_wait(&wake, &wake_lock);
                atomic_fetch_sub(&sleeping, 1);
                pthread_mutex_unlock(&wake_lock);
                break;
            }
            _mm_pause();
        }
        seen = word;
        HELPER_PAUSE(); /* tests only (test_hooks.h): widens the window a preempted helper opens here */
        const long parts = word & ((1L << PARTS_BITS) - 1);
        if (index + 1 < parts) take_units(TAG(word >> PARTS_BITS), index + 1, parts);
    }
    return NULL;
}

/* a forked child has none of its parent's helper threads */
static void forget_helpers(void) {
    helpers_started = 0;
    atomic_store(&sleeping, 0);
    pthread_mutex_init(&wake_lock, NULL);
    pthread_mutex_init(&post_lock, NULL);
    pthread_cond_init(&wake, NULL);
}

/* start helpers up to count (once each); how many there are */
static int ensure_helpers(int count) {
    static int registered;
    if (!registered) registered = pthread_atfork(NULL, NULL, forget_helpers) == 0;
    while (helpers_started < count && helpers_started < MAX_HELPERS) {
        pthread_t t;
        first_seen[helpers_started] = atomic_load(&posted);
        if (pthread_create(&t, NULL, helper, (void *)(long)helpers_started) != 0) break;
        pthread_detach(t);
        helpers_started++;
    }
    return helpers_started;
}

/* fn over units [0, units), split between the caller and up to threads - 1 helpers */
void run_job(void (*fn)(const void *, long, long, long), const void *ctx, long threads, long units) {
    if (threads <= 1 || units <= 1) {
        fn(ctx, 0, units, 0);
        return;
    }
    pthread_mutex_lock(&post_lock);
    long parts = 1 + ensure_helpers((int)threads - 1);
    if (parts > threads) parts = threads;
    if (parts > units) parts = units;
    job = (Job){fn, ctx};
    atomic_store(&units_done, 0);
    const long number = (atomic_load_explicit(&posted, memory_order_relaxed) >> PARTS_BITS) + 1;
    for (long p = 0; p < parts; p++)
        atomic_store(&cursors[p].word, CURSOR(TAG(number), units * (p + 1) / parts, units * p / parts));
    atomic_store_explicit(&posted, number << PARTS_BITS | parts, memory_order_seq_cst);
    if (atomic_load(&sleeping)) {
        pthread_mutex_lock(&wake_lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&wake_lock);
    }
    take_units(TAG(number), 0, parts);
    for (long spins = 0; atomic_load_explicit(&units_done, memory_order_acquire) < units; spins++)
        if (spins < 20000)
            _mm_pause();
        else
            sched_yield(); /* a helper holding units was preempted: let it have this core */
    pthread_mutex_unlock(&post_lock);
}

#ifdef TEST_HOOKS
int test_hooks_set(long first_job, long delay_ns) {
    helper_delay_ns = delay_ns;
    const long word = atomic_load(&posted);
    if (first_job == word >> PARTS_BITS) return 0;
    if (helpers_started || word) return -1; /* a job has run: too late to renumber them */
    atomic_store(&posted, first_job << PARTS_BITS);
    return 0;
}
#endif
