"""A tokenizer given in place of a checkpoint's own (convert to-hf --tokenizer, generate
--tokenizer, eval --data.tokenizer): one past the model's rows is refused, another is said (or,
for eval, whose loss it would make another model's, refused); the run's own, copied, is neither."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer, models

from shardline.cli import main
from shardline.trainer import Trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_corpus):
    from shardline.config import load_config
    from tests.conftest import tiny_overrides

    root = tmp_path_factory.mktemp("given")
    cfg = load_config(None, tiny_overrides(root / "run", small_corpus, "train.steps=2", "checkpoint.interval=2",
                                           "train.eval_interval=0"))
    Trainer(cfg).build().train()
    ckpt = root / "run" / "checkpoints" / "step-000002"
    rows = json.loads((ckpt / "meta.json").read_text())["model_args"]["vocab_size"]
    big, small = root / "big.json", root / "small.json"
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(rows + 5)}, unk_token="w0")).save(str(big))
    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]")).save(str(small))
    copy = root / "copy.json"  # the run's own, laid out anew
    copy.write_text(json.dumps(json.loads((root / "run" / "tokenizer.json").read_text()), indent=2))
    return root, ckpt, rows, big, small, copy


def test_convert_refuses_a_tokenizer_past_the_models_rows_and_names_another(trained, capsys):
    """An export with more tokens than rows wrote an HF folder whose forward failed in transformers."""
    root, ckpt, rows, big, small, copy = trained
    assert main(["convert", "to-hf", str(ckpt), str(root / "hf_big"), "--tokenizer", str(big)]) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer={big}: ids up to {rows + 4}, past the model's {rows} vocabulary rows" in err, err
    assert not (root / "hf_big").exists()
    assert main(["convert", "to-hf", str(ckpt), str(root / "hf_small"), "--tokenizer", str(small)]) == 0
    err = capsys.readouterr().err
    assert f"--tokenizer={small} is not the tokenizer {ckpt} was trained with" in err, err
    assert main(["convert", "to-hf", str(ckpt), str(root / "hf_copy"), "--tokenizer", str(copy)]) == 0
    assert "not the tokenizer" not in capsys.readouterr().err


def test_generate_refuses_a_tokenizer_past_the_models_rows_and_names_another(trained, capsys):
    root, ckpt, rows, big, small, copy = trained
    assert main(["generate", str(ckpt), "--prompt", "a", "--max-new-tokens", "2", "--tokenizer", str(big)]) == 2
    assert f"past the model's {rows} vocabulary rows" in capsys.readouterr().err
    assert main(["generate", str(ckpt), "--prompt", "a", "--max-new-tokens", "2", "--tokenizer", str(small)]) == 0
    assert f"note: --tokenizer={small} is not the tokenizer {ckpt} was trained with" in capsys.readouterr().err
    assert main(["generate", str(ckpt), "--prompt", "a", "--max-new-tokens", "2", "--tokenizer", str(copy)]) == 0
    assert "not the tokenizer" not in capsys.readouterr().err


def test_eval_refuses_another_tokenizer_than_the_checkpoints_own(trained, capsys, small_corpus):
    """Its loss was another tokenization's, with no word said."""
    root, ckpt, rows, big, small, copy = trained
    assert main(["eval", str(ckpt), f"--data.tokenizer={small}"]) == 2
    err = capsys.readouterr().err
    assert f"--data.tokenizer={small} is not the tokenizer {ckpt} was trained with" in err, err
    assert main(["eval", str(ckpt), f"--data.tokenizer={copy}", "--batches", "1"]) == 0


def test_eval_names_a_missing_val_path_as_its_own_key(trained, capsys):
    root, ckpt, *_ = trained
    assert main(["eval", str(ckpt), f"--data.val_path={root / 'nonexist.jsonl'}"]) == 2
    err = capsys.readouterr().err
    assert f"data.val_path='{root / 'nonexist.jsonl'}' does not exist" in err, err


def test_a_shardline_checkpoint_given_as_an_hf_folder_names_the_key_it_takes(trained, capsys):
    root, ckpt, *_ = trained
    for folder in (ckpt, root / "run"):
        assert main(["convert", "from-hf", str(folder), str(root / "nothing")]) == 2
        assert "a shardline checkpoint or run dir (a run starts from it with model.init_from; to-hf exports it)" in \
            capsys.readouterr().err
    shutil.rmtree(root / "nothing", ignore_errors=True)
