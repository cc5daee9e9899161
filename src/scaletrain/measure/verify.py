"""`scaletrain verify`: a model proven to train the same on each layout as on one process, and where it does not,
the first module that differs named.

Each layout is a job of its own processes, started by running the same program again (the `scaletrain verify`
command, or the user's script that called `scaletrain.verify`) with the job in its environment
(training/verify.py records it). The reference trains the steps on one process; each layout the same steps, from
the same initial weights on the same batches. At each step the loss, the gradients' norm and every weight are
compared with the reference's, against tolerances measured on layouts known to be right (`Tolerance`). At the
first step beyond them, every module's input and output in one forward before that step, on the reference and on
the layout, are compared in forward order: the module named is the innermost one whose input agrees and whose
output differs, with a cause where one is recognisable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..errors import UserError


@dataclass(frozen=True)
class Tolerance:
    """Largest relative gaps that are rounding, not a difference (docs/verify.md: what they rest on). Loss and
    gradient norm: |layout - one process| / |one process|; weights and a module's tensors: the largest difference
    over the reference tensor's largest value. AdamW and Adam normalise each element's step, so a gradient element
    near zero whose rounding differs moves by up to twice the learning rate: their weight tolerance is counted in
    steps of the learning rate."""

    loss: float = 1e-5
    grad_norm: float = 1e-5
    weight: float = 1e-3
    module: float = 1e-4
    adaptive_steps: float = 0.0  # with Adam or AdamW (2): a weight may differ by this many learning rates per step

    @classmethod
    def for_optimizer(cls, name: str) -> "Tolerance":
        return cls(adaptive_steps=2.0 if name.lower().startswith(ADAPTIVE) else 0.0)

    def weights_within(self, relative: float, absolute: float, lr: float, step: int) -> bool:
        return relative <= self.weight or absolute <= self.adaptive_steps * lr * step


ADAPTIVE = ("adam", "nadam", "radam", "lamb", "lion", "adafactor")


@dataclass
class LayoutResult:
    layout: str
    equal: bool = False
    max_loss_gap: float | None = None
    max_weight_gap: float | None = None
    first_step: int | None = None
    first_module: str | None = None
    module_gap: float | None = None
    cause: str | None = None
    error: str | None = None
    gaps: list[dict[str, Any]] = field(default_factory=list)  # per step: loss, grad norm and weight gaps


@dataclass
class Program:
    """How this program is started again for a job: the arguments after the interpreter (a module's `-m NAME`
    and its arguments, or a script and its arguments)."""

    args: list[str]

    @classmethod
    def this_command(cls, argv: Sequence[str]) -> "Program":
        return cls(["-m", "scaletrain", *argv])

    @classmethod
    def this_script(cls) -> "Program":
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        if spec is not None and spec.name:
            return cls(["-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]])
        script = getattr(main, "__file__", None)
        if not script:
            raise UserError("scaletrain.verify: call it from a script (python my_script.py), which each layout's "
                            "job runs again; an interactive session cannot be started again")
        return cls([os.path.abspath(script), *sys.argv[1:]])

    def command(self, processes: int) -> list[str]:
        if processes == 1:
            return [sys.executable, *self.args]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
                *self.args]


def layout_text(flags: dict, devices: int) -> str:
    """A layout of `devices` devices as estimate-memory gives it (its flags) written as verify takes it."""
    tp = flags.get("tp", 1)
    if flags["strategy"] == "pipeline":
        return f"pp{flags.get('stages') or devices}"
    rest = devices // tp
    data = f"{flags['strategy']}{rest}"
    return data if tp == 1 else f"tp{tp}" if rest == 1 else f"tp{tp}x{data}"


def run_job(program: Program, job, processes: int, timeout: float) -> str | None:
    """Run one job to its end; None when it finished, else its error in one line."""
    from ..parallel.threads import share

    env = {**os.environ, **job.environment(), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    env.pop("TORCHELASTIC_ERROR_FILE", None)  # this process's launcher's, not the job's
    env.setdefault("OMP_NUM_THREADS", str(share(processes)))
    Path(job.folder).mkdir(parents=True, exist_ok=True)
    log = Path(job.folder) / "job.log"
    try:
        with open(log, "w") as out:
            done = subprocess.run(program.command(processes), env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"did not finish within {timeout:g} s (its output: {log})"
    if done.returncode == 0 and (Path(job.folder) / "record.json").exists():
        return None
    return _error_line(log.read_text(errors="replace")) + f" (exit code {done.returncode}; {log})"


def _error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("scaletrain: error:")]  # a worker's own words, first
    errors = [line for line in lines if "Error" in line.split(":")[0]]  # else the last exception's line
    pick = said[0] if said else errors[-1] if errors else lines[-1] if lines else "no output"
    return pick.removeprefix("scaletrain: error: ")[:400]


def read_record(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / "record.json").read_text())


def step_gaps(reference: dict, record: dict, tol: Tolerance) -> list[dict[str, Any]]:
    """Per step: the loss's, the gradient norm's and the weights' relative gaps, and whether all are within."""
    out = []
    for r, s in zip(reference["steps"], record["steps"]):
        loss = abs(s["loss"] - r["loss"]) / max(abs(r["loss"]), 1e-12)
        norm = abs(s["grad_norm"] - r["grad_norm"]) / max(abs(r["grad_norm"]), 1e-12)
        weight = s.get("weight_gap", 0.0)
        within = loss <= tol.loss and norm <= tol.grad_norm and \
            tol.weights_within(weight, s.get("weight_abs_gap", 0.0), r["lr"], r["step"])
        out.append({"step": r["step"], "loss_gap": loss, "grad_norm_gap": norm, "weight_gap": weight,
                    "worst_tensor": s.get("worst_tensor"), "within": within})
    return out


