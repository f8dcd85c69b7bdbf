// The observer's kernel half: at the end of each request of one FUSE connection, its header
// and its arguments as the wire carries them (the kernel lays a request out as its header
// followed by its in_args, a reply as its header followed by its out_args), and each FORGET a
// driver reads. Events go to a ring buffer without a wake-up; user space drains it in batches
// (a wake-up per event cost 0.41 of a driver's stat speed on 2 cores, see
// bench/results/fast-path-spike-2026-11-25.md).
//
// Owns: what is copied, and its bounds. Must not: change anything (it only reads), or copy an
// argument that lives in pages (READ replies, WRITE data): those are cut. READDIRPLUS replies
// (entries the kernel counts lookups of) live in pages too, but the driver wrote them with the
// write(2) or writev(2) that ends the request: they are copied from its buffer (the kernel's
// direct map is at a random address this program cannot learn without kallsyms' variables).
//
// The structures are declared as far as they are read: CO-RE relocates each field by name
// against the running kernel's BTF, so no vmlinux.h is needed to build this.

typedef unsigned char __u8;
typedef unsigned short __u16;
typedef unsigned int __u32;
typedef int __s32;
typedef unsigned long long __u64;

#define SEC(name) __attribute__((section(name), used))
#define CORE __attribute__((preserve_access_index))
#define __uint(name, val) int (*name)[val]

static long (*bpf_probe_read_kernel)(void *dst, __u32 size, const void *src) = (void *)113;
static void *(*bpf_ringbuf_reserve)(void *ringbuf, __u64 size, __u64 flags) = (void *)131;
static void (*bpf_ringbuf_submit)(void *data, __u64 flags) = (void *)132;
static long (*bpf_probe_read_user)(void *dst, __u32 size, const void *src) = (void *)112;
static __u64 (*bpf_get_current_pid_tgid)(void) = (void *)14;
static void *(*bpf_get_current_task_btf)(void) = (void *)158;
static void *(*bpf_task_pt_regs)(void *task) = (void *)175;
static void *(*bpf_map_lookup_elem)(void *map, const void *key) = (void *)1;
static long (*bpf_ringbuf_output)(void *ringbuf, void *data, __u64 size, __u64 flags) = (void *)130;
#define BPF_RB_NO_WAKEUP 1
#define BPF_MAP_TYPE_HASH 1
#define BPF_MAP_TYPE_RINGBUF 27
#define BPF_MAP_TYPE_ARRAY 2
#define BPF_MAP_TYPE_PERCPU_ARRAY 6
#define BPF_F_MMAPABLE 1024

struct fuse_in_header { __u32 len; __u32 opcode; __u64 unique; __u64 nodeid; __u32 uid;
                        __u32 gid; __u32 pid; __u16 total_extlen; __u16 padding; } CORE;
struct fuse_out_header { __u32 len; __s32 error; __u64 unique; } CORE;
struct fuse_in_arg { __u32 size; const void *value; } CORE;
struct fuse_arg { __u32 size; void *value; } CORE;
struct fuse_args { __u8 in_numargs; __u8 out_numargs; struct fuse_in_arg in_args[4];
                   struct fuse_arg out_args[2]; } CORE;
struct fuse_conn { __u32 dev; } CORE;
struct fuse_mount { struct fuse_conn *fc; } CORE;
struct fuse_req { struct fuse_args *args; struct { struct fuse_in_header h; } in;
                  struct { struct fuse_out_header h; } out; struct fuse_mount *fm; } CORE;
struct fuse_forget_one { __u64 nodeid; __u64 nlookup; } CORE;
struct fuse_forget_link { struct fuse_forget_one forget_one; } CORE;
struct pt_regs { unsigned long dx; unsigned long si; unsigned long orig_ax; } CORE;
struct task_struct { int tgid; struct task_struct *real_parent; } CORE;
struct iovec { void *iov_base; __u64 iov_len; };

