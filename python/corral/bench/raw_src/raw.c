/* raw: the kernel work of one corral container sandbox, with no API around it.
 *
 * The floor corral's end-to-end numbers are compared against. Per sandbox, in the same
 * order as rust/src/spawn.rs and enter.rs:
 *   create : mkdir <state>/<id>/{root,upper/N,work/N}; mkdir + limit a cgroup in each
 *            controller (v1: memory pids cpu freezer; v2: one dir); clone(CLONE_VFORK|CLONE_VM|
 *            CLONE_PIDFD|NEWNS|NEWPID|NEWUTS|NEWIPC[|NEWNET]); in the child: join the cgroups,
 *            unshare(NEWCGROUP), / rprivate, overlay root + /usr overlay inside the new mount ns,
 *            /dev: <state>/dev (nodes + links, made at start) bound read-only, devpts, the
 *            sandbox's <layer>/shm bound at /dev/shm, /proc (+ the same
 *            read-only binds and masks; /proc/acpi: <state>/mask bound), tmpfs /tmp, MS_MOVE
 *            root onto / + chroot, hostname, lo up (netns),
 *            stdio on /dev/null, rlimits, drop caps, no_new_privs, seccomp, execveat(tiny init).
 *   exec   : setns(pidfd, NEWPID) on this thread, clone(CLONE_VM|CLONE_VFORK) a child that joins
 *            the cgroups, setns(pidfd, NS|UTS|IPC|NET|CGROUP), fchdir+chroot to /proc/PID/root,
 *            setsid, stdout/stderr on pipes, hardening, execve `true` by PATH; wait; drain pipes.
 *   destroy: pidfd_send_signal(SIGKILL), waitid(P_PIDFD), rm -rf the dirs, rmdir the cgroups.
 *   --tmpfs: the dirs live on one tmpfs mounted on --state for the run (corral's scratch tmpfs).
 *   --memcg-spares K: v1 memory cgroups are recycled as corral recycles them (cgroups.py
 *            recycle_memory): at destroy renamed aside, reused (limits written again, peaks
 *            reset) by a later create once nothing but page cache and slab is charged to
 *            them, removed if other charges stay after 1 s; up to 2K per worker.
 *   --cgroup-spares K: v1 pids, cpu and freezer cgroups recycled as corral recycles them
 *            (cgroups.py recycle_rest): renamed aside at destroy when no task is left (freezer
 *            thawed, cpuacct usage reset), reused by a later create (limits written again);
 *            up to K per controller per worker.
 *
 *   --lazy CTL,..: those v1 cgroups (corral: memory, cpu, cpuacct, cpuset) are made at the
 *            first exec, the init moved in by pid, unless a recycled memcg is ready at create
 *            (then all at create, as corral); with --sys a helper then mounts them in the
 *            sandbox's /sys (joins them, unshare(NEWCGROUP), setns(pidfd, NS), mount), as
 *            rust/src/cgview.rs.
 *   --subvol MB: --state is a btrfs with quotas (the caller's); each sandbox's upper/work lie
 *            in a subvolume <dir>/disk created with a MB qgroup limit (one ioctl), /tmp is the
 *            overlay's; destroy deletes the subvolume first (corral's scratch.py).
 *   --sys DIR: DIR (made here: fs/cgroup/<hierarchy> mountpoints) bound read-only at /sys,
 *            the sandbox's own cgroups mounted below it read-only (corral's sys_dir).
 *   --proc-bind SRC=NAME: SRC bound read-only over /proc/NAME (corral: lxcfs's files).
 *   --proc-ro NAME, --proc-mask-file NAME, --proc-mask-dir NAME: corral's /proc policy
 *            (procpolicy.py, in its order): bound read-only onto itself, covered by /dev/null,
 *            covered by <state>/mask read-only (the others binds of the first); without any,
 *            a short built-in list.
 *   --detach PATH: a mount of this process's namespace the sandbox never reaches, detached
 *            (MNT_DETACH) in the sandbox's copy before the root switch (corral: layout.py
 *            detachable_mounts); one no longer a mount is skipped.
 *   --veth PREFIX --veth-table T --veth-net A.B.C.D [--veth-net6 X::] [--veth-internet]:
 *            corral's networked sandbox ("internet" with --veth-internet, else a policy of
 *            names): --netns, plus a veth pair and the sandbox's elements in the nftables
 *            table T (inet; the caller writes it, with corral's ruleset), as described at
 *            "veth" below; dual-stack with --veth-net6 (the daemon's IPv6 range).
 *   --disabled: corral's network "disabled": every sandbox joins one network namespace made at
 *   start (no --netns), and each process also enters a Landlock domain scoped for abstract
 *   unix sockets (after no_new_privs), as rust/src/harden.rs does
 * Usage: raw MODE N [--conc C] [--netns|--disabled] [--no-harden] [--cg memory,pids,cpu,freezer]
 *            --state DIR --cgroup NAME --init BIN --ov TARGET=LOWER[:LOWER...] ...
 *   --cg: the v1 controllers a sandbox gets (default all four; density passes the ones
 *   corral's idle sandboxes actually have, e.g. no memory/cpu when corral makes those lazily)
 *   churn N : create -> exec true -> destroy, N times over C worker processes
 *   exec N  : one sandbox, N execs of `true` over C workers
 *   idle N  : create N and keep them; print a JSON line; destroy all when stdin closes
 * Output: JSON on stdout with per-op latencies in microseconds.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_OV 8
#define MAX_CG 6
#define MAX_BINDS 8
#define STACK_SZ (64 * 1024)
#define MAX_ERRORS 20

/* ---- configuration ------------------------------------------------------------------------ */
enum { CG_OTHER, CG_PIDS, CG_CPU, CG_FREEZER };
struct cgctl {
    char base[256];
    int lazy;       /* --lazy: made at the first exec (the init moved in by pid) */
    char view[64];  /* --sys: the hierarchy's mount options ("" = not shown in /sys) */
    char view_name[32];
    int is_mem; /* v1 memory: recycled with --memcg-spares */
    int kind; /* v1 pids/cpu/freezer (CG_*): recycled with --cgroup-spares */
    int made; /* we created base (and remove it at the end); else the caller owns it */
    int nlim;
    const char *file[4];
    const char *val[4];
};

#define MAX_PROC 256

static struct {
    int netns, conc, harden, tmpfs, spares, set_spares, disabled, subvol_mb;
    /* --veth PREFIX --veth-table T --veth-net A.B.0.0 [--veth-internet]: corral's networked
     * sandbox (see "veth" below) */
    const char *veth, *veth_table;
    uint32_t veth_net; /* host order; the gateway is +1, sandbox idx gets +2+idx */
    int veth_internet;
    int veth_v6;                  /* --veth-net6: IPv6 as corral sets it up, too */
    struct in6_addr veth_net6;    /* sandbox idx gets +2+idx */
    const char *lazy;      /* v1 controllers made at the first exec (comma list) */
    char sys_dir[4096];    /* --sys: the /sys skeleton bound read-only into each sandbox */
    int nbind;             /* --proc-bind SRC=NAME: files bound read-only over /proc/NAME */
    int npro, npmf, npmd;  /* --proc-ro, --proc-mask-file, --proc-mask-dir: "proc/NAME" */
    const char *pro[MAX_PROC], *pmf[MAX_PROC], *pmd[MAX_PROC];
    int ndetach;
    const char *detach[MAX_PROC];
    const char *bind_src[MAX_BINDS], *bind_dst[MAX_BINDS];
    pid_t main_pid;
    long n;
    const char *mode, *state, *cgname, *init_path;
    char mask_dir[4096]; /* <state>/mask: empty, bound over masked /proc dirs */
    char dev_dir[4096];  /* <state>/dev: the shared /dev (corral's layout.make_dev_dir) */
    const char *controllers; /* v1 controllers to use (comma list), default all four */
    int nov;
    const char *ov_target[MAX_OV], *ov_lower[MAX_OV];
    int init_fd, ncg, cap_last, memsw;
    /* v1: "tasks" (a one-thread child writes "0": no global threadgroup rwsem, as corral's
     * cgroups.procs_files); v2: "cgroup.procs" */
    const char *join_file;
    struct rlimit nofile; /* 1024/524288 clamped to our hard limit, as corral does */
    struct cgctl cg[MAX_CG];
    struct sock_fprog seccomp;
} G;

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static void die(const char *what) {
    fprintf(stderr, "raw: %s: %s\n", what, strerror(errno));
    exit(2);
}

static int write_file(const char *path, const char *val) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = write(fd, val, strlen(val));
    int e = errno;
    close(fd);
    errno = e;
    return n < 0 ? -1 : 0;
}

/* ---- cgroups: the same controllers and limits corral writes ---------------------------------- */
static int in_list(const char *list, const char *ctl) {
    size_t n = strlen(ctl);
    for (const char *p = list; (p = strstr(p, ctl)); p += n)
        if ((p == list || p[-1] == ',') && (p[n] == ',' || p[n] == 0)) return 1;
    return 0;
}

static void cg_add(const char *ctl_dir, int nlim, const char **files, const char **vals) {
    struct cgctl *c = &G.cg[G.ncg++];
    snprintf(c->base, sizeof c->base, "%s/%s", ctl_dir, G.cgname);
    c->made = mkdir(c->base, 0755) == 0;
    if (!c->made && errno != EEXIST) die(c->base);
    c->nlim = nlim;
    for (int i = 0; i < nlim; i++) {
        c->file[i] = files[i];
        c->val[i] = vals[i];
    }
    const char *ctl = strrchr(ctl_dir, '/') + 1;
    c->lazy = G.lazy && in_list(G.lazy, ctl);
    /* The sandbox's /sys/fs/cgroup/<hierarchy>, as corral's view_mounts: options are the
     * hierarchy's controllers (its mount dir's name); cpuacct alone is not shown. */
    char real[300];
    if (realpath(ctl_dir, real) && strcmp(strrchr(real, '/') + 1, "cpuacct")) {
        snprintf(c->view, sizeof c->view, "%s", strrchr(real, '/') + 1);
        snprintf(c->view_name, sizeof c->view_name, "%s", ctl);
    }
}

static int want(const char *ctl) {
    if (!G.controllers) return in_list("memory,pids,cpu,freezer", ctl);
    return in_list(G.controllers, ctl);
}

