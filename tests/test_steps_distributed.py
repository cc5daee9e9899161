"""A user's own step on 2 processes over gloo, against 1: a contrastive loss whose negatives are gathered from every
process trains to the weights of one process with the whole global batch; two optimizers stepped by the step keep
every process's weights equal. (A detector's mAP over ranks: tests/test_examples.py, on the example's own run.)"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import run_cli

pytestmark = pytest.mark.slow

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

CONTRASTIVE = textwrap.dedent('''
    import sys
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import Dataset
    import scaletrain

    class Views(Dataset):
        """Two fixed views of each digit (no random draw: 1 and 2 processes see the same pairs)."""
        def __init__(self, data):
            self.x = data.images.float().div(255)
        def __len__(self):
            return len(self.x)
        def __getitem__(self, i):
            return self.x[i], self.x[i].flip(-1)

    class Contrastive(scaletrain.Step):
        def train_step(self, model, batch):
            a, b = batch
            z1, z2 = F.normalize(model(a), dim=1), F.normalize(model(b), dim=1)
            z1, z2 = self.all_gather(z1), self.all_gather(z2)
            return F.cross_entropy(z1 @ z2.T / 0.2, torch.arange(len(z1), device=z1.device))

    data = scaletrain.load_image_sets("default")[0]
    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size, config.data.num_workers = 2, int(sys.argv[2]), 0
    config.run.output_dir = sys.argv[1]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 16))
    scaletrain.fit(model, Views(data.subset(torch.arange(128))), None, config, step=Contrastive(),
                   optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
''')


def test_a_contrastive_loss_with_gathered_negatives_trains_as_one_process_with_the_whole_batch(tmp_path):
    script = tmp_path / "contrastive.py"
    script.write_text(CONTRASTIVE)
    one = run_cli(str(tmp_path / "one"), "32", module=str(script), launcher=[sys.executable])
    two = run_cli(str(tmp_path / "two"), "16", module=str(script), launcher=TORCHRUN)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr + two.stderr)[-3000:]
    rows = [json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two")]
    assert rows[0]["global_batch_size"] == rows[1]["global_batch_size"] == 32
    losses = [[float(line.split(",")[1]) for line in (tmp_path / d / "metrics.csv").read_text().splitlines()[1:]]
              for d in ("one", "two")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)  # the same loss for the same global batches
    a, b = (load_file(tmp_path / d / "last.safetensors") for d in ("one", "two"))
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)  # and the same gradients, step after step


GAN = textwrap.dedent('''
    import os, sys, hashlib
    sys.path.insert(0, sys.argv[2])
    import torch
    import scaletrain
    from dcgan_digits import DCGAN, GAN, Digits

    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size, config.data.num_workers = 1, 32, 0
    config.run.output_dir = sys.argv[1]
    torch.manual_seed(0)
    model = GAN(width=8)
    scaletrain.fit(model, Digits(0, 256), None, config, step=DCGAN())
    digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in model.state_dict().values())).hexdigest()
    open(os.path.join(sys.argv[1], f"weights-{os.environ['RANK']}.txt"), "w").write(digest)
''')


def test_two_optimizers_stepped_by_the_step_keep_every_process_s_weights_equal(tmp_path):
    """Each process draws its own noise and reads its own digits; only averaged gradients keep them equal."""
    script = tmp_path / "gan.py"
    script.write_text(GAN)
    proc = run_cli(str(tmp_path / "run"), str(EXAMPLES), module=str(script), launcher=TORCHRUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    digests = {(tmp_path / "run" / f"weights-{r}.txt").read_text() for r in (0, 1)}
    assert len(digests) == 1
    assert "your optimizers discriminator Adam, generator Adam" in proc.stdout
