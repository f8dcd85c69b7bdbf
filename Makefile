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

# Installs rebound, the mount helper (mount -t rebound.DRIVER, fstab) and the systemd unit.
PREFIX ?= /usr/local
.PHONY: install
install:
	cargo build --release
	install -D -m 755 target/release/rebound $(DESTDIR)$(PREFIX)/bin/rebound
	install -d $(DESTDIR)/sbin
	ln -sf $(PREFIX)/bin/rebound $(DESTDIR)/sbin/mount.rebound
	install -D -m 644 contrib/systemd/rebound@.service $(DESTDIR)/etc/systemd/system/rebound@.service
	install -d $(DESTDIR)/etc/rebound
