// Fault injection (LD_PRELOAD; Linux, glibc): the gloo worker thread of a process's last collective lags until the
// process ends, as a preempted thread sometimes does on a loaded machine. Used by benchmarks/clean_exit.py and
// tests/megatron/test_clean_exit.py, with release_at_exit.py beside it.
//
// A gloo group runs each collective on a worker thread of its own: c10d::ProcessGroupGloo::AsyncWork::execute runs
// the collective and completes its future (the rank waiting on it goes on), then the worker lets go of the work and
// its tensors, taking the GIL where a tensor owns a Python object the rank has dropped. This library stands in for
// execute (libtorch_cpu calls it through its PLT): after torch's execute returns, the worker is held until one of:
// another collective of the process completes, a thread joins it (its group is being destroyed),
// the last exit handler runs (release_at_exit.py calls lagging_gloo_worker_exit() just before the interpreter
// finalizes), or LAG_MS milliseconds (default 10000) pass. So the worker of the process's last collective lets go of
// its tensors only at the end. The exit handler keeps the GIL a few milliseconds, so that this worker waits for the GIL
// while the interpreter starts finalizing. A process whose groups are alive then aborts as such a process does; one
// that destroyed its groups before has no worker left to let go. Nothing else changes.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

typedef void (*execute_fn)(const void *);
typedef int (*join_fn)(pthread_t, void **);

static volatile long generation;  // moves on at each event that lets the held worker go
static pthread_t held_worker;  // the worker held last
static volatile int exiting;

static int on_gloo_worker(void) {  // a group's worker thread (torch names them), not a rank's own thread
    char name[32] = {0};
    prctl(PR_GET_NAME, name, 0, 0, 0);
    return strncmp(name, "pt_gloo_runloop", 15) == 0;
}

static void pause_ms(long ms) {
    struct timespec pause = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&pause, NULL);
}

static const char EXECUTE[] =
    "_ZN4c10d16ProcessGroupGloo9AsyncWork7executeERKN3c1013intrusive_ptrIS1_NS2_6detail34intrusive_target_default_null_typeIS1_EEEE";

void _ZN4c10d16ProcessGroupGloo9AsyncWork7executeERKN3c1013intrusive_ptrIS1_NS2_6detail34intrusive_target_default_null_typeIS1_EEEE(
    const void *work) {
    static execute_fn real;
    if (!real) {  // libtorch_cpu sits in a local scope (Python's dlopen of torch._C): found by its soname
        void *torch_cpu = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
        real = (execute_fn)dlsym(torch_cpu ? torch_cpu : RTLD_NEXT, EXECUTE);
    }
    real(work);
    if (!on_gloo_worker())
        return;
    long mine = __sync_add_and_fetch(&generation, 1);
    held_worker = pthread_self();
    const char *env = getenv("LAG_MS");
    for (long left = env ? atol(env) : 10000; left > 0 && generation == mine && !exiting; left--)
        pause_ms(1);
}

int pthread_join(pthread_t thread, void **result) {
    static join_fn real;
    if (!real)
        real = (join_fn)dlvsym(RTLD_NEXT, "pthread_join", "GLIBC_2.34");
    if (!real)
        real = (join_fn)dlsym(RTLD_NEXT, "pthread_join");
    if (pthread_equal(thread, held_worker))
        __sync_add_and_fetch(&generation, 1);
    return real(thread, result);
}

// Called by the last exit handler with the GIL held (ctypes.PyDLL keeps it): lets the held worker go, and keeps the
// GIL for `hold_ms` while it reaches for it.
void lagging_gloo_worker_exit(long hold_ms) {
    exiting = 1;
    pause_ms(hold_ms);
}