def read_probe(folder: str | Path, step: int) -> tuple[dict[str, Any], list[str], dict[str, str]]:
    """(every module's input and output by key, the forward order of the keys, the split layers: {module:
    how}), every stage's joined."""
    from safetensors import safe_open

    tensors: dict[str, Any] = {}
    order: list[str] = []
    split: dict[str, str] = {}
    for path in sorted(Path(folder).glob(f"probe-{step}-stage*.safetensors"),
                       key=lambda p: int(p.stem.rsplit("stage", 1)[1])):
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            order += [k for k in json.loads(meta.get("order", "[]")) if k not in tensors]
            split.update(json.loads(meta.get("split", "{}")))
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors, order, split


def tensor_gap(a, b) -> float:
    if a.shape != b.shape:
        return float("inf")
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() if b.numel() else 0.0


def localise(reference: str | Path, layout: str | Path, step: int, tol: Tolerance, random: Sequence[str],
             tp: int) -> tuple[str | None, float | None, str | None]:
    """(the innermost module whose input agrees and whose output differs, its output's gap, a cause or None)."""
    ref, order, _ = read_probe(reference, step)
    got, _, split = read_probe(layout, step)
    stages = len(list(Path(layout).glob(f"probe-{step}-stage*.safetensors")))
    # a pipeline's stages each have a root of their own, which is not the model's
    modules = [k[:-len("|output")] for k in order if k.endswith("|output") and (stages == 1 or k != "|output")]

    def gap(key: str) -> float | None:
        return tensor_gap(got[key], ref[key]) if key in got and key in ref else None

    def inside(child: str, parent: str) -> bool:
        return parent == "" or child.startswith(parent + ".")

    candidates = []
    for name in modules:
        out, inp = gap(f"{name}|output"), gap(f"{name}|input")
        if out is not None and out > tol.module and (inp is None or inp <= tol.module):
            candidates.append((name, out))
    innermost = [(n, g) for n, g in candidates if not any(m != n and inside(m, n) for m, _ in candidates)]
    if not innermost:
        return None, None, None
    name, module_gap = innermost[0]
    return name or "(the model)", module_gap, _cause(name, random, split, tp, ref, got, tol)


def _cause(name: str, random: Sequence[str], split: dict[str, str], tp: int, ref, got, tol: Tolerance
           ) -> str | None:
    if name in random:
        return ("draws random numbers of its own, or runs a non-deterministic kernel: its output differed between "
                "two forwards of one input on one process")
    inside = [m for m in split if name == "" or m.startswith(name + ".")]
    columns = [m for m in inside if split[m] == "colwise"]
    if tp > 1 and columns and all((g := got.get(f"{m}|output")) is not None and f"{m}|output" in ref and
                                  tensor_gap(g, ref[f"{m}|output"]) <= tol.module for m in columns):
        names = ", ".join(columns[:-1]) + " and " + columns[-1] if len(columns) > 1 else columns[0]
        return (f"reshapes a split layer's output by a fixed count: its split layers agree, but under --tp {tp} "
                f"each process holds 1/{tp} of the outputs of {names} (num_heads / {tp} heads): view them by the "
                f"per-head size (or -1), not by the head count")
    return None


