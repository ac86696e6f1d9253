// Fake CUDA runtime (libcudart subset) for running tidal's real CUDA backend on a CPU.
//
// Use: LD_PRELOAD=libfakecudart.so <program>. tidal links the *shared* libcudart
// (CUDA::cudart, runtime/CMakeLists.txt), so the symbols here interpose on it.
// With ASan, libasan must come first: LD_PRELOAD="libasan.so:libfakecudart.so".
//
// What it models (and checks, aborting with a message + backtrace on a bug):
// - Device memory: each cudaMalloc is a memfd mapped twice: the pointer handed out is
//   PROT_NONE (the CPU cannot read it, as on a GPU), copies go through a second RW mapping.
//   FAKE_CUDA_DEVICE_READABLE=1 maps the handed-out pointer RW instead (needed when torch
//   computes on the CPU over chunk views). Capacity: FAKE_CUDA_CAPACITY_BYTES (default
//   8 GiB); cudaMalloc beyond it fails with cudaErrorMemoryAllocation; cudaMemGetInfo reports it.
//   FAKE_CUDA_OTHERS_BYTES (default 0) of it are in use from the start by someone else (a
//   CUDA context, another process): cudaMemGetInfo counts them used, cudaMalloc cannot have them.
// - cudaHostRegister: the range must be mapped RW (else cudaErrorInvalidValue), must not be
//   device memory (cudaErrorInvalidValue), must not share a page with a live registration
//   (cudaErrorHostMemoryAlreadyRegistered). Pages are touched (pinning faults them in).
//   cudaHostUnregister of a pointer that is not a registration's start:
//   cudaErrorHostMemoryNotRegistered.
// - Abort: munmap/mremap/mprotect (to less than RW)/madvise(DONTNEED|FREE|REMOVE) over a registered range;
//   cudaFree of a pointer that is not a live allocation's start; copies whose pointers do not
//   match the copy kind or that leave an allocation.
// - Streams and events: copies run synchronously on the calling thread, in issue order, so
//   every stream and event is complete as soon as the call returns (cudaStreamQuery and
//   cudaEventQuery say cudaSuccess). This is a legal CUDA schedule: it checks what tidal
//   issues, not that tidal waits where it must. Handles are checked (destroying an unknown or
//   destroyed handle aborts).
// - Errors: FAKE_CUDA_FAIL_AT=N makes the N-th API call (counted from 1) and every call
//   after it fail with the sticky error FAKE_CUDA_FAIL_CODE (default 700,
//   cudaErrorIllegalAddress); fake_cuda_set_sticky_error(code) does the same from a test.
//   As on real CUDA, once sticky, every call (destroys and frees included) returns it.
// - Counters: printed to stderr at exit (unless FAKE_CUDA_QUIET=1), written as key=value
//   lines to the file named by FAKE_CUDA_REPORT at exit, and readable in-process through
//   fake_cuda_counters(). No fixed-size tables: registrations and allocations grow.
//
// Build: cc -O2 -shared -fPIC -I<cuda>/include -o libfakecudart.so fakecudart.c -ldl -lpthread
#define _GNU_SOURCE
#pragma GCC diagnostic ignored "-Wunused-parameter"  // the API's signatures, not all used
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

// ---- state (guarded by mu) -------------------------------------------------------
struct reg { uintptr_t a, n; };               // live host registrations
struct dev { uintptr_t dptr, shadow, n; };    // live device allocations
struct vec { void* p; size_t n, cap, elem; };

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct vec regs = {0, 0, 0, sizeof(struct reg)};
static struct vec devs = {0, 0, 0, sizeof(struct dev)};
static size_t dev_used;

typedef struct fake_cuda_counters_t {
  unsigned long long registers, register_failures, unregisters, live_registrations,
      live_registered_bytes, peak_registered_bytes, pageable_h2d, pageable_d2h, mallocs,
      frees, live_allocations, copies, api_calls;
  int sticky_error;
} fake_cuda_counters_t;
static fake_cuda_counters_t C;
static unsigned long long fail_at;  // 0: never
static int fail_code = cudaErrorIllegalAddress;
static size_t page_size = 4096;

static void die(const char* what, uintptr_t a, size_t n) {
  fprintf(stderr, "\n[fakecudart] FATAL: %s [%#lx, +%zu)\n", what, (unsigned long)a, n);
  void* bt[64];
  int k = backtrace(bt, 64);
  backtrace_symbols_fd(bt, k, 2);
  abort();
}

