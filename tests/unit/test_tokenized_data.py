"""Tokenizers, prepared corpora (one process, MPI.COMM_SELF) and the checks made before training."""
import os

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.comm.grid import ProcessGrid
from hpctrain.data.corpus import DataError
from hpctrain.data.prepared import PreparedCorpus, check_corpus, is_prepared, prepare
from hpctrain.data.sampler import SequenceSampler
from hpctrain.data.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer, train_bpe

@pytest.fixture(scope="module")
def solo():
    """This process alone, as an hpctrain Communicator (what `hpctrain data prepare` passes)."""
    from hpctrain.runtime.launcher import discover

    grid = ProcessGrid.build(discover(MPI.COMM_SELF), mpi_world=MPI.COMM_SELF, timeout_s=0)
    yield grid.world
    grid.close()


TEXTS = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n", "héllo wörld: ünïcode\n"] * 40


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    return train_bpe(iter(TEXTS), 300, str(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def docs(tmp_path, n=6):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(n):
        (folder / f"d{i}.txt").write_text(TEXTS[i % 3] * (i + 2))
    (folder / "blob.bin").write_bytes(b"\0\1\2" * 10)  # binary: skipped
    return folder


def test_bpe_tokenizer_round_trips_and_has_an_identity(tokenizer_json):
    tok = load_tokenizer(tokenizer_json)
    assert 257 < tok.vocab_size <= 300 and len(tok.identity) == 64  # a small corpus may end merges early
    for text in TEXTS[:3]:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(TEXTS[0])) < len(TEXTS[0].encode())  # merges learned
    assert ByteTokenizer().decode(ByteTokenizer().encode("ü")) == "ü"
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer("/nonexistent/tokenizer.json")
    with pytest.raises(TokenizerError, match="at least 257"):
        train_bpe(iter(TEXTS), 100, "/tmp/never.json")


def test_prepare_writes_documents_in_order_and_reads_by_slabs(tmp_path, tokenizer_json, solo):
    tok = load_tokenizer(tokenizer_json)
    out = str(tmp_path / "tokens.h5")
    summary = prepare(solo, [str(docs(tmp_path))], tok, out, progress=False)
    assert summary["documents"] == 6 and summary["dtype"] == "uint16" and is_prepared(out)
    corpus = PreparedCorpus(out)
    expected = np.concatenate([tok.encode(TEXTS[i % 3] * (i + 2)) for i in range(6)])
    assert len(corpus) == len(expected) and corpus.max() == expected.max()
    assert np.array_equal(corpus[:], expected) and list(corpus.doc_offsets[:2]) == [0, len(tok.encode(TEXTS[0] * 2))]
    # the sampler draws the same windows from the file as from the array, reading only those
    lazy, eager = SequenceSampler(corpus, 16, seed=7), SequenceSampler(expected, 16, seed=7)
    before = corpus.tokens_read
    assert np.array_equal(lazy.windows(100, 5), eager.windows(100, 5))
    assert corpus.tokens_read - before == 5 * 17
    check_corpus(corpus, tokenizer_json, 300, out)
    with pytest.raises(DataError, match="prepared with tokenizer 'tokenizer.json'.*byte tokenizer"):
        check_corpus(corpus, "bytes", 300, out)
    with pytest.raises(DataError, match=rf"token id \d+ >= model.vocab_size=256 .*vocabulary is {tok.vocab_size}"):
        check_corpus(corpus, tokenizer_json, 256, out)
    with pytest.raises(DataError, match="needs a prepared corpus"):
        check_corpus(expected, tokenizer_json, 300, "docs/")
    corpus.close()


def test_prepare_never_overwrites_and_names_missing_inputs(tmp_path, solo):
    out = tmp_path / "tokens.h5"
    out.write_text("precious")
    with pytest.raises(DataError, match="exists: choose another --out or pass --force"):
        prepare(solo, [str(docs(tmp_path))], ByteTokenizer(), str(out), progress=False)
    assert out.read_text() == "precious"
    with pytest.raises(DataError, match="does not exist"):
        prepare(solo, [str(tmp_path / "nope")], ByteTokenizer(), str(tmp_path / "t.h5"), progress=False)
    assert not os.path.exists(tmp_path / "t.h5") and not os.path.exists(tmp_path / "t.h5.parts")
    summary = prepare(solo, [str(tmp_path / "docs")], ByteTokenizer(), str(out), force=True,
                      progress=False)
    assert summary["vocab_size"] == 256 and PreparedCorpus(str(out)).max() < 256


def test_validation_split_at_a_document_boundary(tmp_path):
    from hpctrain.data.sampler import SamplerError, validation_split

    assert validation_split(np.zeros(1000, dtype=np.uint16), 0.0, 8) == 1000
    assert validation_split(np.zeros(1000, dtype=np.uint16), 0.1, 8) == 900

    class Docs:
        doc_offsets = np.array([0, 300, 650, 870, 1000])

        def __len__(self):
            return 1000
    assert validation_split(Docs(), 0.1, 8) == 870  # the boundary nearest to 900
    with pytest.raises(SamplerError, match="valid_fraction=0.999"):
        validation_split(np.zeros(1000, dtype=np.uint16), 0.999, 8)