#define FUSE_GETATTR 3
#define FUSE_READDIRPLUS 44
#define ROOT_ID 1
#define NR_WRITE 1
#define NR_WRITEV 20

// x & mask, in a way clang cannot drop when it already knows x to be in range (the verifier,
// which tracks registers differently, must see the mask).
#define BOUND(x, mask)                                   \
    ({                                                   \
        __u64 _v = (x);                                  \
        asm volatile("%[v] &= " #mask : [v] "+r"(_v));   \
        _v;                                              \
    })

#define READ(dst, src) \
    bpf_probe_read_kernel(&(dst), sizeof(dst), __builtin_preserve_access_index(&(src)))

// The connection observed (its device number, as in /proc/self/mountinfo): set once the
// programs are loaded, before they are attached (the loading comes before the mount, to
// learn early whether this kernel can observe at all). 0 matches no connection. The loader
// writes `.bss` as one __u32: it must stay the only zero-initialised global.
volatile __u32 CONNECTION = 0;
// Set by the loader: the range of fuse_dev_do_read (/proc/kallsyms), where a forget a driver
// reads is freed.
const volatile __u64 READ_LO = 0;
const volatile __u64 READ_HI = 0;
// Opcodes (below 64) whose requests are copied; the others are only counted. GETATTR of the
// root is copied always (rebound answers it for the driver while one restarts).
const volatile __u64 WANTED = ~0ULL;

// Bounds of what one event carries; each argument is cut to ARG_MAX bytes.
#define ARG_MAX 511
#define REQUEST_MAX 1024
#define REPLY_MAX 512
// A READDIRPLUS reply's entries: one page, as the kernel asks for.
#define ENTRIES_MAX 4096

enum kind { REQUEST_END = 0, FORGET = 1, ENTRIES_END = 2 };

struct event {
    __u32 kind;
    __u32 request_len;  // bytes of `request` (header + arguments), 0 for a forget
    __u32 reply_len;    // bytes of `reply` (header + arguments)
    __u32 cut;          // an argument was longer than carried, or in pages
    __u64 node;         // FORGET: the node and its count
    __u64 count;
    __u32 reader;       // FORGET: the process that read it
    __u32 entries_len;  // ENTRIES_END: bytes of `entries`
    __u8 request[REQUEST_MAX];
    __u8 reply[REPLY_MAX];
};

// A READDIRPLUS that ended: the event, then the reply's entries.
struct entries_event {
    struct event e;
    __u8 entries[ENTRIES_MAX];
};

struct {
    __uint(type, BPF_MAP_TYPE_RINGBUF);
    __uint(max_entries, 4 << 20);
} events SEC(".maps");

// The connection's requests that ended, copied or not: in all (slot 0), and by opcode (slot
// 1 + opcode; opcodes from 63 up share the last). Per CPU, so that counting is a plain add:
// requests end on every CPU, and atomic adds to one shared line cost each a transfer of it.
#define OPCODE_SLOTS 64
struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, 1 + OPCODE_SLOTS);
    __u32 *key;
    __u64 *value;
} ended SEC(".maps");

// The connection's requests that have not ended, each in slot (unique / 2) % STARTED_SLOTS
// (the kernel numbers a connection's requests 2, 4, 6, ...; 0 marks a free slot): user space
// maps the array and times how long each unique stays, for the hang check (a driver that holds
// one request while it answers the others). A hash map of send times cost 0.6 us a request
// (an update and a delete; bench/results/observer-cost-2026-11-27.md); this costs a store at
// the send and one at the end. A request whose slot is still taken, STARTED_SLOTS requests
// later, goes unwatched.
#define STARTED_SLOTS 4096
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, STARTED_SLOTS);
    __uint(map_flags, BPF_F_MMAPABLE);
    __u32 *key;
    __u64 *value;
} started SEC(".maps");

