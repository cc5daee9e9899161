"""The gaps `scaletrain verify` sees on layouts known to be right, which its tolerances rest on, and its time: over 3
steps, the loss's, the gradient norm's, the weights' and (before the first step) every module's largest relative
gap, for models with plans of their own and timm's, SGD and AdamW; and the planted bug (verify_heads.py) found.

    python benchmarks/verify_gaps.py          # 6 runs of verify, about 6 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json

import _harness as h

EXAMPLE, VIT = str(h.ROOT / "examples" / "verify_heads.py"), ["--image-size", "32", "--global-batch-size", "32"]
SGD, ADAMW = ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"], ["--optimizer", "adamw", "--lr", "0.001"]
SIX = ["--layouts", "ddp2,fsdp2,tp2,pp2,tp2xfsdp2,pp2xtp2"]


def cases(vit: str) -> dict[str, list[str]]:
    return {"verify_heads.py:make, SGD": ["--model", f"{EXAMPLE}:make"],
            "verify_heads.py:make, AdamW": ["--model", f"{EXAMPLE}:make", *ADAMW],
            "timm ViT, SGD": ["--model", vit, *VIT, *SGD, *SIX], "timm ViT, AdamW": ["--model", vit, *VIT, *ADAMW, *SIX],
            "convnext_atto, AdamW": ["--model", "convnext_atto", *VIT, *ADAMW, "--layouts", "ddp2,fsdp2,pp2"],
            "verify_heads.py:make_by_count, SGD (the bug)": ["--model", f"{EXAMPLE}:make_by_count", "--layouts",
                                                             "fsdp2,tp2"]}


def module_gap(folder, layout: str) -> float:
    """The largest gap of any module's input or output to the reference's, before the first step."""
    from scaletrain.measure.verify import read_probe, tensor_gap

    (ref, _, _), (got, _, _) = read_probe(folder / "reference", 1), read_probe(folder / layout, 1)
    return max(tensor_gap(got[k], ref[k]) for k in ref if k in got and not k.startswith("|"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = h.work_dir("verify_gaps", args.work)
    (work / "vit.py").write_text(h.VIT)
    rows = []
    for n, (name, flags) in enumerate(cases(f"{work / 'vit.py'}:make").items()):
        folder = work / f"case{n}"
        run = h.run(h.scaletrain("verify", *flags, "--cpu", "--output-dir", str(folder)), env=h.env(), timeout=1800)
        if run.returncode not in (0, 1):
            run.check(name)
        for r in json.loads((folder / "verify.json").read_text())["layouts"]:
            rows.append({"case": name, "layout": r["layout"], "equal": r["equal"], "seconds": round(run.seconds, 1),
                         "loss": r["max_loss_gap"], "grad_norm": max(g["grad_norm_gap"] for g in r["gaps"]),
                         "weight": r["max_weight_gap"], "module": module_gap(folder, r["layout"]),
                         "first_module": r["first_module"]})
            print(rows[-1], flush=True)
        h.record("verify_gaps_cpu", rows, args.out, title="largest relative gaps to one process over 3 steps "
                 "(the module's: before the first step); seconds: the whole verify command")
    return 0


if __name__ == "__main__":
    h.main(main)
