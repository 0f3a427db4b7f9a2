"""Every file a manifest names stays inside its directory: an export's ``export.json``
(``sha256`` keys, and its fixed files), a DATA_DIR's ``manifest.json`` (``spm_model``, the
references, the training binaries). An absolute name, a ``..`` part or a symbolic link leading
out is one line naming the manifest and the key; the outside file is never hashed, read or
scored, and whether it exists never shows."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_branchnorm.commands import evaluate as evaluate_cmd
from megatron_branchnorm.commands import translate as translate_cmd
from megatron_branchnorm.data import dataset as dataset_mod
from megatron_branchnorm.data.indexed_dataset import IndexedDatasetWriter
from megatron_branchnorm.formats import data_dir as data_dir_mod
from megatron_branchnorm.formats.data_dir import DataError, read_data_manifest
from megatron_branchnorm.formats.files import file_inside, name_problem
from megatron_branchnorm.inference import evaluate as evaluate_mod
from megatron_branchnorm.inference import export as export_mod
from megatron_branchnorm.inference.evaluate import references_from_manifest
from megatron_branchnorm.inference.export import ExportError, load_export, save_export
from megatron_branchnorm.model import build_model
from tests.inference.helpers import tiny_config
from tests.inference.test_evaluate import make_data_dir

SECRET_LINES = 7
"""Lines of the outside file: a count that must never appear in a message."""
SECRET_TEXT = "top secret line"


@pytest.fixture
def secret(tmp_path) -> Path:
    """A file outside every directory under test, with a recognisable content."""
    path = tmp_path / "outside" / "secret.txt"
    path.parent.mkdir()
    path.write_text("".join(f"{SECRET_TEXT} {i}\n" for i in range(SECRET_LINES)))
    return path


@pytest.fixture
def touched(monkeypatch) -> list[Path]:
    """Every path hashed or read as lines, references or an indexed dataset (the readers of
    a manifest's names), resolved."""
    seen: list[Path] = []

    def spy(module, name):
        real = getattr(module, name)

        def wrapper(path, *args, **kwargs):
            seen.append(Path(path).resolve())
            return real(path, *args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    spy(export_mod, "sha256_file")
    spy(data_dir_mod, "sha256_file")
    spy(evaluate_mod, "read_lines")
    spy(dataset_mod, "IndexedDataset")
    real_read_text = Path.read_text
    monkeypatch.setattr(
        Path,
        "read_text",
        lambda self, *a, **k: seen.append(self.resolve()) or real_read_text(self, *a, **k),
    )
    return seen


def outside(seen: list[Path], directory: Path) -> list[Path]:
    root = directory.resolve()
    return [p for p in seen if p != root and root not in p.parents]


def check_line(msg: str, *needles: str) -> None:
    """One line naming what it should, quoting nothing of the outside file."""
    assert "\n" not in msg.strip(), msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert SECRET_TEXT not in msg and f"{SECRET_LINES} lines" not in msg, msg
    assert "checksum mismatch" not in msg and "lines but" not in msg, msg


# --------------------------------------------------------------------------------------------
# The shared rule
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["/etc/hostname", "../x", "a/../../x", "a\\b", "", ".", "./", "a\0b", 3, None, ["x"]]
)
def test_name_problem_refuses_what_is_not_a_name_inside(name):
    assert name_problem(name) is not None


@pytest.mark.parametrize("name", ["x", "a/b.txt", "./x", "a/./b", "...idx"])
def test_name_problem_accepts_names_inside(name):
    assert name_problem(name) is None


def test_file_inside_without_a_key_names_the_directory(tmp_path, secret):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "link").symlink_to(secret)
    with pytest.raises(ValueError) as info:
        file_inside(tmp_path / "d", "link", tmp_path / "d", None)
    check_line(str(info.value), "link", "symbolic link", f"in {tmp_path / 'd'}")


# --------------------------------------------------------------------------------------------
# export.json
# --------------------------------------------------------------------------------------------


@pytest.fixture
def export_dir(tmp_path) -> Path:
    return save_export(build_model(tiny_config(), seed=1), tmp_path / "exp")


