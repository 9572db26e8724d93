/* corral-init: PID 1 of every corral sandbox.
 *
 * It only reaps orphans and waits to be told to stop. Every signal stays blocked and is taken
 * synchronously with sigwaitinfo (rt_sigtimedwait): SIGCHLD reaps every exited child;
 * SIGTERM/SIGINT sent from outside the sandbox's pid namespace (si_pid reads 0 there) exit 0.
 * The same signals sent from inside the sandbox are ignored, so code in the sandbox cannot end
 * its own sandbox and turn a scored rollout into an "infrastructure" failure. SIGKILL from the
 * host always works. The spawner execs this with every signal already blocked, so nothing can
 * arrive before the mask below is in place.
 *
 * Freestanding (no libc, raw syscalls, static, no relocations): a static glibc binary faults in
 * ~680 KiB of RSS at start-up, this one a few pages, and density is the point.
 */

#define SIGINT 2
#define SIGTERM 15
#define SIGCHLD 17
#define SIG_BLOCK 0
#define WNOHANG 1
#define PR_SET_NAME 15

#if defined(__x86_64__)
#define NR_rt_sigprocmask 14
#define NR_prctl 157
#define NR_wait4 61
#define NR_rt_sigtimedwait 128
#define NR_exit_group 231

static long sys4(long n, long a, long b, long c, long d) {
    long ret;
    register long r10 __asm__("r10") = d;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10)
                     : "rcx", "r11", "memory");
    return ret;
}
#elif defined(__aarch64__)
#define NR_rt_sigprocmask 135
#define NR_prctl 167
#define NR_wait4 260
#define NR_rt_sigtimedwait 137
#define NR_exit_group 94

static long sys4(long n, long a, long b, long c, long d) {
    register long x8 __asm__("x8") = n;
    register long x0 __asm__("x0") = a;
    register long x1 __asm__("x1") = b;
    register long x2 __asm__("x2") = c;
    register long x3 __asm__("x3") = d;
    __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3) : "memory");
    return x0;
}
#else
#error "corral-init: unsupported architecture"
#endif

/* The kernel's siginfo: 128 bytes; si_pid sits after signo, errno, code (+pad) on 64-bit. */
struct ksiginfo {
    int si_signo;
    int si_errno;
    int si_code;
    int pad;
    int si_pid;
    int rest[27];
};

__attribute__((noreturn, used)) void corral_init_main(void) {
    unsigned long all = ~0UL; /* kernel sigset_t: 64 bits */
    struct ksiginfo info;

    /* exec'd from a memfd, the name would read "memfd:corral-init" in ps. */
    sys4(NR_prctl, PR_SET_NAME, (long)"corral-init", 0, 0);
    sys4(NR_rt_sigprocmask, SIG_BLOCK, (long)&all, 0, sizeof(all));
    for (;;) {
        long sig = sys4(NR_rt_sigtimedwait, (long)&all, (long)&info, 0, sizeof(all));
        if (sig == SIGCHLD) {
            while (sys4(NR_wait4, -1, 0, WNOHANG, 0) > 0) {
            }
        } else if ((sig == SIGTERM || sig == SIGINT) && info.si_pid == 0) {
            sys4(NR_exit_group, 0, 0, 0, 0);
        }
    }
}

/* Entry point: align the stack and call the C main (which never returns). */
#if defined(__x86_64__)
__asm__(".text\n.global _start\n_start:\n xor %rbp,%rbp\n and $-16,%rsp\n call corral_init_main\n hlt\n");
#elif defined(__aarch64__)
__asm__(".text\n.global _start\n_start:\n mov x29, #0\n mov x30, #0\n bl corral_init_main\n");
#endif
