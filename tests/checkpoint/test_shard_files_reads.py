"""How :func:`~resilience.checkpoint.formats.shard_files.load_by_slices` reads stored pieces: a
file whose every piece lands whole in a contiguous run of the loading tensor (dim-0 shards
loaded by fewer ranks, as FSDP2 2 -> 1) is read in order straight into that run; a piece split
by columns is read by slices. Single process, real safetensors files."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from resilience.checkpoint.formats import shard_files


def _pieces(model_dir: Path, full: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Store ``w`` and ``b`` as two row halves (files ``rows-1``/``rows-2``, as two FSDP2 ranks
    would) and ``c`` as two column halves (``cols-1``/``cols-2``, as tensor parallel would);
    returns the layout entries ``load_by_slices`` reads."""
    model_dir.mkdir()
    w, b, c = full["w"], full["b"], full["c"]
    save_file({"w": w[:3].contiguous(), "b": b[:3].contiguous()}, model_dir / "rows-1.safetensors")
    save_file({"w": w[3:].contiguous(), "b": b[3:].contiguous()}, model_dir / "rows-2.safetensors")
    save_file({"c": c[:, :2].contiguous()}, model_dir / "cols-1.safetensors")
    save_file({"c": c[:, 2:].contiguous()}, model_dir / "cols-2.safetensors")

    def rows(name: str, t: torch.Tensor) -> dict:
        half = [3, *t.shape[1:]]
        zeros = [0] * (t.dim() - 1)
        return {
            "shape": list(t.shape),
            "dtype": "float32",
            "pieces": [
                {"file": "rows-1.safetensors", "offsets": [0, *zeros], "shape": half},
                {"file": "rows-2.safetensors", "offsets": [3, *zeros], "shape": half},
            ],
        }

    cols = {
        "shape": list(c.shape),
        "dtype": "float32",
        "pieces": [
            {"file": "cols-1.safetensors", "offsets": [0, 0], "shape": [4, 2]},
            {"file": "cols-2.safetensors", "offsets": [0, 2], "shape": [4, 2]},
        ],
    }
    return {"w": rows("w", w), "b": rows("b", b), "c": cols}


def test_row_pieces_are_read_whole_in_place_and_column_pieces_by_slices(tmp_path, monkeypatch):
    full = {"w": torch.randn(6, 5), "b": torch.randn(6), "c": torch.randn(4, 4)}
    layout = _pieces(tmp_path / "model", full)
    live = {name: torch.zeros_like(t) for name, t in full.items()}
    before = {name: t.data_ptr() for name, t in live.items()}
    sliced: list[str] = []
    real_open = shard_files.safe_open

    def spy(path: str, **kwargs):
        sliced.append(Path(path).name)
        return real_open(path, **kwargs)

    monkeypatch.setattr(shard_files, "safe_open", spy)
    shard_files.load_by_slices(tmp_path / "model", layout, live, aliases={})

    for name, t in full.items():
        assert torch.equal(live[name], t), name
        assert live[name].data_ptr() == before[name]  # filled in place
    assert sorted(set(sliced)) == ["cols-1.safetensors", "cols-2.safetensors"]  # the row halves never went through safe_open


def test_a_row_piece_file_that_also_holds_a_column_piece_falls_back_to_slices(tmp_path):
    full = {"w": torch.randn(6, 5), "b": torch.randn(6), "c": torch.randn(4, 4)}
    layout = _pieces(tmp_path / "model", full)
    # one file holding a row half of w and b and a column half of c: not every piece lands in a
    # contiguous run, so the whole file is read by slices (and still right)
    save_file(
        {"w": full["w"][:3].contiguous(), "b": full["b"][:3].contiguous(), "c": full["c"][:, :2].contiguous()},
        tmp_path / "model" / "rows-1.safetensors",
    )
    layout["c"]["pieces"][0]["file"] = "rows-1.safetensors"
    live = {name: torch.zeros_like(t) for name, t in full.items()}
    shard_files.load_by_slices(tmp_path / "model", layout, live, aliases={})
    for name, t in full.items():
        assert torch.equal(live[name], t), name