def verify(program: Program, layouts: Sequence[str], steps: int, folder: Path, tolerance: Tolerance | None = None,
           timeout: float = 1800.0, say=print) -> tuple[dict[str, Any], list[LayoutResult], Tolerance]:
    """Run the reference and every layout (each a job of its own processes); returns (the reference's record,
    each layout's result, the tolerance: given, else the optimizer's)."""
    from ..parallel import layout_settings
    from ..training.verify import VerifyJob

    folder.mkdir(parents=True, exist_ok=True)
    ref_job = VerifyJob("1", str(folder / "reference"), steps, [1])
    say(f"verify: the reference, {steps} steps on one process")
    error = run_job(program, ref_job, 1, timeout)
    if error is not None:
        raise UserError(f"verify: the reference run on one process failed: {error}")
    reference = read_record(ref_job.folder)
    tolerance = tolerance or Tolerance.for_optimizer(reference.get("optimizer", ""))
    results = []
    for text in layouts:
        processes, settings = layout_settings(text)
        result = LayoutResult(text)
        results.append(result)
        say(f"verify: {text}, {steps} steps on {processes} processes")
        job = VerifyJob(text, str(folder / text), steps, [1], ref_job.folder)
        result.error = run_job(program, job, processes, timeout)
        if result.error is not None:
            continue
        record = read_record(job.folder)
        result.gaps = step_gaps(reference, record, tolerance)
        result.max_loss_gap = max(g["loss_gap"] for g in result.gaps)
        result.max_weight_gap = max(g["weight_gap"] for g in result.gaps)
        beyond = [g["step"] for g in result.gaps if not g["within"]]
        result.equal = not beyond and len(result.gaps) == steps
        if not beyond:
            continue
        result.first_step = beyond[0]
        where_ref, where = ref_job.folder, job.folder
        if result.first_step != 1:  # captured again, before that step, on both
            say(f"verify: {text} differs at step {result.first_step}: every module captured before it")
            again = VerifyJob("1", str(folder / f"reference-{result.first_step}"), steps, [result.first_step])
            if run_job(program, again, 1, timeout) is None:
                there = VerifyJob(text, str(folder / f"{text}-{result.first_step}"), steps, [result.first_step],
                                  again.folder)
                if run_job(program, there, processes, timeout) is None:
                    where_ref, where = again.folder, there.folder
        result.first_module, result.module_gap, result.cause = localise(
            where_ref, where, result.first_step, tolerance, reference.get("random", []), settings["tp"])
        if result.cause is None:
            replicas = processes // settings["tp"] // max(settings["stages"], 1)
            worst = result.gaps[result.first_step - 1]["worst_tensor"] or ""
            result.first_module, result.cause = _state_cause(
                worst, reference.get("buffers", []), 1 if reference.get("sync_bn") else replicas,
                result.first_module)
    return reference, results, tolerance


def _state_cause(worst: str, buffers: Sequence[str], replicas: int, named: str | None
                 ) -> tuple[str | None, str | None]:
    """(the module, the cause) where the model's state tells, the forward before the step agreeing: a BatchNorm
    on several replicas (its statistics are each replica's share of the batch in training: the first one named),
    or a buffer that is the worst tensor."""
    norms = [b.rsplit(".", 1)[0] for b in buffers if b.endswith("running_mean")]
    module = worst.rsplit(".", 1)[0]
    if norms and replicas > 1 and named is None:  # (with --sync-bn its statistics are the whole batch's already)
        return norms[0], (f"a BatchNorm: in training it normalises each of the {replicas} replicas' share of the "
                          f"batch, one process the whole batch; train with --sync-bn (statistics over the "
                          f"replicas) or a norm of each sample (LayerNorm, GroupNorm)")
    if worst in buffers:
        return named or module, f"the buffer {worst} differs after the step: kept otherwise than on one process"
    return named, None


def table(results: Sequence[LayoutResult]) -> str:
    def num(v):
        return "-" if v is None else f"{v:.1e}"

    rows = [("layout", "equal", "loss gap", "weight gap", "first step", "first module", "cause")]
    for r in results:
        if r.error is not None:
            rows.append((r.layout, "error", "-", "-", "-", "-", r.error))
            continue
        gap = "" if r.module_gap is None else f"(gap {r.module_gap:.1e}) "
        rows.append((r.layout, "yes" if r.equal else "NO", num(r.max_loss_gap), num(r.max_weight_gap),
                     "-" if r.first_step is None else str(r.first_step), r.first_module or "-",
                     (gap + (r.cause or "")).strip() or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row[:6], widths)) + "  " + row[6] for row in rows)


