/* A test-suite aid for oversubscribed machines (tests/mpirun.py preloads it into every rank).
 *
 * MPICH waits by polling, and every MPIR_CVAR_POLLS_BEFORE_YIELD polls (1000) calls sched_yield(). With more
 * ranks than cores (4-8 ranks on the 2 cores CI has), a yield gives the core to nobody in particular: the
 * waiting rank keeps most of it while the rank it waits for is runnable. This sched_yield sleeps 50 us
 * instead, so a waiting rank really lets the others run. Results are unchanged (only when a waiting rank
 * polls); the CPU a 4-rank test job burns drops by about a third on 2 cores. Not for production runs: one
 * rank per core never needs it.
 */
#include <time.h>

int sched_yield(void)
{
    struct timespec pause = {0, 50000};
    nanosleep(&pause, NULL);
    return 0;
}
