/* corral-lockdown: the lock-down of every process the daemon starts in a gVisor sandbox.
 *
 * runsc exec starts a process with the capabilities of its process.json (none) but, in the
 * runsc this runs on, no seccomp filter. So each process is started as this binary (bound
 * read-only into the sandbox), which applies what the container substrate's exec path applies
 * (rust/src/harden.rs) and only then runs the command: rlimits, no capability in any set,
 * no_new_privs, then the sandbox seccomp filter (the same BPF program, compiled by the daemon
 * and bound next to this binary). gVisor's sentry enforces a filter installed by the sandboxed
 * process itself; every child inherits it. Any step that fails ends this process before the
 * command runs (exit 125, a line on stderr): never a command without its filter.
 *
 * argv: "corral-lockdown", mode, the filter's path, then by mode:
 *   "x" (exec)  nlimits, nlimits x (resource, soft, hard: decimal, "-" for infinity), ncand,
 *               the exec candidates, the command's argv. envp: the command's environment.
 *   "i" (init)  nothing: the sandbox's PID 1. Not dumpable (its memory and fds stay out of
 *               reach of root in the sandbox), every signal it can ignored (gVisor delivers a
 *               signal without a handler to a namespace's init, and its end is the sandbox's),
 *               reaps what is orphaned to it, forever.
 *   "k" (kill)  pid: SIGKILL to the process group ``pid`` and to ``pid`` (a command whose
 *               runsc exec client was killed on the host).
 *
 * Freestanding (no libc, raw syscalls, static, no relocations), like corral-init.
 */

#define O_RDONLY 0
#define O_CLOEXEC 02000000
#define PR_SET_DUMPABLE 4
#define PR_SET_NO_NEW_PRIVS 38
#define PR_CAPBSET_DROP 24
#define PR_CAP_AMBIENT 47
#define PR_CAP_AMBIENT_CLEAR_ALL 4
#define SECCOMP_SET_MODE_FILTER 1
#define SIG_BLOCK 0
#define SIG_SETMASK 2
#define SIGKILL 9
#define SIGCHLD 17
#define SIGSTOP 19
#define WNOHANG 1
#define WALL 0x40000000
#define EINTR 4
#define EINVAL 22
#define MAX_FILTER_BYTES (4096 * 8)
#define MAX_LIMITS 16

#include "syscall.h"

#if defined(__x86_64__)
#define NR_rt_sigaction 13
#define NR_kill 62
#define NR_seccomp 317
#elif defined(__aarch64__)
#define NR_rt_sigaction 134
#define NR_kill 129
#define NR_seccomp 277
#endif

struct sock_fprog {
    unsigned short len;
    void *filter;
};

static unsigned char filter[MAX_FILTER_BYTES] __attribute__((aligned(8)));

static __attribute__((noreturn)) void leave(long code) {
    for (;;)
        sys3(NR_exit_group, code, 0, 0);
}

static long len(const char *s) {
    long n = 0;
    while (s[n])
        n++;
    return n;
}

static __attribute__((noreturn)) void fail(const char *what, long rc) {
    static const char pre[] = "corral-lockdown: ";
    char num[24];
    int i = sizeof(num);
    unsigned long e = rc < 0 ? (unsigned long)-rc : (unsigned long)rc;
    num[--i] = '\n';
    do {
        num[--i] = (char)('0' + e % 10);
        e /= 10;
    } while (e && i > 1);
    num[--i] = ' ';
    sys3(NR_write, 2, (long)pre, sizeof(pre) - 1);
    sys3(NR_write, 2, (long)what, len(what));
    sys3(NR_write, 2, (long)(num + i), sizeof(num) - i);
    leave(125);
}

/* A decimal number, "-" (infinity: ~0), or -1 if neither. */
static long number(const char *p, unsigned long *out) {
    unsigned long n = 0;
    if (p[0] == '-' && !p[1]) {
        *out = ~0UL;
        return 0;
    }
    if (!*p)
        return -1;
    for (; *p; p++) {
        if (*p < '0' || *p > '9' || n > (~0UL - 9) / 10)
            return -1;
        n = n * 10 + (unsigned long)(*p - '0');
    }
    *out = n;
    return 0;
}

/* No capability in any set, no_new_privs, the filter: the order harden.rs applies them in. */
static void lock_down(const char *path) {
    long fd = sys4(NR_openat, -100, (long)path, O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0)
        fail("open the seccomp filter", fd);
    long got = 0;
    for (;;) {
        long n = sys3(NR_read, fd, (long)(filter + got), MAX_FILTER_BYTES - got);
        if (n == -EINTR)
            continue;
        if (n < 0)
            fail("read the seccomp filter", n);
        if (n == 0)
            break;
        got += n;
        if (got == MAX_FILTER_BYTES)
            break;
    }
    sys3(NR_close, fd, 0, 0);
    if (got == 0 || got % 8 != 0 || got >= MAX_FILTER_BYTES)
        fail("the seccomp filter has a bad size", got);
    /* The bounding set: runsc exec gives the one of process.json (empty); anything left is
     * dropped while CAP_SETPCAP (if held) still allows it. */
    for (long cap = 0; cap < 64; cap++)
        sys3(NR_prctl, PR_CAPBSET_DROP, cap, 0);
    struct {
        unsigned int version;
        int pid;
    } hdr = {0x20080522, 0};
    unsigned int data[6] = {0, 0, 0, 0, 0, 0};
    long rc = sys3(NR_capset, (long)&hdr, (long)data, 0);
    if (rc < 0)
        fail("capset", rc);
    /* EINVAL: a kernel without ambient capabilities (gVisor's), so none to clear. */
    rc = sys6(NR_prctl, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0, 0);
    if (rc < 0 && rc != -EINVAL)
        fail("clear the ambient capabilities", rc);
    rc = sys6(NR_prctl, PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0, 0);
    if (rc < 0)
        fail("no_new_privs", rc);
    struct sock_fprog prog = {(unsigned short)(got / 8), filter};
    rc = sys3(NR_seccomp, SECCOMP_SET_MODE_FILTER, 0, (long)&prog);
    if (rc < 0)
        fail("seccomp", rc);
}