static void* vec_push(struct vec* v) {
  if (v->n == v->cap) {
    size_t cap = v->cap ? v->cap * 2 : 64;
    void* p = realloc(v->p, cap * v->elem);
    if (!p) die("out of host memory growing a table", 0, cap * v->elem);
    v->p = p;
    v->cap = cap;
  }
  return (char*)v->p + v->elem * v->n++;
}
static void vec_erase(struct vec* v, size_t i) {  // order does not matter: swap with last
  memcpy((char*)v->p + v->elem * i, (char*)v->p + v->elem * (v->n - 1), v->elem);
  v->n--;
}
#define REG(i) (((struct reg*)regs.p)[i])
#define DEV(i) (((struct dev*)devs.p)[i])

static uintptr_t page_down(uintptr_t a) { return a & ~(uintptr_t)(page_size - 1); }
static uintptr_t page_up(uintptr_t a) { return page_down(a + page_size - 1); }

// A live registration overlapping [a, a+n) byte-wise (exact) or, with pages=1, sharing a page.
static long find_reg(uintptr_t a, size_t n, int pages) {
  uintptr_t lo = pages ? page_down(a) : a, hi = pages ? page_up(a + n) : a + n;
  for (size_t i = 0; i < regs.n; i++) {
    uintptr_t rlo = pages ? page_down(REG(i).a) : REG(i).a;
    uintptr_t rhi = pages ? page_up(REG(i).a + REG(i).n) : REG(i).a + REG(i).n;
    if (lo < rhi && rlo < hi) return (long)i;
  }
  return -1;
}
// The live device allocation containing [p, p+n), or -1. *touches: one overlapping at all.
static long find_dev(uintptr_t p, size_t n, int* touches) {
  if (touches) *touches = 0;
  for (size_t i = 0; i < devs.n; i++) {
    uintptr_t lo = DEV(i).dptr, hi = lo + DEV(i).n;
    if (p < hi && lo < p + (n ? n : 1)) {
      if (touches) *touches = 1;
      if (p >= lo && p + n <= hi) return (long)i;
    }
  }
  return -1;
}
static int range_mapped_rw(uintptr_t a, size_t n) {
  FILE* f = fopen("/proc/self/maps", "r");
  if (!f) die("cannot read /proc/self/maps", a, n);
  char line[512];
  uintptr_t cur = a, end = a + n;
  while (cur < end && fgets(line, sizeof line, f)) {  // sorted by address
    unsigned long lo, hi;
    char perm[8];
    if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perm) != 3) continue;
    if (hi <= cur) continue;
    if (lo > cur || perm[0] != 'r' || perm[1] != 'w') break;
    cur = hi;
  }
  fclose(f);
  return cur >= end;
}

// Every API entry: count, apply injected failure, return the sticky error if any.
static cudaError_t enter(void) {
  C.api_calls++;
  if (fail_at && C.api_calls >= fail_at && !C.sticky_error) C.sticky_error = fail_code;
  return (cudaError_t)C.sticky_error;
}
#define ENTER()                      \
  pthread_mutex_lock(&mu);           \
  cudaError_t sticky_ = enter();     \
  if (sticky_ != cudaSuccess) {      \
    pthread_mutex_unlock(&mu);       \
    return sticky_;                  \
  }
#define LEAVE(rc)                    \
  do {                               \
    pthread_mutex_unlock(&mu);       \
    return (rc);                     \
  } while (0)

__attribute__((visibility("default"))) void fake_cuda_set_sticky_error(int code) {
  pthread_mutex_lock(&mu);
  C.sticky_error = code;
  pthread_mutex_unlock(&mu);
}
__attribute__((visibility("default"))) void fake_cuda_counters(fake_cuda_counters_t* out) {
  pthread_mutex_lock(&mu);
  C.live_registrations = regs.n;
  C.live_allocations = devs.n;
  *out = C;
  pthread_mutex_unlock(&mu);
}

__attribute__((constructor)) static void init(void) {
  long ps = sysconf(_SC_PAGESIZE);
  if (ps > 0) page_size = (size_t)ps;
  const char* e = getenv("FAKE_CUDA_FAIL_AT");
  if (e && *e) fail_at = strtoull(e, 0, 10);
  e = getenv("FAKE_CUDA_FAIL_CODE");
  if (e && *e) fail_code = atoi(e);
}

