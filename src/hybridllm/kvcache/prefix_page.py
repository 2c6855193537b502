"""One reusable KV page: the keys and values of every layer for one page of tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVPage:
    """Keys and values of ``P`` tokens in every layer, on the host.

    Attributes:
        keys: (n_layers, B, Hkv, P, D).
        values: (n_layers, B, Hkv, P, D).
    """

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    @property
    def tokens(self) -> int:
        return self.keys.shape[3]

    def to(self, device: torch.device) -> KVPage:
        """This page on ``device`` (itself when it is there)."""
        if self.keys.device == device:
            return self
        return KVPage(self.keys.to(device), self.values.to(device))

    def payload(self) -> bytes:
        """Keys then values as raw bytes (what the disk tier stores)."""
        flat = torch.cat([self.keys.reshape(-1), self.values.reshape(-1)]).cpu()  # (2 * n_layers*B*Hkv*P*D,)
        return flat.view(torch.uint8).numpy().tobytes()

    @classmethod
    def from_payload(cls, payload: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> KVPage:
        """The page :meth:`payload` wrote, keys and values each of ``shape``."""
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype)
        half = flat.numel() // 2
        if flat.numel() != 2 * int(torch.Size(shape).numel()):
            raise ValueError(f"payload of {flat.numel()} values does not hold two tensors of shape {list(shape)}")
        return cls(flat[:half].reshape(shape), flat[half:].reshape(shape))
