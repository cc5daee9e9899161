"""Each script of examples/ that brings its own step, against the loop it was converted from, in the same run: the
converted script runs as a user runs it (`python examples/X.py --out DIR --seed S`), and the script's own loop,
written here as the original scripts write it over the same Dataset, model, optimizer and schedule classes
(imported from the example), runs in a process of its own with the same seed. Figure: each one's result at the
end, and the seconds the whole process took.

- mnist_steplr: PyTorch's MNIST example (Adadelta, StepLR stepped after each epoch); validation accuracy.
- nlp_bert: accelerate's nlp_example (AdamW, a linear warm-up stepped per batch, `model(**batch).loss`); accuracy
  and F1.
- detect_boxes: torchvision's detection tutorial (SGD, StepLR per epoch, `model(images, targets)`); box mAP.
- dcgan_digits: PyTorch's DCGAN example (a discriminator then a generator step per batch); how sure a digit
  classifier is of the generated digits (mean top probability of 1,000 samples), how many of the 10 they cover.
- simclr_digits: a SimCLR loop (two views, NT-Xent over the batch, Adam); nearest-neighbour accuracy on the
  validation digits.

    python benchmarks/own_loops.py                   # every example, 2 seeds: about 15 minutes on a 2-core CPU
    python benchmarks/own_loops.py --only mnist_steplr,nlp_bert --seeds 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


# -- the scripts' own loops, each in a process of its own --------------------------------------------------------
def loop_mnist_steplr(seed: int, out: Path) -> dict:
    import torch
    import torch.nn.functional as F
    from mnist_steplr import Digits, Net

    torch.manual_seed(seed)
    train = torch.utils.data.DataLoader(Digits(0, 8000), batch_size=64, shuffle=True)
    test = torch.utils.data.DataLoader(Digits(8000, 10000), batch_size=1000)
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    for _ in range(2):
        model.train()
        for x, y in train:
            optimizer.zero_grad()
            F.nll_loss(model(x), y).backward()
            optimizer.step()
        model.eval()
        correct = 0
        with torch.no_grad():
            for x, y in test:
                correct += (model(x).argmax(1) == y).sum().item()
        scheduler.step()
    return {"val_accuracy": correct / 2000}


def loop_nlp_bert(seed: int, out: Path) -> dict:
    import torch
    from nlp_bert import Collate, PairF1, SentencePairs, get_linear_schedule_with_warmup, small_bert, tokenizer_in

    tokenizer = tokenizer_in(out / "vocab")
    train, val = SentencePairs(tokenizer, 2000, seed=0), SentencePairs(tokenizer, 400, seed=1)
    torch.manual_seed(seed)
    model = small_bert(tokenizer.vocab_size)
    train_loader = torch.utils.data.DataLoader(train, batch_size=16, shuffle=True, collate_fn=Collate(tokenizer))
    val_loader = torch.utils.data.DataLoader(val, batch_size=16, collate_fn=Collate(tokenizer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    total = len(train_loader) * 3
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=total // 10, num_training_steps=total)
    for _ in range(3):
        model.train()
        for batch in train_loader:
            outputs = model(**batch)
            outputs.loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    model.eval()
    f1, correct = PairF1(), 0
    with torch.no_grad():
        for batch in val_loader:
            logits = model(**batch).logits
            correct += (logits.argmax(1) == batch["labels"]).sum().item()
            f1.update(logits, batch["labels"])
    return {"val_accuracy": correct / len(val), "val_f1": f1.compute().item()}


def loop_detect_boxes(seed: int, out: Path) -> dict:
    import torch
    from detect_boxes import BoxMAP, Squares, collate, make_detector

    torch.manual_seed(seed)
    model = make_detector()
    loader = torch.utils.data.DataLoader(Squares(600, seed=0), batch_size=8, shuffle=True, collate_fn=collate)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.02, momentum=0.9, weight_decay=0.0005)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.1)
    for _ in range(6):
        model.train()
        for images, targets in loader:
            losses = sum(model(list(images), list(targets)).values())
            optimizer.zero_grad()
            losses.backward()
            optimizer.step()
        scheduler.step()
    model.eval()
    metric = BoxMAP()
    with torch.no_grad():
        for images, targets in torch.utils.data.DataLoader(Squares(101, seed=1), batch_size=8, collate_fn=collate):
            metric.update(model(list(images)), list(targets))
    return {"val_map": metric.compute().item()}


def loop_dcgan_digits(seed: int, out: Path) -> dict:
    import torch
    from dcgan_digits import GAN, NZ, Digits
    from torch import nn

    torch.manual_seed(seed)
    model = GAN()
    loader = torch.utils.data.DataLoader(Digits(0, 10000), batch_size=64, shuffle=True)
    criterion = nn.BCELoss()
    opt_d = torch.optim.Adam(model.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(model.generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    for _ in range(5):
        for real, _ in loader:
            ones, zeros = torch.ones(len(real)), torch.zeros(len(real))
            model.discriminator.zero_grad()
            fake = model.generator(torch.randn(len(real), NZ, 1, 1))
            loss_d = criterion(model.discriminator(real).view(-1), ones) + \
                criterion(model.discriminator(fake.detach()).view(-1), zeros)
            loss_d.backward()
            opt_d.step()
            model.generator.zero_grad()
            criterion(model.discriminator(fake).view(-1), ones).backward()
            opt_g.step()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "last.safetensors"))
    return {}


def loop_simclr_digits(seed: int, out: Path) -> dict:
    import torch
    from simclr_digits import Encoder, NearestNeighbourAccuracy, Plain, TwoViews, nt_xent

    torch.manual_seed(seed)
    model = Encoder()
    loader = torch.utils.data.DataLoader(TwoViews(0, 8000), batch_size=128, shuffle=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(5):
        model.train()
        for (view1, view2), _ in loader:
            z1, z2 = model(torch.cat([view1, view2])).chunk(2)
            loss = nt_xent(z1, z2, 0.2)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    metric = NearestNeighbourAccuracy()
    with torch.no_grad():
        for images, labels in torch.utils.data.DataLoader(Plain(8000, 10000), batch_size=128):
            metric.update(torch.nn.functional.normalize(model.body(images), dim=1), labels)
    return {"val_knn_accuracy": metric.compute().item()}


LOOPS = {name[len("loop_"):]: fn for name, fn in globals().items() if name.startswith("loop_")}
# what each side's result is read as: the converted script's summary.json keys
RESULTS = {"mnist_steplr": ["val_accuracy"], "nlp_bert": ["val_accuracy", "val_f1"], "detect_boxes": ["val_map"],
           "dcgan_digits": ["digit_confidence", "digits_covered"], "simclr_digits": ["val_knn_accuracy"]}


def gan_quality(weights: Path, classifier_dir: Path) -> dict:
    """How sure a digit classifier (trained once, here) is of 1,000 generated digits, and how many digits they
    cover."""
    import torch
    import torch.nn.functional as F
    from dcgan_digits import GAN, NZ
    from mnist_steplr import Digits, Net
    from safetensors.torch import load_file

    classifier_path = classifier_dir / "digit_classifier.pt"
    net = Net()
    if classifier_path.is_file():
        net.load_state_dict(torch.load(classifier_path, weights_only=True))
    else:
        torch.manual_seed(0)
        optimizer = torch.optim.Adadelta(net.parameters(), lr=1.0)
        for x, y in torch.utils.data.DataLoader(Digits(0, 10000), batch_size=64, shuffle=True):
            optimizer.zero_grad()
            F.nll_loss(net(x), y).backward()
            optimizer.step()
        torch.save(net.state_dict(), classifier_path)
    gan = GAN()
    gan.load_state_dict(load_file(str(weights)))
    gan.eval()
    net.eval()
    with torch.no_grad():
        fake = gan.generator(torch.randn(1000, NZ, 1, 1, generator=torch.Generator().manual_seed(1)))
        # the classifier takes MNIST-normalised images; the generator's are in [-1, 1]
        probs = net(((fake + 1) / 2 - 0.1307) / 0.3081).exp()
    return {"digit_confidence": probs.max(1).values.mean().item(),
            "digits_covered": int(torch.bincount(probs.argmax(1), minlength=10).gt(20).sum())}


def run_one(kind: str, name: str, seed: int, work: Path) -> tuple[dict, float]:
    """(results, seconds) of the converted script or of its own loop, in a process of its own."""
    out = work / f"{name}-{kind}-{seed}"
    shutil.rmtree(out, ignore_errors=True)  # a finished run folder would be taken as done
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), str(ROOT / "src"),
                                                         os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(EXAMPLES / f"{name}.py"), "--out", str(out), "--seed", str(seed)] if kind == "fit" \
        else [sys.executable, __file__, "--loop", name, "--seed", str(seed), "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{name} ({kind}) failed: {proc.stderr[-3000:]}")
    if kind == "fit":
        summary = json.loads((out / "summary.json").read_text())
        results = {k: summary.get(f"final_{k}") for k in RESULTS[name] if f"final_{k}" in summary}
    else:
        results = json.loads((out / "result.json").read_text())
    if name == "dcgan_digits":
        sys.path.insert(0, str(EXAMPLES))
        results.update(gan_quality(out / "last.safetensors", work))
    return results, seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loop", help=argparse.SUPPRESS)  # run one example's own loop here (a process of its own)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--only", default=",".join(LOOPS), help="comma-separated examples")
    p.add_argument("--seeds", type=int, default=2, help="seeds per example and way (first-seed, first-seed + 1, ...)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--work-dir", default="/tmp/scaletrain-own-loops")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "own_loops_cpu.json"))
    args = p.parse_args()
    if args.loop:
        sys.path.insert(0, str(EXAMPLES))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(LOOPS[args.loop](args.seed, out)))
        return
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.only.split(","):
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for kind in ("loop", "fit"):
                results, seconds = run_one(kind, name, seed, work)
                rows.append({"example": name, "way": kind, "seed": seed, "seconds": seconds, **results})
                print(f"{name} seed {seed} {kind}: " + ", ".join(f"{k} {v:.4f}" for k, v in results.items())
                      + f" ({seconds:.1f} s)", flush=True)
    print("\n| example | result | its own loop | through scaletrain.fit | seconds, loop / fit |\n|---|---|---|---|---|")
    for name in args.only.split(","):
        for key in RESULTS[name]:
            ways = {kind: [r[key] for r in rows if r["example"] == name and r["way"] == kind]
                    for kind in ("loop", "fit")}
            secs = {kind: statistics.median(r["seconds"] for r in rows if r["example"] == name and r["way"] == kind)
                    for kind in ("loop", "fit")}
            print(f"| {name} | {key} | {', '.join(f'{v:.4f}' for v in ways['loop'])} | "
                  f"{', '.join(f'{v:.4f}' for v in ways['fit'])} | {secs['loop']:.1f} / {secs['fit']:.1f} |")
    record = {"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "command": " ".join(["python", "benchmarks/own_loops.py", *sys.argv[1:]]),
              "rows": rows}
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
