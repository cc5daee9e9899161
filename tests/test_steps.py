"""A user's own step through fit and evaluate, in one process: a model called with the batch's keys and its own
loss, a Step with named losses, a frozen teacher, several optimizers, and every mistake refused on one line before
the first step with nothing written; what a Step cannot do alongside other settings is refused by name."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import Dataset

import scaletrain
from scaletrain.errors import UserError

from helpers import Digits



class Tokens(Dataset):
    """Items as a tokenizer and datasets.map give them: input_ids, attention_mask (the last ones padding), labels."""

    def __init__(self, mnist, start, stop):
        x = (mnist.images[start:stop].float().flatten(1)[:, ::28] > 0).long()  # 28 "tokens" per image
        self.ids, self.y = x + 1, mnist.labels[start:stop]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        mask = torch.ones(28, dtype=torch.long)
        mask[20:] = 0
        return {"input_ids": self.ids[i], "attention_mask": mask, "labels": int(self.y[i])}


class KeywordModel(nn.Module):
    """A Hugging Face-shaped model: forward(input_ids, attention_mask, labels) -> an object with .loss and .logits;
    its loss is cross-entropy x 2 (so that using it, not scaletrain's, shows); it records the masks it was given."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(3, 8), nn.Linear(8, 10)
        self.masks = []

    def forward(self, input_ids, attention_mask=None, labels=None):
        self.masks.append(attention_mask)
        h = (self.embed(input_ids) * attention_mask[..., None]).sum(1) / attention_mask.sum(1, keepdim=True)
        logits = self.head(h)
        loss = None if labels is None else 2 * F.cross_entropy(logits, labels)
        return SimpleNamespace(loss=loss, logits=logits)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))


def _config(out="", epochs=1, batch_size=32):
    cfg = scaletrain.TrainConfig()
    cfg.optim.epochs, cfg.optim.batch_size = epochs, batch_size
    cfg.data.num_workers = 0
    cfg.run.output_dir = str(out)
    return cfg


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def test_a_model_whose_forward_takes_the_items_keys_is_called_with_them_and_trains_on_its_own_loss(mnist):
    model = KeywordModel()
    result = scaletrain.fit(model, Tokens(mnist, 0, 128), Tokens(mnist, 128, 192), _config(epochs=2),
                            optimizer=_sgd)
    assert all(m is not None and int(m[0].sum()) == 20 for m in model.masks)  # the padding mask reached it
    row = result.history[-1]
    assert set(row) >= {"train_loss", "val_loss", "val_accuracy"} and row["val_samples"] == 64
    model.eval()
    with torch.no_grad():  # the validation loss is the model's own (2 x cross-entropy), averaged over the items
        batch = torch.utils.data.default_collate([Tokens(mnist, 128, 192)[i] for i in range(64)])
        out = model(**batch)
    assert row["val_loss"] == pytest.approx(out.loss.item(), rel=1e-5)
    assert row["val_accuracy"] == pytest.approx((out.logits.argmax(1) == batch["labels"]).float().mean().item())
    scores = scaletrain.evaluate(model, Tokens(mnist, 128, 192), _config())
    assert scores["loss"] == pytest.approx(row["val_loss"], rel=1e-6) and scores["samples"] == 64


def test_a_key_the_models_forward_does_not_take_is_refused_naming_it(mnist):
    class Extra(Tokens):
        def __getitem__(self, i):
            return {**super().__getitem__(i), "idx": i}

    with pytest.raises(UserError, match=r"train_data: item 0 is a dict .*; the model's forward takes input_ids, "
                                        r"attention_mask, labels by name but not 'idx': leave them out"):
        scaletrain.fit(KeywordModel(), Extra(mnist, 0, 64), None, _config(), optimizer=_sgd)


class Points(Dataset):
    """Items of the user's own key names: {"coords": 2 values, "ring": a class}."""

    def __init__(self, n):
        self.x = torch.randn(n, 2, generator=torch.Generator().manual_seed(0))
        self.y = (self.x.norm(dim=1) > 1).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"coords": self.x[i], "ring": self.y[i]}


class PointNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(2, 2)

    def forward(self, coords):
        return self.body(coords)


