"""The on-disk formats' owners (megatron_branchnorm/formats/): tag names, train_config.json,
the DATA_DIR manifest, the run's records, and reading a bf16 optimizer file's pickled
DeepSpeed ``fragment_address`` without DeepSpeed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats import checkpoint_state, data_dir, records, train_config

ROOT = Path(__file__).resolve().parents[2]


# ---- checkpoint names ------------------------------------------------------------------------


@pytest.mark.parametrize("step", [0, 1, 12, 4000, 10**9])
def test_tag_round_trip(step):
    assert ckpt.tag_step(ckpt.tag_for(step)) == step
    assert ckpt.is_tag(ckpt.tag_for(step))


@pytest.mark.parametrize(
    "name",
    [
        "global_step",
        "global_step-1",
        "global_step+1",
        "global_step01",
        "global_step1.0",
        "global_step 1",
        "global_step1\n",
        "global_step²",  # str.isdigit() says yes, int() says no
        "global_step١",  # an Arabic-Indic digit
        "xglobal_step1",
        "global_step1x",
        ".removing-global_step4",
        "latest",
        "",
    ],
)
def test_malformed_tags_refused(name):
    assert ckpt.tag_step(name) is None and not ckpt.is_tag(name)


def test_tag_for_refuses_bad_steps():
    for bad in (-1, 1.5, "3"):
        with pytest.raises((ValueError, TypeError)):
            ckpt.tag_for(bad)


def test_layer_and_engine_file_names():
    for idx in (0, 7, 99, 100, 1234):
        assert ckpt.layer_index(ckpt.layer_file(idx)) == idx
    assert ckpt.layer_file(3) == "layer_03-model_states.pt"  # DeepSpeed 0.19.8's name
    for name in ("layer_3-model_states.pt", "layer_03-model_states.pt.tmp", "mp_rank_00_model_states.pt"):  # fmt: skip
        assert ckpt.layer_index(name) is None
    assert ckpt.ENGINE_FILE.match(ckpt.engine_file(1)).group(1) == "01"
    m = ckpt.OPTIM_FILE.match(ckpt.optim_file(3, 2, bf16=True))
    assert m.groups() == ("bf16_", "3", "02")
    assert ckpt.OPTIM_FILE.match(ckpt.optim_file(0, 1)).group(1) is None


def test_layer_files_and_tags_by_parsed_index(tmp_path):
    for idx in (2, 100, 10):
        (tmp_path / ckpt.layer_file(idx)).write_bytes(b"x")
    ckpt.write_manifest(tmp_path, 0)  # layer files are the ones the manifest lists
    (tmp_path / "layer_xx-model_states.pt").write_bytes(b"x")
    assert sorted(ckpt.layer_files(tmp_path)) == [2, 10, 100]
    save = tmp_path / "save"
    for name in ("global_step10", "global_step9", "global_step010", "global_stepx"):
        (save / name).mkdir(parents=True)
    (save / "global_step10" / ckpt.MANIFEST).write_text("{}")
    assert ckpt.checkpoint_tags(save) == (["global_step10"], ["global_step9"])


# ---- train_config.json -----------------------------------------------------------------------


def test_train_config_round_trip(tmp_path):
    info = {"step": 4, "spec_names": {"0": "embedding", "1": "encoder_layers.0"}, "p": Path("x")}
    train_config.write_train_config(tmp_path, info)
    back = train_config.read_train_config(tmp_path)
    assert back == {**info, "p": "x"}  # default=str: a Path is written as text
    assert train_config.saved_spec_names(tmp_path, back) == {0: "embedding", 1: "encoder_layers.0"}
    assert not list(tmp_path.glob(".*"))  # no temporary file left


@pytest.mark.parametrize(
    "content, why",
    [
        (None, "missing"),
        (b'{"step": 4, "spec_na', "not valid JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b"\xff\xfe{}", "unreadable"),
    ],
)
def test_damaged_train_config_is_one_line_naming_it(tmp_path, content, why):
    if content is not None:
        (tmp_path / ckpt.TRAIN_CONFIG).write_bytes(content)
    with pytest.raises(ckpt.CheckpointError) as info:
        train_config.read_train_config(tmp_path)
    msg = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in msg
    assert msg.startswith(f"{tmp_path / ckpt.TRAIN_CONFIG}: ") and why in msg


def test_malformed_spec_names_named(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="train_config.json: key spec_names"):
        train_config.saved_spec_names(tmp_path, {"spec_names": {"zero": "embedding"}})


# ---- the DATA_DIR manifest -------------------------------------------------------------------


def write_manifest(root: Path, **keys) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": "megatron_branchnorm-data",
        "version": 1,
        "vocab_size": 64,
        "languages": ["de", "en"],
        "spm_model": "spm.model",
        **keys,
    }
    manifest = {k: v for k, v in manifest.items() if v is not ...}
    (root / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return root


def test_manifest_read(tmp_path):
    root = write_manifest(tmp_path / "d", pivot="de")
    m = data_dir.read_data_manifest(root)
    assert (m.vocab_size, m.languages, m.pivot, m.spm_path) == (64, ("de", "en"), "de", root / "spm.model")  # fmt: skip
    assert m.sha256 == ckpt.sha256_file(root / "manifest.json")
    with pytest.raises(AttributeError):
        m.vocab_size = 3  # frozen
    defaults = data_dir.read_data_manifest(write_manifest(tmp_path / "e", spm_model=..., vocab_size=...))  # fmt: skip
    assert (defaults.spm_model, defaults.vocab_size, defaults.pivot) == ("spm.model", None, "en")


@pytest.mark.parametrize(
    "keys, key",
    [
        ({"vocab_size": "64"}, "vocab_size"),
        ({"vocab_size": True}, "vocab_size"),
        ({"vocab_size": 2}, "vocab_size"),
        ({"languages": "de,en"}, "languages"),
        ({"pivot": 3}, "pivot"),
        ({"splits": []}, "splits"),
        ({"format": "fairseq"}, "format"),
        ({"spm_model": "../spm.model"}, "spm_model"),
        ({"spm_model": "sub/spm.model"}, "spm_model"),
        ({"spm_model": "/etc/passwd"}, "spm_model"),
        ({"spm_model": ".."}, "spm_model"),
        ({"spm_model": "a\\b"}, "spm_model"),
        ({"spm_model": ""}, "spm_model"),
        ({"spm_model": 7}, "spm_model"),
    ],
)
def test_manifest_bad_key_named(tmp_path, keys, key):
    root = write_manifest(tmp_path / "d", **keys)
    with pytest.raises(data_dir.DataError) as info:
        data_dir.read_data_manifest(root)
    msg = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in msg
    assert msg.startswith(f"{root / 'manifest.json'}: key {key} ")


def test_manifest_missing_or_damaged(tmp_path):
    with pytest.raises(data_dir.DataError, match=r"manifest.json: missing; .* not a preprocessed"):  # fmt: skip
        data_dir.read_data_manifest(tmp_path / "none")
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(data_dir.DataError, match="manifest.json: not valid JSON"):
        data_dir.read_data_manifest(tmp_path)


def test_manifest_references(tmp_path):
    root = write_manifest(tmp_path / "d")
    (root / "raw").mkdir()
    for lang in ("de", "en"):
        (root / "raw" / f"test.{lang}").write_text("x\n")
    refs = {"de-en": {"src": "raw/test.de", "tgt": "raw/test.en"}}
    write_manifest(root, splits={"test": {"references": refs}, "dev": {}})
    m = data_dir.read_data_manifest(root)
    (r,) = m.references("test").values()
    assert (r.name, r.src, r.tgt) == ("de-en", root / "raw/test.de", root / "raw/test.en")
    with pytest.raises(data_dir.DataError, match=r"no split 'valid' \(splits with references: test\)"):  # fmt: skip
        m.references("valid")
    with pytest.raises(data_dir.DataError, match="split 'dev' has no references"):
        m.references("dev")
    write_manifest(root, splits={"test": {"references": {"de-en": {"src": "raw/test.de"}}}})
    with pytest.raises(data_dir.DataError, match="key splits.test.references.de-en needs"):
        data_dir.read_data_manifest(root).references("test")


# ---- records ---------------------------------------------------------------------------------


def test_records_reader_skips_a_cut_last_line(tmp_path):
    rows = [{"step": 1, "loss": 2.0}, {"step": 2, "valid_loss": 1.5}]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / records.METRICS_FILE).write_text(text + '{"step": 3, "lo')
    assert records.read_metrics(tmp_path) == rows
    assert records.valid_losses(tmp_path) == {2: 1.5}
    with pytest.raises(records.MetricsFileError, match=r"metrics.jsonl:3: not a JSON object"):
        records.read_metrics(tmp_path, strict=True)
    # bytes that are not UTF-8 in a cut line: tolerant skips it, strict names the file
    (tmp_path / records.METRICS_FILE).write_bytes(text.encode() + b'{"step": 3, "x": "\xff')
    assert records.read_metrics(tmp_path) == rows
    with pytest.raises(records.MetricsFileError, match="metrics.jsonl: not UTF-8"):
        records.read_metrics(tmp_path, strict=True)


def test_bleu_rows_and_best_json(tmp_path):
    records.append_bleu_row(tmp_path, {"step": 4, "valid_bleu": 20.0})
    with open(tmp_path / records.BLEU_FILE, "a") as fh:
        fh.write('{"step": 6, "valid_bl')  # a companion killed mid-write
    records.append_bleu_row(tmp_path, {"step": 8, "valid_bleu": 21.0})
    # the cut line is skipped; the next row starts a line of its own
    assert records.valid_bleus(tmp_path) == {4: 20.0, 8: 21.0}
    with pytest.raises(ValueError):
        records.append_bleu_row(tmp_path, {"valid_bleu": 1.0})
    records.write_best(tmp_path, "valid_loss", [("global_step8", 1.0), ("global_step4", 2.0)])
    assert records.read_best(tmp_path) == ["global_step8", "global_step4"]
    (tmp_path / records.BEST_FILE).write_text('{"checkpoints": [{"step": 8}]}')
    with pytest.raises(records.MetricsFileError, match=r"best.json: expected"):
        records.read_best(tmp_path)
    with pytest.raises(records.MetricsFileError, match=r"best.json: missing .*keep_best"):
        records.read_best(tmp_path / "none")


# ---- DeepSpeed's fragment_address without DeepSpeed ------------------------------------------

SAVE_WITH_DEEPSPEED = """
import sys, torch
from deepspeed.utils.tensor_fragment import fragment_address
torch.save({"optimizer_state_dict": {
    "single_partition_of_fp32_groups": [torch.arange(10.0)],
    "param_slice_mappings": [{"1.w": fragment_address(numel=4, start=2),
                              "tied_modules.embed.embedding.weight": fragment_address(numel=3, start=6)}],
}}, sys.argv[1])
"""


def test_fragment_address_stand_in(tmp_path):
    """A BF16 optimizer file saved with DeepSpeed's real ``fragment_address`` loads with
    ``weights_only=True`` in a process that never imports DeepSpeed."""
    path = tmp_path / ckpt.optim_file(0, 0, bf16=True)
    subprocess.run([sys.executable, "-c", SAVE_WITH_DEEPSPEED, str(path)], check=True, timeout=300)
    with pytest.raises(Exception, match="fragment_address"):  # refused without the stand-in
        torch.load(path, map_location="cpu", weights_only=True)
    saved = checkpoint_state.load_optimizer_file(path)
    mapping = saved["optimizer_state_dict"]["param_slice_mappings"][0]
    assert isinstance(mapping["1.w"], checkpoint_state.FragmentAddress)
    assert (mapping["1.w"].start, mapping["1.w"].numel) == (2, 4)
    ckpt.write_manifest(tmp_path, 0)  # a checkpoint's files are the ones its manifest lists
    master = checkpoint_state.read_master_weights(tmp_path, lambda name: f"flat.{name}")
    assert master["flat.1.w"].tolist() == [2.0, 3.0, 4.0, 5.0]
    assert master["flat.tied_modules.embed.embedding.weight"].tolist() == [6.0, 7.0, 8.0]


def test_formats_import_no_deepspeed():
    code = (
        "import sys, megatron_branchnorm.formats.checkpoint, megatron_branchnorm.formats.records, "
        "megatron_branchnorm.formats.data_dir, megatron_branchnorm.formats.train_config, "
        "megatron_branchnorm.formats.checkpoint_state; print('deepspeed' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"
