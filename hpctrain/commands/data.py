"""``hpctrain data``: train a tokenizer offline, and prepare a tokenized corpus in parallel.

    hpctrain data train-tokenizer --vocab-size 1024 --out tokenizer.json          # on the embedded corpus
    mpiexec -n 4 hpctrain data prepare --input docs/ notes.txt --tokenizer tokenizer.json --out tokens.h5
    hpctrain data prepare --format sft-jsonl examples/sft/tiny.jsonl --out sft.h5         # SFT examples + loss mask
"""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="tokenizers and prepared corpora")
    dsub = p.add_subparsers(dest="data_what", required=True)
    t = dsub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer.json offline (tokenizers)")
    t.add_argument("--vocab-size", type=int, required=True, help="vocabulary size (>= 257)")
    t.add_argument("--input", nargs="+", default=["builtin"],
                   help="files, folders or 'builtin' (the embedded corpus; default)")
    t.add_argument("--max-bytes", type=int, default=0, help="train on at most this many bytes (0 = all)")
    t.add_argument("--out", required=True, help="the tokenizer.json to write")
    t.add_argument("--force", action="store_true", help="replace --out if it exists")
    t.set_defaults(func=_train_tokenizer)
    q = dsub.add_parser("prepare", help="tokenize files in parallel (each MPI rank a share) into one HDF5 file")
    q.add_argument("sources", nargs="*", metavar="INPUT", help="inputs (as --input)")
    q.add_argument("--input", nargs="+", default=[], help="files, folders or 'builtin' (text); JSONL files (sft-jsonl)")
    q.add_argument("--format", choices=("text", "sft-jsonl"), default="text",
                   help="text: every file a document for pretraining (default); sft-jsonl: prompt/response or "
                        "chat examples with a loss mask (docs/models-and-data.md, SFT data)")
    q.add_argument("--tokenizer", default="bytes", help="'bytes' or a tokenizer.json (default bytes)")
    q.add_argument("--out", required=True, help="the .h5 file to write")
    q.add_argument("--force", action="store_true", help="replace --out if it exists")
    q.add_argument("--comm-timeout", type=float, default=3600.0,
                   help="seconds a rank may wait for the others before the job ends with a hang report naming "
                        "the missing rank (default 3600: shares are balanced by bytes, not by time; 0 = never)")
    q.set_defaults(func=_prepare)


def _train_tokenizer(args) -> int:
    import os

    from hpctrain.data.documents import DataError, text_documents
    from hpctrain.data.tokenizer import train_bpe

    if os.path.exists(args.out) and not args.force:
        raise DataError(f"{args.out} exists: choose another --out or pass --force to replace it")
    files, used = text_documents(args.input), []

    def texts():
        total = 0
        for path in files:
            used.append(path)
            with open(path, "rb") as f:
                data = f.read()
            if args.max_bytes:
                data = data[:max(0, args.max_bytes - total)]
            total += len(data)
            yield data.decode("utf-8", errors="replace")
            if args.max_bytes and total >= args.max_bytes:
                return
    train_bpe(texts(), args.vocab_size, args.out)
    print(f"tokenizer with {args.vocab_size} tokens trained on {len(used)} file(s) written to {args.out}")
    return 0


def _prepare(args) -> int:
    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.data.documents import DataError
    from hpctrain.data.prepared import prepare
    from hpctrain.data.sft import prepare_sft_collective
    from hpctrain.data.tokenizer import load_tokenizer
    from hpctrain.runtime.launcher import discover

    inputs = args.sources + args.input
    if not inputs:
        raise DataError("data prepare: give the inputs (INPUT ... or --input ...)")
    tokenizer = load_tokenizer(args.tokenizer)
    grid = ProcessGrid.build(discover(), timeout_s=args.comm_timeout)
    comm = grid.world
    try:
        if args.format == "sft-jsonl":
            summary = prepare_sft_collective(comm, inputs, tokenizer, args.out, force=args.force)
        else:
            summary = prepare(comm, inputs, tokenizer, args.out, force=args.force)
    finally:
        grid.close()
    if comm.rank == 0 and args.format == "sft-jsonl":
        print(f"prepared {summary['documents']} SFT examples, {summary['tokens']} tokens of which "
              f"{summary['counted']} counted in the loss (longest example {summary['longest']} tokens; "
              f"vocabulary {summary['vocab_size']}, tokenizer {summary['tokenizer']}, eos "
              f"{summary['eos_id']}): {summary['path']}")
        print(f"train on it: hpctrain train data.source={summary['path']} data.tokenizer={args.tokenizer} "
              f"model.vocab_size={summary['vocab_size']}  (train.seq_len at least {summary['longest'] - 1})")
    elif comm.rank == 0:
        print(f"prepared {summary['documents']} documents, {summary['tokens']} tokens ({summary['dtype']}, "
              f"vocabulary {summary['vocab_size']}, tokenizer {summary['tokenizer']}) on {comm.size} "
              f"rank(s): {summary['path']}")
        print(f"train on it: hpctrain train data.source={summary['path']} data.tokenizer={args.tokenizer} "
              f"model.vocab_size={summary['vocab_size']}")
    return 0
