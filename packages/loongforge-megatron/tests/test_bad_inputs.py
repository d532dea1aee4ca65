"""Bad user files and values are one ``error:`` line naming the file (and line / key), exit 2, never a traceback:
corrupt prepared data and index caches, bad SFT / JSONL sources, empty corpora, SFT data with nothing to train,
sizes that cannot train, a config.json that disagrees with its weights, LLaVA image paths outside the records'
folder; ``data prepare --force`` gives a new corpus a new sample plan."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import loongforge
import pytest
import yaml
from loongforge.cli import main
from loongforge.errors import RecipeError

RECORDS = [
    {"instruction": "Add the numbers", "input": "2 and 3", "output": "five"},
    {"conversations": [{"from": "human", "value": "What is a list?"}, {"from": "gpt", "value": "an ordered one"}]},
    {"messages": [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": "blue"}]},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from loongforge_megatron.data.tokenizer import train_bpe

    out = tmp_path_factory.mktemp("tok")
    train_bpe([json.dumps(r) for r in RECORDS] * 20 + ["the quick brown fox jumps"] * 20, vocab_size=300, out_dir=out)
    return out


def _recipe(tmp_path: Path, data: dict, **train) -> loongforge.Recipe:
    r = {"backend": "megatron", "model": {"preset": "llama-tiny"}, "data": {"seq_length": 64, **data},
         "train": {"steps": 1, "global_batch_size": 2, "micro_batch_size": 1, **train}, "accelerator": "cpu"}
    path = tmp_path / f"r{len(list(tmp_path.glob('r*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(r))
    return loongforge.load_recipe(str(path))


def _sft(tmp_path, tok, text: str | bytes) -> loongforge.Recipe:
    src = tmp_path / "sft.jsonl"
    src.write_bytes(text if isinstance(text, bytes) else text.encode())
    return _recipe(tmp_path, {"format": "sft", "path": str(tmp_path / "sft"), "tokenizer": str(tok),
                              "source": {"kind": "jsonl", "paths": [str(src)]}}, stage="sft")


def _prepare(recipe, **kw):
    from loongforge_megatron.data.prepare import prepare

    return prepare(recipe, **kw)


def test_sft_record_errors_name_file_and_line(tmp_path, tok):
    lines = [json.dumps(RECORDS[0]), json.dumps({"instruction": "no output here"})]
    with pytest.raises(RecipeError, match=r"sft\.jsonl:2: cannot tell the SFT format"):
        _prepare(_sft(tmp_path, tok, "\n".join(lines)))
    lines[1] = json.dumps({"messages": [{"role": "user", "content": ["not", "text"]}]})
    with pytest.raises(RecipeError, match=r"sft\.jsonl:2: message contents and roles must be strings"):
        _prepare(_sft(tmp_path, tok, "\n".join(lines)))


@pytest.mark.parametrize("line", ["[1, 2, 3]", '"a string"', "17"])
def test_jsonl_line_that_is_not_an_object(tmp_path, tok, line):
    with pytest.raises(RecipeError, match=r"sft\.jsonl:2: expected a JSON object per line"):
        _prepare(_sft(tmp_path, tok, json.dumps(RECORDS[0]) + "\n" + line))


def test_binary_jsonl_file(tmp_path, tok):
    with pytest.raises(RecipeError, match=r"sft\.jsonl:\d+: not UTF-8 text"):
        _prepare(_sft(tmp_path, tok, b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe" * 50))


def test_sft_without_assistant_turns_is_refused(tmp_path, tok):
    rec = {"messages": [{"role": "user", "content": "hello"}, {"role": "user", "content": "again"}]}
    with pytest.raises(RecipeError, match="no assistant tokens"):
        _prepare(_sft(tmp_path, tok, json.dumps(rec) + "\n" + json.dumps(rec)))


def _text_corpus(tmp_path, tok, texts: list[str], name="corpus") -> loongforge.Recipe:
    src = tmp_path / f"{name}.txt"
    src.write_text("\n".join(texts))
    return _recipe(tmp_path, {"format": "pretrain", "path": str(tmp_path / "data"), "tokenizer": str(tok),
                              "source": {"kind": "text", "paths": [str(src)]}, "split": "100,0,0"})


def test_empty_corpus_is_refused(tmp_path, tok):
    with pytest.raises(RecipeError, match="no text"):
        _prepare(_text_corpus(tmp_path, tok, [""]))


def test_validate_refuses_untrainable_values(tmp_path, capsys):
    for override, words in (("model.vocab_size=1", "model.vocab_size"), ("data.split=0,0,0", "no training documents")):
        r = tmp_path / "v.yaml"
        r.write_text(yaml.safe_dump({"backend": "megatron", "model": {"preset": "llama-tiny"},
                                     "data": {"format": "pretrain", "path": str(tmp_path / "d")}, "accelerator": "cpu"}))
        assert main(["validate", str(r), override]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err


@pytest.mark.parametrize("recipe, words", [("llm/tiny/llama_tiny.yaml", "model families, not of llama"),
                                           ("vlm/llava_tiny.yaml", "model families, not of llava")])
def test_image_size_where_no_data_reads_it_is_refused(recipe, words, capsys):
    """``data.image_size`` on a model whose data ignores it is an error, not a silently unused key: it is a key of
    other model kinds' data sections only, and the error names them."""
    path = Path(__file__).parents[3] / "recipes" / recipe
    assert main(["validate", str(path), "accelerator=cpu", "data.format=synthetic", "data.image_size=64"]) == 2
    err = capsys.readouterr().err
    assert "key 'data.image_size'" in err and words in err and "dit" in err and err.count("\n") == 1, err


