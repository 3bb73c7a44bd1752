"""One rank's piece of a global tensor: :class:`ShardedTensor`, its checks, geometry and
constructors (re-exported by :mod:`distckpt.mapping`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, List, Optional, Tuple, Union

import torch

from distckpt.core import CheckpointingException
from distckpt.sharded_base import ReplicaId, ShardedBase, to_int, to_int_tuple


@dataclass
class ShardedTensor(ShardedBase):
    """One rank's piece of a global tensor and the piece's position in it.

    The first ``prepend_axis_num`` axes of the global tensor exist only globally (for instance
    a stacked-layers axis): the local tensor has no such axis and occupies the single index
    ``global_offset[i]`` along it. Along every other axis ``i`` (local axis ``j = i - p``) the
    piece covers ``[global_offset[i], global_offset[i] + local_shape[j])``.

    With ``flattened_range`` set, ``data`` is 1-D and holds elements ``[start, stop)`` of the
    row-major flattening of a local chunk of shape ``local_shape`` (how a distributed optimizer
    splits one tensor-parallel chunk across data-parallel ranks). Such chunks must lie on a
    regular grid.

    Attributes:
        key: global tensor name.
        data: the local piece, or None (metadata only).
        dtype: element type of the global tensor.
        local_shape: shape of the local (un-flattened) chunk.
        global_shape: shape of the global tensor, prepended axes included.
        global_offset: position of the chunk in the global tensor.
        axis_fragmentations: number of chunks along each global axis, if known.
        replica_id: replica of this piece; only the main replica (all zeros) is saved.
        prepend_axis_num: number of leading global-only axes.
        allow_shape_mismatch: on load, the stored shape may differ from ``global_shape``.
        flattened_range: flat slice of the local chunk held in ``data``.
    """

    key: str
    data: Optional[torch.Tensor]
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def __post_init__(self) -> None:
        self.validate_metadata_integrity()

    # ------------------------------------------------------------------ validation

    def validate_metadata_integrity(self) -> None:
        """Normalise shapes to int tuples and check that they agree with each other and the data.

        Raises:
            CheckpointingException: naming the key and the offending values.
        """
        if self._plain_chunk_in_bounds():
            if self.data is not None:
                self._validate_data()
            return
        me = f"ShardedTensor {self.key!r}"
        # Shapes are normalised to int tuples here rather than only at construction because the
        # fields stay mutable (e.g. a torch.Size or list may be assigned later).
        self.local_shape = to_int_tuple(self.local_shape, "local_shape", me)
        self.global_shape = to_int_tuple(self.global_shape, "global_shape", me)
        self.global_offset = to_int_tuple(self.global_offset, "global_offset", me)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = to_int_tuple(self.axis_fragmentations, "axis_fragmentations", me)
        p = self.prepend_axis_num = to_int(self.prepend_axis_num, "prepend_axis_num", me)
        if p < 0:
            raise CheckpointingException(f"{me}: prepend_axis_num must be >= 0, got {p}")
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"{me}: global_shape {self.global_shape} and global_offset {self.global_offset} "
                f"have different lengths"
            )
        if len(self.local_shape) + p != len(self.global_shape):
            raise CheckpointingException(
                f"{me}: local_shape {self.local_shape} plus prepend_axis_num={p} does not match "
                f"the number of global axes in global_shape {self.global_shape}"
            )
        if any(s < 0 for s in self.local_shape) or any(s < 0 for s in self.global_shape):
            raise CheckpointingException(
                f"{me}: negative shape entry (local_shape={self.local_shape}, "
                f"global_shape={self.global_shape})"
            )
        if any(o < 0 for o in self.global_offset):
            raise CheckpointingException(f"{me}: negative global_offset {self.global_offset}")
        for i in range(p):
            if self.global_offset[i] >= self.global_shape[i]:
                raise CheckpointingException(
                    f"{me}: offset {self.global_offset[i]} along prepended axis {i} is outside "
                    f"global size {self.global_shape[i]} (global_offset={self.global_offset}, "
                    f"global_shape={self.global_shape})"
                )
        for j, local in enumerate(self.local_shape):
            i = j + p
            if self.global_offset[i] + local > self.global_shape[i]:
                raise CheckpointingException(
                    f"{me}: chunk [{self.global_offset[i]}, {self.global_offset[i] + local}) along "
                    f"axis {i} exceeds global size {self.global_shape[i]} "
                    f"(local_shape={self.local_shape}, global_shape={self.global_shape}, "
                    f"global_offset={self.global_offset})"
                )
        if self.axis_fragmentations is not None:
            frags = self.axis_fragmentations
            if len(frags) != len(self.global_shape) or any(f < 1 for f in frags):
                raise CheckpointingException(
                    f"{me}: axis_fragmentations {frags} must have one entry >= 1 per global axis "
                    f"(global_shape={self.global_shape})"
                )
        if self.flattened_range is not None:
            self._validate_flattened_range()
        if self.data is not None:
            self._validate_data()

    def _plain_chunk_in_bounds(self) -> bool:
        """The common case in one pass, for the checks a save and a load repeat on every tensor:
        shapes (and fragmentations, if any) already tuples of plain ints, no prepended axes, no
        flattening, the chunk inside the global shape. False: the full checks decide (and word
        the error)."""
        ls, gs, go, frags = self.local_shape, self.global_shape, self.global_offset, self.axis_fragmentations
        if (
            type(ls) is not tuple
            or type(gs) is not tuple
            or type(go) is not tuple
            or self.prepend_axis_num != 0
            or type(self.prepend_axis_num) is not int
            or self.flattened_range is not None
            or len(gs) != len(ls)
            or len(go) != len(ls)
        ):
            return False
        for local, glob, off in zip(ls, gs, go):
            if (
                type(local) is not int
                or type(glob) is not int
                or type(off) is not int
                or local < 0
                or off < 0
                or off + local > glob
            ):
                return False
        if frags is not None:
            if type(frags) is not tuple or len(frags) != len(gs):
                return False
            for f in frags:
                if type(f) is not int or f < 1:
                    return False
        return True

    def _validate_flattened_range(self) -> None:
        me = f"ShardedTensor {self.key!r}"
        fr = self.flattened_range
        if not isinstance(fr, slice):
            raise CheckpointingException(f"{me}: flattened_range must be a slice, got {fr!r}")
        if fr.step not in (None, 1):
            raise CheckpointingException(f"{me}: flattened_range {fr} must have step None or 1")
        numel = math.prod(self.local_shape)
        start, stop = fr.start, fr.stop
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= numel):
            raise CheckpointingException(
                f"{me}: flattened_range {fr} must satisfy 0 <= start <= stop <= {numel} "
                f"(the size of local_shape {self.local_shape})"
            )
        problem = self._regular_grid_problem()
        if problem is not None:
            raise CheckpointingException(
                f"{me}: a flattened tensor must lie on a regular grid, but {problem}"
            )

    def _regular_grid_problem(self) -> Optional[str]:
        """Describe why the chunk is not on a regular grid, or return None if it is."""
        p = self.prepend_axis_num
        for j, local in enumerate(self.local_shape):
            i = j + p
            glob, off = self.global_shape[i], self.global_offset[i]
            if local == 0:
                # An empty axis holds no elements, so it makes no claim about a grid.
                continue
            if self.axis_fragmentations is not None:
                if glob != local * self.axis_fragmentations[i]:
                    return (
                        f"global size {glob} along axis {i} != local size {local} * "
                        f"fragmentation {self.axis_fragmentations[i]}"
                    )
            elif glob % local:
                return f"global size {glob} along axis {i} is not a multiple of local size {local}"
            if off % local:
                return f"offset {off} along axis {i} is not a multiple of local size {local}"
        return None

    def _validate_data(self) -> None:
        me = f"ShardedTensor {self.key!r}"
        data = self.data
        if not isinstance(data, torch.Tensor):
            raise CheckpointingException(f"{me}: data must be a torch.Tensor, got {type(data)}")
        if data.dtype != self.dtype:
            raise CheckpointingException(f"{me}: data dtype {data.dtype} != declared dtype {self.dtype}")
        if self.flattened_range is None:
            if tuple(data.shape) != self.local_shape:
                raise CheckpointingException(
                    f"{me}: data shape {tuple(data.shape)} != local_shape {self.local_shape}"
                )
        else:
            expected = self.flattened_range.stop - self.flattened_range.start
            if data.ndim != 1 or data.numel() != expected:
                raise CheckpointingException(
                    f"{me}: with flattened_range {self.flattened_range} data must be 1-D with "
                    f"{expected} elements, got shape {tuple(data.shape)}"
                )

    # ------------------------------------------------------------------ geometry

    @property
    def has_regular_grid(self) -> bool:
        """Whether the chunk declares its place on a regular grid of chunks (``axis_fragmentations``
        set: every rank's chunk of this tensor has the same shape). ``False`` for a tensor built
        without a grid (irregular chunks), whose chunk count per axis is not known up front."""
        return self.axis_fragmentations is not None

    def global_slice(self) -> Tuple[Union[int, slice], ...]:
        """Index of the (un-flattened) chunk in the global tensor: ints on prepended axes."""
        p = self.prepend_axis_num
        return tuple(self.global_offset[:p]) + tuple(
            slice(off, off + local) for off, local in zip(self.global_offset[p:], self.local_shape)
        )

    def local_chunk_offset_in_global(self) -> Tuple[int, ...]:
        """Index of the chunk in the regular grid of chunks of the global tensor.

        Raises:
            CheckpointingException: an offset is not a multiple of the local size.
        """
        p = self.prepend_axis_num
        chunk = list(self.global_offset[:p])
        for j, (off, local) in enumerate(zip(self.global_offset[p:], self.local_shape)):
            if local == 0 or off % local:
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: offset {off} along axis {j + p} is not a multiple "
                    f"of local size {local}; the chunk is not on a regular grid"
                )
            chunk.append(off // local)
        return tuple(chunk)

    def max_allowed_chunks(self) -> Tuple[int, ...]:
        """Number of chunks of the regular grid along each global axis.

        Raises:
            CheckpointingException: the grid is not defined (no fragmentation given and the
                global size is not a multiple of the local size).
        """
        p = self.prepend_axis_num
        chunks = list(self.global_shape[:p])
        for j, local in enumerate(self.local_shape):
            i = j + p
            if self.axis_fragmentations is not None:
                chunks.append(self.axis_fragmentations[i])
            elif local > 0 and self.global_shape[i] % local == 0:
                chunks.append(self.global_shape[i] // local)
            else:
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: no regular grid along axis {i}: global size "
                    f"{self.global_shape[i]}, local size {local}, no axis_fragmentations"
                )
        return tuple(chunks)

    def local_coordinates(self) -> Tuple[Any, ...]:
        """Per local axis, the coordinate of each element of ``data`` inside the local chunk."""
        import numpy as np  # numpy only serves this debugging aid

        if self.flattened_range is None:
            flat = np.arange(math.prod(self.local_shape))
        else:
            flat = np.arange(self.flattened_range.start, self.flattened_range.stop)
        if not self.local_shape:
            return ()
        return tuple(np.unravel_index(flat, self.local_shape))

    def global_coordinates(self) -> Tuple[Any, ...]:
        """Per global axis, the global coordinate of each element of ``data`` (row-major order)."""
        import numpy as np

        p = self.prepend_axis_num
        if self.flattened_range is None:
            n = math.prod(self.local_shape)
        else:
            n = self.flattened_range.stop - self.flattened_range.start
        prepended = tuple(np.full(n, self.global_offset[i], dtype=np.int64) for i in range(p))
        local = self.local_coordinates()
        return prepended + tuple(c + off for c, off in zip(local, self.global_offset[p:]))

    # ------------------------------------------------------------------ transformations

    def narrow(self, dim: int, start: int, length: int) -> List[ShardedTensor]:
        """Apply ``torch.narrow(dim, start, length)`` to the local chunk, on every rank alike.

        If all ranks narrow their chunks the same way, the results tile a smaller global tensor
        whose size along the axis is ``global * length / local``. ``dim`` indexes the local
        tensor. For a flattened tensor the elements of ``data`` that fall inside the narrowed
        chunk always form one contiguous flat range of it, so the result is a list of zero or
        one tensors; the new ``data`` is a view when those elements are contiguous in the old
        ``data`` and a copy otherwise.

        Raises:
            CheckpointingException: bad dim/start/length, or the chunk is not on a regular grid
                along that axis.
        """
        me = f"ShardedTensor {self.key!r}"
        ndim = len(self.local_shape)
        if not 0 <= dim < ndim:
            raise CheckpointingException(f"{me}: cannot narrow dim {dim} of a {ndim}-D local tensor")
        local = self.local_shape[dim]
        if start < 0 or length < 0 or start + length > local:
            raise CheckpointingException(
                f"{me}: narrow(dim={dim}, start={start}, length={length}) is outside local size {local}"
            )
        axis = dim + self.prepend_axis_num
        glob, off = self.global_shape[axis], self.global_offset[axis]
        if local == 0 or glob % local or off % local:
            raise CheckpointingException(
                f"{me}: narrowing needs a regular grid along axis {axis}, got global size {glob}, "
                f"offset {off}, local size {local}"
            )
        global_shape = _replace_at(self.global_shape, axis, glob * length // local)
        global_offset = _replace_at(self.global_offset, axis, off * length // local)
        local_shape = _replace_at(self.local_shape, dim, length)

        if self.flattened_range is None:
            data = None if self.data is None else self.data.narrow(dim, start, length)
            return [
                replace(
                    self,
                    data=data,
                    local_shape=local_shape,
                    global_shape=global_shape,
                    global_offset=global_offset,
                )
            ]
        return self._narrow_flat(dim, start, length, local_shape, global_shape, global_offset)

    def _narrow_flat(
        self,
        dim: int,
        start: int,
        length: int,
        local_shape: Tuple[int, ...],
        global_shape: Tuple[int, ...],
        global_offset: Tuple[int, ...],
    ) -> List[ShardedTensor]:
        # View the local chunk as (outer, local[dim], inner); a "row" is one outer index, i.e.
        # `block` consecutive flat elements of which the window [lo, hi) survives the narrowing.
        inner = math.prod(self.local_shape[dim + 1 :])
        block = self.local_shape[dim] * inner
        lo, hi = start * inner, (start + length) * inner
        fs, fe = self.flattened_range.start, self.flattened_range.stop
        if fs == fe or block == 0 or lo == hi:
            return []

        def kept_before(f: int) -> int:
            # Number of surviving elements with old flat index < f. The narrowed chunk lists the
            # survivors in their old order, so this is also the new flat index of the first
            # survivor at or after f -- hence the survivors of [fs, fe) are exactly the new
            # flat range [kept_before(fs), kept_before(fe)).
            row, r = divmod(f, block)
            return row * (hi - lo) + min(max(r, lo), hi) - lo

        new_range = slice(kept_before(fs), kept_before(fe))
        if new_range.start == new_range.stop:
            return []

        data = None
        if self.data is not None:
            data = self._gather_window(fs, fe, block, lo, hi)
        return [
            replace(
                self,
                data=data,
                local_shape=local_shape,
                global_shape=global_shape,
                global_offset=global_offset,
                flattened_range=new_range,
            )
        ]

    def _gather_window(self, fs: int, fe: int, block: int, lo: int, hi: int) -> torch.Tensor:
        """Elements of ``data`` (flat range [fs, fe)) whose in-row position lies in [lo, hi)."""
        data = self.data
        pieces: List[torch.Tensor] = []

        def partial_row(a: int, b: int) -> None:
            # [a, b) lies within one row; keep its intersection with the window.
            base = (a // block) * block
            x, y = max(a, base + lo), min(b, base + hi)
            if x < y:
                pieces.append(data[x - fs : y - fs])

        head_end = min(fe, -(-fs // block) * block)
        tail_start = max(head_end, (fe // block) * block)
        if fs < head_end:
            partial_row(fs, head_end)
        if head_end < tail_start:
            # Whole rows: a strided 2-D view picks the window of every row at once.
            rows = data[head_end - fs : tail_start - fs].view(-1, block)
            pieces.append(rows[:, lo:hi].reshape(-1))
        if tail_start < fe:
            partial_row(tail_start, fe)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def init_data(
        self, device: Union[str, torch.device], init_fn: Callable[..., torch.Tensor] = torch.empty
    ) -> None:
        """Allocate ``data`` (local shape, or the flat range's length) unless it is already set."""
        if self.data is not None:
            return
        if self.flattened_range is None:
            shape: Tuple[int, ...] = self.local_shape
        else:
            shape = (self.flattened_range.stop - self.flattened_range.start,)
        self.data = init_fn(shape, dtype=self.dtype, device=device)

    def without_data(self) -> ShardedTensor:
        """Return a copy with the same metadata and ``data=None``."""
        return replace(self, data=None)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: Tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: Optional[slice] = None,
        **init_kwargs: Any,
    ) -> ShardedTensor:
        """Build a ShardedTensor from the rank's position in an evenly split global tensor.

        Each rank offset is ``(axis, axis_rank_offset, axis_fragm)`` over *global* axes: the
        global tensor is split into ``axis_fragm`` equal chunks along ``axis`` and this rank
        holds chunk number ``axis_rank_offset``. Axes not listed are not split; a prepended axis
        has local size 1, so an unlisted prepended axis has global size 1.

        Raises:
            CheckpointingException: invalid or duplicated rank offsets, or ``flattened_range``
                given (use :meth:`from_rank_offsets_flat`).
        """
        if flattened_range is not None:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: from_rank_offsets does not build flattened tensors; "
                f"use ShardedTensor.from_rank_offsets_flat"
            )
        if not isinstance(data, torch.Tensor):
            raise CheckpointingException(f"ShardedTensor {key!r}: data must be a tensor, got {type(data)}")
        ndim = data.ndim + prepend_axis_num
        global_shape = [1] * prepend_axis_num + list(data.shape)
        global_offset = [0] * ndim
        axis_fragmentations = [1] * ndim
        seen = set()
        for ro in rank_offsets:
            if not (isinstance(ro, tuple) and len(ro) == 3):
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: each rank offset must be (axis, axis_rank_offset, "
                    f"axis_fragm), got {ro!r}"
                )
            axis, rank_off, fragm = (to_int(v, "rank offset", f"ShardedTensor {key!r}") for v in ro)
            if not 0 <= axis < ndim:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: rank offset {ro} names axis {axis}, but the global "
                    f"tensor has {ndim} axes"
                )
            if axis in seen:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: axis {axis} appears twice in rank offsets {rank_offsets}"
                )
            if fragm < 1 or not 0 <= rank_off < fragm:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: rank offset {ro} needs 0 <= axis_rank_offset < axis_fragm"
                )
            seen.add(axis)
            local = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis] = local * fragm
            global_offset[axis] = rank_off * local
            axis_fragmentations[axis] = fragm
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            tuple(axis_fragmentations),
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: Tuple[int, ...],
        *rank_offsets: Tuple[int, int, int],
        flattened_range: Optional[slice] = None,
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        **init_kwargs: Any,
    ) -> ShardedTensor:
        """Like :meth:`from_rank_offsets` for a chunk of ``non_flat_local_shape`` held flat.

        ``data`` holds elements ``flattened_range`` of the flattened chunk.

        Raises:
            CheckpointingException: no ``flattened_range``, ``data`` not 1-D, or its size
                differs from the range's length.
        """
        if flattened_range is None:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: from_rank_offsets_flat needs a flattened_range; "
                f"use from_rank_offsets for non-flat tensors"
            )
        if not isinstance(data, torch.Tensor) or data.ndim != 1:
            shape = tuple(data.shape) if isinstance(data, torch.Tensor) else type(data)
            raise CheckpointingException(f"ShardedTensor {key!r}: flat data must be 1-D, got {shape}")
        if flattened_range.stop - flattened_range.start != data.numel():
            raise CheckpointingException(
                f"ShardedTensor {key!r}: flattened_range {flattened_range} covers "
                f"{flattened_range.stop - flattened_range.start} elements but data has {data.numel()}"
            )
        shape = to_int_tuple(non_flat_local_shape, "non_flat_local_shape", f"ShardedTensor {key!r}")
        # A meta tensor gives from_rank_offsets the chunk's shape without allocating it.
        meta = torch.empty(shape, dtype=data.dtype, device="meta")
        layout = cls.from_rank_offsets(
            key,
            meta,
            *rank_offsets,
            replica_id=replica_id,
            prepend_axis_num=prepend_axis_num,
            **init_kwargs,
        )
        return replace(layout, data=data, flattened_range=flattened_range)

    def __str__(self) -> str:
        flat = (
            ""
            if self.flattened_range is None
            else (f", flattened_range=[{self.flattened_range.start}, {self.flattened_range.stop})")
        )
        return (
            f"ShardedTensor(key={self.key!r}, dtype={self.dtype}, local_shape={self.local_shape}, "
            f"global_shape={self.global_shape}, global_offset={self.global_offset}, "
            f"replica_id={self.replica_id}{flat})"
        )


def _replace_at(t: Tuple[int, ...], index: int, value: int) -> Tuple[int, ...]:
    return t[:index] + (value,) + t[index + 1 :]
