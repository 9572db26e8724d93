/* corral-exec: the trampoline of the daemon's own exec path (rust/src/enter.rs).
 *
 * exec_in's helper shares the daemon's memory and stays in the daemon's pid namespace; once it
 * has entered the sandbox's other namespaces, cgroups and root, and dropped to the command's
 * credentials (seccomp included), it execs this (from a sealed memfd). From then on nothing is
 * shared with the daemon, and the daemon's thread is free again. This forks the command into
 * the sandbox's pid namespace (the helper set its pid_for_children) as a child of the daemon
 * (CLONE_PARENT), writes its pid to fd 3 and exits; the command takes a session of its own
 * (and its controlling tty) and execs. The fork copies this tiny process, not the daemon.
 *
 * argv: "corral-exec", flags ("t": take stdin as the controlling tty, else "-"), the number of
 * exec candidates, the candidates, then the command's argv. envp: the command's environment.
 * fd 3: the report pipe (close-on-exec: the command holds it only until it execs, while it is
 * not dumpable). A pid > 0 is written on success, -errno if the fork failed.
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
    int denied = 0;
    for (long i = 0; i < ncand; i++) {
        long e = -sys3(NR_execve, cand[i], argv, envp);
        if (e == EACCES)
            denied = 1;
        else if (e != ENOENT && e != ENOTDIR && e != ESTALE && e != ELOOP && e != ENAMETOOLONG)
            leave(126);
    }
    leave(denied ? 126 : 127);
}

__attribute__((noreturn, used)) void corral_exec_main(long *sp) {
    long argc = sp[0];
    char **argv = (char **)(sp + 1);
    char **envp = argv + argc + 1;
    long ncand = 0;
    if (argc < 4)
        leave(125);
    for (const char *p = argv[2]; *p; p++) {
        if (*p < '0' || *p > '9' || ncand > 100000000)
            leave(125);
        ncand = ncand * 10 + (*p - '0');
    }
    if (ncand < 1 || 3 + ncand >= argc)
        leave(125);
    int tty = argv[1][0] == 't';
    /* Not dumpable, and so the command until it execs: code in the sandbox cannot open its fd
     * 3 through /proc and write a pid of its choosing to the daemon. */
    sys3(NR_prctl, PR_SET_DUMPABLE, 0, 0);
    sys3(NR_fcntl, REPORT_FD, F_SETFD, FD_CLOEXEC);
    long pid = sys6(NR_clone, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0, 0);
    if (pid == 0)
        command(tty, argv + 3, ncand, argv + 3 + ncand, envp);
    int report = (int)pid; /* the pid, or -errno */
    sys3(NR_write, REPORT_FD, &report, sizeof(report));
    leave(0);
}

/* Entry point: hand the initial stack (argc, argv, envp) to the C main. */
#if defined(__x86_64__)
__asm__(".text\n.global _start\n_start:\n xor %rbp,%rbp\n mov %rsp,%rdi\n and $-16,%rsp\n"
        " call corral_exec_main\n hlt\n");
#elif defined(__aarch64__)
__asm__(".text\n.global _start\n_start:\n mov x29, #0\n mov x30, #0\n mov x0, sp\n"
        " bl corral_exec_main\n");
#endif
