/* Helper threads for the compiled kernels' parallel loops (cpu_packed.c's products, decode attention).
 *
 * A decode step runs ~100 weight products with tens of microseconds of single-threaded work
 * between them. An OpenMP team whose idle threads sleep after a short spin (the launcher's
 * GOMP_SPINCOUNT, so that an idle stage holds no core another stage needs) pays a wake-up per
 * product, and the product waits for its slowest thread: on the 2-core AMX Xeon, 97 products of a
 * `mid` decode step took ~36 ms inside the step against ~29 back to back. Here the caller and the
 * helpers share a loop's tasks through one atomic counter: the caller starts at once and takes
 * whatever the helpers have not, so a helper that is asleep or descheduled costs at most the task
 * it holds. A helper spins SPIN_NS after its last task (the gaps inside a step), then sleeps on a
 * futex (between steps), holding no core; at once where the caller says work of another kind
 * follows (mm_pool_rest: before torch's own OpenMP operators, whose threads would share the cores
 * with a spinning helper).
 */
#define _GNU_SOURCE
#include "cpu_pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define MAX_HELPERS 63
#define SPIN_NS 300000 /* a helper spins this long after its last task before it sleeps */

typedef struct {
    mm_task_fn fn;
    const void *ctx;
    int64_t tasks;
} job_t;

static job_t job;               /* the caller writes it only while no task of the last job is open */
static _Atomic uint64_t claim;  /* (job sequence << 32) | next task */
static _Atomic uint32_t posted; /* the job sequence, for helpers to wait on */
static _Atomic int64_t done;    /* tasks of the current job finished */
static _Atomic int sleepers;    /* helpers waiting on `posted` */
static _Atomic int64_t started; /* helpers running */
static _Atomic int resting;     /* the caller says no job comes soon: helpers sleep now */
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t caller_lock = PTHREAD_MUTEX_INITIALIZER;

static inline void pause_once(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void wait_for_post(uint32_t seen) {
#ifdef __linux__
    syscall(SYS_futex, &posted, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
    (void)seen;
    struct timespec t = {0, 50000};
    nanosleep(&t, NULL);
#endif
}

static void wake_helpers(void) {
#ifdef __linux__
    syscall(SYS_futex, &posted, FUTEX_WAKE_PRIVATE, MAX_HELPERS, NULL, NULL, 0);
#endif
}

/* Run tasks of job `seq` (whose fields `j` holds) until none is left or another job is posted. A
 * task is claimed with its job's sequence number, so fields copied as a newer job was being
 * written are never used: a claim succeeds only while the job it names is open. */
static void take_tasks(uint32_t seq, const job_t *j) {
    uint64_t word = atomic_load_explicit(&claim, memory_order_acquire);
    while ((uint32_t)(word >> 32) == seq && (int64_t)(uint32_t)word < j->tasks) {
        if (atomic_compare_exchange_weak_explicit(&claim, &word, word + 1, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            j->fn(j->ctx, (int64_t)(uint32_t)word);
            atomic_fetch_add_explicit(&done, 1, memory_order_release);
            word = atomic_load_explicit(&claim, memory_order_acquire);
        }
    }
}

static void *helper(void *arg) {
    (void)arg;
    uint32_t seen = atomic_load(&posted);
    for (;;) {
        int64_t idle_since = now_ns();
        uint32_t now;
        while ((now = atomic_load_explicit(&posted, memory_order_acquire)) == seen) {
            if (now_ns() - idle_since < SPIN_NS && !atomic_load_explicit(&resting, memory_order_relaxed)) {
                pause_once();
                continue;
            }
            mm_tiles_release();
            atomic_fetch_add(&sleepers, 1);
            if (atomic_load(&posted) == seen) wait_for_post(seen);
            atomic_fetch_sub(&sleepers, 1);
            idle_since = now_ns();
        }
        seen = now;
        job_t j = job;
        take_tasks(seen, &j);
    }
    return NULL;
}

/* A forked child has none of the parent's helpers: it runs every task itself. */
static void forked_child(void) {
    atomic_store(&started, 0);
    atomic_store(&sleepers, 0);
    pthread_mutex_init(&start_lock, NULL);
    pthread_mutex_init(&caller_lock, NULL);
}

/* Start helpers until `helpers` run (never fewer than before); 0 on success. */
int mm_pool_start(int64_t helpers) {
    static int hooked;
    pthread_mutex_lock(&start_lock);
    if (!hooked) hooked = pthread_atfork(NULL, NULL, forked_child) == 0;
    int rc = 0;
    while (atomic_load(&started) < helpers && atomic_load(&started) < MAX_HELPERS) {
        pthread_t t;
        if ((rc = pthread_create(&t, NULL, helper, NULL)) != 0) break;
        pthread_detach(t);
        atomic_fetch_add(&started, 1);
    }
    pthread_mutex_unlock(&start_lock);
    return rc;
}

int64_t mm_pool_helpers(void) { return atomic_load(&started); }

int64_t mm_pool_sleeping(void) { return atomic_load(&sleepers); }

void mm_pool_rest(void) {
    if (!atomic_load_explicit(&resting, memory_order_relaxed)) atomic_store_explicit(&resting, 1, memory_order_relaxed);
}

void mm_pool_run(mm_task_fn fn, const void *ctx, int64_t tasks) {
    if (tasks <= 0) return;
    pthread_mutex_lock(&caller_lock);
    atomic_store_explicit(&resting, 0, memory_order_relaxed);
    job = (job_t){fn, ctx, tasks};
    atomic_store_explicit(&done, 0, memory_order_relaxed);
    uint32_t seq = atomic_load_explicit(&posted, memory_order_relaxed) + 1;
    atomic_store_explicit(&claim, (uint64_t)seq << 32, memory_order_release);
    atomic_store(&posted, seq); /* sequentially consistent against a helper's sleepers / posted */
    if (tasks > 1 && atomic_load(&sleepers) > 0) wake_helpers();
    take_tasks(seq, &job);
    while (atomic_load_explicit(&done, memory_order_acquire) < tasks) pause_once();
    pthread_mutex_unlock(&caller_lock);
}
