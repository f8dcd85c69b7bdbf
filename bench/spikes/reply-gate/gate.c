/* A prototype of guarded mode with the driver on the kernel's queue: the driver reads its
 * requests from a real /dev/fuse, and each reply it writes there with write(2) or writev(2)
 * is stopped by a seccomp user notification until this process has read and checked the
 * reply's header in the driver's memory; then the write continues
 * (SECCOMP_USER_NOTIF_FLAG_CONTINUE) or fails with EINVAL. It measures what docs/design.md's
 * "Guarded mode's bulk I/O" proposes: the reply's data never passes a second process, and
 * each reply costs one notification round trip. The checks (length, error range) are ones the
 * kernel makes too: what is measured is their cost, not their worth.
 *
 * Not covered, as a product would have to: pwrite(2) and pwritev(2), io_uring, a dup(2) or
 * clone_fd of the descriptor (passthrough_ll without clone_fd writes its replies with
 * writev); a spliced reply is counted and let through unread.
 *
 * Usage: gate MOUNTPOINT DRIVER [ARG...]
 *   Opens /dev/fuse as descriptor F, mounts it on MOUNTPOINT, and runs DRIVER with every ARG
 *   equal to MOUNTPOINT replaced by /dev/fd/F (libfuse 3 then serves F without mounting).
 *   The filter reports write(2) and writev(2) on F, and splice(2) into F; a call of another
 *   architecture kills the process. Unless GATE_SYNC=0, the listener asks for Linux 6.6's
 *   synchronous wake-ups (SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP; asynchronous is the kernel's
 *   default) and exits if the kernel refuses. GATE_CHECK=0 lets every reply continue unread
 *   (the notification's own cost); GATE_POLL=1 waits in poll(2) before each receive instead
 *   of only in the receive ioctl. On SIGTERM or SIGINT it unmounts and prints its counts.
 *
 * A spike, not rebound: no tracking, no recovery, one thread answering. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

struct out_header { uint32_t len; int32_t error; uint64_t unique; };

/* Linux 6.6: the notifying task and the listener hand the CPU to each other on one CPU
 * instead of waking each other across CPUs (uapi names, absent from older headers). */
#define NOTIF_SET_FLAGS _IOW('!', 4, uint64_t)
#define NOTIF_FD_SYNC_WAKE_UP 1

static volatile sig_atomic_t stop;
static void on_signal(int sig) { (void)sig; stop = 1; }

static int install_filter(int fuse_fd) {
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_write, 3, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_writev, 2, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_splice, 4, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        /* write, writev: the descriptor is the first argument */
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (uint32_t)fuse_fd, 4, 0),
        /* splice: the third */
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[2])),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (uint32_t)fuse_fd, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_USER_NOTIF),
    };
    struct sock_fprog prog = { .len = sizeof f / sizeof f[0], .filter = f };
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) return -1;
    return syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, &prog);
}

static void send_fd(int sock, int fd) {
    char cbuf[CMSG_SPACE(sizeof(int))] = {0};
    char byte = 0;
    struct iovec iov = { &byte, 1 };
    struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                          .msg_controllen = sizeof cbuf };
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET; c->cmsg_type = SCM_RIGHTS; c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    if (sendmsg(sock, &msg, 0) != 1) { perror("gate: sendmsg"); _exit(1); }
}

static int recv_fd(int sock) {
    char cbuf[CMSG_SPACE(sizeof(int))];
    char byte;
    struct iovec iov = { &byte, 1 };
    struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                          .msg_controllen = sizeof cbuf };
    if (recvmsg(sock, &msg, 0) != 1) return -1;
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    if (!c || c->cmsg_type != SCM_RIGHTS) return -1;
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

/* The reply's header and total length, read from the driver's memory. 0 when readable. */
static int read_reply(pid_t pid, const struct seccomp_data *d, struct out_header *h,
                      uint64_t *total) {
    struct iovec local = { h, sizeof *h }, remote;
    if (d->nr == __NR_write) {
        remote.iov_base = (void *)d->args[1];
        remote.iov_len = sizeof *h;
        *total = d->args[2];
    } else { /* writev: the header leads the first element (libfuse, go-fuse, fuser) */
        struct iovec iov[16];
        if (d->args[2] == 0 || d->args[2] > 16) return -1;
        size_t n = d->args[2];
        struct iovec li = { iov, n * sizeof iov[0] };
        struct iovec ri = { (void *)d->args[1], n * sizeof iov[0] };
        if (process_vm_readv(pid, &li, 1, &ri, 1, 0) != (ssize_t)(n * sizeof iov[0])) return -1;
        if (iov[0].iov_len < sizeof *h) return -1;
        *total = 0;
        for (size_t i = 0; i < n; i++) *total += iov[i].iov_len;
        remote = iov[0];
        remote.iov_len = sizeof *h;
    }
    return process_vm_readv(pid, &local, 1, &remote, 1, 0) == sizeof *h ? 0 : -1;
}