def test_an_input_and_a_label_under_ones_own_key_names_are_refused_naming_batch_keys_which_then_trains():
    with pytest.raises(UserError, match=r"takes coords by name but not 'ring': leave them out of the items \(or your "
                                        r"collate_fn\); if they are the input and its label, say so with "
                                        r"batch_keys=\('coords', 'ring'\)$"):
        scaletrain.fit(PointNet(), Points(64), None, _config(), optimizer=_sgd)
    result = scaletrain.fit(PointNet(), Points(64), Points(32), _config(), optimizer=_sgd,
                            batch_keys=("coords", "ring"))
    assert result.history[-1]["val_samples"] == 32
    with pytest.raises(UserError, match=r"^dataset: .*batch_keys=\('coords', 'ring'\)$"):
        scaletrain.predict(PointNet(), Points(32), _config())
    assert scaletrain.predict(PointNet(), Points(32), _config(), batch_keys=("coords", "ring")).shape == (32, 2)


class TwoHeads(scaletrain.Step):
    """Cross-entropy and a penalty on the logits' size, as two named losses."""

    def train_step(self, model, batch):
        x, y = batch
        logits = model(x)
        return {"ce": F.cross_entropy(logits, y), "size": 1e-3 * logits.pow(2).mean()}


def test_a_steps_named_losses_are_summed_and_each_becomes_a_column(mnist, tmp_path, capsys):
    result = scaletrain.fit(_net(), Digits(mnist, 0, 128), Digits(mnist, 128, 160), _config(tmp_path, epochs=2),
                            step=TwoHeads())
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header[:5] == ["epoch", "train_loss", "train_ce", "train_size", "val_loss"]
    row = result.history[-1]
    assert row["train_loss"] == pytest.approx(row["train_ce"] + row["train_size"], rel=1e-5)
    assert "val_accuracy" in row  # validation is fit's own: model(x) against y
    assert "train_ce " in capsys.readouterr().out


class Plain(scaletrain.Step):
    def train_step(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)


def test_a_step_that_computes_the_default_loss_trains_to_the_same_weights(mnist, tmp_path):
    train, val = Digits(mnist, 0, 128), Digits(mnist, 128, 160)
    scaletrain.fit(_net(), train, val, _config(tmp_path / "default", epochs=2))
    scaletrain.fit(_net(), train, val, _config(tmp_path / "step", epochs=2), step=Plain())
    default, own = (load_file(tmp_path / d / "last.safetensors") for d in ("default", "step"))
    assert default.keys() == own.keys() and all(torch.equal(default[k], own[k]) for k in default)


def test_a_step_with_gradient_accumulation_trains_as_fits_own_step_with_it(mnist, tmp_path):
    train = Digits(mnist, 0, 128)
    for name, step in (("default", None), ("step", Plain())):
        cfg = _config(tmp_path / name, epochs=1, batch_size=16)
        cfg.optim.grad_accum = 2
        scaletrain.fit(_net(), train, None, cfg, step=step)
    default, own = (load_file(tmp_path / d / "last.safetensors") for d in ("default", "step"))
    assert all(torch.equal(default[k], own[k]) for k in default)


class Distil(scaletrain.Step):
    """A student learns the frozen teacher's soft labels and the true ones."""

    def __init__(self, teacher):
        self.teacher = teacher

    def train_step(self, model, batch):
        x, y = batch
        assert not self.teacher.training and x.device == next(self.teacher.parameters()).device
        with torch.no_grad():
            soft = F.softmax(self.teacher(x) / 2, dim=1)
        logits = model(x)
        return {"hard": F.cross_entropy(logits, y), "soft": F.kl_div(F.log_softmax(logits / 2, dim=1), soft,
                                                                     reduction="batchmean")}


def test_a_frozen_teacher_is_moved_kept_in_evaluation_mode_and_never_trained(mnist, tmp_path):
    torch.manual_seed(1)
    teacher = nn.Sequential(nn.Flatten(), nn.Linear(784, 10), nn.Dropout(0.5)).train()
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    scaletrain.fit(_net(), Digits(mnist, 0, 128), Digits(mnist, 128, 160), _config(tmp_path), step=Distil(teacher))
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())
    assert set(load_file(tmp_path / "last.safetensors")) == set(_net().state_dict())  # the student's alone


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 784), nn.Tanh())
        self.discriminator = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))


