"""models/compile.py ``share_compile_workers``: a node's cores shared among its ranks' inductor compile workers."""
import os

import torch._inductor.config as inductor_config

from hpctrain.models.compile import share_compile_workers


def test_the_node_cores_are_shared_among_its_ranks_and_the_environment_decides_when_set():
    cores = len(os.sched_getaffinity(0))
    with inductor_config.patch(compile_threads=cores):  # inductor's default: every usable core
        assert share_compile_workers(1, environ={}) == cores
    with inductor_config.patch(compile_threads=cores):
        assert share_compile_workers(2 * cores, environ={}) == 1  # oversubscribed: compile in-process
        assert inductor_config.compile_threads == 1
    with inductor_config.patch(compile_threads=7):
        assert share_compile_workers(8, environ={"TORCHINDUCTOR_COMPILE_THREADS": "3"}) is None
        assert inductor_config.compile_threads == 7  # the user's setting stands