static __attribute__((always_inline)) __u64 *started_slot(__u64 unique)
{
    __u32 i = (unique >> 1) & (STARTED_SLOTS - 1);
    return bpf_map_lookup_elem(&started, &i);
}

char LICENSE[] SEC("license") = "GPL";

// A ring record of `kind` with its fixed fields cleared, or 0 when the ring is full.
static __attribute__((always_inline)) struct event *new_event(__u32 kind)
{
    struct event *e = kind == ENTRIES_END
                          ? bpf_ringbuf_reserve(&events, sizeof(struct entries_event), 0)
                          : bpf_ringbuf_reserve(&events, sizeof(*e), 0);
    if (e) {
        e->kind = kind;
        e->request_len = 0;
        e->reply_len = 0;
        e->cut = 0;
        e->node = 0;
        e->count = 0;
        e->reader = 0;
        e->entries_len = 0;
    }
    return e;
}

// Copies the entries of a READDIRPLUS reply of `size` bytes from the buffer the ending
// write(2)/writev(2) of the driver passed (the current task's system call). Returns the bytes
// copied, or -1 if they cannot be (another system call, or a layout not handled: the reply
// header and data in more than two pieces).
static __attribute__((always_inline)) long copy_entries(__u8 *dst, __u32 size)
{
    if (size == 0)  // the end of the directory: a bare header
        return 0;
    struct pt_regs *regs = bpf_task_pt_regs(bpf_get_current_task_btf());
    unsigned long nr = 0, arg1 = 0, arg2 = 0;
    READ(nr, regs->orig_ax);
    READ(arg1, regs->si);
    READ(arg2, regs->dx);
    const __u8 *data = 0;
    __u64 available = 0;
    if (nr == NR_WRITE) {
        data = (const __u8 *)arg1 + sizeof(struct fuse_out_header);
        available = arg2 - sizeof(struct fuse_out_header);
    } else if (nr == NR_WRITEV && arg2 >= 1) {
        struct iovec iov[2] = {};
        if (bpf_probe_read_user(&iov[0], sizeof(iov[0]), (void *)arg1))
            return -1;
        if (iov[0].iov_len > sizeof(struct fuse_out_header)) {
            data = (const __u8 *)iov[0].iov_base + sizeof(struct fuse_out_header);
            available = iov[0].iov_len - sizeof(struct fuse_out_header);
        } else if (iov[0].iov_len == sizeof(struct fuse_out_header) && arg2 >= 2) {
            if (bpf_probe_read_user(&iov[1], sizeof(iov[1]), (struct iovec *)arg1 + 1))
                return -1;
            data = iov[1].iov_base;
            available = iov[1].iov_len;
        }
    }
    if (!data || available < size || size > ENTRIES_MAX)
        return -1;
    __u64 len = BOUND(size, 4095);
    if (size == ENTRIES_MAX)
        len = ENTRIES_MAX;
    if (len && bpf_probe_read_user(dst, len, data))
        return -1;
    return len;
}

// Whether `req` is a request of the connection observed. (The tracepoints' `req` is a pointer
// the verifier trusts: the fields every request reads are loaded directly, where a
// bpf_probe_read_kernel call each cost more than the rest of the program.)
static __attribute__((always_inline)) int observed(struct fuse_req *req)
{
    return req->fm->fc->dev == CONNECTION;
}

SEC("tp_btf/fuse_request_send")
int request_send(__u64 *ctx)
{
    struct fuse_req *req = (void *)ctx[0];
    if (!observed(req))
        return 0;
    __u64 unique = req->in.h.unique;
    __u64 *slot = started_slot(unique);
    if (slot && *slot == 0)
        *slot = unique;
    return 0;
}