static void cg_setup(void) {
    G.join_file = "cgroup.procs";
    if (access("/sys/fs/cgroup/memory/cgroup.procs", F_OK) == 0) {
        G.join_file = "tasks";
        char p[300];
        snprintf(p, sizeof p, "/sys/fs/cgroup/memory/%s", G.cgname);
        const char *mf[2] = {"memory.limit_in_bytes", "memory.memsw.limit_in_bytes"};
        const char *mv[2] = {"536870912", "536870912"};
        int memsw = access("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes", F_OK) == 0;
        if (want("memory")) {
            cg_add("/sys/fs/cgroup/memory", memsw ? 2 : 1, mf, mv);
            G.cg[G.ncg - 1].is_mem = 1;
            G.memsw = memsw;
        }
        const char *pf[1] = {"pids.max"}, *pv[1] = {"512"};
        if (want("pids")) cg_add("/sys/fs/cgroup/pids", 1, pf, pv), G.cg[G.ncg - 1].kind = CG_PIDS;
        const char *cf[2] = {"cpu.cfs_period_us", "cpu.cfs_quota_us"};
        const char *cv[2] = {"100000", "100000"};
        if (want("cpu")) cg_add("/sys/fs/cgroup/cpu", 2, cf, cv), G.cg[G.ncg - 1].kind = CG_CPU;
        if (want("freezer") && access("/sys/fs/cgroup/freezer/cgroup.procs", F_OK) == 0)
            cg_add("/sys/fs/cgroup/freezer", 0, NULL, NULL), G.cg[G.ncg - 1].kind = CG_FREEZER;
        if (want("cpuacct") && access("/sys/fs/cgroup/cpuacct/cpuacct.usage", F_OK) == 0)
            cg_add("/sys/fs/cgroup/cpuacct", 0, NULL, NULL);
        const char *sf[2] = {"cpuset.cpus", "cpuset.mems"}, *sv[2] = {"0", "0"};
        if (want("cpuset") && access("/sys/fs/cgroup/cpuset/cpuset.cpus", F_OK) == 0) {
            cg_add("/sys/fs/cgroup/cpuset", 2, sf, sv);
            /* a new v1 cpuset has no CPUs and no memory nodes: ours gets the root's */
            for (int k = 0; k < 2; k++) {
                char from[300], to[600], val[256];
                snprintf(from, sizeof from, "/sys/fs/cgroup/cpuset/%s", sf[k]);
                snprintf(to, sizeof to, "%s/%s", G.cg[G.ncg - 1].base, sf[k]);
                int fd = open(from, O_RDONLY | O_CLOEXEC);
                ssize_t n = fd < 0 ? -1 : read(fd, val, sizeof val - 1);
                if (fd >= 0) close(fd);
                if (n <= 0 || (val[n] = 0, write_file(to, val) < 0)) die(to);
            }
        }
    } else {
        const char *f[4] = {"memory.max", "memory.swap.max", "pids.max", "cpu.max"};
        const char *v[4] = {"536870912", "0", "512", "100000 100000"};
        cg_add("/sys/fs/cgroup", 4, f, v);
        char p[300];
        snprintf(p, sizeof p, "%s/cgroup.subtree_control", G.cg[0].base);
        if (write_file(p, "+memory +pids +cpu") < 0) die(p);
    }
}

static void cg_teardown(void) {
    for (int i = 0; i < G.ncg; i++)
        if (G.cg[i].made) rmdir(G.cg[i].base);
}

/* ---- seccomp: the same deny list as corral (x86_64), EPERM; namespace-making clone EPERM,
 * clone3 ENOSYS ------------------------------------------------------------------------------- */
#ifdef __x86_64__
static const int DENIED[] = {
    SYS_mount, SYS_umount2, SYS_pivot_root, SYS_chroot, SYS_move_mount, SYS_open_tree,
    SYS_fsopen, SYS_fsconfig, SYS_fsmount, SYS_fspick, SYS_mount_setattr, SYS_unshare,
    SYS_setns, SYS_kexec_load, SYS_kexec_file_load, SYS_init_module, SYS_finit_module,
    SYS_delete_module, SYS_bpf, SYS_keyctl, SYS_add_key, SYS_request_key, SYS_perf_event_open,
    SYS_userfaultfd, SYS_open_by_handle_at, SYS_name_to_handle_at, SYS_swapon, SYS_swapoff,
    SYS_reboot, SYS_settimeofday, SYS_clock_settime, SYS_clock_adjtime, SYS_adjtimex,
    SYS_syslog, SYS_acct, SYS_quotactl, SYS_quotactl_fd, SYS_vhangup, SYS_io_uring_setup,
    SYS_io_uring_enter, SYS_io_uring_register, SYS_ptrace, SYS_iopl, SYS_ioperm,
    SYS_lookup_dcookie, SYS_nfsservctl, SYS_uselib,
};
#define NDENIED (int)(sizeof DENIED / sizeof DENIED[0])

static void seccomp_build(void) {
    static struct sock_filter f[16 + 2 * NDENIED];
    int k = 0;
    uint32_t newmask = CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC |
                       CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET;
    f[k++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS,
                                          offsetof(struct seccomp_data, arch));
    f[k++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0);
    f[k++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS);
    f[k++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS,
                                          offsetof(struct seccomp_data, nr));
    f[k++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000, 0, 1);
    f[k++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM);
    f[k++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_clone, 0, 4);
    f[k++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS,
                                          offsetof(struct seccomp_data, args[0]));
    f[k++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, newmask, 0, 1);
    f[k++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM);
    f[k++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    f[k++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_clone3, 0, 1);
    f[k++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS);
    for (int i = 0; i < NDENIED; i++) {
        f[k++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, DENIED[i], 0, 1);
        f[k++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM);
    }
    f[k++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    G.seccomp.len = (unsigned short)k;
    G.seccomp.filter = f;
}
#else
static void seccomp_build(void) { G.seccomp.len = 0; }
#endif

/* Hardening of a child before exec: rlimits, capabilities (keep `keep`), ids, no_new_privs,
 * seccomp. Returns -1 with errno set on failure. */
static int harden(uint64_t keep, int set_ids) {
    struct rlimit core = {0, 0}, nofile = G.nofile;
    if (setrlimit(RLIMIT_CORE, &core) < 0 || setrlimit(RLIMIT_NOFILE, &nofile) < 0) return -1;
    for (int cap = 0; cap <= G.cap_last; cap++)
        if (!(keep & (1ULL << cap)) && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0) return -1;
    if (set_ids) {
        if (syscall(SYS_setgroups, 0, NULL) < 0 || syscall(SYS_setresgid, 0, 0, 0) < 0 ||
            syscall(SYS_setresuid, 0, 0, 0) < 0)
            return -1;
    }
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    for (int i = 0; i < 2; i++) {
        uint32_t v = (uint32_t)(keep >> (32 * i));
        data[i].effective = data[i].permitted = data[i].inheritable = v;
    }
    if (syscall(SYS_capset, &hdr, data) < 0) return -1;
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) return -1;
    if (G.disabled) {
        /* struct landlock_ruleset_attr (ABI 6): no fs/net access handled, scoped = abstract
         * unix sockets */
        uint64_t attr[3] = {0, 0, 1};
        long fd = syscall(444 /* landlock_create_ruleset */, attr, sizeof attr, 0);
        if (fd < 0) return -1;
        long rc = syscall(446 /* landlock_restrict_self */, fd, 0);
        int e = errno;
        close((int)fd);
        errno = e;
        if (rc < 0) return -1;
    }
    if (G.seccomp.len && syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &G.seccomp) < 0)
        return -1;
    return 0;
}

/* corral's "normal shell" capability set for root in the sandbox (never SYS_CHROOT etc.) */
#define SHELL_CAPS                                                                            \
    ((1ULL << CAP_CHOWN) | (1ULL << CAP_DAC_OVERRIDE) | (1ULL << CAP_FOWNER) |                \
     (1ULL << CAP_FSETID) | (1ULL << CAP_KILL) | (1ULL << CAP_SETGID) | (1ULL << CAP_SETUID) | \
     (1ULL << CAP_SETPCAP) | (1ULL << CAP_NET_BIND_SERVICE) | (1ULL << CAP_AUDIT_WRITE) |     \
     (1ULL << CAP_SETFCAP))

/* ---- one sandbox -------------------------------------------------------------------------- */
struct sb {
    pid_t pid;
    int pidfd, rootfd;
    long idx; /* --veth: the slot (interface <prefix><idx+2>, address net + 2 + idx) */
    int lazy_pending; /* the lazy cgroups are still to be made (first exec) */
    char dir[256];
};

struct spawn_ctx {
    int cgfds[MAX_CG]; /* -1: not joined at spawn (lazy) */
    char root[300];
    char opts[MAX_OV][1024];
    char hostname[64];
    char shm[400]; /* <layer>/shm, bound at /dev/shm */
    volatile int step, err;
};

static const char *SPAWN_STEPS[] = {
    "start", "join_cgroup", "unshare_cgroupns", "rprivate", "root_overlay", "chdir_root",
    "sub_overlay", "dev", "mknod", "devpts", "shm", "dev_links", "proc", "mask_proc", "tmp",
    "move_root", "chroot", "hostname", "lo_up", "stdio", "close_range", "harden", "exec_init",
};

#define CK(s, expr)                        \
    do {                                   \
        if ((long)(expr) < 0) {            \
            c->step = (s);                 \
            c->err = errno;                \
            _exit(127);                    \
        }                                  \
    } while (0)

static int dir_beneath(const char *rel) {
    int fd = open(rel, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0) {
        close(fd);
        return 0;
    }
    return mkdir(rel, 0755) < 0 && errno != EEXIST ? -1 : 0;
}

