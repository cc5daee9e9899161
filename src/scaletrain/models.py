"""Models by name: scaletrain's own small CNNs, any timm model, or a factory in the user's own code
(`path/to/file.py:factory` or `package.module:factory`), made for the data's channels and classes.

timm is imported only when a timm model is asked for (it is slow to import and the default needs none of it). A
user's file is imported only when the user names it (`--model`), or, for a checkpoint, when it is the very file a
run on this machine trained with (its SHA-256 recorded then): a weights file never makes scaletrain import code.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import cache_root
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
    """Raise UserError for a name that is neither built in nor in timm, naming the closest ones; a factory of the
    user's (file.py:factory, package.module:factory) is imported and looked up."""
    if name in BUILTIN:
        return
    if is_user_model(name):
        _factory(model_code(name))
        return
    import timm

    if timm.is_model(name):
        return
    close = difflib.get_close_matches(name, model_names(), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; built in: " + ", ".join(sorted(BUILTIN))
    raise UserError(f"--model: unknown model '{name}'{hint}")


HUB_WEIGHTS = "timm"  # --pretrained timm: the model's own pretrained weights, through timm and the HF hub


def build_model(name: str, in_chans: int, num_classes: int, hub_weights: bool = False, image_size: int = 0
                ) -> nn.Module:
    """A classifier with `in_chans` input channels and `num_classes` outputs: freshly initialised, or with
    `hub_weights` starting from timm's pretrained weights for `name` (e.g. resnet18.a1_in1k; the default tag
    without one), fetched through the Hugging Face hub into its cache or read from there offline. timm resizes
    the head to `num_classes` and adapts the first convolution to `in_chans`; a timm model built for one input
    size (a ViT's, DeiT's, EVA's or Swin's position embeddings or windows) is built for `image_size` when given
    (timm resamples pretrained position embeddings to it)."""
    check_model_name(name)
    model = _build_model(name, in_chans, num_classes, hub_weights, image_size)
    model.scaletrain_model_name = name  # what rebuilds it for predict, read by fit (model_name_of)
    return model


def model_name_of(model: nn.Module) -> str:
    """The name that rebuilds `model`: build_model's, else its class's (a user's own model, saved by name)."""
    return getattr(model, "scaletrain_model_name", None) or type(model).__name__


def _timm_size(name: str, image_size: int) -> dict[str, int]:
    """timm's img_size argument for a model whose input size is fixed, where the run's input size differs."""
    import timm

    cfg = timm.models.get_pretrained_cfg(name)
    if not image_size or cfg is None or not getattr(cfg, "fixed_input_size", False) or \
            tuple(cfg.input_size[-2:]) == (image_size, image_size):
        return {}
    return {"img_size": image_size}


def _build_model(name: str, in_chans: int, num_classes: int, hub_weights: bool, image_size: int = 0
                 ) -> nn.Module:
    if is_user_model(name):
        if hub_weights:
            raise UserError(f"--pretrained timm: '{name}' is your own model; timm has no weights for it")
        return build_user_model(model_code(name), in_chans, num_classes)
    if name in BUILTIN:
        if hub_weights:
            raise UserError(f"--pretrained timm: '{name}' is scaletrain's own model; timm has no weights for it")
        return BUILTIN[name](in_chans, num_classes)
    import timm

    if not hub_weights:
        return timm.create_model(name, pretrained=False, in_chans=in_chans, num_classes=num_classes,
                                 **_timm_size(name, image_size))
    from huggingface_hub import constants

    cfg = timm.models.get_pretrained_cfg(name)
    where = getattr(cfg, "hf_hub_id", None) or name if cfg else name
    if cfg is None:
        raise UserError(f"--pretrained timm: timm has no pretrained weights for '{name}'")
    try:
        return timm.create_model(name, pretrained=True, in_chans=in_chans, num_classes=num_classes,
                                 **_timm_size(name, image_size))
    except (OSError, RuntimeError, ValueError) as e:
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        raise UserError(f"--pretrained timm: cannot get the weights of '{name}' ({where}){offline}: they are not in "
                        f"the Hugging Face cache {constants.HF_HUB_CACHE} and cannot be downloaded "
                        f"({type(e).__name__}); run once where the hub is reachable, or fill that cache") from None


def hub_normalisation(name: str) -> tuple[list[float], list[float]] | None:
    """The mean and std timm's pretrained weights for `name` expect, or None."""
    if is_user_model(name) or name in BUILTIN:
        return None
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


def output_of(output: Any, key: str | int | None = None) -> torch.Tensor:
    """The tensor a model's output is scored by, its batch first (logits N x classes, values N x K, masks
    N x C x H x W, ...): the tensor itself; with `key` (fit's and predict's `output_key=`) that entry of a dict, a
    tuple or an object; else the first element of a tuple or list, the `logits` of a dict or an object (Hugging Face
    models), or a dict's first tensor. Refused on one line naming what the model returned."""
    if isinstance(output, torch.Tensor):
        return output
    if key is not None:
        try:
            found = output[key] if isinstance(output, (dict, tuple, list)) else getattr(output, str(key))
        except (KeyError, IndexError, TypeError, AttributeError):
            found = None
        if not isinstance(found, torch.Tensor):
            raise UserError(f"output_key={key!r}: the model returned {describe(output)}, with no tensor at "
                            f"{key!r}")
        return found
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    if isinstance(output, dict):
        tensors = [v for v in output.values() if isinstance(v, torch.Tensor)]
        found = output.get("logits", tensors[0] if tensors else None)
    else:
        found = getattr(output, "logits", None)
    if isinstance(found, torch.Tensor):
        return found
    raise UserError(f"the model returned {describe(output)}; expected a tensor with the batch first, a tuple whose "
                    f"first element is one, or a dict or object with .logits (else name it with output_key=)")


# -- the user's own model code ---------------------------------------------------------------------------------
USER_MODEL = re.compile(r"^(?P<where>[^:]+\.py|[A-Za-z_][\w.]*):(?P<factory>[A-Za-z_]\w*)$")
TRUST_FILE = "model_code.json"  # under the cache folder: the model files this machine trained with


def is_user_model(name: str) -> bool:
    """Whether --model names a factory in the user's code: path/to/file.py:factory or package.module:factory."""
    return bool(USER_MODEL.match(name))


@dataclass(frozen=True)
class ModelCode:
    """A model factory in the user's code: as --model named it, the file it lives in, and that file's SHA-256."""

    spec: str
    file: str
    sha256: str

    @property
    def factory(self) -> str:
        return self.spec.rsplit(":", 1)[1]

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def model_code(spec: str) -> ModelCode:
    """Where a factory of the user's lives, found without running anything but the parents of a module path."""
    m = USER_MODEL.match(spec)
    if not m:
        raise UserError(f"--model {spec}: not path/to/file.py:factory or package.module:factory")
    where = m.group("where")
    if where.endswith(".py"):
        file = Path(where).expanduser().resolve()
        if not file.is_file():
            raise UserError(f"--model {spec}: no such file {file}")
    else:
        try:
            found = importlib.util.find_spec(where)
        except (ImportError, ValueError) as e:
            raise UserError(f"--model {spec}: no module {where} on the Python path ({e})") from None
        if found is None or not found.origin or not Path(found.origin).is_file():
            raise UserError(f"--model {spec}: no module {where} on the Python path")
        file = Path(found.origin).resolve()
    return ModelCode(spec, str(file), _sha256(file))


def _factory(code: ModelCode):
    where = code.spec.rsplit(":", 1)[0]
    try:
        if where.endswith(".py"):
            name = f"scaletrain_model_{code.sha256[:16]}"
            module = sys.modules.get(name)
            if module is None:
                folder = str(Path(code.file).parent)
                if folder not in sys.path:  # the file may import its neighbours
                    sys.path.append(folder)
                spec = importlib.util.spec_from_file_location(name, code.file)
                module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
                sys.modules[name] = module
                spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(where)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's module failed to import: say where, on one line
        sys.modules.pop(f"scaletrain_model_{code.sha256[:16]}", None)
        raise UserError(f"--model {code.spec}: importing {code.file} failed ({type(e).__name__}: {e})") from None
    factory = getattr(module, code.factory, None)
    if not callable(factory):
        raise UserError(f"--model {code.spec}: {code.file} has no function or class {code.factory}")
    return factory


def build_user_model(code: ModelCode, in_chans: int, num_classes: int) -> nn.Module:
    """The user's factory called with num_classes and in_chans when it takes them."""
    factory = _factory(code)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in (("num_classes", num_classes), ("in_chans", in_chans)) if takes_any or k in params}
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise UserError(f"--model {code.spec}: returned {describe(model)}; expected a torch.nn.Module")
    return model


