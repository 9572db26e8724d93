/* corral-init: PID 1 of every corral sandbox.
 *
 * It reaps orphans, waits to be told to stop, and starts the daemon's commands. Every signal
 * stays blocked and is taken synchronously with sigwaitinfo (rt_sigtimedwait): SIGCHLD reaps
 * every exited child; SIGTERM/SIGINT sent from outside the sandbox's pid namespace (si_code
 * SI_USER with si_pid 0, see stop_from_outside) exit 0. The same signals sent from inside the
 * sandbox, or queued with a forged siginfo, are ignored, so code in the sandbox cannot end its
 * own sandbox and turn a scored rollout into an "infrastructure" failure. SIGKILL from the host always works. The spawner execs this with every signal already
 * blocked, so nothing can arrive before the mask below is in place.
 *
 * Exec server (docs/isolation.md, "Exec through the init"). The spawner leaves both ends of a
 * SOCK_SEQPACKET pair on fds 3 and 4; the daemon takes its own copy of fd 4 with pidfd_getfd
 * when it first runs a command here (so the channel survives a daemon restart). A request is
 * one message: a header, groups, argv, env, the exec candidates (the daemon resolves PATH)
 * and the cwd, with the stdio fds attached. A request larger than a message (64 KiB) sends
 * the header alone and the rest in a sealed memfd attached after the stdio fds (at most
 * 4 MiB), which the init maps read-only for the time of the request: its memory stays flat. The init starts a child (CLONE_VM | CLONE_VFORK:
 * the init waits until it has exec'd or exited, which orders the messages), and answers with the child's pid in the
 * sandbox and a pidfd attached (CLONE_PIDFD), through which the daemon signals the child and
 * reads its exit status once this init has reaped it (PIDFD_GET_INFO). The child inherits the
 * init's walls (cgroups, namespaces, root, rlimits, no_new_privs, seccomp); it only switches
 * to the command's user, which the init's capabilities (the shell set a root command gets)
 * allow. Socket readiness arrives as a signal (O_ASYNC + F_SETSIG), so the loop stays one
 * sigwaitinfo. The init is not dumpable: code in the sandbox, even as root, cannot ptrace it,
 * read its memory or take its fds.
 *
 * Freestanding (no libc, raw syscalls, static, no relocations): a static glibc binary faults in
 * ~680 KiB of RSS at start-up, this one a few pages, and density is the point.
 */

#define SIGINT 2
#define SIGTERM 15
#define SIGCHLD 17
#define SIGKILL 9
#define SIGIO 29
#define SIG_CTL 40 /* realtime: the channel's readiness */
#define SIG_BLOCK 0
#define SI_USER 0
#define SI_KERNEL 0x80
#define SIG_SETMASK 2
#define WNOHANG 1
#define PR_SET_NAME 15
#define RLIMIT_NOFILE 7
#define PR_SET_DUMPABLE 4
#define F_SETFD 2
#define F_GETFL 3
#define F_SETFL 4
#define F_SETOWN 8
#define F_SETSIG 10
#define FD_CLOEXEC 1
#define O_RDONLY 0
#define O_NONBLOCK 04000
#define O_ASYNC 020000
#define O_CLOEXEC 02000000
#define AT_FDCWD (-100)
#define MSG_DONTWAIT 0x40
#define MSG_TRUNC 0x20
#define MSG_CTRUNC 0x08
#define MSG_NOSIGNAL 0x4000
#define MSG_CMSG_CLOEXEC 0x40000000
#define SOL_SOCKET 1
#define SCM_RIGHTS 1
#define CLONE_VM 0x100
#define CLONE_PIDFD 0x1000
#define CLONE_VFORK 0x4000
#define EAGAIN 11
#define EINTR 4
#define EINVAL 22
#define EMSGSIZE 90
#define E2BIG 7
#define F_GET_SEALS 1034
#define F_SEAL_ALL 15 /* SEAL | SHRINK | GROW | WRITE */
#define SEEK_END 2
#define PROT_READ 1
#define PROT_WRITE 2
#define MAP_PRIVATE 2
#define MAP_ANONYMOUS 0x20

#include "syscall.h"

/* clone(flags | CLONE_VM, stack) running fn(arg) on `stack` in the child (which must exec or
 * exit, never return); the parent gets the pid or -errno. CLONE_VM | CLONE_VFORK is what
 * posix_spawn does: no copy of our memory to make and then tear down again at the exec, and
 * the child's writes (its failure report) need no pipe. Written in assembly because the child
 * must not touch the parent's stack frame after the switch. */