// ---- interposed libc calls -------------------------------------------------------
#define REAL(name)                   \
  static typeof(name)* real_##name;  \
  if (!real_##name) real_##name = (typeof(name)*)dlsym(RTLD_NEXT, #name)
static void check_not_pinned(const char* what, void* addr, size_t len) {
  pthread_mutex_lock(&mu);
  long i = find_reg((uintptr_t)addr, len, 0);
  if (i >= 0) {
    fprintf(stderr, "[fakecudart] registration [%#lx, +%zu)\n", (unsigned long)REG(i).a, (size_t)REG(i).n);
    die(what, (uintptr_t)addr, len);
  }
  pthread_mutex_unlock(&mu);
}
int munmap(void* addr, size_t len) {
  REAL(munmap);
  check_not_pinned("munmap of a registered (pinned) range", addr, len);
  return real_munmap(addr, len);
}
int madvise(void* addr, size_t len, int advice) {
  REAL(madvise);
  if (advice == MADV_DONTNEED || advice == MADV_FREE || advice == MADV_REMOVE)
    check_not_pinned("madvise(DONTNEED/FREE/REMOVE) of a registered range", addr, len);
  return real_madvise(addr, len, advice);
}
int mprotect(void* addr, size_t len, int prot) {
  REAL(mprotect);
  // Raising to RW is what an allocator's commit does (mimalloc commits a 2 MiB-aligned
  // range with mprotect(RW) that can cover the tail page of a live pinned block next to
  // it): a no-op for pages already RW. Anything less than RW breaks the pinned range.
  if ((prot & (PROT_READ | PROT_WRITE)) != (PROT_READ | PROT_WRITE))
    check_not_pinned("mprotect below PROT_READ|PROT_WRITE of a registered range", addr, len);
  return real_mprotect(addr, len, prot);
}
void* mremap(void* old, size_t old_len, size_t new_len, int flags, ...) {
  REAL(mremap);
  check_not_pinned("mremap of a registered range", old, old_len);
  // tidal never passes MREMAP_FIXED; refuse rather than drop the fifth argument silently.
  if (flags & MREMAP_FIXED) die("mremap with MREMAP_FIXED is not supported by the fake", (uintptr_t)old, old_len);
  return real_mremap(old, old_len, new_len, flags);
}

// ---- runtime API: device, errors ------------------------------------------------
static const char* err_name(cudaError_t e) {
  switch ((int)e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorHostMemoryAlreadyRegistered: return "cudaErrorHostMemoryAlreadyRegistered";
    case cudaErrorHostMemoryNotRegistered: return "cudaErrorHostMemoryNotRegistered";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    default: return "cudaErrorUnknown";
  }
}
const char* cudaGetErrorName(cudaError_t e) { return err_name(e); }
const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : "fake CUDA runtime error (see the name)";
}
cudaError_t cudaGetLastError(void) {  // sticky errors are not cleared, as on CUDA
  pthread_mutex_lock(&mu);
  cudaError_t e = enter();
  LEAVE(e);
}
cudaError_t cudaPeekAtLastError(void) { return cudaGetLastError(); }
cudaError_t cudaGetDeviceCount(int* c) { ENTER(); *c = 1; LEAVE(cudaSuccess); }
cudaError_t cudaGetDevice(int* d) { ENTER(); *d = 0; LEAVE(cudaSuccess); }
cudaError_t cudaSetDevice(int d) { ENTER(); LEAVE(d == 0 ? cudaSuccess : cudaErrorInvalidDevice); }
static size_t capacity(void) {
  const char* e = getenv("FAKE_CUDA_CAPACITY_BYTES");
  return e && *e ? (size_t)strtoull(e, 0, 10) : (size_t)8 << 30;
}
// Device memory this process cannot have: a CUDA context's and other processes'.
static size_t others(void) {
  const char* e = getenv("FAKE_CUDA_OTHERS_BYTES");
  size_t n = e && *e ? (size_t)strtoull(e, 0, 10) : 0;
  return n < capacity() ? n : capacity();
}
cudaError_t cudaMemGetInfo(size_t* f, size_t* t) {
  ENTER();
  size_t cap = capacity(), used = dev_used + others();
  *t = cap;
  *f = cap > used ? cap - used : 0;
  LEAVE(cudaSuccess);
}
static cudaError_t get_props(struct cudaDeviceProp* prop, int d) {
  ENTER();
  if (d != 0) LEAVE(cudaErrorInvalidDevice);
  memset(prop, 0, sizeof *prop);
  snprintf(prop->name, sizeof prop->name, "Fake CUDA device (libfakecudart)");
  prop->totalGlobalMem = capacity();
  prop->major = 9;
  LEAVE(cudaSuccess);
}
#undef cudaGetDeviceProperties
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp* prop, int d) { return get_props(prop, d); }
cudaError_t cudaGetDeviceProperties_v2(struct cudaDeviceProp* prop, int d) { return get_props(prop, d); }
cudaError_t cudaDeviceSynchronize(void) { ENTER(); LEAVE(cudaSuccess); }

