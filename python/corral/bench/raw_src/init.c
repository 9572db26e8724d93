/* raw-init: PID 1 of a raw-baseline sandbox. Same job and same footprint class as corral's init:
 * block every signal, reap children on SIGCHLD, exit on SIGTERM from outside; freestanding
 * (no libc) so an idle sandbox costs a few pages, not a glibc start-up.
 * Built by corral.bench with: cc -O2 -static -nostdlib -ffreestanding -fno-stack-protector
 */

#if defined(__x86_64__)
#define NR_rt_sigprocmask 14
#define NR_wait4 61
#define NR_rt_sigtimedwait 128
#define NR_exit_group 231
static long sys4(long n, long a, long b, long c, long d) {
    long ret;
    register long r10 __asm__("r10") = d;
    __asm__ volatile("syscall" : "=a"(ret) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10)
                     : "rcx", "r11", "memory");
    return ret;
}
#elif defined(__aarch64__)
#define NR_rt_sigprocmask 135
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
#error "raw-init: unsupported architecture"
#endif

struct ksiginfo {
    int si_signo, si_errno, si_code, pad, si_pid;
    int rest[27];
};

__attribute__((noreturn, used)) void raw_init_main(void) {
    unsigned long all = ~0UL;
    struct ksiginfo info;
    sys4(NR_rt_sigprocmask, 0 /* SIG_BLOCK */, (long)&all, 0, sizeof(all));
    for (;;) {
        long sig = sys4(NR_rt_sigtimedwait, (long)&all, (long)&info, 0, sizeof(all));
        if (sig == 17 /* SIGCHLD */) {
            while (sys4(NR_wait4, -1, 0, 1 /* WNOHANG */, 0) > 0) {
            }
        } else if (sig == 15 && info.si_pid == 0) {
            sys4(NR_exit_group, 0, 0, 0, 0);
        }
    }
}

#if defined(__x86_64__)
__asm__(".text\n.global _start\n_start:\n xor %rbp,%rbp\n and $-16,%rsp\n call raw_init_main\n hlt\n");
#elif defined(__aarch64__)
__asm__(".text\n.global _start\n_start:\n mov x29, #0\n mov x30, #0\n bl raw_init_main\n");
#endif
