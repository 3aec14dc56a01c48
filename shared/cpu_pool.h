/* The helper threads the compiled kernels share (cpu_pool.c). */
#ifndef MM_CPU_POOL_H
#define MM_CPU_POOL_H
#include <stdint.h>

typedef void (*mm_task_fn)(const void *ctx, int64_t task);

/* fn(ctx, t) for every t in [0, tasks), on the caller and whichever helpers are free; returns when
 * all are done. Callers on several threads take turns. */
void mm_pool_run(mm_task_fn fn, const void *ctx, int64_t tasks);

/* Helpers stop spinning and sleep until the next mm_pool_run (work of another kind follows). */
void mm_pool_rest(void);

/* Helper threads running (0: the caller runs every task). */
int64_t mm_pool_helpers(void);

/* Helpers asleep now (the others spin or work). */
int64_t mm_pool_sleeping(void);

/* Free this thread's AMX tiles if it holds any (cpu_packed.c): a helper calls it before it sleeps. */
void mm_tiles_release(void);

#endif
