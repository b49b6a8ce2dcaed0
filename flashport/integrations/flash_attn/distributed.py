"""``flash_attn.utils.distributed``'s collectives without flash-attn (plain ``torch.distributed``).

flash-attn's module is plain ``torch.distributed`` too, but importing it imports flash-attn's CUDA
extension. Its meaning (flash-attn 2.8.3), along the first dimension of ``input_`` (torch's
``*_single`` collectives where this torch has them, the ``*_tensor`` ones they replace otherwise):

* ``all_gather_raw(input_, process_group, async_op=False)``: ``(output, handle)``, the ranks'
  inputs concatenated (``world_size * N`` rows);
* ``reduce_scatter_raw(...)``: ``(output, handle)``, this rank's ``N / world_size`` rows of the sum
  over ranks;
* ``all_reduce_raw(...)``: ``(input_, handle)``, the contiguous input summed in place over ranks;
* ``all_gather`` / ``reduce_scatter`` / ``all_reduce(input_, process_group)``: the same, with
  autograd (the gradient of a gather is a reduce-scatter and vice versa; an all-reduce passes the
  gradient through), synchronous.
"""

from __future__ import annotations

import functools

__all__ = [
    "all_gather",
    "all_gather_raw",
    "all_reduce",
    "all_reduce_raw",
    "reduce_scatter",
    "reduce_scatter_raw",
]


def all_gather_raw(input_, process_group, async_op=False):
    """The ranks' ``input_`` concatenated along dim 0, and the collective's handle (``async_op``)."""
    import torch

    world_size = torch.distributed.get_world_size(process_group)
    output = torch.empty(
        world_size * input_.shape[0], *input_.shape[1:], dtype=input_.dtype, device=input_.device
    )
    gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    handle = gather(output, input_.contiguous(), group=process_group, async_op=async_op)
    return output, handle


def reduce_scatter_raw(input_, process_group, async_op=False):
    """This rank's block of dim 0 of the sum of ``input_`` over ranks, and the handle."""
    import torch

    world_size = torch.distributed.get_world_size(process_group)
    if input_.shape[0] % world_size:
        raise ValueError(f"dim 0 ({input_.shape[0]}) is not a multiple of the world size ({world_size})")
    output = torch.empty(
        input_.shape[0] // world_size, *input_.shape[1:], dtype=input_.dtype, device=input_.device
    )
    scatter = (
        getattr(torch.distributed, "reduce_scatter_single", None) or torch.distributed.reduce_scatter_tensor
    )
    handle = scatter(output, input_.contiguous(), group=process_group, async_op=async_op)
    return output, handle


def all_reduce_raw(input_, process_group, async_op=False):
    """``input_`` (made contiguous) summed in place over ranks, and the handle."""
    import torch

    input_ = input_.contiguous()
    handle = torch.distributed.all_reduce(input_, group=process_group, async_op=async_op)
    return input_, handle


@functools.cache
def _functions():
    import torch

    class AllGatherFunc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input_, process_group):
            ctx.process_group = process_group
            return all_gather_raw(input_, process_group)[0]

        @staticmethod
        def backward(ctx, grad_output):
            return reduce_scatter_raw(grad_output, ctx.process_group)[0], None

    class ReduceScatterFunc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input_, process_group):
            ctx.process_group = process_group
            return reduce_scatter_raw(input_, process_group)[0]

        @staticmethod
        def backward(ctx, grad_output):
            return all_gather_raw(grad_output, ctx.process_group)[0], None

    class AllReduceFunc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input_, process_group):
            ctx.process_group = process_group
            return all_reduce_raw(input_, process_group)[0]

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output, None

    return AllGatherFunc, ReduceScatterFunc, AllReduceFunc


def all_gather(input_, process_group):
    """``all_gather_raw`` with autograd (backward: reduce-scatter)."""
    return _functions()[0].apply(input_, process_group)


def reduce_scatter(input_, process_group):
    """``reduce_scatter_raw`` with autograd (backward: all-gather)."""
    return _functions()[1].apply(input_, process_group)


def all_reduce(input_, process_group):
    """``all_reduce_raw`` with autograd (backward: the gradient as it is)."""
    return _functions()[2].apply(input_, process_group)