SEC("tp_btf/fuse_request_end")
int request_end(__u64 *ctx)
{
    struct fuse_req *req = (void *)ctx[0];
    struct fuse_args *args;
    if (!observed(req))
        return 0;
    __u64 unique = req->in.h.unique;
    __u64 *watched = started_slot(unique);
    if (watched && *watched == unique)
        *watched = 0;
    __u32 zero = 0;
    __u64 *count = bpf_map_lookup_elem(&ended, &zero);
    if (count)
        *count += 1;
    __u32 opcode = req->in.h.opcode;
    __u32 slot = 1 + (opcode < OPCODE_SLOTS - 1 ? opcode : OPCODE_SLOTS - 1);
    __u64 *by_opcode = bpf_map_lookup_elem(&ended, &slot);
    if (by_opcode)
        *by_opcode += 1;
    __u64 nodeid = req->in.h.nodeid;
    int wanted = opcode >= 64 || (WANTED >> opcode) & 1 ||
                 (opcode == FUSE_GETATTR && nodeid == ROOT_ID);
    if (!wanted)
        return 0;
    READ(args, req->args);
    __s32 error = 0;
    READ(error, req->out.h.error);
    __u32 kind = opcode == FUSE_READDIRPLUS && error == 0 ? ENTRIES_END : REQUEST_END;
    struct event *e = new_event(kind);
    if (!e)
        return 0;

    READ(*(struct fuse_in_header *)e->request, req->in.h);
    __u32 off = sizeof(struct fuse_in_header);
    __u8 n = 0;
    READ(n, args->in_numargs);
    for (int i = 0; i < 4; i++) {
        if (i >= n)
            break;
        __u32 size = 0;
        const void *value = 0;
        READ(size, args->in_args[i].size);
        READ(value, args->in_args[i].value);
        if (size > ARG_MAX) {
            e->cut = 1;
            size = ARG_MAX;
        }
        if (off > REQUEST_MAX / 2 - 1) {
            e->cut = 1;
            break;
        }
        __u64 at = BOUND(off, 511), len = BOUND(size, 511);  // as they are, within ARG_MAX
        if (len && bpf_probe_read_kernel(e->request + at, len, value))
            e->cut = 1;
        off += size;
    }
    e->request_len = off;

    READ(*(struct fuse_out_header *)e->reply, req->out.h);
    off = sizeof(struct fuse_out_header);
    n = 0;
    READ(n, args->out_numargs);
    for (int i = 0; i < 2; i++) {
        if (i >= n)
            break;
        __u32 size = 0;
        void *value = 0;
        READ(size, args->out_args[i].size);
        READ(value, args->out_args[i].value);
        if (kind == ENTRIES_END) {
            long copied = copy_entries(((struct entries_event *)e)->entries, size);
            if (copied < 0)
                e->cut = 1;
            else
                e->entries_len = copied;
            break;
        }
        if (size > REPLY_MAX / 2 - sizeof(struct fuse_out_header) || off > REPLY_MAX / 2 - 1) {
            e->cut = 1;
            break;
        }
        __u64 at = BOUND(off, 255), len = BOUND(size, 255);  // as they are, both below 256
        if (len && bpf_probe_read_kernel(e->reply + at, len, value))
            e->cut = 1;
        off += size;
    }
    e->reply_len = off;
    bpf_ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 0;
}

// FORGETs are not requests and pass no tracepoint; fuse_dev_do_read frees each forget link it
// hands to a driver. (Which connection it was is not known here: user space keeps the forgets
// of node ids it has seen looked up on the observed one.) Two programs see them:
// - forget_read, one per observer, puts each in the observer's own ring (`rebound observe`, and
//   a run that cannot share forget_share);
// - forget_share, one for the whole host, shared by every fast-mode run: a program on kfree
//   runs at every kfree of the host, about 50 ns each, so one per run made each fast-mode mount
//   cost work that never touches FUSE about 1.7% of this 2-CPU machine
//   (bench/results/host-tax-2026-11-29.md). Each run has a slot: its pid in forget_owners, and
//   the ring forgets<slot>. A forget goes to the slot of the reader or its nearest ancestor
//   there (a run's drivers are its descendants); the others are dropped.
static __attribute__((always_inline)) int in_fuse_dev_do_read(__u64 *ctx)
{
    return ctx[0] >= READ_LO && ctx[0] < READ_HI;
}