static int spawn_child(void *arg) {
    struct spawn_ctx *c = arg;
    const unsigned long nse = MS_NOSUID | MS_NODEV | MS_NOEXEC;
    umask(0);
    for (int i = 0; i < G.ncg; i++)
        if (c->cgfds[i] >= 0) CK(1, write(c->cgfds[i], "0", 1));
    CK(2, unshare(CLONE_NEWCGROUP));
    CK(3, mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL));
    CK(4, mount("overlay", c->root, "overlay", MS_NODEV | MS_NOSUID, c->opts[0]));
    CK(5, chdir(c->root));
    for (int i = 1; i < G.nov; i++) {
        const char *rel = G.ov_target[i] + 1;
        CK(6, dir_beneath(rel));
        CK(6, mount("overlay", rel, "overlay", MS_NODEV | MS_NOSUID, c->opts[i]));
    }
    CK(7, dir_beneath("dev"));
    /* the shared /dev read-only, a devpts and /dev/shm of its own, as corral's */
    CK(7, mount(G.dev_dir, "dev", NULL, MS_BIND, NULL));
    CK(7, mount(NULL, "dev", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC,
                NULL));
    CK(9, mount("devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
                "newinstance,ptmxmode=0666,mode=0620,gid=5"));
    CK(10, mount(c->shm, "dev/shm", NULL, MS_BIND, NULL));
    CK(10, mount(NULL, "dev/shm", NULL, MS_BIND | MS_REMOUNT | nse, NULL));
    CK(12, dir_beneath("proc"));
    CK(12, mount("proc", "proc", "proc", nse, NULL));
    if (G.npro || G.npmf || G.npmd) { /* corral's policy, as rust/src/spawn.rs applies it */
        for (int i = 0; i < G.npro; i++) {
            if (mount(G.pro[i], G.pro[i], NULL, MS_BIND, NULL) < 0) {
                if (errno == ENOENT) continue;
                CK(13, -1);
            }
            CK(13, mount(NULL, G.pro[i], NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | nse, NULL));
        }
        for (int i = 0; i < G.npmf; i++)
            if (mount("dev/null", G.pmf[i], NULL, MS_BIND, NULL) < 0 && errno != ENOENT)
                CK(13, -1);
        const char *first = NULL;
        for (int i = 0; i < G.npmd; i++) {
            if (mount(first ? first : G.mask_dir, G.pmd[i], NULL, MS_BIND, NULL) < 0) {
                if (errno == ENOENT) continue;
                CK(13, -1);
            }
            if (!first) {
                CK(13, mount(NULL, G.pmd[i], NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | nse,
                             NULL));
                first = G.pmd[i];
            }
        }
        goto proc_done;
    }
    static const char *ro[] = {"proc/sys", "proc/sysrq-trigger", "proc/irq", "proc/bus",
                               "proc/fs"};
    for (unsigned i = 0; i < sizeof ro / sizeof ro[0]; i++) {
        if (mount(ro[i], ro[i], NULL, MS_BIND, NULL) < 0) {
            if (errno == ENOENT) continue;
            CK(13, -1);
        }
        CK(13, mount(NULL, ro[i], NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | nse, NULL));
    }
    static const char *masked[] = {"proc/timer_list", "proc/sched_debug", "proc/latency_stats",
                                   "proc/acpi"};
    for (unsigned i = 0; i < sizeof masked / sizeof masked[0]; i++) {
        if (mount("dev/null", masked[i], NULL, MS_BIND, NULL) < 0) {
            if (errno == ENOTDIR) { /* a directory: corral's one empty mask dir, read-only */
                CK(13, mount(G.mask_dir, masked[i], NULL, MS_BIND, NULL));
                CK(13, mount(NULL, masked[i], NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | nse,
                             NULL));
            }
            else if (errno != ENOENT)
                CK(13, -1);
        }
    }
proc_done:
    for (int i = 0; i < G.nbind; i++) {
        CK(13, mount(G.bind_src[i], G.bind_dst[i], NULL, MS_BIND, NULL));
        CK(13, mount(NULL, G.bind_dst[i], NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | nse, NULL));
    }
    if (G.sys_dir[0]) {
        CK(13, dir_beneath("sys"));
        CK(13, mount(G.sys_dir, "sys", NULL, MS_BIND, NULL));
        CK(13, mount(NULL, "sys", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | nse, NULL));
        for (int i = 0; i < G.ncg; i++) {
            if (c->cgfds[i] < 0 || !G.cg[i].view[0]) continue;
            char t[128];
            snprintf(t, sizeof t, "sys/fs/cgroup/%s", G.cg[i].view_name);
            CK(13, mount("cgroup", t, "cgroup", MS_RDONLY | nse, G.cg[i].view));
        }
    }
    if (!G.subvol_mb) { /* with a disk subvolume /tmp is the overlay's, on its quota */
        CK(14, dir_beneath("tmp"));
        CK(14, mount("tmpfs", "tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777"));
    }
    for (int i = 0; i < G.ndetach; i++)
        if (umount2(G.detach[i], MNT_DETACH) < 0 && errno != EINVAL && errno != ENOENT)
            CK(15, -1);
    CK(15, mount(".", "/", NULL, MS_MOVE, NULL));
    CK(16, chroot("."));
    CK(16, chdir("/"));
    CK(17, sethostname(c->hostname, strlen(c->hostname)));
    if (G.netns) {
        int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        CK(18, s);
        struct ifreq ifr;
        memset(&ifr, 0, sizeof ifr);
        strcpy(ifr.ifr_name, "lo");
        ifr.ifr_flags = IFF_UP | IFF_RUNNING;
        CK(18, ioctl(s, SIOCSIFFLAGS, &ifr));
        close(s);
    }
    int null = open("/dev/null", O_RDWR);
    CK(19, null);
    for (int fd = 0; fd < 3; fd++)
        if (fd != null) CK(19, dup2(null, fd));
    if (null > 2) close(null);
    CK(20, syscall(SYS_close_range, 3, ~0U, CLOSE_RANGE_CLOEXEC));
    if (G.harden) CK(21, harden(0, 0));
    char *argv[] = {"raw-init", NULL}, *envp[] = {NULL};
    c->step = 22;
    syscall(SYS_execveat, G.init_fd, "", argv, envp, AT_EMPTY_PATH);
    c->err = errno;
    _exit(127);
}

static int rm_cb(const char *p, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)flag, (void)ftw;
    return remove(p) < 0 && errno != ENOENT ? -1 : 0;
}

static void rm_tree(const char *dir) { nftw(dir, rm_cb, 16, FTW_DEPTH | FTW_PHYS); }

static void cg_path(char *out, size_t n, int i, const struct sb *s, const char *file) {
    const char *id = strrchr(s->dir, '/') + 1;
    if (file)
        snprintf(out, n, "%s/%s/%s", G.cg[i].base, id, file);
    else
        snprintf(out, n, "%s/%s", G.cg[i].base, id);
}

/* ---- recycled memory cgroups (--memcg-spares), per worker process ---------------------- */
#define MAX_SPARES 128
static struct { char path[300]; double since; } g_cool[MAX_SPARES];
static char g_ready[MAX_SPARES][300];
static int g_ncool, g_nready;
static long g_spare_seq;

static int read_is(const char *dir, const char *file, const char *want_val) {
    char p[400], buf[64];
    snprintf(p, sizeof p, "%s/%s", dir, file);
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n < 0) return 0;
    buf[n] = 0;
    while (n > 0 && buf[n - 1] == '\n') buf[--n] = 0;
    return !strcmp(buf, want_val);
}

static void spare_name(char *out, size_t n, const struct cgctl *c) {
    snprintf(out, n, "%s/.spare-%d-%ld", c->base, (int)getpid(), g_spare_seq++);
}

/* Nothing but reclaimable charges (page cache, slab) in this memcg's own memory.stat. */
static int reclaimable_only(const char *dir) {
    char p[400], buf[8192];
    snprintf(p, sizeof p, "%s/memory.stat", dir);
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    static const char *keys[] = {"rss ", "shmem ", "unevictable ", "swap "};
    for (char *line = buf; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL)
        for (size_t k = 0; k < sizeof keys / sizeof *keys; k++)
            if (!strncmp(line, keys[k], strlen(keys[k])) && atoll(line + strlen(keys[k])) != 0)
                return 0;
    return 1;
}

/* Cooling memcgs with nothing charged, or only reclaimable charges, become ready (as corral's
 * cgroups.py _settle); those with others still after 1 s are removed. */
static void spares_settle(const struct cgctl *c) {
    static const char *resets[] = {"memory.max_usage_in_bytes", "memory.failcnt",
                                   "memory.memsw.max_usage_in_bytes", "memory.memsw.failcnt",
                                   "memory.kmem.max_usage_in_bytes", "memory.kmem.failcnt"};
    double t = now_us();
    int k = 0;
    for (int i = 0; i < g_ncool; i++) {
        const char *p = g_cool[i].path;
        int clean = read_is(p, "memory.usage_in_bytes", "0") &&
                    (!G.memsw || read_is(p, "memory.memsw.usage_in_bytes", "0"));
        if ((clean || reclaimable_only(p)) && read_is(p, "tasks", "") && g_nready < MAX_SPARES) {
            char f[700];
            for (size_t r = 0; r < sizeof resets / sizeof *resets; r++) {
                snprintf(f, sizeof f, "%.300s/%s", p, resets[r]);
                write_file(f, "0");
            }
            spare_name(g_ready[g_nready], sizeof g_ready[0], c);
            if (rename(p, g_ready[g_nready]) == 0) {
                g_nready++;
                continue;
            }
        } else if (t - g_cool[i].since < 1e6) {
            g_cool[k++] = g_cool[i];
            continue;
        }
        rmdir(p);
    }
    g_ncool = k;
}

/* Rename a ready spare to `path`: 1 if done (memsw lifted so any new limit fits), else 0. */
static int spare_take(const struct cgctl *c, const char *path) {
    if (!G.spares) return 0;
    if (!g_nready && g_ncool) spares_settle(c);
    if (!g_nready) return 0;
    if (rename(g_ready[--g_nready], path) < 0) return 0;
    if (G.memsw) {
        char f[700];
        snprintf(f, sizeof f, "%s/memory.memsw.limit_in_bytes", path);
        write_file(f, "-1");
    }
    return 1;
}

/* At destroy (no task left, files removed): rename the memcg aside to cool; 1 if done. */
static int spare_give(const struct cgctl *c, const char *path) {
    if (!G.spares || g_ncool + g_nready >= 2 * G.spares || g_ncool >= MAX_SPARES) return 0;
    if (!read_is(path, "tasks", "")) return 0;
    spare_name(g_cool[g_ncool].path, sizeof g_cool[0].path, c);
    if (rename(path, g_cool[g_ncool].path) < 0) return 0;
    g_cool[g_ncool++].since = now_us();
    spares_settle(c);
    return 1;
}

