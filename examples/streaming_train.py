"""Training on a streamed data set: Hugging Face ``datasets`` with ``streaming=True`` over
local JSON Lines (or Parquet) files, tokenized on the fly, shuffled through a buffer
(``procckpt.ShuffleBuffer``), read by two worker processes through torchdata's
``StatefulDataLoader``. A resume in the middle of an epoch loads the stream's state (which
file, which row, the buffer's samples): it reads only from where the stream stopped, however
far into the epoch that is, and goes on with the same order.

``--stateless`` reads the same files with an iterable of its own that has no state, through a
plain DataLoader: a resume reads the epoch again up to where it stopped, and says how long
that will take.

The data (16 files of 200 short texts) is written to ``--data`` when the folder is missing.

    procckpt run --time-limit 1m -- python examples/streaming_train.py
    procckpt run --time-limit 1m -- python examples/streaming_train.py --stateless
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import procckpt

VOCAB, LENGTH = 512, 12
#: Seconds of work to read one sample (--read-cost: a long text's tokenizing, say).
READ_COST = 0.0
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


def make_data(folder: Path, files: int, rows: int, parquet: bool) -> None:
    """Short texts with a label: whether the word "gamma" occurs in it more than once."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for f in range(files):
        records = []
        for r in range(rows):
            words = [WORDS[int(i)] for i in torch.randint(len(WORDS), (LENGTH,), generator=g)]
            records.append({"id": f * rows + r, "text": " ".join(words),
                            "label": int(words.count("gamma") > 1)})
        if parquet:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(records), folder / f"part-{f:03d}.parquet",
                           row_group_size=50)
        else:
            with open(folder / f"part-{f:03d}.jsonl", "w") as out:
                out.writelines(json.dumps(record) + "\n" for record in records)


def tokenize(text: str) -> list[int]:
    if READ_COST:
        until = time.perf_counter() + READ_COST
        while time.perf_counter() < until:
            pass
    return [zlib.crc32(word.encode()) % VOCAB for word in text.split()][:LENGTH]


def streamed(files: list[Path], parquet: bool) -> IterableDataset:
    import datasets

    datasets.disable_progress_bars()
    stream = datasets.load_dataset("parquet" if parquet else "json", split="train",
                                   data_files=[str(f) for f in files], streaming=True)
    stream = stream.map(lambda e: {"tokens": tokenize(e["text"])}, remove_columns=["text"])
    return stream.with_format("torch")


class LinesWithoutState(IterableDataset):
    """The same samples, read line by line; each worker reads every other file. No state."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files

    def __iter__(self):
        info = get_worker_info()
        mine = self.files[info.id::info.num_workers] if info else self.files
        for path in mine:
            with open(path) as lines:
                for line in lines:
                    record = json.loads(line)
                    yield {"id": torch.tensor(record["id"]),
                           "tokens": torch.tensor(tokenize(record["text"])),
                           "label": torch.tensor(record["label"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="stream-data", help="folder of the data files")
    parser.add_argument("--parquet", action="store_true", help="Parquet files, not JSON Lines")
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--rows", type=int, default=200, help="samples a file")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--buffer", type=int, default=64, help="shuffle buffer, in samples")
    parser.add_argument("--stateless", action="store_true",
                        help="a plain iterable without state (replayed on a resume)")
    parser.add_argument("--read-cost", type=float, default=0.0,
                        help="seconds of work to read each sample")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--out", default=None, help="write the final weights here")
    args = parser.parse_args()
    global READ_COST
    READ_COST = args.read_cost

    folder = Path(args.data)
    if not folder.exists():
        make_data(folder, args.files, args.rows, args.parquet and not args.stateless)
    files = sorted(folder.glob("*.parquet" if args.parquet else "*.jsonl"))

    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(VOCAB, 32), nn.Dropout(0.2), nn.Linear(32, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if args.stateless:
        data: IterableDataset = LinesWithoutState(files)
        loader = DataLoader(data, batch_size=8, num_workers=args.workers)
    else:
        from torchdata.stateful_dataloader import StatefulDataLoader

        data = procckpt.ShuffleBuffer(streamed(files, args.parquet), size=args.buffer, seed=0)
        loader = StatefulDataLoader(data, batch_size=8, num_workers=args.workers)

    ckpt = procckpt.Checkpointer(model=model, optimizer=optimizer)
    for epoch in ckpt.epochs(args.epochs):
        if isinstance(data, procckpt.ShuffleBuffer):
            data.set_epoch(epoch)
        for batch in ckpt.batches(loader):
            loss = nn.functional.cross_entropy(model(batch["tokens"]), batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
            print(f"step {ckpt.step + 1} ids {batch['id'][:2].tolist()}", flush=True)
    if args.out:
        torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