long vfork_call(void (*fn)(void *), void *arg, void *stack_top, long flags, int *pidfd);
#if defined(__x86_64__)
__asm__(".text\n.global vfork_call\nvfork_call:\n"
        " and $-16, %rdx\n sub $8, %rdx\n mov %rsi, (%rdx)\n" /* arg, popped by the child */
        " mov %rdi, %r9\n"                                       /* fn: survives syscall */
        " mov %rcx, %rdi\n mov %rdx, %rsi\n mov %r8, %rdx\n"   /* flags, stack, &pidfd */
        " xor %r10d, %r10d\n xor %r8d, %r8d\n"                  /* child_tid, tls */
        " mov $56, %eax\n syscall\n"
        " test %rax, %rax\n jnz 1f\n"
        " xor %ebp, %ebp\n pop %rdi\n call *%r9\n"
        " mov $127, %edi\n mov $231, %eax\n syscall\n hlt\n"
        "1: ret\n");
#elif defined(__aarch64__)
__asm__(".text\n.global vfork_call\nvfork_call:\n"
        " and x2, x2, #0xfffffffffffffff0\n stp x0, x1, [x2, #-16]!\n" /* fn, arg */
        " mov x0, x3\n mov x1, x2\n mov x2, x4\n"              /* flags, stack, &pidfd */
        " mov x3, #0\n mov x4, #0\n"                            /* tls, child_tid */
        " mov x8, #220\n svc #0\n"
        " cbnz x0, 1f\n"
        " ldp x1, x0, [sp], #16\n blr x1\n"
        " mov x0, #127\n mov x8, #94\n svc #0\n"
        "1: ret\n");
#endif

typedef unsigned int u32;

/* The kernel's siginfo: 128 bytes; si_pid sits after signo, errno, code (+pad) on 64-bit. */
struct ksiginfo {
    int si_signo;
    int si_errno;
    int si_code;
    int pad;
    int si_pid;
    int rest[27];
};

struct iovec {
    void *base;
    unsigned long len;
};

struct msghdr {
    void *name;
    int namelen;
    struct iovec *iov;
    unsigned long iovlen;
    void *control;
    unsigned long controllen;
    int flags;
};

struct cmsghdr {
    unsigned long len;
    int level;
    int type;
};

/* ---- the channel's wire format (python/corral/daemon/initexec.py has the other half) ---- */
#define CTL_FD 3
#define REQ_MAGIC 0x31585243u   /* "CRX1" */
#define REPLY_MAGIC 0x31525243u /* "CRR1": the init's answer */
#define FAIL_MAGIC 0x31465243u  /* "CRF1": the child failed before exec */
#define REQ_NULL_STDIN 1u       /* two fds attached (stdout, stderr); stdin is /dev/null */
#define REQ_SCOPE_UNIX 2u       /* network "disabled": a Landlock domain of the command's own */
#define REQ_MEMFD 4u            /* groups and strings in a sealed memfd, attached last */
#define MAX_MSG 65536
#define MAX_STRINGS 1024
#define MAX_GROUPS 64
#define MAX_BIG (4u << 20)       /* a memfd request's body */
#define MAX_BIG_STRINGS (1u << 18)
#define MAX_BIG_GROUPS 65536     /* NGROUPS_MAX */
#define MAX_FDS 12               /* what `control` holds; more is MSG_CTRUNC */

struct req {
    u32 magic, id, uid, gid, flags, ngroups, nargv, nenv, ncand;
};

struct reply {
    u32 magic, id;
    int value; /* REPLY: the child's pid in the sandbox, or -errno; FAIL: errno */
    int step;  /* FAIL: which step (see initexec.py) */
};

enum {
    STEP_SIGNALS = 1,
    STEP_SETSID,
    STEP_STDIO,
    STEP_FDS,
    STEP_IDS,
    STEP_CAPS,
    STEP_RLIMIT,
    STEP_LANDLOCK
};

