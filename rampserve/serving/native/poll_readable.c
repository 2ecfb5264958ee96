/* Whether a file descriptor becomes readable within a time, found by looking at it again and again and yielding the
   core to any other runnable thread between looks: the executor's idle poll (rampserve.serving.idle_poll), called
   through ctypes, which lets go of Python's GIL for the whole call. */
#include <poll.h>
#include <sched.h>
#include <time.h>

static double monotonic_seconds(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

/* 1 when `fd` is readable (or closed, or in error: a read then says which) before `seconds` pass, else 0. */
int poll_readable(int fd, double seconds) {
    struct pollfd watched = {fd, POLLIN, 0};
    double end = monotonic_seconds() + seconds;
    for (;;) {
        if (poll(&watched, 1, 0) > 0)
            return 1;
        if (monotonic_seconds() >= end)
            return 0;
        sched_yield();
    }
}
