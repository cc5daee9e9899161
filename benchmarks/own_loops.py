"""A user's own loop against scaletrain, two ways, in fresh processes taking turns (the order reversed every other
round).

`--case speed`: PyTorch's MNIST example (its network, F.nll_loss, Adadelta 1.0 with StepLR per epoch, batch 64 per
process, 3 epochs of the 8,000 embedded digits, validation on the other 2,000 after each) written as a bare loop, with
HF accelerate, with PyTorch Lightning (when installed) and through `scaletrain.fit` (no DataLoader workers, no
tracker), beside two more sides of fit: a `scaletrain.Step` whose train_step returns the very `F.nll_loss(model(x),
y)` fit computes (bitwise the same weights: what a step of the user's own costs), and fit with its defaults (workers
and tracker as scaletrain decides them). On 1 process and on 2 under torchrun (the bare loop on 1 only). Figure: the
training seconds of the epochs after the first (the training loop alone, no validation), median per side, and
scaletrain fit's speed over each side (>= 1: fit at least as fast).

`--case results`: each example that brings its own step, run as a user runs it (`python examples/X.py --out DIR
--seed S`), against the loop of the script it was converted from, written here over the same Dataset, model,
optimizer and schedule classes, with the same seed: the result each ends with, and the whole process's seconds.
- mnist_steplr: PyTorch's MNIST example (StepLR after each epoch); validation accuracy.
- nlp_bert: accelerate's nlp_example (`model(**batch).loss`, a linear warm-up per batch); accuracy and F1.
- detect_boxes: torchvision's detection tutorial; box mAP.
- dcgan_digits: PyTorch's DCGAN example; how sure a digit classifier is of 1,000 generated digits, digits covered.
- simclr_digits: a SimCLR loop (NT-Xent, Adam); nearest-neighbour accuracy on the validation digits.

    python benchmarks/own_loops.py --case speed --rounds 3         # about 15 minutes on 2 cores
    python benchmarks/own_loops.py --case speed --rounds 5 --nproc 1 --sides bare,fit,fit-step
    python benchmarks/own_loops.py --case results --seeds 2        # every example: about 15 minutes
    python benchmarks/own_loops.py --case results --only mnist_steplr,nlp_bert --seeds 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import _harness as h

EXAMPLES = h.ROOT / "examples"
EPOCHS, BATCH, SEED = 3, 64, 1


# -- speed: the MNIST example's loop, five ways -------------------------------------------------------------------
def _parts():
    sys.path.insert(0, str(EXAMPLES))
    from mnist_steplr import Digits, Net  # the example's own classes

    return Digits(0, 8000), Digits(8000, 10000), Net


def _say(epoch: int, seconds: float, accuracy: float) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"epoch {epoch}/{EPOCHS} val_accuracy {accuracy:.4f} {seconds:.3f}s", flush=True)


def bare(out: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    train, val, Net = _parts()
    torch.manual_seed(SEED)
    model = Net()
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    loader, val_loader = DataLoader(train, BATCH, shuffle=True), DataLoader(val, 1000)
    for epoch in range(1, EPOCHS + 1):
        model.train()
        t0 = time.perf_counter()
        for x, y in loader:
            opt.zero_grad()
            F.nll_loss(model(x), y).backward()
            opt.step()
        seconds = time.perf_counter() - t0
        model.eval()
        with torch.no_grad():
            correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in val_loader)
        sched.step()
        _say(epoch, seconds, correct / len(val))


def accelerate(out: str) -> None:
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    train, val, Net = _parts()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(SEED)
    model = Net()
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    model, opt, loader, val_loader = accelerator.prepare(model, opt, DataLoader(train, BATCH, shuffle=True),
                                                         DataLoader(val, 1000))
    for epoch in range(1, EPOCHS + 1):
        model.train()
        t0 = time.perf_counter()
        for x, y in loader:
            opt.zero_grad()
            accelerator.backward(F.nll_loss(model(x), y))
            opt.step()
        seconds = time.perf_counter() - t0
        model.eval()
        correct = 0
        with torch.no_grad():
            for x, y in val_loader:
                guess, y = accelerator.gather_for_metrics((model(x).argmax(1), y))
                correct += int((guess == y).sum())
        sched.step()
        _say(epoch, seconds, correct / len(val))
    accelerator.end_training()


def lightning(out: str) -> None:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    train, val, Net = _parts()

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.t0, self.seconds = Net(), 0.0, 0.0

        def training_step(self, batch, _):
            return F.nll_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch, _):
            self.log("val_accuracy", (self.net(batch[0]).argmax(1) == batch[1]).float().mean(), sync_dist=True)

        def configure_optimizers(self):
            opt = torch.optim.Adadelta(self.parameters(), lr=1.0)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]

        def on_train_epoch_start(self):
            self.t0 = time.perf_counter()

        def on_validation_start(self):  # the epoch's training loop has ended
            self.seconds = time.perf_counter() - self.t0

        def on_train_epoch_end(self):
            _say(self.current_epoch + 1, self.seconds, float(self.trainer.callback_metrics["val_accuracy"]))

    torch.manual_seed(SEED)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                        num_sanity_val_steps=0, enable_progress_bar=False, enable_checkpointing=False, logger=False,
                        enable_model_summary=False, default_root_dir=out)
    trainer.fit(Module(), DataLoader(train, BATCH, shuffle=True), DataLoader(val, 1000))


def fit(out: str, defaults: bool = False, step: bool = False) -> None:
    """`defaults`: nothing set beyond the run folder, the epochs, the batch and the seed; else no DataLoader workers
    and no tracker, set by hand. `step`: a Step whose train_step returns the loss fit computes itself."""
    import torch
    import torch.nn.functional as F

    import scaletrain

    class Plain(scaletrain.Step):
        def train_step(self, model, batch):
            x, y = batch
            return F.nll_loss(model(x), y)

    train, val, Net = _parts()
    torch.manual_seed(SEED)
    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size = EPOCHS, BATCH
    config.run.output_dir, config.run.seed = out, SEED
    if not defaults:
        config.data.num_workers, config.run.log_with = 0, "none"
    scaletrain.fit(Net(), train, val, config, loss_fn=F.nll_loss, step=Plain() if step else None,
                   optimizer=lambda params: torch.optim.Adadelta(params, lr=1.0),
                   scheduler=scaletrain.Schedule(lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.7),
                                                 interval="epoch"))
    for row in h.metrics(Path(out)) if int(os.environ.get("RANK", "0")) == 0 else []:
        _say(int(row["epoch"]), row["epoch_seconds"], row["val_accuracy"])


SIDES = {"bare": (bare, {}), "accelerate": (accelerate, {}), "lightning": (lightning, {}), "fit": (fit, {}),
         "fit-step": (fit, {"step": True}), "fit-defaults": (fit, {"defaults": True})}


def speed(args: argparse.Namespace, work: Path) -> tuple[list[dict], dict]:
    sides = [s for s in (args.sides.split(",") if args.sides else SIDES)
             if s != "lightning" or importlib.util.find_spec("lightning")]  # Lightning is not scaletrain's dependency
    plans = [(n, s) for n in args.nproc for s in sides if n == 1 or s != "bare"]
    seconds: dict[str, list] = {f"{s}, {n} process(es)": [] for n, s in plans}
    for k, (n, side) in h.turns(plans, args.rounds):
        fn, kwargs = SIDES[side]
        r = h.run(h.job(fn, nproc=n, out=str(work / f"{side}-{n}-{k}"), **kwargs), env=h.env(), cwd=work,
                  log=work / f"{side}-{n}-{k}").check(side)
        seconds[f"{side}, {n} process(es)"].append(h.median(e["train_seconds"] for e in h.epochs(r)[1:]))
        print(f"round {k + 1}, {side} on {n}: {seconds[f'{side}, {n} process(es)'][-1]:.3f} s", flush=True)
    rows = []
    for name, values in seconds.items():
        ours = h.median(seconds.get(f"fit, {name.split(', ')[-1]}", []))
        rows.append({"side": name, "training s per epoch (median)": h.median(values), "values": values,
                     "fit's speed over it": h.ratio(h.median(values), ours)})
    return rows, {"epochs": EPOCHS, "batch": BATCH}


# -- results: each converted example against its own loop -------------------------------------------------------
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
    criterion = nn.BCEWithLogitsLoss()  # the example's discriminator gives logits
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


def loop(name: str, seed: int, out: str) -> dict:
    """One example's own loop, in a process of its own (h.job)."""
    sys.path.insert(0, str(EXAMPLES))
    Path(out).mkdir(parents=True, exist_ok=True)
    return LOOPS[name](seed, Path(out))


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