static __attribute__((noreturn)) void init(void) {
    unsigned long act[4] = {1, 0, 0, 0}; /* SIG_IGN, no flags, no restorer, no mask */
    unsigned long chld = 1UL << (SIGCHLD - 1);
    struct {
        long sec, nsec;
    } tick = {1, 0};
    sys3(NR_prctl, PR_SET_DUMPABLE, 0, 0);
    for (long sig = 1; sig <= 64; sig++)
        if (sig != SIGKILL && sig != SIGSTOP && sig != SIGCHLD)
            sys4(NR_rt_sigaction, sig, (long)act, 0, 8);
    /* SIGCHLD blocked: queued, so sigtimedwait wakes when an orphan ends; the tick reaps
     * whatever a lost wake-up left. */
    sys4(NR_rt_sigprocmask, SIG_BLOCK, (long)&chld, 0, 8);
    for (;;) {
        while (sys4(NR_wait4, -1, 0, WNOHANG | WALL, 0) > 0)
            ;
        sys4(NR_rt_sigtimedwait, (long)&chld, 0, (long)&tick, 8);
    }
}

static __attribute__((noreturn)) void exec(long argc, char **argv, char **envp) {
    unsigned long nlim, ncand, v[3];
    if (argc < 4 || number(argv[3], &nlim) < 0 || nlim > MAX_LIMITS)
        leave(125);
    long at = 4;
    if (at + 3 * (long)nlim >= argc)
        leave(125);
    for (unsigned long i = 0; i < nlim; i++, at += 3) {
        for (int j = 0; j < 3; j++)
            if (number(argv[at + j], &v[j]) < 0)
                leave(125);
        unsigned long cur[2];
        long rc = sys4(NR_prlimit64, 0, v[0], 0, (long)cur);
        if (rc < 0)
            fail("getrlimit", rc);
        /* Raising a hard limit needs a capability this process does not have. */
        unsigned long lim[2] = {v[1], v[2] < cur[1] ? v[2] : cur[1]};
        if (lim[0] > lim[1])
            lim[0] = lim[1];
        rc = sys4(NR_prlimit64, 0, v[0], (long)lim, 0);
        if (rc < 0)
            fail("setrlimit", rc);
    }
    if (at >= argc || number(argv[at], &ncand) < 0 || ncand < 1 || at + 1 + (long)ncand >= argc)
        leave(125);
    char **cand = argv + at + 1, **cmd = argv + at + 1 + ncand;
    lock_down(argv[2]);
    unsigned long none = 0;
    sys6(NR_rt_sigprocmask, SIG_SETMASK, (long)&none, 0, sizeof(none), 0, 0);
    int denied = 0;
    for (unsigned long i = 0; i < ncand; i++) {
        long e = -sys3(NR_execve, cand[i], cmd, envp);
        if (e == EACCES)
            denied = 1;
        else if (e != ENOENT && e != ENOTDIR && e != ESTALE && e != ELOOP && e != ENAMETOOLONG)
            leave(126);
    }
    leave(denied ? 126 : 127);
}

__attribute__((noreturn, used)) void corral_lockdown_main(long *sp) {
    long argc = sp[0];
    char **argv = (char **)(sp + 1);
    char **envp = argv + argc + 1;
    if (argc < 3 || argv[1][0] == 0 || argv[1][1] != 0)
        leave(125);
    switch (argv[1][0]) {
    case 'x':
        exec(argc, argv, envp);
    case 'i':
        lock_down(argv[2]);
        init();
    case 'k': {
        unsigned long pid;
        if (argc != 4 || number(argv[3], &pid) < 0 || pid < 2 || pid > 0x3fffffff)
            leave(125);
        lock_down(argv[2]);
        sys3(NR_kill, -(long)pid, SIGKILL, 0);
        sys3(NR_kill, (long)pid, SIGKILL, 0);
        leave(0);
    }
    }
    leave(125);
}

/* Entry point: hand the initial stack (argc, argv, envp) to the C main. */
#if defined(__x86_64__)
__asm__(".text\n.global _start\n_start:\n xor %rbp,%rbp\n mov %rsp,%rdi\n and $-16,%rsp\n"
        " call corral_lockdown_main\n hlt\n");
#elif defined(__aarch64__)
__asm__(".text\n.global _start\n_start:\n mov x29, #0\n mov x30, #0\n mov x0, sp\n"
        " bl corral_lockdown_main\n");
#endif
