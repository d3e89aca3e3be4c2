/* The floors the paired benchmark prints beside its figures, measured in C so that they are
   the machine's and not the interpreter's:

   - handoff: a word handed from one process to another through a shared page and back, half
     a round trip, with the receiver spinning on the word (pause between loads), and with the
     receiver asleep in futex_wait and the sender's futex_wake waking it;
   - memcpy: one core copying N bytes between two buffers whose pages are already faulted in.

   Usage: floors ROUNDS SIZE...  Prints one JSON object on stdout:
   {"handoff_spin_s": ..., "handoff_futex_s": ..., "memcpy_s": {"SIZE": seconds, ...}}
   Each figure is the median of several batches (a shared machine's noise lands in a few). */

#define _GNU_SOURCE
#include <linux/futex.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BATCHES 9
#define BATCH_S 0.2

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof v[0], cmp);
    return v[n / 2];
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static void futex_wait(uint32_t *word, uint32_t expected) {
    syscall(SYS_futex, word, FUTEX_WAIT, expected, NULL, NULL, 0);
}

static void futex_wake(uint32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE, 1, NULL, NULL, 0); }

/* Waits until *word == want: spinning, or asleep in the kernel between wakes. */
static void await(uint32_t *word, uint32_t want, int sleep) {
    for (;;) {
        uint32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if (seen == want) return;
        if (sleep)
            futex_wait(word, seen);
        else
            relax();
    }
}

static void hand(uint32_t *word, uint32_t value, int sleep) {
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
    if (sleep) futex_wake(word);
}

/* One way of a handoff, in seconds: the median batch's round trips over twice their count.
   The parent hands odd values, the child answers with the next even one. A batch ends after
   ROUNDS round trips or BATCH_S seconds: where the two processes share a core, each handoff
   waits for the scheduler, and the floor is then that (slow) figure, not a long wait. */
static double handoff(uint32_t *word, long rounds, int sleep) {
    double batch[BATCHES];
    __atomic_store_n(word, 0, __ATOMIC_RELEASE);
    pid_t child = fork();
    if (child < 0) {
        perror("floors: fork");
        exit(1);
    }
    if (child == 0) {
        for (uint32_t v = 1;; v += 2) {
            await(word, v, sleep);
            hand(word, v + 1, sleep);
        }
    }
    uint32_t v = 1;
    for (int b = 0; b < BATCHES; b++) {
        double start = now(), took = 0.0;
        long done = 0;
        while (done < rounds) {
            hand(word, v, sleep);
            await(word, v + 1, sleep);
            v += 2;
            done++;
            if ((done & 63) == 0 && (took = now() - start) > BATCH_S) break;
        }
        took = now() - start;
        batch[b] = took / (2.0 * (double)done);
    }
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    return median(batch, BATCHES);
}

static double copy(size_t n) {
    char *src = malloc(n ? n : 1), *dst = malloc(n ? n : 1);
    if (!src || !dst) {
        fprintf(stderr, "floors: cannot allocate %zu bytes\n", n);
        exit(1);
    }
    memset(src, 1, n);
    memset(dst, 0, n); /* faults the pages in: not part of a copy */
    /* Enough repetitions per batch that a timing is well above the clock's resolution. */
    long reps = n >= (1 << 20) ? 3 : (long)((64 << 20) / (n + 64));
    if (reps < 1) reps = 1;
    double batch[BATCHES];
    for (int b = 0; b < BATCHES; b++) {
        double start = now();
        for (long i = 0; i < reps; i++) {
            memcpy(dst, src, n);
            __asm__ volatile("" : : "r"(dst) : "memory"); /* the copy is not elided */
        }
        batch[b] = (now() - start) / (double)reps;
    }
    free(src);
    free(dst);
    return median(batch, BATCHES);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: floors ROUNDS SIZE...\n");
        return 2;
    }
    long rounds = atol(argv[1]);
    uint32_t *word = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (word == MAP_FAILED) {
        perror("floors: mmap");
        return 1;
    }
    double spin = handoff(word, rounds, 0);
    double sleep = handoff(word, rounds / 10 > 0 ? rounds / 10 : 1, 1);
    printf("{\"handoff_spin_s\": %.9g, \"handoff_futex_s\": %.9g, \"memcpy_s\": {", spin, sleep);
    for (int i = 2; i < argc; i++) {
        size_t n = (size_t)atoll(argv[i]);
        printf("%s\"%zu\": %.9g", i > 2 ? ", " : "", n, copy(n));
    }
    printf("}}\n");
    return 0;
}