def set_meta(export: Path, key: str, value) -> None:
    meta = json.loads((export / "export.json").read_text())
    meta[key] = value
    (export / "export.json").write_text(json.dumps(meta))


def add_listed(export: Path, name: str, digest: str = "0" * 64) -> None:
    meta = json.loads((export / "export.json").read_text())
    meta["sha256"][name] = digest
    (export / "export.json").write_text(json.dumps(meta))


OUT_NAMES = ["ABSOLUTE", "ABSOLUTE_MISSING", "../outside/secret.txt", "link", "dirlink/secret.txt"]


def out_name(export: Path, secret: Path, case: str) -> str:
    """The name of ``case`` in ``export``: an absolute path (of the secret, or of nothing),
    ``..``, a link to the secret, a name under a linked directory."""
    if case == "ABSOLUTE":
        return str(secret)
    if case == "ABSOLUTE_MISSING":
        return str(secret.parent / "nothing.txt")
    if case == "link":
        (export / "link").symlink_to(secret)
    if case == "dirlink/secret.txt":
        (export / "dirlink").symlink_to(secret.parent)
    return case


@pytest.mark.parametrize("case", OUT_NAMES)
def test_export_sha256_key_outside_is_refused_unhashed(export_dir, secret, touched, case):
    """A sha256 key naming a file outside the export was hashed ("checksum mismatch") or
    stat'ed ("missing"): an existence oracle for any path of the machine."""
    name = out_name(export_dir, secret, case)
    add_listed(export_dir, name)
    with pytest.raises(ExportError) as info:
        load_export(export_dir)
    check_line(str(info.value), "export.json", "key sha256")
    assert "missing" not in str(info.value)
    assert outside(touched, export_dir) == []


def test_export_outside_name_says_the_same_whether_the_file_exists(export_dir, secret):
    messages = []
    for name in (str(secret), str(secret.parent / "nothing.txt")):
        meta = json.loads((export_dir / "export.json").read_text())
        meta["sha256"] = {name: "0" * 64}
        (export_dir / "export.json").write_text(json.dumps(meta))
        with pytest.raises(ExportError) as info:
            load_export(export_dir)
        messages.append(str(info.value).replace(name, "NAME"))
    assert messages[0] == messages[1]


@pytest.mark.parametrize(
    "value", [["model.safetensors"], "model.safetensors", 42, None, {"model.safetensors": 5}]
)
@pytest.mark.parametrize("verify", [True, False])
def test_export_sha256_of_the_wrong_shape_is_one_line(export_dir, value, verify):
    """A list, string or number was an AttributeError traceback (a string with verify=False
    made ``"spm.model" in sums`` a substring test)."""
    set_meta(export_dir, "sha256", value)
    with pytest.raises(ExportError) as info:
        load_export(export_dir, verify=verify)
    check_line(str(info.value), "export.json", "key sha256")


@pytest.mark.parametrize("name", ["model.safetensors", "config.yaml", "spm.model"])
def test_export_fixed_file_linked_out_is_refused(export_dir, tmp_path, name):
    """model.safetensors, config.yaml or spm.model as a link to a copy outside the export
    were loaded from there (the copy's hash matches what export.json records)."""
    src = export_dir / name
    if name == "spm.model":
        src = tmp_path / "spm.bin"
        src.write_bytes(b"not a model")
    copy = tmp_path / "outside_copy"
    shutil.copyfile(src, copy)
    (export_dir / name).unlink(missing_ok=True)
    (export_dir / name).symlink_to(copy)
    with pytest.raises(ExportError) as info:
        load_export(export_dir, verify=False)
    check_line(str(info.value), str(export_dir / name), "symbolic link")


def test_translate_refuses_an_export_naming_an_outside_file(
    export_dir, secret, touched, monkeypatch, capsys
):
    add_listed(export_dir, str(secret))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"x\n"), encoding="utf-8"))
    argv = ["--model", str(export_dir), "--src-lang", "de", "--tgt-lang", "en", "--quiet"]
    code = translate_cmd.main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "", err
    check_line(err, "error: ", "export.json", "key sha256", "absolute path")
    assert outside(touched, export_dir) == []


