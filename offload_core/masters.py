"""Masters: the host copies of streamed tensors as the world sees them, while the model is offloaded.

Between uses a streamed tensor holds a placeholder, so torch's own ``state_dict`` would save empty
tensors. A post-hook on every module that owns streamed tensors replaces each entry with the
tensor's host master, after pending write-backs (running stats) and optimizer masters have
landed (``flush``): ``torch.save(model.state_dict())``, diffusers' ``save_pretrained`` and peft's
``get_peft_model_state_dict`` then work mid-training.

- The values are CPU tensors over the host store's memory (no copy): writing to them writes the
  model, as with a resident model's ``state_dict``. Each has a storage of its own (a slice of the
  store's buffer, which it keeps alive), so ``torch.save`` writes each tensor's bytes once, and
  tensors of different dtypes packed side by side save as they would from a resident model.
- Weights stored narrower (``weight_dtype``) come back widened to their dtype: the values the model
  computes with (fp8-rounded, for fp8), as new tensors.
- A unit in use (inside its forward) keeps its live device view.
- New values given between uses as ``p.data = tensor`` are taken in first (``Binder.adopt``); an
  in-place edit between uses, which acted on the empty placeholder, raises ``OffloadedEditError``.

``load_state_dict`` writes the given values into the masters (rounded again for a narrower
``weight_dtype``) and drops any device copy, so the next use loads the new values. Resident
tensors load as torch loads them.

Optimizer offload keeps fp32 copies of narrower trainable parameters: it registers a ``flush``
(copy them into the store before a read) and a ``written`` hook (follow a write) here.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .errors import copied_module_error
from .quant import pack_into, stored_value
from .seams import MastersHost
from .units import Unit

__all__ = ["Masters", "own_storage"]


class Masters:
    def __init__(self, engine: MastersHost) -> None:
        self.e = engine
        self._flush: list[Callable[[], None]] = []
        self._written: list[Callable[[Unit, int], None]] = []
        owned: dict[int, tuple[nn.Module, list[tuple[Unit, int]]]] = {}
        for u in engine.streamed:
            for i, ts in enumerate(u.tensors):
                owned.setdefault(id(ts.module), (ts.module, []))[1].append((u, i))
        self.handles: list[Any] = []
        # a state_dict() of the whole model takes in edits and flushes once, at its start (per module it
        # was quadratic); one of a submodule alone does it in each module's hook
        self._whole = False
        root = engine.model
        # (functions: torch marks the hook it is given with an attribute, which a bound method cannot take)
        self.handles += [root.register_state_dict_pre_hook(lambda m, prefix, keep_vars: self._whole_start())]
        for module, entries in owned.values():
            loaded: set[str] = set()
            self.handles += [module.register_state_dict_post_hook(self._saver(module, entries)),
                             module.register_load_state_dict_pre_hook(self._loader(module, entries, loaded)),
                             module.register_load_state_dict_post_hook(_unmissing(loaded))]
        self.handles += [root.register_state_dict_post_hook(lambda *args: self._whole_end())]  # after the root's saver

    # ------------------------------------------------------------------ seams
    def add_hooks(self, flush: Callable[[], None], written: Callable[[Unit, int], None]) -> None:
        """``flush()`` brings pending master updates into the store before it is read; ``written(u, i)``
        follows a write into a master."""
        self._flush.append(flush)
        self._written.append(written)

    def remove_hooks(self, flush: Callable[[], None], written: Callable[[Unit, int], None]) -> None:
        for lst, cb in ((self._flush, flush), (self._written, written)):
            if cb in lst:
                lst.remove(cb)

    def flush(self) -> None:
        """The host masters are current once this returns: write-backs landed, optimizer masters stored."""
        self.e.transfer.flush()
        for cb in self._flush:
            cb()

    def value(self, u: Unit, index: int) -> torch.Tensor:
        """What tensor ``index`` of ``u`` holds: its host master, widened when it is stored narrower."""
        return stored_value(self.e.store, u, index)

    def write(self, u: Unit, index: int, value: torch.Tensor) -> None:
        """Overwrite one tensor's host master; the device copy is dropped."""
        e, ts = self.e, u.tensors[index]
        e.transfer.synchronize()  # no copy may still be reading or writing the master
        e.store.master(u.uid)  # the store keeps the unit from now on (a disk store's view is a copy until then)
        with torch.no_grad():
            if ts.store_dtype is not None:
                pack_into(e.store, u, index, value.detach().to("cpu", ts.dtype))
                e.widener.forget(u.uid)
            else:
                e.store.view(u, index).copy_(value.detach())
        for cb in self._written:
            cb(u, index)
        e.invalidate(u.uid)

    def _replaced(self, u: Unit, i: int) -> bool:
        """The module holds another tensor object than the one streamed (the next call raises
        OffloadedCopyError): state_dict and load_state_dict see that object, as torch would."""
        ts = u.tensors[i]
        return (ts.module._parameters if ts.is_param else ts.module._buffers).get(ts.attr) is not self.e.binder.own(u, i)

    def _take_in(self, uids: Any) -> None:
        """Before the masters are read: what the user gave since the last use (``p.data = new``), and
        what write-backs and the optimizer have pending."""
        for uid in uids:
            if not self.e.in_use(uid):
                self.e.binder.adopt(self.e.units[uid])
        self.flush()

    def _whole_start(self) -> None:
        self._take_in([u.uid for u in self.e.streamed])
        self._whole = True

    def _whole_end(self) -> None:
        self._whole = False

    # ------------------------------------------------------------------ state_dict hooks
    def _saver(self, owner: nn.Module, entries: list) -> Any:
        def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
            if module is not owner:
                raise copied_module_error(prefix)
            flushed = False
            for u, i in entries:
                key = prefix + u.tensors[i].attr
                if key not in state_dict or self.e.in_use(u.uid) or self._replaced(u, i):
                    continue  # a tensor object put in place of the streamed one: torch's entry is its value
                if not flushed and not self._whole:
                    self._take_in({x.uid: None for x, _ in entries})
                flushed = True
                value = self.value(u, i)
                state_dict[key] = own_storage(value) if u.tensors[i].store_dtype is None else value
                # the tensor handed out is the master itself: a write into it (state_dict()[k].copy_(v))
                # writes the model, so the device copy the ring may still hold is dropped
                self.e.invalidate(u.uid)
        return hook

    def _loader(self, owner: nn.Module, entries: list, loaded: set[str]) -> Any:
        def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                 missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
            if module is not owner:
                raise copied_module_error(prefix)
            for u, i in entries:
                ts = u.tensors[i]
                key = prefix + ts.attr
                if key not in state_dict or self._replaced(u, i):
                    continue  # torch loads into the tensor object put in place of the streamed one
                value = state_dict.pop(key)  # torch's own copy into the placeholder is skipped
                loaded.add(key)
                if tuple(value.shape) != tuple(ts.shape):
                    error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} "
                                      f"from checkpoint, the shape in current model is {tuple(ts.shape)}.")
                    continue
                self.e.binder.discard_edits(u, i)
                self.write(u, i, value)
        return hook


def _unmissing(loaded: set[str]) -> Any:
    def hook(module: nn.Module, incompatible_keys: Any) -> None:
        # the pre-hook took these keys out of torch's hands, which would report them missing
        for key in list(loaded):
            while key in incompatible_keys.missing_keys:
                incompatible_keys.missing_keys.remove(key)
        loaded.clear()
    return hook


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) over a storage of its own that aliases its bytes and keeps them alive."""
    start = t.storage_offset() * t.element_size()
    piece = t.untyped_storage()[start: start + t.numel() * t.element_size()]
    return torch.empty(0, dtype=t.dtype).set_(piece, 0, t.shape, t.stride())
