"""The submit screen's model picker (ctrl+l): the worker's models (GET /v1/models), a pick fills the field.

A REAL worker whose model root holds a diffusers folder (its model_index.json) and a Flux transformer
in the BFL layout (a header with the tensors detection reads, zero-filled data: no torch here).
Picking the folder sets the form's `model.path`; picking the file adds `model.transformer=...`, and the
spec still validates (the folder is then the base).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from tui_helpers import WorkerProcess, make_app, until

from jobs.catalog import ROOTS_ENV
from tui.screens.models import ModelPickerScreen
from tui.screens.submit import SubmitScreen
from tui.specform import SpecSource

# BFL names -> shapes for a Flux of width 32 (two 16-wide heads), 4 input channels, 1 + 1 blocks
_BFL = {"img_in.weight": [32, 4], "txt_in.weight": [32, 8], "vector_in.in_layer.weight": [32, 8],
        "double_blocks.0.img_attn.qkv.weight": [96, 32], "double_blocks.0.img_attn.norm.query_norm.scale": [16],
        "single_blocks.0.linear1.weight": [224, 32], "final_layer.linear.weight": [4, 32],
        "guidance_in.in_layer.weight": [32, 256]}


def _write_bfl_header(path: Path) -> None:
    header, at = {}, 0
    for name, shape in _BFL.items():
        n = 4
        for s in shape:
            n *= s
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(at))


@pytest.fixture(scope="module")
def models_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WorkerProcess, Path]]:
    root = tmp_path_factory.mktemp("roots")
    (root / "FLUX.1-tiny").mkdir()
    (root / "FLUX.1-tiny" / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    _write_bfl_header(root / "flux1-tiny.safetensors")
    (root / "notes.safetensors").write_bytes(b"not a checkpoint")
    w = WorkerProcess(tmp_path_factory.mktemp("tui-models") / "home", env={ROOTS_ENV: str(root)}).start()
    yield w, root
    w.stop()


async def _pick(pilot, app, name: str) -> None:
    await pilot.press("ctrl+l")
    picker = app.screen
    assert isinstance(picker, ModelPickerScreen)
    await until(pilot, lambda: picker.loaded, what="the worker's models")
    listing = picker.query_one("#models")
    index = next(i for i, m in enumerate(picker.entries) if m["name"] == name)
    listing.highlighted = index
    await pilot.press("enter")
    await until(pilot, lambda: not isinstance(app.screen, ModelPickerScreen), what="the picker to close")


async def test_picking_a_folder_and_a_transformer_fills_their_fields(models_worker) -> None:
    worker, root = models_worker
    app = make_app(worker, feed=False)
    async with app.run_test(size=(160, 40)) as pilot:
        screen = SubmitScreen()
        await app.push_screen(screen)
        screen.load(SpecSource.from_template("infer"))
        await pilot.pause(0.2)
        await pilot.press("ctrl+l")
        picker = app.screen
        await until(pilot, lambda: picker.loaded, what="the worker's models")
        by = {m["name"]: m for m in picker.entries}
        assert by["FLUX.1-tiny"]["field"] == "model.path" and by["flux1-tiny.safetensors"]["field"] == "model.transformer"
        assert by["notes.safetensors"]["kind"] == "unknown"
        listing = picker.query_one("#models")
        assert listing.get_option_at_index(list(by).index("notes.safetensors")).disabled  # listed, not pickable
        await pilot.press("escape")
        assert app.screen is screen

        await _pick(pilot, app, "FLUX.1-tiny")
        path_input = next(i for i in screen.query("Input") if i.name == "model.path")
        assert path_input.value == str(root / "FLUX.1-tiny") and f"model.path={root / 'FLUX.1-tiny'}" in screen.overrides()

        await _pick(pilot, app, "flux1-tiny.safetensors")
        assert f"model.transformer={root / 'flux1-tiny.safetensors'}" in screen.overrides()
        await until(pilot, lambda: screen.spec is not None, what="the spec to validate")
        assert screen.spec.model.transformer == str(root / "flux1-tiny.safetensors")
        assert screen.spec.model.path == str(root / "FLUX.1-tiny")