/* The fd limit (soft, hard) the init's children get: half the hard limit the init was started
 * with (the soft one no higher), while the init raises its own soft limit to that hard one.
 * Sending a pidfd fails with ETOOMANYREFS once the fds in flight in unix sockets of the same
 * user pass the sender's soft limit, and every sandbox is uid 0: code in any sandbox can raise
 * its soft limit to its hard one and keep that many fds in flight (sent, never received) for
 * as long as it likes. With the commands' hard limit at half the init's, all sandboxes
 * together stay half the init's limit short of it (a fd in flight more per message of 253),
 * and the rest is room for the answers and requests really in flight. Otherwise every
 * sandbox's commands would fail to start, an error of the platform's, for as long as one
 * sandbox holds them. hard is 0 when nothing is to be set. It lives on main's stack, not in
 * .bss: an idle init dirties no page of its data (density), and the children reach it through
 * `struct job`. */

static unsigned long long buf[MAX_MSG / 8];        /* the request; pages touched on use */
static unsigned long long child_stack[2048];       /* 16 KiB, the vfork child's */
static unsigned long long control[8];              /* room for 12 fds */
static const char *small_strs[MAX_STRINGS + 3];    /* argv, NULL, envp, NULL, candidates */

static long send_reply(u32 magic, u32 id, int value, int step, int fd) {
    struct reply r;
    struct iovec io;
    struct msghdr m;
    unsigned long long cbuf[3];
    struct cmsghdr *c = (struct cmsghdr *)cbuf;
    r.magic = magic;
    r.id = id;
    r.value = value;
    r.step = step;
    io.base = &r;
    io.len = sizeof(r);
    m.name = 0;
    m.namelen = 0;
    m.iov = &io;
    m.iovlen = 1;
    m.control = 0;
    m.controllen = 0;
    m.flags = 0;
    if (fd >= 0) {
        c->len = sizeof(struct cmsghdr) + sizeof(int);
        c->level = SOL_SOCKET;
        c->type = SCM_RIGHTS;
        *(int *)(c + 1) = fd;
        m.control = cbuf;
        m.controllen = sizeof(cbuf);
    }
    /* Never blocks. The daemon keeps at most 16 requests in flight per sandbox, so answers
     * always fit the socket's buffer while it reads them; with the daemon gone they may not,
     * and are dropped (the daemon reports a crash's in-flight commands as infra errors). */
    return sys3(NR_sendmsg, CTL_FD, (long)&m, MSG_DONTWAIT | MSG_NOSIGNAL);
}

/* What the child is to run: in our memory, which it shares (CLONE_VM) while we wait. */
struct job {
    const struct req *q;
    const u32 *groups;
    const int *fds;
    int nfds; /* stdio only */
    const unsigned long *nofile;
    const char **strs; /* argv, NULL, envp, NULL, candidates, cwd */
};

/* The child, between clone and exec, on child_stack in our memory: it writes nothing of
 * ours (the parent resumes with everything as it left it). */