SEC("tp_btf/kfree")
int forget_read(__u64 *ctx)
{
    if (!in_fuse_dev_do_read(ctx))
        return 0;
    struct fuse_forget_link *link = (void *)ctx[1];
    struct event *e = new_event(FORGET);
    if (!e)
        return 0;
    READ(e->node, link->forget_one.nodeid);
    READ(e->count, link->forget_one.nlookup);
    e->reader = bpf_get_current_pid_tgid() >> 32;
    bpf_ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 0;
}

#define FORGET_SLOTS 16
// How far up from the reader a run's pid is looked for: a driver is the run's child, or a
// grandchild that daemonized under it; forks of those go deeper.
#define ANCESTORS 8

// pid of a run -> its slot. Pinned with forget_share, so that every run finds it.
struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, FORGET_SLOTS);
    __u32 *key;
    __u32 *value;
} forget_owners SEC(".maps");

// What a slot's ring holds: one forget.
struct forget_record {
    __u32 kind;    // FORGET
    __u32 reader;  // the process that read it
    __u64 node;
    __u64 count;
};

// The slots' rings (a ring has one consumer, so one each). The loader makes them one page
// unless this object is to be the first to share forget_share: else they are not used.
#define FORGET_RING(n)                                \
    struct {                                          \
        __uint(type, BPF_MAP_TYPE_RINGBUF);           \
        __uint(max_entries, 1 << 16);                 \
    } forgets##n SEC(".maps");
FORGET_RING(0) FORGET_RING(1) FORGET_RING(2) FORGET_RING(3)
FORGET_RING(4) FORGET_RING(5) FORGET_RING(6) FORGET_RING(7)
FORGET_RING(8) FORGET_RING(9) FORGET_RING(10) FORGET_RING(11)
FORGET_RING(12) FORGET_RING(13) FORGET_RING(14) FORGET_RING(15)

#define OUTPUT_TO(n) \
    case n:          \
        return bpf_ringbuf_output(&forgets##n, r, sizeof(*r), BPF_RB_NO_WAKEUP);

static __attribute__((always_inline)) long output_to_slot(__u32 slot, struct forget_record *r)
{
    switch (slot) {
        OUTPUT_TO(0) OUTPUT_TO(1) OUTPUT_TO(2) OUTPUT_TO(3)
        OUTPUT_TO(4) OUTPUT_TO(5) OUTPUT_TO(6) OUTPUT_TO(7)
        OUTPUT_TO(8) OUTPUT_TO(9) OUTPUT_TO(10) OUTPUT_TO(11)
        OUTPUT_TO(12) OUTPUT_TO(13) OUTPUT_TO(14) OUTPUT_TO(15)
    }
    return 0;
}

SEC("tp_btf/kfree")
int forget_share(__u64 *ctx)
{
    if (!in_fuse_dev_do_read(ctx))
        return 0;
    struct task_struct *task = bpf_get_current_task_btf();
    __u32 *slot = 0;
    for (int i = 0; i < ANCESTORS && task && !slot; i++) {
        __u32 tgid = 0;
        READ(tgid, task->tgid);
        slot = bpf_map_lookup_elem(&forget_owners, &tgid);
        struct task_struct *parent = 0;
        READ(parent, task->real_parent);
        task = parent;
    }
    if (!slot)
        return 0;
    struct fuse_forget_link *link = (void *)ctx[1];
    struct forget_record r = {.kind = FORGET, .reader = bpf_get_current_pid_tgid() >> 32};
    READ(r.node, link->forget_one.nodeid);
    READ(r.count, link->forget_one.nlookup);
    output_to_slot(*slot, &r);
    return 0;
}