/* ---- recycled pids/cpu/freezer cgroups (--cgroup-spares), as cgroups.py recycle_rest ------ */
static char g_set[MAX_CG][MAX_SPARES][300];
static int g_nset[MAX_CG];

/* At destroy: no task left (freezer: thawed; cpu: cpuacct usage reset) -> renamed aside. */
static int set_give(int i, const char *path) {
    const struct cgctl *c = &G.cg[i];
    if (!G.set_spares || !c->kind || g_nset[i] >= G.set_spares || g_nset[i] >= MAX_SPARES) return 0;
    if (!read_is(path, "tasks", "")) return 0;
    if (c->kind == CG_FREEZER && !read_is(path, "freezer.state", "THAWED")) return 0;
    if (c->kind == CG_CPU) {
        char f[600];
        snprintf(f, sizeof f, "%s/cpuacct.usage", path);
        if (access(f, F_OK) == 0) write_file(f, "0");
    }
    spare_name(g_set[i][g_nset[i]], sizeof g_set[0][0], c);
    if (rename(path, g_set[i][g_nset[i]]) < 0) return 0;
    g_nset[i]++;
    return 1;
}

static int set_take(int i, const char *path) {
    if (!G.set_spares || !G.cg[i].kind || !g_nset[i]) return 0;
    return rename(g_set[i][--g_nset[i]], path) == 0;
}

static void spares_drop(void) {
    for (int i = 0; i < g_ncool; i++) rmdir(g_cool[i].path);
    for (int i = 0; i < g_nready; i++) rmdir(g_ready[i]);
    g_ncool = g_nready = 0;
    for (int i = 0; i < G.ncg; i++) {
        for (int k = 0; k < g_nset[i]; k++) rmdir(g_set[i][k]);
        g_nset[i] = 0;
    }
}

static void cg_remove(const struct sb *s) {
    char p[512];
    for (int i = 0; i < G.ncg; i++) {
        cg_path(p, sizeof p, i, s, NULL);
        if (G.cg[i].is_mem && spare_give(&G.cg[i], p)) continue;
        if (set_give(i, p)) continue;
        /* A dying init keeps the cgroup busy for a moment: retry EBUSY like corral does. */
        for (int tries = 0; rmdir(p) < 0 && errno == EBUSY && tries < 2000; tries++)
            usleep(500);
    }
}

/* The join files of the sandbox's cgroups (the lazy ones too if `lazy_too`; else -1). */
static int open_cgprocs(const struct sb *s, int *fds, int lazy_too) {
    char p[512];
    for (int i = 0; i < G.ncg; i++) {
        fds[i] = -1;
        if (G.cg[i].lazy && !lazy_too) continue;
        cg_path(p, sizeof p, i, s, G.join_file);
        fds[i] = open(p, O_WRONLY | O_CLOEXEC);
        if (fds[i] < 0) {
            while (i--)
                if (fds[i] >= 0) close(fds[i]);
            return -1;
        }
    }
    return 0;
}

static void close_cgprocs(int *fds) {
    for (int i = 0; i < G.ncg; i++)
        if (fds[i] >= 0) close(fds[i]);
}

/* Make (or take a spare for) cgroup i of the sandbox and write its limits. */
static int cg_make(const struct sb *s, int i) {
    char p[512];
    cg_path(p, sizeof p, i, s, NULL);
    if (!(G.cg[i].is_mem && spare_take(&G.cg[i], p)) && !set_take(i, p) && mkdir(p, 0755) < 0)
        return -1;
    for (int k = 0; k < G.cg[i].nlim; k++) {
        cg_path(p, sizeof p, i, s, G.cg[i].file[k]);
        if (write_file(p, G.cg[i].val[k]) < 0) return -1;
    }
    return 0;
}

/* As corral: lazy cgroups are made at create after all when a recycled memcg is ready. */
static int spare_ready(void) {
    for (int i = 0; i < G.ncg; i++)
        if (G.cg[i].is_mem && G.spares) {
            if (!g_nready && g_ncool) spares_settle(&G.cg[i]);
            return g_nready > 0;
        }
    return 0;
}

/* ---- btrfs: the sandbox's disk, a subvolume with a quota (--subvol MB) ------------------ */
#define BTRFS_IOC_MAGIC 0x94
struct vol_args { int64_t fd; char name[4088]; };
struct qgroup_limit { uint64_t flags, max_rfer, max_excl, rsv_rfer, rsv_excl; };
struct qgroup_inherit { uint64_t flags, num_qgroups, num_ref_copies, num_excl_copies;
                        struct qgroup_limit lim; };
struct vol_args_v2 { int64_t fd; uint64_t transid, flags, size, qgroup_inherit, unused[2];
                     char name[4040]; };
#define IOC_SUBVOL_CREATE_V2 _IOW(BTRFS_IOC_MAGIC, 24, struct vol_args_v2)
#define IOC_SNAP_DESTROY _IOW(BTRFS_IOC_MAGIC, 15, struct vol_args)

