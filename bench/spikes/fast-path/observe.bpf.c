// Spike (2026-11-25, issue 12): what a tp_btf program on the fuse_request_end tracepoint sees of
// each request at its end: opcode, unique, node id, error, and for LOOKUP the name asked for and
// the node id the driver answered. Events are drained in batches (no wake-up per event).
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
char LICENSE[] SEC("license") = "GPL";
struct ev { u64 unique, nodeid, out_nodeid; u32 opcode; s32 error; char name[64]; };
struct { __uint(type, BPF_MAP_TYPE_RINGBUF); __uint(max_entries, 1 << 20); } rb SEC(".maps");
SEC("tp_btf/fuse_request_end")
int BPF_PROG(on_end, struct fuse_req *req)
{
    struct fuse_args *args = BPF_CORE_READ(req, args);
    struct ev *e = bpf_ringbuf_reserve(&rb, sizeof(*e), 0);
    if (!e) return 0;
    e->unique = BPF_CORE_READ(req, in.h.unique);
    e->nodeid = BPF_CORE_READ(req, in.h.nodeid);
    e->opcode = BPF_CORE_READ(req, in.h.opcode);
    e->error = BPF_CORE_READ(req, out.h.error);
    e->name[0] = 0; e->out_nodeid = 0;
    if (e->opcode == 1) {
        // 6.18 puts the name in in_args[1] when there are two (in_args[0]: an empty arg). Its
        // size is the name's length, and no NUL need follow it (a path walk passes the
        // component inside the whole path: "d/absent" for "d"): read size bytes.
        u8 n = BPF_CORE_READ(args, in_numargs);
        u32 i = n > 1 ? 1 : 0;
        const void *v = BPF_CORE_READ(args, in_args[i].value);
        u32 len = BPF_CORE_READ(args, in_args[i].size);
        len &= sizeof(e->name) - 1;  // a bound the verifier accepts (the spike's names are short)
        bpf_probe_read_kernel(e->name, len, v);
        e->name[len & (sizeof(e->name) - 1)] = 0;
        struct fuse_entry_out *o = BPF_CORE_READ(args, out_args[0].value);
        if (o && e->error == 0) e->out_nodeid = BPF_CORE_READ(o, nodeid);
    }
    bpf_ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 0;
}
