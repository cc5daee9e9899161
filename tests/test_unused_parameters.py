"""A model with parameters some steps leave unused (an auxiliary head used on some calls, a layer never called)
trains through `scaletrain.fit` on 2 processes as on 1; turned off, DDP's error becomes one line naming them."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from helpers import run_cli

SCRIPT = textwrap.dedent('''
    import sys
    import torch
    from torch import nn
    from torch.utils.data import Dataset
    import scaletrain


    class Digits(Dataset):
        def __init__(self, data):
            self.x, self.y = data.images.float().div(255), data.labels

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return self.x[i], self.y[i]


    class WithAux(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU())
            self.head = nn.Linear(32, 10)
            self.aux = nn.Linear(32, 10)  # an auxiliary head, used on every other call in training
            self.never = nn.Linear(4, 4)  # defined and never called
            self.calls = 0

        def forward(self, x):
            h = self.body(x)
            self.calls += 1
            out = self.head(h)
            if self.training and self.calls % 2 == 0:
                out = out + 0.1 * self.aux(h)
            return out


    data = scaletrain.load_image_sets("default")[0]
    train, val = Digits(data.subset(torch.arange(256))), Digits(data.subset(torch.arange(256, 320)))
    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size, config.data.num_workers = 2, 32, 0
    config.run.output_dir, config.model.find_unused_parameters = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    scaletrain.fit(WithAux(), train, val, config, loss_fn=nn.CrossEntropyLoss())
''')
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("unused") / "with_aux.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.slow
def test_a_model_with_unused_parameters_trains_on_two_processes(script, tmp_path):
    out = tmp_path / "run"
    proc = run_cli(str(out), "auto", module=str(script), launcher=TORCHRUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 parameter(s) got no gradient on the first batch (aux.weight, aux.bias, never.weight and 1 more)" \
        in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["epochs"] == 2


@pytest.mark.slow
def test_turned_off_the_error_names_the_unused_parameters_and_keeps_the_run_folder(script, tmp_path):
    out = tmp_path / "run"
    proc = run_cli(str(out), "no", module=str(script), launcher=TORCHRUN)
    assert proc.returncode != 0
    # the first step used the auxiliary head (the first-item check made one call before it), the layer never
    assert "2 parameter(s) got no gradient in the previous step (never.weight, never.bias)" in proc.stderr
    assert "--find-unused-parameters yes" in proc.stderr and "Expected to have finished reduction" not in \
        proc.stderr.replace("[rank0]", "").split("UserError")[-1]
    assert not (out / "summary.json").exists()
