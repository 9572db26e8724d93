/* corral-exec: the trampoline of the daemon's own exec path (rust/src/enter.rs).
 *
 * exec_in's helper shares the daemon's memory and stays in the daemon's pid namespace and
 * cgroups; once it has entered the sandbox's namespaces and root, and dropped to the command's
 * credentials (seccomp included), it execs this (from a sealed memfd). From then on nothing is
 * shared with the daemon, and the daemon's thread is free again. This joins the sandbox's
 * cgroups (only now: whatever the sandbox does to its own limits can slow this process, which
 * the daemon times out and kills, never the daemon's thread in its vfork), forks the command
 * into the sandbox's pid namespace (the helper set its pid_for_children) as a child of the
 * daemon (CLONE_PARENT), writes its pid to fd 3 and exits; the command takes a session of its
 * own (and its controlling tty) and execs. The fork copies this tiny process, not the daemon.
 *
 * argv: "corral-exec", flags ("t": take stdin as the controlling tty, else "-"), the number of
 * cgroup files, the number of exec candidates, the candidates, then the command's argv. envp:
 * the command's environment. fd 3: the report pipe (close-on-exec: the command holds it only
 * until it execs, while it is not dumpable). fd 5..: the cgroup files ("0" written to each
 * moves this process), closed before the fork. The report is two ints, (stage, value):
 * (0, -errno) if joining a cgroup failed, (1, pid) on success, (1, -errno) if the fork failed.
 *
 * Freestanding (no libc, raw syscalls, static, no relocations), like corral-init.
 */

#define SIGCHLD 17
#define SIG_SETMASK 2
#define CLONE_PARENT 0x8000
#define TIOCSCTTY 0x540E
#define REPORT_FD 3
#define PR_SET_DUMPABLE 4
#define F_SETFD 2
#define FD_CLOEXEC 1
#define FIRST_CGROUP_FD 5
#define MAX_CGROUP_FDS 16
#define STAGE_JOIN 0
#define STAGE_FORK 1

#include "syscall.h"

static __attribute__((noreturn)) void leave(long code) {
    for (;;)
        sys3(NR_exit_group, code, 0, 0);
}

/* The command: a session of its own, then exec (the first candidate that exists). */
static __attribute__((noreturn)) void command(int tty, char **cand, long ncand, char **argv,
                                              char **envp) {
    unsigned long none = 0;
    sys3(NR_setsid, 0, 0, 0);
    if (tty && sys3(NR_ioctl, 0, TIOCSCTTY, 0) < 0)
        leave(125);
    sys6(NR_rt_sigprocmask, SIG_SETMASK, (long)&none, 0, sizeof(none), 0, 0);
    leave(exec_candidates(cand, ncand, argv, envp));
}

/* A decimal count, or -1. */
static long count(const char *p) {
    long n = 0;
    if (!*p)
        return -1;
    for (; *p; p++) {
        if (*p < '0' || *p > '9' || n > 100000000)
            return -1;
        n = n * 10 + (*p - '0');
    }
    return n;
}

static __attribute__((noreturn)) void report(int stage, int value) {
    int msg[2] = {stage, value};
    sys3(NR_write, REPORT_FD, (long)msg, sizeof(msg));
    leave(0);
}

__attribute__((noreturn, used)) void corral_exec_main(long *sp) {
    long argc = sp[0];
    char **argv = (char **)(sp + 1);
    char **envp = argv + argc + 1;
    if (argc < 5)
        leave(125);
    long ncg = count(argv[2]), ncand = count(argv[3]);
    if (ncg < 0 || ncg > MAX_CGROUP_FDS || ncand < 1 || 4 + ncand >= argc)
        leave(125);
    int tty = argv[1][0] == 't';
    for (long i = 0; i < ncg; i++) {
        long rc = sys3(NR_write, FIRST_CGROUP_FD + i, (long)"0", 1);
        if (rc < 0)
            report(STAGE_JOIN, (int)rc);
    }
    sys3(NR_close_range, FIRST_CGROUP_FD, ~0U, 0);
    /* Not dumpable, and so the command until it execs: code in the sandbox cannot open its fd
     * 3 through /proc and write a pid of its choosing to the daemon. */
    sys3(NR_prctl, PR_SET_DUMPABLE, 0, 0);
    sys3(NR_fcntl, REPORT_FD, F_SETFD, FD_CLOEXEC);
    long pid = sys6(NR_clone, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0, 0);
    if (pid == 0)
        command(tty, argv + 4, ncand, argv + 4 + ncand, envp);
    report(STAGE_FORK, (int)pid); /* the pid, or -errno */
}

/* Entry point: hand the initial stack (argc, argv, envp) to the C main. */
#if defined(__x86_64__)
__asm__(".text\n.global _start\n_start:\n xor %rbp,%rbp\n mov %rsp,%rdi\n and $-16,%rsp\n"
        " call corral_exec_main\n hlt\n");
#elif defined(__aarch64__)
__asm__(".text\n.global _start\n_start:\n mov x29, #0\n mov x30, #0\n mov x0, sp\n"
        " bl corral_exec_main\n");
#endif
