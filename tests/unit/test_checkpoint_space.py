"""The words of a checkpoint that does not fit: what it needs with its metadata, what is free, how much is
missing (no self-contradicting figures), and ENOSPC named as such with the figures."""
from hpctrain.checkpoint.directory import METADATA_BYTES, enospc_detail, space_shortfall

MIB = 1 << 20


def test_a_checkpoint_that_fits_with_its_metadata_is_no_problem():
    assert space_shortfall(10, 3 * MIB, 3 * MIB + METADATA_BYTES, "/ckpt") is None


def test_a_shortfall_counts_the_metadata_and_says_by_how_much():
    # 3.2 MiB of data + 1 MiB of metadata = 4.2 MiB; 3.6 MiB free: 0.6 MiB short (the case)
    problem = space_shortfall(10, int(3.2 * MIB), int(3.6 * MIB), "/ckpt")
    assert problem == ("the checkpoint of step 10 does not fit in /ckpt: it needs 4.2 MiB with metadata "
                       "(3.2 MiB of data + 1.0 MiB), 3.6 MiB free: 0.6 MiB short"), problem


def test_the_figures_share_one_unit_and_add_up():
    problem = space_shortfall(4, 2 * 1024 * MIB, 2 * 1024 * MIB, "/ckpt")  # the data fits, its metadata not
    assert problem is not None and "needs 2.0 GiB with metadata" in problem, problem
    assert "2.0 GiB free: 1.0 MiB short" in problem, problem  # never "0.0 GiB short"
    problem = space_shortfall(4, 2 * 1024 * MIB, 1536 * MIB, "/ckpt")
    assert "needs 2.0 GiB with metadata" in problem and "1.5 GiB free: 0.5 GiB short" in problem, problem


def test_enospc_during_a_write_is_named_with_the_space_figures(tmp_path):
    error = f"{tmp_path}/shard-00001.h5: No space left on device (errno 28)"
    text = enospc_detail(error, 3 * MIB, str(tmp_path), "/run/checkpoints")
    assert text.startswith(error) and "(no space left on device: " in text, text
    assert " free in /run/checkpoints now, the checkpoint needs 4.0 MiB with metadata)" in text, text


def test_other_write_errors_are_left_as_they_are(tmp_path):
    error = f"{tmp_path}/shard-00001.h5: Input/output error (errno 5)"
    assert enospc_detail(error, 3 * MIB, str(tmp_path), "/run/checkpoints") == error