# --------------------------------------------------------------------------------------------
# A DATA_DIR's references
# --------------------------------------------------------------------------------------------


def set_reference(data: Path, direction: str, side: str, value) -> None:
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["splits"]["test"]["references"][direction][side] = value
    (data / "manifest.json").write_text(json.dumps(manifest))


def ref_name(data: Path, secret: Path, case: str) -> str:
    if case == "ABSOLUTE":
        return str(secret)
    if case == "ABSOLUTE_MISSING":
        return str(secret.parent / "nothing.txt")
    if case == "../outside/secret.txt":
        return "../outside/secret.txt"  # DATA_DIR is tmp_path/data
    if case == "link":
        (data / "raw" / "link").symlink_to(secret)
        return "raw/link"
    (data / "dirlink").symlink_to(secret.parent)
    return "dirlink/secret.txt"


@pytest.mark.parametrize("side", ["src", "tgt"])
@pytest.mark.parametrize("case", OUT_NAMES)
def test_reference_outside_the_data_dir_is_refused(tmp_path, secret, touched, case, side):
    """A reference named by an absolute or ``..`` path, or through a link, was read and
    scored (evaluate quoted its line count)."""
    data = make_data_dir(tmp_path)
    set_reference(data, "de-en", side, ref_name(data, secret, case))
    key = f"splits.test.references.de-en.{side}"
    with pytest.raises(DataError) as info:
        references_from_manifest(data, "test")
    check_line(str(info.value), key, "manifest.json")
    assert "missing" not in str(info.value)
    assert outside(touched, data) == []


