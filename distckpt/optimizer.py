"""Optimizer state as sharded state: each state tensor is sharded exactly like its parameter.

An optimizer's ``state_dict()`` keys its per-parameter state by position (0, 1, ...), which
means nothing across parallel layouts. These helpers give every state tensor the sharding of
the model parameter it belongs to, under the key ``optimizer.state.<state name>.<param key>``,
so that optimizer state reshards on load exactly like the model::

    model_sd = model.sharded_state_dict()          # ShardedTensors whose data are the params
    optim_sd = optimizer.state_dict()
    id_map = get_param_id_to_sharded_param_map(
        model_sd, itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups))
    optim_state_to_sharding_state(optim_sd, id_map)
    distckpt.save({"model": model_sd, "optimizer": optim_sd}, ckpt_dir)

A distributed optimizer, whose data-parallel ranks each hold a flat slice of every state
tensor, uses :func:`make_sharded_optimizer_tensor_flat` instead (see docs/guide.md).

The first three functions keep the names and semantics of
Megatron-Core's ``dist_checkpointing.optimizer``; user errors raise CheckpointingException.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from copy import deepcopy
from dataclasses import replace

import torch

from distckpt.core import CheckpointingException
from distckpt.dict_utils import nested_values
from distckpt.foreign import from_foreign, normalize_sharded_state_dict
from distckpt.mapping import (
    LocalNonpersistentObject,
    ReplicaId,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)
from distckpt.utils import extract_sharded_tensors_and_factories

logger = logging.getLogger(__name__)

__all__ = [
    "KEEP_VARS_HINT",
    "get_optim_param_to_id_map",
    "get_param_id_to_sharded_param_map",
    "make_sharded_optimizer_tensor",
    "make_sharded_optimizer_tensor_flat",
    "optim_state_to_sharding_state",
]

ShardedParam = ShardedTensor | ShardedTensorFactory

# Appended to errors about a parameter that no sharded leaf holds (Megatron-Core's distributed
# optimizer imports this name and puts it into its own errors): the usual cause is a model
# ``state_dict()`` taken without ``keep_vars=True``, which hands out detached copies.
KEEP_VARS_HINT = (
    " The sharded state dict must hold the model's torch.nn.Parameter objects themselves, not"
    " detached tensors: build it from `.state_dict(keep_vars=True)`. A parameter that has to be"
    " transformed before saving belongs in a ShardedTensorFactory."
)


def get_optim_param_to_id_map(optim_params_iter: Iterable[torch.Tensor]) -> dict[int, int]:
    """Map ``id(param)`` to the param's position in the optimizer (its ``state_dict`` id).

    A parameter that appears twice keeps its first position, as ``torch.optim`` numbers it.
    """
    param_to_id: dict[int, int] = {}
    for index, param in enumerate(optim_params_iter):
        param_to_id.setdefault(id(param), index)
    return param_to_id


def get_param_id_to_sharded_param_map(
    model_sharded_state_dict: ShardedStateDict, optim_params_iter: Iterable[torch.Tensor]
) -> dict[int, ShardedParam]:
    """Map optimizer state ids to the model's ShardedTensors (or factories) of those params.

    A sharded leaf belongs to a parameter when its ``data`` *is* that parameter (the model's
    sharded state dict must hold the parameters themselves, not copies: ``keep_vars=True``).

    Args:
        model_sharded_state_dict: the model's sharded state dict, in any nesting.
        optim_params_iter: the parameters in optimizer order (group after group), e.g.
            ``itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)``.
    """
    normalize_sharded_state_dict(model_sharded_state_dict)
    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    param_to_id = get_optim_param_to_id_map(optim_params_iter)
    id_to_sharded: dict[int, ShardedParam] = {}
    for leaf in nested_values(sharded):
        param_id = param_to_id.get(id(leaf.data))
        if param_id is None:
            logger.debug("%s is not a parameter of the optimizer", leaf.key)
        else:
            id_to_sharded[param_id] = leaf
    if not id_to_sharded and param_to_id:
        logger.warning(
            "no sharded tensor of the model state dict holds an optimizer parameter.%s", KEEP_VARS_HINT
        )
    return id_to_sharded


def _state_prefix_key(prefix: str, key: str) -> str:
    return f"{prefix}.{key}"


def make_sharded_optimizer_tensor(
    model_param: ShardedParam, optim_param: torch.Tensor, prefix: str
) -> ShardedParam:
    """Shard ``optim_param`` (a state tensor of one parameter) like the model parameter.

    The result is ``model_param`` with key ``f"{prefix}.{model_param.key}"``, data
    ``optim_param`` and dtype ``optim_param.dtype``. A factory is kept a factory: its
    ``build_fn`` then splits the state tensor exactly as it splits the parameter.

    Raises:
        CheckpointingException: the state tensor's shape differs from the parameter's local
            shape (a factory's tensor; for a flattened parameter, the flat range's length).
    """
    model_param = from_foreign(model_param, "model_param")
    key = _state_prefix_key(prefix, model_param.key)
    if isinstance(model_param, ShardedTensorFactory):
        param = model_param.data
        if (
            isinstance(param, torch.Tensor)
            and isinstance(optim_param, torch.Tensor)
            and optim_param.shape != param.shape
        ):
            raise CheckpointingException(
                f"optimizer state {key!r}: shape {tuple(optim_param.shape)} does not match the model "
                f"parameter's shape {tuple(param.shape)}"
            )
        return replace(model_param, key=key, data=optim_param)
    if not isinstance(model_param, ShardedTensor):
        raise CheckpointingException(
            f"make_sharded_optimizer_tensor: {key!r}: the model parameter must be a ShardedTensor "
            f"or ShardedTensorFactory, got {type(model_param).__name__}"
        )
    if not isinstance(optim_param, torch.Tensor):
        raise CheckpointingException(
            f"make_sharded_optimizer_tensor: {key!r}: optimizer state must be a tensor, got "
            f"{type(optim_param).__name__}"
        )
    shape = tuple(optim_param.shape)
    if model_param.flattened_range is None:
        if shape != tuple(model_param.local_shape):
            raise CheckpointingException(
                f"optimizer state {key!r}: shape {shape} does not match the model parameter's "
                f"local shape {tuple(model_param.local_shape)}"
            )
    else:
        fr = model_param.flattened_range
        if optim_param.ndim != 1 or optim_param.numel() != fr.stop - fr.start:
            raise CheckpointingException(
                f"optimizer state {key!r}: shape {shape} does not match the model parameter's "
                f"flattened range [{fr.start}, {fr.stop}) (1-D, {fr.stop - fr.start} elements)"
            )
    sharded = replace(model_param, key=key, data=optim_param, dtype=optim_param.dtype)
    sharded.validate_metadata_integrity()
    return sharded


def make_sharded_optimizer_tensor_flat(
    model_param: ShardedParam,
    optim_slice: torch.Tensor,
    flattened_range: slice,
    prefix: str,
    replica_id: ReplicaId | None = None,
) -> ShardedParam:
    """Shard a distributed optimizer's flat slice of one parameter's state.

    A distributed optimizer cuts the flattened *local* parameter (one tensor-parallel chunk)
    into contiguous pieces over data-parallel ranks; ``optim_slice`` holds elements
    ``flattened_range`` of that flattened chunk. The result places them in the same global
    tensor as the parameter (``ShardedTensor.from_rank_offsets_flat`` with the parameter's grid),
    so the slices reshard on load into any other data- or tensor-parallel split, or into
    regular (non-flat) tensors.

    Args:
        model_param: the parameter's (non-flat) ShardedTensor or ShardedTensorFactory.
        optim_slice: 1-D state slice, ``flattened_range.stop - flattened_range.start`` long.
        flattened_range: which elements of the flattened local parameter ``optim_slice`` holds.
        prefix: key prefix, e.g. ``"optimizer.state.exp_avg"``.
        replica_id: the slice's replica id. The parameter's own id usually counts data-parallel
            replicas, which a distributed optimizer does not have (each DP rank holds a different
            slice): pass the parameter's id with its data-parallel part set to 0. Default: the
            parameter's replica id.

    Raises:
        CheckpointingException: the parameter is itself flattened or not on a regular grid, or
            the slice does not fit ``flattened_range``.
    """
    model_param = from_foreign(model_param, "model_param")
    key = _state_prefix_key(prefix, model_param.key)
    replica_id = model_param.replica_id if replica_id is None else replica_id
    if not isinstance(flattened_range, slice):
        raise CheckpointingException(f"optimizer state {key!r}: flattened_range must be a slice")
    if isinstance(model_param, ShardedTensorFactory):
        if model_param.flattened_range is not None:
            raise CheckpointingException(f"optimizer state {key!r}: the model factory is already flattened")
        return replace(
            model_param, key=key, data=optim_slice, replica_id=replica_id, flattened_range=flattened_range
        )
    if not isinstance(model_param, ShardedTensor):
        raise CheckpointingException(
            f"make_sharded_optimizer_tensor_flat: {key!r}: the model parameter must be a "
            f"ShardedTensor or ShardedTensorFactory, got {type(model_param).__name__}"
        )
    if model_param.flattened_range is not None:
        raise CheckpointingException(
            f"optimizer state {key!r}: the model parameter is already flattened "
            f"({model_param.flattened_range}); pass the parameter's regular ShardedTensor"
        )
    return ShardedTensor.from_rank_offsets_flat(
        key,
        optim_slice,
        model_param.local_shape,
        *_rank_offsets(model_param),
        flattened_range=flattened_range,
        replica_id=replica_id,
        prepend_axis_num=model_param.prepend_axis_num,
    )


def _rank_offsets(sharded: ShardedTensor) -> tuple[tuple[int, int, int], ...]:
    """The ``(axis, rank_offset, fragments)`` triples that place ``sharded`` on its grid.

    Raises:
        CheckpointingException: the chunk is not on a regular grid.
    """
    p = sharded.prepend_axis_num
    offsets = [(axis, sharded.global_offset[axis], sharded.global_shape[axis]) for axis in range(p)]
    for j, local in enumerate(sharded.local_shape):
        axis = j + p
        glob, off = sharded.global_shape[axis], sharded.global_offset[axis]
        if local == 0 or glob % local or off % local:
            raise CheckpointingException(
                f"ShardedTensor {sharded.key!r}: a flat slice needs a regular grid, but along axis "
                f"{axis} the local size {local} does not tile global size {glob} at offset {off}"
            )
        offsets.append((axis, off // local, glob // local))
    return tuple(offsets)


def optim_state_to_sharding_state(
    optim_state_dict: StateDict,
    id_to_sharded_param_map: dict[int, ShardedParam],
    exclude_keys: tuple[str, ...] = (),
) -> None:
    """Turn a ``torch.optim``-style state dict into a sharded state dict, in place.

    Every tensor ``optim_state_dict["state"][param_id][name]`` becomes a sharded tensor (or
    factory) keyed ``optimizer.state.<name>.<param key>`` and sharded like the parameter
    (:func:`make_sharded_optimizer_tensor`). ``param_groups`` stay common state (saved once,
    from rank 0) except each group's ``params`` list -- positions that are only meaningful in
    this process -- which becomes a LocalNonpersistentObject: never saved, and handed back on
    load from the caller's own state dict.

    Args:
        optim_state_dict: ``{"state": {param_id: {name: tensor}}, "param_groups": [...]}``.
        id_to_sharded_param_map: from :func:`get_param_id_to_sharded_param_map`.
        exclude_keys: state names to drop (e.g. ``("step",)`` when the step is kept elsewhere).

    Raises:
        CheckpointingException: a parameter with state has no sharded counterpart, or a state
            tensor does not match its parameter's shape.
    """
    sharded_state: dict[int, dict[str, ShardedParam]] = {}
    for param_id, param_state in optim_state_dict["state"].items():
        sharded_param = id_to_sharded_param_map.get(param_id)
        sharded_state[param_id] = {}
        for name, value in param_state.items():
            if name in exclude_keys:
                continue
            if sharded_param is None:
                raise CheckpointingException(
                    f"optimizer state {name!r} of param id {param_id} has no sharded model "
                    f"parameter (known ids: {sorted(id_to_sharded_param_map)}); build the map from "
                    f"the same parameters, in the same order, as the optimizer's"
                )
            sharded_state[param_id][name] = make_sharded_optimizer_tensor(
                sharded_param, value, prefix=f"optimizer.state.{name}"
            )
    optim_state_dict["param_groups"] = deepcopy(optim_state_dict["param_groups"])
    for group in optim_state_dict["param_groups"]:
        group["params"] = LocalNonpersistentObject(group["params"])
    optim_state_dict["state"] = sharded_state
