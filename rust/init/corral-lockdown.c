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

/* The command: every signal unblocked, then exec (the first candidate that exists). */
static __attribute__((noreturn)) void command(char **cand, unsigned long ncand, char **cmd,
                                              char **envp) {
    unsigned long none = 0;
    sys6(NR_rt_sigprocmask, SIG_SETMASK, (long)&none, 0, sizeof(none), 0, 0);
    leave(exec_candidates(cand, (long)ncand, cmd, envp));
}

#if defined(__x86_64__)
/* "t": the command under a tracer that takes AT_NO_AUTOMOUNT out of statx and newfstatat,
 * which the runsc this runs on refuses with EINVAL (coreutils 9 passes it: `ls DIR`, `stat`);
 * it means nothing in a sandbox, which has no automount points. A second filter, stacked on
 * the sandbox's, stops exactly those calls for the tracer (SECCOMP_RET_TRACE); every other
 * call never sees it. The tracer (PTRACE_SEIZE: stops and SIGCONT behave as untraced) follows
 * forks and clones, is not dumpable, holds no capability and runs under a filter of its own
 * that allows only what it calls. It ends with the command, the way the command ended;
 * processes the command left running are detached then (still under the sandbox's filter;
 * their statx calls then answer ENOSYS, as for a process nobody traces). */
#define NR_ptrace 101
#define NR_getpid 39
#define NR_rt_sigreturn 15
#define NR_statx 332
#define NR_newfstatat 262
#define NR_pipe2 293
#define AT_NO_AUTOMOUNT 0x800
#define PTRACE_GETREGS 12
#define PTRACE_SETREGS 13
#define PTRACE_CONT 7
#define PTRACE_SEIZE 0x4206
#define PTRACE_LISTEN 0x4208
#define PTRACE_O_TRACEFORK 0x2
#define PTRACE_O_TRACEVFORK 0x4
#define PTRACE_O_TRACECLONE 0x8
#define PTRACE_O_TRACESECCOMP 0x80
#define PTRACE_EVENT_SECCOMP 7
#define PTRACE_EVENT_STOP 128
#define REG_R10 7
#define REG_RDX 12
#define REG_ORIG_RAX 15
#define AUDIT_ARCH_X86_64 0xc000003eU
#define RET_ALLOW 0x7fff0000U
#define RET_TRACE 0x7ff00000U
#define RET_KILL_PROCESS 0x80000000U

struct insn {
    unsigned short code;
    unsigned char jt, jf;
    unsigned int k;
};
#define LD_ABS 0x20 /* BPF_LD | BPF_W | BPF_ABS */
#define JEQ 0x15    /* BPF_JMP | BPF_JEQ | BPF_K */
#define JSET 0x45   /* BPF_JMP | BPF_JSET | BPF_K */
#define RET 0x06    /* BPF_RET | BPF_K */

static void install(struct insn *prog, unsigned short n, const char *what) {
    struct sock_fprog fp = {n, prog};
    long rc = sys3(NR_seccomp, SECCOMP_SET_MODE_FILTER, 0, (long)&fp);
    if (rc < 0)
        fail(what, rc);
}

/* The command's second filter: statx (flags: args[2]) and newfstatat (args[3]) with
 * AT_NO_AUTOMOUNT -> the tracer; anything else -> allowed (the sandbox's filter decides). */
static void automount_filter(void) {
    struct insn p[] = {
        {LD_ABS, 0, 0, 4},              /* 0: arch */
        {JEQ, 0, 8, AUDIT_ARCH_X86_64}, /* 1: else allow (the sandbox's filter kills it) */
        {LD_ABS, 0, 0, 0},              /* 2: nr */
        {JEQ, 0, 2, NR_statx},          /* 3 */
        {LD_ABS, 0, 0, 16 + 8 * 2},     /* 4: args[2], low half */
        {JSET, 3, 4, AT_NO_AUTOMOUNT},  /* 5 */
        {JEQ, 0, 3, NR_newfstatat},     /* 6 */
        {LD_ABS, 0, 0, 16 + 8 * 3},     /* 7: args[3], low half */
        {JSET, 0, 1, AT_NO_AUTOMOUNT},  /* 8 */
        {RET, 0, 0, RET_TRACE},         /* 9 */
        {RET, 0, 0, RET_ALLOW},         /* 10 */
    };
    install(p, sizeof(p) / sizeof(p[0]), "seccomp (automount)");
}

/* The tracer's own filter: the calls of its loop, nothing else (the process is killed). */
static void tracer_filter(void) {
    static const unsigned int allowed[] = {NR_wait4, NR_ptrace, NR_kill, NR_getpid,
                                           NR_exit_group, NR_exit, NR_rt_sigaction,
                                           NR_rt_sigprocmask, NR_rt_sigreturn, NR_write};
    enum { N = sizeof(allowed) / sizeof(allowed[0]) };
    struct insn p[N + 5];
    p[0] = (struct insn){LD_ABS, 0, 0, 4};
    p[1] = (struct insn){JEQ, 0, (unsigned char)(N + 1), AUDIT_ARCH_X86_64};
    p[2] = (struct insn){LD_ABS, 0, 0, 0};
    for (int i = 0; i < N; i++)
        p[3 + i] = (struct insn){JEQ, (unsigned char)(N - i), 0, allowed[i]};
    p[N + 3] = (struct insn){RET, 0, 0, RET_KILL_PROCESS};
    p[N + 4] = (struct insn){RET, 0, 0, RET_ALLOW};
    install(p, N + 5, "seccomp (tracer)");
}

