"""Batch normalisation whose training statistics span every process, on GPUs (torch's SyncBatchNorm) and on
CPUs over gloo (CpuSyncBatchNorm2d, since DistributedDataParallel refuses torch's on CPU modules)."""

from __future__ import annotations

import warnings

import torch


class CpuSyncBatchNorm2d(torch.nn.BatchNorm2d):
    """BatchNorm2d whose training statistics span all processes, for gloo on the CPU.

    Per-channel sums, sums of squares and counts are all-reduced with an autograd-aware all-reduce, so the
    gradient also flows through the global statistics, exactly as one process with the whole batch would see.
    `group`: the processes whose batches make up the whole (None: every process).
    """

    group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        with warnings.catch_warnings():  # its deprecation points to an API without autograd support yet
            warnings.simplefilter("ignore", FutureWarning)
            from torch.distributed.nn.functional import all_reduce

        c = x.shape[1]
        local = torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)),
                           x.new_full((1,), x.numel() / c)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            total = all_reduce(local, group=self.group or torch.distributed.group.WORLD)
        count = total[-1]
        mean = total[:c] / count
        var = total[c:2 * c] / count - mean * mean
        if self.track_running_stats:
            with torch.no_grad():
                m = self.momentum if self.momentum is not None else 0.1
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(var.detach() * count / (count - 1).clamp_min(1), alpha=m)
                self.num_batches_tracked.add_(1)
        shape = (1, c, 1, 1)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return y * self.weight.view(shape) + self.bias.view(shape) if self.affine else y


def convert_cpu_sync_bn(module: torch.nn.Module, group=None) -> torch.nn.Module:
    """Replace every BatchNorm2d by CpuSyncBatchNorm2d over `group`, keeping the very same parameter and buffer
    tensors (an optimizer made before the conversion still updates them)."""
    if type(module) is torch.nn.BatchNorm2d:
        new = CpuSyncBatchNorm2d(module.num_features, module.eps, module.momentum, module.affine,
                                 module.track_running_stats, device="meta")
        new.group = group
        for name, p in module.named_parameters(recurse=False):
            setattr(new, name, p)
        for name, b in module.named_buffers(recurse=False):
            setattr(new, name, b)
        return new
    for name, child in module.named_children():
        module.add_module(name, convert_cpu_sync_bn(child, group))
    return module


def convert_sync_bn(model: torch.nn.Module, device: torch.device, group=None) -> torch.nn.Module:
    """SyncBatchNorm over `group` (None: every process) for the device: torch's on GPUs, CpuSyncBatchNorm2d on the
    CPU."""
    if device.type == "cpu":
        return convert_cpu_sync_bn(model, group)
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
