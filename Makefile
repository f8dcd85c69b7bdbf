# The project's entry points, one target per script (each installs what it needs; run as root).
# Arguments for the script go in ARGS, e.g. `make bench ARGS="--quick --drivers sshfs"`.
.PHONY: bench bench-recovery storm test demo

bench:
	scripts/bench.sh $(ARGS)

bench-recovery:
	scripts/bench-recovery.sh $(ARGS)

storm:
	scripts/storm.sh $(ARGS)

test:
	scripts/test.sh $(ARGS)

demo:
	scripts/demo.sh $(ARGS)
