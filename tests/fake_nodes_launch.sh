#!/bin/bash
# Hydra "rsh" launcher for tests: `fake_nodes_launch.sh [opts] HOST CMD...` runs CMD on THIS machine
# in its own UTS namespace with hostname HOST, so MPI treats each HOST as a separate node.
while [[ "$1" == -* ]]; do shift; done
host=$1; shift
exec unshare --uts /bin/sh -c "hostname $host; exec $*"
