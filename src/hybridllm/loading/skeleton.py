"""What both loaders share: the model skeleton on the meta device, the progress bar, and the
assembly of loaded weights into the model (stacked projections built from their parts).

Checkpoints name weights as Hugging Face does (``self_attn.q_proj.weight`` ...); the model
stacks q/k/v and gate/up (:meth:`~hybridllm.models.llama.LlamaForCausalLM.stacked_projections`).
A loader reads every tensor under its checkpoint name and hands it to a
:class:`ProjectionAssembler`, which builds each stacked projection from its parts
(:func:`hybridllm.models.fuse.stack_projections`) as soon as the last one is read; the rest
load by name.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hybridllm.errors import ModelLoadError
from hybridllm.models.fuse import stack_projections
from hybridllm.models.layers import RotaryEmbedding
from hybridllm.models.llama import LlamaForCausalLM

PROGRESS_MIN_BYTES = 64 * 2**20
HEAD = "lm_head.weight"


@dataclass
class Skeleton:
    """A model on the meta device and what to read into it.

    Attributes:
        model: the model, every tensor on the meta device.
        expected: the checkpoint (Hugging Face) names of the parameters to read.
        names: the file's tensor name -> checkpoint parameter name.
        show_progress: whether to show a progress bar.
        total: bytes to read.
    """

    model: LlamaForCausalLM
    expected: set[str]
    names: dict[str, str]
    show_progress: bool
    total: int


def prepare_skeleton(checkpoint, show_progress: bool | None) -> Skeleton:
    """The skeleton of ``checkpoint``'s model. Raises ModelLoadError when weights are missing."""
    config = checkpoint.config
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = set(model.checkpoint_shapes())
    if config.tie_word_embeddings:
        expected.discard(HEAD)
    names = checkpoint.parameter_names()  # file name -> parameter name
    missing = expected - set(names.values())
    if missing:
        raise ModelLoadError(f"{checkpoint.path}: missing weights, e.g. {sorted(missing)[0]}")
    total = sum(checkpoint.nbytes(n) for n in names)
    if show_progress is None:
        show_progress = total >= PROGRESS_MIN_BYTES and sys.stderr.isatty()
    return Skeleton(model, expected, names, show_progress, total)


class ProjectionAssembler:
    """Builds each stacked projection of ``model`` as soon as the loader has read all its parts.

    A load reads tensors in the file's order (layer by layer), so stacking a layer's q/k/v or
    gate/up when its last part arrives holds at most that projection's parts twice (the parts
    and their stacked copy), where stacking them all at the end held every layer's parts beside
    the stacked copies (the model's projections twice at the load's peak, and as many freed
    bytes left scattered on the C heap afterwards).

    Args:
        model: the skeleton.
        expected: the checkpoint names the loader reads (``Skeleton.expected``): a stacked
            projection is built once every one of its parts' names in it has been read.
        fuse: stack parts into one matrix where they can be (else they stay separate inside a
            :class:`~hybridllm.models.fuse.ConcatLinear`).
    """

    def __init__(self, model: LlamaForCausalLM, expected: set[str], fuse: bool) -> None:
        self.model, self.fuse = model, fuse
        self._unbuilt = {stacked.name: stacked for stacked in model.stacked_projections()}
        self._unread: dict[str, set[str]] = {}  # stacked name -> its parts' checkpoint names not read yet
        self._stacked_of: dict[str, str] = {}  # a part's checkpoint name -> the stacked projection's name
        for stacked in self._unbuilt.values():
            names = {f"{part}.{leaf}" for part in stacked.parts for leaf in ("weight", "bias")} & expected
            self._unread[stacked.name] = names
            self._stacked_of.update(dict.fromkeys(names, stacked.name))

    def loaded(self, name: str, tensors: dict[str, torch.Tensor], modules: dict[str, nn.Module]) -> None:
        """The loader has put checkpoint tensor ``name`` into ``tensors`` (float, by checkpoint
        name) or its module into ``modules`` (by module name): build its stacked projection if
        that was the last part (the parts are removed from both dicts)."""
        stacked_name = self._stacked_of.pop(name, None)
        if stacked_name is None:
            return
        unread = self._unread[stacked_name]
        unread.discard(name)
        if not unread:
            self._build(stacked_name, tensors, modules)

    def finish(self, tensors: dict[str, torch.Tensor], modules: dict[str, nn.Module]) -> None:
        """Every stacked projection not built yet, then the other modules into the model with
        their biases from ``tensors``. ``modules`` is emptied; the float tensors used are
        removed from ``tensors`` (the rest are for :func:`load_tensors`)."""
        for stacked_name in list(self._unbuilt):
            self._build(stacked_name, tensors, modules)
        while modules:
            name, module = modules.popitem()
            _attach_bias(module, tensors.pop(f"{name}.bias", None))
            self.model.set_submodule(name, module)

    def _build(self, stacked_name: str, tensors: dict[str, torch.Tensor], modules: dict[str, nn.Module]) -> None:
        stacked = self._unbuilt.pop(stacked_name)
        del self._unread[stacked_name]
        parts = []
        for part in stacked.parts:
            if part in modules:
                module = modules.pop(part)
                _attach_bias(module, tensors.pop(f"{part}.bias", None))
                parts.append(module)
            else:
                parts.append(_float_linear(tensors, part))
        self.model.set_submodule(stacked.name, stack_projections(parts, self.fuse))


def _attach_bias(module: nn.Module, bias: torch.Tensor | None) -> None:
    if bias is not None:
        module.bias = nn.Parameter(bias, requires_grad=False)


def load_tensors(model: LlamaForCausalLM, tensors: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """Assign the remaining float tensors by name, rebuild the rotary tables, and check that no
    tensor is left on the meta device. Returns the model in eval mode."""
    _, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if unexpected:
        raise ModelLoadError(f"weights the model has no place for, e.g. {sorted(unexpected)[0]}")
    model.rotary = RotaryEmbedding(model.config)  # buffers were built on the meta device
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelLoadError(f"weights left unset, e.g. {left[0]}")
    return model.eval()


def _float_linear(tensors: dict[str, torch.Tensor], name: str) -> nn.Linear:
    """An ``nn.Linear`` holding ``tensors[name.weight]`` (N, K) and its bias, if any (removed from ``tensors``)."""
    weight = tensors.pop(f"{name}.weight")
    bias = tensors.pop(f"{name}.bias", None)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


class progress:
    """Context manager yielding an ``advance(nbytes)`` callback; a rich bar when enabled."""

    def __init__(self, enabled: bool, total: int, label: str) -> None:
        self.enabled, self.total, self.label = enabled, total, label
        self._bar = None

    def __enter__(self) -> Callable[[int], None]:
        if not self.enabled:
            return lambda _n: None
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        self._bar = Progress(
            TextColumn("loading {task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn(), transient=True,
        )
        self._bar.start()
        task = self._bar.add_task(self.label, total=self.total)
        return lambda n: self._bar.update(task, advance=n)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