static void child(void *arg) {
    const struct job *j = (const struct job *)arg;
    const struct req *q = j->q;
    const u32 *groups = j->groups;
    const int *fds = j->fds;
    int nfds = j->nfds;
    const unsigned long *nofile = j->nofile;
    const char **strs = j->strs;
    unsigned long none = 0;
    int step = STEP_SIGNALS;
    long rc = sys4(NR_rt_sigprocmask, SIG_SETMASK, (long)&none, 0, sizeof(none));
    if (rc >= 0) {
        step = STEP_SETSID;
        rc = sys3(NR_setsid, 0, 0, 0);
    }
    if (rc >= 0) {
        step = STEP_STDIO;
        int first = 0;
        if (nfds == 2) { /* REQ_NULL_STDIN */
            long null = sys4(NR_openat, AT_FDCWD, (long)"/dev/null", O_RDONLY | O_CLOEXEC, 0);
            rc = null < 0 ? null : sys3(NR_dup3, null, 0, 0);
            first = 1;
        }
        /* The received fds are >= 5 (0-4 are taken), so no dup3 clobbers another's source. */
        for (int i = 0; rc >= 0 && i < nfds; i++)
            rc = sys3(NR_dup3, fds[i], first + i, 0);
    }
    if (rc >= 0) {
        step = STEP_FDS; /* our fds above 2 are all close-on-exec already; make sure */
        rc = sys3(NR_close_range, 3, ~0U, 4 /* CLOSE_RANGE_CLOEXEC */);
    }
    if (rc >= 0) {
        step = STEP_IDS;
        rc = sys3(NR_setgroups, q->ngroups, (long)groups, 0);
        if (rc >= 0)
            rc = sys3(NR_setresgid, q->gid, q->gid, q->gid);
        if (rc >= 0)
            rc = sys3(NR_setresuid, q->uid, q->uid, q->uid);
    }
    if (rc >= 0 && nofile[1]) {
        step = STEP_RLIMIT;
        rc = sys4(NR_prlimit64, 0, RLIMIT_NOFILE, (long)nofile, 0);
    }
    if (rc >= 0 && q->uid != 0) {
        /* setresuid cleared the permitted and effective sets; clear the inheritable one too,
         * as the daemon's own exec path leaves a non-root command with none. */
        u32 hdr[2] = {0x20080522u, 0};
        u32 data[6] = {0, 0, 0, 0, 0, 0};
        step = STEP_CAPS;
        rc = sys3(NR_capset, (long)hdr, (long)data, 0);
    }
    if (rc >= 0 && (q->flags & REQ_SCOPE_UNIX)) {
        /* Nested in the init's domain, scoped to abstract unix sockets only: the command's
         * process tree connects to its own @names, never to another command's or sandbox's
         * (no_new_privs is the init's already). */
        unsigned long long attr[3] = {0, 0, 1 /* LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET */};
        step = STEP_LANDLOCK;
        rc = sys3(NR_landlock_create_ruleset, (long)attr, sizeof(attr), 0);
        if (rc >= 0) {
            long ruleset = rc;
            rc = sys3(NR_landlock_restrict_self, ruleset, 0, 0);
            sys3(NR_close, ruleset, 0, 0);
        }
    }
    if (rc < 0) {
        send_reply(FAIL_MAGIC, q->id, (int)-rc, step, -1);
        sys3(NR_exit_group, 127, 0, 0);
    }
    /* As the final user, so a directory it may not enter falls back to / like a login. */
    if (sys3(NR_chdir, (long)strs[q->nargv + 1 + q->nenv + 1 + q->ncand], 0, 0) < 0)
        sys3(NR_chdir, (long)"/", 0, 0);
    sys3(NR_umask, 022, 0, 0);
    const char **argv = strs;
    const char **envp = strs + q->nargv + 1;
    const char **cand = envp + q->nenv + 1;
    sys3(NR_exit_group,
         exec_candidates((char **)cand, (long)q->ncand, (char **)argv, (char **)envp), 0, 0);
}

static long sys_mmap(unsigned long len, long prot, long flags, long fd) {
    return sys6(NR_mmap, 0, (long)len, prot, flags, fd, 0);
}

/* Split n NUL-terminated strings starting at p (< end) into strs[at..]; the end or 0. */
static const char *take_strings(const char **strs, const char *p, const char *end, u32 n,
                                u32 at) {
    for (u32 i = 0; i < n; i++) {
        strs[at + i] = p;
        while (p < end && *p)
            p++;
        if (p >= end)
            return 0;
        p++;
    }
    return p;
}

