"""Malformed HF folders and export arguments fail early with an error that names the culprit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardline.errors import CheckpointError
from shardline.interop.hf import INDEX_NAME, WEIGHTS_NAME, load_hf_weights, to_hf_pretrained
from shardline.models.llama import Llama, ModelArgs

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=96, max_seq_len=64)


def _model(seed: int = 0) -> Llama:
    model = Llama(ARGS)
    model.init_weights(seed=seed)
    return model


@pytest.mark.parametrize("shard", ["", ".."])
def test_index_naming_a_folder_as_shard_is_an_invalid_weight_map(shard, tmp_path):
    """"" and ".." pass as plain file names but name folders: the error must say the index is bad."""
    model = _model()
    folder = to_hf_pretrained(model, tmp_path / "hf", max_shard_size_bytes=40_000)
    index = json.loads((folder / INDEX_NAME).read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = shard
    (folder / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="has no valid weight_map"):
        load_hf_weights(model, folder)


def test_non_float_tensor_error_lists_every_loadable_dtype(tmp_path):
    model = _model()
    folder = to_hf_pretrained(model, tmp_path / "hf")
    tensors = load_file(folder / WEIGHTS_NAME)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, folder / WEIGHTS_NAME)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight .* I32; .*BF16, F16, F32, F64"):
        load_hf_weights(model, folder)


def test_f64_weights_load(tmp_path):
    model = _model(seed=1)
    folder = to_hf_pretrained(model, tmp_path / "hf", dtype=torch.float64)
    other = _model(seed=2)
    load_hf_weights(other, folder)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_export_refuses_a_dtype_no_loader_reads(dtype, tmp_path):
    with pytest.raises(ValueError, match=r"dtype=torch\.\w+ .*torch\.bfloat16"):
        to_hf_pretrained(_model(), tmp_path / "hf", dtype=dtype)
    assert not (tmp_path / "hf").exists()