def _prepared(tmp_path, tok) -> tuple[loongforge.Recipe, Path]:
    recipe = _text_corpus(tmp_path, tok, [f"the quick brown fox jumps {i}" for i in range(40)])
    return recipe, _prepare(recipe)


def _build_pretrain(recipe, tok_dir, *, samples=8):
    from loongforge_megatron.data.datasets import build_pretrain_dataset
    from loongforge_megatron.data.tokenizer import load_tokenizer

    train, _ = build_pretrain_dataset(recipe, tokenizer=load_tokenizer(tok_dir), num_samples=samples)
    return train


@pytest.mark.parametrize("damage", ["truncate_bin", "empty_bin", "truncate_idx", "garble_idx", "empty_idx",
                                    "swap_bin"])
def test_corrupt_prepared_data_names_the_file(tmp_path, tok, damage, capfd):
    recipe, out = _prepared(tmp_path, tok)
    idx, bin_ = out / "train.idx", out / "train.bin"
    if damage == "truncate_bin":
        bin_.write_bytes(bin_.read_bytes()[:-7])
    elif damage == "empty_bin":
        bin_.write_bytes(b"")
    elif damage == "truncate_idx":
        idx.write_bytes(idx.read_bytes()[:-5])
    elif damage == "garble_idx":
        raw = bytearray(idx.read_bytes())
        raw[40:60] = b"\x7f" * 20
        idx.write_bytes(bytes(raw))
    elif damage == "empty_idx":
        idx.write_bytes(b"")
    else:
        bin_.write_bytes(bin_.read_bytes() + b"\0\0")
    with pytest.raises(RecipeError, match=r"train\.(bin|idx): .*data prepare --force"):
        _build_pretrain(recipe, out / "tokenizer")
    assert "Traceback" not in capfd.readouterr().err  # NOTE: megatron's reader never half-opened: no __del__ noise


@pytest.mark.parametrize("damage", ["truncate", "garble", "out_of_range"])
def test_corrupt_index_cache_names_the_file(tmp_path, tok, damage):
    import numpy as np

    recipe, out = _prepared(tmp_path, tok)
    _build_pretrain(recipe, out / "tokenizer")
    target = sorted((out / "cache").rglob("*-shuffle_index.npy"))[0]
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-9])
    elif damage == "garble":
        target.write_bytes(b"\x93NUMPY garbage" + b"\xff" * 64)
    else:
        np.save(target, np.full(np.load(target).shape, 10**6, dtype=np.int64))
    with pytest.raises(RecipeError, match=rf"{target.name}: corrupt index cache"):
        _build_pretrain(recipe, out / "tokenizer")


def test_a_split_without_documents(tmp_path, tok):
    """A one-document corpus at split 98,2,0: the valid share holds no document. Megatron caches empty indices for
    it, which the next run on the same prepared data reads back (not "corrupt"); asked for validation samples (train.
    eval_interval), it is a one-line error naming data.split, not megatron's endless search for their tokens."""
    from loongforge_megatron.data.datasets import build_pretrain_dataset
    from loongforge_megatron.data.tokenizer import load_tokenizer

    src = tmp_path / "corpus.txt"
    src.write_text(" ".join(f"the quick brown fox jumps {i}" for i in range(40)))
    recipe = _recipe(tmp_path, {"format": "pretrain", "path": str(tmp_path / "data"), "tokenizer": str(tok),
                                "source": {"kind": "text", "paths": [str(src)]}, "split": "98,2,0"})
    out = _prepare(recipe)
    tokenizer = load_tokenizer(out / "tokenizer")
    for _ in range(2):  # NOTE: the second build reads the first one's cache
        train, _ = build_pretrain_dataset(recipe, tokenizer=tokenizer, num_samples=4)
        assert len(train) >= 4
    assert sorted((out / "cache").rglob("*-valid-document_index.npy"))
    with pytest.raises(RecipeError, match="gives the validation split none of the 1 documents") as err:
        build_pretrain_dataset(recipe, tokenizer=tokenizer, num_samples=4, num_valid=2)
    assert err.value.key == "data.split" and "\n" not in str(err.value)


