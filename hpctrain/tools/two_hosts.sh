#!/bin/bash
# Two emulated hosts on one machine, joined by a shaped "wire", for tests and benchmarks of
# inter-node communication (e.g. gradient compression on a slow interconnect).
#
#   two_hosts.sh up [RATE]   network namespaces h1 (10.200.0.1) and h2 (10.200.0.2) joined by a veth pair
#                            (eth1 in each), shaped to RATE each way with tc tbf (e.g. 1gbit, 100mbit;
#                            `none` = unshaped; default 1gbit). Idempotent: a healthy pair is kept and reshaped.
#   two_hosts.sh rate RATE   reshape the wire without rebuilding it
#   two_hosts.sh counters    tx/rx bytes of eth1 in h1 and h2, as JSON
#   two_hosts.sh down        kill what still runs in h1/h2, delete them and the generated files
#
# `up` writes into ${HPCTRAIN_NS_DIR:-/tmp/hpctrain-ns}:
#   hosts            hydra host file (10.200.0.1, 10.200.0.2)
#   launch           hydra rsh-style launcher: runs the proxy for host 10.200.0.N in netns hN, hostname hN
#   mpiexec-2hosts   -n NP [-ppn K] CMD...  runs CMD on NP ranks, K per host in blocks (default: NP/2 rounded
#                    up, so ranks 0..K-1 on h1, the rest on h2), MPI forced onto TCP over eth1.
#                    The `mpiexec` first on PATH (hydra, e.g. the PyPI mpich wheel's) is used; the caller's
#                    environment (PATH, PYTHONPATH, VIRTUAL_ENV, OMP_NUM_THREADS, MPIR_CVAR_*, ...) reaches
#                    every rank. Without TCP forced, MPI on one machine quietly uses shared memory and nothing
#                    crosses the wire.
# Needs root, iproute2 (ip netns, tc) and util-linux (unshare). netem is not assumed (no delay/loss).
set -euo pipefail

D=${HPCTRAIN_NS_DIR:-/tmp/hpctrain-ns}
NS=(h1 h2)
ADDR=(10.200.0.1 10.200.0.2)
DEV=eth1

die() { echo "two_hosts.sh: $*" >&2; exit 1; }

preflight() {
    [ "${EUID:-$(id -u)}" = 0 ] || die "needs root (network namespaces, veth and tc need CAP_NET_ADMIN); run as root"
    local missing=()
    command -v ip >/dev/null || missing+=(ip)
    command -v tc >/dev/null || missing+=(tc)
    command -v unshare >/dev/null || missing+=(unshare)
    if [ ${#missing[@]} -gt 0 ] && [ "${HPCTRAIN_NS_NO_INSTALL:-0}" != 1 ] && command -v apt-get >/dev/null; then
        echo "two_hosts.sh: installing iproute2 util-linux (missing: ${missing[*]})" >&2
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
            --no-install-recommends iproute2 util-linux >/dev/null 2>&1 || true
        missing=()
        for c in ip tc unshare; do command -v $c >/dev/null || missing+=($c); done
    fi
    [ ${#missing[@]} -eq 0 ] || die "missing command(s): ${missing[*]} (install iproute2 and util-linux)"
    ip netns list >/dev/null 2>&1 || die "\`ip netns\` is unavailable: $(ip netns list 2>&1 | head -1)"
}

LOCK=${HPCTRAIN_NS_LOCK:-/tmp/hpctrain-two-hosts.lock}  # the namespace names are global: one lock for all dirs
lock() {  # serialize up/down/rate of concurrent callers
    exec 9>"$LOCK"
    flock -w 60 9 || die "timed out waiting for the lock $LOCK"
}

ns_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$1"; }

# tbf burst must hold at least one timer tick of traffic: 5 ms worth of RATE, at least 128 KiB.
burst_for() {
    local r=${1,,} num unit mult
    [[ $r =~ ^([0-9]+)(\.[0-9]+)?([kmgt]?)(bit|bps)$ ]] \
        || die "bad rate '$1': use a tc rate such as 10gbit, 1gbit, 100mbit, 500kbit, 50mbps, or none"
    num=${BASH_REMATCH[1]}; unit=${BASH_REMATCH[3]}
    case $unit in k) mult=1000 ;; m) mult=1000000 ;; g) mult=1000000000 ;; t) mult=1000000000000 ;; *) mult=1 ;; esac
    local bytes_per_s=$(( num * mult ))
    [ "${BASH_REMATCH[4]}" = bit ] && bytes_per_s=$(( bytes_per_s / 8 ))
    [ "$bytes_per_s" -gt 0 ] || die "bad rate '$1': must be positive"
    local b=$(( bytes_per_s / 200 ))
    [ $b -ge 131072 ] || b=131072
    echo $b
}