// ---- streams and events: handles only, work is synchronous ----------------------
enum { STREAM_MAGIC = 0x5752454d, EVENT_MAGIC = 0x45564e54, DEAD = 0xdead };
struct handle { int magic; };
static struct handle* new_handle(int magic) {
  struct handle* h = malloc(sizeof *h);
  if (!h) die("out of host memory for a handle", 0, sizeof *h);
  h->magic = magic;
  return h;
}
static void check_handle(const void* h, int magic, const char* what) {
  if (h == NULL && magic == STREAM_MAGIC) return;  // the legacy default stream
  if (h == NULL || ((const struct handle*)h)->magic != magic) die(what, (uintptr_t)h, 0);
}
static void drop_handle(void* h, int magic, const char* what) {
  check_handle(h, magic, what);
  if (!h) die(what, 0, 0);
  ((struct handle*)h)->magic = DEAD;  // leaked on purpose: a later use is caught, not UB
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned f) { ENTER(); *s = (cudaStream_t)new_handle(STREAM_MAGIC); LEAVE(cudaSuccess); }
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }
cudaError_t cudaStreamDestroy(cudaStream_t s) { ENTER(); drop_handle(s, STREAM_MAGIC, "cudaStreamDestroy of a handle that is not a live stream"); LEAVE(cudaSuccess); }
cudaError_t cudaStreamQuery(cudaStream_t s) { ENTER(); check_handle(s, STREAM_MAGIC, "cudaStreamQuery of a dead stream"); LEAVE(cudaSuccess); }
cudaError_t cudaStreamSynchronize(cudaStream_t s) { ENTER(); check_handle(s, STREAM_MAGIC, "cudaStreamSynchronize of a dead stream"); LEAVE(cudaSuccess); }
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned f) {
  ENTER();
  check_handle(s, STREAM_MAGIC, "cudaStreamWaitEvent on a dead stream");
  check_handle(e, EVENT_MAGIC, "cudaStreamWaitEvent on a dead event");
  LEAVE(cudaSuccess);
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned f) { ENTER(); *e = (cudaEvent_t)new_handle(EVENT_MAGIC); LEAVE(cudaSuccess); }
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventDestroy(cudaEvent_t e) { ENTER(); drop_handle(e, EVENT_MAGIC, "cudaEventDestroy of a handle that is not a live event"); LEAVE(cudaSuccess); }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  ENTER();
  check_handle(e, EVENT_MAGIC, "cudaEventRecord of a dead event");
  check_handle(s, STREAM_MAGIC, "cudaEventRecord on a dead stream");
  LEAVE(cudaSuccess);
}
cudaError_t cudaEventQuery(cudaEvent_t e) { ENTER(); check_handle(e, EVENT_MAGIC, "cudaEventQuery of a dead event"); LEAVE(cudaSuccess); }
cudaError_t cudaEventSynchronize(cudaEvent_t e) { ENTER(); check_handle(e, EVENT_MAGIC, "cudaEventSynchronize of a dead event"); LEAVE(cudaSuccess); }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  ENTER();
  check_handle(a, EVENT_MAGIC, "cudaEventElapsedTime of a dead event");
  check_handle(b, EVENT_MAGIC, "cudaEventElapsedTime of a dead event");
  *ms = 0.0f;  // synchronous copies: no time passes between events
  LEAVE(cudaSuccess);
}