def report_json(reference: dict[str, Any], results: Sequence[LayoutResult], steps: int, tolerance: Tolerance
                ) -> dict[str, Any]:
    return {"reference": {"layout": "1 process", "steps": reference["steps"], "quieted": reference["quieted"],
                          "random": reference.get("random", [])},
            "optimizer": reference.get("optimizer"), "steps": steps, "tolerance": asdict(tolerance),
            "layouts": [{k: v for k, v in asdict(r).items()} for r in results]}


def folder_for(output_dir: str) -> Path:
    """verify's folder: --output-dir (config.run.output_dir), else verify/<timestamp>."""
    import time

    return Path(output_dir or Path("verify") / time.strftime("%Y%m%d-%H%M%S"))


def finish(reference: dict[str, Any], results: Sequence[LayoutResult], steps: int, tolerance: Tolerance,
           folder: Path, json_path: str | None = None) -> dict[str, Any]:
    """The table printed; verify.json (and `json_path`) and verify.png written; the report returned."""
    from ..runfolder import atomic_write_text

    print(table(results), flush=True)
    report = report_json(reference, results, steps, tolerance)
    text = json.dumps(report, indent=1)
    atomic_write_text(folder / "verify.json", text)
    if json_path:
        atomic_write_text(Path(json_path), text)
    plot(results, tolerance, folder / "verify.png")
    return report


def plot(results: Sequence[LayoutResult], tolerance: Tolerance, path: Path) -> None:
    """Each layout's loss and weight gaps per step, on a log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    drawn = False
    for r in results:
        if not r.gaps:
            continue
        steps = [g["step"] for g in r.gaps]
        for ax, key in zip(axes, ("loss_gap", "weight_gap")):
            ax.plot(steps, [max(g[key], 1e-12) for g in r.gaps], marker="o", label=r.layout)
        drawn = True
    for ax, title, tol in zip(axes, ("loss", "weights"), (tolerance.loss, tolerance.weight)):
        ax.set_yscale("log")
        ax.axhline(tol, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("optimizer step")
        ax.set_title(f"{title}: relative gap to one process")
        if drawn:
            ax.legend()
    with warnings.catch_warnings():  # no layout trained: empty axes
        warnings.simplefilter("ignore")
        fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


@dataclass
class VerifyResult:
    """What `scaletrain.verify` returns: each layout's result, and whether every layout was equal."""

    layouts: list[LayoutResult]
    folder: str
    report: dict[str, Any]

    @property
    def equal(self) -> bool:
        return all(r.equal for r in self.layouts)


def verify_model(model, train_data, config=None, *, layouts: Sequence[str] = ("ddp2", "fsdp2", "tp2", "pp2"),
                 steps: int = 3, json_path: str | None = None, loss_fn=None, optimizer=None, batch_keys=None,
                 collate_fn=None, seed_fn=None, output_key=None) -> VerifyResult:
    """`scaletrain verify` for a script's own model and data: call it where you would call `fit`, with the same
    arguments, from a script run as `python my_script.py` (not under a launcher). Each layout's job runs the script
    again, in its own processes; there this call trains and records that job's steps and ends the process, so
    nothing after it runs in a job. In the script's own process it returns the layouts' results, after printing
    the table. `model`: a module, or a function of no arguments building it (then a layout that splits the model
    builds it on the meta device). The run's folder is `config.run.output_dir` (default verify/<timestamp>). (The
    whole config: an entry point, each job trains from it.)"""
    from ..config import TrainConfig
    from ..parallel import launched_world_size, layout_settings
    from ..training.hooks import UserCode
    from ..training.verify import VerifyJob, job_config, record

    config = config or TrainConfig()
    job = VerifyJob.from_environment()
    if job is not None:  # a process of one layout's job: record, then end the script here
        job_settings, batch = job_config(config, job)
        record(job, model, train_data, job_settings, batch, UserCode(loss_fn, optimizer, None, batch_keys,
                                                                     collate_fn, seed_fn, None, output_key))
        raise SystemExit(0)
    if launched_world_size() is not None:
        raise UserError("scaletrain.verify starts each layout's processes itself: run the script as "
                        "`python my_script.py`, not under torchrun or another launcher")
    if steps < 1:
        raise UserError(f"scaletrain.verify: steps must be 1 or more, got {steps}")
    for text in layouts:
        layout_settings(text, "layouts")
    folder = folder_for(config.run.output_dir)
    reference, results, tolerance = verify(Program.this_script(), list(layouts), steps, folder,
                                           timeout=max(config.run.timeout, 600.0))
    return VerifyResult(results, str(folder), finish(reference, results, steps, tolerance, folder, json_path))
