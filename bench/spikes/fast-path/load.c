// Spike loader: attaches the program `on_end` of the BPF object argv[1] and drains its ring
// buffer every 20 ms for argv[2] seconds; PRINT=1 prints each event. Prints the event count.
#include <stdio.h>
#include <time.h>
#include <unistd.h>
#include <stdlib.h>
#include <bpf/libbpf.h>
struct ev { unsigned long long unique, nodeid, out_nodeid; unsigned opcode; int error; char name[64]; };
static long n;
static int handle(void *ctx, void *data, size_t sz) {
    struct ev *e = data; n++;
    if (getenv("PRINT")) printf("op %u unique %llu node %llu err %d name '%s' -> %llu\n", e->opcode, e->unique, e->nodeid, e->error, e->name, e->out_nodeid);
    return 0;
}
int main(int argc, char **argv) {
    struct bpf_object *obj = bpf_object__open_file(argv[1], NULL);
    if (!obj || bpf_object__load(obj)) { perror("load"); return 1; }
    struct bpf_program *p = bpf_object__find_program_by_name(obj, "on_end");
    struct bpf_link *l = bpf_program__attach(p);
    if (!l) { perror("attach"); return 1; }
    struct ring_buffer *rb = ring_buffer__new(bpf_object__find_map_fd_by_name(obj, "rb"), handle, NULL, NULL);
    fprintf(stderr, "attached\n");
    int secs = argc > 2 ? atoi(argv[2]) : 5;
    time_t end = time(NULL) + secs; while (time(NULL) < end) { usleep(20000); ring_buffer__consume(rb); }
    fprintf(stderr, "events %ld\n", n);
    return 0;
}
