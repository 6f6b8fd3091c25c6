"""SFT data (hpctrain/data/sft.py, packing.py): the template, the loss mask, bad input, the packed sampler."""
import json
import os

import numpy as np
import pytest

from hpctrain.data.corpus import load_tokens_collective
from hpctrain.data.documents import DataError
from hpctrain.data.packing import PackedSampler, SFTCorpus, pack_documents, sft_split
from hpctrain.data.sampler import GlobalBatchIterator, SamplerError
from hpctrain.data.sft import END_OF_TURN, chat_prompt_ids, prepare_sft, render
from hpctrain.data.tokenizer import ByteTokenizer, train_bpe, load_tokenizer

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "sft", "tiny.jsonl")


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def counted_text(ids, mask):
    return bytes(int(i) for i, m in zip(ids, mask) if m).decode()


def test_prompt_response_template_and_mask(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "2+2?", "response": "4", "id": 7},
                                             {"system": "Be brief.", "prompt": "Hi", "response": "Hello!"}])
    summary = prepare_sft([src], ByteTokenizer(), str(tmp_path / "a.h5"))
    corpus = SFTCorpus(str(tmp_path / "a.h5"))
    texts, counted = [], []
    for d in range(2):
        lo, hi = corpus.doc_offsets[d], corpus.doc_offsets[d + 1]
        ids, mask = corpus.read(lo, hi)
        texts.append(bytes(ids.astype(np.uint8)).decode())
        counted.append(counted_text(ids, mask))
    assert texts == ["<|user|>\n2+2?<|end|>\n<|assistant|>\n4<|end|>\n",
                     "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n"]
    assert counted == ["4" + END_OF_TURN, "Hello!" + END_OF_TURN]  # only the response and its end of turn
    assert list(corpus.doc_counted) == [len(c) for c in counted] and summary["counted"] == sum(map(len, counted))
    assert corpus.doc_names == [f"{src}:1", f"{src}:2"] and corpus.template == "hpctrain-chat-v1"


def test_chat_messages_count_every_assistant_turn_and_nothing_else():
    turns = [("system", "S"), ("user", "u1"), ("assistant", "a1"), ("user", "u2"), ("assistant", "a2"), ("user", "u3")]
    ids, mask = render(turns, ByteTokenizer())
    assert counted_text(ids, mask) == "a1" + END_OF_TURN + "a2" + END_OF_TURN
    assert bytes(ids).decode().endswith("<|user|>\nu3<|end|>\n") and len(ids) == len(mask) and mask[0] == 0


def test_a_tokenizer_with_eos_ends_the_example_with_it_counted(tmp_path):
    tok_path = train_bpe(["hello world, the answer is four. " * 50], 300, str(tmp_path / "tok.json"))
    tok = load_tokenizer(tok_path)
    assert tok.eos_id == tok.tok.token_to_id("<|endoftext|>")
    ids, mask = render([("user", "hello"), ("assistant", "the answer is four.")], tok)
    assert ids[-1] == tok.eos_id and mask[-1] == 1
    pieces = tok.encode_segment("the answer is four.") + tok.encode_segment(END_OF_TURN) + [tok.eos_id]
    assert [i for i, m in zip(ids, mask) if m] == pieces
    ids, mask = render([("user", "hello"), ("assistant", "four."), ("user", "more")], tok)
    assert ids[-1] == tok.eos_id and mask[-1] == 0  # the conversation ends with a user turn: eos not counted
    trained, mask = render([("user", "hello"), ("assistant", "four.")], tok)  # generate --chat: the same ids,
    prompt = chat_prompt_ids("hello", tok)                                    # up to the first counted token
    assert prompt == trained[:mask.index(1)] and len(prompt) < len(trained)