/* End the way the command ended: its exit code, or its signal. */
static __attribute__((noreturn)) void end_like(int st) {
    int sig = st & 0x7f;
    if (sig == 0)
        leave((st >> 8) & 0xff);
    unsigned long dfl[4] = {0, 0, 0, 0}, none = 0;
    sys4(NR_rt_sigaction, sig, (long)dfl, 0, 8);
    sys4(NR_rt_sigprocmask, SIG_SETMASK, (long)&none, 0, 8);
    sys3(NR_kill, sys3(NR_getpid, 0, 0, 0), sig, 0);
    leave(128 + sig);
}

static __attribute__((noreturn)) void traced(const char *filter_path, char **cand,
                                             unsigned long ncand, char **cmd, char **envp) {
    int go[2];
    long rc = sys3(NR_pipe2, (long)go, O_CLOEXEC, 0);
    if (rc < 0)
        fail("pipe2", rc);
    long pid = sys6(NR_clone, SIGCHLD, 0, 0, 0, 0, 0);
    if (pid < 0)
        fail("fork", pid);
    if (pid == 0) {
        char c;
        sys3(NR_close, go[1], 0, 0);
        long n;
        do
            n = sys3(NR_read, go[0], (long)&c, 1);
        while (n == -EINTR);
        if (n != 1)
            leave(125); /* the tracer is gone: no command without it */
        sys3(NR_close, go[0], 0, 0);
        lock_down(filter_path);
        automount_filter();
        command(cand, ncand, cmd, envp);
    }
    sys3(NR_close, go[0], 0, 0);
    rc = sys4(NR_ptrace, PTRACE_SEIZE, pid, 0,
              PTRACE_O_TRACESECCOMP | PTRACE_O_TRACEFORK | PTRACE_O_TRACEVFORK |
                  PTRACE_O_TRACECLONE);
    if (rc < 0) {
        sys3(NR_kill, pid, SIGKILL, 0);
        fail("ptrace", rc);
    }
    sys3(NR_write, go[1], (long)"g", 1);
    sys3(NR_close, go[1], 0, 0);
    sys3(NR_prctl, PR_SET_DUMPABLE, 0, 0);
    struct {
        unsigned int version;
        int pid;
    } hdr = {0x20080522, 0};
    unsigned int data[6] = {0, 0, 0, 0, 0, 0};
    sys3(NR_capset, (long)&hdr, (long)data, 0);
    rc = sys6(NR_prctl, PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0, 0);
    if (rc < 0) {
        sys3(NR_kill, pid, SIGKILL, 0);
        fail("no_new_privs", rc);
    }
    tracer_filter();
    for (;;) {
        int st = 0;
        long w = sys4(NR_wait4, -1, (long)&st, WALL, 0);
        if (w == -EINTR)
            continue;
        if (w < 0)
            leave(125); /* no child left, the command's end unseen: cannot happen */
        if ((st & 0x7f) != 0x7f) { /* exited or killed */
            if (w == pid)
                end_like(st);
            continue;
        }
        int sig = (st >> 8) & 0xff, ev = (st >> 16) & 0xff;
        if (ev == PTRACE_EVENT_SECCOMP) {
            unsigned long regs[27];
            if (sys4(NR_ptrace, PTRACE_GETREGS, w, 0, (long)regs) == 0) {
                if (regs[REG_ORIG_RAX] == NR_statx)
                    regs[REG_RDX] &= ~(unsigned long)AT_NO_AUTOMOUNT;
                else if (regs[REG_ORIG_RAX] == NR_newfstatat)
                    regs[REG_R10] &= ~(unsigned long)AT_NO_AUTOMOUNT;
                sys4(NR_ptrace, PTRACE_SETREGS, w, 0, (long)regs);
            }
            sys4(NR_ptrace, PTRACE_CONT, w, 0, 0);
        } else if (ev == PTRACE_EVENT_STOP) {
            /* a group-stop (stays stopped until SIGCONT), or a new child's first stop */
            if (sig == SIGSTOP || sig == 20 || sig == 21 || sig == 22)
                sys4(NR_ptrace, PTRACE_LISTEN, w, 0, 0);
            else
                sys4(NR_ptrace, PTRACE_CONT, w, 0, 0);
        } else if (ev) { /* fork, vfork, clone */
            sys4(NR_ptrace, PTRACE_CONT, w, 0, 0);
        } else { /* a signal on its way: delivered */
            sys4(NR_ptrace, PTRACE_CONT, w, 0, sig);
        }
    }
}
#endif

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
#if defined(__x86_64__)
    if (argv[1][0] == 't')
        traced(argv[2], cand, ncand, cmd, envp);
#endif
    lock_down(argv[2]);
    command(cand, ncand, cmd, envp);
}

__attribute__((noreturn, used)) void corral_lockdown_main(long *sp) {
    long argc = sp[0];
    char **argv = (char **)(sp + 1);
    char **envp = argv + argc + 1;
    if (argc < 3 || argv[1][0] == 0 || argv[1][1] != 0)
        leave(125);
    switch (argv[1][0]) {
    case 'x':
    case 't':
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