/* One request: validate, fork, answer. Returns 0 when the queue is empty. */
static int serve_one(const unsigned long *nofile) {
    struct iovec io;
    struct msghdr m;
    int fds[MAX_FDS];
    int nfds = 0;
    const char *map = 0;        /* a memfd request's body, mapped read-only */
    unsigned long map_len = 0;
    const char **strs = small_strs;
    unsigned long table_len = 0; /* or a table mapped for a memfd request */
    io.base = buf;
    io.len = sizeof(buf);
    m.name = 0;
    m.namelen = 0;
    m.iov = &io;
    m.iovlen = 1;
    m.control = control;
    m.controllen = sizeof(control);
    m.flags = 0;
    long n = sys3(NR_recvmsg, CTL_FD, (long)&m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n == -EINTR)
        return 1;
    if (n < 0)
        return 0; /* EAGAIN: drained (EOF cannot happen: fd 4 is ours too) */
    /* Every fd that came with the message is ours to close, whatever its shape: at most one
     * SCM_RIGHTS group of at most MAX_FDS fds is a request's; anything else is refused. */
    int bad_fds = 0;
    unsigned long off = 0;
    while (off + sizeof(struct cmsghdr) <= m.controllen) {
        struct cmsghdr *c = (struct cmsghdr *)((char *)control + off);
        if (c->len < sizeof(*c) || c->len > m.controllen - off)
            break;
        if (c->level == SOL_SOCKET && c->type == SCM_RIGHTS) {
            int k = (int)((c->len - sizeof(*c)) / sizeof(int));
            for (int i = 0; i < k; i++) {
                int fd = ((int *)(c + 1))[i];
                if (nfds < MAX_FDS && !bad_fds)
                    fds[nfds++] = fd;
                else
                    sys3(NR_close, fd, 0, 0);
            }
            if (off > 0 || k > MAX_FDS)
                bad_fds = 1;
        }
        off += (c->len + 7) & ~7UL;
    }
    const struct req *q = (const struct req *)buf;
    u32 id = (unsigned long)n >= sizeof(*q) ? q->id : 0;
    int err = 0;
    if ((unsigned long)n < sizeof(*q) || q->magic != REQ_MAGIC || bad_fds)
        err = EINVAL;
    else if (m.flags & (MSG_TRUNC | MSG_CTRUNC))
        err = EMSGSIZE;
    else if ((q->flags & ~(REQ_NULL_STDIN | REQ_SCOPE_UNIX | REQ_MEMFD)) ||
             nfds != ((q->flags & REQ_NULL_STDIN) ? 2 : 3) + ((q->flags & REQ_MEMFD) ? 1 : 0) ||
             q->ngroups > ((q->flags & REQ_MEMFD) ? MAX_BIG_GROUPS : MAX_GROUPS) ||
             q->nargv == 0 || q->ncand == 0 ||
             (unsigned long)q->nargv + q->nenv + q->ncand >
                 ((q->flags & REQ_MEMFD) ? MAX_BIG_STRINGS : MAX_STRINGS))
        err = EINVAL;
    const u32 *groups = (const u32 *)(q + 1);
    const char *end = (const char *)buf + n;
    if (!err && (q->flags & REQ_MEMFD)) {
        /* Only the header travels in the message; the rest is in a memfd nobody can change
         * any more (every seal set), mapped for the time of this request. */
        int mfd = fds[nfds - 1];
        long size = sys3(NR_lseek, mfd, 0, SEEK_END);
        /* More seals are fine: vm.memfd_noexec adds F_SEAL_EXEC to every memfd. */
        long seals = sys3(NR_fcntl, mfd, F_GET_SEALS, 0);
        if ((unsigned long)n != sizeof(*q) || seals < 0 || (seals & F_SEAL_ALL) != F_SEAL_ALL ||
            size <= 0)
            err = EINVAL;
        else if ((unsigned long)size > MAX_BIG)
            err = E2BIG;
        if (!err) {
            long m = sys_mmap((unsigned long)size, PROT_READ, MAP_PRIVATE, mfd);
            table_len = ((unsigned long)q->nargv + q->nenv + q->ncand + 3) * sizeof(char *);
            long t = m < 0 ? m : sys_mmap(table_len, PROT_READ | PROT_WRITE,
                                         MAP_PRIVATE | MAP_ANONYMOUS, -1);
            if (m < 0 || t < 0) {
                err = (int)-(m < 0 ? m : t);
                if (m >= 0)
                    sys3(NR_munmap, m, size, 0);
                table_len = 0;
            } else {
                map = (const char *)m;
                map_len = (unsigned long)size;
                strs = (const char **)t;
                groups = (const u32 *)map;
                end = map + map_len;
            }
        }
    }
    if (!err) {
        const char *p = (const char *)(groups + q->ngroups);
        if (p > end) {
            err = EINVAL;
        } else {
            /* argv, NULL, envp, NULL, candidates, then cwd in the slot after them */
            p = take_strings(strs, p, end, q->nargv, 0);
            strs[q->nargv] = 0;
            if (p)
                p = take_strings(strs, p, end, q->nenv, q->nargv + 1);
            if (p) {
                strs[q->nargv + 1 + q->nenv] = 0;
                p = take_strings(strs, p, end, q->ncand + 1, q->nargv + q->nenv + 2);
            }
            if (!p || p != end) /* nothing may follow the cwd */
                err = EINVAL;
        }
    }
    if (!err) {
        int pidfd = -1;
        struct job j;
        j.q = q;
        j.groups = groups;
        j.fds = fds;
        j.nfds = nfds - ((q->flags & REQ_MEMFD) ? 1 : 0);
        j.nofile = nofile;
        j.strs = strs;
        long pid = vfork_call(child, &j, child_stack + sizeof(child_stack) / 8,
                              CLONE_VM | CLONE_VFORK | CLONE_PIDFD | SIGCHLD, &pidfd);
        if (pid < 0) {
            err = (int)-pid;
        } else {
            long sent = send_reply(REPLY_MAGIC, id, (int)pid, 0, pidfd);
            if (sent < 0) {
                /* The daemon cannot watch a command it has no pidfd of: stop it, say why. */
                sys4(NR_pidfd_send_signal, pidfd, SIGKILL, 0, 0);
                err = (int)-sent;
            }
            sys3(NR_close, pidfd, 0, 0);
        }
    }
    if (err)
        send_reply(REPLY_MAGIC, id, -err, 0, -1);
    for (int i = 0; i < nfds; i++)
        sys3(NR_close, fds[i], 0, 0);
    if (map) { /* the child has exec'd or exited: its strings are copied */
        sys3(NR_munmap, (long)map, (long)map_len, 0);
        sys3(NR_munmap, (long)strs, (long)table_len, 0);
    }
    return 1;
}

