"""Sequence bounds for fixed-length and packed (``cu_seqlens``) batches, computed once.

A call describes ``N`` sequences: ``B`` rows of ``T`` tokens, or with ``cu_seqlens``
(``[N+1]``, ``B == 1``) the packed spans ``[cu_seqlens[n], cu_seqlens[n+1])``.
The torch tier runs on a padded ``[N, L, ...]`` view; :class:`SeqLayout` holds the
gather index from the packed tokens to that view (and back), built on the host from
``cu_seqlens_cpu`` when given, so no device-to-host copy is needed then.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def host_cu_seqlens(cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None) -> list[int] | None:
    """The sequence offsets as a Python list; reads ``cu_seqlens_cpu`` when given (no device sync)."""
    if cu_seqlens_cpu is not None:
        return [int(x) for x in cu_seqlens_cpu.tolist()]
    if cu_seqlens is not None:
        return [int(x) for x in cu_seqlens.tolist()]
    return None


def chunk_counts(lengths: list[int], chunk_size: int) -> list[int]:
    """Chunks per sequence, each sequence chunked from its own start."""
    return [(n + chunk_size - 1) // chunk_size for n in lengths]


@dataclass(frozen=True)
class SeqLayout:
    """How the ``[B, T]`` tokens of a call map to ``N`` sequences.

    ``lengths[n]`` is the length of sequence ``n``; ``starts[n]`` its first token in the
    flattened ``B * T`` token axis. ``reverse`` maps position ``t`` of the padded view to
    token ``len - 1 - t`` of its sequence (FLA's ``reverse=True`` recurrent ops).
    """

    B: int
    T: int
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    reverse: bool = False
    cu_device: torch.Tensor | None = None   # the same offsets on the compute device, if the caller has them
    _index_cache: dict = field(default_factory=dict, compare=False, repr=False)   # device -> (index, valid)

    @property
    def N(self) -> int:
        return len(self.lengths)

    @property
    def max_len(self) -> int:
        return max(self.lengths, default=0)

    @property
    def is_dense(self) -> bool:
        """True when the padded view is a plain reshape of the input (no gather needed)."""
        return not self.reverse and all(n == self.T for n in self.lengths) and self.N == self.B

    @staticmethod
    def build(B: int, T: int, cu: list[int] | None, reverse: bool = False,
              cu_device: torch.Tensor | None = None) -> "SeqLayout":
        if cu is None:
            return SeqLayout(B, T, tuple(b * T for b in range(B)), (T,) * B, reverse)
        starts = tuple(cu[:-1])
        lengths = tuple(e - s for s, e in zip(cu[:-1], cu[1:]))
        return SeqLayout(B, T, starts, lengths, reverse, cu_device)

    def gather_index(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index, valid)``, both ``[N, L]``: token index into ``B*T`` for each padded slot.

        Built on ``device`` from the device copy of the offsets when there is one (no host
        copy, so CUDA graphs can capture it), else from the host offsets.
        """
        key = torch.device(device)
        if key in self._index_cache:
            return self._index_cache[key]
        L = self.max_len
        if self.cu_device is not None and self.cu_device.device == key:
            cu = self.cu_device.to(torch.int64)
            starts, lengths = cu[:-1], cu[1:] - cu[:-1]
        else:
            starts = torch.tensor(self.starts, dtype=torch.int64).to(device)
            lengths = torch.tensor(self.lengths, dtype=torch.int64).to(device)
        t = torch.arange(L, dtype=torch.int64, device=device)
        valid = t[None, :] < lengths[:, None]
        offset = (lengths[:, None] - 1 - t[None, :]) if self.reverse else t[None, :].expand(self.N, L)
        index = torch.where(valid, starts[:, None] + offset, torch.zeros_like(offset))
        self._index_cache[key] = (index, valid)       # one layout gathers several tensors
        return index, valid

    def to_padded(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, *rest]`` -> ``[N, L, *rest]``, zeros past each sequence's end."""
        if self.is_dense:
            return x
        index, valid = self.gather_index(x.device)
        flat = x.reshape(self.B * self.T, *x.shape[2:])
        out = flat[index.reshape(-1)].reshape(self.N, self.max_len, *x.shape[2:])
        mask = valid.reshape(self.N, self.max_len, *([1] * (x.dim() - 2)))
        return out * mask.to(out.dtype)

    def from_padded(self, y: torch.Tensor) -> torch.Tensor:
        """``[N, L, *rest]`` -> ``[B, T, *rest]`` (the inverse of :meth:`to_padded`)."""
        if self.is_dense:
            return y
        index, valid = self.gather_index(y.device)
        rest = y.shape[2:]
        trash = self.B * self.T                                   # padding slots land on one spare row
        dest = torch.where(valid, index, torch.full_like(index, trash)).reshape(-1)
        out = y.new_zeros(trash + 1, *rest).index_copy(0, dest, y.reshape(self.N * self.max_len, *rest))
        return out[:trash].reshape(self.B, self.T, *rest)