class Adversarial(scaletrain.Step):
    def optimizers(self, model):
        return {"discriminator": torch.optim.Adam(model.discriminator.parameters(), lr=1e-3),
                "generator": torch.optim.Adam(model.generator.parameters(), lr=1e-3)}

    def train_step(self, model, batch):
        real = batch[0] * 2 - 1
        fake = model.generator(torch.randn(len(real), 8, device=real.device)).view_as(real)
        ones, zeros = torch.ones(len(real), 1, device=real.device), torch.zeros(len(real), 1, device=real.device)
        loss_d = F.binary_cross_entropy_with_logits(model.discriminator(real), ones) + \
            F.binary_cross_entropy_with_logits(model.discriminator(fake.detach()), zeros)
        self.optimize("discriminator", loss_d)
        loss_g = F.binary_cross_entropy_with_logits(model.discriminator(fake), ones)
        self.optimize("generator", loss_g)
        return {"d": loss_d, "g": loss_g}


def test_two_optimizers_are_each_stepped_once_per_batch_by_the_step(mnist, tmp_path):
    model = GAN()
    d0, g0 = model.discriminator[1].weight.clone(), model.generator[0].weight.clone()
    result = scaletrain.fit(model, Digits(mnist, 0, 128), None, _config(tmp_path, epochs=2), step=Adversarial())
    assert not torch.equal(d0, model.discriminator[1].weight) and not torch.equal(g0, model.generator[0].weight)
    train = sorted((tmp_path / "state").iterdir())[-1]
    saved = json.loads((train / "train.json").read_text())
    assert saved["step"] == 8 and len(saved["optimizer"]["param_groups"]) == 2
    assert {k.split(".")[0] for k in load_file(train / "optimizer.safetensors")} == {str(i) for i in range(8)}
    assert {"train_d", "train_g"} <= set(result.history[0])


def _killed_and_resumed(monkeypatch, tmp_path, run, at: int):
    """`run(out)` whole, and killed (an exception) after micro-batch `at` with checkpoints every 2 steps, then run
    again: the two runs' last weights."""
    run(tmp_path / "whole")
    monkeypatch.setenv("SCALETRAIN_FAULT", f"raise:{at}")
    with pytest.raises(RuntimeError, match="fault injected"):
        run(tmp_path / "cut")
    monkeypatch.delenv("SCALETRAIN_FAULT")
    run(tmp_path / "cut")
    resumed = json.loads((tmp_path / "cut" / "resumes.jsonl").read_text())
    assert resumed["batch"] == 2  # mid-epoch, from the checkpoint of 2 steps before
    return (load_file(tmp_path / d / "last.safetensors") for d in ("whole", "cut"))


def test_a_gan_killed_mid_epoch_resumes_to_the_same_weights(mnist, tmp_path, monkeypatch):
    def run(out):
        cfg = _config(out, epochs=2)
        cfg.run.checkpoint_every = 2
        scaletrain.fit(GAN(), Digits(mnist, 0, 192), None, cfg, step=Adversarial())

    whole, cut = _killed_and_resumed(monkeypatch, tmp_path, run, at=9)  # epoch 2, after step 8's checkpoint
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    rows = [list(csv.DictReader((tmp_path / d / "metrics.csv").open())) for d in ("whole", "cut")]
    assert [(r["train_d"], r["train_g"]) for r in rows[0]] == [(r["train_d"], r["train_g"]) for r in rows[1]]


class Contrastive(scaletrain.Step):
    """Two noisy views of each digit (drawn inside the step, from torch's generator), an InfoNCE loss."""

    def train_step(self, model, batch):
        x, _ = batch
        z1 = F.normalize(model(x + 0.1 * torch.randn_like(x)), dim=1)
        z2 = F.normalize(model(x + 0.1 * torch.randn_like(x)), dim=1)
        z1, z2 = self.all_gather(z1), self.all_gather(z2)
        return F.cross_entropy(z1 @ z2.T / 0.2, torch.arange(len(z1), device=z1.device))

    def eval_step(self, model, batch):
        x, y = batch
        return model(x), y


def test_a_contrastive_run_killed_mid_epoch_resumes_to_the_same_weights(mnist, tmp_path, monkeypatch):
    def run(out):
        cfg = _config(out, epochs=2)
        cfg.run.checkpoint_every, cfg.optim.monitor_mode = 2, "max"
        scaletrain.fit(_net(), Digits(mnist, 0, 192), Digits(mnist, 192, 224), cfg, step=Contrastive(),
                       metrics={"mean_norm": lambda z, y: z.norm(dim=1)}, optimizer=_sgd)

    whole, cut = _killed_and_resumed(monkeypatch, tmp_path, run, at=3)
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    header = (tmp_path / "whole" / "metrics.csv").read_text().splitlines()[0]
    assert "val_mean_norm" in header and "val_accuracy" not in header and "val_loss" not in header


