"""Models by name: scaletrain's own small CNNs, or any timm model, made for the data's channels and classes.

timm is imported only when a timm model is asked for (it is slow to import and the default needs none of it).
"""

from __future__ import annotations

import difflib
import types
from typing import Any

import torch
from torch import nn

from .errors import UserError, describe


def _conv_bn(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class SmallCNN(nn.Module):
    """Three conv-BN-ReLU stages with max-pooling, then global pooling and a linear classifier.

    Built for digits-sized inputs: on 28x28 MNIST it reaches ~99% in a few CPU-minutes or less; any input size
    works because the head pools globally.
    """

    def __init__(self, in_chans: int = 1, num_classes: int = 10, widths: tuple[int, int, int] = (32, 64, 128),
                 dropout: float = 0.1):
        super().__init__()
        a, b, c = widths
        self.features = nn.Sequential(
            *_conv_bn(in_chans, a), nn.MaxPool2d(2),
            *_conv_bn(a, b), nn.MaxPool2d(2),
            *_conv_bn(b, c), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(c, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def get_classifier(self) -> nn.Module:
        """The head, named as timm names it, so --freeze backbone treats both alike."""
        return self.head


BUILTIN = {
    "smallcnn": lambda in_chans, num_classes: SmallCNN(in_chans, num_classes),
    "tinycnn": lambda in_chans, num_classes: SmallCNN(in_chans, num_classes, widths=(8, 16, 32), dropout=0.0),
}


def model_names() -> list[str]:
    import timm

    return sorted(BUILTIN) + timm.list_models()


def check_model_name(name: str) -> None:
    """Raise UserError for a name that is neither built in nor in timm, naming the closest ones."""
    if name in BUILTIN:
        return
    import timm

    if timm.is_model(name):
        return
    close = difflib.get_close_matches(name, model_names(), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; built in: " + ", ".join(sorted(BUILTIN))
    raise UserError(f"--model: unknown model '{name}'{hint}")


HUB_WEIGHTS = "timm"  # --pretrained timm: the model's own pretrained weights, through timm and the HF hub


def build_model(name: str, in_chans: int, num_classes: int, hub_weights: bool = False) -> nn.Module:
    """A classifier with `in_chans` input channels and `num_classes` outputs: freshly initialised, or with
    `hub_weights` starting from timm's pretrained weights for `name` (e.g. resnet18.a1_in1k; the default tag
    without one), fetched through the Hugging Face hub into its cache or read from there offline. timm resizes
    the head to `num_classes` and adapts the first convolution to `in_chans`."""
    check_model_name(name)
    if name in BUILTIN:
        if hub_weights:
            raise UserError(f"--pretrained timm: '{name}' is scaletrain's own model; timm has no weights for it")
        return BUILTIN[name](in_chans, num_classes)
    import timm

    if not hub_weights:
        return timm.create_model(name, pretrained=False, in_chans=in_chans, num_classes=num_classes)
    from huggingface_hub import constants

    cfg = timm.models.get_pretrained_cfg(name)
    where = getattr(cfg, "hf_hub_id", None) or name if cfg else name
    if cfg is None:
        raise UserError(f"--pretrained timm: timm has no pretrained weights for '{name}'")
    try:
        return timm.create_model(name, pretrained=True, in_chans=in_chans, num_classes=num_classes)
    except (OSError, RuntimeError, ValueError) as e:
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        raise UserError(f"--pretrained timm: cannot get the weights of '{name}' ({where}){offline}: they are not in "
                        f"the Hugging Face cache {constants.HF_HUB_CACHE} and cannot be downloaded "
                        f"({type(e).__name__}); run once where the hub is reachable, or fill that cache") from None


def hub_normalisation(name: str) -> tuple[list[float], list[float]] | None:
    """The mean and std timm's pretrained weights for `name` expect, or None."""
    import timm

    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is None or not cfg.mean or not cfg.std:
        return None
    return list(cfg.mean), list(cfg.std)


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Tensors from a .safetensors file or a torch checkpoint, never unpickling arbitrary objects."""
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--pretrained {path}: no such file")
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(p))
        except Exception as e:  # safetensors has its own error types for bad headers and short files
            raise UserError(f"--pretrained {path}: not a readable safetensors file ({e})") from None
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # weights_only refuses pickled code with UnpicklingError; bad zips raise others
        reason = str(e).strip().splitlines()[0][:200]
        raise UserError(f"--pretrained {path}: refused or unreadable torch file ({reason})") from None
    for key in ("state_dict", "model", "model_state_dict"):  # common wrappers around the weights
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not any(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UserError(f"--pretrained {path}: holds no tensors by name (a state dict was expected)")
    return {k.removeprefix("module."): v for k, v in obj.items() if isinstance(v, torch.Tensor)}


def load_matching(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> list[str]:
    """Load the tensors whose names and shapes match the model; return one line per skipped tensor."""
    own = model.state_dict()
    matched = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    if not matched:
        raise UserError(f"--pretrained {source}: none of its {len(state)} tensors match the model's names and "
                        f"shapes; is it for another architecture?")
    model.load_state_dict(matched, strict=False)
    skipped = [f"{k}: shape {tuple(v.shape)} in file, {tuple(own[k].shape)} in model"
               for k, v in state.items() if k in own and k not in matched]
    skipped += [f"{k}: not in the model" for k in state if k not in own]
    skipped += [f"{k}: not in the file (kept as initialised)" for k in own if k not in state]
    return skipped


def freeze_backbone(model: nn.Module) -> int:
    """Train only the classifier head; returns the number of parameters left trainable. The backbone's
    BatchNorm layers stay in evaluation mode, normalising by their loaded statistics without updating them (as
    timm's frozen BatchNorm does), so the frozen features are exactly the loaded model's."""
    if not hasattr(model, "get_classifier"):
        raise UserError("--freeze backbone: this model has no get_classifier() naming its head")
    head_module = model.get_classifier()
    head = {id(p) for p in head_module.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in head)
    in_head = {id(m) for m in head_module.modules()}
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and id(m) not in in_head:
            m.train = types.MethodType(_stay_in_eval, m)  # type: ignore[method-assign]
            m.eval()
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _stay_in_eval(module: nn.Module, mode: bool = True) -> nn.Module:
    return nn.Module.train(module, False)


def logits_of(output: Any) -> torch.Tensor:
    """A model's output as logits: a tensor, the first element of a tuple or list, or the `logits` of a dict or an
    object (Hugging Face models); refused on one line naming what the model returned."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise UserError(f"the model returned {describe(output)}; expected logits (a tensor N x classes), a tuple whose "
                    f"first element is them, or a dict or object with .logits")
