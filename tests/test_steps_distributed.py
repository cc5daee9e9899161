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


STALL = textwrap.dedent('''
    import os, sys, time
    sys.path.insert(0, sys.argv[2])
    import torch
    import scaletrain
    from dcgan_digits import DCGAN, GAN, Digits

    class Stalling(DCGAN):
        calls = 0

        def train_step(self, model, batch):
            self.calls += 1
            if self.calls == 3 and os.environ["RANK"] == "1":
                time.sleep(3600)  # a step of the user's that never returns
            return super().train_step(model, batch)

    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size, config.data.num_workers = 1, 16, 0
    config.run.output_dir, config.run.stall_timeout = sys.argv[1], 5
    torch.manual_seed(0)
    scaletrain.fit(GAN(width=8), Digits(0, 256), None, config, step=Stalling())
''')


def test_a_rank_stalled_inside_a_steps_own_code_is_named_with_its_stack(tmp_path):
    """Two optimizers stepped by the step: the other rank waits in the step's gradient averaging."""
    script = tmp_path / "stall.py"
    script.write_text(STALL)
    proc = run_cli(str(tmp_path / "run"), str(EXAMPLES), module=str(script), launcher=TORCHRUN, timeout=120)
    assert proc.returncode != 0
    blocks = proc.stderr.split("scaletrain: rank 1 stalled: no progress for ")[1:]
    assert blocks, proc.stderr[-3000:]
    assert "in phase 'forward'" in blocks[0] and "in train_step" in blocks[0], blocks[0][:3000]
    assert "exitcode  : 6" in proc.stderr


SCORES = textwrap.dedent('''
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    from pathlib import Path
    import torch
    import scaletrain
    from nlp_bert import Collate, PairF1, SentencePairs, small_bert, tokenizer_in
    from simclr_digits import Encoder, NearestNeighbourAccuracy, Plain, SimCLR

    config = scaletrain.TrainConfig()
    config.optim.batch_size, config.data.num_workers = 8, 0
    tokenizer = tokenizer_in(Path(sys.argv[2]) / "vocab")
    torch.manual_seed(0)  # the same weights in every process and run
    bert = small_bert(tokenizer.vocab_size)
    encoder = Encoder()
    values = {"bert": scaletrain.evaluate(bert, SentencePairs(tokenizer, 37, seed=1), config,
                                          collate_fn=Collate(tokenizer), metrics={"f1": PairF1()}),
              "simclr": scaletrain.evaluate(encoder, Plain(8000, 8101), config, step=SimCLR(),
                                            metrics={"knn_accuracy": NearestNeighbourAccuracy()})}
    if os.environ.get("RANK", "0") == "0":
        (Path(sys.argv[2]) / f"values-{os.environ.get('WORLD_SIZE', '1')}.json").write_text(json.dumps(values))
''')


