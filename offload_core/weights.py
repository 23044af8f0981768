"""Weights from a checkpoint, for a model built on the meta device (``enable_offload(model, weights=PATH)``).

    with torch.device("meta"):                   # or accelerate.init_empty_weights()
        model = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(path))
    handle = enable_offload(model, weights=path)  # a diffusers folder, or one .safetensors file

``from_pretrained`` and then the engine holds the weights twice for a while (the loaded model,
then its packed copy): 1.3x the weight bytes of RSS, measured on Flux-dev. Here each streamed
tensor is read (``SafetensorsSource``: pread, page cache dropped per file) straight into its slab
of the engine's host store, and each resident tensor (strays, embedders, buffers) into a temporary
that goes to the device at once, so host RSS peaks at about the streamed bytes.

Which value each tensor of the model gets:

- a tensor the checkpoint has (under any of its names, peft's ``base_layer`` steps removed) is
  read from it, converted to the model tensor's dtype, whether it is on the meta device or not
  (``from_pretrained`` does the same);
- a tensor the checkpoint lacks keeps its value when it has one (a LoRA the caller initialised, a
  buffer computed at init under ``init_empty_weights``);
- a meta tensor the checkpoint lacks is a table the model computes when it is built (rotary
  frequencies as non-persistent buffers, as Wan has, or as plain tensor attributes, as Qwen-Image
  has). For a model that can be rebuilt from its config (diffusers' ``from_config``), a twin is
  built with its parameters on the meta device and those tensors are taken from it. A parameter
  is never made up that way: a checkpoint without it is a ``CheckpointMismatchError`` naming it,
  as is a model that cannot be rebuilt.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from .errors import CheckpointMismatchError
from .quant import pack_into
from .units import Unit

__all__ = ["fill_from_checkpoint", "fill_computed_tensors", "meta_tensor_names", "parameters_on_meta"]


def base_name(name: str) -> str:
    """A tensor name with peft's ``base_layer`` wrapping removed (the checkpoint's name for it)."""
    return ".".join(p for p in name.split(".") if p != "base_layer")


@dataclass
class _Tensor:
    """One tensor object of the model, and every place it is registered (tied tensors: several)."""

    obj: torch.Tensor
    names: list[str] = field(default_factory=list)
    holders: list[tuple[nn.Module, str, bool]] = field(default_factory=list)

    def replace(self, value: torch.Tensor) -> None:
        """Put ``value`` wherever the tensor is registered. A meta tensor's .data cannot take
        another device's tensor, so the object itself is replaced (tied ones stay tied)."""
        if self.obj.device.type != "meta":
            self.obj.data = value
            return
        new = nn.Parameter(value, requires_grad=self.obj.requires_grad) if isinstance(self.obj, nn.Parameter) else value
        for m, attr, is_param in self.holders:
            (m._parameters if is_param else m._buffers)[attr] = new
        self.obj = new


def _tensors(model: nn.Module) -> list[_Tensor]:
    found: dict[int, _Tensor] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for is_param, table in ((True, m._parameters), (False, m._buffers)):
            for attr, t in table.items():
                if t is None:
                    continue
                rec = found.setdefault(id(t), _Tensor(t))
                rec.names.append(f"{mname}.{attr}" if mname else attr)
                if not any(h[0] is m and h[1] == attr for h in rec.holders):
                    rec.holders.append((m, attr, is_param))
    return list(found.values())