static int valid(const struct out_header *h, uint64_t total) {
    if (h->len != total) return 0;
    if (h->unique == 0) return h->error > 0 && h->error < 16;   /* a notification */
    return h->error <= 0 && h->error > -4096;
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: gate MOUNTPOINT DRIVER [ARG...]\n"); return 2; }
    const char *mnt = argv[1];
    int fuse_fd = open("/dev/fuse", O_RDWR);
    if (fuse_fd < 0) { perror("gate: /dev/fuse"); return 1; }
    char opts[128], fdpath[32];
    snprintf(opts, sizeof opts, "fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other", fuse_fd);
    if (mount("gate", mnt, "fuse.gate", MS_NOSUID | MS_NODEV, opts)) {
        perror("gate: mount"); return 1;
    }
    snprintf(fdpath, sizeof fdpath, "/dev/fd/%d", fuse_fd);
    int sv[2];
    pid_t child = -1;
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0) child = fork();
    if (child < 0) { perror("gate: socketpair or fork"); umount2(mnt, MNT_DETACH); return 1; }
    if (child == 0) {
        close(sv[0]);
        int listener = install_filter(fuse_fd);
        if (listener < 0) { perror("gate: seccomp"); _exit(1); }
        send_fd(sv[1], listener);
        close(listener);
        close(sv[1]);
        char **args = calloc(argc, sizeof *args);
        for (int i = 2; i < argc; i++) args[i - 2] = strcmp(argv[i], mnt) ? argv[i] : fdpath;
        execvp(args[0], args);
        perror("gate: exec"); _exit(127);
    }
    close(sv[1]);
    close(fuse_fd);
    int listener = recv_fd(sv[0]);
    if (listener < 0) {
        fprintf(stderr, "gate: no listener\n");
        umount2(mnt, MNT_DETACH);
        return 1;
    }
    const char *check_env = getenv("GATE_CHECK");
    int check = !check_env || strcmp(check_env, "0");
    const char *poll_env = getenv("GATE_POLL");
    int wait_in_poll = poll_env && strcmp(poll_env, "0");
    const char *sync = getenv("GATE_SYNC");
    if ((!sync || strcmp(sync, "0")) && ioctl(listener, NOTIF_SET_FLAGS, NOTIF_FD_SYNC_WAKE_UP)) {
        perror("gate: SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP");
        umount2(mnt, MNT_DETACH);
        kill(child, SIGKILL);
        return 1;
    }
    struct sigaction sa = { .sa_handler = on_signal };
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    struct seccomp_notif_sizes sizes;
    if (syscall(SYS_seccomp, SECCOMP_GET_NOTIF_SIZES, 0, &sizes)) {
        perror("gate: SECCOMP_GET_NOTIF_SIZES");
        return 1;
    }
    struct seccomp_notif *req = calloc(1, sizes.seccomp_notif > sizeof *req ? sizes.seccomp_notif : sizeof *req);
    struct seccomp_notif_resp *resp = calloc(1, sizes.seccomp_notif_resp > sizeof *resp ? sizes.seccomp_notif_resp : sizeof *resp);
    uint64_t replies = 0, refused = 0, spliced = 0;
    while (!stop) {
        memset(req, 0, sizes.seccomp_notif);
        if (wait_in_poll) {
            /* The other way to wait: poll(2) first, then the receive ioctl. */
            struct pollfd p = { .fd = listener, .events = POLLIN };
            if (poll(&p, 1, -1) < 0) continue;
            if (p.revents & POLLHUP) break;
        }
        if (ioctl(listener, SECCOMP_IOCTL_NOTIF_RECV, req)) {
            if (errno == EINTR) continue;
            break; /* ENOENT: every process under the filter is gone */
        }
        memset(resp, 0, sizes.seccomp_notif_resp);
        resp->id = req->id;
        if (req->data.nr == __NR_splice) {
            /* A spliced reply is in a pipe; the product would tee(2) its header. */
            spliced++;
            resp->flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
        } else if (!check) {
            replies++;
            resp->flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
        } else {
            struct out_header h;
            uint64_t total;
            if (read_reply(req->pid, &req->data, &h, &total) == 0 && valid(&h, total)) {
                replies++;
                resp->flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
            } else {
                refused++;
                resp->error = -EINVAL;
            }
        }
        if (ioctl(listener, SECCOMP_IOCTL_NOTIF_SEND, resp) && errno != ENOENT)
            perror("gate: NOTIF_SEND");
    }
    umount2(mnt, MNT_DETACH);
    kill(child, SIGTERM);
    waitpid(child, NULL, 0);
    fprintf(stderr, "gate: %llu replies checked, %llu refused, %llu spliced\n",
            (unsigned long long)replies, (unsigned long long)refused,
            (unsigned long long)spliced);
    return 0;
}
