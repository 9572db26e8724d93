/* The raw system calls (and error numbers) of the sandbox's static binaries (corral-init,
 * corral-exec): no libc, so each is a syscall instruction with the numbers of the
 * architecture. Included once by each binary; what a binary does not use costs it nothing. */
#ifndef CORRAL_SYSCALL_H
#define CORRAL_SYSCALL_H

/* The errors an exec can end with that both binaries tell apart. */
#define ENOENT 2
#define ENOTDIR 20
#define ESTALE 116
#define ELOOP 40
#define ENAMETOOLONG 36
#define EACCES 13

#if defined(__x86_64__)
#define NR_read 0
#define NR_write 1
#define NR_ioctl 16
#define NR_close 3
#define NR_lseek 8
#define NR_mmap 9
#define NR_munmap 11
#define NR_rt_sigprocmask 14
#define NR_sendmsg 46
#define NR_recvmsg 47
#define NR_clone 56
#define NR_execve 59
#define NR_exit 60
#define NR_wait4 61
#define NR_fcntl 72
#define NR_chdir 80
#define NR_umask 95
#define NR_setsid 112
#define NR_setresuid 117
#define NR_setresgid 119
#define NR_setgroups 116
#define NR_capset 126
#define NR_rt_sigtimedwait 128
#define NR_prctl 157
#define NR_exit_group 231
#define NR_openat 257
#define NR_dup3 292
#define NR_close_range 436
#define NR_prlimit64 302
#define NR_pidfd_send_signal 424
#define NR_landlock_create_ruleset 444
#define NR_landlock_restrict_self 446

static long sys6(long n, long a, long b, long c, long d, long e, long f) {
    long ret;
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    register long r9 __asm__("r9") = f;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return ret;
}
#elif defined(__aarch64__)
#define NR_read 63
#define NR_write 64
#define NR_ioctl 29
#define NR_close 57
#define NR_lseek 62
#define NR_mmap 222
#define NR_munmap 215
#define NR_rt_sigprocmask 135
#define NR_sendmsg 211
#define NR_recvmsg 212
#define NR_clone 220
#define NR_execve 221
#define NR_exit 93
#define NR_wait4 260
#define NR_fcntl 25
#define NR_chdir 49
#define NR_umask 166
#define NR_setsid 157
#define NR_setresuid 147
#define NR_setresgid 149
#define NR_setgroups 159
#define NR_capset 91
#define NR_rt_sigtimedwait 137
#define NR_prctl 167
#define NR_exit_group 94
#define NR_openat 56
#define NR_dup3 24
#define NR_close_range 436
#define NR_prlimit64 261
#define NR_pidfd_send_signal 424
#define NR_landlock_create_ruleset 444
#define NR_landlock_restrict_self 446

static long sys6(long n, long a, long b, long c, long d, long e, long f) {
    register long x8 __asm__("x8") = n;
    register long x0 __asm__("x0") = a;
    register long x1 __asm__("x1") = b;
    register long x2 __asm__("x2") = c;
    register long x3 __asm__("x3") = d;
    register long x4 __asm__("x4") = e;
    register long x5 __asm__("x5") = f;
    __asm__ volatile("svc 0"
                     : "+r"(x0)
                     : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5)
                     : "memory");
    return x0;
}
#else
#error "corral: unsupported architecture"
#endif

#define sys4(n, a, b, c, d) sys6((n), (long)(a), (long)(b), (long)(c), (long)(d), 0, 0)
#define sys3(n, a, b, c) sys4((n), (a), (b), (c), 0)

/* execve each of the ``ncand`` exec candidates in turn (the PATH rule); returns only if none
 * ran, with the command's exit code: 127 (none exists), 126 (one was not executable, or
 * another error). */
static inline long exec_candidates(char **cand, long ncand, char **argv, char **envp) {
    int denied = 0;
    for (long i = 0; i < ncand; i++) {
        long e = -sys3(NR_execve, cand[i], argv, envp);
        if (e == EACCES)
            denied = 1;
        else if (e != ENOENT && e != ENOTDIR && e != ESTALE && e != ELOOP && e != ENAMETOOLONG)
            return 126;
    }
    return denied ? 126 : 127;
}

#endif