@pytest.mark.parametrize("returned, expected", [
    (None, r"train_step returned a NoneType; expected the batch's loss, a scalar tensor, or a dict"),
    ([1.0], r"train_step returned a list of 1 .*; expected the batch's loss"),
    ("vector", r"train_step returned a float32 tensor 32; expected a floating-point scalar tensor"),
    ("dict", r"train_step\['ce'\] returned a float; expected a floating-point scalar tensor"),
    ("named loss", r"train_step returned a loss named 'loss'; expected names of letters, digits and _"),
])
def test_a_train_step_that_returns_no_scalar_loss_is_refused_before_the_first_step(mnist, tmp_path, returned,
                                                                                      expected):
    class Wrong(scaletrain.Step):
        def train_step(self, model, batch):
            x, y = batch
            losses = F.cross_entropy(model(x), y, reduction="none")
            return {"vector": losses, "dict": {"ce": 1.0}, "named loss": {"loss": losses.mean()}}.get(
                returned, returned) if isinstance(returned, str) else returned

    with pytest.raises(UserError, match=expected):
        scaletrain.fit(_net(), Digits(mnist, 0, 64), None, _config(tmp_path / "run"), step=Wrong())
    assert not (tmp_path / "run" / "state").exists() and not (tmp_path / "run" / "metrics.csv").exists()


def test_an_eval_step_that_returns_something_else_is_refused(mnist):
    class Wrong(Plain):
        def eval_step(self, model, batch):
            return model(batch[0])

    with pytest.raises(UserError, match=r"eval_step returned a float32 tensor 1 x 10; expected \(outputs, "
                                        r"targets\) or \(outputs, targets, loss\)"):
        scaletrain.fit(_net(), Digits(mnist, 0, 64), Digits(mnist, 64, 96), _config(), step=Wrong())


class Overlapping(Adversarial):
    def optimizers(self, model):
        return {"all": torch.optim.Adam(model.parameters()), "generator": torch.optim.Adam(
            model.generator.parameters())}


class Outside(Adversarial):
    def optimizers(self, model):
        return {"discriminator": torch.optim.Adam(model.discriminator.parameters()),
                "other": torch.optim.Adam(nn.Linear(2, 2).parameters())}


class Unknown(Adversarial):
    def train_step(self, model, batch):
        loss = model.discriminator(batch[0]).mean()
        self.optimize("critic", loss)
        return loss


@pytest.mark.parametrize("step, change, expected", [
    (Overlapping(), None, r"optimizers 'all' and 'generator' share parameters"),
    (Outside(), None, r"optimizer 'other' holds a parameter that is not the model's"),
    (Unknown(), None, r"Step.optimize\('critic'\): the step's optimizers are 'discriminator', 'generator'"),
    (Adversarial(), ("grad_accum", 2), r"--grad-accum 2: a Step with several optimizers \(discriminator, "
                                       r"generator\) steps each once per batch"),
    (Adversarial(), ("optimizer", _sgd), r"optimizer= and scheduler= are for one optimizer"),
])
def test_what_several_optimizers_cannot_do_is_refused_before_the_first_step(mnist, tmp_path, step, change,
                                                                             expected):
    cfg, kwargs = _config(tmp_path / "run"), {}
    if change and change[0] == "grad_accum":
        cfg.optim.grad_accum = 2
    elif change:
        kwargs[change[0]] = change[1]
    with pytest.raises(UserError, match=expected):
        scaletrain.fit(GAN(), Digits(mnist, 0, 64), None, cfg, step=step, **kwargs)
    assert not (tmp_path / "run" / "state").exists()


def test_optimize_with_one_optimizer_says_to_return_the_loss(mnist):
    class One(scaletrain.Step):
        def train_step(self, model, batch):
            loss = F.cross_entropy(model(batch[0]), batch[1])
            self.optimize("only", loss)
            return loss

    with pytest.raises(UserError, match="Step.optimize is for a step with several optimizers"):
        scaletrain.fit(_net(), Digits(mnist, 0, 64), None, _config(), step=One())


def test_a_step_that_is_not_a_step_is_refused(mnist):
    with pytest.raises(UserError, match="step is a function; expected an instance of a subclass of scaletrain.Step"):
        scaletrain.fit(_net(), Digits(mnist, 0, 64), None, _config(), step=lambda m, b: m(b))


def test_a_step_outside_fit_says_what_it_is_given_when(mnist):
    with pytest.raises(RuntimeError, match=r"Step.all_gather is given to a step while fit or evaluate runs it"):
        Contrastive().all_gather(torch.zeros(2))