set_rate() {
    local rate=$1 burst=
    [ "$rate" = none ] || burst=$(burst_for "$rate")
    for n in "${NS[@]}"; do
        ns_exists $n || die "netns $n does not exist: run \`$0 up\` first"
        if [ "$rate" = none ]; then
            ip -n $n link show $DEV >/dev/null 2>&1 || die "no $DEV in netns $n"
            ip netns exec $n tc qdisc del dev $DEV root 2>/dev/null || true
        else
            ip netns exec $n tc qdisc replace dev $DEV root tbf rate "$rate" burst "$burst" latency 50ms \
                || die "tc could not shape $DEV in $n to $rate"
        fi
    done
    echo "$rate" > "$D/rate"
}

healthy() {  # both namespaces exist, each has eth1 with its address, and they are peers
    local i
    for i in 0 1; do
        ns_exists ${NS[$i]} || return 1
        ip -n ${NS[$i]} -o -4 addr show dev $DEV 2>/dev/null | grep -q " ${ADDR[$i]}/24 " || return 1
    done
    ip -n ${NS[0]} -o link show $DEV 2>/dev/null | grep -q "link-netns ${NS[1]}" || return 1
}

kill_ns_procs() {
    local n pids
    for n in "${NS[@]}"; do
        ns_exists $n || continue
        pids=$(ip netns pids $n 2>/dev/null || true)
        [ -z "$pids" ] || kill -TERM $pids 2>/dev/null || true
    done
    for n in "${NS[@]}"; do
        ns_exists $n || continue
        for _ in $(seq 20); do [ -z "$(ip netns pids $n 2>/dev/null)" ] && break; sleep 0.1; done
        pids=$(ip netns pids $n 2>/dev/null || true)
        [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
    done
}

build() {
    local i n
    kill_ns_procs
    for n in "${NS[@]}"; do ip netns del $n 2>/dev/null || true; done
    for n in "${NS[@]}"; do ip netns add $n || die "cannot create netns $n"; done
    ip link add $DEV netns ${NS[0]} type veth peer name $DEV netns ${NS[1]} || die "cannot create the veth pair"
    for i in 0 1; do
        n=${NS[$i]}
        ip netns exec $n sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 \
            >/dev/null 2>&1 || true
        ip -n $n addr add ${ADDR[$i]}/24 dev $DEV
        ip -n $n link set lo up
        ip -n $n link set $DEV up
    done
}

wait_up() {  # libfabric/UCX skip interfaces that are not RUNNING; linkwatch can lag ~1 s
    local n state
    for n in "${NS[@]}"; do
        for _ in $(seq 100); do
            state=$(ip netns exec $n cat /sys/class/net/$DEV/operstate 2>/dev/null || true)
            [ "$state" = up ] && break
            sleep 0.05
        done
        [ "$state" = up ] || die "$DEV in $n did not come up (operstate '$state' after 5 s)"
    done
}

write_files() {
    mkdir -p "$D"
    printf '%s\n' "${ADDR[@]}" > "$D/hosts"
    cat > "$D/launch" <<EOF
#!/bin/bash
# hydra rsh-style launcher: \`launch [opts] HOST CMD...\` runs CMD (a shell command line, as ssh would)
# in the network namespace of HOST, in its own UTS namespace with the host's name as hostname.
while [[ \$# -gt 0 && "\$1" == -* ]]; do shift; done
case "\$1" in
    ${ADDR[0]}|${NS[0]}) ns=${NS[0]} ;;
    ${ADDR[1]}|${NS[1]}) ns=${NS[1]} ;;
    *) echo "launch: unknown host '\$1' (known: ${ADDR[*]})" >&2; exit 255 ;;
esac
shift
exec ip netns exec "\$ns" unshare --uts /bin/sh -c "hostname \$ns; exec \$*"
EOF
    cat > "$D/mpiexec-2hosts" <<EOF
#!/bin/bash
# mpiexec-2hosts -n NP [-ppn K] CMD...   NP ranks, K per host in blocks (default: ceil(NP/2)), on h1 and h2
# made by two_hosts.sh, over TCP on $DEV. Uses the \`mpiexec\` first on PATH (hydra).
set -euo pipefail
D="$D"
np= ppn=
while [[ \$# -gt 0 ]]; do
    case "\$1" in
        -n|-np) np=\$2; shift 2 ;;
        -ppn) ppn=\$2; shift 2 ;;
        --) shift; break ;;
        -*) echo "mpiexec-2hosts: unknown option \$1 (usage: mpiexec-2hosts -n NP [-ppn K] CMD...)" >&2; exit 2 ;;
        *) break ;;
    esac