def results(args: argparse.Namespace, work: Path) -> tuple[list[dict], dict]:
    sys.path.insert(0, str(EXAMPLES))
    env = h.env(PYTHONPATH=os.pathsep.join([str(EXAMPLES), h.env()["PYTHONPATH"]]))
    names = args.only.split(",") if args.only else list(LOOPS)
    plans = [(name, seed, way) for name in names for seed in range(args.first_seed, args.first_seed + args.seeds)
             for way in ("loop", "fit")]
    runs = []
    for _, (name, seed, way) in h.turns(plans, 1):
        out = work / f"{name}-{way}-{seed}"
        cmd = [sys.executable, str(EXAMPLES / f"{name}.py"), "--out", str(out), "--seed", str(seed)] if way == "fit" \
            else h.job(loop, name=name, seed=seed, out=str(out))
        r = h.run(cmd, env=env, cwd=work, log=work / f"{name}-{way}-{seed}").check(f"{name} ({way})")
        summary = json.loads((out / "summary.json").read_text()) if way == "fit" else {}
        got = {k: summary[f"final_{k}"] for k in RESULTS[name] if f"final_{k}" in summary} if way == "fit" \
            else r.result()
        if name == "dcgan_digits":
            got.update(gan_quality(out / "last.safetensors", work))
        runs.append({"example": name, "way": way, "seed": seed, "seconds": r.seconds, **got})
        print(f"{name} seed {seed} {way}: {got} ({r.seconds:.1f} s)", flush=True)
    rows = []
    for name in names:
        for key in RESULTS[name]:
            side = {way: [x for x in runs if x["example"] == name and x["way"] == way] for way in ("loop", "fit")}
            rows.append({"example": name, "result": key, "its own loop": [x[key] for x in side["loop"]],
                         "through fit": [x[key] for x in side["fit"]],
                         "medians, loop / fit": [h.median(x[key] for x in side[w]) for w in ("loop", "fit")],
                         "whole process, s, loop / fit": [h.median(x["seconds"] for x in side[w])
                                                          for w in ("loop", "fit")]})
    return rows, {"runs": runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=("speed", "results"), required=True)
    p.add_argument("--rounds", type=int, default=3, help="speed: rounds of every side")
    p.add_argument("--nproc", type=int, choices=(1, 2), action="append", help="speed: 1 process, 2, or both "
                   "(repeat the flag) [default: both]")
    p.add_argument("--sides", default="", help=f"speed: comma-separated sides [default: all]: {', '.join(SIDES)}")
    p.add_argument("--only", default="", help=f"results: comma-separated examples [default: all]: {', '.join(LOOPS)}")
    p.add_argument("--seeds", type=int, default=2, help="results: seeds per example and way")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--work-dir")
    p.add_argument("--out", help="the JSON record [default: results/own_loops_<case>.json]")
    args = p.parse_args()
    args.nproc = args.nproc or [1, 2]
    work = h.work_dir(f"own-loops-{args.case}", args.work_dir)
    rows, extra = (speed if args.case == "speed" else results)(args, work)
    h.record(f"own_loops_{args.case}", rows, args.out, title=f"own loops: {args.case}", **extra)


if __name__ == "__main__":
    h.main(main, bare, accelerate, lightning, fit, loop)