@pytest.mark.parametrize("lines, problem, line", [
    ([{"prompt": "p", "response": "r"}, {"prompt": "p"}], 'no "response"', 2),
    (['{"prompt": "p", "response": "r"', ], "invalid JSON", 1),
    ([{"prompt": "p", "response": "r"}, "", {"messages": [{"role": "user", "content": "x"}]}], "no assistant turn", 3),
    ([{"messages": [{"role": "robot", "content": "x"}]}], 'needs a "role"', 1),
    ([{"messages": [{"role": "assistant", "content": 3}]}], 'string "content"', 1),
    ([{"prompt": "p", "response": "  "}], "empty response", 1),
    ([{"prompt": "p", "response": "r", "messages": []}], "not both", 1),
    ([[1, 2]], "expected a JSON object", 1),
])
def test_bad_input_names_file_and_line_and_writes_nothing(tmp_path, lines, problem, line):
    src = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError, match=f"{src}:{line}: .*{problem}"):
        prepare_sft([src], ByteTokenizer(), str(tmp_path / "out.h5"))
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_empty_file_existing_output_and_missing_input(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(DataError, match="empty.jsonl: no examples"):
        prepare_sft([str(empty)], ByteTokenizer(), str(tmp_path / "out.h5"))
    (tmp_path / "out.h5").write_text("keep")
    with pytest.raises(DataError, match="exists: choose another --out"):
        prepare_sft([EXAMPLE], ByteTokenizer(), str(tmp_path / "out.h5"))
    assert (tmp_path / "out.h5").read_text() == "keep"
    with pytest.raises(DataError, match="is not a file"):
        prepare_sft([str(tmp_path / "nope.jsonl")], ByteTokenizer(), str(tmp_path / "x.h5"))


def test_packing_is_greedy_in_order_and_refuses_a_too_long_example():
    bounds = pack_documents(np.array([5, 4, 3, 9, 1, 1]), 10, [f"f:{i}" for i in range(6)])
    assert bounds.tolist() == [0, 2, 3, 5, 6]  # [5, 4] [3] [9, 1] [1]: a full sequence is fine
    with pytest.raises(SamplerError, match=r"SFT example f:3 has 12 tokens, more than train.seq_len \+ 1 = 10"):
        pack_documents(np.array([5, 4, 3, 12]), 10, [f"f:{i}" for i in range(4)])


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sft") / "tiny.h5")
    prepare_sft([EXAMPLE], ByteTokenizer(), path)
    assert load_tokens_collective(None, path).__class__ is SFTCorpus  # what the trainer loads
    return SFTCorpus(path)


def test_packed_batches_keep_whole_examples_and_count_their_mask(shipped):
    sampler = PackedSampler(shipped, 255, seed=3)
    assert sampler.num_sequences < len(shipped.doc_offsets) - 1  # several examples share a sequence
    n = sampler.num_sequences
    inputs, targets, mask, docs = sampler.batch(0, n)
    assert inputs.shape == targets.shape == mask.shape == docs.shape == (n, 255)
    assert int(mask.sum()) == sampler.counted(0, n) == int(shipped.doc_counted.sum())  # one epoch: every example
    assert sorted(sampler.sequences(0, n).tolist()) == list(range(n))
    assert (docs[:, 1:] >= docs[:, :-1]).all() and (docs[:, 0] == 0).all()
    starts = docs[:, 1:] != docs[:, :-1]  # a target that begins a new document is never counted
    assert not (mask[:, :-1] & starts[:, :]).any()
    assert not mask[targets == 0].any()  # padding is never counted
    again = PackedSampler(shipped, 255, seed=3)  # (seed, index) alone: any slice, any object, same samples
    for a, b in zip(again.batch(n - 3, 6), [t[n - 3:] for t in sampler.batch(0, n + 3)]):
        assert np.array_equal(a, b)
    assert sampler.sequences(n, n).tolist() != sampler.sequences(0, n).tolist()  # a new order each epoch


def test_dp_ranks_read_slices_of_one_global_batch(shipped):
    sampler = PackedSampler(shipped, 255, seed=5)
    whole = GlobalBatchIterator(sampler, 4, 1, 0, start_sample=4).next_batch()
    halves = [GlobalBatchIterator(sampler, 4, 2, r, start_sample=4).next_batch() for r in range(2)]
    for k in range(4):
        assert np.array_equal(whole[k], np.concatenate([h[k] for h in halves]))


def test_validation_split_holds_out_the_last_examples(shipped):
    n = len(shipped.doc_offsets) - 1
    split = sft_split(shipped, 0.25)
    assert split == n - 10
    valid = PackedSampler(shipped, 255, 1, first_doc=split)
    assert int(valid.sequence_counted.sum()) == int(shipped.doc_counted[split:].sum())
    with pytest.raises(DataError, match="leaves none to train on"):
        sft_split(shipped, 0.99)