def test_evaluate_refuses_a_reference_outside_the_data_dir(
    tmp_path, export_dir, secret, touched, capsys
):
    data = make_data_dir(tmp_path)
    set_reference(data, "de-en", "tgt", "../outside/secret.txt")
    argv = ["--model", str(export_dir), "--data", str(data), "--split", "test", "--quiet"]
    code = evaluate_cmd.main([*argv, "--directions", "de-en"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", err
    check_line(err, "error: ", "splits.test.references.de-en.tgt", "'..'")
    assert outside(touched, data) == []


@pytest.mark.parametrize("value", [["x"], 3, None, {"src": "raw/test.de-en.de"}])
def test_reference_name_that_is_not_a_string_is_one_line(tmp_path, value):
    data = make_data_dir(tmp_path)
    manifest = json.loads((data / "manifest.json").read_text())
    if isinstance(value, dict):
        manifest["splits"]["test"]["references"]["de-en"] = value  # no tgt
    else:
        manifest["splits"]["test"]["references"]["de-en"]["src"] = value
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError) as info:
        references_from_manifest(data, "test")
    check_line(str(info.value), "manifest.json", "splits.test.references.de-en")


@pytest.mark.parametrize("value", [["a", "b"], "abc", 5, {"src": 5}])
def test_reference_sha256_of_the_wrong_shape_is_one_line(tmp_path, value):
    """A recorded sha256 that is not {src, tgt} digests was silently not checked."""
    data = make_data_dir(tmp_path)
    set_reference(data, "de-en", "sha256", value)
    with pytest.raises(DataError) as info:
        references_from_manifest(data, "test")
    check_line(str(info.value), "manifest.json", "splits.test.references.de-en.sha256")


# --------------------------------------------------------------------------------------------
# A DATA_DIR's training binaries and SentencePiece model
# --------------------------------------------------------------------------------------------


def write_pair(prefix: Path, n: int = 3) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetWriter(prefix) as writer:
        for i in range(n):
            writer.add(np.arange(5, 7 + i))


def train_data_dir(root: Path) -> Path:
    """The smallest DATA_DIR TranslationData opens: one direction de-en of 3 sentences."""
    data = root / "data"
    for lang in ("de", "en"):
        write_pair(data / "bin" / f"train.de-en.{lang}")
    (data / "spm.model").write_bytes(b"spm")
    (data / "raw").mkdir()
    for lang in ("de", "en"):
        (data / "raw" / f"test.{lang}").write_text("a\nb\nc\n")
    refs = {"src": "raw/test.de", "tgt": "raw/test.en"}
    entry = {"src": "bin/train.de-en.de", "tgt": "bin/train.de-en.en", "sentences": 3}
    manifest = {
        "format": "megatron_branchnorm-data",
        "version": 1,
        "vocab_size": 32,
        "languages": ["de", "en"],
        "tag_ids": {"de": 4, "en": 5},
        "spm_model": "spm.model",
        "directions": ["de-en"],
        "splits": {
            "train": {"directions": {"de-en": entry}},
            "test": {"directions": {"de-en": entry}, "references": {"de-en": refs}},
        },
    }
    (data / "manifest.json").write_text(json.dumps(manifest))
    return data


def set_binary(data: Path, side: str, value: str) -> None:
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["splits"]["train"]["directions"]["de-en"][side] = value
    (data / "manifest.json").write_text(json.dumps(manifest))


BIN_CASES = ["ABSOLUTE", "../elsewhere/train", "linked_bin", "linked_idx", "dirlink/train"]


@pytest.mark.parametrize("side", ["src", "tgt"])
@pytest.mark.parametrize("case", BIN_CASES)
def test_training_binary_outside_the_data_dir_is_refused(tmp_path, touched, case, side):
    """A direction's ``.bin``/``.idx`` named by an absolute or ``..`` path, or linked out,
    was trained on."""
    data = train_data_dir(tmp_path)
    elsewhere = tmp_path / "elsewhere" / "train"
    write_pair(elsewhere)  # a valid pair: before, training read it without a word
    value = {
        "ABSOLUTE": str(elsewhere),
        "../elsewhere/train": "../elsewhere/train",
        "dirlink/train": "dirlink/train",
    }.get(case, f"bin/{case}")
    if case == "dirlink/train":
        (data / "dirlink").symlink_to(elsewhere.parent)
    for suffix in (".bin", ".idx"):
        if case.startswith("linked"):
            target = Path(f"{elsewhere}{suffix}")
            link = data / "bin" / f"{case}{suffix}"
            if case.endswith(suffix[1:]):
                link.symlink_to(target)
            else:
                shutil.copyfile(target, link)
    set_binary(data, side, value)
    with pytest.raises(DataError) as info:
        dataset_mod.TranslationData(str(data), "train")
    msg = str(info.value)
    check_line(msg, "manifest.json" if not case.startswith("linked") else "symbolic link")
    assert f"splits.train.directions.de-en.{side}" in msg
    assert outside(touched, data) == []


def test_training_binaries_inside_still_open(tmp_path):
    data = train_data_dir(tmp_path)
    td = dataset_mod.TranslationData(str(data), "train")
    assert td.directions == ["de-en"] and len(td._src[0]) == 3


@pytest.mark.parametrize(
    "case", ["ABSOLUTE", "../outside/secret.txt", "link", "dirlink/secret.txt"]
)
def test_read_references_refuses_a_reference_outside(tmp_path, secret, touched, case):
    """The training side's reader of references (``data.read_references``) read any path."""
    data = train_data_dir(tmp_path)
    assert dataset_mod.read_references(data, "test", "de-en")[1] == ["a", "b", "c"]
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["splits"]["test"]["references"]["de-en"]["tgt"] = ref_name(data, secret, case)
    (data / "manifest.json").write_text(json.dumps(manifest))
    touched.clear()
    with pytest.raises(DataError) as info:
        dataset_mod.read_references(data, "test", "de-en")
    check_line(str(info.value), "manifest.json", "splits.test.references.de-en.tgt")
    assert outside(touched, data) == []


@pytest.mark.parametrize("case", ["link", "../spm.model", "sub/spm.model", "ABSOLUTE", 7])
def test_spm_model_must_be_a_plain_name_and_not_a_link(tmp_path, secret, case):
    """spm_model linked to a file outside was read (trained on, copied into exports)."""
    data = train_data_dir(tmp_path)
    manifest = json.loads((data / "manifest.json").read_text())
    if case == "link":
        (data / "spm.model").unlink()
        (data / "spm.model").symlink_to(secret)
        case = "spm.model"
    manifest["spm_model"] = str(secret) if case == "ABSOLUTE" else case
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError) as info:
        read_data_manifest(data)
    check_line(str(info.value), "spm_model", "manifest.json")