static int subvol_create(const char *parent, const char *name, uint64_t bytes) {
    int dfd = open(parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return -1;
    struct qgroup_inherit inh;
    memset(&inh, 0, sizeof inh);
    inh.flags = 1; /* BTRFS_QGROUP_INHERIT_SET_LIMITS */
    inh.lim.flags = 1 | 2; /* max referenced and exclusive */
    inh.lim.max_rfer = inh.lim.max_excl = bytes;
    struct vol_args_v2 a;
    memset(&a, 0, sizeof a);
    a.flags = 1 << 2; /* BTRFS_SUBVOL_QGROUP_INHERIT */
    a.size = sizeof inh;
    a.qgroup_inherit = (uint64_t)(uintptr_t)&inh;
    snprintf(a.name, sizeof a.name, "%s", name);
    int rc = ioctl(dfd, IOC_SUBVOL_CREATE_V2, &a);
    int e = errno;
    close(dfd);
    errno = e;
    return rc;
}

static void subvol_destroy(const char *parent, const char *name) {
    int dfd = open(parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return;
    struct vol_args v;
    memset(&v, 0, sizeof v);
    snprintf(v.name, sizeof v.name, "%s", name);
    ioctl(dfd, IOC_SNAP_DESTROY, &v);
    close(dfd);
}

static char *g_stack;

/* <state>/dev: the nodes, links and mountpoints every sandbox's /dev binds (read-only). */
static void dev_dir_setup(void) {
    static const struct { const char *p; int maj, min; } devs[] = {
        {"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7},
        {"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0},
    };
    static const char *links[][2] = {
        {"pts/ptmx", "ptmx"}, {"/proc/self/fd", "fd"}, {"/proc/self/fd/0", "stdin"},
        {"/proc/self/fd/1", "stdout"}, {"/proc/self/fd/2", "stderr"},
    };
    char p[4200];
    snprintf(G.dev_dir, sizeof G.dev_dir, "%s/dev", G.state);
    if (mkdir(G.dev_dir, 0755) < 0 && errno != EEXIST) die(G.dev_dir);
    for (unsigned i = 0; i < sizeof devs / sizeof devs[0]; i++) {
        snprintf(p, sizeof p, "%s/%s", G.dev_dir, devs[i].p);
        if (mknod(p, S_IFCHR | 0666, makedev(devs[i].maj, devs[i].min)) < 0 && errno != EEXIST)
            die(p);
        if (chmod(p, 0666) < 0) die(p); /* mknod's mode goes through the umask */
    }
    for (unsigned i = 0; i < sizeof links / sizeof links[0]; i++) {
        snprintf(p, sizeof p, "%s/%s", G.dev_dir, links[i][1]);
        if (symlink(links[i][0], p) < 0 && errno != EEXIST) die(p);
    }
    snprintf(p, sizeof p, "%s/pts", G.dev_dir);
    if (mkdir(p, 0755) < 0 && errno != EEXIST) die(p);
    snprintf(p, sizeof p, "%s/shm", G.dev_dir);
    if (mkdir(p, 0755) < 0 && errno != EEXIST) die(p);
}

/* Returns 0, or -1 after printing why (everything it made is undone). */

/* ---- --veth: a networked sandbox's link and firewall elements, as corral makes them ------
 * (rust/src/netlink.rs, nftset.rs; daemon/network/firewall.py attach/detach): a veth pair
 * over rtnetlink, the host end <prefix><slot> with the gateway /32 and a /32 route to the
 * sandbox, eth0 moved into the sandbox's netns with its /32 and a default route via the
 * gateway (this process enters the netns for that half); then one nf_tables batch adding
 * the sandbox's elements to the caller's table (src4, shard -> jump p<slot % 256>, and
 * internet with --veth-internet). Destroy: one batch destroying them (src4, internet, denied,
 * conns, shard), then the kill; the kernel removes the veth with the netns. With
 * --veth-net6, IPv6 too, as corral's netlink.rs: the IPv6 sysctls of both ends (no DAD, RA,
 * solicitations; no link-local address of the host end's own), the link-local gateway
 * fe80::c0:0:<slot> (no prefix route) on the host end and a /128 route to the sandbox,
 * eth0's /128 and a default route via the gateway, and the src6 element. */
#include <arpa/inet.h>
#include <linux/if_link.h>
#include <linux/netfilter/nf_tables.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <linux/veth.h>

static int g_hostnet = -1;

struct nlb {
    char b[2048];
    int len, nest[8], nn;
};

static void nl_put(struct nlb *m, const void *d, int n) {
    memcpy(m->b + m->len, d, n);
    m->len += n;
    while (m->len & 3) m->b[m->len++] = 0;
}

static void nl_attr(struct nlb *m, uint16_t ty, const void *d, int n) {
    struct nlattr a = {.nla_len = (uint16_t)(NLA_HDRLEN + n), .nla_type = ty};
    memcpy(m->b + m->len, &a, sizeof a);
    m->len += NLA_HDRLEN;
    nl_put(m, d, n);
}

static void nl_begin(struct nlb *m, uint16_t ty) {
    m->nest[m->nn++] = m->len;
    struct nlattr a = {.nla_len = 0, .nla_type = ty | NLA_F_NESTED};
    memcpy(m->b + m->len, &a, sizeof a);
    m->len += NLA_HDRLEN;
}

static void nl_end(struct nlb *m) {
    int at = m->nest[--m->nn];
    ((struct nlattr *)(m->b + at))->nla_len = (uint16_t)(m->len - at);
}

static int nl_msg(struct nlb *m, uint16_t ty, uint16_t flags, uint32_t seq, const void *fixed,
                  int n) {
    int at = m->len;
    struct nlmsghdr h = {.nlmsg_type = ty, .nlmsg_flags = flags, .nlmsg_seq = seq};
    memcpy(m->b + at, &h, sizeof h);
    m->len += NLMSG_HDRLEN;
    nl_put(m, fixed, n);
    return at;
}

static void nl_close(struct nlb *m, int at) {
    ((struct nlmsghdr *)(m->b + at))->nlmsg_len = (uint32_t)(m->len - at);
}

/* This process's nf_tables socket, kept open as corral's (rust/src/nftset.rs): the close
 * of one waits out earlier transactions' release. Put back after a clean exchange only. */
static int g_nfsock = -1;
static pid_t g_nfsock_pid;

/* Send m on a socket of `proto` (in this process's netns: a fresh one, or the kept one for
 * nf_tables) and read `acks` acks; 0, or -errno of the first error. */
static int nl_talk(int proto, struct nlb *m, int acks) {
    int keep = proto == NETLINK_NETFILTER;
    int fd = keep && g_nfsock >= 0 && g_nfsock_pid == getpid() ? g_nfsock : -1;
    if (keep) g_nfsock = -1;
    if (fd < 0) fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, proto);
    if (fd < 0) return -errno;
    int rc = 0;
    if (send(fd, m->b, m->len, 0) < 0) rc = -errno;
    char buf[8192];
    while (!rc && acks > 0) {
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            rc = -errno;
            break;
        }
        for (struct nlmsghdr *h = (void *)buf; NLMSG_OK(h, n); h = NLMSG_NEXT(h, n)) {
            if (h->nlmsg_type != NLMSG_ERROR) continue;
            acks--;
            int code = ((struct nlmsgerr *)NLMSG_DATA(h))->error;
            if (code) {
                rc = code;
                break;
            }
        }
    }
    if (keep && !rc) g_nfsock = fd, g_nfsock_pid = getpid();
    else close(fd);
    return rc;
}

static int rt_call(struct nlb *m) { return nl_talk(NETLINK_ROUTE, m, 1); }

#define RQ (NLM_F_REQUEST | NLM_F_ACK)
#define CX (NLM_F_CREATE | NLM_F_EXCL)

static int rt_addr(int idx, uint32_t a) {
    struct nlb m = {.len = 0};
    struct ifaddrmsg f = {.ifa_family = AF_INET, .ifa_prefixlen = 32,
                          .ifa_scope = RT_SCOPE_UNIVERSE, .ifa_index = (unsigned)idx};
    int at = nl_msg(&m, RTM_NEWADDR, RQ | CX, 1, &f, sizeof f);
    nl_attr(&m, IFA_LOCAL, &a, 4);
    nl_attr(&m, IFA_ADDRESS, &a, 4);
    nl_close(&m, at);
    return rt_call(&m);
}

static int rt_up(int idx) {
    struct nlb m = {.len = 0};
    struct ifinfomsg f = {.ifi_family = AF_UNSPEC, .ifi_index = idx, .ifi_flags = IFF_UP,
                          .ifi_change = IFF_UP};
    int at = nl_msg(&m, RTM_NEWLINK, RQ, 1, &f, sizeof f);
    nl_close(&m, at);
    return rt_call(&m);
}

/* dst/32 on the link (dst != 0), or the default route via gw. */
static int rt_route(uint32_t dst, uint32_t gw, int idx) {
    struct nlb m = {.len = 0};
    struct rtmsg f = {.rtm_family = AF_INET, .rtm_dst_len = dst ? 32 : 0,
                      .rtm_table = RT_TABLE_MAIN, .rtm_protocol = RTPROT_STATIC,
                      .rtm_scope = dst ? RT_SCOPE_LINK : RT_SCOPE_UNIVERSE,
                      .rtm_type = RTN_UNICAST};
    int at = nl_msg(&m, RTM_NEWROUTE, RQ | CX, 1, &f, sizeof f);
    if (dst) nl_attr(&m, RTA_DST, &dst, 4);
    if (gw) nl_attr(&m, RTA_GATEWAY, &gw, 4);
    uint32_t oif = (uint32_t)idx;
    nl_attr(&m, RTA_OIF, &oif, 4);
    nl_close(&m, at);
    return rt_call(&m);
}

/* IPv6: `a`/`plen` on link idx (a link-local one: scope link, no prefix route), no DAD. */
static int rt_addr6(int idx, const struct in6_addr *a, int plen, int link_local) {
    struct nlb m = {.len = 0};
    struct ifaddrmsg f = {.ifa_family = AF_INET6, .ifa_prefixlen = (unsigned char)plen,
                          .ifa_scope = link_local ? RT_SCOPE_LINK : RT_SCOPE_UNIVERSE,
                          .ifa_index = (unsigned)idx};
    int at = nl_msg(&m, RTM_NEWADDR, RQ | CX, 1, &f, sizeof f);
    nl_attr(&m, IFA_LOCAL, a, 16);
    nl_attr(&m, IFA_ADDRESS, a, 16);
    uint32_t fl = IFA_F_NODAD | (link_local ? IFA_F_NOPREFIXROUTE : 0);
    if (link_local) nl_attr(&m, IFA_FLAGS, &fl, 4);
    nl_close(&m, at);
    return rt_call(&m);
}

/* IPv6: dst/128 on the link (dst), or the default route via gw. */
static int rt_route6(const struct in6_addr *dst, const struct in6_addr *gw, int idx) {
    struct nlb m = {.len = 0};
    struct rtmsg f = {.rtm_family = AF_INET6, .rtm_dst_len = dst ? 128 : 0,
                      .rtm_table = RT_TABLE_MAIN, .rtm_protocol = RTPROT_STATIC,
                      .rtm_scope = RT_SCOPE_UNIVERSE, .rtm_type = RTN_UNICAST};
    int at = nl_msg(&m, RTM_NEWROUTE, RQ | CX, 1, &f, sizeof f);
    if (dst) nl_attr(&m, RTA_DST, dst, 16);
    if (gw) nl_attr(&m, RTA_GATEWAY, gw, 16);
    uint32_t oif = (uint32_t)idx;
    nl_attr(&m, RTA_OIF, &oif, 4);
    nl_close(&m, at);
    return rt_call(&m);
}

/* The IPv6 sysctls corral writes on interface `name` of this thread's netns: off, or on
 * without DAD, RA and solicitations, and with a link-local address only if link_local. */
static void ipv6_conf(const char *name, int on, int link_local) {
    char p[128];
    snprintf(p, sizeof p, "/proc/sys/net/ipv6/conf/%s", name);
    int dir = open(p, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0) return; /* no IPv6 here */
    static const char *const off[] = {"disable_ipv6=1", NULL};
    static const char *const on_ll[] = {"accept_dad=0", "dad_transmits=0", "accept_ra=0",
                                        "autoconf=0", "router_solicitations=0",
                                        "disable_ipv6=0", NULL};
    const char *const *keys = on ? on_ll : off;
    if (on && !link_local) { /* IN6_ADDR_GEN_MODE_NONE: no link-local of its own */
        int fd = openat(dir, "addr_gen_mode", O_WRONLY | O_CLOEXEC);
        if (fd >= 0 && write(fd, "1", 1) < 0) { /* a key this kernel lacks: skipped */ }
        if (fd >= 0) close(fd);
    }
    for (; *keys; keys++) {
        char k[32];
        const char *eq = strchr(*keys, '=');
        snprintf(k, sizeof k, "%.*s", (int)(eq - *keys), *keys);
        int fd = openat(dir, k, O_WRONLY | O_CLOEXEC);
        if (fd < 0) continue;
        if (write(fd, eq + 1, 1) < 0) { /* as corral: a key this kernel lacks is skipped */ }
        close(fd);
    }
    close(dir);
}

/* Slot idx's IPv6 addresses: the sandbox's (net6 + 2 + idx) and its gateway's, the host
 * end's link-local fe80::c0:0:<slot>. */
static void veth_names6(const struct sb *s, struct in6_addr *a6, struct in6_addr *gw6) {
    *a6 = G.veth_net6;
    uint32_t low;
    memcpy(&low, a6->s6_addr + 12, 4);
    low = htonl(ntohl(low) + 2 + (uint32_t)s->idx);
    memcpy(a6->s6_addr + 12, &low, 4);
    memset(gw6, 0, sizeof *gw6);
    gw6->s6_addr[0] = 0xfe, gw6->s6_addr[1] = 0x80, gw6->s6_addr[11] = 0xc0;
    uint32_t slot = htonl((uint32_t)s->idx + 2);
    memcpy(gw6->s6_addr + 12, &slot, 4);
}

static void veth_names(const struct sb *s, char *ifname, uint32_t *addr, uint32_t *gw) {
    snprintf(ifname, IFNAMSIZ, "%.6s%u", G.veth, (unsigned)(s->idx + 2) % 100000u);
    *gw = htonl(G.veth_net + 1);
    *addr = htonl(G.veth_net + 2 + (uint32_t)s->idx);
}

#define VK(expr)                          \
    do {                                  \
        int rc_ = (expr);                 \
        if (rc_ < 0) {                    \
            errno = -rc_;                 \
            step = #expr;                 \
            goto out;                     \
        }                                 \
    } while (0)

static int veth_setup(const struct sb *s) {
    char host[IFNAMSIZ], p[128];
    uint32_t addr, gw;
    const char *step = "open netns";
    veth_names(s, host, &addr, &gw);
    snprintf(p, sizeof p, "/proc/%d/ns/net", s->pid);
    int ns = open(p, O_RDONLY | O_CLOEXEC), in_ns = 0;
    if (ns < 0) goto out;
    {
        struct nlb m = {.len = 0};
        struct ifinfomsg f = {.ifi_family = AF_UNSPEC};
        int at = nl_msg(&m, RTM_NEWLINK, RQ | CX, 1, &f, sizeof f);
        nl_attr(&m, IFLA_IFNAME, host, strlen(host) + 1);
        nl_begin(&m, IFLA_LINKINFO);
        nl_attr(&m, IFLA_INFO_KIND, "veth", 4);
        nl_begin(&m, IFLA_INFO_DATA);
        nl_begin(&m, VETH_INFO_PEER);
        nl_put(&m, &f, sizeof f);
        nl_attr(&m, IFLA_IFNAME, "eth0", 5);
        uint32_t fd = (uint32_t)ns;
        nl_attr(&m, IFLA_NET_NS_FD, &fd, 4);
        nl_end(&m);
        nl_end(&m);
        nl_end(&m);
        nl_close(&m, at);
        VK(rt_call(&m));
    }
    int hidx = (int)if_nametoindex(host);
    step = "if_nametoindex";
    if (!hidx) goto out;
    struct in6_addr a6, gw6;
    veth_names6(s, &a6, &gw6);
    ipv6_conf(host, G.veth_v6, 0);
    VK(rt_addr(hidx, gw));
    if (G.veth_v6) VK(rt_addr6(hidx, &gw6, 64, 1));
    VK(rt_up(hidx));
    VK(rt_route(addr, 0, hidx));
    if (G.veth_v6) VK(rt_route6(&a6, NULL, hidx));
    step = "setns";
    if (setns(ns, CLONE_NEWNET) < 0) goto out;
    in_ns = 1;
    int gidx = (int)if_nametoindex("eth0");
    step = "if_nametoindex eth0";
    if (!gidx) goto out;
    ipv6_conf("eth0", G.veth_v6, 1);
    VK(rt_addr(gidx, addr));
    if (G.veth_v6) VK(rt_addr6(gidx, &a6, 128, 0));
    VK(rt_up(gidx));
    VK(rt_route(gw, 0, gidx));
    VK(rt_route(0, gw, gidx));
    if (G.veth_v6) VK(rt_route6(NULL, &gw6, gidx));
    if (setns(g_hostnet, CLONE_NEWNET) < 0) die("setns back to the host netns");
    close(ns);
    return 0;
out:
    fprintf(stderr, "raw: veth %s: %s: %s\n", host, step, strerror(errno));
    if (in_ns && setns(g_hostnet, CLONE_NEWNET) < 0) die("setns back to the host netns");
    if (ns >= 0) close(ns);
    return -1;
}

/* One nf_tables batch of element lists on G.veth_table (inet): add (NEWSETELEM) or destroy
 * (DESTROYSETELEM) this sandbox's elements. */
static int nft_elems(const struct sb *s, int add) {
    char host[IFNAMSIZ], key[IFNAMSIZ + 16], key6[IFNAMSIZ + 16], chain[8];
    uint32_t addr, gw;
    struct in6_addr a6, gw6;
    veth_names(s, host, &addr, &gw);
    veth_names6(s, &a6, &gw6);
    memset(key, 0, sizeof key);
    memcpy(key, host, strlen(host));
    memcpy(key6, key, sizeof key6);
    memcpy(key + IFNAMSIZ, &addr, 4);
    memcpy(key6 + IFNAMSIZ, &a6, 16);
    snprintf(chain, sizeof chain, "p%ld", (s->idx + 2) % 256);
    const char *sets[6];
    int ns = 0;
    sets[ns++] = "src4";
    if (G.veth_v6) sets[ns++] = "src6";
    sets[ns++] = "shard";
    if (!add || G.veth_internet) sets[ns++] = "internet";
    if (!add) sets[ns++] = "denied", sets[ns++] = "conns";
    struct nlb m = {.len = 0};
    struct nfgenmsg g0 = {.nfgen_family = AF_UNSPEC, .version = NFNETLINK_V0,
                          .res_id = htons(NFNL_SUBSYS_NFTABLES)};
    int at = nl_msg(&m, NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, 1, &g0, sizeof g0);
    nl_close(&m, at);
    uint16_t ty = (NFNL_SUBSYS_NFTABLES << 8) | (add ? NFT_MSG_NEWSETELEM : 30 /* DESTROY */);
    struct nfgenmsg g = {.nfgen_family = 1 /* NFPROTO_INET */, .version = NFNETLINK_V0};
    for (int i = 0; i < ns; i++) {
        at = nl_msg(&m, ty, RQ | (add ? NLM_F_CREATE : 0), 2 + i, &g, sizeof g);
        nl_attr(&m, NFTA_SET_ELEM_LIST_TABLE, G.veth_table, strlen(G.veth_table) + 1);
        nl_attr(&m, NFTA_SET_ELEM_LIST_SET, sets[i], strlen(sets[i]) + 1);
        nl_begin(&m, NFTA_SET_ELEM_LIST_ELEMENTS);
        nl_begin(&m, NFTA_LIST_ELEM);
        nl_begin(&m, NFTA_SET_ELEM_KEY);
        if (!strcmp(sets[i], "src6")) nl_attr(&m, NFTA_DATA_VALUE, key6, IFNAMSIZ + 16);
        else nl_attr(&m, NFTA_DATA_VALUE, key, strcmp(sets[i], "src4") ? IFNAMSIZ : IFNAMSIZ + 4);
        nl_end(&m);
        if (add && !strcmp(sets[i], "shard")) {
            nl_begin(&m, NFTA_SET_ELEM_DATA);
            nl_begin(&m, NFTA_DATA_VERDICT);
            uint32_t code = htonl((uint32_t)NFT_JUMP);
            nl_attr(&m, NFTA_VERDICT_CODE, &code, 4);
            nl_attr(&m, NFTA_VERDICT_CHAIN, chain, strlen(chain) + 1);
            nl_end(&m);
            nl_end(&m);
        }
        nl_end(&m);
        nl_end(&m);
        nl_close(&m, at);
    }
    at = nl_msg(&m, NFNL_MSG_BATCH_END, NLM_F_REQUEST, 2 + ns, &g0, sizeof g0);
    nl_close(&m, at);
    int rc = nl_talk(NETLINK_NETFILTER, &m, ns);
    if (rc < 0) fprintf(stderr, "raw: nft %s %s: %s\n", add ? "add" : "destroy", host,
                        strerror(-rc));
    return rc;
}

static void sb_destroy(struct sb *s);

static int sb_create(struct sb *s, int worker, long idx) {
    struct spawn_ctx c;
    memset(&c, 0, sizeof c);
    char p[512];
    s->pid = -1, s->pidfd = -1, s->rootfd = -1, s->idx = idx;
    snprintf(s->dir, sizeof s->dir, "%s/raw-%d-%ld", G.state, worker, idx);
    snprintf(c.hostname, sizeof c.hostname, "raw-%d-%ld", worker, idx);
    snprintf(c.root, sizeof c.root, "%s/root", s->dir);
    int made_cg = 0;
    if (mkdir(s->dir, 0700) < 0) goto fail;
    if (mkdir(c.root, 0755) < 0) goto fail;
    char layer[300];
    snprintf(layer, sizeof layer, "%s", s->dir);
    if (G.subvol_mb) {
        if (subvol_create(s->dir, "disk", (uint64_t)G.subvol_mb << 20) < 0) goto fail;
        snprintf(layer, sizeof layer, "%s/disk", s->dir);
    }
    snprintf(p, sizeof p, "%s/upper", layer);
    if (mkdir(p, 0700) < 0) goto fail;
    snprintf(p, sizeof p, "%s/work", layer);
    if (mkdir(p, 0700) < 0) goto fail;
    snprintf(c.shm, sizeof c.shm, "%s/shm", layer);
    if (mkdir(c.shm, 01777) < 0 || chmod(c.shm, 01777) < 0) goto fail;
    for (int i = 0; i < G.nov; i++) {
        char up[400], wk[400];
        snprintf(up, sizeof up, "%s/upper/%d", layer, i);
        snprintf(wk, sizeof wk, "%s/work/%d", layer, i);
        if (mkdir(up, 0755) < 0 || mkdir(wk, 0700) < 0) goto fail;
        snprintf(c.opts[i], sizeof c.opts[i], "lowerdir=%s,upperdir=%s,workdir=%s",
                 G.ov_lower[i], up, wk);
    }
    int eager = !G.lazy || spare_ready();
    s->lazy_pending = !eager;
    for (int i = 0; i < G.ncg; i++) {
        if (G.cg[i].lazy && !eager) continue;
        if (cg_make(s, i) < 0) goto fail;
        made_cg = i + 1;
    }
    made_cg = G.ncg;
    if (open_cgprocs(s, c.cgfds, eager) < 0) goto fail;
    int flags = CLONE_VM | CLONE_VFORK | CLONE_PIDFD | CLONE_NEWNS | CLONE_NEWPID |
                CLONE_NEWUTS | CLONE_NEWIPC | SIGCHLD;
    if (G.netns) flags |= CLONE_NEWNET;
    int pidfd = -1;
    pid_t pid = clone(spawn_child, g_stack + STACK_SZ, flags, &c, &pidfd);
    close_cgprocs(c.cgfds);
    if (pid < 0) goto fail;
    s->pid = pid, s->pidfd = pidfd;
    if (c.err) {
        waitpid(pid, NULL, 0);
        close(pidfd);
        s->pid = -1, s->pidfd = -1;
        errno = c.err;
        fprintf(stderr, "raw: create: %s: %s\n", SPAWN_STEPS[c.step], strerror(c.err));
        goto undo;
    }
    if (G.veth && (veth_setup(s) < 0 || nft_elems(s, 1) < 0)) {
        sb_destroy(s);
        return -1;
    }
    return 0;
fail:
    fprintf(stderr, "raw: create %s: %s\n", s->dir, strerror(errno));
undo:
    for (int i = 0; i < made_cg; i++) {
        cg_path(p, sizeof p, i, s, NULL);
        rmdir(p);
    }
    if (G.subvol_mb) subvol_destroy(s->dir, "disk");
    rm_tree(s->dir);
    return -1;
}

static void sb_destroy(struct sb *s) {
    if (G.veth && s->pid > 0) nft_elems(s, 0);
    if (s->rootfd >= 0) close(s->rootfd);
    if (s->pidfd >= 0) {
        syscall(SYS_pidfd_send_signal, s->pidfd, SIGKILL, NULL, 0);
        siginfo_t si;
        waitid(P_PIDFD, s->pidfd, &si, WEXITED);
        close(s->pidfd);
    } else if (s->pid > 0) {
        kill(s->pid, SIGKILL);
        waitpid(s->pid, NULL, 0);
    }
    if (G.subvol_mb) subvol_destroy(s->dir, "disk"); /* as corral: the subvolume first */
    rm_tree(s->dir); /* first, as corral: files on a tmpfs are charged to the memcg */
    cg_remove(s);
    s->pid = -1, s->pidfd = -1, s->rootfd = -1;
}

/* ---- exec in a live sandbox ------------------------------------------------------------- */
struct enter_ctx {
    const struct sb *s;
    int cgfds[MAX_CG];
    int out, err;
    volatile int step, errno_;
};

static char *const ENVP[] = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                             "HOME=/root", "LANG=C.UTF-8", "TERM=xterm", "HOSTNAME=raw", NULL};
static const char *const CANDIDATES[] = {"/usr/local/sbin/true", "/usr/local/bin/true",
                                         "/usr/sbin/true", "/usr/bin/true", "/sbin/true",
                                         "/bin/true"};

#undef CK
#define CK(st, expr)                       \
    do {                                   \
        if ((long)(expr) < 0) {            \
            c->step = (st);                \
            c->errno_ = errno;             \
            _exit(126);                    \
        }                                  \
    } while (0)

static int enter_child(void *arg) {
    struct enter_ctx *c = arg;
    for (int i = 0; i < G.ncg; i++)
        if (c->cgfds[i] >= 0) CK(1, write(c->cgfds[i], "0", 1));
    CK(2, setns(c->s->pidfd, CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET |
                                 CLONE_NEWCGROUP));
    CK(3, fchdir(c->s->rootfd));
    CK(3, chroot("."));
    CK(3, chdir("/"));
    CK(4, setsid());
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    CK(5, null);
    CK(5, dup2(null, 0));
    CK(5, dup2(c->out, 1));
    CK(5, dup2(c->err, 2));
    CK(6, syscall(SYS_close_range, 3, ~0U, 0));
    if (G.harden) CK(7, harden(SHELL_CAPS, 1));
    umask(022);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    char *argv[] = {"true", NULL};
    c->step = 8;
    for (unsigned i = 0; i < sizeof CANDIDATES / sizeof CANDIDATES[0]; i++)
        execve(CANDIDATES[i], argv, ENVP);
    _exit(127);
}

static int g_hostns = -1;

/* ---- the lazy cgroups, made at the first exec (as corral's ensure_later) ------------------ */
struct view_ctx {
    const struct sb *s;
    int fds[MAX_CG];
    volatile int step, errno_;
};

/* Mounts the new cgroups at /sys/fs/cgroup/<name> in the sandbox, as corral's
 * mount_cgroups_in: joins them, a cgroup namespace rooted there, the sandbox's mount ns. */
static int view_child(void *arg) {
    struct view_ctx *c = arg;
    const unsigned long nse = MS_NOSUID | MS_NODEV | MS_NOEXEC;
    for (int i = 0; i < G.ncg; i++)
        if (c->fds[i] >= 0) CK(1, write(c->fds[i], "0", 1));
    CK(2, unshare(CLONE_NEWCGROUP));
    CK(3, setns(c->s->pidfd, CLONE_NEWNS));
    for (int i = 0; i < G.ncg; i++) {
        if (c->fds[i] < 0 || !G.cg[i].view[0]) continue;
        char t[128];
        snprintf(t, sizeof t, "/sys/fs/cgroup/%s", G.cg[i].view_name);
        CK(4, mount("cgroup", t, "cgroup", MS_RDONLY | nse, G.cg[i].view));
    }
    _exit(0);
}

static int lazy_make(struct sb *s) {
    char p[512], pid[16];
    snprintf(pid, sizeof pid, "%d", s->pid);
    struct view_ctx v;
    memset(&v, 0, sizeof v);
    v.s = s;
    for (int i = 0; i < G.ncg; i++) {
        v.fds[i] = -1;
        if (!G.cg[i].lazy) continue;
        if (cg_make(s, i) < 0) return -1;
        cg_path(p, sizeof p, i, s, "cgroup.procs"); /* the init, by pid */
        if (write_file(p, pid) < 0) return -1;
        cg_path(p, sizeof p, i, s, G.join_file);
        v.fds[i] = open(p, O_WRONLY | O_CLOEXEC);
        if (v.fds[i] < 0) return -1;
    }
    s->lazy_pending = 0;
    int rc = 0;
    if (G.sys_dir[0]) {
        pid_t h = clone(view_child, g_stack + STACK_SZ, CLONE_VM | CLONE_VFORK | SIGCHLD, &v);
        int st = 0;
        if (h < 0 || waitpid(h, &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st)) {
            fprintf(stderr, "raw: cgroup view step %d: %s\n", v.step, strerror(v.errno_));
            rc = -1;
        }
    }
    close_cgprocs(v.fds);
    return rc;
}

/* Returns the exit status of `true` (0), or -1. */
static int sb_exec_true(struct sb *s) {
    if (s->rootfd < 0) {
        char p[64];
        snprintf(p, sizeof p, "/proc/%d/root", s->pid);
        s->rootfd = open(p, O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (s->rootfd < 0) return -1;
    }
    if (s->lazy_pending && lazy_make(s) < 0) return -1;
    struct enter_ctx c;
    memset(&c, 0, sizeof c);
    c.s = s;
    int po[2], pe[2];
    if (open_cgprocs(s, c.cgfds, 1) < 0) return -1;
    if (pipe2(po, O_CLOEXEC) < 0 || pipe2(pe, O_CLOEXEC) < 0) return -1;
    c.out = po[1], c.err = pe[1];
    if (setns(s->pidfd, CLONE_NEWPID) < 0) die("setns pid_for_children");
    pid_t pid = clone(enter_child, g_stack + STACK_SZ, CLONE_VM | CLONE_VFORK | SIGCHLD, &c);
    if (setns(g_hostns, CLONE_NEWPID) < 0) die("restore pid_for_children");
    close_cgprocs(c.cgfds);
    close(po[1]);
    close(pe[1]);
    int status = -1;
    if (pid > 0) {
        char buf[4096];
        while (read(po[0], buf, sizeof buf) > 0) {
        }
        while (read(pe[0], buf, sizeof buf) > 0) {
        }
        waitpid(pid, &status, 0);
    }
    close(po[0]);
    close(pe[0]);
    if (c.errno_) fprintf(stderr, "raw: exec step %d: %s\n", c.step, strerror(c.errno_));
    return pid > 0 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* ---- modes ------------------------------------------------------------------------------- */
static void print_arr(const char *name, const double *a, long n, int last) {
    printf("\"%s\":[", name);
    for (long i = 0; i < n; i++) printf(i ? ",%.1f" : "%.1f", a[i]);
    printf("]%s", last ? "" : ",");
}

struct shared {
    volatile int errors;
    double wall_us;
};

static void *shmem(size_t n) {
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) die("mmap");
    return p;
}

/* Fork G.conc workers running fn(worker, lo, hi); release them together; wait; wall time. */
typedef void (*work_fn)(int worker, long i0, long step, void *arg);

static double run_workers(work_fn fn, void *arg) {
    int go[2];
    if (pipe(go) < 0) die("pipe");
    pid_t kids[64];
    for (int w = 0; w < G.conc; w++) {
        kids[w] = fork();
        if (kids[w] < 0) die("fork");
        if (kids[w] == 0) {
            close(go[1]);
            char b;
            if (read(go[0], &b, 1) < 0) _exit(3);
            fn(w, w, G.conc, arg);
            fflush(stderr);
            _exit(0);
        }
    }
    close(go[0]);
    double t0 = now_us();
    close(go[1]);
    int bad = 0;
    for (int w = 0; w < G.conc; w++) {
        int st;
        waitpid(kids[w], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st)) bad = 1;
    }
    double wall = now_us() - t0;
    if (bad) fprintf(stderr, "raw: a worker failed\n");
    return wall;
}

struct churn_arg {
    struct shared *sh;
    double *create, *exec, *destroy;
};

static void churn_work(int worker, long i0, long step, void *arg) {
    struct churn_arg *a = arg;
    for (long i = i0; i < G.n; i += step) {
        struct sb s;
        double t0 = now_us();
        if (sb_create(&s, worker, i) < 0) {
            a->create[i] = a->exec[i] = a->destroy[i] = -1;
            if (__sync_add_and_fetch(&a->sh->errors, 1) > MAX_ERRORS) _exit(4);
            continue;
        }
        double t1 = now_us();
        int rc = sb_exec_true(&s);
        double t2 = now_us();
        sb_destroy(&s);
        double t3 = now_us();
        if (rc != 0) __sync_add_and_fetch(&a->sh->errors, 1);
        a->create[i] = t1 - t0, a->exec[i] = t2 - t1, a->destroy[i] = t3 - t2;
    }
    spares_drop();
}

static void mode_churn(void) {
    struct churn_arg a;
    a.sh = shmem(sizeof *a.sh);
    a.create = shmem(G.n * sizeof(double));
    a.exec = shmem(G.n * sizeof(double));
    a.destroy = shmem(G.n * sizeof(double));
    double wall = run_workers(churn_work, &a);
    printf("{\"mode\":\"churn\",\"n\":%ld,\"conc\":%d,\"netns\":%s,\"harden\":%s,"
           "\"errors\":%d,\"wall_s\":%.6f,\"ops_per_s\":%.2f,",
           G.n, G.conc, G.netns ? "true" : "false", G.harden ? "true" : "false", a.sh->errors,
           wall / 1e6, G.n / (wall / 1e6));
    print_arr("create_us", a.create, G.n, 0);
    print_arr("exec_us", a.exec, G.n, 0);
    print_arr("destroy_us", a.destroy, G.n, 1);
    printf("}\n");
}

struct exec_arg {
    struct shared *sh;
    struct sb *s;
    double *lat;
};

static void exec_work(int worker, long i0, long step, void *arg) {
    (void)worker;
    struct exec_arg *a = arg;
    struct sb s = *a->s;
    s.rootfd = -1; /* opened per worker, like corral opens it once per sandbox */
    for (long i = i0; i < G.n; i += step) {
        double t0 = now_us();
        int rc = sb_exec_true(&s);
        a->lat[i] = now_us() - t0;
        if (rc != 0 && __sync_add_and_fetch(&a->sh->errors, 1) > MAX_ERRORS) _exit(4);
    }
}

static void mode_exec(void) {
    struct exec_arg a;
    struct sb s;
    a.sh = shmem(sizeof *a.sh);
    a.lat = shmem(G.n * sizeof(double));
    if (sb_create(&s, 0, 0) < 0) exit(2);
    /* its first-exec cgroups made once, before the workers share it (each has a copy) */
    if (s.lazy_pending && lazy_make(&s) < 0) exit(2);
    a.s = &s;
    double wall = run_workers(exec_work, &a);
    sb_destroy(&s);
    printf("{\"mode\":\"exec\",\"n\":%ld,\"conc\":%d,\"errors\":%d,\"wall_s\":%.6f,"
           "\"ops_per_s\":%.2f,",
           G.n, G.conc, a.sh->errors, wall / 1e6, G.n / (wall / 1e6));
    print_arr("exec_us", a.lat, G.n, 1);
    printf("}\n");
}

/* Keep N alive: the idle floor (memory) and the create rate against the live count. */
static void mode_idle(void) {
    struct sb *all = calloc(G.n, sizeof *all);
    double *lat = calloc(G.n, sizeof *lat);
    if (!all || !lat) die("calloc");
    long made = 0;
    int errors = 0;
    double t0 = now_us();
    for (long i = 0; i < G.n; i++) {
        double t = now_us();
        if (sb_create(&all[made], 0, i) < 0) {
            if (++errors > MAX_ERRORS) break;
            continue;
        }
        lat[made] = now_us() - t;
        /* Hold no fd per sandbox (the fd limit here may be far below N): destroy by pid. */
        close(all[made].pidfd);
        all[made++].pidfd = -1;
    }
    double wall = now_us() - t0;
    printf("{\"mode\":\"idle\",\"n\":%ld,\"made\":%ld,\"netns\":%s,\"errors\":%d,"
           "\"wall_s\":%.6f,\"pids\":[",
           G.n, made, G.netns ? "true" : "false", errors, wall / 1e6);
    for (long i = 0; i < made && i < 64; i++) printf(i ? ",%d" : "%d", all[i].pid);
    printf("],");
    print_arr("create_us", lat, made, 1);
    printf("}\n");
    fflush(stdout);
    /* The caller measures memory now; a line or EOF on stdin means: destroy them all. */
    char buf[64];
    while (read(0, buf, sizeof buf) < 0 && errno == EINTR) {
    }
    double t1 = now_us();
    for (long i = 0; i < made; i++) sb_destroy(&all[i]);
    printf("{\"destroyed\":%ld,\"destroy_s\":%.6f}\n", made, (now_us() - t1) / 1e6);
}

static void usage(void) {
    fprintf(stderr, "usage: raw churn|exec|idle N [--conc C] [--netns|--disabled] [--veth PREFIX --veth-table T --veth-net A.B.C.D [--veth-net6 X::] [--veth-internet]] [--no-harden] [--tmpfs] [--memcg-spares K] [--cgroup-spares K] "
                    "[--cg CTL,CTL] [--lazy CTL,CTL] [--subvol MB] [--sys DIR] [--proc-bind SRC=NAME] "
                    "--state DIR --cgroup NAME --init BIN "
                    "--ov TARGET=LOWER[:LOWER] ...\n");
    exit(2);
}

static void scratch_umount(void) {
    if (getpid() == G.main_pid) umount2(G.state, 0);
}

int main(int argc, char **argv) {
    if (argc < 3) usage();
    G.mode = argv[1];
    G.n = atol(argv[2]);
    G.conc = 1;
    G.harden = 1;
    for (int i = 3; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--netns")) G.netns = 1;
        else if (!strcmp(a, "--tmpfs")) G.tmpfs = 1;
        else if (!strcmp(a, "--disabled")) G.disabled = 1;
        else if (!strcmp(a, "--no-harden")) G.harden = 0;
        else if (!strcmp(a, "--veth-internet")) G.veth_internet = 1;
        else if (!v) usage();
        else if (!strcmp(a, "--conc")) G.conc = atoi(v), i++;
        else if (!strcmp(a, "--veth")) G.veth = v, G.netns = 1, i++;
        else if (!strcmp(a, "--veth-table")) G.veth_table = v, i++;
        else if (!strcmp(a, "--veth-net")) {
            struct in_addr in;
            if (inet_pton(AF_INET, v, &in) != 1) usage();
            G.veth_net = ntohl(in.s_addr);
            i++;
        }
        else if (!strcmp(a, "--veth-net6")) {
            if (inet_pton(AF_INET6, v, &G.veth_net6) != 1) usage();
            G.veth_v6 = 1;
            i++;
        }
        else if (!strcmp(a, "--state")) G.state = v, i++;
        else if (!strcmp(a, "--cgroup")) G.cgname = v, i++;
        else if (!strcmp(a, "--init")) G.init_path = v, i++;
        else if (!strcmp(a, "--cg")) G.controllers = v, i++;
        else if (!strcmp(a, "--memcg-spares")) G.spares = atoi(v), i++;
        else if (!strcmp(a, "--cgroup-spares")) G.set_spares = atoi(v), i++;
        else if (!strcmp(a, "--lazy")) G.lazy = v, i++;
        else if (!strcmp(a, "--subvol")) G.subvol_mb = atoi(v), i++;
        else if (!strcmp(a, "--sys")) snprintf(G.sys_dir, sizeof G.sys_dir, "%s", v), i++;
        else if (!strcmp(a, "--proc-ro") || !strcmp(a, "--proc-mask-file") ||
                 !strcmp(a, "--proc-mask-dir")) {
            int *n = a[7] == 'r' ? &G.npro : a[12] == 'f' ? &G.npmf : &G.npmd;
            const char **l = a[7] == 'r' ? G.pro : a[12] == 'f' ? G.pmf : G.pmd;
            if (!v || *n == MAX_PROC) usage();
            char *d = malloc(strlen(v) + 6);
            if (!d) die("malloc");
            sprintf(d, "proc/%s", v);
            l[(*n)++] = d;
            i++;
        }
        else if (!strcmp(a, "--detach")) {
            if (!v || G.ndetach == MAX_PROC) usage();
            G.detach[G.ndetach++] = v;
            i++;
        }
        else if (!strcmp(a, "--proc-bind")) {
            char *eq = strchr(argv[i + 1], '=');
            if (!eq || G.nbind == MAX_BINDS) usage();
            *eq = 0;
            G.bind_src[G.nbind] = argv[i + 1];
            static char dst[MAX_BINDS][128];
            snprintf(dst[G.nbind], sizeof dst[0], "proc/%s", eq + 1);
            G.bind_dst[G.nbind] = dst[G.nbind];
            G.nbind++;
            i++;
        }
        else if (!strcmp(a, "--ov")) {
            char *eq = strchr(argv[i + 1], '=');
            if (!eq || G.nov == MAX_OV) usage();
            *eq = 0;
            G.ov_target[G.nov] = argv[i + 1];
            G.ov_lower[G.nov++] = eq + 1;
            i++;
        } else usage();
    }
    if (G.n <= 0 || G.conc < 1 || G.conc > 64 || !G.state || !G.cgname || !G.init_path ||
        !G.nov || strcmp(G.ov_target[0], "/") || (G.netns && G.disabled) ||
        (G.veth && (!G.veth_table || !G.veth_net || strlen(G.veth) > 6 || G.n > 65000)))
        usage();
    g_hostnet = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
    if (g_hostnet < 0) die("/proc/self/ns/net");
    /* The one shared namespace: ours, so every sandbox (and churn worker) inherits it. */
    if (G.disabled && unshare(CLONE_NEWNET) < 0) die("unshare(CLONE_NEWNET)");
    if (G.conc > G.n) G.conc = (int)G.n;
    G.init_fd = open(G.init_path, O_RDONLY | O_CLOEXEC);
    if (G.init_fd < 0) die(G.init_path);
    g_hostns = open("/proc/self/ns/pid", O_RDONLY | O_CLOEXEC);
    if (g_hostns < 0) die("/proc/self/ns/pid");
    FILE *f = fopen("/proc/sys/kernel/cap_last_cap", "r");
    if (!f || fscanf(f, "%d", &G.cap_last) != 1) G.cap_last = 40;
    if (f) fclose(f);
    getrlimit(RLIMIT_NOFILE, &G.nofile);
    if (G.nofile.rlim_max > 524288) G.nofile.rlim_max = 524288;
    G.nofile.rlim_cur = G.nofile.rlim_max < 1024 ? G.nofile.rlim_max : 1024;
    g_stack = mmap(NULL, STACK_SZ, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK,
                   -1, 0);
    if (g_stack == MAP_FAILED) die("mmap stack");
    if (mkdir(G.state, 0700) < 0 && errno != EEXIST) die(G.state);
    G.main_pid = getpid();
    if (G.tmpfs) {
        if (mount("raw-scratch", G.state, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                  "size=50%,mode=0700") < 0)
            die("mount tmpfs on --state");
        atexit(scratch_umount);
    }
    snprintf(G.mask_dir, sizeof G.mask_dir, "%s/mask", G.state);
    if (mkdir(G.mask_dir, 0555) < 0 && errno != EEXIST) die(G.mask_dir);
    dev_dir_setup();
    seccomp_build();
    cg_setup();
    if (G.sys_dir[0]) /* the skeleton: a mountpoint per hierarchy shown */
        for (int i = 0; i < G.ncg; i++) {
            if (!G.cg[i].view[0]) continue;
            char d[4300];
            mkdir(G.sys_dir, 0755);
            snprintf(d, sizeof d, "%s/fs", G.sys_dir);
            mkdir(d, 0755);
            snprintf(d, sizeof d, "%s/fs/cgroup", G.sys_dir);
            mkdir(d, 0755);
            snprintf(d, sizeof d, "%s/fs/cgroup/%s", G.sys_dir, G.cg[i].view_name);
            if (mkdir(d, 0755) < 0 && errno != EEXIST) die(d);
        }
    if (!strcmp(G.mode, "churn")) mode_churn();
    else if (!strcmp(G.mode, "exec")) mode_exec();
    else if (!strcmp(G.mode, "idle")) mode_idle();
    else usage();
    spares_drop();
    cg_teardown();
    return 0;
}