// ---- device memory ---------------------------------------------------------------
cudaError_t cudaMalloc(void** p, size_t n) {
  ENTER();
  if (!p) LEAVE(cudaErrorInvalidValue);
  if (n == 0) { *p = NULL; LEAVE(cudaSuccess); }
  size_t used = dev_used + others();
  if (n > capacity() - (used < capacity() ? used : capacity())) LEAVE(cudaErrorMemoryAllocation);
  int readable = getenv("FAKE_CUDA_DEVICE_READABLE") && strcmp(getenv("FAKE_CUDA_DEVICE_READABLE"), "0") != 0;
  int fd = (int)syscall(SYS_memfd_create, "fakecuda-device", 0);
  if (fd < 0) LEAVE(cudaErrorMemoryAllocation);
  if (ftruncate(fd, (off_t)n) != 0) { close(fd); LEAVE(cudaErrorMemoryAllocation); }
  void* d = mmap(0, n, readable ? PROT_READ | PROT_WRITE : PROT_NONE, MAP_SHARED, fd, 0);
  void* s = mmap(0, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  REAL(munmap);
  if (d == MAP_FAILED || s == MAP_FAILED) {
    if (d != MAP_FAILED) real_munmap(d, n);
    if (s != MAP_FAILED) real_munmap(s, n);
    LEAVE(cudaErrorMemoryAllocation);
  }
  *(struct dev*)vec_push(&devs) = (struct dev){(uintptr_t)d, (uintptr_t)s, n};
  dev_used += n;
  C.mallocs++;
  *p = d;
  LEAVE(cudaSuccess);
}
cudaError_t cudaFree(void* p) {
  ENTER();
  if (!p) LEAVE(cudaSuccess);
  long i = find_dev((uintptr_t)p, 0, NULL);
  if (i < 0 || DEV(i).dptr != (uintptr_t)p) die("cudaFree of a pointer that is not a live cudaMalloc", (uintptr_t)p, 0);
  REAL(munmap);
  real_munmap((void*)DEV(i).dptr, DEV(i).n);
  real_munmap((void*)DEV(i).shadow, DEV(i).n);
  dev_used -= DEV(i).n;
  vec_erase(&devs, (size_t)i);
  C.frees++;
  LEAVE(cudaSuccess);
}

// ---- pinning ---------------------------------------------------------------------
cudaError_t cudaHostRegister(void* p, size_t n, unsigned flags) {
  ENTER();
  uintptr_t a = (uintptr_t)p;
  cudaError_t rc = cudaSuccess;
  int touches = 0;
  if (!p || !n) rc = cudaErrorInvalidValue;
  else if (find_dev(a, n, &touches), touches) rc = cudaErrorInvalidValue;
  else if (find_reg(a, n, 1) >= 0) rc = cudaErrorHostMemoryAlreadyRegistered;
  else if (!range_mapped_rw(a, n)) rc = cudaErrorInvalidValue;
  if (rc != cudaSuccess) {
    C.register_failures++;
    if (getenv("FAKE_CUDA_VERBOSE")) fprintf(stderr, "[fakecudart] cudaHostRegister [%#lx, +%zu) -> %s\n", (unsigned long)a, n, err_name(rc));
    LEAVE(rc);
  }
  for (uintptr_t q = page_down(a); q < a + n; q += page_size) {  // pinning faults pages in
    volatile char* c = (volatile char*)(q < a ? a : q);
    (void)*c;
  }
  *(struct reg*)vec_push(&regs) = (struct reg){a, n};
  C.registers++;  // successful registrations only; failures count in register_failures
  C.live_registered_bytes += n;
  if (C.live_registered_bytes > C.peak_registered_bytes) C.peak_registered_bytes = C.live_registered_bytes;
  LEAVE(cudaSuccess);
}
cudaError_t cudaHostUnregister(void* p) {
  ENTER();
  for (size_t i = 0; i < regs.n; i++)
    if (REG(i).a == (uintptr_t)p) {
      C.unregisters++;
      C.live_registered_bytes -= REG(i).n;
      vec_erase(&regs, i);
      LEAVE(cudaSuccess);
    }
  LEAVE(cudaErrorHostMemoryNotRegistered);
}

// ---- copies (synchronous) --------------------------------------------------------
static char* to_shadow(long i, uintptr_t p) { return (char*)(DEV(i).shadow + (p - DEV(i).dptr)); }
static cudaError_t copy(void* dst, const void* src, size_t n, enum cudaMemcpyKind kind) {
  ENTER();
  C.copies++;
  if (n == 0) LEAVE(cudaSuccess);
  int dt, st;
  long di = find_dev((uintptr_t)dst, n, &dt), si = find_dev((uintptr_t)src, n, &st);
  if (kind == cudaMemcpyDefault) kind = dt ? (st ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                                           : (st ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  char* d = (char*)dst;
  const char* s = (const char*)src;
  switch (kind) {
    case cudaMemcpyHostToDevice:
      if (di < 0) die(dt ? "H2D copy leaves its device allocation" : "H2D copy: destination is not device memory", (uintptr_t)dst, n);
      if (st) die("H2D copy: source is device memory", (uintptr_t)src, n);
      if (find_reg((uintptr_t)src, n, 0) < 0) C.pageable_h2d++;
      d = to_shadow(di, (uintptr_t)dst);
      break;
    case cudaMemcpyDeviceToHost:
      if (si < 0) die(st ? "D2H copy leaves its device allocation" : "D2H copy: source is not device memory", (uintptr_t)src, n);
      if (dt) die("D2H copy: destination is device memory", (uintptr_t)dst, n);
      if (find_reg((uintptr_t)dst, n, 0) < 0) C.pageable_d2h++;
      s = to_shadow(si, (uintptr_t)src);
      break;
    case cudaMemcpyDeviceToDevice:
      if (di < 0) die("D2D copy: destination is not inside one device allocation", (uintptr_t)dst, n);
      if (si < 0) die("D2D copy: source is not inside one device allocation", (uintptr_t)src, n);
      d = to_shadow(di, (uintptr_t)dst);
      s = to_shadow(si, (uintptr_t)src);
      break;
    case cudaMemcpyHostToHost:
      if (dt || st) die("H2H copy touches device memory", (uintptr_t)(dt ? dst : src), n);
      break;
    default:
      LEAVE(cudaErrorInvalidMemcpyDirection);
  }
  memmove(d, s, n);
  LEAVE(cudaSuccess);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, enum cudaMemcpyKind kind, cudaStream_t stream) {
  pthread_mutex_lock(&mu);
  check_handle(stream, STREAM_MAGIC, "cudaMemcpyAsync on a dead stream");
  pthread_mutex_unlock(&mu);
  return copy(dst, src, n, kind);
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, enum cudaMemcpyKind kind) { return copy(dst, src, n, kind); }

// ---- exit report -----------------------------------------------------------------
__attribute__((destructor)) static void report(void) {
  fake_cuda_counters_t c;
  fake_cuda_counters(&c);
  const char* path = getenv("FAKE_CUDA_REPORT");
  if (path && *path) {
    FILE* f = fopen(path, "w");
    if (f) {
      fprintf(f,
              "registers=%llu\nregister_failures=%llu\nunregisters=%llu\nlive_registrations=%llu\n"
              "live_registered_bytes=%llu\npeak_registered_bytes=%llu\npageable_h2d=%llu\npageable_d2h=%llu\n"
              "mallocs=%llu\nfrees=%llu\nlive_allocations=%llu\ncopies=%llu\napi_calls=%llu\nsticky_error=%d\n",
              c.registers, c.register_failures, c.unregisters, c.live_registrations, c.live_registered_bytes,
              c.peak_registered_bytes, c.pageable_h2d, c.pageable_d2h, c.mallocs, c.frees, c.live_allocations,
              c.copies, c.api_calls, c.sticky_error);
      fclose(f);
    } else {
      fprintf(stderr, "[fakecudart] cannot write FAKE_CUDA_REPORT=%s\n", path);
    }
  }
  const char* q = getenv("FAKE_CUDA_QUIET");
  if (q && strcmp(q, "0") != 0) return;
  fprintf(stderr,
          "[fakecudart] registers %llu (failed %llu) unregisters %llu, live at exit %llu (%llu bytes), "
          "peak pinned %llu, pageable copies h2d %llu d2h %llu, allocations %llu freed %llu live %llu, sticky %d\n",
          c.registers, c.register_failures, c.unregisters, c.live_registrations, c.live_registered_bytes,
          c.peak_registered_bytes, c.pageable_h2d, c.pageable_d2h, c.mallocs, c.frees, c.live_allocations,
          c.sticky_error);
}