done
[[ "\$np" =~ ^[1-9][0-9]*\$ ]] || { echo "mpiexec-2hosts: -n NP is required (usage: -n NP [-ppn K] CMD...)" >&2; exit 2; }
[ -n "\$ppn" ] || ppn=\$(( (np + 1) / 2 ))
[[ "\$ppn" =~ ^[1-9][0-9]*\$ ]] || { echo "mpiexec-2hosts: bad -ppn '\$ppn'" >&2; exit 2; }
[ \$# -gt 0 ] || { echo "mpiexec-2hosts: no command given" >&2; exit 2; }
[ -e /run/netns/${NS[0]} ] || { echo "mpiexec-2hosts: netns ${NS[0]} is missing: run two_hosts.sh up" >&2; exit 2; }
mpiexec=\$(command -v mpiexec) || { echo "mpiexec-2hosts: no mpiexec on PATH (activate the venv)" >&2; exit 2; }
export MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=$DEV UCX_TLS=tcp,self UCX_NET_DEVICES=$DEV
# mpiexec runs in h1 (its proxies in h2 call back to ${ADDR[0]}); hydra hands this environment to every rank
exec ip netns exec ${NS[0]} unshare --uts /bin/sh -c 'hostname ${NS[0]}; exec "\$@"' sh \\
    "\$mpiexec" -launcher rsh -launcher-exec "\$D/launch" -localhost ${ADDR[0]} -f "\$D/hosts" \\
    -ppn "\$ppn" -n "\$np" "\$@"
EOF
    chmod +x "$D/launch" "$D/mpiexec-2hosts"
}

counters() {
    local out="{" sep="" n v tx rx
    for n in "${NS[@]}"; do
        ns_exists $n || die "netns $n does not exist: run \`$0 up\` first"
        v=$(ip netns exec $n cat /sys/class/net/$DEV/statistics/tx_bytes /sys/class/net/$DEV/statistics/rx_bytes) \
            || die "cannot read $DEV counters in $n"
        read -r tx rx <<< "$(echo $v)"
        out+="$sep\"$n\": {\"tx_bytes\": $tx, \"rx_bytes\": $rx}"; sep=", "
    done
    echo "$out}"
}

down() {
    kill_ns_procs
    for n in "${NS[@]}"; do
        ! ns_exists $n || ip netns del $n || die "cannot delete netns $n"
    done
    rm -f "$D/hosts" "$D/launch" "$D/mpiexec-2hosts" "$D/rate"
    rmdir "$D" 2>/dev/null || true
}

cmd=${1:-}
case "$cmd" in
    up)
        rate=${2:-1gbit}
        preflight
        [ "$rate" = none ] || burst_for "$rate" >/dev/null
        lock
        healthy || build
        mkdir -p "$D"
        set_rate "$rate"
        wait_up
        write_files
        echo "two hosts up: ${NS[0]}=${ADDR[0]} ${NS[1]}=${ADDR[1]} on $DEV, rate $rate; run: $D/mpiexec-2hosts -n 2 CMD..."
        ;;
    rate)
        [ $# -ge 2 ] || die "usage: $0 rate RATE"
        preflight; lock; mkdir -p "$D"; set_rate "$2"; echo "rate $2"
        ;;
    counters) preflight; counters ;;
    down) preflight; lock; down; echo "two hosts down" ;;
    *) echo "usage: $0 up [RATE|none] | rate RATE | counters | down    (dir: $D)" >&2; exit 2 ;;
esac