def test_prepare_force_gives_a_new_corpus_a_new_sample_plan(tmp_path, tok):
    """A larger corpus prepared with --force over the old one trains on its own samples (as a fresh directory)."""
    recipe, out = _prepared(tmp_path, tok)
    _build_pretrain(recipe, out / "tokenizer")  # builds (and caches) the old corpus' sample plan
    bigger = _text_corpus(tmp_path, tok, [f"a brown fox jumps over the lazy dog {i} times" for i in range(400)],
                          name="corpus")
    _prepare(bigger, force=True)
    stale = _build_pretrain(bigger, out / "tokenizer")
    fresh_dir = tmp_path / "fresh"
    shutil.copytree(out, fresh_dir, ignore=shutil.ignore_patterns("cache"))
    fresh_recipe = bigger.model_copy(update={"data": bigger.data.model_copy(update={"path": str(fresh_dir)})})
    fresh = _build_pretrain(fresh_recipe, fresh_dir / "tokenizer")
    assert len(stale) == len(fresh)
    for i in range(len(fresh)):
        assert (stale[i]["text"] if "text" in stale[i] else stale[i]["tokens"]).tolist() == \
            (fresh[i]["text"] if "text" in fresh[i] else fresh[i]["tokens"]).tolist()


@pytest.mark.parametrize("image", ["../outside.png", "/etc/hosts", "sub/../../outside.png"])
def test_llava_image_paths_stay_in_the_records_folder(tmp_path, image):
    from loongforge_megatron.models.llava.model import _confined_image

    (tmp_path / "outside.png").write_bytes(b"x")
    records = tmp_path / "data" / "r.json"
    with pytest.raises(RecipeError, match=r"record 1: image .* is not a path inside the records' folder"):
        _confined_image(records, image, f"{records}: record 1")
    assert _confined_image(records, "imgs/a.png", "x") == records.parent / "imgs" / "a.png"


def test_convert_refuses_a_config_that_disagrees_with_the_weights(tmp_path, tiny_hf, capsys):
    hf = tiny_hf("llama", tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (hf / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main(["convert", str(hf), str(tmp_path / "mg"), "--to", "megatron"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "config.json does not match the weights: tensor 'model.layers.0.mlp.down_proj.weight' has shape (64, 128)" \
        in err and "intermediate_size 96" in err and "gives (64, 96)" in err, err
    assert not (tmp_path / "mg").exists()


def test_llava_binary_records_and_unreadable_image(tmp_path):
    from types import SimpleNamespace

    from loongforge_megatron.data.tokenizer import train_bpe
    from loongforge_megatron.models.llava.model import ImageTextConversations

    tok = train_bpe(["a b c d what is this"] * 4, vocab_size=280, out_dir=tmp_path / "tok")
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    arch = SimpleNamespace(vision={"image_token_index": tok.convert_tokens_to_ids("<image>"),
                                   "vision_config": {"image_size": 32, "patch_size": 8}})
    (tmp_path / "bin.json").write_bytes(b"\xff\xd8\xff\xe0" + bytes(range(256)))
    with pytest.raises(RecipeError, match=r"bin\.json: not UTF-8 text"):
        ImageTextConversations(str(tmp_path / "bin.json"), tokenizer=tok, arch=arch, seq_length=64, seed=3)
    (tmp_path / "x.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)  # a PNG signature, then nothing
    record = {"image": "x.png", "conversations": [{"from": "human", "value": "<image>\nwhat is this"},
                                                  {"from": "gpt", "value": "a"}]}
    (tmp_path / "r.json").write_text(json.dumps([record]))
    ds = ImageTextConversations(str(tmp_path / "r.json"), tokenizer=tok, arch=arch, seq_length=64, seed=3)
    with pytest.raises(RecipeError, match=r"r\.json: record 1: image .*x\.png' is unreadable"):
        ds[0]


def test_corrupt_parquet_names_the_file(tmp_path, tok):
    src = tmp_path / "part.parquet"
    src.write_bytes(b"PAR1" + b"\x00garbage" * 20)
    recipe = _recipe(tmp_path, {"format": "pretrain", "path": str(tmp_path / "data"), "tokenizer": str(tok),
                                "source": {"kind": "parquet", "paths": [str(src)]}})
    with pytest.raises(RecipeError, match=r"part\.parquet: not a readable Parquet file"):
        _prepare(recipe)