def _meta_attributes(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """Plain tensor attributes (not registered) left on the meta device: (name, module, attr)."""
    out = []
    for mname, m in model.named_modules():
        for attr, v in vars(m).items():
            if isinstance(v, torch.Tensor) and v.device.type == "meta" and not attr.startswith("_"):
                out.append((f"{mname}.{attr}" if mname else attr, m, attr))
    return out


def meta_tensor_names(model: nn.Module, limit: int = 3) -> list[str]:
    """Up to ``limit`` names of the model's tensors (registered or plain attributes) on the meta device."""
    names = [rec.names[0] for rec in _tensors(model) if rec.obj.device.type == "meta"]
    names += [n for n, _, _ in _meta_attributes(model)]
    return names[:limit]


# ---------------------------------------------------------------- tables computed at init
@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device and everything else (buffers,
    plain tensors) real: a model costs no weight memory, and what it computes at init is there.
    (accelerate's init_empty_weights does the same; offload_core needs only torch.)"""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            self._parameters[name] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _twin(model: nn.Module, missing: list[str]) -> nn.Module:
    build = getattr(type(model), "from_config", None)
    config = getattr(model, "config", None)
    if build is None or config is None:
        raise CheckpointMismatchError(
            f"weights: {len(missing)} tensors of the model are on the meta device and not in the checkpoint "
            f"({', '.join(missing[:4])}); they are computed when the model is built: build it with "
            "accelerate.init_empty_weights() (buffers materialized) instead of torch.device('meta')")
    with parameters_on_meta():
        return build(config)


def fill_computed_tensors(model: nn.Module, present: Callable[[str], bool],
                          device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Give the model's meta buffers and plain tensor attributes the checkpoint lacks their values
    from a twin of the model built from its config (see the module docstring); returns them by name.

    Buffers go to ``device`` in the dtype the model holds them in; plain attributes are set as the
    model computes them. A meta *parameter* the checkpoint lacks is an error naming it.
    """
    records = [rec for rec in _tensors(model) if rec.obj.device.type == "meta"
               and not any(present(base_name(n)) for n in rec.names)]
    attributes = _meta_attributes(model)
    params = [rec.names[0] for rec in records if isinstance(rec.obj, nn.Parameter)]
    if params:
        raise CheckpointMismatchError(
            f"weights: the checkpoint has no value for {len(params)} parameters of the model "
            f"({', '.join(params[:4])}{', ...' if len(params) > 4 else ''}); a checkpoint of another model or config?")
    if not records and not attributes:
        return {}
    twin = _twin(model, [rec.names[0] for rec in records] + [n for n, _, _ in attributes])
    out: dict[str, torch.Tensor] = {}
    try:
        for rec in records:
            value = _twin_tensor(twin, rec.names)
            rec.replace(value.to(device=device, dtype=rec.obj.dtype))
            out[rec.names[0]] = rec.obj
        for name, m, attr in attributes:
            value = _twin_tensor(twin, [name], attribute=True)
            setattr(m, attr, value)
            out[name] = value
    finally:
        del twin
    return out


def _twin_tensor(twin: nn.Module, names: Sequence[str], attribute: bool = False) -> torch.Tensor:
    for name in names:
        path, _, attr = name.rpartition(".")
        try:
            owner = twin.get_submodule(path) if path else twin
        except AttributeError:
            continue
        value = getattr(owner, attr, None) if attribute else owner._buffers.get(attr)
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            return value
    raise CheckpointMismatchError(f"weights: {names[0]} is on the meta device, not in the checkpoint, and the model "
                                  "built again from its config does not compute it either")


# ---------------------------------------------------------------- the checkpoint into the store
def fill_from_checkpoint(model: nn.Module, streamed: Sequence[Unit], store: Any, path: str,
                         device: torch.device) -> list[tuple[nn.Module, str, bool]]:
    """Fill the host store's slabs of the ``streamed`` units from the checkpoint at ``path``, and
    give every other tensor its value on ``device``; returns the tensors read onto the device.

    ``store`` is the engine's PinnedArena (``view(u, i)`` is a tensor's slab); it is marked
    ``filled``, so the engine packs nothing into it. Streamed tensors keep their meta (or old)
    objects here: the engine gives them placeholders.
    """
    from .disk.source import SafetensorsSource

    src = SafetensorsSource.open(path)
    try:
        return _fill(model, streamed, store, src, device)
    finally:
        src.close()


def _fill(model: nn.Module, streamed: Sequence[Unit], store: Any, src: Any,
          device: torch.device) -> list[tuple[nn.Module, str, bool]]:
    in_unit = {(id(ts.module), ts.attr): (u, i) for u in streamed for i, ts in enumerate(u.tensors)}
    files = src.tensors

    def in_file(rec: _Tensor) -> str | None:
        for n in rec.names:
            if base_name(n) in files:
                return base_name(n)
        return None

    # Before the walk, since it replaces objects. On the CPU: the engine moves (or packs) them as any other.
    fill_computed_tensors(model, lambda n: n in files)
    records = _tensors(model)
    used: set[str] = set()
    reads: list[tuple[str, _Tensor, tuple[Unit, int] | None]] = []
    for rec in records:
        where = next((in_unit[(id(m), a)] for m, a, _ in rec.holders if (id(m), a) in in_unit), None)
        name = in_file(rec)
        if name is None:
            if where is not None:  # a value the caller gave (a LoRA streamed with optimizer offload): packed as is
                _pack_one(store, *where, rec.obj)
            continue
        have, want = files[name], list(rec.obj.shape)
        if have.shape != want:
            raise CheckpointMismatchError(f"{have.file}: tensor {name} has shape {have.shape}, the model's {want}")
        used.add(name)
        reads.append((name, rec, where))
    unused = sorted(set(files) - used)
    if unused:
        warnings.warn(f"weights: {len(unused)} tensors of the checkpoint are not in the model and were not read "
                      f"({', '.join(unused[:4])}{', ...' if len(unused) > 4 else ''})", stacklevel=4)

    placed: list[tuple[nn.Module, str, bool]] = []
    reads.sort(key=lambda r: (str(files[r[0]].file), files[r[0]].start))  # each file front to back
    for k, (name, rec, where) in enumerate(reads):
        if where is not None:
            u, i = where
            ts = u.tensors[i]
            with torch.no_grad():
                if ts.store_dtype is None or ts.native_dtype is not None:  # native fp8: as stored, its scale kept
                    src.read_into(name, store.view(u, i))
                else:  # stored narrower (weight_dtype): one tensor's temporary, rounded into the slab
                    pack_into(store, u, i, src.read_into(name, torch.empty(ts.shape, dtype=ts.dtype)))
        else:
            value = src.read_into(name, torch.empty(rec.obj.shape, dtype=rec.obj.dtype))
            rec.replace(value if device.type == "cpu" else value.to(device))
            del value
            placed.append(rec.holders[0])
        nxt = reads[k + 1][0] if k + 1 < len(reads) else None
        if nxt is None or files[nxt].file != files[name].file:
            src.release(files[name].file)  # done with this file: its page cache goes
    store.filled = True
    return placed


def _pack_one(store: Any, u: Unit, i: int, value: torch.Tensor) -> None:
    ts = u.tensors[i]
    if value.device.type == "meta":
        raise CheckpointMismatchError(f"weights: {u.name}.{ts.attr} is on the meta device and not in the checkpoint")
    with torch.no_grad():
        pack_into(store, u, i, value)
