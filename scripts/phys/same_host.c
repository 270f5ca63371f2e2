// same_host.c: what this machine can copy between two processes right now, the ceiling of the
// transfer engine's same-host path. A child holds a region; the parent reads it with
// process_vm_readv (what the engine does) and, for scale, memcpy's it from a shared mapping,
// each on THREADS threads, in the engine benchmark's shape (MIB MiB at once). Every copy is
// checked against the source. Prints one JSON line of medians over REPS.
//
//   same_host [MIB=64] [THREADS=2] [REPS=15]
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static size_t size;
static int threads;
static pid_t child;
static unsigned char *remote, *local;
static int use_pvm;

static void *copy_part(void *arg) {
  long i = (long)arg;
  size_t part = size / threads, off = i * part, done = 0;
  if (i == threads - 1) part = size - off;
  if (!use_pvm) {
    memcpy(local + off, remote + off, part);
    return NULL;
  }
  while (done < part) {
    size_t n = part - done;
    if (n > (4u << 20)) n = 4u << 20;
    struct iovec l = {local + off + done, n}, r = {remote + off + done, n};
    ssize_t got = process_vm_readv(child, &l, 1, &r, 1, 0);
    if (got <= 0) {
      perror("process_vm_readv");
      exit(1);
    }
    done += (size_t)got;
  }
  return NULL;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double run(int pvm, int reps) {
  double *rates = calloc(reps, sizeof(double));
  use_pvm = pvm;
  for (int r = 0; r < reps; r++) {
    memset(local, 0, size);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    pthread_t t[64];
    for (long i = 0; i < threads; i++) pthread_create(&t[i], NULL, copy_part, (void *)i);
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (memcmp(local, remote, size) != 0) {
      fprintf(stderr, "same_host: a copy came back wrong\n");
      exit(1);
    }
    double s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
    rates[r] = size / s / (1 << 30);
  }
  qsort(rates, reps, sizeof(double), cmp);
  double m = rates[reps / 2];
  free(rates);
  return m;
}

int main(int argc, char **argv) {
  size = (size_t)(argc > 1 ? atol(argv[1]) : 64) << 20;
  threads = argc > 2 ? atoi(argv[2]) : 2;
  int reps = argc > 3 ? atoi(argv[3]) : 15;
  if (size == 0 || threads < 1 || threads > 64 || reps < 1) {
    fprintf(stderr, "usage: same_host [MIB>0] [THREADS 1..64] [REPS>0]\n");
    return 2;
  }
  // Shared so that the memcpy comparison reads the very pages process_vm_readv reads.
  remote = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  local = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (remote == MAP_FAILED || local == MAP_FAILED) {
    perror("mmap");
    return 1;
  }
  for (size_t i = 0; i < size; i++) remote[i] = (unsigned char)(i * 131 + 7);
  int gate[2];
  if (pipe(gate) != 0) return 1;
  child = fork();
  if (child == 0) {
    char c;
    close(gate[1]);
    // Holds the region until the parent closes the pipe (or dies).
    while (read(gate[0], &c, 1) > 0) {
    }
    _exit(0);
  }
  close(gate[0]);
  double pvm = run(1, reps), mem = run(0, reps);
  close(gate[1]);
  waitpid(child, NULL, 0);
  printf("{\"MiB\": %zu, \"threads\": %d, \"reps\": %d, \"process_vm_readv_GiB/s\": %.2f, "
         "\"memcpy_GiB/s\": %.2f}\n",
         size >> 20, threads, reps, pvm, mem);
  return 0;
}
