#!/bin/sh
# Runs as PID 1's successor inside the Soft-RoCE VM (the image's /sbin/irdma-init mounts the
# repository at /host and execs this). Brings up rxe0 on a dummy netdev, runs /host/.vm-cmd,
# and hands its exit status to qemu through isa-debug-exit.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
up() { cut -d' ' -f1 /proc/uptime; }
echo "== guest init at uptime $(up)s"
modprobe -a dummy rdma_rxe rdma_ucm ib_uverbs fuse
mkdir -p /dev/shm && mount -t tmpfs shm /dev/shm
ip link set lo up
ip link add rxnet0 type dummy            # modprobe dummy already made dummy0: use our own name
ip addr add 10.9.9.1/24 dev rxnet0 && ip link set rxnet0 up   # exists only inside the guest
rdma link add rxe0 type rxe netdev rxnet0 && rdma link show
echo "== rxe0 ready at uptime $(up)s"
ulimit -l unlimited
cd /host && sh /host/.vm-cmd
RC=$?
echo "== command exit status $RC at uptime $(up)s"
sync
printf "$(printf '\\%03o' $((RC & 127)))" | dd of=/dev/port bs=1 seek=244 count=1 2>/dev/null
echo o > /proc/sysrq-trigger
sleep 30
