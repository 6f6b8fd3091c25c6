"""The node-local tier's pure parts: which partner keeps whose piece, and a piece's file round trip with its
checksums (local_piece.py, local_tier.py; the MPI behaviour: tests/mpi/test_local_tier.py)."""
import torch

from hpctrain.checkpoint.local_piece import Piece, checksum, layout_of, read_piece, write_piece
from hpctrain.checkpoint.local_tier import expand, partners


def test_partners_live_on_other_nodes_and_every_rank_keeps_as_many_as_it_gives():
    nodes, local = (0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2), (0, 1, 2, 3) * 3
    for replicas in (1, 2):
        kept = [0] * 12
        for rank in range(12):
            holders = partners(rank, replicas, nodes, local)
            assert len(holders) == replicas and all(nodes[h] != nodes[rank] for h in holders)
            assert len({nodes[h] for h in holders}) == replicas  # two replicas: two other nodes
            for h in holders:
                kept[h] += 1
        assert kept == [replicas] * 12  # the load is even
    assert partners(0, 2, (0, 0, 1, 1), (0, 1, 0, 1)) == [2]  # two nodes hold one replica at most
    assert partners(0, 1, (0, 0), (0, 1)) == []  # one node: none


def test_a_piece_round_trips_and_a_flipped_byte_changes_its_checksum(tmp_path, monkeypatch):
    tensors = [("a", torch.arange(10, dtype=torch.float64)), ("b", torch.ones(3, 5, dtype=torch.bfloat16))]
    entries, total = layout_of(tensors)
    assert [e.offset % 64 for e in entries] == [0, 0] and total >= 80 + 30
    piece = Piece(torch.zeros(total, dtype=torch.uint8), entries, {"step": 3})
    for (_, t), e in zip(tensors, entries):
        piece.view(e).copy_(t)
    checksum(piece)
    write_piece(piece, str(tmp_path), "rank-00000")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-00000.bin", "rank-00000.json"]  # no temporaries
    back = read_piece(str(tmp_path / "rank-00000.json"))
    assert back.meta["step"] == 3 and [e.crc for e in back.entries] == [e.crc for e in entries]
    assert torch.equal(back.view(back.entries[1]), tensors[1][1])
    data = bytearray((tmp_path / "rank-00000.bin").read_bytes())
    data[5] ^= 1
    (tmp_path / "rank-00000.bin").write_bytes(data)
    damaged = read_piece(str(tmp_path / "rank-00000.json"))
    checksum(damaged)
    assert damaged.entries[0].crc != entries[0].crc and damaged.entries[1].crc == entries[1].crc
    monkeypatch.setenv("NODE_SCRATCH", "/scratch")
    assert expand("$NODE_SCRATCH/{hostname}/x").startswith("/scratch/") and "{" not in expand("{hostname}")


def test_a_layout_is_named_whole_and_a_change_by_its_keys():
    """ep and the ZeRO stage are part of every layout string; a change names only what differs (issue #55)."""
    from hpctrain.checkpoint.format import layout_differences, layout_text

    ours = {"dp": 2, "pp": 1, "cp": 1, "tp": 1, "ep": 2, "zero": 1, "world": 2}
    assert layout_text(ours) == "dp2 x pp1 x cp1 x tp1 x ep2, ZeRO-1"
    assert layout_differences({**ours, "zero": 2}, ours) == "parallel.zero 2 there, 1 here"
    assert layout_differences({**ours, "ep": 1}, ours) == "parallel.ep 1 there, 2 here"
    older = {k: v for k, v in ours.items() if k != "ep"}  # a piece written before ep was recorded
    assert layout_differences(older, ours) == "parallel.ep unrecorded there, 2 here"
