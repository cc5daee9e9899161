"""A user's Step at the edges the examples do not reach, in one process: gradients inside the step (a WGAN-GP
critic's gradient penalty), a Step's own state (a counter that decides when the generator steps) kept through the
first batch's checks and through a resume, a module the Step shares with the model, an eval_step that gathers,
predict on items of the keys the model's forward takes, and a setting's value refused by name through the API.
(The same on 2 processes: tests/test_steps_distributed.py.)"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import scaletrain
from scaletrain.errors import UserError

from helpers import Digits
from test_steps import GAN, KeywordModel, Tokens


def _config(out="", epochs=1, batch_size=32):
    cfg = scaletrain.TrainConfig()
    cfg.optim.epochs, cfg.optim.batch_size = epochs, batch_size
    cfg.data.num_workers = 0
    cfg.run.output_dir = str(out)
    return cfg


class WGANGP(scaletrain.Step):
    """A WGAN-GP: the critic every batch, with the gradient penalty of Gulrajani et al. (the critic's gradient at
    points between real and fake images, through autograd.grad with create_graph); the generator every
    `every`-th batch, counted by the step itself (its state)."""

    def __init__(self, every: int = 3):
        self.every, self.batches = every, 0

    def optimizers(self, model):
        return {"critic": torch.optim.Adam(model.discriminator.parameters(), lr=1e-3, betas=(0.5, 0.9)),
                "generator": torch.optim.Adam(model.generator.parameters(), lr=1e-3, betas=(0.5, 0.9))}

    def train_step(self, model, batch):
        real = batch[0].flatten(1) * 2 - 1
        fake = model.generator(torch.randn(len(real), 8, device=real.device))
        alpha = torch.rand(len(real), 1, device=real.device)
        mix = (alpha * real + (1 - alpha) * fake.detach()).requires_grad_(True)
        grad, = torch.autograd.grad(model.discriminator(mix).sum(), mix, create_graph=True)
        penalty = ((grad.norm(dim=1) - 1) ** 2).mean()
        loss_c = model.discriminator(fake.detach()).mean() - model.discriminator(real).mean() + 10 * penalty
        self.optimize("critic", loss_c)
        self.batches += 1
        if self.batches % self.every == 0:
            self.optimize("generator", -model.discriminator(fake).mean())
        return {"critic": loss_c, "penalty": penalty}

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = state["batches"]


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_a_wgan_gp_critic_takes_gradients_inside_its_step_and_trains(mnist, tmp_path, precision):
    """The first batch's checks run with autograd as training does (they ran without, and autograd.grad raised
    'element 0 of tensors does not require grad'); they count for nothing: the step's counter is the batches
    trained, 8, and the generator stepped on batches 3 and 6. (fp16 on a GPU: the GPU suite's own-steps row.)"""
    model, step = GAN(), WGANGP()
    g0, c0 = model.generator[0].weight.clone(), model.discriminator[1].weight.clone()
    cfg = _config(tmp_path, epochs=2)
    cfg.run.mixed_precision = precision
    result = scaletrain.fit(model, Digits(mnist, 0, 128), None, cfg, step=step)
    assert step.batches == 8
    assert not torch.equal(g0, model.generator[0].weight) and not torch.equal(c0, model.discriminator[1].weight)
    assert all(torch.isfinite(torch.tensor(row["train_penalty"])) for row in result.history)
    folder = sorted((tmp_path / "state").iterdir())[-1]
    assert torch.load(folder / "rank-0.step.pt", weights_only=True) == {"batches": 8}
    adam = {int(k.split(".")[0]): v for k, v in load_file(folder / "optimizer.safetensors").items()
            if k.endswith(".step")}
    assert {float(v) for k, v in adam.items() if k < 4} == {8.0}  # the critic's 4 tensors: every batch
    assert {float(v) for k, v in adam.items() if k >= 4} == {2.0}  # the generator's: batches 3 and 6


def test_a_steps_counter_is_restored_on_resume_and_the_run_ends_as_an_uninterrupted_one(mnist, tmp_path,
                                                                                         monkeypatch):
    """Killed after batch 9 with checkpoints every 2 steps: resumed from step 8, the counter must say 8, else the
    generator steps on other batches and the weights differ."""
    def run(out):
        cfg = _config(out, epochs=3)
        cfg.run.checkpoint_every = 2
        step = WGANGP()
        scaletrain.fit(GAN(), Digits(mnist, 0, 128), None, cfg, step=step)
        return step

    whole = run(tmp_path / "whole")
    monkeypatch.setenv("SCALETRAIN_FAULT", "raise:9")
    with pytest.raises(RuntimeError, match="fault injected"):
        run(tmp_path / "cut")
    monkeypatch.delenv("SCALETRAIN_FAULT")
    resumed = run(tmp_path / "cut")
    assert json.loads((tmp_path / "cut" / "resumes.jsonl").read_text())["step"] == 8
    assert resumed.batches == whole.batches == 12
    a, b = (load_file(tmp_path / d / "last.safetensors") for d in ("whole", "cut"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_step_state_a_checkpoint_cannot_hold_is_refused_before_the_first_step(mnist, tmp_path):
    class Holding(WGANGP):
        def state_dict(self):
            return {"batches": self.batches, "rng": torch.Generator()}

    with pytest.raises(UserError, match=r"Holding.state_dict\(\)\['rng'\] is a Generator, which a checkpoint "
                                        r"cannot hold"):
        scaletrain.fit(GAN(), Digits(mnist, 0, 64), None, _config(tmp_path / "run"), step=Holding())
    assert not (tmp_path / "run" / "state").exists()


def test_an_optimize_whose_loss_reaches_none_of_its_parameters_is_named(mnist, tmp_path):
    """In fp16 it was GradScaler's 'No inf checks were recorded for this optimizer'; in fp32 nothing stepped."""
    class Detached(WGANGP):
        def train_step(self, model, batch):
            real = batch[0].flatten(1) * 2 - 1
            fake = model.generator(torch.randn(len(real), 8, device=real.device))
            self.optimize("critic", model.discriminator(fake.detach()).mean() - model.discriminator(real).mean())
            self.optimize("generator", -model.discriminator(fake.detach()).mean())  # the generator cut off
            return model.discriminator(real).mean()

    with pytest.raises(UserError, match=r"Step.optimize\('generator', loss\): the loss reaches none of optimizer "
                                        r"'generator''s parameters on any process"):
        scaletrain.fit(GAN(), Digits(mnist, 0, 64), None, _config(tmp_path / "run"), step=Detached())


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))


class SharedEncoder(scaletrain.Step):
    """A step that keeps a handle on the model's first layer (`self.encoder = model[1]`) and calls it itself."""

    def __init__(self, model):
        self.encoder, self.head = model[1], model[3]

    def train_step(self, model, batch):
        x, y = batch
        return F.cross_entropy(self.head(F.relu(self.encoder(x.flatten(1)))), y)


def test_a_module_the_step_shares_with_the_model_trains_with_it(mnist):
    """It was frozen without a word (put in evaluation mode, its gradients off) as a teacher would be."""
    model = _net()
    before = model[1].weight.clone()
    scaletrain.fit(model, Digits(mnist, 0, 128), None, _config(), step=SharedEncoder(model),
                   optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert model[1].weight.requires_grad and not torch.equal(before, model[1].weight)


def test_a_module_mixing_the_models_parameters_with_its_own_is_refused_by_name(mnist):
    class Mixed(scaletrain.Step):
        def __init__(self, model):
            self.probe = nn.Sequential(model[1], nn.Linear(32, 2))

        def train_step(self, model, batch):
            return self.probe(batch[0].flatten(1)).sum()

    model = _net()
    with pytest.raises(UserError, match=r"Step attribute 'probe' \(Sequential\) holds the model's parameters "
                                        r"\(0.weight and more\) beside parameters of its own"):
        scaletrain.fit(model, Digits(mnist, 0, 64), None, _config(), step=Mixed(model))


class Retrieval(scaletrain.Step):
    """Validation as retrieval: each item's nearest neighbour among every process's items of the batch step
    (gathered), scored right when it has the same label."""

    def train_step(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    def eval_step(self, model, batch):
        x, y = batch
        z = F.normalize(model(x), dim=1)
        gallery, labels = self.all_gather(z), self.all_gather(y)
        similar = z @ gallery.T
        similar[similar > 1 - 1e-6] = -2  # not itself
        return labels[similar.argmax(1)], y


class RetrievalGathered(Retrieval):
    """Returns every process's rows, as accelerate's gather_for_metrics users write an evaluation step."""

    def eval_step(self, model, batch):
        found, y = super().eval_step(model, batch)
        return self.all_gather(found), self.all_gather(y)


def test_an_eval_step_that_gathers_scores_its_own_rows_and_is_not_blamed_for_the_gathered_ones(mnist, tmp_path):
    """Its output for one item held every rank's rows and was refused as 'the model returned ... for one item'."""
    model = _net()
    hits = lambda found, y: (found == y).float()  # noqa: E731
    cfg = _config(tmp_path)
    cfg.optim.monitor_mode = "max"
    result = scaletrain.fit(model, Digits(mnist, 0, 128), Digits(mnist, 128, 153), cfg,
                            step=Retrieval(), metrics={"recall_at_1": hits},
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    cfg = _config(batch_size=8)
    scored = scaletrain.evaluate(model, Digits(mnist, 128, 153), cfg, step=Retrieval(), metrics={"recall_at_1": hits})
    assert scored["samples"] == 25 and 0 <= scored["recall_at_1"] <= 1
    assert result.history[-1]["val_samples"] == 25


class Unlabelled(Tokens):
    """Tokens as a test set gives them: input_ids and attention_mask, no labels."""

    def __getitem__(self, i):
        item = super().__getitem__(i)
        del item["labels"]
        return item


def test_predict_calls_a_model_with_the_items_keys_and_gives_its_logits_in_dataset_order(mnist):
    """A Hugging Face-shaped text classifier: predict refused its items (no input key); evaluate took them."""
    model = KeywordModel()
    cfg = _config(batch_size=16)
    out = scaletrain.predict(model, Unlabelled(mnist, 0, 40), cfg)
    data = Unlabelled(mnist, 0, 40)
    with torch.no_grad():
        one_by_one = torch.cat([model(**{k: v[None] for k, v in data[i].items()}).logits for i in range(40)])
    assert out.shape == (40, 10) and torch.allclose(out, one_by_one, atol=1e-6)
    padded = scaletrain.predict(model, Unlabelled(mnist, 0, 40), cfg,
                                collate_fn=lambda items: {k: torch.stack([i[k] for i in items]) for k in items[0]})
    assert torch.equal(out, padded)  # the script's own collate_fn


def test_predict_refuses_outputs_whose_shape_changes_from_batch_to_batch(mnist):
    class PerToken(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(3, 4)

        def forward(self, input_ids, attention_mask=None):
            return self.embed(input_ids)

    def ragged(items):  # pads each batch to its own length, as a collator does
        length = 20 if len(items) == 16 else 24
        return {k: torch.stack([i[k][:length] for i in items]) for k in items[0]}

    with pytest.raises(UserError, match=r"predict: the model's outputs are 20 x 4 per item in one batch and 24 x 4 "
                                        r"in another; pad every item to one length"):
        scaletrain.predict(PerToken(), Unlabelled(mnist, 0, 40), _config(batch_size=16), collate_fn=ragged)


@pytest.mark.parametrize("section, name, value, expected", [
    ("run", "strategy", "tensor", r"config.run.strategy \(--strategy\): 'tensor' is not one of ddp, dp, fsdp, pipeline"),
    ("optim", "epochs", "3", r"config.optim.epochs \(--epochs\): expected an integer, got '3'"),
    ("run", "mixed_precision", "fp8", r"config.run.mixed_precision \(--mixed-precision\): 'fp8' is not one of"),
])
def test_a_setting_value_given_through_the_api_is_refused_naming_the_setting_and_the_choices(mnist, section, name,
                                                                                           value, expected):
    cfg = _config()
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(UserError, match=expected):
        scaletrain.fit(_net(), Digits(mnist, 0, 64), None, cfg)
