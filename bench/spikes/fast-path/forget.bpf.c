// Spike (2026-11-25, issue 12): FORGETs are not requests, and fentry/kprobes cannot attach
// here; the forget link a driver reads is freed by fuse_dev_do_read (fuse_read_forget is inlined
// there), so the kmem:kfree tracepoint from that function's range gives node id and count.
// FUSE_DEV_DO_READ_LO/HI come from /proc/kallsyms (run.sh).
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
char LICENSE[] SEC("license") = "GPL";
struct ev { u64 unique, nodeid, out_nodeid; u32 opcode; s32 error; char name[64]; };
struct { __uint(type, BPF_MAP_TYPE_RINGBUF); __uint(max_entries, 1 << 20); } rb SEC(".maps");
SEC("tp_btf/kfree")
int BPF_PROG(on_end, unsigned long call_site, const void *ptr)
{
    if (call_site < FUSE_DEV_DO_READ_LO || call_site >= FUSE_DEV_DO_READ_HI) return 0;
    struct fuse_forget_link *f = (void *)ptr;
    struct ev *e = bpf_ringbuf_reserve(&rb, sizeof(*e), 0);
    if (!e) return 0;
    e->unique = 0;
    e->nodeid = BPF_CORE_READ(f, forget_one.nodeid);
    e->out_nodeid = BPF_CORE_READ(f, forget_one.nlookup);
    e->opcode = 2; e->error = 0; e->name[0] = 0;
    bpf_ringbuf_submit(e, 0);
    return 0;
}