/* A stop request counts only when the kernel, not the sender, filled in where it came from:
 * kill()/pidfd_send_signal() without a siginfo from an ancestor pid namespace (SI_USER, the
 * sender's pid unmappable here, so 0) or the kernel itself (SI_KERNEL). A siginfo a process
 * supplies (rt_sigqueueinfo, pidfd_send_signal with one) always has si_code < 0 (the kernel
 * refuses anything else from another process), whatever si_pid it claims; a signal from
 * inside the sandbox has its sender's pid. */
static int stop_from_outside(const struct ksiginfo *info) {
    return info->si_pid == 0 && (info->si_code == SI_USER || info->si_code == SI_KERNEL);
}

static void serve(const unsigned long *nofile) {
    while (serve_one(nofile)) {
    }
}

__attribute__((noreturn, used)) void corral_init_main(void) {
    unsigned long all = ~0UL; /* kernel sigset_t: 64 bits */
    struct ksiginfo info;
    unsigned long nofile[2] = {0, 0};

    /* exec'd from a memfd, the name would read "memfd:corral-init" in ps. */
    sys4(NR_prctl, PR_SET_NAME, (long)"corral-init", 0, 0);
    sys4(NR_prctl, PR_SET_DUMPABLE, 0, 0, 0);
    sys4(NR_rt_sigprocmask, SIG_BLOCK, (long)&all, 0, sizeof(all));
    if (sys4(NR_prlimit64, 0, RLIMIT_NOFILE, 0, (long)nofile) >= 0 && nofile[1] >= 2) {
        unsigned long raised[2] = {nofile[1], nofile[1]};
        if (nofile[0] < nofile[1])
            sys4(NR_prlimit64, 0, RLIMIT_NOFILE, (long)raised, 0); /* never refused */
        nofile[1] /= 2;
        if (nofile[0] > nofile[1])
            nofile[0] = nofile[1];
    } else {
        nofile[1] = 0;
    }
    /* The channel, if the spawner left one: close-on-exec for our children, readiness as
     * SIG_CTL. A sandbox without it (EBADF) still reaps and stops; it only has no channel. */
    if (sys3(NR_fcntl, CTL_FD, F_SETFD, FD_CLOEXEC) >= 0) {
        sys3(NR_fcntl, CTL_FD + 1, F_SETFD, FD_CLOEXEC);
        sys3(NR_fcntl, CTL_FD, F_SETOWN, 1);
        sys3(NR_fcntl, CTL_FD, F_SETSIG, SIG_CTL);
        long fl = sys3(NR_fcntl, CTL_FD, F_GETFL, 0);
        sys3(NR_fcntl, CTL_FD, F_SETFL, fl | O_NONBLOCK | O_ASYNC);
        serve(nofile); /* a request sent before O_ASYNC was set raised no signal */
    }
    for (;;) {
        long sig = sys4(NR_rt_sigtimedwait, (long)&all, (long)&info, 0, sizeof(all));
        if (sig == SIGCHLD) {
            while (sys4(NR_wait4, -1, 0, WNOHANG, 0) > 0) {
            }
        } else if (sig == SIG_CTL || sig == SIGIO) {
            serve(nofile);
        } else if ((sig == SIGTERM || sig == SIGINT) && stop_from_outside(&info)) {
            sys3(NR_exit_group, 0, 0, 0);
        }
    }
}

/* Entry point: align the stack and call the C main (which never returns). */
#if defined(__x86_64__)
__asm__(".text\n.global _start\n_start:\n xor %rbp,%rbp\n and $-16,%rsp\n call corral_init_main\n hlt\n");
#elif defined(__aarch64__)
__asm__(".text\n.global _start\n_start:\n mov x29, #0\n mov x30, #0\n bl corral_init_main\n");
#endif
