// Crash reporter for scripts/gpu_run.sh, loaded with LD_PRELOAD into every
// phase's processes (Python, ctest's test binaries). On SIGSEGV, SIGBUS,
// SIGILL, SIGFPE or SIGABRT it writes to stderr: the signal, whether it was a
// fault or raised, the fault address and the PC with the /proc/self/maps line
// holding each, and the native backtrace (backtrace_symbols_fd); then it calls
// the handler the process itself installed (Python's faulthandler, which
// prints every thread's Python stack), then dies of the signal as it would
// have without us.
//   cc -O1 -g -shared -fPIC -o build/segv_backtrace.so scripts/segv_backtrace.c -ldl
//
// Note [Staying first in line]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// faulthandler installs its handler after we load and, when it has printed
// the Python stack, re-raises the signal with raise(): a handler that it
// chained to would see a raised signal, not the fault address. So we
// interpose sigaction(): for the signals above, a handler someone else
// installs is recorded in `chained[sig]` (and the previous one returned to
// them as oldact), while ours stays installed in the kernel. Our handler
// reports first, with the real siginfo, then calls the chained one. glibc's
// signal() does not go through the PLT and is not seen; Python and torch use
// sigaction().
//
// Everything in the handler is async-signal-safe except backtrace(), whose
// first call loads libgcc's unwinder: the constructor makes that call.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

typedef int (*sigaction_fn)(int, const struct sigaction*, struct sigaction*);
static sigaction_fn real_sigaction;
static struct sigaction chained[65];  // what the process installed; see Note [Staying first in line]
static volatile sig_atomic_t reporting;
static const int kSignals[] = {SIGSEGV, SIGBUS, SIGABRT, SIGILL, SIGFPE};

static int watched(int sig) {
  for (unsigned i = 0; i < sizeof kSignals / sizeof *kSignals; i++)
    if (kSignals[i] == sig) return 1;
  return 0;
}
static void say(const char* s) { (void)!write(2, s, strlen(s)); }
static void hex(uintptr_t v) {
  char b[19] = "0x";
  b[18] = 0;
  for (int i = 17; i >= 2; --i, v >>= 4) b[i] = "0123456789abcdef"[v & 15];
  say(b);
}
static void dec(long v) {
  char b[24];
  int i = 23;
  b[i] = 0;
  int neg = v < 0;
  unsigned long u = neg ? -(unsigned long)v : (unsigned long)v;
  do { b[--i] = (char)('0' + u % 10); u /= 10; } while (u && i > 1);
  if (neg) b[--i] = '-';
  say(b + i);
}
static uintptr_t parse_hex(const char** p) {
  uintptr_t v = 0;
  for (;; ++*p) {
    char c = **p;
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return v;
    v = v * 16 + (uintptr_t)d;
  }
}

// Reads /proc/self/maps a buffer at a time and prints the line holding `a`.
static void show_mapping(const char* what, uintptr_t a) {
  static char buf[64 << 10];
  int fd = open("/proc/self/maps", O_RDONLY);
  if (fd < 0) { say("[segv_bt] cannot open /proc/self/maps\n"); return; }
  size_t have = 0;
  for (;;) {
    ssize_t r = read(fd, buf + have, sizeof buf - 1 - have);
    if (r <= 0) break;
    have += (size_t)r;
    buf[have] = 0;
    char* line = buf;
    char* nl;
    while ((nl = strchr(line, '\n')) != NULL) {
      *nl = 0;
      const char* p = line;
      uintptr_t lo = parse_hex(&p);
      ++p;
      uintptr_t hi = parse_hex(&p);
      if (a >= lo && a < hi) {
        say("[segv_bt] "); say(what); say(" "); hex(a); say(" (+"); hex(a - lo); say(" into) ");
        say(line); say("\n");
        close(fd);
        return;
      }
      line = nl + 1;
    }
    have = (size_t)(buf + have - line);  // keep the partial last line
    memmove(buf, line, have);
  }
  close(fd);
  say("[segv_bt] "); say(what); say(" "); hex(a); say(" is in no mapping\n");
}

static void handler(int sig, siginfo_t* si, void* ctx) {
  if (!reporting) {
    reporting = 1;
    uintptr_t pc = (uintptr_t)((ucontext_t*)ctx)->uc_mcontext.gregs[REG_RIP];
    say("\n[segv_bt] signal "); dec(sig); say(" ("); say(strsignal(sig)); say(") ");
    say(si->si_code > 0 ? "fault" : "raised"); say(", si_code "); dec(si->si_code);
    say(", pid "); dec(getpid()); say("\n");
    if (si->si_code > 0) show_mapping("fault address", (uintptr_t)si->si_addr);
    show_mapping("pc", pc);
    say("[segv_bt] native backtrace:\n");
    void* bt[128];
    int k = backtrace(bt, 128);
    backtrace_symbols_fd(bt, k, 2);
    say("[segv_bt] end of native backtrace\n");
    struct sigaction next = chained[sig];
    if (!(next.sa_flags & SA_SIGINFO) && (next.sa_handler == SIG_DFL || next.sa_handler == SIG_IGN)) {
      // nothing of the process's own to call
    } else if (next.sa_flags & SA_SIGINFO) {
      next.sa_sigaction(sig, si, ctx);  // e.g. a handler that prints more
    } else {
      next.sa_handler(sig);  // faulthandler: prints the Python stacks, then raise()s
    }
  }
  // Die of the signal: the default action, then re-raise (a raised signal) or
  // return to re-execute the faulting instruction (a fault).
  struct sigaction dfl;
  memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  real_sigaction(sig, &dfl, NULL);
  if (si->si_code <= 0) raise(sig);
}

int sigaction(int sig, const struct sigaction* act, struct sigaction* oldact) {
  if (!real_sigaction) real_sigaction = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
  if (sig > 0 && sig < 65 && watched(sig) && !reporting) {
    if (oldact) *oldact = chained[sig];
    if (act) chained[sig] = *act;
    return 0;
  }
  return real_sigaction(sig, act, oldact);
}

__attribute__((constructor)) static void install(void) {
  if (!real_sigaction) real_sigaction = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
  static char stack[256 << 10];
  stack_t ss = {.ss_sp = stack, .ss_size = sizeof stack};
  sigaltstack(&ss, NULL);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = handler;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  for (unsigned i = 0; i < sizeof kSignals / sizeof *kSignals; i++)
    real_sigaction(kSignals[i], &sa, &chained[kSignals[i]]);
  void* warm[2];
  backtrace(warm, 2);  // load libgcc's unwinder now, not inside the handler
}
