"""One batch through the model, as `fit` trains it and as `fit` and `evaluate` score it: scaletrain's own step
(`loss_fn(model(x), y)`), a keyword call (`model(**batch)`: a Hugging Face model and the loss it returns), or a
`Step` of the user's (any call, named losses, several optimizers, an evaluation that differs from training, a
gather that keeps gradients, modules that are not trained).

The loop, the checkpoints, the reductions over ranks and the metrics stay scaletrain's whatever the step: the step
only says what one batch computes. Nothing here talks to other processes itself: what a Step asks of the job (an
optimizer step, a gather) goes through the job's Runtime, which `StepJob` is given and binds to the step while it
runs.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from .errors import UserError, describe
from .metrics import NAME, Loss

class Step:
    """Your script's own step, for `fit(..., step=MyStep())` and `evaluate(..., step=...)`: override what your
    script does differently from `loss_fn(model(x), y)`; scaletrain keeps the loop and every guarantee.

    - `train_step(model, batch)`: the loss of one batch, a scalar tensor, or a dict of named scalar tensors
      (summed for the backward pass, each logged as train_<name>). `batch` is what your collate_fn (or torch's
      default collate) made of the Dataset's items, on the device.
    - `eval_step(model, batch)`: `(outputs, targets)` for the metrics, or `(outputs, targets, loss)` with the
      batch's loss (a scalar, its mean; or one value per sample). Without it, validation scores `model(x)` against
      `y` as fit does by default.
    - `optimizers(model)`: `{name: optimizer}` over the model's parameters. One is used as fit's `optimizer=`
      would be; with several, `train_step` steps each itself with `self.optimize(name, loss)`.

    - `state_dict()` / `load_state_dict(state)`: the step's own state that training changes (a counter, an EMA
      teacher), checkpointed with the run and restored on resume.

    What the job gives a step while it trains: `self.optimize(name, loss)`, `self.all_gather(tensor)` (every
    process's rows, keeping gradients) and `self.device`. Attributes that are `nn.Module`s of their own (a frozen
    teacher) are moved to the device, kept in evaluation mode and never trained; a module the model also holds
    (`self.encoder = model.encoder`) is the model's, and trains with it.
    """

    def train_step(self, model: nn.Module, batch: Any) -> torch.Tensor | dict[str, torch.Tensor]:
        raise NotImplementedError

    def eval_step(self, model: nn.Module, batch: Any) -> tuple:
        raise NotImplementedError

    def optimizers(self, model: nn.Module) -> dict[str, torch.optim.Optimizer] | torch.optim.Optimizer | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        """The step's own state that training changes (a counter that decides when the generator steps, an EMA
        teacher's weights, a queue of negatives): saved in every checkpoint, per process, and given back to
        `load_state_dict` on resume. Tensors, numbers, strings, and lists and dicts of them. Default: nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (on resume, and after the first batch's trial passes)."""

    # -- what the job gives a step ------------------------------------------------------------------------------
    def optimize(self, name: str, loss: torch.Tensor) -> None:
        """Backpropagate `loss` into the parameters of optimizer `name` alone (their gradients cleared first, then
        averaged over the processes), and step it (through the fp16 loss scaler, after --clip-grad-norm)."""
        self._job("optimize").optimize(name, loss)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's `tensor` (the same shape but for the first dimension), concatenated in rank order, with
        gradients flowing back to each process's own rows: a contrastive loss sees the whole global batch."""
        return self._job("all_gather").all_gather(tensor)

    @property
    def device(self) -> torch.device:
        return self._job("device").device

    def _job(self, what: str):
        job = self.__dict__.get("_scaletrain_job")
        if job is None:
            raise RuntimeError(f"Step.{what} is given to a step while fit or evaluate runs it")
        return job


def overrides(step: Step | None, method: str) -> bool:
    """Whether a user's Step defines `method` itself."""
    return step is not None and getattr(type(step), method) is not getattr(Step, method)


def frozen_modules(step: Step, model: nn.Module | None = None) -> dict[str, nn.Module]:
    """The nn.Modules of its own a Step holds as attributes: never trained, in evaluation mode. A module of the
    model's (`self.encoder = model.encoder`) is not among them: it trains with the model. One that mixes the model's
    parameters with others of its own is refused on one line (the others would be neither trained nor saved)."""
    own = {}
    mine = {id(m) for m in model.modules()} if model is not None else set()
    params = {id(p) for p in model.parameters()} if model is not None else set()
    for name, value in vars(step).items():
        if not isinstance(value, nn.Module) or id(value) in mine:
            continue
        named = [(n, id(p) in params) for n, p in value.named_parameters()]
        shared = [n for n, models in named if models]
        if shared and len(shared) == len(named):  # only the model's modules (nn.Sequential(model.body, ...))
            continue
        if shared:
            raise UserError(f"Step attribute {name!r} ({type(value).__name__}) holds the model's parameters "
                            f"({shared[0]}{' and more' if len(shared) > 1 else ''}) beside parameters of its own, "
                            f"which would be neither trained nor saved; put the new layers in the model, or hold "
                            f"only the model's own submodule (self.{name} = model.<submodule>)")
        own[name] = value
    return own


@dataclass
class Scored:
    """One batch scored: what the metrics take (outputs, targets) and, where the step gives one, its loss (a scalar
    mean over the batch, or one value per sample)."""

    outputs: Any
    targets: Any
    loss: torch.Tensor | None = None


class BatchCalls:
    """How one batch reaches the model, for training and for scoring: `loss_fn(model(x), y)` (the default),
    `model(**batch)` (`keywords`), or a user's Step, whose methods take the batch whole. Training returns a scalar
    loss or a dict of named ones (see `parts_of`)."""

    def __init__(self, loss: Loss, step: Step | None = None, keywords: bool = False):
        self.loss, self.step, self.keywords = loss, step, keywords
        self.train_whole = keywords or overrides(step, "train_step")  # the batch handed over as collated
        self.eval_whole = keywords or overrides(step, "eval_step")
        self.label_key: str | None = None  # the keyword batches' targets
        # an eval_step that gathered over the processes (retrieval against every rank's gallery): evaluation then
        # runs in lockstep, a rank out of batches taking part with empty ones, as under a sharded strategy
        self.eval_gathers = False

    def train_losses(self, model: nn.Module, x: Any, y: Any) -> torch.Tensor | dict[str, torch.Tensor]:
        """The loss of one training batch (in autocast). With a Step, `model` is the module whose forward is the
        step (parallel/strategies.StepModule): every call of the model inside it is one forward for DDP."""
        if self.keywords:
            return self._keyword_loss(model(**x.data), x.data)
        if self.train_whole:
            return model(x.data)
        return self.loss(self.loss.outputs(model(x)), y)

    def score(self, model: nn.Module, x: Any, y: Any) -> Scored:
        """One evaluation batch (in autocast, without gradients): outputs and targets for the metrics, and the
        step's loss where it gives one (else the Loss is computed from outputs and targets)."""
        if self.keywords:
            out = model(**x.data)
            targets = x.data.get(self.label_key) if self.label_key else None
            own = None if self.loss.fn is not None else _model_loss(out)
            return Scored(self.loss.outputs(out), targets, own)
        if self.eval_whole:
            job = self.step.__dict__.get("_scaletrain_job")  # type: ignore[union-attr]
            before = job.gathers if job is not None else 0
            if self.eval_gathers and x.size == 0:  # a rank's padding: no rows to add to the others' gather
                x = x.emptied()
            result = scored(self.step.eval_step(model, x.data))  # type: ignore[union-attr]
            gathered = job is not None and job.gathers > before
            self.eval_gathers |= gathered
            return own_rows(result, x.size, job.rows) if gathered else result
        return Scored(self.loss.outputs(model(x)), y)

    def _keyword_loss(self, out: Any, batch: Mapping) -> torch.Tensor:
        if self.loss.fn is not None:
            return self.loss(self.loss.outputs(out), batch[self.label_key] if self.label_key else None)
        loss = _model_loss(out)
        if loss is None:
            raise UserError(f"the model called with the batch's keys ({', '.join(batch)}) returned "
                            f"{describe(out)} without a loss; give it the labels under a key its forward takes "
                            f"(labels), or pass loss_fn")
        return loss


def own_rows(result: Scored, n: int, rows: tuple[int, int, int]) -> Scored:
    """An eval_step's result after it gathered: returned as every process's rows (the gathered batch, as
    accelerate's gather_for_metrics users write it), this process's `n` of them, so that each sample is counted
    once; refused on one line when it is neither this process's rows nor every process's."""
    start, stop, total = rows
    out = result.outputs
    if not isinstance(out, torch.Tensor) or out.ndim == 0 or len(out) == n or total == n:
        return result
    if len(out) != total:
        raise UserError(f"eval_step returned {describe(out)} for a batch of {n} after self.all_gather (every process's "
                        f"rows: {total}); return this process's {n} rows, or every process's as all_gather gave them")

    def mine(value: Any) -> Any:
        return value[start:stop] if isinstance(value, torch.Tensor) and value.ndim and len(value) == total else value

    return Scored(mine(out), mine(result.targets), mine(result.loss))


def _model_loss(out: Any) -> torch.Tensor | None:
    """The loss a model returned with its outputs (a Hugging Face ModelOutput's `loss`, a dict's "loss")."""
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def scored(value: Any) -> Scored:
    """A Step's eval_step result as Scored, refused on one line when it is not (outputs, targets[, loss])."""
    if isinstance(value, tuple) and len(value) in (2, 3):
        return Scored(*value)
    raise UserError(f"eval_step returned {describe(value)}; expected (outputs, targets) or (outputs, targets, "
                    f"loss)")


def parts_of(losses: Any, what: str = "train_step") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the loss to backpropagate, its named parts) of what a training step returned: a scalar tensor (no parts),
    or a dict of scalar tensors (summed). Anything else is refused on one line."""
    if isinstance(losses, torch.Tensor):
        _check_scalar(losses, what)
        return losses, {}
    if isinstance(losses, Mapping) and losses:
        for name, value in losses.items():
            if not isinstance(name, str) or not NAME.match(name) or name in ("loss", "samples"):
                raise UserError(f"{what} returned a loss named {name!r}; expected names of letters, digits and _ "
                                f"(each becomes the column train_<name>), not loss or samples")
            _check_scalar(value, f"{what}[{name!r}]")
        total = sum(losses.values())
        return total, dict(losses)  # type: ignore[return-value]
    raise UserError(f"{what} returned {describe(losses)}; expected the batch's loss, a scalar tensor, or a dict of "
                    f"named scalar tensors")


def _check_scalar(value: Any, what: str) -> None:
    if not isinstance(value, torch.Tensor) or value.ndim != 0 or not value.is_floating_point():
        raise UserError(f"{what} returned {describe(value)}; expected a floating-point scalar tensor (the batch's "
                        f"mean loss)")


class StepJob:
    """What a user's Step is given while fit or evaluate runs it (`bind`): the device and a gather that keeps
    gradients (from the job's Runtime), and, with several optimizers (training/optimizers.NamedOptimizers),
    `optimize`.

    Several optimizers are handled as Lightning's manual optimization is, without its pitfalls: each `optimize`
    clears the gradients of its own parameters before its backward pass (a generator's loss leaves gradients in
    the discriminator; they are not stepped later by mistake), averages them over the processes itself (no DDP
    wrapper, so no "Expected to have finished reduction" whatever the step calls), and the fp16 loss scaler is
    updated once per batch, after every optimizer has stepped (`end_of_batch`)."""

    def __init__(self, runtime: Any, optimizers: Any = None, clip_grad_norm: float = 0.0):
        self.runtime, self.optimizers, self.clip_grad_norm = runtime, optimizers, clip_grad_norm
        self.trial = False  # the check on the first batch: optimize() only checks its loss
        self.stepped: list[str] = []  # this batch's optimizers, in the order the step stepped them
        self.gathers = 0  # all_gather calls so far (BatchCalls.eval_gathers)
        self.rows = (0, 0, 0)  # the last gather's: (this process's first row, its end, every process's rows)

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def manual(self) -> bool:
        """Whether the step runs its optimizers itself (several of them)."""
        return self.optimizers is not None

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.gathers += 1
        gathered, self.rows = self.runtime.all_gather_rows(tensor)
        return gathered

    def optimize(self, name: str, loss: torch.Tensor) -> None:
        if self.optimizers is None:
            raise UserError("Step.optimize is for a step with several optimizers (Step.optimizers returns them "
                            "by name); with one, return the loss from train_step and fit steps it")
        if name not in self.optimizers.optimizers:
            raise UserError(f"Step.optimize({name!r}): the step's optimizers are "
                            f"{', '.join(map(repr, self.optimizers.optimizers))}")
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
            raise UserError(f"Step.optimize({name!r}, loss): the loss is {describe(loss)}; expected a "
                            f"floating-point scalar tensor")
        if self.trial:
            return
        if name in self.stepped:
            raise UserError(f"Step.optimize({name!r}) was called twice for one batch; sum the losses and step once")
        optimizer, runtime = self.optimizers[name], self.runtime
        params = [p for g in optimizer.param_groups for p in g["params"]]
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, enabled=False):  # the backward pass outside the step's autocast
            runtime.backward(loss)
        runtime.average_gradients(params)
        if all(p.grad is None for p in params):  # on every process alike: the averaging told each which got none
            raise UserError(f"Step.optimize({name!r}, loss): the loss reaches none of optimizer {name!r}'s "
                            f"parameters on any process, so there is nothing to step; compute it from the "
                            f"module(s) that optimizer trains (a detached output cuts them off)")
        scaler = runtime.accelerator.scaler
        if self.clip_grad_norm:
            if scaler is not None:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
        if scaler is not None:
            scaler.step(optimizer)
        else:
            optimizer.step()
        self.stepped.append(name)

    def bind(self, step: Step | None, model: nn.Module | None = None) -> StepJob:
        """Give `step` this job (until `unbind`), its own modules (a frozen teacher; not those it shares with
        `model`) on the device, in evaluation mode, without gradients."""
        if step is not None:
            for module in frozen_modules(step, model).values():
                module.to(self.device).eval().requires_grad_(False)
            step.__dict__["_scaletrain_job"] = self
        return self

    @staticmethod
    def unbind(step: Step | None) -> None:
        if step is not None:
            step.__dict__.pop("_scaletrain_job", None)

    @contextmanager
    def unbound_on_error(self, step: Step | None) -> Iterator[None]:
        """`step` unbound when the block raises (a refusal while the run is built)."""
        try:
            yield
        except BaseException:
            self.unbind(step)
            raise

    def end_of_batch(self) -> bool:
        """After a step that ran its optimizers: the fp16 loss scaler updated once, for all of them; False when it
        skipped this batch's steps (an overflow), so the schedule does not advance."""
        scaler = self.runtime.accelerator.scaler
        skipped = False
        if scaler is not None and self.stepped:
            scale = scaler.get_scale()
            scaler.update()
            skipped = scaler.get_scale() < scale
        for name in self.stepped:
            self.optimizers[name].zero_grad(set_to_none=True)  # type: ignore[index]
        self.stepped = []
        return not skipped