def _trust_file() -> Path:
    return cache_root() / TRUST_FILE


def trust(code: ModelCode) -> None:
    """Record that a run on this machine trains with this file as it is, so that its checkpoints may import it."""
    path = _trust_file()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if code.sha256 in known.get(code.file, []):
        return
    known.setdefault(code.file, []).append(code.sha256)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # then its checkpoints need --model given again


def trusted(code: ModelCode) -> bool:
    try:
        return code.sha256 in json.loads(_trust_file().read_text()).get(code.file, [])
    except (OSError, ValueError):
        return False


def checkpoint_model(meta: dict[str, Any], given: str = "") -> tuple[str, str]:
    """(the model spec to build a checkpoint's model with, a note saying which file is imported, or ""): the
    --model given, else the checkpoint's own; a model of the user's code only from the file it was trained with,
    unchanged, and trained with on this machine."""
    if given:
        return given, ""
    name = meta.get("model", "")
    if not is_user_model(name):
        return name, ""
    saved = meta.get("model_code") or {}
    file, why = saved.get("file", "?"), ""
    if not saved:
        why = "the checkpoint does not say which file"
    elif not Path(file).is_file():
        why = f"{file} is gone"
    elif _sha256(Path(file)) != saved.get("sha256"):
        why = f"{file} changed since training (its SHA-256 differs)"
    elif not trusted(ModelCode(name, file, saved["sha256"])):
        why = f"{file} was not trained with on this machine"
    if why:
        raise UserError(f"the checkpoint's model comes from your code ({name}), and {why}: give --model "
                        f"path/to/file.py:factory to rebuild it (nothing is imported from a checkpoint by itself)")
    # built from the recorded file itself: nothing else on the Python path is looked up or imported
    return f"{file}:{name.rsplit(':', 1)[1]}", f"importing the model's code from {file} (the file the run trained " \
                                               f"with, unchanged)"
