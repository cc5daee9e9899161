"""accelerate's nlp_example as people write it (a BERT sentence-pair classifier, tokenized items padded per batch by
a collate_fn, `outputs = model(**batch); loss = outputs.loss`, AdamW with a linear warm-up schedule, accuracy and
F1), with its loop replaced by scaletrain. Nothing says how the batch reaches the model: its items are dicts of the
keys BERT's forward takes, so scaletrain calls `model(**batch)` and trains on the loss BERT returns.

    python examples/nlp_bert.py --quick
    torchrun --nproc-per-node 2 examples/nlp_bert.py --quick

Offline: the BERT is built from a small BertConfig (random weights, no download) and the tokenizer from a
vocabulary written next to the run; the sentence pairs are synthetic (MRPC's shape): a statement, and a reply
that agrees with it (label 1) or not (label 0), said by a word of agreement or disagreement among filler words.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from torch.utils.data import Dataset
from torchmetrics.classification import BinaryF1Score
from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast, get_linear_schedule_with_warmup

import scaletrain

TOPICS = [f"topic{k}" for k in range(8)]
AGREE, DISAGREE = [f"yes{k}" for k in range(4)], [f"no{k}" for k in range(4)]  # what the reply says of the first
FILLER = [f"word{k}" for k in range(40)]


def tokenizer_in(folder: Path) -> BertTokenizerFast:
    """A BERT WordPiece tokenizer over this example's words (written once as vocab.txt)."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = folder / "vocab.txt"
    if not vocab.is_file():
        words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *FILLER, *TOPICS, *AGREE, *DISAGREE]
        vocab.write_text("\n".join(words) + "\n")
    return BertTokenizerFast.from_pretrained(str(folder))


class SentencePairs(Dataset):
    """Tokenized sentence pairs: {"input_ids", "token_type_ids", "attention_mask", "labels"}, unpadded, as
    `tokenizer(s1, s2, truncation=True)` gives them after a datasets.map."""

    def __init__(self, tokenizer: BertTokenizerFast, n: int, seed: int):
        rng = random.Random(seed)
        self.items = []
        for _ in range(n):
            first = rng.sample(TOPICS, 1) + rng.sample(FILLER, rng.randint(3, 8))
            same = rng.random() < 0.5
            second = rng.sample(AGREE if same else DISAGREE, 1) + rng.sample(FILLER, rng.randint(3, 8))
            rng.shuffle(first)
            rng.shuffle(second)
            item = dict(tokenizer(" ".join(first), " ".join(second), truncation=True, max_length=32))
            item["labels"] = int(same)
            self.items.append(item)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class Collate:
    """Pads a batch to its longest pair, as the example's collate_fn does with tokenizer.pad."""

    def __init__(self, tokenizer: BertTokenizerFast):
        self.tokenizer = tokenizer

    def __call__(self, items):
        return self.tokenizer.pad(items, padding="longest", return_tensors="pt")


def small_bert(vocab_size: int) -> BertForSequenceClassification:
    config = BertConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=64, num_labels=2)
    return BertForSequenceClassification(config)


class PairF1(BinaryF1Score):
    """F1 of the "same meaning" class from the model's two logits, as the example's metric computes it."""

    def update(self, logits, labels):
        super().update(logits.argmax(1), labels)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/nlp-bert")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--mixed-precision", default="no", choices=["no", "fp16", "bf16"])
    p.add_argument("--quick", action="store_true", help="1 epoch of 256 pairs")
    args = p.parse_args()
    tokenizer = tokenizer_in(Path(args.out + "-vocab"))
    train, val = SentencePairs(tokenizer, 2000, seed=0), SentencePairs(tokenizer, 400, seed=1)
    if args.quick:
        args.epochs, train, val = 1, SentencePairs(tokenizer, 256, seed=0), SentencePairs(tokenizer, 101, seed=1)

    torch.manual_seed(args.seed)
    model = small_bert(tokenizer.vocab_size)
    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size = args.epochs, args.batch_size
    config.data.num_workers = 0
    config.run.output_dir, config.run.seed = args.out, args.seed
    config.run.mixed_precision = args.mixed_precision
    scaletrain.fit(model, train, val, config, collate_fn=Collate(tokenizer), metrics={"f1": PairF1()},
                   optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr),
                   scheduler=lambda optimizer, total_steps: get_linear_schedule_with_warmup(
                       optimizer, num_warmup_steps=total_steps // 10, num_training_steps=total_steps))


if __name__ == "__main__":
    main()