def test_the_examples_own_steps_score_the_same_weights_alike_on_one_and_two_processes(tmp_path):
    """A model called with its batch's keys (its own loss, accuracy, F1) and a Step's own evaluation (a metric of
    list states over the whole set) on 37 and 101 items: shards of different sizes."""
    script = tmp_path / "scores.py"
    script.write_text(SCORES)
    for launcher in ([sys.executable], TORCHRUN):
        proc = run_cli(str(EXAMPLES), str(tmp_path), module=str(script), launcher=launcher)
        assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"values-{n}.json").read_text()) for n in (1, 2))
    assert set(one["bert"]) == {"loss", "accuracy", "f1", "samples", "per_class_accuracy"}
    assert set(one["simclr"]) == {"knn_accuracy", "samples"} and one["simclr"]["samples"] == 101
    for name in ("bert", "simclr"):
        for key, value in one[name].items():
            assert two[name][key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key


FSDP = textwrap.dedent('''
    import sys
    import torch
    import torch.nn.functional as F
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

    class Plain(scaletrain.Step):
        def train_step(self, model, batch):
            x, y = batch
            return F.cross_entropy(model(x), y)

    data = scaletrain.load_image_sets("default")[0]
    for way in ("default", "step"):  # one fit after the other in the same processes
        config = scaletrain.TrainConfig()
        config.optim.epochs, config.optim.batch_size, config.data.num_workers = 1, 16, 0
        config.run.output_dir, config.run.strategy = f"{sys.argv[1]}/{way}", "fsdp"
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Sequential(nn.Linear(784, 64), nn.ReLU()),
                              nn.Sequential(nn.Linear(64, 64), nn.ReLU()), nn.Linear(64, 10))
        scaletrain.fit(model, Digits(data.subset(torch.arange(128))), Digits(data.subset(torch.arange(128, 160))),
                       config, step=Plain() if way == "step" else None)
''')


def test_a_step_under_fsdp_on_two_processes_trains_as_fits_own_step(tmp_path):
    """The model is sharded and the step runs around it: the same weights, bit for bit (fit's own step, then the
    user's, in one job)."""
    script = tmp_path / "fsdp.py"
    script.write_text(FSDP)
    proc = run_cli(str(tmp_path), module=str(script), launcher=TORCHRUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (load_file(tmp_path / d / "last.safetensors") for d in ("default", "step"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


EDGES = textwrap.dedent('''
    import hashlib, json, os, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    import torch
    import torch.nn.functional as F
    import scaletrain
    from helpers import Digits
    from scaletrain.data import embedded_mnist
    from test_step_edges import Retrieval, RetrievalGathered, Unlabelled, WGANGP, _net
    from test_steps import GAN, KeywordModel

    out, what = Path(sys.argv[1]), sys.argv[3].split(",")  # wgan, scores, or both in turn
    mnist, rank, world = embedded_mnist(), os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    config = scaletrain.TrainConfig()
    config.data.num_workers = 0
    if os.environ.get("BUCKET_BYTES"):  # gradients averaged in many small buckets: the same averages
        import scaletrain.parallel.runtime
        scaletrain.parallel.runtime.BUCKET_BYTES = int(os.environ["BUCKET_BYTES"])
    if "wgan" in what:  # 3 epochs of 128 digits, checkpoints every 2 steps
        config.optim.epochs, config.optim.batch_size = 3, 16
        config.run.output_dir, config.run.checkpoint_every = str(out), 2
        model, step = GAN(), WGANGP()
        scaletrain.fit(model, Digits(mnist, 0, 128), None, config, step=step)
        digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in model.state_dict().values())).hexdigest()
        (out / f"rank-{rank}.txt").write_text(f"{digest} {step.batches}")
    if "scores" in what:  # the same weights scored: 25 items, shards of 13 and 12 (4 and 3 batches of 4)
        config.optim.batch_size = 8 // int(world)
        model, hits = _net(), {"recall_at_1": lambda found, y: (found == y).float()}
        values = scaletrain.evaluate(model, Digits(mnist, 128, 153), config, step=Retrieval(), metrics=hits)
        every = scaletrain.evaluate(model, Digits(mnist, 128, 153), config, step=RetrievalGathered(), metrics=hits)
        config.optim.batch_size = 16 // int(world)
        logits = scaletrain.predict(KeywordModel(), Unlabelled(mnist, 0, 45), config)
        if rank == "0":
            (out / f"values-{world}.json").write_text(json.dumps(values))
            (out / f"gathered-{world}.json").write_text(json.dumps(every))
            torch.save(logits, out / f"logits-{world}.pt")
''')


def _edges(tmp_path, *args, launcher=TORCHRUN, env=None):
    script = tmp_path / "edges.py"
    script.write_text(EDGES)
    return run_cli(*args, module=str(script), launcher=launcher, env=env)


TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture(scope="module")
def edges_on_two(tmp_path_factory):
    """One job of 2 processes: the WGAN-GP trained uninterrupted, then the retrieval and keyword scores."""
    root = tmp_path_factory.mktemp("edges")
    proc = _edges(root, str(root / "whole"), TESTS, "wgan,scores")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "whole"


def test_a_wgan_gp_on_two_processes_killed_and_resumed_ends_as_an_uninterrupted_run(edges_on_two, tmp_path):
    """Gradients inside the step (the critic's gradient penalty) on 2 processes, every rank's weights equal; a
    rank SIGKILLed after batch 11 (epoch 3) and the same command again: the step's counter comes back with the
    checkpoint of step 10, and the run ends on the uninterrupted run's weights and count, bit for bit, though
    it averaged its gradients in 1-KB buckets and the uninterrupted run in one."""
    whole = edges_on_two
    results = {(whole / f"rank-{r}.txt").read_text() for r in (0, 1)}
    assert len(results) == 1 and results.pop().endswith(" 12")
    small = {"BUCKET_BYTES": "1024"}  # the interrupted run averages its gradients in 1-KB buckets
    killed = _edges(tmp_path, str(tmp_path / "cut"), TESTS, "wgan", env={"SCALETRAIN_FAULT": "kill:11:1", **small})
    assert killed.returncode != 0 and not (tmp_path / "cut" / "rank-0.txt").exists()
    resumed = _edges(tmp_path, str(tmp_path / "cut"), TESTS, "wgan", env=small)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "optimizer step 10" in resumed.stdout
    assert {(d / f"rank-{r}.txt").read_text() for d in (whole, tmp_path / "cut") for r in (0, 1)} == \
        {(whole / "rank-0.txt").read_text()}


def test_a_gathering_eval_step_and_predict_on_keyword_items_give_on_two_processes_what_one_gives(edges_on_two,
                                                                                                 tmp_path):
    """Retrieval validation whose eval_step gathers every rank's rows, on shards of 4 and 3 batches (the shorter
    rank takes part in the 4th gather with no rows), and a text classifier's logits for items of its forward's
    keys: the same values on 1 and 2 processes of the same global batch; and the same Retrieval returning every
    process's rows, which once stopped with 'metrics['recall_at_1'] returned ... for a batch of 4'."""
    proc = _edges(tmp_path, str(tmp_path), TESTS, "scores", launcher=[sys.executable])
    assert proc.returncode == 0, proc.stderr[-3000:]
    folders = {1: tmp_path, 2: edges_on_two}  # by process count
    one, two = (json.loads((folders[n] / f"values-{n}.json").read_text()) for n in (1, 2))
    assert one["samples"] == two["samples"] == 25 and one == pytest.approx(two, rel=1e-6)
    # an eval_step returning every process's rows (the gathered batch): each sample counted once all the same
    for n in (1, 2):
        assert json.loads((folders[n] / f"gathered-{n}.json").read_text()) == pytest.approx(one, rel=1e-6)
    a, b = (torch.load(folders[n] / f"logits-{n}.pt") for n in (1, 2))
    assert a.shape == (45, 10) and torch.equal(a, b)
